#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The group's store keys, all in one schema: the rendezvous, the mesh, the failure record, the
// elastic protocol and the launcher spell none of their own. Integers are stored one way, as
// the store's counters (`add`) store them: 8 bytes, little-endian (`int_value`, `int_of`); a
// flag is a key that exists ("1"); everything else is text.

#include <cstdint>
#include <string>
#include <string_view>

#include <ddp/detail/bytes.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {
namespace keys {

// ---- a group: rendezvous, links, failure record ---------------------------------------------
/// A rank's seat (its claim on the store's membership: the store server's seat prefix).
inline constexpr std::string_view seat_prefix = "pg/rank/";
inline std::string seat(int rank) { return std::string(seat_prefix) + std::to_string(rank); }
/// An elastic process's seat, by its unique id, before it has a rank.
inline std::string elastic_seat(std::string_view uid) { return std::string(seat_prefix) + "el." + std::string(uid); }
inline constexpr const char* job = "pg/job";                          ///< rank 0's record of the job (world, heartbeat)
inline constexpr const char* group_id = "pg/id";                      ///< the group's nonce (an integer)
inline constexpr const char* complete = "pg/complete";                ///< flag: every rank arrived
inline constexpr const char* missing = "pg/missing";                  ///< rank 0's word on who never arrived
inline constexpr const char* mesh = "pg/mesh";                        ///< the mesh's channel
inline constexpr const char* heartbeat = "pg/hb";                     ///< the heartbeat's channel
inline constexpr const char* failure = "pg/failure";                  ///< the group's failure record
inline constexpr const char* failure_readers = "pg/failure_readers";  ///< a counter
inline constexpr const char* hello = "store/hello";                   ///< a key nobody sets: a connection's probe
/// Rank `rank`'s last error (process_group::note_error).
inline std::string note(int rank) { return "pg/note/" + std::to_string(rank); }
/// Rank `rank`'s "waits for" record under a collective's `prefix`.
inline std::string waiting(std::string_view prefix, int rank) {
  return std::string(prefix) + "/waiting/" + std::to_string(rank);
}
/// Rank `rank`'s listening address on a channel of links (the mesh, the heartbeat, a tcp transport).
inline std::string address(std::string_view channel, int rank) {
  return std::string(channel) + "/addr/" + std::to_string(rank);
}
/// The channel of the group's `n`-th tcp transport.
inline std::string tcp_channel(int n) { return "tcp/" + std::to_string(n); }

// ---- an elastic job: its generations, rounds and steps --------------------------------------
inline constexpr const char* generation = "el/gen";           ///< the newest generation that formed (an integer)
inline constexpr const char* done = "el/done";                ///< flag: the job finished
inline constexpr const char* signature = "el/signature";      ///< the job's signature, set by generation 0
inline constexpr const char* live = "el/live";                ///< the live mark (elastic_rules' encode_live)
inline constexpr const char* progress = "el/step";            ///< the next step, noted now and then (an integer)
inline constexpr const char* swept = "el/swept";              ///< generations swept (an integer)
inline constexpr const char* swept_steps = "el/swept_steps";  ///< generations whose step keys went (an integer)
/// Generation `g`'s own keys (its group's store prefix, and its dead ranks below it).
inline std::string generation_keys(int g) { return "el" + std::to_string(g) + "/"; }
/// Rank `rank` found dead by generation `g`'s heartbeat (a flag).
inline std::string dead(int g, int rank) { return generation_keys(g) + "hb/dead/" + std::to_string(rank); }
/// The round that forms generation `g`, and its members and old members.
inline std::string round(int g) { return "el/r" + std::to_string(g) + "/"; }
inline std::string member(std::string_view round_key, int index) {
  return std::string(round_key) + "m/" + std::to_string(index);
}
inline std::string old_member(std::string_view round_key, int priority) {
  return std::string(round_key) + "old/" + std::to_string(priority);
}
/// A round's arrivals (a counter) and its closing decision.
inline std::string arrivals(std::string_view round_key) { return std::string(round_key) + "n"; }
inline std::string closed(std::string_view round_key) { return std::string(round_key) + "closed"; }
/// Generation `g`'s steps: in blocks of `step_block`, so that the last voter erases a whole
/// block in one request; a step's votes ("v") and decision ("d") under step().
inline constexpr std::uint64_t step_block = 64;
inline std::string steps(int g) { return "el/g" + std::to_string(g) + "/"; }
inline std::string step_block_of(int g, std::uint64_t block) { return steps(g) + "b" + std::to_string(block) + "/"; }
inline std::string step(int g, std::uint64_t s) {
  return step_block_of(g, s / step_block) + "s" + std::to_string(s) + "/";
}
/// A step's votes (a counter) and its decision, under its step() key.
inline std::string votes(std::string_view step_key) { return std::string(step_key) + "v"; }
inline std::string decision(std::string_view step_key) { return std::string(step_key) + "d"; }

// ---- integers -------------------------------------------------------------------------------
inline std::string int_value(std::int64_t v) { return encode_i64(v); }
/// The integer stored at `key`; errc::protocol on `rank` for a value that is not one.
inline std::int64_t int_of(std::string_view value, int rank, std::string_view key) {
  if (value.size() != 8)
    raise(errc::protocol, rank,
          "the store's " + std::string(key) + " holds " + std::to_string(value.size()) +
              " bytes, not an integer (8): another program, or another version of ddp, shares the store");
  return decode_i64(value);
}

}  // namespace keys
}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
