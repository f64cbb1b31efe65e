// Positive control: minimal types modelling each concept compile, so the failures above are due
// to the one thing each of them leaves out, not to the harness.
#include <cstddef>
#include <cstdlib>
#include <span>
#include <vector>

#include "ddp/memory/allocator_concept.hpp"
#include "ddp/memory/host_allocator.hpp"
#include "ddp/parameter.hpp"
#include "ddp/planner/planner_concept.hpp"
#include "ddp/planner/size_planner.hpp"

struct model {
  float* w;
  float* g;
};

template <>
struct ddp::parameter_traits<model> {
  static std::size_t size(const model&) { return 1; }
  static float* data(const model& m, std::size_t) { return m.w; }
  static float* grad(const model& m, std::size_t) { return m.g; }
  static std::size_t numel(const model&, std::size_t) { return 1; }
  static ddp::dtype type(const model&, std::size_t) { return ddp::dtype::f32; }
};

struct one_planner {
  ddp::bucket_plan plan(std::span<const ddp::param_info>, const ddp::bucket_policy&,
                        std::span<const std::size_t>) const {
    return {};
  }
};

struct malloc_allocator {
  void* allocate(std::size_t n) { return std::malloc(n); }
  void deallocate(void* p, std::size_t) noexcept { std::free(p); }
  ddp::memory_kind location() const { return ddp::memory_kind::host; }
};

template <ddp::bucket_planner P>
ddp::bucket_plan make_plan(const P& p) {
  return p.plan({}, ddp::bucket_policy{}, {});
}

template <ddp::device_allocator A>
void* get(A& a) {
  return a.allocate(64);
}

int main() {
  float w = 0, g = 0;
  std::vector<float> v(4), gv(4);
  std::vector<ddp::tensor_view> views{ddp::make_tensor_view(v, gv)};
  malloc_allocator a;
  ddp::host_allocator h;
  void* p = get(a);
  a.deallocate(p, 64);
  return static_cast<int>(ddp::to_views(model{&w, &g}).size() + ddp::to_views(views).size() +
                          make_plan(one_planner{}).buckets.size() +
                          make_plan(ddp::size_planner{}).buckets.size()) +
         (get(h) == nullptr);
}
