#!/usr/bin/env bash
# scripts/gpu_check.sh without a GPU: its arguments, its --dry-run plan on this machine, its
# discovery in a fake layout (a CUDA toolkit behind an nvcc on PATH, NCCL and torch in a fake
# site-packages tree), and a real run on that layout, which must link the prefix, fail at
# configure (the libraries are empty files), say so in its summary and exit 1.
#   test_gpu_check.sh SCRIPT
set -uo pipefail
script=${1:?usage: test_gpu_check.sh path/to/gpu_check.sh}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
expect() {  # expect WHAT TEXT NEEDLE
  grep -qF -- "$3" <<<"$2" || fail "$1: no '$3' in:"$'\n'"$2"
}

# ---- arguments --------------------------------------------------------------------------------
out=$("$script" --help 2>&1); rc=$?
[[ $rc == 0 ]] || fail "--help exits $rc"
expect "--help" "$out" "usage: scripts/gpu_check.sh"
expect "--help" "$out" "allocators nccl wrapper shared torch bench"

check_bad() {  # check_bad MESSAGE ARGS...
  local msg=$1 out rc
  shift
  out=$("$script" "$@" 2>&1); rc=$?
  [[ $rc == 2 ]] || fail "'$*' exits $rc, not 2"
  expect "'$*'" "$out" "$msg"
}
check_bad "unknown argument '--frobnicate'" --frobnicate
check_bad "unknown part 'gpus'" --only gpus
check_bad "--build-dir needs a value" --build-dir
check_bad "--only needs a value" --dry-run --only
check_bad "-j needs a positive number, not 'x'" -j x
check_bad "--only bench and --skip-bench exclude each other" --only bench --skip-bench

# ---- --dry-run here: what this machine has, nothing created ---------------------------------
out=$(OUT="$tmp/here-out" "$script" --dry-run --build-dir "$tmp/here-build" 2>&1); rc=$?
[[ $rc == 0 ]] || fail "--dry-run exits $rc"
expect "dry run" "$out" "dry run: nothing was configured, built or run"
for t in tests/cuda/cuda_check tests/cuda/cuda_allocator tests/cuda/nccl_reducer tests/cuda/cuda_data_parallel \
         tests/cuda/cuda_shared_gpu bench/gpu_reduce; do
  expect "dry run's build line" "$(grep '^build: ' <<<"$out")" "$t"
done
expect "dry run" "$out" "output     $tmp/here-out (summary.txt, logs/)"
expect "dry run" "$out" "-Dcudatoolkit=$tmp/here-build/gpu-prefix"
expect "dry run" "$out" "-Dcmake_prefix_path="
cuda=$(sed -n 's/^  cuda  *\([^ ]*\) (from.*/\1/p' <<<"$out")
nccl=$(sed -n 's/^  nccl  *\([^ ]*\) (from.*/\1/p' <<<"$out")
if [[ -n $cuda ]]; then
  [[ -f $cuda/include/cuda_runtime.h ]] || fail "dry run's cuda '$cuda' has no include/cuda_runtime.h"
else
  expect "dry run" "$out" "cuda       not found"
fi
if [[ -n $nccl ]]; then
  [[ -f $nccl/include/nccl.h ]] || fail "dry run's nccl '$nccl' has no include/nccl.h"
fi
doctest=$(sed -n 's/^  doctest  *\([^ ]*\) .*/\1/p' <<<"$out")
[[ -f $doctest/include/doctest/doctest.h && -f $doctest/lib/cmake/doctest/doctestConfig.cmake ]] ||
  fail "dry run's doctest '$doctest' has no header or CMake config"
[[ ! -e $tmp/here-out && ! -e $tmp/here-build ]] || fail "--dry-run created files"
out=$("$script" --dry-run --only nccl --skip-bench 2>&1)
expect "--only nccl" "$(grep '^build: ' <<<"$out")" "tests/cuda/nccl_reducer"
grep '^build: ' <<<"$out" | grep -q 'cuda_shared_gpu\|gpu_reduce' && fail "--only nccl builds other parts"
expect "--only nccl" "$out" "run: shared     not run (--only nccl)"

# ---- a fake layout: nvcc's toolkit, NCCL and torch in site-packages ---------------------------
mkdir -p "$tmp/cuda/bin" "$tmp/cuda/include" "$tmp/cuda/lib64" "$tmp/site/nvidia/nccl/include" \
         "$tmp/site/nvidia/nccl/lib" "$tmp/site/torch/include/torch/csrc/api/include/torch" "$tmp/bin"
printf '#!/bin/sh\necho "nvcc: fake"\n' >"$tmp/cuda/bin/nvcc"
chmod +x "$tmp/cuda/bin/nvcc"
touch "$tmp/cuda/include/cuda_runtime.h" "$tmp/cuda/lib64/libcudart.so.13" "$tmp/site/nvidia/nccl/include/nccl.h" \
      "$tmp/site/nvidia/nccl/lib/libnccl.so.2" "$tmp/site/torch/__init__.py" \
      "$tmp/site/torch/include/torch/csrc/api/include/torch/torch.h"
fake_env=(env -u CUDA_HOME -u CUDA_PATH -u NCCL_HOME -u TORCH_PREFIX -u PYTHON PATH="$tmp/cuda/bin:$PATH"
          PYTHONPATH="$tmp/site" DDP_GPU_CHECK_CUDA_DIRS= DDP_GPU_CHECK_NCCL_DIRS= DDP_GPU_CHECK_NO_SYSTEM_TORCH=1
          OUT="$tmp/out")
out=$("${fake_env[@]}" "$script" --dry-run --build-dir "$tmp/b" 2>&1); rc=$?
[[ $rc == 0 ]] || fail "fake layout: --dry-run exits $rc"
expect "fake layout" "$out" "cuda       $tmp/cuda (from nvcc on PATH ($tmp/cuda/bin/nvcc); libcudart in $tmp/cuda/lib64)"
expect "fake layout" "$out" "nccl       $tmp/site/nvidia/nccl (from pip wheel in $tmp/site; libnccl in $tmp/site/nvidia/nccl/lib)"
expect "fake layout" "$out" "torch      $tmp/site/torch (from "
expect "fake layout" "$out" "-Dtorch=enabled -Dtorch_prefix=$tmp/site/torch"
expect "fake layout" "$out" "tests/cuda/torch_libtorch_cuda"
expect "fake layout" "$out" "output     $tmp/out (summary.txt, logs/)"

# CUDA_HOME and NCCL_HOME come first; torch without its headers is left out.
mkdir -p "$tmp/cuda2/include" "$tmp/cuda2/lib" "$tmp/nccl2/include" "$tmp/nccl2/lib64"
touch "$tmp/cuda2/include/cuda_runtime.h" "$tmp/cuda2/lib/libcudart.so" "$tmp/nccl2/include/nccl.h" "$tmp/nccl2/lib64/libnccl.so"
rm -r "$tmp/site/torch/include"
out=$("${fake_env[@]}" CUDA_HOME="$tmp/cuda2" NCCL_HOME="$tmp/nccl2" "$script" --dry-run --build-dir "$tmp/b" 2>&1)
expect "CUDA_HOME" "$out" "cuda       $tmp/cuda2 (from CUDA_HOME; libcudart in $tmp/cuda2/lib)"
expect "NCCL_HOME" "$out" "nccl       $tmp/nccl2 (from NCCL_HOME; libnccl in $tmp/nccl2/lib64)"
expect "torch without headers" "$out" "the torch part is left out"
expect "torch without headers" "$out" "-Dtorch=disabled"
expect "torch without headers" "$out" "run: torch      not run (no LibTorch)"

# CUDA from the pip wheel alone (no toolkit anywhere: PATH without an nvcc), NCCL not at all: a
# real run stops at discovery, names what is missing, writes its summary and exits 1.
no_nvcc=$(tr ':' '\n' <<<"$PATH" | while read -r d; do [[ -x $d/nvcc ]] || echo "$d"; done | paste -sd:)
mkdir -p "$tmp/site/nvidia/cu13/include" "$tmp/site/nvidia/cu13/lib"
touch "$tmp/site/nvidia/cu13/include/cuda_runtime.h" "$tmp/site/nvidia/cu13/lib/libcudart.so.13"
rm -r "$tmp/site/nvidia/nccl"
out=$("${fake_env[@]}" PATH="$no_nvcc" "$script" --dry-run --build-dir "$tmp/b" 2>&1)
expect "CUDA from the wheel" "$out" "cuda       $tmp/site/nvidia/cu13 (from pip wheel in $tmp/site; libcudart in $tmp/site/nvidia/cu13/lib)"
expect "no NCCL" "$out" "nccl       not found"
out=$("${fake_env[@]}" PATH="$no_nvcc" "$script" --build-dir "$tmp/b" --skip-bench 2>&1); rc=$?
[[ $rc == 1 ]] || fail "a run without NCCL exits $rc, not 1"
expect "a run without NCCL" "$out" "not found: NCCL (nccl.h and libnccl)"
expect "a run without NCCL" "$(cat "$tmp/out/summary.txt" 2>/dev/null)" "GPU check: FAILED"

# Everything found (fake), a real run: the prefix of links, then meson refuses the empty
# libraries; the summary names the configure step and the run exits 1, without a hang.
mkdir -p "$tmp/site/nvidia/nccl/include" "$tmp/site/nvidia/nccl/lib"
touch "$tmp/site/nvidia/nccl/include/nccl.h" "$tmp/site/nvidia/nccl/lib/libnccl.so.2"
rm -rf "$tmp/out"
out=$("${fake_env[@]}" "$script" --build-dir "$tmp/b" --only nccl 2>&1); rc=$?
[[ $rc == 1 ]] || fail "a run on the fake layout exits $rc, not 1"
for f in include/cuda_runtime.h include/nccl.h lib64/libcudart.so.13 lib64/libnccl.so.2; do
  [[ -L $tmp/b/gpu-prefix/$f ]] || fail "the prefix has no link $f"
done
[[ $(readlink "$tmp/b/gpu-prefix/lib64/libnccl.so") == libnccl.so.2 ]] || fail "libnccl.so does not lead to libnccl.so.2"
[[ $(readlink "$tmp/b/gpu-prefix/lib64/libcudart.so") == libcudart.so.13 ]] || fail "libcudart.so does not lead to libcudart.so.13"
summary=$(cat "$tmp/out/summary.txt" 2>/dev/null)
expect "summary" "$summary" "configure   meson setup"
expect "summary" "$summary" "fail"
expect "summary" "$summary" "GPU check: FAILED"
[[ -s $tmp/out/logs/configure.log && -s $tmp/out/logs/plan.log ]] || fail "no configure or plan log"

if ((fails > 0)); then
  echo "$fails check(s) failed"
  exit 1
fi
echo "gpu_check.sh: arguments, dry run, discovery and failure reporting as expected"
