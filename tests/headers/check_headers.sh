#!/usr/bin/env bash
# Each header compiles alone (one translation unit per header, included twice to prove its
# guard), and ddp/ddp.hpp compiles with plain `c++ -std=c++20 -Iinclude`, without any optional
# SDK. Headers of optional features get their SDK's flags or are skipped when the SDK is absent.
# Private headers (ddp/detail/, ddp/reducer/detail/) compile alone when the translation unit
# opts in (DDP_ALLOW_DETAIL_HEADERS), and without it each stops with the one line that says to
# include a public header. Each public header compiled below C++20 stops with one error line
# that says ddp needs C++20.
#   check_headers.sh INCLUDE_DIR CXX [cuda-flags] [mpi-flags] [tbb-flags] [sodium-flags] [torch-flags] [eigen-flags]
set -u
inc=$1; cxx=$2; cuda=${3:-none}; mpi=${4:-none}; tbb=${5:-none}; sodium=${6:-none}; torch=${7:-none}; eigen=${8:-none}
pass=0; fail=0; skip=0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cd "$inc"
for h in $(find ddp -name '*.hpp' | sort); do
  extra=""
  if grep -Eq '#include <(nccl|cuda_runtime)\.h>' "$h"; then extra=$cuda
  elif grep -Eq '#include <mpi\.h>' "$h"; then extra=$mpi
  elif grep -Eq '#include <(oneapi/)?tbb/' "$h"; then extra=$tbb
  elif grep -Eq '#include <sodium' "$h"; then extra=$sodium
  elif grep -Eq '#include <torch/' "$h"; then extra=$torch
  elif grep -Eq '#include <Eigen/' "$h"; then extra=$eigen
  fi
  if [[ "$extra" == none ]]; then skip=$((skip + 1)); echo "SKIP $h (SDK not found)"; continue; fi
  optin=""
  if [[ $h == */detail/* ]]; then
    optin="-DDDP_ALLOW_DETAIL_HEADERS"
    # Alone, without the opt-in: the private-header check fires, first.
    printf '#include <%s>\n' "$h" > "$tmp/alone.cpp"
    $cxx -std=c++20 -E -I. $extra "$tmp/alone.cpp" > /dev/null 2> "$tmp/err"
    if grep -m1 'error:' "$tmp/err" | grep -q 'this header is private to ddp: include <ddp/ddp.hpp>'; then
      pass=$((pass + 1))
    else
      fail=$((fail + 1)); echo "FAIL $h included alone does not stop with the private-header message"
      head -5 "$tmp/err"
    fi
  else
    # Below C++20: exactly one error line, the one that says why.
    printf '#include <%s>\nint main() { return 0; }\n' "$h" > "$tmp/old.cpp"
    $cxx -std=c++17 -fsyntax-only -I. $extra "$tmp/old.cpp" > /dev/null 2> "$tmp/err"
    if [[ $(grep -c 'error:' "$tmp/err") -eq 1 ]] && grep -q 'ddp needs C++20: compile with -std=c++20 or later' "$tmp/err"; then
      pass=$((pass + 1))
    else
      fail=$((fail + 1)); echo "FAIL $h with -std=c++17 does not stop with one line saying ddp needs C++20"
      grep 'error:' "$tmp/err" | head -5
    fi
  fi
  printf '#include <%s>\n#include <%s>\nint main() { return 0; }\n' "$h" "$h" > "$tmp/tu.cpp"
  if $cxx -std=c++20 -Wall -Wextra -Wpedantic -Werror -fsyntax-only -I. $optin $extra "$tmp/tu.cpp" 2> "$tmp/err"; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1)); echo "FAIL $h"; head -20 "$tmp/err"
  fi
done
# The umbrella must not pull in optional SDKs.
if grep -Eq '#\s*include\s*<(nccl|cuda_runtime|mpi)\.h>|#\s*include\s*<((oneapi/)?tbb|torch|Eigen)/' ddp/ddp.hpp; then
  fail=$((fail + 1)); echo "FAIL ddp/ddp.hpp includes an optional SDK header"
else
  pass=$((pass + 1))
fi
echo "$pass passed, $fail failed, $skip skipped"
[[ $fail -eq 0 ]]
