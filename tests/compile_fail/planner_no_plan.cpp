// A planner policy without plan() is rejected where the policy is used.
#include "ddp/planner/planner_concept.hpp"

struct lazy_planner {};

template <ddp::bucket_planner P>
ddp::bucket_plan make_plan(const P& p) {
  return p.plan({}, ddp::bucket_policy{}, {});
}

int main() { return static_cast<int>(make_plan(lazy_planner{}).buckets.size()); }
