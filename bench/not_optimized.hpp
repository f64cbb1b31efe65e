// Force-included into every benchmark of a build configured with -Dbench_optimization=0 or 1
// (scripts/test.sh's build): the program says, before anything else, that its figures are not
// the library's. Not part of the library.
#pragma once
#include <cstdio>

namespace ddp_bench_note {
inline const bool said = [] {
  std::fputs("note: this benchmark was built without optimization (-Dbench_optimization=" DDP_BENCH_OPT_LEVEL
             "), so its figures do not represent ddp; rebuild it with\n"
             "  meson configure build -Dbench_optimization=build && ninja -C build\n",
             stderr);
  return true;
}();
}  // namespace ddp_bench_note
