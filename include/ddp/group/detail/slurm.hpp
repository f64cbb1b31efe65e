#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// What init_options::from_env derives from Slurm's environment when MASTER_ADDR and
// MASTER_PORT are absent (docs/process-group.md): the first host of a node list written in
// Slurm's compressed syntax, and a port from the job and step ids. Pure functions; no
// `scontrol`, no name lookup.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// A node list's first host, and whether it names more than one.
struct slurm_hosts {
  std::string first;
  bool several = false;
};

/// Parses Slurm's host list syntax: hosts separated by commas, each a name in which bracketed
/// groups of numbers and ranges stand for several names (`node[01-04,07],gpu3`,
/// `rack[1-2]-n[1-8]`); a range's lower bound is written with the zero padding every name of it
/// has. The first host is the first entry with each group at its first number (`node01`).
/// Raises errc::invalid_argument naming `var` and its value when the list is malformed.
inline slurm_hosts parse_slurm_hostlist(const char* var, std::string_view list) {
  auto fail = [&](const std::string& why) -> void {
    raise(errc::invalid_argument, -1,
          std::string("environment variable ") + var + "='" + std::string(list) + "' is not a Slurm host list: " + why);
  };
  auto is_name_char = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '.' ||
           c == '_';
  };
  auto is_digit = [](char c) { return c >= '0' && c <= '9'; };
  // The value of a run of digits in `[group]`; numbers in host lists are far below 10^18.
  auto number = [&](std::string_view digits, std::string_view group) -> std::uint64_t {
    if (digits.empty()) fail("a number is missing in '[" + std::string(group) + "]'");
    if (digits.size() > 18) fail("'" + std::string(digits) + "' is too long for a host number");
    std::uint64_t x = 0;
    for (char c : digits) x = x * 10 + static_cast<std::uint64_t>(c - '0');
    return x;
  };

  slurm_hosts out;
  std::uint64_t hosts = 0;  // saturates at 2: only "one or several" matters
  std::size_t i = 0;
  const std::size_t n = list.size();
  if (n == 0) fail("it is empty");
  for (;;) {                  // one entry per round
    std::string name;         // this entry's first host
    std::uint64_t names = 1;  // hosts this entry stands for, saturating at 2
    const std::size_t start = i;
    while (i < n && list[i] != ',') {
      const char c = list[i];
      if (is_name_char(c)) {
        name += c;
        ++i;
        continue;
      }
      if (c != '[') fail(std::string("unexpected '") + c + "' at offset " + std::to_string(i));
      const std::size_t close = list.find(']', i);
      if (close == std::string_view::npos) fail("'[' at offset " + std::to_string(i) + " is not closed");
      const std::string_view group = list.substr(i + 1, close - i - 1);
      if (group.empty()) fail("empty '[]' at offset " + std::to_string(i));
      std::uint64_t values = 0;  // numbers this group stands for, saturating at 2
      bool first_range = true;
      std::size_t j = 0;
      for (;;) {  // one number or range per round
        std::size_t k = j;
        while (k < group.size() && is_digit(group[k])) ++k;
        const std::string_view lo = group.substr(j, k - j);
        std::uint64_t count = 1;
        const std::uint64_t a = number(lo, group);
        if (k < group.size() && group[k] == '-') {
          std::size_t m = k + 1;
          while (m < group.size() && is_digit(group[m])) ++m;
          const std::uint64_t b = number(group.substr(k + 1, m - k - 1), group);
          if (b < a) fail("range '" + std::string(group.substr(j, m - j)) + "' runs backwards");
          count = b - a + 1;
          k = m;
        }
        if (first_range) name += lo;
        first_range = false;
        values = values + count >= 2 ? 2 : values + count;  // saturates, as `names` does
        if (k == group.size()) break;
        if (group[k] != ',') fail(std::string("unexpected '") + group[k] + "' in '[" + std::string(group) + "]'");
        j = k + 1;
      }
      names = names * values >= 2 ? 2 : names * values;
      i = close + 1;
    }
    if (i == start) fail("an empty host name at offset " + std::to_string(i));
    if (hosts == 0) out.first = std::move(name);
    hosts = hosts + names >= 2 ? 2 : hosts + names;
    if (i == n) break;
    ++i;  // the comma
    if (i == n) fail("it ends with ','");
  }
  out.several = hosts >= 2;
  return out;
}

/// The store port a Slurm step derives when MASTER_PORT is absent:
/// `12000 + (16 * job_id + step_id % 16) % 20000`, in [12000, 31999], below Linux's ephemeral
/// range (32768-60999) so that no outgoing connection holds it. Steps 0-15 of one job get
/// different ports, and so do any two jobs whose ids differ by less than 1250.
constexpr int slurm_port(std::uint64_t job_id, std::uint64_t step_id) noexcept {
  return 12000 + static_cast<int>((16 * (job_id % 20000) + step_id % 16) % 20000);
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
