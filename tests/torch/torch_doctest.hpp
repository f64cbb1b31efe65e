#pragma once
// The LibTorch adapter and doctest in one translation unit: LibTorch's logging defines
// glog-style CHECK macros, and doctest's are the ones the torch suite means.

#include <ddp/adapters/libtorch.hpp>
#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>
