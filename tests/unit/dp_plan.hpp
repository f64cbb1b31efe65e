// A hand-made bucket plan for the data-parallel parts' unit tests: 4 parameters of 4 floats in
// 3 buckets, listed in launch order as backward produces them (last parameter first):
// bucket 0 = {p3, p2}, bucket 1 = {p1}, bucket 2 = {p0}.
#pragma once

#include <cstddef>
#include <vector>

#include "ddp/planner/bucket_plan.hpp"

namespace dp_test {

inline ddp::bucket_plan three_buckets() {
  ddp::bucket_plan plan;
  const auto entry = [](std::size_t p, std::size_t off) { return ddp::bucket_entry{p, off, 4}; };
  plan.buckets.push_back({ddp::dtype::f32, -1, 8, 32, {entry(3, 0), entry(2, 4)}});
  plan.buckets.push_back({ddp::dtype::f32, -1, 4, 16, {entry(1, 0)}});
  plan.buckets.push_back({ddp::dtype::f32, -1, 4, 16, {entry(0, 0)}});
  plan.where = {{2, 0}, {1, 0}, {0, 1}, {0, 0}};
  return plan;
}

}  // namespace dp_test
