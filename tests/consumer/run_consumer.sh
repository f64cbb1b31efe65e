#!/usr/bin/env bash
# Builds and runs tests/consumer/consumer.cpp the three ways a user consumes ddp:
#   plain   c++ -std=c++20 -I include (vendoring include/); below C++20 the compile stops
#           with the one line that says ddp needs C++20
#   cmake   find_package(ddp) against a `meson install` of this tree (ddp::ddp target),
#           and pkg-config's ddp.pc from the same install (its --cflags carry -std=c++20)
#   meson   ddp as a Meson subproject, with ddp's defaults: the consumer builds its own
#           program and none of ddp's tests, examples, benchmarks or fuzzers
# Usage: run_consumer.sh KIND SOURCE_ROOT CXX
set -euo pipefail
kind=$1; src=$2; cxx=$3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
def="-DDDP_CONSUMER_PORT=$port"
case $kind in
  plain)
    $cxx -std=c++20 $def -I "$src/include" "$src/tests/consumer/consumer.cpp" -o "$work/consumer" -pthread
    "$work/consumer"
    if $cxx -std=c++17 $def -I "$src/include" -c "$src/tests/consumer/consumer.cpp" -o "$work/old.o" 2> "$work/err"; then
      echo "FAIL: consumer.cpp compiled with -std=c++17"; exit 1
    fi
    errors=$(grep -c 'error:' "$work/err" || true)
    if [[ $errors -ne 1 ]] || ! grep -q 'ddp needs C++20: compile with -std=c++20 or later' "$work/err"; then
      echo "FAIL: below C++20 the compile should stop with one line saying ddp needs C++20; got $errors:"
      head -20 "$work/err"; exit 1
    fi
    echo "below C++20: $(grep 'error:' "$work/err")" ;;
  cmake)
    meson setup "$work/b" "$src" --prefix=/usr -Dtests=disabled -Dexamples=disabled -Dbench=disabled \
      -Ddocs=disabled --wrap-mode=nodownload >/dev/null
    meson install -C "$work/b" --destdir "$work/root" >/dev/null
    CXXFLAGS="$def" cmake -S "$src/tests/consumer/cmake" -B "$work/c" \
      -DCMAKE_PREFIX_PATH="$work/root/usr" -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
    cmake --build "$work/c" >/dev/null
    "$work/c/consumer"
    # pkg-config from the same install, relocated with --define-prefix; its flags alone suffice
    # (no -std here: they carry -std=c++20).
    flags=$(PKG_CONFIG_PATH="$work/root/usr/share/pkgconfig" pkg-config --define-prefix --cflags --libs ddp)
    echo "pkg-config --cflags --libs ddp: $flags"
    [[ " $flags " == *" -std=c++20 "* ]] || { echo "FAIL: pkg-config --cflags ddp lacks -std=c++20"; exit 1; }
    $cxx $def "$src/tests/consumer/consumer.cpp" $flags -o "$work/pc"
    "$work/pc" ;;
  meson)
    cp -r "$src/tests/consumer/meson" "$work/p"
    cp "$src/tests/consumer/consumer.cpp" "$work/consumer.cpp"
    mkdir -p "$work/p/subprojects"
    ln -s "$src" "$work/p/subprojects/ddp"
    # ddp's own defaults: no -Dddp:... options.
    meson setup "$work/p/b" "$work/p" -Dcpp_args="$def" --wrap-mode=nodownload >/dev/null
    ninja -C "$work/p/b" > "$work/ninja.log"
    "$work/p/b/consumer"
    # ninja numbers its steps [i/N]: N is everything a plain `ninja` of the consumer builds.
    steps=$(grep -o '^\[[0-9]*/[0-9]*\]' "$work/ninja.log" | tail -1 | sed 's/.*\///; s/\]//')
    echo "a Meson consumer's build: $steps steps"
    cat "$work/ninja.log"
    # The consumer's program: compile and link, nothing of ddp's.
    if [[ -z $steps || $steps -gt 2 ]]; then
      echo "FAIL: a Meson consumer builds $steps steps; ddp as a subproject should add none"; exit 1
    fi ;;
esac
