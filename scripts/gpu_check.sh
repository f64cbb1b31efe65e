#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on a machine with a CUDA device, in one command and within 8
# minutes, configure a build with CUDA, NCCL and the LibTorch of the machine's PyTorch, build
# only what the check needs, run the GPU tests and the GPU benchmark, and print one summary.
#
#   scripts/gpu_check.sh [--dry-run] [--build-dir DIR] [--skip-bench] [--only PART] [-j N] [--help]
#
# Parts: allocators (tests/cuda/test_cuda_check.cpp, test_cuda_allocator.cpp), nccl
# (test_nccl.cpp), wrapper (test_cuda_data_parallel.cpp), shared (test_cuda_shared_gpu.cpp),
# torch (tests/cuda/test_libtorch_cuda.cpp), bench (bench/gpu_reduce.cpp).
#
# Where things are found, first match wins:
#   CUDA    $CUDA_HOME, $CUDA_PATH, the toolkit of the nvcc on PATH, /usr/local/cuda, then the
#           pip wheels (site-packages/nvidia/cu13, nvidia/cuda_runtime) of the Python below
#   NCCL    $NCCL_HOME, the pip wheel (site-packages/nvidia/nccl), the CUDA root, /usr
#   LibTorch $TORCH_PREFIX, else the package directory of `import torch` (-Dtorch_prefix),
#           or, where Python has none, a system LibTorch under /usr (Debian's libtorch-dev)
#   Python  $PYTHON, else python3 on PATH; its sys.path is searched for the wheels
#   doctest tests/vendor/doctest (-Dcmake_prefix_path), so no doctest package is needed
# DDP_GPU_CHECK_CUDA_DIRS and DDP_GPU_CHECK_NCCL_DIRS replace the fixed places (/usr/local/cuda;
# /usr), and DDP_GPU_CHECK_NO_SYSTEM_TORCH=1 ignores /usr's LibTorch: tests/scripts/
# test_gpu_check.sh uses them to reach a fake layout on any machine.
# CUDA and NCCL may sit in different trees, and a wheel has only versioned libraries
# (libnccl.so.2): the build gets one prefix of links to both, <build>/gpu-prefix, for Meson's
# -Dcudatoolkit.
#
# Summary and logs go to $OUT when it is set (the device runner returns what is written there),
# else to build-gpu-check/. Exit status: 0 when nothing failed, 1 when a part failed, 2 for bad
# arguments. Every step runs under `timeout`, within one budget of 8 minutes.
set -uo pipefail

me=gpu_check.sh
root=$(cd "$(dirname "$0")/.." && pwd)
parts_all=(allocators nccl wrapper shared torch bench)
budget_s=${DDP_GPU_CHECK_BUDGET:-480}

usage() {
  cat <<EOF
usage: scripts/gpu_check.sh [--dry-run] [--build-dir DIR] [--skip-bench] [--only PART] [-j N] [--help]

Configures a build with CUDA, NCCL and LibTorch found where this machine keeps them, builds what
the GPU check needs, runs the GPU tests and benchmark, and prints one summary (docs/gpu.md).

  --dry-run         print what would be found, configured, built and run; change nothing
  --build-dir DIR   the build directory (default build-gpu-check/build)
  --skip-bench      leave the benchmark out
  --only PART       configure, then build and run one part: ${parts_all[*]}
  -j, --jobs N      ninja's parallel jobs (default: ninja's own)
  --help            this text

Summary and logs: \$OUT when set, else build-gpu-check/. Environment: CUDA_HOME, CUDA_PATH,
NCCL_HOME, TORCH_PREFIX, PYTHON (see the head of this script).
EOF
}

bad() {
  echo "$me: $1 (see --help)" >&2
  exit 2
}

dry_run=0
skip_bench=0
only=""
jobs=""
build=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --dry-run) dry_run=1 ;;
    --skip-bench) skip_bench=1 ;;
    --help | -h) usage; exit 0 ;;
    --build-dir | --only | -j | --jobs)
      [[ $# -ge 2 && -n $2 ]] || bad "$1 needs a value"
      case $1 in
        --build-dir) build=$2 ;;
        --only) only=$2 ;;
        *) jobs=$2 ;;
      esac
      shift ;;
    --build-dir=* ) build=${1#*=}; [[ -n $build ]] || bad "--build-dir needs a value" ;;
    --only=*) only=${1#*=} ;;
    --jobs=*) jobs=${1#*=} ;;
    *) bad "unknown argument '$1'" ;;
  esac
  shift
done
if [[ -n $only ]]; then
  known=0
  for p in "${parts_all[@]}"; do [[ $p == "$only" ]] && known=1; done
  [[ $known == 1 ]] || bad "unknown part '$only' (parts: ${parts_all[*]})"
  [[ $only == bench && $skip_bench == 1 ]] && bad "--only bench and --skip-bench exclude each other"
fi
[[ -z $jobs || $jobs =~ ^[1-9][0-9]*$ ]] || bad "-j needs a positive number, not '$jobs'"

out=${OUT:-$root/build-gpu-check}
[[ -n $build ]] || build=$root/build-gpu-check/build
[[ $build == /* ]] || build=$PWD/$build
cd "$root" || exit 1

# ---- discovery ------------------------------------------------------------------------------
python=${PYTHON:-$(command -v python3 || true)}
site_dirs=()
if [[ -n $python ]] && command -v "$python" >/dev/null 2>&1; then
  mapfile -t site_dirs < <("$python" -c 'import sys; print("\n".join(p for p in sys.path if p))' 2>/dev/null)
else
  python=""
fi

# meson, ninja and cmake from pip sit beside the interpreter (or in its user base), which may not
# be on PATH: their directory is added when a tool is missing.
for tool in meson ninja cmake; do
  command -v $tool >/dev/null 2>&1 && continue
  [[ -n $python ]] || break
  for d in "$(dirname "$(readlink -f "$(command -v "$python")")")" "$("$python" -m site --user-base 2>/dev/null)/bin"; do
    if [[ -x $d/$tool ]]; then PATH=$d:$PATH; break; fi
  done
done

has_lib() {  # has_lib DIR NAME: DIR holds libNAME.so or libNAME.so.*
  compgen -G "$1/lib$2.so" >/dev/null || compgen -G "$1/lib$2.so.*" >/dev/null
}
lib_dir_of() {  # lib_dir_of ROOT NAME: the first of ROOT/lib64, ROOT/lib, ROOT/lib/<triplet> with libNAME
  local d
  for d in "$1/lib64" "$1/lib" "$1/lib/x86_64-linux-gnu" "$1/targets/x86_64-linux/lib"; do
    if has_lib "$d" "$2"; then echo "$d"; return 0; fi
  done
  return 1
}

cuda_root="" cuda_from="" cuda_lib=""
cuda_try() {  # cuda_try DIR WHY
  [[ -z $cuda_root && -n $1 && -f $1/include/cuda_runtime.h ]] || return 0
  local l
  l=$(lib_dir_of "$1" cudart) || return 0
  cuda_root=$1 cuda_from=$2 cuda_lib=$l
}
cuda_try "${CUDA_HOME:-}" "CUDA_HOME"
cuda_try "${CUDA_PATH:-}" "CUDA_PATH"
if nvcc=$(command -v nvcc 2>/dev/null); then cuda_try "$(cd "$(dirname "$nvcc")/.." && pwd)" "nvcc on PATH ($nvcc)"; fi
for d in ${DDP_GPU_CHECK_CUDA_DIRS-/usr/local/cuda}; do cuda_try "$d" "$d"; done
for sp in "${site_dirs[@]}"; do
  cuda_try "$sp/nvidia/cu13" "pip wheel in $sp"
  cuda_try "$sp/nvidia/cuda_runtime" "pip wheel in $sp"
done

nccl_root="" nccl_from="" nccl_lib=""
nccl_try() {
  [[ -z $nccl_root && -n $1 && -f $1/include/nccl.h ]] || return 0
  local l
  l=$(lib_dir_of "$1" nccl) || return 0
  nccl_root=$1 nccl_from=$2 nccl_lib=$l
}
nccl_try "${NCCL_HOME:-}" "NCCL_HOME"
for sp in "${site_dirs[@]}"; do nccl_try "$sp/nvidia/nccl" "pip wheel in $sp"; done
nccl_try "$cuda_root" "the CUDA root"
for d in ${DDP_GPU_CHECK_NCCL_DIRS-/usr}; do nccl_try "$d" "$d"; done

torch_prefix="" torch_from=""
if [[ -n ${TORCH_PREFIX:-} ]]; then
  torch_prefix=$TORCH_PREFIX torch_from="TORCH_PREFIX"
elif [[ -n $python ]]; then
  torch_prefix=$("$python" -c 'import torch, os; print(os.path.dirname(torch.__file__))' 2>/dev/null | tail -n 1)
  torch_from="$python -c 'import torch'"
fi
if [[ -n $torch_prefix && ! -f $torch_prefix/include/torch/csrc/api/include/torch/torch.h ]]; then
  torch_from="$torch_from; no include/torch/csrc/api/include/torch/torch.h under $torch_prefix"
  torch_prefix=""
fi
# A distribution's LibTorch (Debian's libtorch-dev) where Python has none: Meson's default.
if [[ -z $torch_prefix && -f /usr/include/torch/csrc/api/include/torch/torch.h && -z ${DDP_GPU_CHECK_NO_SYSTEM_TORCH:-} ]]; then
  torch_prefix=/usr torch_from="/usr/include/torch (a system LibTorch)"
fi

doctest_prefix=$root/tests/vendor/doctest
prefix=$build/gpu-prefix

# ---- the plan -------------------------------------------------------------------------------
declare -A part_targets=(
  [allocators]="tests/cuda/cuda_check tests/cuda/cuda_allocator"
  [nccl]="tests/cuda/nccl_reducer"
  [wrapper]="tests/cuda/cuda_data_parallel"
  [shared]="tests/cuda/cuda_shared_gpu"
  [torch]="tests/cuda/torch_libtorch_cuda"
  [bench]="bench/gpu_reduce"
)
declare -A limit_s=(  # seconds each program may run
  [tests/cuda/cuda_check]=60 [tests/cuda/cuda_allocator]=60 [tests/cuda/nccl_reducer]=120
  [tests/cuda/cuda_data_parallel]=120 [tests/cuda/cuda_shared_gpu]=180
  [tests/cuda/torch_libtorch_cuda]=180 [bench/gpu_reduce]=150
)
why_not() {  # why_not PART: why PART is left out (nothing: it runs)
  if [[ -n $only && $1 != "$only" ]]; then echo "--only $only"
  elif [[ $1 == bench && $skip_bench == 1 ]]; then echo "--skip-bench"
  elif [[ $1 == torch && -z $torch_prefix ]]; then echo "no LibTorch"
  fi
}
parts=()
for p in "${parts_all[@]}"; do [[ -z $(why_not "$p") ]] && parts+=("$p"); done
targets=()
for p in "${parts[@]}"; do read -ra t <<<"${part_targets[$p]}"; targets+=("${t[@]}"); done

setup_opts=(--wrap-mode=nodownload --buildtype=release -Dcudatoolkit="$prefix" -Dcuda=enabled -Dnccl=enabled
            -Dcmake_prefix_path="$doctest_prefix" -Dtests=enabled -Dbench=enabled -Dexamples=disabled
            -Ddocs=disabled -Dtbb=disabled -Dmpi=disabled -Deigen=disabled -Ddlib=disabled -Dauth=disabled
            -Dbench_optimization=build)
if [[ -n $torch_prefix ]]; then
  setup_opts+=(-Dtorch=enabled -Dtorch_prefix="${torch_prefix#/usr}")  # /usr: Meson's default, ""
else
  setup_opts+=(-Dtorch=disabled)
fi
ninja_cmd=(ninja -C "$build")
[[ -n $jobs ]] && ninja_cmd+=(-j "$jobs")

show() { printf '  %-10s %s\n' "$1" "$2"; }
print_plan() {
  echo "$me: plan"
  show output "$out (summary.txt, logs/)"
  show "build dir" "$build"
  show python "${python:-not found}"
  show cuda "${cuda_root:-not found} ${cuda_root:+(from $cuda_from; libcudart in $cuda_lib)}"
  show nccl "${nccl_root:-not found} ${nccl_root:+(from $nccl_from; libnccl in $nccl_lib)}"
  if [[ -n $torch_prefix ]]; then
    show torch "$torch_prefix (from $torch_from)"
  else
    show torch "not found${torch_from:+ ($torch_from)}: the torch part is left out"
  fi
  show doctest "$doctest_prefix (vendored, -Dcmake_prefix_path)"
  local tl="" tool
  for tool in meson ninja cmake; do tl+="$tool $(command -v $tool || echo 'not found'); "; done
  show tools "${tl%; }"
  show prefix "$prefix: include and lib64 with links to CUDA's and NCCL's headers and libraries"
  echo "configure: meson setup $build ${setup_opts[*]}"
  echo "build: ${ninja_cmd[*]} ${targets[*]}"
  for p in "${parts_all[@]}"; do
    local why
    why=$(why_not "$p")
    if [[ -n $why ]]; then
      printf 'run: %-10s not run (%s)\n' "$p" "$why"
    else
      for t in ${part_targets[$p]}; do printf 'run: %-10s %s (limit %s s)\n' "$p" "$build/$t" "${limit_s[$t]}"; done
    fi
  done
  echo "budget: $budget_s s in all"
}

if [[ $dry_run == 1 ]]; then
  print_plan
  echo "$me: dry run: nothing was configured, built or run"
  exit 0
fi

# ---- run ------------------------------------------------------------------------------------
mkdir -p "$out/logs" || { echo "$me: cannot create $out/logs" >&2; exit 1; }
summary=$out/summary.txt
: >"$summary"
t_start=$SECONDS
rows=()
failed=0
row() {  # row PART WHAT STATUS SECONDS [NOTE]
  rows+=("$(printf '%-11s %-34s %-6s %6s s  %s' "$1" "$2" "$3" "$4" "${5:-}")")
  [[ $3 == fail ]] && failed=1
  return 0
}
left() { echo $((budget_s - (SECONDS - t_start))); }
# run_step LIMIT LOG CMD...: the command under timeout, bounded by what is left of the budget;
# sets step_rc (124: timed out) and step_s.
run_step() {
  local limit=$1 log=$2 room
  shift 2
  room=$(($(left) - 5))
  ((limit > room)) && limit=$room
  if ((limit < 5)); then
    step_rc=125 step_s=0
    echo "$me: not run, the time budget is spent" >"$log"
    return
  fi
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$log" 2>&1
  step_rc=$?
  step_s=$((SECONDS - t0))
  ((step_rc == 137)) && step_rc=124
  step_limit=$limit
}
finish() {
  {
    echo "GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname)"
    command -v nvidia-smi >/dev/null 2>&1 &&
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
    echo "cuda: ${cuda_root:-not found}; nccl: ${nccl_root:-not found}; torch: ${torch_prefix:-not found}"
    echo
    printf '%-11s %-34s %-6s %8s  %s\n' part what status time note
    printf '%s\n' "${rows[@]}"
    if [[ -f $out/logs/bench.log ]] && grep -q '^result ' "$out/logs/bench.log"; then
      echo
      echo "benchmark (bench/gpu_reduce; targets: nccl_reducer within 3% of ncclAllReduce at >= 64 MiB,"
      echo "pack at >= 80% of one D2D copy's bandwidth):"
      grep -v '^result ' "$out/logs/bench.log" | sed 's/^/  /'
      echo
      grep '^result ' "$out/logs/bench.log" | sed 's/^result /  result: /'
    fi
    echo
    echo "total $((SECONDS - t_start)) s; logs in $out/logs"
    [[ $failed == 0 ]] && echo "GPU check: nothing failed" || echo "GPU check: FAILED (see the rows marked fail and their logs)"
  } | tee "$summary"
  exit "$failed"
}

print_plan >"$out/logs/plan.log"
missing=""
[[ -z $cuda_root ]] && missing+=" CUDA (cuda_runtime.h and libcudart)"
[[ -z $nccl_root ]] && missing+=" NCCL (nccl.h and libnccl)"
for tool in meson ninja cmake timeout; do command -v $tool >/dev/null 2>&1 || missing+=" $tool"; done
if [[ -n $missing ]]; then
  row find "CUDA, NCCL, LibTorch, tools" fail 0 "not found:$missing (logs/plan.log)"
  finish
fi
row find "CUDA, NCCL, LibTorch, tools" pass 0 "cuda $cuda_root; nccl $nccl_root"

# The prefix of links for -Dcudatoolkit: CUDA's headers with nccl.h beside them, libcudart and
# libnccl (each also under its unversioned name, which the linker looks for).
link_prefix() {
  rm -rf "$prefix" && mkdir -p "$prefix/include" "$prefix/lib64" || return 1
  local f base
  for f in "$cuda_root"/include/*; do ln -sfn "$f" "$prefix/include/" || return 1; done
  for f in "$nccl_root"/include/nccl*.h; do ln -sfn "$f" "$prefix/include/" || return 1; done
  for f in "$cuda_lib"/libcudart.so* "$nccl_lib"/libnccl.so*; do ln -sfn "$f" "$prefix/lib64/" || return 1; done
  for base in cudart nccl; do
    if [[ ! -e $prefix/lib64/lib$base.so ]]; then
      f=$(compgen -G "$prefix/lib64/lib$base.so.*" | sort | head -n 1)
      ln -sfn "$(basename "$f")" "$prefix/lib64/lib$base.so" || return 1
    fi
  done
}
mkdir -p "$build" || { row configure "meson setup" fail 0 "cannot create $build"; finish; }
if ! link_prefix >"$out/logs/prefix.log" 2>&1; then
  row configure "links in $prefix" fail 0 "logs/prefix.log"
  finish
fi
ls -l "$prefix/include/nccl.h" "$prefix/lib64" >>"$out/logs/prefix.log" 2>&1

# ---- configure and build --------------------------------------------------------------------
if [[ -f $build/build.ninja ]]; then
  run_step 120 "$out/logs/configure.log" meson setup --reconfigure "$build" "${setup_opts[@]}"
else
  run_step 120 "$out/logs/configure.log" meson setup "$build" "${setup_opts[@]}"
fi
if ((step_rc != 0)); then
  note="logs/configure.log"
  ((step_rc == 124)) && note="timed out after $step_limit s; $note"
  row configure "meson setup" fail "$step_s" "$note"
  finish
fi
row configure "meson setup" pass "$step_s"

run_step 300 "$out/logs/build.log" "${ninja_cmd[@]}" "${targets[@]}"
if ((step_rc != 0)); then
  note="logs/build.log"
  ((step_rc == 124)) && note="timed out after $step_limit s; $note"
  row build "${#targets[@]} targets" fail "$step_s" "$note: $(grep -m1 -E 'error|FAILED' "$out/logs/build.log" | cut -c1-120)"
  finish
fi
row build "${#targets[@]} targets" pass "$step_s"

# ---- tests and benchmark --------------------------------------------------------------------
for p in "${parts_all[@]}"; do
  why=$(why_not "$p")
  if [[ $why == --only* ]]; then continue; fi
  if [[ -n $why ]]; then
    [[ $p == torch && -n $torch_from ]] && why+=": $torch_from"
    row "$p" "${part_targets[$p]}" skip 0 "$why"
    continue
  fi
  for t in ${part_targets[$p]}; do
    name=$(basename "$t")
    log=$out/logs/$name.log
    [[ $p == bench ]] && log=$out/logs/bench.log
    run_step "${limit_s[$t]}" "$log" "$build/$t"
    case $step_rc in
      0) row "$p" "$name" pass "$step_s" ;;
      77) row "$p" "$name" skip "$step_s" "$(tail -n 1 "$log" | cut -c1-90)" ;;
      124) row "$p" "$name" fail "$step_s" "timed out after $step_limit s; logs/$(basename "$log")" ;;
      125) row "$p" "$name" fail 0 "not run: the 8-minute budget was spent" ;;
      *) row "$p" "$name" fail "$step_s" "exit $step_rc; logs/$(basename "$log")" ;;
    esac
  done
done
# A benchmark figure that misses its target is a finding, not a failure of the check: the
# summary shows it beside the figure.
finish
