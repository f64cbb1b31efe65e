#!/bin/sh
# A program whose units disagree on how ddp was compiled (header-only or compiled mode,
# DDP_WITH_MPI) must fail to link, naming the function that crosses them, instead of breaking the
# one-definition rule in silence (the ABI tag in ddp's inline namespace, ddp/version.hpp). Units
# that agree link (the control).
#
# Usage: mixed_modes.sh SOURCE_DIR COMPILED_LIB MPI_FLAGS COMPILER [COMPILER ARGS...]
#   COMPILED_LIB: the static library of src/ddp.cpp in compiled mode; MPI_FLAGS: the flags that
#   find mpi.h, or 'none' (then the DDP_WITH_MPI case is skipped).
set -u
src=$1 lib=$2 mpi=$3
shift 3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
here=$src/tests/compile_fail
fails=0
# unit NAME SOURCE FLAGS...: compiles SOURCE into $dir/NAME.o
unit() {
  name=$1 file=$2
  shift 2
  if ! "$@" -std=c++20 -O0 -I"$src/include" -c "$file" -o "$dir/$name.o" >"$dir/$name.log" 2>&1; then
    cat "$dir/$name.log"
    echo "FAIL: $file did not compile ($*)"
    exit 1
  fi
}
# expect pass|fail WHAT OBJECTS... -- LINK ARGS: links the objects
expect() {
  want=$1 what=$2
  shift 2
  log=$("$@" -pthread -o "$dir/prog" 2>&1)
  status=$?
  if [ "$want" = pass ] && [ $status -ne 0 ]; then
    printf '%s\n' "$log"
    echo "FAIL: $what should link"
    fails=1
  elif [ "$want" = fail ] && [ $status -eq 0 ]; then
    echo "FAIL: $what linked, but its units disagree on ddp's ABI"
    fails=1
  elif [ "$want" = fail ] && ! printf '%s\n' "$log" | grep -q 'group_size_of(ddp::v0_'; then
    printf '%s\n' "$log"
    echo "FAIL: $what did not link, but the error does not name group_size_of(ddp::v0_...)"
    fails=1
  else
    if [ "$want" = pass ]; then
      echo "ok: $what: links"
    else
      echo "ok: $what: does not link, undefined $(printf '%s\n' "$log" | grep -m1 -o 'group_size_of(ddp::v0_[^)]*)')"
    fi
  fi
}
cxx=$*
unit define_h "$here/mixed_define.cpp" $cxx
unit call_h "$here/mixed_call.cpp" $cxx
unit define_c "$here/mixed_define.cpp" $cxx -DDDP_SEPARATE_COMPILATION
unit call_c "$here/mixed_call.cpp" $cxx -DDDP_SEPARATE_COMPILATION
expect pass "header-only units together" $cxx "$dir/define_h.o" "$dir/call_h.o"
expect pass "compiled-mode units with the compiled library" $cxx "$dir/define_c.o" "$dir/call_c.o" "$lib"
expect fail "a header-only unit called from a compiled-mode one" $cxx "$dir/define_h.o" "$dir/call_c.o" "$lib"
expect fail "a compiled-mode unit called from a header-only one" $cxx "$dir/define_c.o" "$dir/call_h.o" "$lib"
if [ "$mpi" != none ]; then
  unit call_mpi "$here/mixed_call.cpp" $cxx $mpi -DDDP_WITH_MPI=1
  expect fail "a unit built with DDP_WITH_MPI calling one built without" $cxx "$dir/define_h.o" "$dir/call_mpi.o"
else
  echo "skip: DDP_WITH_MPI (no MPI found)"
fi
exit $fails
