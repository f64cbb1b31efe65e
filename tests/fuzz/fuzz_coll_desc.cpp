// The collective descriptor a peer sends before its data, checked with detail::mismatch and
// printed with detail::describe, on arbitrary bytes (a diverged, corrupt or hostile peer).
// Properties: no crash or undefined behavior on any value of any field; mismatch says nothing
// exactly when the descriptors are byte-for-byte equal, and names both ranks otherwise.
//
// Input: our descriptor (32 bytes), then the peer's (32 bytes); missing bytes are zero.

#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/detail/collective.hpp>

#include <cstring>

#include "fuzz_common.hpp"

namespace {
using namespace ddp::detail;

coll_desc load(ddp_fuzz::reader& in) {
  char raw[sizeof(coll_desc)] = {};
  const auto s = in.take(sizeof raw);
  std::memcpy(raw, s.data(), s.size());
  coll_desc d;
  std::memcpy(&d, raw, sizeof d);
  return d;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  ddp_fuzz::reader in(data, size);
  const coll_desc mine = load(in);
  const coll_desc theirs = load(in);
  const bool equal = std::memcmp(&mine, &theirs, sizeof mine) == 0;
  const auto why = mismatch(mine, 3, theirs, 7);
  ddp_fuzz::require(why.empty() == equal, "mismatch disagrees with byte equality");
  if (!equal)
    ddp_fuzz::require(why.find("rank 3") != std::string::npos && why.find("rank 7") != std::string::npos,
                      "mismatch message does not name both ranks");
  ddp_fuzz::require(!describe(theirs).empty(), "empty description");
  return 0;
}
