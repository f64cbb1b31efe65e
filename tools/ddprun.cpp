// ddprun: starts N local ranks of a program, torchrun/mpirun style.
//
//   ddprun -n 4 [--master-addr 127.0.0.1] [--port P] [--timeout S] [--] prog args...
//   ddprun -n 4 --nnodes 3 --node-rank K --master-addr HOST --port P [--job-id ID] [--] prog args...
//   ddprun -n 2 --bind-cores [--] prog args...
//   ddprun -n 4 --max-restarts 3 [--] prog args...
//
// Picks a free port unless --port is given, sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE and DDP_JOB_ID (unless set) for each rank, prefixes every output
// line with "[rank] ", and when one rank fails, ends the others and exits with the status of the
// rank that failed first (by exit time; ranks that fail after it, often because of it, and
// ranks that ddprun ended itself are not blamed).
//
// Several hosts: one ddprun per host, each with the same -n, --nnodes, --master-addr (the host
// of global rank 0, reachable from every host) and --port, and its own --node-rank K in
// [0, nnodes). Host K's local rank l is global rank K*n + l of a world of nnodes*n (torchrun's
// static rendezvous). The ranks of all hosts must share one job id: --job-id, else DDP_JOB_ID,
// else one derived from the master's address and port (the same on every host). Each ddprun
// ends only its own host's ranks; the others learn of a failure through ddp's group (their
// collectives fail naming the rank that was lost).
//
// --max-restarts K: when a rank fails, ddprun ends the others as always, says once which rank
// failed and how, and starts every rank again, up to K times, as torchrun's --max_restarts does
// (each run on a fresh port unless --port is given; DDP_RESTART_COUNT tells the ranks which run
// this is, 0 for the first). The program resumes from its own checkpoint
// (ddp::save_checkpoint / ddp::load_checkpoint: examples/01_mlp.cpp --checkpoint). ddprun
// exits with the status of the last run. A signal to ddprun itself ends the job, with no
// restart. On several hosts every host's ddprun restarts its ranks: a failure on one host
// reaches the others through the group (their ranks fail naming the lost rank), so each
// host's ddprun sees its own ranks fail and starts them again; run k's job id is
// "<job>+restart.k", and a rank that finds an earlier run's store still on the port waits for
// it to go, so the hosts meet in the same run.
//
// --store etcd://h1:2379,h2:2379,h3:2379[/prefix] (or DDP_STORE): the group's store lives on that
// etcd cluster (docs/cluster.md), so that no launcher serves it and the loss of any host, host 0
// included, leaves it in place; --master-addr and --port are then not needed, even across
// hosts, but --job-id is (the same on every host, new for every job: it names the job's keys).
//
// --bind-cores pins local rank l to the l-th core ddprun may run on (modulo their number), as
// mpirun binds its ranks to cores: two ranks that hand a shared-memory step back and forth are
// then never left queued on one core by the scheduler. Leave it off for programs that run
// threads of their own in each rank.
//
// --elastic MIN:MAX (docs/elastic.md, "The launcher"): a rank that fails alone is started again,
// a newcomer to the running group (DDP_RESTART_COUNT > 0), up to --max-restarts times in all.
// Once the job is done (a rank ended normally, or the group said so in its store) a failure is
// final: no replacement. When no rank holding the group's state is left (ddprun_elastic.hpp),
// every rank starts again as the first generation of run k, as without --elastic, while
// restarts are left; else the job ends.
//
// ddprun's death, even by SIGKILL, ends its ranks within a second or so: a keeper holds none of
// ddprun's descriptors (no rank is left writing to a pipe that nobody reads), and the kernel
// tells it that ddprun is gone (PR_SET_PDEATHSIG), whereupon it ends its rank's process group.
#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <fcntl.h>
#include <sched.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/detail/socket.hpp>
#include <ddp/error.hpp>
#include <ddp/group/detail/keys.hpp>
#include <ddp/group/detail/rendezvous.hpp>  // job_run_id: the ids of a restarted job's runs
#include <ddp/store.hpp>
#if DDP_TOOLS_SODIUM
#include <ddp/auth/sodium.hpp>  // proves the group's secret at the store ddprun serves
#endif
#if DDP_TOOLS_ETCD
#include <ddp/etcd.hpp>  // --store etcd://...: the group's store on an etcd cluster
#endif

#include "ddprun_elastic.hpp"  // whether an elastic group's state is gone

namespace {

volatile sig_atomic_t g_signal = 0;
void on_signal(int s) { g_signal = s; }

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr,
               "ddprun: %s\nusage: ddprun -n N [--master-addr ADDR] [--port PORT] [--timeout SECONDS] [--] "
               "program [args...]\n"
               "       ddprun -n N --nnodes NODES --node-rank K --master-addr ADDR --port PORT [--job-id ID] "
               "[--timeout SECONDS] [--] program [args...]\n"
               "       ddprun -n N [--nnodes NODES --node-rank K] --store etcd://HOST:2379[,HOST:2379...] [--job-id ID] "
               "[--] program [args...]   (the group's store on etcd: no host serves it)\n"
               "       options: --bind-cores (pin local rank l to the l-th usable core), --max-restarts K "
               "(start every rank again when one fails, up to K times), --elastic MIN:MAX (the group shrinks "
               "and grows in place: a failed rank alone is started again, up to --max-restarts times; every rank, when "
               "the group's state is lost)\n",
               msg);
  std::exit(2);
}

int pick_port(const std::string& addr) {
  const auto eps = ddp::detail::resolve(addr, 0, -1, true);
  auto fd = ddp::detail::listen_on(eps.front(), -1, 1);
  return ddp::detail::port_of(ddp::detail::local_address(fd.get()));
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// How a rank ended, written by its keeper: a process between ddprun and the program that
// waits for the program and notes the moment it ended. ddprun itself may notice several
// exits at once (its poll slice, a loaded machine), and would then not know which came first.
struct exit_note {
  std::atomic<int> done;
  std::atomic<int> status;
  std::atomic<std::int64_t> at_ns;
};

struct rank_proc {
  pid_t pid = -1;  // the keeper, leader of the rank's process group
  int out = -1;
  int note = -1;   // ddprun's end of the rank's DDP_LAUNCHER_FD socket
  std::size_t life = 0;  // elastic: its entry in the run's lives
  std::string pending;
  std::string last_error;  // the last "[ddp.<errc>] ..." line it wrote: why it failed, when it says
  bool said_lost = false;  // elastic: it wrote that every rank holding the group's state is gone
  bool exited = false;  // the keeper was reaped
  bool ended = false;   // the program's end is known: status and at_ns are set
  bool handled = false;  // elastic: its end was seen to (replaced, or noted as final)
  int status = 0;
  std::int64_t at_ns = 0;
};

int code_of(int st) { return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st); }

// Closes the descriptors from `lo` to `hi`.
void close_fds(unsigned lo, unsigned hi) {
  if (lo > hi || ::close_range(lo, hi, 0) == 0) return;
  const long most = ::sysconf(_SC_OPEN_MAX);
  const long last = std::min<long>(hi, (most > 0 ? most : 65536) - 1);
  for (long fd = lo; fd <= last; ++fd) ::close(static_cast<int>(fd));
}

// A keeper whose ddprun is gone ends its rank's process group as ddprun would have (SIGTERM,
// then SIGKILL a second later), itself with it: nothing of the job outlives its launcher.
[[noreturn]] void end_orphaned_rank(pid_t prog) {
  ::kill(0, SIGTERM);  // the keeper ignores it
  for (int i = 0; i < 100; ++i) {
    int st;
    if (::waitpid(prog, &st, WNOHANG) != 0) break;
    ::usleep(10000);
  }
  ::kill(0, SIGKILL);
  ::_exit(128 + SIGKILL);
}

// Prints the rank's complete lines (all with `flush_all`), noting the last ddp error among them.
void emit(int rank, rank_proc& p, bool flush_all) {
  auto& pending = p.pending;
  auto line = [&](std::string_view l) {
    std::printf("[%d] %.*s\n", rank, static_cast<int>(l.size()), l.data());
    // (An elastic group's notes, "[ddp.elastic] ...", say what it survived, not why it failed.)
    if (const auto at = l.find("[ddp."); at != std::string_view::npos && l.substr(at, 13) != "[ddp.elastic]")
      p.last_error = l.substr(at, 400);
    if (l.find(ddprun::state_lost_text) != std::string_view::npos) p.said_lost = true;
  };
  std::size_t pos;
  while ((pos = pending.find('\n')) != std::string::npos) {
    line(std::string_view(pending).substr(0, pos));
    pending.erase(0, pos + 1);
  }
  if (flush_all && !pending.empty()) {
    line(pending);
    pending.clear();
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int n = -1;
  int port = 0;
  int nnodes = 1, node_rank = 0;
  bool addr_given = false, port_given = false, node_rank_given = false;
  std::string addr = "127.0.0.1";
  std::string timeout, job_id_opt;
  std::string store_url;  // --store URL (or DDP_STORE): the group's store on etcd; ddprun serves none
  bool bind_cores = false;
  int max_restarts = 0;
  std::string elastic;  // --elastic MIN:MAX
  // A whole decimal number in [lo, hi], or a usage error naming the option.
  auto number = [](const std::string& name, const std::string& v, long lo, long hi) {
    char* end = nullptr;
    errno = 0;
    const long x = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || errno != 0 || x < lo || x > hi)
      usage((name + " takes a number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], not '" + v + "'")
                .c_str());
    return static_cast<int>(x);
  };
  int i = 1;
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) -> std::string {
      if (i + 1 >= argc) usage((std::string(name) + " needs a value").c_str());
      return argv[++i];
    };
    if (a == "-n" || a == "--nproc" || a == "-np") n = number("-n", value("-n"), 1, 1 << 20);
    else if (a == "--master-addr") { addr = value("--master-addr"); addr_given = true; }
    else if (a == "--port") { port = number("--port", value("--port"), 0, 65535); port_given = port != 0; }
    else if (a == "--nnodes") nnodes = number("--nnodes", value("--nnodes"), 1, 1 << 20);
    else if (a == "--node-rank") {
      node_rank = number("--node-rank", value("--node-rank"), 0, 1 << 20);
      node_rank_given = true;
    }
    else if (a == "--job-id") job_id_opt = value("--job-id");
    else if (a == "--store") store_url = value("--store");
    else if (a == "--timeout") timeout = value("--timeout");
    else if (a == "--bind-cores") bind_cores = true;
    else if (a == "--max-restarts") max_restarts = number("--max-restarts", value("--max-restarts"), 0, 1 << 20);
    else if (a == "--elastic") elastic = value("--elastic");
    else if (a == "-h" || a == "--help") usage("help");
    else if (a == "--") { ++i; break; }
    else if (!a.empty() && a[0] == '-') usage(("unknown option " + a).c_str());
    else break;
  }
  if (n < 1) usage("-n must be a positive number of ranks");
  if (node_rank >= nnodes)
    usage(("--node-rank " + std::to_string(node_rank) + " is not below --nnodes " + std::to_string(nnodes)).c_str());
  if (store_url.empty())
    if (const char* e = std::getenv("DDP_STORE"); e != nullptr && *e != '\0') store_url = e;
  if (!store_url.empty()) {
    // The store is the cluster's: no host serves one, so no host needs the others' address.
#if !DDP_TOOLS_ETCD
    usage(("--store " + store_url.substr(0, 64) +
           ": this ddprun was built without the etcd backend (libcurl and nlohmann/json; docs/cluster.md)")
              .c_str());
#endif
    try {
      (void)ddp::store_backend_for(store_url, -1);
    } catch (const std::exception& e) {
      usage(e.what());
    }
    if (nnodes > 1 && job_id_opt.empty() && std::getenv("DDP_JOB_ID") == nullptr)
      usage("--store with --nnodes needs --job-id (or DDP_JOB_ID): the same on every host, and new for every job "
            "(it names the job's keys in the store)");
    if (nnodes > 1 && !node_rank_given) usage("--nnodes needs --node-rank (this host's number in [0, nnodes))");
    if (nnodes > 1 && !addr_given) addr = "127.0.0.1";  // unused by the ranks' store; their links listen where they reach it
  }
  if (nnodes > 1 && store_url.empty() && (!addr_given || !port_given || !node_rank_given)) {
    std::string missing;
    auto need = [&](bool given, const char* what) {
      if (!given) missing += (missing.empty() ? " " : "; ") + std::string(what);
    };
    need(addr_given, "--master-addr (the host of rank 0, as the other hosts reach it)");
    need(port_given,
         "--port (one fixed port, the same on every host: a port picked here would be unknown to the others)");
    need(node_rank_given, "--node-rank (this host's number in [0, nnodes), 0 on the master's host)");
    usage(("--nnodes " + std::to_string(nnodes) + " needs" + missing).c_str());
  }
  if (static_cast<long long>(n) * nnodes > (1 << 20)) usage("-n times --nnodes is larger than 1048576 ranks");
  if (i >= argc) usage("no program given");
  const int world = n * nnodes;
  if (!elastic.empty()) {
    const auto colon = elastic.find(':');
    const int lo = number("--elastic (its minimum)", elastic.substr(0, colon), 1, 1 << 20);
    const int hi = colon == std::string::npos ? lo : number("--elastic (its maximum)", elastic.substr(colon + 1), 1, 1 << 20);
    if (lo > hi || world < lo || world > hi)
      usage(("--elastic " + elastic + " must be MIN:MAX with MIN <= " + std::to_string(world) + " ranks <= MAX").c_str());
  }
  const int base = node_rank * n;  // global rank of this host's local rank 0
  try {
    if (port == 0) port = pick_port(addr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddprun: %s\n", e.what());
    return 2;
  }

  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // One job id for all ranks, so that a second job started on the same port is told apart.
  // Several hosts need the same id on all of them: given, or derived from what they share.
  std::string job_id = job_id_opt;
  const char* env_job_id = std::getenv("DDP_JOB_ID");
  if (job_id.empty() && env_job_id != nullptr) job_id = env_job_id;
  if (job_id.empty() && nnodes > 1)
    job_id = "ddprun-" + addr + ":" + std::to_string(port) + "-" + std::to_string(nnodes) + "x" + std::to_string(n);
  if (job_id.empty()) {
    std::random_device rd;
    char buf[32];
    std::snprintf(buf, sizeof buf, "ddprun-%08x%08x", rd(), rd());
    job_id = buf;
  }

  // The group's store, served here rather than by rank 0 (DDP_EXTERNAL_STORE=1 for the ranks):
  // then rank 0's loss leaves the store, and the failure record every survivor reads, in place.
  // Only where ddprun can serve it as rank 0 would: with the group's secret proven at every
  // connection (DDP_AUTH_TOKEN; ddprun built with libsodium), or without one on loopback unless
  // DDP_INSECURE=1. The user's DDP_EXTERNAL_STORE=0 keeps the store on rank 0. Every host
  // decides alike; host 0 serves it.
  const auto env_is = [](const char* name, const char* v) {
    const char* e = std::getenv(name);
    return e != nullptr && std::string(e) == v;
  };
  const char* token = std::getenv("DDP_AUTH_TOKEN");
  const bool secret = token != nullptr && *token != '\0';
  std::shared_ptr<const ddp::authenticator> store_auth;
  std::string no_auth = "this ddprun was built without libsodium and cannot prove the secret";
#if DDP_TOOLS_SODIUM
  if (secret) {
    try {
      ddp::install_authenticator(&ddp::sodium_authenticator::make);
      store_auth = ddp::make_authenticator(token, 0);
    } catch (const std::exception& e) {
      no_auth = std::string("ddprun cannot prove the secret: ") + e.what();
    }
  }
#endif
  bool loopback = false;
  try {
    for (const auto& ep : ddp::detail::resolve(addr, port, -1, true))
      loopback = loopback || ddp::detail::is_loopback(ep.addr);
  } catch (const std::exception&) {
  }
  const bool external_store = store_url.empty() && !env_is("DDP_EXTERNAL_STORE", "0") &&
                              (secret ? store_auth != nullptr : loopback || env_is("DDP_INSECURE", "1"));
  // An elastic group's store should outlive every rank: ddprun serves it where it can;
  // otherwise the group's rank 0 hosts it. On etcd (--store) nobody serves it.
  if (!elastic.empty() && !external_store && store_url.empty())
    std::fprintf(stderr, "ddprun: --elastic: the group's store stays on rank 0 (%s): the loss of rank 0 ends the job\n",
                 env_is("DDP_EXTERNAL_STORE", "0") ? "DDP_EXTERNAL_STORE=0"
                 : secret ? no_auth.c_str()
                          : "beyond loopback without a secret or DDP_INSECURE=1");
  // A store that outlives its jobs (etcd) may still hold the end of an earlier job under this
  // id: the ranks of a new job would take it for a running job that finished without them and
  // leave at once, reporting success for a job that never ran. A new job needs a new id.
  if (!store_url.empty()) {
    try {
      const auto until = ddp::steady_clock::now() + std::chrono::seconds(10);
      ddp::init_options o;
      o.store_url = store_url;
      o.job_id = ddp::detail::job_run_id(job_id, 0);
      o.timeout = std::chrono::seconds(10);
      auto c = ddp::connect_store(o, nullptr, until);
      if (c->check(ddp::detail::keys::done, until)) {
        std::fprintf(stderr,
                     "ddprun: the job '%s' already finished in the store %s: a new job needs a new --job-id "
                     "(DDP_JOB_ID)\n",
                     job_id.c_str(), c->where().c_str());
        return 2;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ddprun: cannot reach the group's store: %s\n", e.what());
      return 2;
    }
  }
  int used = 0;  // elastic: replacements and whole restarts so far, against --max-restarts
  for (int restart = 0;; ++restart) {
    if (restart > 0 && !port_given) {
      try {
        port = pick_port(addr);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ddprun: %s\n", e.what());
        return 2;
      }
    }
    const bool restart_left = restart < max_restarts;
    void* shared = ::mmap(nullptr, sizeof(exit_note) * static_cast<std::size_t>(n), PROT_READ | PROT_WRITE,
                          MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) { std::perror("ddprun: mmap"); return 2; }
    auto* notes = static_cast<exit_note*>(shared);
    for (int r = 0; r < n; ++r) new (&notes[r]) exit_note{};

    std::vector<rank_proc> procs(static_cast<std::size_t>(n));
    std::vector<ddprun::rank_life> lives;  // elastic: every process of this run, as started and ended
    // Starts local rank r (its keeper, then the program) in run `restart` of the job, with
    // DDP_RESTART_COUNT=count: the run's number, or in an elastic job 0 for the run's first
    // generation and the replacement's number (of all, > 0: a newcomer) for a replacement. False
    // when a pipe or a socket failed.
    auto spawn = [&](int r, int count) -> bool {
      new (&notes[r]) exit_note{};
      procs[static_cast<std::size_t>(r)] = rank_proc{};
      procs[static_cast<std::size_t>(r)].life = lives.size();
      lives.push_back({.slot = r, .start_ns = now_ns(), .replacement = !elastic.empty() && count > 0});
      int p[2];
      if (::pipe2(p, O_CLOEXEC) != 0) { std::perror("ddprun: pipe"); return false; }
      // The rank's end of the launcher's note (DDP_LAUNCHER_FD, ddp/group/detail/launcher.hpp): before
      // ending the ranks of this host because one failed, ddprun tells them which, so that the
      // group's failure names it and the other hosts do not blame the ranks ended here.
      int sv[2] = {-1, -1};
      if (nnodes > 1 && ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        std::perror("ddprun: socketpair");
        return false;
      }
      const pid_t launcher = ::getpid();
      const pid_t pid = ::fork();
      if (pid == 0) {
        // The keeper. Each rank leads its own process group, so ending a rank ends whatever it
        // started; the keeper outlives the program by a moment only, and ignores the signals
        // ddprun sends the group so that it can still write down how the program ended.
        ::setpgid(0, 0);
        ::dup2(p[1], 1);
        ::dup2(p[1], 2);
        // Of ddprun's descriptors it keeps the rank's own only: its output (1 and 2) and its end
        // of the launcher's note. A read end of an output pipe kept here (its own rank's, or an
        // earlier rank's) would leave a rank whose launcher died blocked in a write for ever;
        // the store's sockets would keep its port.
        if (sv[1] >= 0) {
          close_fds(3, static_cast<unsigned>(sv[1]) - 1);
          close_fds(static_cast<unsigned>(sv[1]) + 1, ~0U);
        } else {
          close_fds(3, ~0U);
        }
        // ddprun's death ends the rank: the kernel says so to the keeper (SIGHUP), which waits
        // for it and for the program's end (SIGCHLD) alike, both held until it looks, so that
        // neither is missed; ddprun's death before the ask shows in getppid().
        sigset_t watch, before;
        sigemptyset(&watch);
        sigaddset(&watch, SIGCHLD);
        sigaddset(&watch, SIGHUP);
        ::sigprocmask(SIG_BLOCK, &watch, &before);
        ::prctl(PR_SET_PDEATHSIG, SIGHUP);
        ::setenv("MASTER_ADDR", addr.c_str(), 1);
        ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
        ::setenv("RANK", std::to_string(base + r).c_str(), 1);
        ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
        ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
        ::setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
        // Run k > 0 of the job is "<job>+restart.k": a rank of a new run that finds the store of an
        // earlier one still on the port (another host's launcher has not ended it yet) waits for
        // it to go (group/detail/rendezvous.hpp, job_run). An elastic job's replacements join its
        // run (DDP_RESTART_COUNT > 0); it has a new run only when its state was lost.
        ::setenv("DDP_JOB_ID", ddp::detail::job_run_id(job_id, restart).c_str(), 1);
        ::setenv("DDP_RESTART_COUNT", std::to_string(count).c_str(), 1);
        if (external_store) ::setenv("DDP_EXTERNAL_STORE", "1", 1);
        if (!store_url.empty()) ::setenv("DDP_STORE", store_url.c_str(), 1);
        if (!elastic.empty()) ::setenv("DDP_ELASTIC", elastic.c_str(), 1);
        if (!timeout.empty()) ::setenv("DDP_TIMEOUT", timeout.c_str(), 1);
        if (sv[1] >= 0) {
          ::fcntl(sv[1], F_SETFD, 0);  // kept across exec: the program's
          ::setenv("DDP_LAUNCHER_FD", std::to_string(sv[1]).c_str(), 1);
        }
        struct sigaction ign{}, dfl{};
        ign.sa_handler = SIG_IGN;
        dfl.sa_handler = SIG_DFL;
        for (int sig : {SIGINT, SIGTERM}) sigaction(sig, &ign, nullptr);
        sigaction(SIGHUP, &dfl, nullptr);  // held, not ignored: it says that ddprun is gone
        const pid_t keeper = ::getpid();
        const pid_t prog = ::fork();
        if (prog == 0) {
          for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) sigaction(sig, &dfl, nullptr);
          ::sigprocmask(SIG_SETMASK, &before, nullptr);
          // And the keeper's death ends the program (a keeper killed alone leaves no rank behind).
          ::prctl(PR_SET_PDEATHSIG, SIGKILL);
          if (::getppid() != keeper) ::_exit(128 + SIGKILL);
          if (bind_cores) {
            cpu_set_t allowed, one;
            CPU_ZERO(&allowed);
            CPU_ZERO(&one);
            if (::sched_getaffinity(0, sizeof allowed, &allowed) == 0 && CPU_COUNT(&allowed) > 0) {
              const int k = r % CPU_COUNT(&allowed);
              for (int c = 0, seen = 0; c < CPU_SETSIZE; ++c)
                if (CPU_ISSET(c, &allowed) && seen++ == k) {
                  CPU_SET(c, &one);
                  break;
                }
              if (::sched_setaffinity(0, sizeof one, &one) != 0)
                std::fprintf(stderr, "ddprun: cannot bind rank %d to a core: %s\n", base + r, std::strerror(errno));
            }
          }
          ::execvp(argv[i], argv + i);
          std::fprintf(stderr, "ddprun: cannot run %s: %s\n", argv[i], std::strerror(errno));
          ::_exit(127);
        }
        int st = 127 << 8;
        while (prog > 0) {
          const pid_t w = ::waitpid(prog, &st, WNOHANG);
          if (w == prog || (w < 0 && errno != EINTR)) break;
          if (::getppid() != launcher) end_orphaned_rank(prog);
          siginfo_t si;
          (void)::sigwaitinfo(&watch, &si);
        }
        notes[r].at_ns = now_ns();
        notes[r].status = st;
        notes[r].done = 1;
        ::_exit(0);
      }
      ::close(p[1]);
      ::setpgid(pid, pid);
      procs[static_cast<std::size_t>(r)].pid = pid;
      procs[static_cast<std::size_t>(r)].out = p[0];
      if (sv[1] >= 0) {
        ::close(sv[1]);
        ::fcntl(sv[0], F_SETFL, O_NONBLOCK);
        procs[static_cast<std::size_t>(r)].note = sv[0];
      }
      return true;
    };
    for (int r = 0; r < n; ++r)
      if (!spawn(r, elastic.empty() ? restart : 0)) return 2;

    // Started once the ranks are forked (a fork while its thread runs could copy a held lock
    // into the keeper); the ranks retry until it answers, as they do for rank 0's.
    std::unique_ptr<ddp::store_server> store;
    if (external_store && node_rank == 0) {
      try {
        // An elastic group's generations claim their seats in namespaces of their own: no count.
        store = std::make_unique<ddp::store_server>(ddp::endpoint{addr, port}, 0, store_auth, ddp::store_limits{},
                                                    std::string(ddp::detail::keys::seat_prefix), elastic.empty() ? static_cast<std::uint32_t>(world) : 0u);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ddprun: cannot serve the group's store: %s\n", e.what());
      }
    }
    int exit_code = 0;
    int failed_rank = -1;
    bool terminating = false;
    std::int64_t ended_at = INT64_MAX;  // when ddprun began ending the ranks itself
    auto kill_deadline = std::chrono::steady_clock::time_point::max();
    auto end_all = [&](int sig) {
      for (auto& p : procs) ::kill(-p.pid, sig);
    };
    // The rank that failed first among those that ended before ddprun began ending them.
    auto first_failure = [&]() -> int {
      std::vector<ddprun::failed_rank> failed;
      for (int r = 0; r < n; ++r) {
        const auto& p = procs[static_cast<std::size_t>(r)];
        if (!p.ended || code_of(p.status) == 0 || p.at_ns >= ended_at) continue;
        failed.push_back(ddprun::failed_rank{r, p.at_ns, p.last_error});
      }
      return ddprun::first_cause(failed);
    };
    // Ranks fail together (the survivors of a lost rank fail because of it), and their keepers
    // may be scheduled late on a loaded machine: after the first failure is seen, wait a moment
    // for the others' notes before naming the first.
    constexpr auto settle = std::chrono::milliseconds(150);
    constexpr auto never = std::chrono::steady_clock::time_point::max();
    auto settle_until = never;
    auto describe = [&](int r) {
      const int st = procs[static_cast<std::size_t>(r)].status;
      return std::string(WIFEXITED(st) ? "exited with status " : "was killed by signal ") +
             std::to_string(WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
    };
    // Tells the ranks still running which rank failed first (a group on each records it as the
    // group's failure unless one was recorded before), and waits up to half a second for their
    // answers: then ending them blames nobody. Ranks that run no group do not answer.
    auto tell_cause = [&](int failed) {
      const std::string note =
          ddp::group_failure{ddp::errc::peer_lost,
                             "rank " + std::to_string(base + failed) + " " + describe(failed) +
                                 " (seen by its launcher, ddprun on node " + std::to_string(node_rank) +
                                 ", which then ended the other ranks of that node)",
                             -1, base + failed}
              .encode() +
          "\n";
      std::vector<int> waiting;
      for (std::size_t r = 0; r < procs.size(); ++r) {
        auto& p = procs[r];
        if (p.note < 0 || p.ended || static_cast<int>(r) == failed) continue;
        if (::send(p.note, note.data(), note.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(note.size()))
          waiting.push_back(p.note);
      }
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
      while (!waiting.empty() && std::chrono::steady_clock::now() < until) {
        std::vector<pollfd> pf;
        for (int fd : waiting) pf.push_back({fd, POLLIN, 0});
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
        if (::poll(pf.data(), pf.size(), static_cast<int>(std::max<long long>(1, left.count()))) <= 0) continue;
        std::vector<int> still;
        for (auto& q : pf) {
          if (q.revents == 0) { still.push_back(q.fd); continue; }
          char ack;
          (void)!::read(q.fd, &ack, 1);  // an answer, or the rank ended: either way done
        }
        waiting.swap(still);
      }
    };
    std::size_t running = procs.size();
    // Elastic: how each slot's last process ended, and when; the slots whose process ended with
    // a failure in this pass; whether a rank finished normally (the job is done); and when the
    // group's state was lost, the status to end with, and whether every rank starts again.
    std::vector<int> final_status(procs.size());
    std::vector<std::int64_t> final_at(procs.size());
    std::vector<int> ended_now;
    bool finished = false;
    int lost_code = 0;
    bool restart_all = false;
    // Whether the elastic group said that its job is done: "el/done" in its store, which
    // elastic_group::finish sets before its ranks end. Asked on a connection of its own, closed
    // at once (a rank 0 that hosts the store waits for its clients before it ends); false where
    // the store does not answer within a second, or where ddprun cannot prove the group's secret.
    auto group_said_done = [&]() -> bool {
      if (secret && !store_auth && store_url.empty()) return false;
      try {
        const auto until = ddp::steady_clock::now() + std::chrono::seconds(1);
        ddp::init_options o;
        o.master_addr = addr;
        o.master_port = port;
        o.external_store = external_store;
        o.store_url = store_url;
        o.job_id = ddp::detail::job_run_id(job_id, restart);
        o.timeout = std::chrono::seconds(1);
        auto c = ddp::connect_store(o, store_auth, until);
        return c->check(ddp::detail::keys::done, until);
      } catch (const std::exception&) {
        return false;
      }
    };
    // What the rank wrote before it ended, without waiting (a grandchild that still holds the
    // pipe open must not keep the launcher waiting): all of it, and the pipe closed, with `close`.
    auto drain = [&](std::size_t r, bool close) {
      auto& p = procs[r];
      if (p.out < 0) return;
      ::fcntl(p.out, F_SETFL, O_NONBLOCK);
      char buf[65536];
      ssize_t k;
      while ((k = ::read(p.out, buf, sizeof buf)) > 0) p.pending.append(buf, static_cast<std::size_t>(k));
      emit(base + static_cast<int>(r), p, close);
      if (close) {
        ::close(p.out);
        p.out = -1;
      }
    };
    while (running > 0) {
      std::vector<pollfd> pf;
      for (auto& p : procs)
        if (p.out >= 0) pf.push_back({p.out, POLLIN, 0});
      const bool settling = settle_until != never && !terminating;
      if (!pf.empty()) ::poll(pf.data(), pf.size(), settling ? 10 : 50);
      else ::usleep(settling ? 5000 : 20000);
      for (std::size_t r = 0; r < procs.size(); ++r) {
        auto& p = procs[r];
        if (p.out < 0) continue;
        char buf[65536];
        for (;;) {
          pollfd one{p.out, POLLIN, 0};
          if (::poll(&one, 1, 0) <= 0) break;
          const ssize_t k = ::read(p.out, buf, sizeof buf);
          if (k <= 0) { ::close(p.out); p.out = -1; emit(base + static_cast<int>(r), p, true); break; }
          p.pending.append(buf, static_cast<std::size_t>(k));
          emit(base + static_cast<int>(r), p, false);
        }
      }
      for (std::size_t r = 0; r < procs.size(); ++r) {
        auto& p = procs[r];
        if (!p.exited) {
          int st = 0;
          if (::waitpid(p.pid, &st, WNOHANG) == p.pid) {
            p.exited = true;
            --running;
            if (!notes[r].done.load()) {  // the keeper itself was killed
              p.ended = true;
              p.status = st;
              p.at_ns = now_ns();
            }
          }
        }
        if (!p.ended && notes[r].done.load()) {
          p.ended = true;
          p.status = notes[r].status.load();
          p.at_ns = notes[r].at_ns.load();
        }
        if (!elastic.empty()) {
          // Elastic: the group goes on without a failed rank; what becomes of its slot is
          // decided below, once every end seen in this pass is noted.
          if (!p.ended || !p.exited || p.handled) continue;
          p.handled = true;
          drain(r, false);  // its last lines: what it said, and whether the state is gone
          final_status[r] = p.status;
          final_at[r] = p.at_ns;
          auto& life = lives[p.life];
          life.end_ns = p.at_ns;
          life.code = code_of(p.status);
          life.said_lost = p.said_lost;
          if (life.code == 0) {
            finished = true;
          } else {
            ended_now.push_back(static_cast<int>(r));
            // Ranks fail together: decide once the others' ends are in too (the settle below).
            if (settle_until == never) settle_until = std::chrono::steady_clock::now() + settle;
          }
          continue;
        }
        if (p.ended && code_of(p.status) != 0 && settle_until == never)
          settle_until = std::chrono::steady_clock::now() + settle;
      }
      const bool settled = std::chrono::steady_clock::now() >= settle_until || running == 0;
      if (!elastic.empty() && settled) settle_until = never;
      if (!ended_now.empty() && settled && g_signal == 0 && !terminating) {
        // The job is done once a rank finished normally or the group said so: a rank that
        // fails then is not replaced (its replacement would find the job done and end normally,
        // hiding the failure), and its failure is its slot's last word.
        const bool done = finished || group_said_done();
        const auto state = done ? ddprun::state_verdict{} : ddprun::elastic_state(lives, n, nnodes == 1);
        if (state.lost) {
          // No rank is left to take a newcomer in: the job starts over, as after a failure
          // without --elastic, or ends.
          lost_code = std::max(1, state.code);
          // Replacements started once the state was gone never had a group to join: not counted.
          for (const auto& l : lives)
            if (l.replacement && l.start_ns >= state.gone_ns) --used;
          restart_all = used < max_restarts;
          if (restart_all) {
            ++used;
            std::fprintf(stderr, "ddprun: %s: restarting every rank (restart %d of %d)\n", state.why.c_str(), used,
                         max_restarts);
          } else {
            const std::string none_left =
                max_restarts > 0 ? " (no restart left of --max-restarts " + std::to_string(max_restarts) + ")" : "";
            std::fprintf(stderr, "ddprun: %s: ending the job%s\n", state.why.c_str(), none_left.c_str());
          }
          terminating = true;
          ended_at = now_ns();
          end_all(SIGTERM);
          kill_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        }
        for (const int r : ended_now) {
          if (state.lost) break;
          auto& p = procs[static_cast<std::size_t>(r)];
          const std::string said = p.last_error.empty() ? "" : " (" + p.last_error + ")";
          if (done) {
            std::fprintf(stderr, "ddprun: rank %d %s%s after the job was done: not replaced\n", base + r,
                         describe(r).c_str(), said.c_str());
            continue;
          }
          if (p.said_lost) {
            std::fprintf(stderr,
                         "ddprun: rank %d %s%s; not replaced: a newcomer would find nobody holding the group's state\n",
                         base + r, describe(r).c_str(), said.c_str());
            continue;
          }
          if (used >= max_restarts) {
            std::fprintf(stderr, "ddprun: rank %d %s; no replacement left (--max-restarts %d): the group goes on without it\n",
                         base + r, describe(r).c_str(), max_restarts);
            continue;
          }
          // A replacement takes its slot, and joins the group at its next step.
          drain(static_cast<std::size_t>(r), true);
          if (p.note >= 0) ::close(p.note);
          ++used;
          std::fprintf(stderr, "ddprun: rank %d %s%s; the group goes on without it and a replacement joins it (%d of %d)\n",
                       base + r, describe(r).c_str(), said.c_str(), used, max_restarts);
          if (!spawn(r, used)) return 2;
          ++running;
        }
      }
      if (settled) ended_now.clear();
      if (elastic.empty() && !terminating && settle_until != never && settled) {
        failed_rank = first_failure();
        if (failed_rank >= 0) {
          exit_code = code_of(procs[static_cast<std::size_t>(failed_rank)].status);
          // The cause, once: the rank that failed first, and what it said last when it said what
          // failed (a rank of another host, when this rank failed because of it).
          const auto& said = procs[static_cast<std::size_t>(failed_rank)].last_error;
          const std::string cause = describe(failed_rank) + (said.empty() ? "" : " (" + said + ")");
          if (restart_left)
            std::fprintf(stderr, "ddprun: rank %d %s; restarting every rank (restart %d of %d)\n",
                         base + failed_rank, cause.c_str(), restart + 1, max_restarts);
          else
            std::fprintf(stderr, "ddprun: rank %d %s; ending the other ranks%s\n", base + failed_rank,
                         describe(failed_rank).c_str(), nnodes > 1 ? " of this host" : "");
          if (nnodes > 1) tell_cause(failed_rank);
          terminating = true;
          ended_at = now_ns();
          end_all(SIGTERM);
          kill_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        }
      }
      if (g_signal != 0 && !terminating) {
        terminating = true;
        exit_code = 128 + g_signal;
        ended_at = now_ns();
        end_all(g_signal);
        kill_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      }
      if (terminating && std::chrono::steady_clock::now() > kill_deadline) end_all(SIGKILL);
    }
    for (std::size_t r = 0; r < procs.size(); ++r) drain(r, true);
    ::munmap(shared, sizeof(exit_note) * static_cast<std::size_t>(n));
    for (auto& p : procs)
      if (p.note >= 0) ::close(p.note);
    if (!elastic.empty()) {
      if (g_signal != 0) return 128 + g_signal;
      if (restart_all) continue;  // the group's state was lost: every rank starts again
      if (lost_code != 0) return lost_code;
      // A slot whose last process exited with an error fails the job (the first such by exit
      // time gives the status): a replacement ends a slot's failure only when it was started
      // while the job ran, and itself ended normally. Ranks killed and not replaced were
      // failures the group survived, as long as one rank finished normally.
      int first = -1, finished_slots = 0, signalled = 0;
      for (int r = 0; r < n; ++r) {
        const int st = final_status[static_cast<std::size_t>(r)];
        if (WIFEXITED(st) && WEXITSTATUS(st) != 0) {
          if (first < 0 || final_at[static_cast<std::size_t>(r)] < final_at[static_cast<std::size_t>(first)]) first = r;
        } else if (WIFEXITED(st)) {
          ++finished_slots;
        } else if (signalled == 0) {
          signalled = code_of(st);
        }
      }
      if (first >= 0) return WEXITSTATUS(final_status[static_cast<std::size_t>(first)]);
      return finished_slots > 0 ? 0 : signalled;
    }
    // A rank failed, no signal came to ddprun, and a restart is left: every rank starts again.
    if (exit_code == 0 || g_signal != 0 || !restart_left || failed_rank < 0) return exit_code;
  }
}
