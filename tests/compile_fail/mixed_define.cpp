// One unit of a two-unit program (tests/compile_fail/mixed_modes.sh): defines a function that
// takes ddp's process_group, compiled in whatever mode the script asks for.
#include <ddp/process_group.hpp>

int group_size_of(ddp::process_group& pg) { return pg.size(); }
