#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The definitions of detail/kernels.hpp's type-erased entry points: included by it in a
// header-only build, compiled once by src/ddp.cpp with DDP_SEPARATE_COMPILATION
// (detail/compiled.hpp).

#include <cstddef>

#include <ddp/detail/compiled.hpp>
#include <ddp/detail/kernels.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

DDP_DECL void reduce_into(void* dst, const void* src, std::size_t n, dtype t, op o) {
  check_dtype(t, -1, "reduction kernel");
  check_op(o, -1, "reduction kernel");
  kern::dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    reduce_into(static_cast<T*>(dst), static_cast<const T*>(src), n, o);
  });
}

DDP_DECL void combine(void* const* outs, int nouts, const void* const* ins, int nins, std::size_t n, dtype t, op o,
                      avg_step a) {
  check_dtype(t, -1, "reduction kernel");
  check_op(o, -1, "reduction kernel");
  kern::check_avg(o, a, nins);
  const auto par = parallel_hook().load(std::memory_order_relaxed);
  const std::size_t es = dtype_size(t);
  if (par != nullptr && n * es >= parallel_min_bytes && nouts <= 64 && nins <= 64) {
    struct job {
      void* const* outs;
      int nouts;
      const void* const* ins;
      int nins;
      dtype t;
      op o;
      avg_step a;
      std::size_t es;
    } j{outs, nouts, ins, nins, t, o, a, es};
    par(
        n, (std::size_t{256} << 10) / es,
        [](std::size_t b, std::size_t e, void* ctx) {
          const auto& j = *static_cast<const job*>(ctx);
          void* po[64];
          const void* pi[64];
          for (int k = 0; k < j.nouts; ++k) po[k] = static_cast<char*>(j.outs[k]) + b * j.es;
          for (int k = 0; k < j.nins; ++k) pi[k] = static_cast<const char*>(j.ins[k]) + b * j.es;
          kern::dispatch(j.t,
                         [&](auto tag) { kern::combine_any<decltype(tag)>(po, j.nouts, pi, j.nins, e - b, j.o, j.a); });
        },
        &j);
    return;
  }
  kern::dispatch(t, [&](auto tag) { kern::combine_any<decltype(tag)>(outs, nouts, ins, nins, n, o, a); });
}

DDP_DECL void avg_prescale(void* dst, const void* src, std::size_t n, dtype t, int world) {
  check_dtype(t, -1, "reduction kernel");
  kern::dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    avg_prescale(static_cast<T*>(dst), static_cast<const T*>(src), n, world);
  });
}

DDP_DECL void avg_finish(void* p, std::size_t n, dtype t, int world) {
  check_dtype(t, -1, "reduction kernel");
  kern::dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    avg_finish(static_cast<T*>(p), n, world);
  });
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
