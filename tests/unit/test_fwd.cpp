// ddp/fwd.hpp alone is enough to declare what passes ddp's classes around, and it names the
// wrapper's default policies in one place.
#include <ddp/fwd.hpp>

#include <type_traits>

namespace {
// A header of a training program that only passes ddp's objects along needs nothing more.
struct trainer {
  ddp::process_group* pg = nullptr;
  ddp::data_parallel* dp = nullptr;
  ddp::store_client* store = nullptr;
  void attach(ddp::process_group& g, ddp::data_parallel& d) {
    pg = &g;
    dp = &d;
  }
};
}  // namespace

static_assert(std::is_same_v<ddp::data_parallel,
                             ddp::basic_data_parallel<ddp::size_planner, ddp::auto_reducer, ddp::auto_allocator>>);
static_assert(std::is_same_v<ddp::basic_data_parallel<ddp::size_planner>, ddp::data_parallel>);

// The declarations agree with the definitions: these headers redeclare every class above (a
// different class template's parameters or enum's base would not compile).
#include <ddp/auth.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/memory/auto_allocator.hpp>
#include <ddp/memory/host_allocator.hpp>
#include <ddp/memory/shm_allocator.hpp>
#include <ddp/parameter.hpp>
#include <ddp/planner/size_planner.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/auto.hpp>
#include <ddp/reducer/hierarchical.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/reducer/tree.hpp>
#include <ddp/request.hpp>
#include <ddp/store.hpp>
#include <ddp/transport/tcp.hpp>

#include <doctest/doctest.h>

static_assert(std::is_same_v<ddp::basic_reducer<ddp::ring_algorithm, ddp::tcp>, ddp::ring<ddp::tcp>>,
              "fwd.hpp's default reducer is ddp::ring<ddp::tcp>");

TEST_CASE("fwd.hpp declares the classes that the full headers define") {
  trainer t;
  CHECK(t.pg == nullptr);
  CHECK(std::is_class_v<ddp::process_group>);
  CHECK(sizeof(ddp::size_planner) > 0);  // complete now, from planner/size_planner.hpp
  CHECK(sizeof(ddp::host_allocator) > 0);
  CHECK(sizeof(ddp::tcp) > 0);
  CHECK(static_cast<int>(ddp::dtype::f32) == 0);
  CHECK(DDP_VERSION == DDP_VERSION_MAJOR * 10000 + DDP_VERSION_MINOR * 100 + DDP_VERSION_PATCH);
}
