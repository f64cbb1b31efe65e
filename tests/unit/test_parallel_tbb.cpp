#include <ddp/parallel/tbb.hpp>

#include <ddp/detail/kernels.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <vector>

// oneTBB is the program's explicit choice: including the header installs no hook.
TEST_CASE("including <ddp/parallel/tbb.hpp> installs nothing; use_tbb() does") {
  CHECK((ddp::detail::parallel_hook().load() == nullptr));
  ddp::use_tbb();
  CHECK((ddp::detail::parallel_hook().load() == &ddp::detail::tbb_parallel_for));
  ddp::detail::parallel_hook().store(nullptr);
  ddp::set_kernel_threads(1);  // choosing a share chooses oneTBB too
  CHECK((ddp::detail::parallel_hook().load() == &ddp::detail::tbb_parallel_for));
}

// The oneTBB split must give the bits the serial kernel gives: each piece keeps the order of
// the inputs, so only the work distribution changes.
TEST_CASE("tbb-parallel combine is bitwise equal to the serial kernel") {
  const std::size_t n = (std::size_t{12} << 20) / sizeof(float) + 12345;  // above the 4 MiB threshold
  std::vector<std::vector<float>> in(4, std::vector<float>(n));
  for (std::size_t k = 0; k < in.size(); ++k)
    for (std::size_t i = 0; i < n; ++i) in[k][i] = static_cast<float>((i * 2654435761u + k * 97) % 1000003) * 1e-3f;
  const void* ins[4] = {in[0].data(), in[1].data(), in[2].data(), in[3].data()};
  // avg over 3 ranks: scaled inputs and a true division, finished in each piece.
  const ddp::detail::avg_step avg{3, 0, true};
  for (auto o : {ddp::op::sum, ddp::op::max, ddp::op::prod, ddp::op::avg}) {
    CAPTURE(static_cast<int>(o));
    std::vector<float> serial(n), par(n), par2(n);
    {
      void* outs[1] = {serial.data()};
      ddp::detail::kern::combine_any<float>(outs, 1, ins, 4, n, o, avg);
    }
    ddp::set_kernel_threads(2);
    void* outs[2] = {par.data(), par2.data()};
    ddp::detail::combine(outs, 2, ins, 4, n, ddp::dtype::f32, o, avg);
    CHECK(std::memcmp(serial.data(), par.data(), n * sizeof(float)) == 0);
    CHECK(std::memcmp(serial.data(), par2.data(), n * sizeof(float)) == 0);
  }
  ddp::set_kernel_threads(1);
}

TEST_CASE("below the threshold nothing is split, and f16 stays exact") {
  ddp::set_kernel_threads(2);
  std::vector<ddp::half> a(1000, ddp::half(1.5f)), b(1000, ddp::half(2.0f));
  void* outs[1] = {a.data()};
  const void* ins[2] = {a.data(), b.data()};
  ddp::detail::combine(outs, 1, ins, 2, a.size(), ddp::dtype::f16, ddp::op::sum);
  for (auto x : a) CHECK(static_cast<float>(x) == 3.5f);
}
