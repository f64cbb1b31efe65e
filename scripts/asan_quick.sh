#!/usr/bin/env bash
# A bounded sanitizer pass that every test run includes: the code that reads what the network
# sends (the fuzz corpus replays, the store protocol, the store server against real clients,
# floods and descriptor exhaustion), the dtypes and schedules, under AddressSanitizer +
# UndefinedBehaviorSanitizer. The whole suite under ASan or TSan, the lifetimes suite
# (reducers and wrappers outliving the program's process_group handle) included:
# scripts/sanitize.sh (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${BUILD_DIR:-build-asan-quick}
if [[ ! -f "$dir/build.ninja" ]]; then
  # -O1 with line tables only (-g1): stack traces name functions, files and lines, and the
  # build takes half the time of -O2 -g.
  meson setup "$dir" --wrap-mode=nodownload --buildtype=plain -Doptimization=1 -Dcpp_args=-g1 \
    -Dtest_optimization=1 -Db_sanitize=address,undefined -Db_lundef=false -Dbench=disabled -Dexamples=disabled >/dev/null
fi
fuzz=(store_frame store_server store_client mesh_hello auth_handshake coll_desc)
# DDP_ASAN_FUZZ=0 leaves the corpus replays out: scripts/test.sh sets it when its fuzz pass
# follows, whose libFuzzer targets (clang, ASan + UBSan) run every corpus input first anyway.
[[ "${DDP_ASAN_FUZZ:-1}" == 0 ]] && fuzz=()
unit=(store_protocol dtype schedule)
multi=(store)
targets=()
for t in "${fuzz[@]}"; do targets+=("tests/fuzz/fuzz_$t"); done
for t in "${unit[@]}"; do targets+=("tests/unit/unit_$t"); done
for t in "${multi[@]}"; do targets+=("tests/multiproc/multiproc_$t"); done
ninja -C "$dir" "${targets[@]}"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
meson test -C "$dir" --no-rebuild --print-errorlogs "${fuzz[@]}" "${unit[@]}" "${multi[@]}"
