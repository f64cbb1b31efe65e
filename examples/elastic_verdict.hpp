// The end of the elastic examples (05_elastic, 06_sharded --elastic): rank 0's last line,
//   <what>: OK steps=<n> failures=<k> sizes=<a,b,...> generations=<g>
// (the committed steps, the failures survived, the world sizes seen, each once in the order
// first seen, and the generations), then every rank's verdict: the worst code of any rank.
#pragma once

#include <ddp/ddp.hpp>
#include <ddp/group/elastic.hpp>

#include <algorithm>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

namespace elastic_example {

/// Rank 0 (with code 0) prints the OK line; every rank returns the group's worst code (0 or 1),
/// having said that the job is done. Collective over the group's last generation.
inline int conclude(ddp::elastic_group& eg, const char* what, int code) {
  if (eg.rank() == 0 && code == 0) {
    std::string sizes;
    std::vector<int> seen;
    for (int s : eg.sizes())
      if (std::find(seen.begin(), seen.end(), s) == seen.end()) {
        seen.push_back(s);
        sizes += (sizes.empty() ? "" : ",") + std::to_string(s);
      }
    std::printf("%s: OK steps=%llu failures=%d sizes=%s generations=%zu\n", what,
                static_cast<unsigned long long>(eg.step()), eg.failures(), sizes.c_str(), eg.sizes().size());
  }
  std::fflush(stdout);
  double verdict = code;
  eg.group().all_reduce(std::span<double>(&verdict, 1), ddp::op::max);
  eg.finish();
  return verdict == 0 ? 0 : 1;
}

}  // namespace elastic_example
