// What the test suites include first, precompiled once (tests/meson.build, option test_pch) and
// force-included (-include) by the suites built at the tests' optimization level.
#include <ddp/ddp.hpp>
#include <doctest/doctest.h>
