#!/usr/bin/env bash
# Each header compiles alone (one translation unit per header, included twice to prove its
# guard), and ddp/ddp.hpp compiles with plain `c++ -std=c++20 -Iinclude`, without any optional
# SDK. Headers of optional features get their SDK's flags or are skipped when the SDK is absent.
# Private headers (ddp/detail/, ddp/reducer/detail/) compile alone when the translation unit
# opts in (DDP_ALLOW_DETAIL_HEADERS), and without it each stops with the one line that says to
# include a public header. Each public header compiled below C++20 stops with one error line
# that says ddp needs C++20. Each public header compiles alone in compiled mode
# (DDP_SEPARATE_COMPILATION) as well. The headers are checked side by side, one per core.
#   check_headers.sh INCLUDE_DIR CXX [cuda-flags] [mpi-flags] [tbb-flags] [sodium-flags] [torch-flags] [eigen-flags]
#                    [dlib-flags] [etcd-flags]
set -u
inc=$1; cxx=$2; cuda=${3:-none}; mpi=${4:-none}; tbb=${5:-none}; sodium=${6:-none}; torch=${7:-none}; eigen=${8:-none}
dlib=${9:-none}; etcd=${10:-none}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cd "$inc"

# check_one HEADER: prints PASS, FAIL ... or SKIP ... lines for one header.
check_one() {
  local h=$1 extra="" optin="" dir
  dir=$(mktemp -d -p "$tmp")
  if grep -Eq '#include <(nccl|cuda_runtime)\.h>' "$h"; then extra=$cuda
  elif grep -Eq '#include <mpi\.h>' "$h"; then extra=$mpi
  elif grep -Eq '#include <(oneapi/)?tbb/' "$h"; then extra=$tbb
  elif grep -Eq '#include <sodium' "$h"; then extra=$sodium
  elif grep -Eq '#include <torch/' "$h"; then extra=$torch
  elif grep -Eq '#include <Eigen/' "$h"; then extra=$eigen
  elif grep -Eq '#include <dlib/' "$h"; then extra=$dlib
  elif grep -Eq '#include <(curl/curl\.h|nlohmann/json\.hpp|ddp/group/etcd_store\.hpp)>' "$h"; then extra=$etcd
  fi
  if [[ "$extra" == none ]]; then echo "SKIP $h (SDK not found)"; return; fi
  if [[ $h == */detail/* ]]; then
    optin="-DDDP_ALLOW_DETAIL_HEADERS"
    # Alone, without the opt-in: the private-header check fires, first.
    printf '#include <%s>\n' "$h" > "$dir/alone.cpp"
    $cxx -std=c++20 -E -I. $extra "$dir/alone.cpp" > /dev/null 2> "$dir/err"
    if grep -m1 'error:' "$dir/err" | grep -q 'this header is private to ddp: include <ddp/ddp.hpp>'; then
      echo PASS
    else
      echo "FAIL $h included alone does not stop with the private-header message"
      head -5 "$dir/err"
    fi
  else
    # Below C++20: exactly one error line, the one that says why.
    printf '#include <%s>\nint main() { return 0; }\n' "$h" > "$dir/old.cpp"
    $cxx -std=c++17 -fsyntax-only -I. $extra "$dir/old.cpp" > /dev/null 2> "$dir/err"
    if [[ $(grep -c 'error:' "$dir/err") -eq 1 ]] && grep -q 'ddp needs C++20: compile with -std=c++20 or later' "$dir/err"; then
      echo PASS
    else
      echo "FAIL $h with -std=c++17 does not stop with one line saying ddp needs C++20"
      grep 'error:' "$dir/err" | head -5
    fi
  fi
  printf '#include <%s>\n#include <%s>\nint main() { return 0; }\n' "$h" "$h" > "$dir/tu.cpp"
  if $cxx -std=c++20 -Wall -Wextra -Wpedantic -Werror -fsyntax-only -I. $optin $extra "$dir/tu.cpp" 2> "$dir/err"; then
    echo PASS
  else
    echo "FAIL $h"; head -20 "$dir/err"
  fi
  # A public header compiles alone in compiled mode too, where the headers only declare the
  # non-template code (detail/compiled.hpp) and the umbrella stops at the default path.
  if [[ $h != */detail/* ]]; then
    if $cxx -std=c++20 -Wall -Wextra -Wpedantic -Werror -fsyntax-only -I. -DDDP_SEPARATE_COMPILATION $extra \
      "$dir/tu.cpp" 2> "$dir/err"; then
      echo PASS
    else
      echo "FAIL $h with DDP_SEPARATE_COMPILATION"; head -20 "$dir/err"
    fi
  fi
}
export -f check_one
export tmp cxx cuda mpi tbb sodium torch eigen dlib etcd
# One output file per header, printed in order once all are done.
find ddp -name '*.hpp' | sort | awk '{ printf "%s %04d\n", $0, NR }' |
  xargs -P "$(nproc)" -L 1 bash -c 'check_one "$0" > "$tmp/out.$1" 2>&1'
cat "$tmp"/out.* > "$tmp/all"
pass=$(grep -c '^PASS$' "$tmp/all"); fail=$(grep -c '^FAIL' "$tmp/all"); skip=$(grep -c '^SKIP' "$tmp/all")
grep -v '^PASS$' "$tmp/all"
# The umbrella must not pull in optional SDKs.
if grep -Eq '#\s*include\s*<(nccl|cuda_runtime|mpi)\.h>|#\s*include\s*<((oneapi/)?tbb|torch|Eigen|dlib|curl|nlohmann)/' ddp/ddp.hpp; then
  fail=$((fail + 1)); echo "FAIL ddp/ddp.hpp includes an optional SDK header"
else
  pass=$((pass + 1))
fi
# Every header was checked: one output file each.
headers=$(find ddp -name '*.hpp' | wc -l); outs=$(ls "$tmp"/out.* | wc -l)
if [[ $outs -ne $headers ]]; then fail=$((fail + 1)); echo "FAIL only $outs of $headers headers were checked"; fi
echo "$pass passed, $fail failed, $skip skipped"
[[ $fail -eq 0 ]]
