#pragma once
/// \file group/topology.hpp
/// `ddp::topology`: which ranks of a group share a host. The default reducer
/// (`ddp::auto_reducer`) picks its engine from it; engines that split work between hosts
/// (`ddp::hierarchical`) build on it. See docs/cluster.md.
///
/// \code
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// const auto topo = ddp::topology::of(pg);   // collective
/// std::printf("%s; my host's ranks: %zu\n", topo.describe().c_str(), topo.ranks_on(topo.host_of(pg.rank())).size());
/// \endcode

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <concepts>
#include <map>
#include <string>
#include <vector>

#include <ddp/version.hpp>

namespace ddp {
inline namespace DDP_ABI {

namespace detail {
/// The first line of the file at `path` (empty when it cannot be read).
inline std::string read_first_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

}  // namespace detail

/// This process's host identity, "the same host": host name, boot id (a rebooted or different machine with the
/// same name differs), network namespace, and the device of /dev/shm (containers on one machine
/// see different /dev/shm). Ranks with the same identity can share a segment; ranks in
/// different network namespaces count as different hosts even where they could share memory
/// (`ip netns exec` gives each process a mount namespace of its own but the same /dev/shm, and
/// what a group on one host expects is one network). `DDP_HOST_ID`, when set, replaces all of
/// it (containers that share memory but not a host name, or tests that say which ranks form a
/// host): the hosts `ddp::topology` finds and the segments `ddp::shm` agrees to share are then
/// the same ones.
inline std::string host_identity() {
  if (const char* v = std::getenv("DDP_HOST_ID"); v != nullptr && *v != '\0') {
    std::string id = std::string("id ") + v;
    std::replace(id.begin(), id.end(), '\n', ' ');  // identities travel one per line
    return id;
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  char ns[128] = {};
  const ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof ns - 1);
  struct stat st {};
  const bool shm_dev = ::stat("/dev/shm", &st) == 0;
  return std::string(host) + " boot " + detail::read_first_line("/proc/sys/kernel/random/boot_id") + " " +
         (n > 0 ? std::string(ns, static_cast<std::size_t>(n)) : std::string("net:?")) + " shm " +
         (shm_dev ? std::to_string(static_cast<unsigned long long>(st.st_dev)) : std::string("?"));
}

/// Ranks grouped by host. Hosts are numbered by their lowest rank (host 0 holds rank 0), and
/// each host's ranks are listed in ascending order; a host's *leader* is its lowest rank.
struct topology {
  std::vector<int> host_index;            ///< per rank: its host
  std::vector<std::vector<int>> members;  ///< per host: its ranks, ascending

  /// Built from each rank's identity (what `of` gathers); `ids[r]` is rank r's.
  static topology from_identities(const std::vector<std::string>& ids) {
    topology t;
    std::map<std::string, int> seen;
    t.host_index.resize(ids.size());
    for (std::size_t r = 0; r < ids.size(); ++r) {
      auto [it, fresh] = seen.emplace(ids[r], static_cast<int>(t.members.size()));
      if (fresh) t.members.emplace_back();
      t.host_index[r] = it->second;
      t.members[static_cast<std::size_t>(it->second)].push_back(static_cast<int>(r));
    }
    return t;
  }
  /// The group's topology, gathered from every rank (a collective: every rank calls it).
  /// `pg` is a `ddp::process_group`, or anything else whose `all_gather(blob)` returns every
  /// rank's blob indexed by rank: a topology needs that one collective, not the whole group.
  template <class Group>
  requires requires(Group& g, const std::string& blob) {
    { g.all_gather(blob) } -> std::convertible_to<std::vector<std::string>>;
  }
  static topology of(Group& pg) { return from_identities(pg.all_gather(host_identity())); }

  int world() const noexcept { return static_cast<int>(host_index.size()); }
  int hosts() const noexcept { return static_cast<int>(members.size()); }
  int host_of(int rank) const { return host_index.at(static_cast<std::size_t>(rank)); }
  const std::vector<int>& ranks_on(int host) const { return members.at(static_cast<std::size_t>(host)); }
  /// The lowest rank of each host, in host order.
  std::vector<int> leaders() const {
    std::vector<int> l;
    for (const auto& m : members) l.push_back(m.front());
    return l;
  }
  /// True when every host holds as many ranks as every other.
  bool uniform() const noexcept {
    return std::all_of(members.begin(), members.end(), [&](const auto& m) { return m.size() == members[0].size(); });
  }
  /// "1 host, 4 ranks", "3 hosts x 2 ranks", "2 hosts (3 + 1 ranks)".
  std::string describe() const {
    if (members.empty()) return "no ranks";
    auto ranks = [](std::size_t n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); };
    if (members.size() == 1) return "1 host, " + ranks(members[0].size());
    if (uniform()) return std::to_string(members.size()) + " hosts x " + ranks(members[0].size());
    std::string s = std::to_string(members.size()) + " hosts (";
    for (std::size_t h = 0; h < members.size(); ++h) s += (h ? " + " : "") + std::to_string(members[h].size());
    return s + " ranks)";
  }
};

}  // namespace DDP_ABI
}  // namespace ddp
