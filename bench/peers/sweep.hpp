// Size sweep, iteration counts, statistics and CSV output shared by the peer allreduce
// benchmarks, so every system reports the same columns computed the same way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace sweep {

struct options {
  std::size_t min_bytes = 4096;
  std::size_t max_bytes = std::size_t{256} << 20;
  std::size_t factor = 4;
  int iters = 0;     // 0: choose per size (iters_for)
  int warmup = -1;   // -1: choose per size (warmup_for)
  int ranks = 2;     // only read by programs that start their own ranks
  std::string algo;  // comma-separated; empty: the program's default list
};

inline void usage(const char* prog, std::string_view algos) {
  std::fprintf(stderr,
               "usage: %s [--ranks N] [--algo %.*s] [--min-bytes B] [--max-bytes B]\n"
               "          [--factor F] [--iters N] [--warmup W]\n",
               prog, static_cast<int>(algos.size()), algos.data());
}

// Exits on a malformed command line: a benchmark that silently measures the wrong thing is
// worse than one that refuses to start.
inline options parse(int argc, char** argv, std::string_view algos) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s: %s needs a value\n", argv[0], argv[i]);
        std::exit(2);
      }
      return argv[++i];
    };
    auto number = [&]() -> long long {
      const char* v = value();
      char* end = nullptr;
      long long n = std::strtoll(v, &end, 10);
      if (end == v || *end != '\0' || n < 0) {
        std::fprintf(stderr, "%s: bad number '%s' for %s\n", argv[0], v, argv[i - 1]);
        std::exit(2);
      }
      return n;
    };
    if (a == "--min-bytes") o.min_bytes = static_cast<std::size_t>(number());
    else if (a == "--max-bytes") o.max_bytes = static_cast<std::size_t>(number());
    else if (a == "--factor") o.factor = static_cast<std::size_t>(number());
    else if (a == "--iters") o.iters = static_cast<int>(number());
    else if (a == "--warmup") o.warmup = static_cast<int>(number());
    else if (a == "--ranks") o.ranks = static_cast<int>(number());
    else if (a == "--algo") o.algo = value();
    else if (a == "-h" || a == "--help") { usage(argv[0], algos); std::exit(0); }
    else {
      std::fprintf(stderr, "%s: unknown argument '%s'\n", argv[0], argv[i]);
      usage(argv[0], algos);
      std::exit(2);
    }
  }
  if (o.factor < 2 || o.min_bytes < 4 || o.max_bytes < o.min_bytes || o.ranks < 1) {
    std::fprintf(stderr, "%s: need factor >= 2, 4 <= min-bytes <= max-bytes, ranks >= 1\n",
                 argv[0]);
    std::exit(2);
  }
  return o;
}

inline std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos <= list.size()) {
    std::size_t comma = list.find(',', pos);
    if (comma == std::string::npos) comma = list.size();
    if (comma > pos) out.push_back(list.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return out;
}

// Sizes are whole float32 elements.
inline std::vector<std::size_t> sizes(const options& o) {
  std::vector<std::size_t> out;
  for (std::size_t b = o.min_bytes; b <= o.max_bytes; b *= o.factor) out.push_back(b / 4 * 4);
  return out;
}

// Fewer iterations for big messages keep a 4 KiB..256 MiB sweep to about a minute per system
// on 2 cores, while small messages, where scheduler noise dominates, get enough samples for a
// stable median.
inline int iters_for(const options& o, std::size_t bytes) {
  if (o.iters > 0) return o.iters;
  if (bytes < (std::size_t{1} << 20)) return 100;
  if (bytes < (std::size_t{16} << 20)) return 40;
  if (bytes < (std::size_t{64} << 20)) return 20;
  if (bytes < (std::size_t{256} << 20)) return 10;
  return 5;
}

inline int warmup_for(const options& o, std::size_t bytes) {
  if (o.warmup >= 0) return o.warmup;
  return std::max(1, iters_for(o, bytes) / 10);
}

struct stats {
  double median_us = 0;
  double p10_us = 0;
};

// `per_iter_us` holds, for each iteration, the slowest rank's time: a collective is done only
// when its last rank is.
inline stats summarize(std::vector<double> per_iter_us) {
  stats s;
  if (per_iter_us.empty()) return s;
  std::sort(per_iter_us.begin(), per_iter_us.end());
  const std::size_t n = per_iter_us.size();
  s.median_us = n % 2 ? per_iter_us[n / 2] : 0.5 * (per_iter_us[n / 2 - 1] + per_iter_us[n / 2]);
  s.p10_us = per_iter_us[(n - 1) / 10];
  return s;
}

inline void print_header() {
  std::printf("system,algo,ranks,bytes,iters,median_us,p10_us,algbw_GBps,busbw_GBps\n");
  std::fflush(stdout);
}

// algbw and busbw as nccl-tests defines them, from the median time.
inline void print_row(std::string_view system, std::string_view algo, int ranks,
                      std::size_t bytes, int iters, const stats& s) {
  const double algbw = s.median_us > 0 ? static_cast<double>(bytes) / (s.median_us * 1e3) : 0;
  const double busbw = ranks > 1 ? algbw * 2.0 * (ranks - 1) / ranks : algbw;
  std::printf("%.*s,%.*s,%d,%zu,%d,%.2f,%.2f,%.4f,%.4f\n", static_cast<int>(system.size()),
              system.data(), static_cast<int>(algo.size()), algo.data(), ranks, bytes, iters,
              s.median_us, s.p10_us, algbw, busbw);
  std::fflush(stdout);
}

// Inputs are rank+1, so a sum over n ranks is n(n+1)/2 in every element; exact in float32.
inline std::size_t count_wrong(const float* v, std::size_t count, int ranks) {
  const float expect = static_cast<float>(ranks) * static_cast<float>(ranks + 1) / 2.0f;
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < count; ++i) wrong += v[i] != expect;
  return wrong;
}

}  // namespace sweep
