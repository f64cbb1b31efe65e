#!/usr/bin/env bash
# The test suite under a sanitizer, in its own build directory.
#   scripts/sanitize.sh [asan|tsan] [meson test arguments...]
#     asan  AddressSanitizer + LeakSanitizer + UndefinedBehaviorSanitizer (default)
#     tsan  ThreadSanitizer
# Environment: BUILD_DIR (default build-asan / build-tsan), CXX (default: the system compiler),
# JOBS (ninja -j; default: all cores).
# The headers, compile_fail and consumer suites are left out: they only run the compiler again
# on the headers, which a sanitizer does not instrument. Results are in docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-asan}
[[ $# -gt 0 ]] && shift
case "$kind" in
  asan) sanitize=address,undefined ;;
  tsan) sanitize=thread ;;
  *) echo "usage: scripts/sanitize.sh [asan|tsan] [meson test args...]" >&2; exit 2 ;;
esac
dir=${BUILD_DIR:-build-$kind}
jobs=()
[[ -n "${JOBS:-}" ]] && jobs=(-j "$JOBS")

if [[ ! -f "$dir/build.ninja" ]]; then
  # debugoptimized keeps assert() on and -O2, which keeps the multi-process tests' timing close
  # to a release build; b_lundef=false because clang's sanitizer runtimes leave symbols to the
  # executable. Benchmarks gain nothing from a sanitizer and double the build time. The tests
  # follow the build type here (-O2), not the -O0 of a normal build.
  meson setup "$dir" --wrap-mode=nodownload --buildtype=debugoptimized -Dtest_optimization=build \
    -Db_sanitize="$sanitize" -Db_lundef=false -Dbench=disabled
fi
abs=$(cd "$dir" && pwd)
t0=$(date +%s)
ninja -C "$dir" "${jobs[@]}"
t1=$(date +%s)

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Any report fails the test: halt on the first one, with a stack.
# allocator_may_return_null: the allocator tests ask for impossible sizes on purpose and expect
# the null that the C library returns, not an ASan abort.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1:check_initialization_order=1:allocator_may_return_null=1}
# Open MPI does not free everything at MPI_Finalize; LeakSanitizer would fail every MPI test on
# memory that only Open MPI, its plugins and hwloc allocated (none of these stacks has a ddp frame).
cat >"$dir/lsan.supp" <<'EOF'
leak:libmpi.so
leak:libopen-pal.so
leak:libopen-rte.so
leak:libhwloc.so
leak:libpmix.so
leak:libevent
leak:mca_
EOF
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$abs/lsan.supp}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# The multi-process tests may fork while a store server thread runs; TSan kills such children by
# default (die_after_fork=1). Keep them alive, so that any race they then have is reported.
# oneTBB and Open MPI are not built with TSan, so it cannot see their own synchronization:
# suppress reports whose stacks run inside them.
cat >"$dir/tsan.supp" <<'EOF'
race:libtbb.so
race:tbb::detail::
deadlock:libmpi.so
deadlock:libopen-pal.so
deadlock:mca_btl_tcp_add_procs
EOF
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:die_after_fork=0:history_size=4:allocator_may_return_null=1:suppressions=$abs/tsan.supp}
# Sanitizers slow the collectives and the forked groups; give each test three times its limit.
common=(--no-rebuild --print-errorlogs --num-processes 2 --timeout-multiplier 3
        --no-suite headers --no-suite compile_fail --no-suite consumer)
rc=0
if [[ $kind == asan && $# -eq 0 ]]; then
  meson test -C "$dir" "${common[@]}" --no-suite mpi || rc=$?
  # Open MPI's leaks have stacks through plugins that the fast unwinder cannot follow, so the
  # suppressions above only match with the slow one; it would slow the other suites tenfold.
  ASAN_OPTIONS="$ASAN_OPTIONS:fast_unwind_on_malloc=0" \
    meson test -C "$dir" "${common[@]}" --suite mpi --logbase testlog-mpi || rc=$?
else
  meson test -C "$dir" "${common[@]}" "$@" || rc=$?
fi
t2=$(date +%s)
echo "sanitize $kind: build $((t1 - t0)) s, tests $((t2 - t1)) s, rc $rc (logs: $dir/meson-logs/testlog*.txt)"
exit $rc
