// ddpstore: serves a group's store on its own, outside every rank, for launchers other than
// ddprun (torchrun, Slurm, by hand): the ranks then run with DDP_EXTERNAL_STORE=1 and
// MASTER_ADDR/MASTER_PORT naming this process, so that the loss of any rank, rank 0 included,
// leaves the store and the group's failure record in place. An elastic group's store
// (`--elastic`) has no numbered seats: its generations claim theirs in namespaces of their own
// (docs/elastic.md).
//
//   ddpstore [--host ADDR] --port PORT [--world N | --elastic] [--until-idle SECONDS]
//
// Prints "ddpstore: serving on ADDR:PORT" once it listens. Ends on SIGINT or SIGTERM, or, with
// --until-idle S, once it has had no client for S seconds (since it started, or since its last
// client left). With DDP_AUTH_TOKEN (built with libsodium) every connection must prove the
// group's secret, as at rank 0's store; without one, only on loopback unless DDP_INSECURE=1
// (docs/security.md).
#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include <ddp/detail/socket.hpp>
#include <ddp/group/detail/keys.hpp>
#include <ddp/store.hpp>
#if DDP_TOOLS_SODIUM
#include <ddp/auth/sodium.hpp>
#endif

namespace {

volatile sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr,
               "ddpstore: %s\nusage: ddpstore [--host ADDR] --port PORT [--world N | --elastic] "
               "[--until-idle SECONDS]\n",
               msg);
  std::exit(2);
}

int number(const char* name, const char* v, long lo, long hi) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*v == '\0' || *end != '\0' || x < lo || x > hi)
    usage((std::string(name) + " takes a number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]").c_str());
  return static_cast<int>(x);
}

}  // namespace

int main(int argc, char** argv) try {
  std::string host = "127.0.0.1";
  int port = -1, world = 0, idle = 0;
  bool elastic = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage((a + " needs a value").c_str());
      return argv[++i];
    };
    if (a == "--host") host = value();
    else if (a == "--port") port = number("--port", value(), 0, 65535);
    else if (a == "--world") world = number("--world", value(), 1, 1 << 20);
    else if (a == "--elastic") elastic = true;
    else if (a == "--until-idle") idle = number("--until-idle", value(), 1, 1 << 30);
    else if (a == "-h" || a == "--help") usage("help");
    else usage(("unknown option " + a).c_str());
  }
  if (port < 0) usage("--port is needed (0 picks a free one)");
  if (elastic && world > 0) usage("--world and --elastic exclude each other (an elastic group has no fixed seats)");
  const char* token = std::getenv("DDP_AUTH_TOKEN");
  std::shared_ptr<const ddp::authenticator> auth;
  if (token != nullptr && *token != '\0') {
#if DDP_TOOLS_SODIUM
    ddp::install_authenticator(&ddp::sodium_authenticator::make);
    auth = ddp::make_authenticator(token, 0);
#else
    usage("DDP_AUTH_TOKEN is set but this ddpstore was built without libsodium: it cannot prove the secret");
#endif
  }
  const char* insecure = std::getenv("DDP_INSECURE");
  if (!auth && !(insecure && std::string(insecure) == "1")) {
    for (const auto& ep : ddp::detail::resolve(host, port == 0 ? 1 : port, -1, true))
      if (!ddp::detail::is_loopback(ep.addr))
        usage(("--host " + host + " is beyond loopback and the store has no secret: set DDP_AUTH_TOKEN, or "
               "DDP_INSECURE=1 to accept that any process reaching it may join or disturb the group "
               "(docs/security.md)").c_str());
  }
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // Only connections that claimed a rank may write: a fixed group's seats are its ranks.
  ddp::store_server server(ddp::endpoint{host, port}, 0, auth, ddp::store_limits{}, std::string(ddp::detail::keys::seat_prefix),
                           static_cast<std::uint32_t>(elastic ? 0 : world));
  std::printf("ddpstore: serving on %s:%d\n", host.c_str(), server.port());
  std::fflush(stdout);
  auto last_busy = std::chrono::steady_clock::now();
  while (g_stop == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (server.clients() > 0)
      last_busy = std::chrono::steady_clock::now();
    else if (idle > 0 && std::chrono::steady_clock::now() - last_busy >= std::chrono::seconds(idle))
      break;
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ddpstore: %s\n", e.what());
  return 1;
}
