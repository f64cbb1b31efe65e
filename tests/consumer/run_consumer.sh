#!/usr/bin/env bash
# Builds and runs tests/consumer/consumer.cpp the three ways a user consumes ddp:
#   plain   c++ -std=c++20 -I include (vendoring include/)
#   cmake   find_package(ddp) against a `meson install` of this tree (ddp::ddp target),
#           and pkg-config's ddp.pc from the same install
#   meson   ddp as a Meson subproject
# Usage: run_consumer.sh KIND SOURCE_ROOT CXX
set -euo pipefail
kind=$1; src=$2; cxx=$3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
def="-DDDP_CONSUMER_PORT=$port"
case $kind in
  plain)
    $cxx -std=c++20 $def -I "$src/include" "$src/tests/consumer/consumer.cpp" -o "$work/consumer" -pthread
    "$work/consumer" ;;
  cmake)
    meson setup "$work/b" "$src" --prefix=/usr -Dtests=disabled -Dexamples=disabled -Dbench=disabled \
      -Ddocs=disabled --wrap-mode=nodownload >/dev/null
    meson install -C "$work/b" --destdir "$work/root" >/dev/null
    CXXFLAGS="$def" cmake -S "$src/tests/consumer/cmake" -B "$work/c" \
      -DCMAKE_PREFIX_PATH="$work/root/usr" -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
    cmake --build "$work/c" >/dev/null
    "$work/c/consumer"
    # pkg-config from the same install, relocated with --define-prefix.
    flags=$(PKG_CONFIG_PATH="$work/root/usr/share/pkgconfig" pkg-config --define-prefix --cflags --libs ddp)
    $cxx -std=c++20 $def "$src/tests/consumer/consumer.cpp" $flags -o "$work/pc"
    "$work/pc" ;;
  meson)
    cp -r "$src/tests/consumer/meson" "$work/p"
    cp "$src/tests/consumer/consumer.cpp" "$work/consumer.cpp"
    mkdir -p "$work/p/subprojects"
    ln -s "$src" "$work/p/subprojects/ddp"
    meson setup "$work/p/b" "$work/p" -Dcpp_args="$def" -Dddp:tests=disabled -Dddp:examples=disabled \
      -Dddp:bench=disabled -Dddp:docs=disabled --wrap-mode=nodownload >/dev/null
    ninja -C "$work/p/b" >/dev/null
    "$work/p/b/consumer" ;;
esac
