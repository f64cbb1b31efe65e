#include "ddp/parameter.hpp"

#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace {

// A user's own model type, adapted through ddp::parameter_traits below.
struct layer {
  std::string name;
  std::vector<double> w, gw;
  std::array<int, 2> dims;
};
struct my_model {
  std::vector<layer> layers;
  int gpu = 3;
};

// A model that describes only the required pieces.
struct bare_model {
  float* w;
  float* gw;
  std::size_t n;
};

// Not a parameter set: no gradient.
struct no_grad_model {
  float* w;
};

}  // namespace

template <>
struct ddp::parameter_traits<my_model> {
  static std::size_t size(const my_model& m) { return m.layers.size(); }
  static void* data(const my_model& m, std::size_t i) { return const_cast<double*>(m.layers[i].w.data()); }
  static void* grad(const my_model& m, std::size_t i) { return const_cast<double*>(m.layers[i].gw.data()); }
  static std::size_t numel(const my_model& m, std::size_t i) { return m.layers[i].w.size(); }
  static ddp::dtype type(const my_model&, std::size_t) { return ddp::dtype::f64; }
  static int device(const my_model& m, std::size_t) { return m.gpu; }
  static const std::string& name(const my_model& m, std::size_t i) { return m.layers[i].name; }
  static const std::array<int, 2>& shape(const my_model& m, std::size_t i) { return m.layers[i].dims; }
};

template <>
struct ddp::parameter_traits<bare_model> {
  static std::size_t size(const bare_model&) { return 1; }
  static float* data(const bare_model& m, std::size_t) { return m.w; }
  static float* grad(const bare_model& m, std::size_t) { return m.gw; }
  static std::size_t numel(const bare_model& m, std::size_t) { return m.n; }
  static ddp::dtype type(const bare_model&, std::size_t) { return ddp::dtype::f32; }
};

template <>
struct ddp::parameter_traits<no_grad_model> {
  static std::size_t size(const no_grad_model&) { return 1; }
  static float* data(const no_grad_model& m, std::size_t) { return m.w; }
  static std::size_t numel(const no_grad_model&, std::size_t) { return 1; }
  static ddp::dtype type(const no_grad_model&, std::size_t) { return ddp::dtype::f32; }
};

static_assert(ddp::parameter_set<std::vector<ddp::tensor_view>>);
static_assert(ddp::parameter_set<const std::vector<ddp::tensor_view>&>);
static_assert(ddp::parameter_set<std::span<ddp::tensor_view>>);
static_assert(ddp::parameter_set<std::span<const ddp::tensor_view>>);
static_assert(ddp::parameter_set<std::array<ddp::tensor_view, 3>>);
static_assert(ddp::parameter_set<my_model>);
static_assert(ddp::parameter_set<bare_model>);
static_assert(!ddp::has_parameter_device<bare_model> && !ddp::has_parameter_name<bare_model>);
static_assert(ddp::has_parameter_count<no_grad_model> && ddp::has_parameter_data<no_grad_model>);
static_assert(!ddp::has_parameter_grad<no_grad_model>);
static_assert(!ddp::parameter_set<no_grad_model>);
static_assert(!ddp::parameter_set<std::vector<float>>);
static_assert(!ddp::parameter_set<int>);

TEST_CASE("make_tensor_view records pointers, size, dtype and shape") {
  std::vector<float> w(12), gw(12);
  auto v = ddp::make_tensor_view(std::span{w}, std::span{gw}, "fc.weight", {3, 4});
  CHECK(v.data == w.data());
  CHECK(v.grad == gw.data());
  CHECK(v.numel == 12);
  CHECK(v.type == ddp::dtype::f32);
  CHECK(v.device == -1);
  CHECK(v.name == "fc.weight");
  CHECK(v.shape == std::vector<std::int64_t>{3, 4});
  CHECK(v.bytes() == 48);

  std::vector<ddp::bfloat16> b(5), gb(5);
  auto vb = ddp::make_tensor_view(b, gb);  // contiguous-range overload
  CHECK(vb.type == ddp::dtype::bf16);
  CHECK(vb.shape == std::vector<std::int64_t>{5});
  CHECK(vb.bytes() == 10);
  CHECK(vb.data == b.data());
}

TEST_CASE("make_tensor_view rejects a gradient of the wrong size, naming the parameter") {
  std::vector<float> w(8), gw(7);
  try {
    (void)ddp::make_tensor_view(std::span{w}, std::span{gw}, "layer3.bias");
    FAIL("expected ddp::error");
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::invalid_argument);
    const std::string what = e.what();
    CHECK(what.find("[ddp.invalid_argument]") == 0);
    CHECK(what.find("layer3.bias") != std::string::npos);
    CHECK(what.find("7") != std::string::npos);
    CHECK(what.find("8") != std::string::npos);
  }
  CHECK_THROWS_AS(ddp::make_tensor_view(std::span{w}, std::span{w}, "x", {3, 3}), ddp::error);
  CHECK_THROWS_AS(ddp::make_tensor_view(std::span{w}, std::span{w}, "x", {-2, -4}), ddp::error);
}

TEST_CASE("to_views over a vector of tensor_view is the identity") {
  std::vector<float> a(6), ga(6);
  std::vector<std::int64_t> c(2), gc(2);
  std::vector<ddp::tensor_view> vs{ddp::make_tensor_view(a, ga, "a", {2, 3}),
                                   ddp::make_tensor_view(c, gc, "c")};
  vs[1].device = 1;
  const auto out = ddp::to_views(vs);
  CHECK(out == vs);
  const auto from_span = ddp::to_views(std::span<const ddp::tensor_view>(vs));
  CHECK(from_span == vs);
  CHECK(out[1].type == ddp::dtype::i64);
  CHECK(out[1].device == 1);
}

TEST_CASE("to_views adapts a user struct through parameter_traits") {
  my_model m;
  m.layers.push_back({"embed", std::vector<double>(6), std::vector<double>(6), {2, 3}});
  m.layers.push_back({"head", std::vector<double>(4), std::vector<double>(4), {4, 1}});
  const auto vs = ddp::to_views(m);
  REQUIRE(vs.size() == 2);
  CHECK(vs[0].data == m.layers[0].w.data());
  CHECK(vs[0].grad == m.layers[0].gw.data());
  CHECK(vs[0].numel == 6);
  CHECK(vs[0].type == ddp::dtype::f64);
  CHECK(vs[0].device == 3);
  CHECK(vs[0].name == "embed");
  CHECK(vs[0].name.data() == m.layers[0].name.data());  // a view into the model, no copy
  CHECK(vs[0].shape == std::vector<std::int64_t>{2, 3});
  CHECK(vs[1].shape == std::vector<std::int64_t>{4, 1});
  CHECK(vs[1].bytes() == 32);
}

TEST_CASE("to_views fills defaults for optional traits") {
  float w[5] = {}, gw[5] = {};
  const auto vs = ddp::to_views(bare_model{w, gw, 5});
  REQUIRE(vs.size() == 1);
  CHECK(vs[0].device == -1);
  CHECK(vs[0].name.empty());
  CHECK(vs[0].shape == std::vector<std::int64_t>{5});
  CHECK(vs[0].data == w);
}

TEST_CASE("to_views rejects null pointers and inconsistent shapes with the parameter index") {
  float w[4] = {};
  try {
    (void)ddp::to_views(bare_model{w, nullptr, 4});
    FAIL("expected ddp::error");
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::invalid_argument);
    CHECK(e.parameter() == 0);
    CHECK(std::string(e.what()).find("null gradient") != std::string::npos);
  }
  CHECK_NOTHROW((void)ddp::to_views(bare_model{nullptr, nullptr, 0}));  // empty parameters are fine

  std::vector<float> a(4), ga(4);
  std::vector<ddp::tensor_view> vs{ddp::make_tensor_view(a, ga, "ok"), ddp::make_tensor_view(a, ga, "bad")};
  vs[1].shape = {3};
  try {
    (void)ddp::to_views(vs);
    FAIL("expected ddp::error");
  } catch (const ddp::error& e) {
    CHECK(e.parameter() == 1);
    CHECK(std::string(e.what()).find("'bad'") != std::string::npos);
  }
}

TEST_CASE("with_buffers: a parameter set with buffers; to_buffer_views checks them; to_state_views has both") {
  std::vector<float> w(4), g(4), mean(3);
  std::vector<std::int64_t> count(1);
  std::vector<ddp::tensor_view> views{ddp::make_tensor_view(w, g, "w", {2, 2})};
  auto state = ddp::with_buffers(views, {ddp::make_buffer_view(std::span{mean}, "bn.mean"),
                                         ddp::make_buffer_view(std::span{count}, "bn.count")});
  static_assert(ddp::parameter_set<decltype(state)> && ddp::has_buffers<decltype(state)>);
  static_assert(!ddp::has_buffers<std::vector<ddp::tensor_view>>);
  const auto pv = ddp::to_views(state);
  REQUIRE(pv.size() == 1);
  CHECK(pv[0].shape == std::vector<std::int64_t>{2, 2});
  CHECK(pv[0].name == "w");
  const auto bv = ddp::to_buffer_views(state);
  REQUIRE(bv.size() == 2);
  CHECK(bv[1].type == ddp::dtype::i64);
  CHECK(bv[0].shape == std::vector<std::int64_t>{3});
  const auto all = ddp::to_state_views(state);
  REQUIRE(all.size() == 3);
  CHECK(all[2].name == "bn.count");
  CHECK(all[2].data == count.data());
  CHECK(ddp::to_buffer_views(views).empty());

  auto bad = ddp::with_buffers(views, {ddp::buffer_view{nullptr, 3, ddp::dtype::f32, -1, "x", {3}}});
  CHECK_THROWS_WITH_AS(ddp::to_buffer_views(bad), doctest::Contains("buffer 0 ('x'): null data pointer"), ddp::error);
  auto shape = ddp::with_buffers(views, {ddp::buffer_view{mean.data(), 3, ddp::dtype::f32, -1, "y", {2, 2}}});
  CHECK_THROWS_WITH_AS(ddp::to_buffer_views(shape), doctest::Contains("shape holds 4 elements but numel is 3"), ddp::error);
  CHECK_THROWS_AS(ddp::make_buffer_view(std::span{mean}, "z", {2, 2}), ddp::error);
}

TEST_CASE("with_buffers over a set with buffers of its own: its own first, then the added ones") {
  std::vector<float> w(2), g(2), a(3), b(4);
  std::vector<ddp::tensor_view> views{ddp::make_tensor_view(w, g, "w")};
  auto inner = ddp::with_buffers(views, {ddp::make_buffer_view(std::span{a}, "a")});
  auto outer = ddp::with_buffers(inner, {ddp::make_buffer_view(std::span{b}, "b")});
  const auto bv = ddp::to_buffer_views(outer);
  REQUIRE(bv.size() == 2);
  CHECK(bv[0].name == "a");
  CHECK(bv[1].name == "b");
  CHECK(bv[1].numel == 4);
}
