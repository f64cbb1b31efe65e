// basic_data_parallel names the unmet requirement when its Reducer argument is not a reducer.
#include <ddp/data_parallel.hpp>

struct not_a_reducer {
  int rank() const { return 0; }
};

using bad = ddp::basic_data_parallel<ddp::size_planner, not_a_reducer, ddp::host_allocator>;
bad* p = nullptr;
void f(ddp::process_group& pg, std::vector<ddp::tensor_view>& v) { bad b{pg, v}; }
