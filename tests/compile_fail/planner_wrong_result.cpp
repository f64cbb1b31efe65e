// plan() must return a ddp::bucket_plan.
#include <cstddef>
#include <span>
#include <vector>

#include "ddp/planner/planner_concept.hpp"

struct vector_planner {
  std::vector<std::size_t> plan(std::span<const ddp::param_info>, const ddp::bucket_policy&,
                                std::span<const std::size_t>) const {
    return {};
  }
};

template <ddp::bucket_planner P>
ddp::bucket_plan make_plan(const P& p) {
  return p.plan({}, ddp::bucket_policy{}, {});
}

int main() { return static_cast<int>(make_plan(vector_planner{}).buckets.size()); }
