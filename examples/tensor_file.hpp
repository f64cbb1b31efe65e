#pragma once
// The tensor file that the LibTorch examples and their PyTorch counterparts
// (examples/03_libtorch_ddp.py: read_tensors, write_tensors) read and write.
#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace example {

// The tensor file both sides read and write: "DDPT", a count, then per tensor its name, dims
// and float32 (or int64, for labels) values, little endian as the machine is.
inline void write_tensors(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& ts) {
  std::ofstream f(path, std::ios::binary);
  const auto put = [&](const void* p, std::size_t n) { f.write(static_cast<const char*>(p), static_cast<std::streamsize>(n)); };
  put("DDPT", 4);
  const auto count = static_cast<std::uint32_t>(ts.size());
  put(&count, 4);
  for (const auto& [name, t0] : ts) {
    const auto t = t0.contiguous();
    const auto len = static_cast<std::uint32_t>(name.size());
    const std::uint32_t kind = t.scalar_type() == torch::kLong ? 1 : 0;
    const auto ndim = static_cast<std::uint32_t>(t.dim());
    put(&len, 4);
    put(name.data(), len);
    put(&kind, 4);
    put(&ndim, 4);
    for (auto d : t.sizes()) put(&d, 8);
    put(t.data_ptr(), static_cast<std::size_t>(t.numel()) * t.element_size());
  }
  if (!f) throw std::runtime_error("cannot write " + path);
}

}  // namespace example
