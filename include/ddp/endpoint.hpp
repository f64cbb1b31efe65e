#pragma once
/// \file endpoint.hpp
/// `ddp::endpoint`: where something listens, as a host and a port, the way a user writes it
/// ("10.0.0.1:29500", "[::1]:29500", "node7:29500"). Names are resolved by whoever binds or
/// connects (a `store_server`, a `store_client`), not here.
///
/// \code
/// #include <ddp/endpoint.hpp>
/// auto ep = ddp::endpoint::parse("[::1]:29500");   // {.host = "::1", .port = 29500}
/// std::string s = ep.to_string();                  // "[::1]:29500"
/// ddp::endpoint any{"127.0.0.1", 0};               // port 0: the system picks one when binding
/// \endcode

#include <charconv>
#include <string>
#include <string_view>

#include <ddp/version.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// A host (name, IPv4 or IPv6 address; empty: every interface) and a port (0: any free one).
struct endpoint {
  std::string host;
  int port = 0;

  /// Reads "host:port", or "[ipv6]:port" (the brackets are dropped from `host`). Throws
  /// errc::invalid_argument for a missing or malformed port, or an IPv6 address without brackets.
  static endpoint parse(std::string_view s) {
    auto bad = [&](const char* why) -> endpoint {
      detail::raise(errc::invalid_argument, -1,
                    "endpoint '" + std::string(s) + "': " + why +
                        " (write host:port, or "
                        "[ipv6]:port)");
    };
    std::string_view host, port;
    if (!s.empty() && s.front() == '[') {
      const auto close = s.find(']');
      if (close == std::string_view::npos) return bad("an IPv6 address without its closing ']'");
      host = s.substr(1, close - 1);
      if (close + 1 >= s.size() || s[close + 1] != ':') return bad("no port after the address");
      port = s.substr(close + 2);
    } else {
      const auto colon = s.rfind(':');
      if (colon == std::string_view::npos) return bad("no port");
      host = s.substr(0, colon);
      if (host.find(':') != std::string_view::npos) return bad("an IPv6 address needs brackets");
      port = s.substr(colon + 1);
    }
    int p = -1;
    const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), p);
    if (port.empty() || ec != std::errc() || end != port.data() + port.size() || p < 0 || p > 65535)
      return bad("the port is not a number in [0, 65535]");
    return {std::string(host), p};
  }

  /// "host:port"; an IPv6 address in brackets ("[::1]:29500").
  std::string to_string() const {
    const bool v6 = host.find(':') != std::string::npos && host.front() != '[';  // not empty: it holds ':'
    return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
  }

  friend bool operator==(const endpoint&, const endpoint&) = default;
};

}  // namespace DDP_ABI
}  // namespace ddp
