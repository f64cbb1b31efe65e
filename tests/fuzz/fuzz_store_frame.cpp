// The store's frame parser on arbitrary bytes: check_header, parse_body and valid_request.
// Properties: the verdicts agree with the limits; a parsed frame encodes back to exactly the
// bytes it came from; a stream cut into arbitrary reads yields the same frames and the same
// verdict as the whole stream; a request that passes valid_request carries every field the
// server will index.
//
// Input: one byte that chooses how the rest is cut into reads, then the stream.

#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/group/detail/store_protocol.hpp>

#include <vector>

#include "fuzz_common.hpp"

namespace {

using namespace ddp::detail;

struct stream_result {
  std::vector<frame> frames;
  bool dropped = false;  ///< the server would drop the client
};

/// Consumes complete frames from the front of `in`, like store_server::handle_frames.
bool consume(std::string& in, stream_result& r) {
  for (;;) {
    std::uint32_t len = 0;
    const auto hr = check_header(in, len);
    if (hr == parse_result::invalid) return false;
    if (hr == parse_result::need_more) return true;
    frame f;
    if (parse_body(std::string_view(in).substr(4, len), f) != parse_result::ok) return false;
    in.erase(0, 4 + static_cast<std::size_t>(len));
    if (!valid_request(f)) return false;
    r.frames.push_back(std::move(f));
  }
}

stream_result run_stream(std::string_view bytes, std::size_t cut) {
  stream_result r;
  std::string in;
  for (std::size_t pos = 0; pos < bytes.size() && !r.dropped;) {
    const std::size_t k = cut == 0 ? bytes.size() : std::min(cut, bytes.size() - pos);
    in.append(bytes.substr(pos, k));
    pos += k;
    r.dropped = !consume(in, r);
  }
  return r;
}

bool same(const stream_result& a, const stream_result& b) {
  if (a.dropped != b.dropped || a.frames.size() != b.frames.size()) return false;
  for (std::size_t i = 0; i < a.frames.size(); ++i)
    if (a.frames[i].code != b.frames[i].code || a.frames[i].fields != b.frames[i].fields) return false;
  return true;
}

void check_one_frame(std::string_view bytes) {
  std::uint32_t len = 0;
  const auto hr = check_header(bytes, len);
  if (bytes.size() < 4) {
    ddp_fuzz::require(hr == parse_result::need_more, "short header must ask for more");
    return;
  }
  const std::uint32_t claimed = get_u32(bytes.data());
  const bool in_limits = claimed != 0 && claimed <= store_max_frame;
  ddp_fuzz::require((hr == parse_result::invalid) == !in_limits, "header verdict disagrees with the limits");
  if (hr != parse_result::ok) return;
  ddp_fuzz::require(len == claimed && bytes.size() >= 4 + static_cast<std::size_t>(len), "ok header, short buffer");

  const auto body = bytes.substr(4, len);
  frame f;
  if (parse_body(body, f) != parse_result::ok) return;
  ddp_fuzz::require(f.fields.size() <= store_max_fields, "more fields than the limit");
  const std::vector<std::string_view> views(f.fields.begin(), f.fields.end());
  ddp_fuzz::require(encode_frame(f.code, views) == bytes.substr(0, 4 + len), "frame does not round-trip");

  if (!valid_request(f)) return;
  // store_server::execute indexes these fields without checking again.
  ddp_fuzz::require(!f.fields.empty(), "valid request without a key");
  switch (static_cast<store_cmd>(f.code)) {
    case store_cmd::add: ddp_fuzz::require(f.fields.size() == 2 && f.fields[1].size() == 8, "add shape"); break;
    case store_cmd::cas: ddp_fuzz::require(f.fields.size() == 3, "cas shape"); break;
    case store_cmd::wait: ddp_fuzz::require(f.fields.size() >= 2, "wait shape"); break;
    case store_cmd::set:
    case store_cmd::get: ddp_fuzz::require(f.fields.size() == 2, "set/get shape"); break;
    case store_cmd::del:
      ddp_fuzz::require(f.fields.size() == 1 || (f.fields.size() == 2 && f.fields[1] == store_del_prefix),
                        "del shape (a key, or a prefix and the mark)");
      break;
    case store_cmd::check: ddp_fuzz::require(f.fields.size() == 1, "check shape"); break;
    default: ddp_fuzz::require(false, "unknown command accepted");
  }
  // The server's membership check and its parked requests rely on these.
  // A claim is a compare_set from the empty value of a key under the prefix, or, for a store
  // without numbered seats, under the prefix inside a namespace ("el3/pg/rank/0").
  const bool claim = is_claim(f, "pg/rank/");
  const bool under = f.fields[0].starts_with("pg/rank/") || f.fields[0].find("/pg/rank/") != std::string::npos;
  ddp_fuzz::require(!claim || (is_write(f.code) && under && f.fields[1].empty()),
                    "a claim that is not a compare_set from the empty value under the prefix");
  ddp_fuzz::require(!is_claim(f, "pg/rank/", 4) || f.fields[0].starts_with("pg/rank/"),
                    "a seat claimed outside the prefix of a store with members");
  ddp_fuzz::require(!is_claim(f, ""), "a claim without a prefix");
  ddp_fuzz::require(is_write(f.code) == (f.code == 1 || f.code == 3 || f.code == 4 || f.code == 5), "write set");
  if (f.code == static_cast<std::uint8_t>(store_cmd::get) || f.code == static_cast<std::uint8_t>(store_cmd::wait))
    ddp_fuzz::require(waited_keys(f) >= 1 && waited_keys(f) < f.fields.size(), "waited keys out of the fields");
  for (std::size_t i = 0; i < f.fields.size(); ++i) {
    const bool value = (f.code == static_cast<std::uint8_t>(store_cmd::set) && i == 1) ||
                       (f.code == static_cast<std::uint8_t>(store_cmd::cas) && i >= 1);
    ddp_fuzz::require(value || f.fields[i].size() <= store_max_key, "oversized key accepted");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  ddp_fuzz::reader in(data, size);
  const std::size_t cut = in.byte() % 17;  // 0: the whole stream in one read
  const auto bytes = in.rest();
  check_one_frame(bytes);
  const auto whole = run_stream(bytes, 0);
  ddp_fuzz::require(same(whole, run_stream(bytes, cut == 0 ? 1 : cut)), "result depends on how reads are cut");
  return 0;
}
