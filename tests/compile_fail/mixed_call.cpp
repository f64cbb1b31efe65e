// The other unit (tests/compile_fail/mixed_modes.sh): refers to the function mixed_define.cpp
// defines. Built in the same mode it links; in another mode (or with other DDP_WITH_* settings)
// it must not.
#include <ddp/process_group.hpp>

int group_size_of(ddp::process_group& pg);

int main() {
  // Only the link is tested: the address alone needs the definition.
  int (*volatile f)(ddp::process_group&) = &group_size_of;
  return f == nullptr ? 1 : 0;
}
