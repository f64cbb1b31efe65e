#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The environment parsing behind init_options::from_env (group/init_options.hpp): which
// launcher set the rank and the world size (torchrun and ddprun, Open MPI's mpirun, MPICH/PMI,
// srun with or without PMIx), what a Slurm task derives from Slurm's own variables, and the
// DDP_* variables. Each function here is the body of the init_options member that names it;
// the rules and the messages are documented there and in docs/process-group.md.

#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <ddp/group/detail/slurm.hpp>
#include <ddp/error.hpp>
#include <ddp/group/backend.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// init_options::note_world_of_one: says once per process that no launcher set a rank.
inline void note_world_of_one(const char* why = nullptr) noexcept {
  static std::atomic<bool> said{false};
  if (said.exchange(true)) return;
  std::fputs(
      "ddp: no rank in the environment (RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE or "
      "SLURM_PROCID/NTASKS)",
      stderr);
  if (why) {
    std::fputs(": ", stderr);
    std::fputs(why, stderr);
  }
  std::fputs(
      ": running as a world of 1 (rank 0); start the ranks with ddprun, torchrun, mpirun or srun to run "
      "more\n",
      stderr);
}

/// init_options::rank_and_size: the launcher's pair of variables that hold the rank and the
/// world size; `first(names)` is the first of `names` set and not empty.
template <class First>
std::pair<std::pair<const char*, const char*>, std::pair<const char*, const char*>> env_rank_and_size(First& first) {
  using var = std::pair<const char*, const char*>;
  const auto half = [](var set, const char* missing, const char* launcher) {
    detail::raise(errc::invalid_argument, -1,
                  std::string("environment variable ") + set.first + "='" + set.second + "' is set but " + missing +
                      " is not: " + launcher + "; set " + missing + " too, or unset " + set.first +
                      " (the other half would be a default: rank 0, or a world of 1)");
  };
  struct pair_of {
    const char *rank, *size, *local, *launcher;
  };
  static constexpr pair_of pairs[] = {
      {"RANK", "WORLD_SIZE", "LOCAL_RANK", "torchrun and ddprun set RANK, WORLD_SIZE and LOCAL_RANK"},
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "Open MPI's mpirun sets OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE"},
      {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPICH's mpiexec sets PMI_RANK and PMI_SIZE"}};
  for (const auto& p : pairs) {
    const var r = first({p.rank}), s = first({p.size});
    if (r.first && s.first) return {r, s};
    if (r.first) half(r, p.size, p.launcher);
    if (s.first) half(s, p.rank, p.launcher);
  }
  const var procid = first({"SLURM_PROCID"}), ntasks = first({"SLURM_NTASKS"});
  if (const var pmix = first({"PMIX_RANK"}); pmix.first) {
    if (ntasks.first) return {pmix, ntasks};
    detail::raise(errc::invalid_argument, -1,
                  std::string("environment variable PMIX_RANK='") + pmix.second +
                      "' is set but no world size is: PMIx puts none in the environment; start the ranks with srun "
                      "--mpi=pmix (which sets SLURM_NTASKS) or Open MPI's mpirun (OMPI_COMM_WORLD_SIZE), or set "
                      "RANK and WORLD_SIZE");
  }
  if (procid.first && ntasks.first) return {procid, ntasks};
  if (procid.first && std::string_view(procid.second) != "0")
    half(procid, "SLURM_NTASKS", "srun sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID");
  // What is left names no rank; a local rank then belongs to a pair that is not there.
  for (const auto& p : pairs)
    if (const var l = first({p.local}); l.first)
      detail::raise(errc::invalid_argument, -1,
                    std::string("environment variable ") + l.first + "='" + l.second + "' is set but " + p.rank +
                        " and " + p.size + " are not: " + p.launcher + "; set " + p.rank + " and " + p.size +
                        " too, or unset " + l.first);
  if (procid.first)
    note_world_of_one("SLURM_PROCID=0 without SLURM_NTASKS is a batch script's own process, not an srun task");
  else if (ntasks.first)
    note_world_of_one("SLURM_NTASKS without SLURM_PROCID is a shell of salloc or sbatch, not an srun task");
  else
    note_world_of_one();
  return {};
}

/// init_options::from_env(get): sets in `o` (an init_options) what the environment that `get`
/// reads says, and leaves the rest as it is.
template <class Options, class Getenv>
void read_env(Options& o, Getenv& get) {
  auto first = [&](std::initializer_list<const char*> names) -> std::pair<const char*, const char*> {
    for (const char* n : names) {
      const char* v = get(n);
      if (v != nullptr && *v != '\0') return {n, v};
    }
    return {nullptr, nullptr};
  };
  auto as_int = [](std::pair<const char*, const char*> nv, long long lo, long long hi) -> long long {
    long long x = 0;
    const std::string_view s(nv.second);
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
    if (ec != std::errc() || p != s.data() + s.size() || x < lo || x > hi)
      detail::raise(errc::invalid_argument, -1,
                    std::string("environment variable ") + nv.first + "='" + nv.second + "' is not an integer in [" +
                        std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return x;
  };
  // The rank and the world size come from one launcher's pair of variables, never half from
  // one and half from a default: a rank without its world size would run as a world of 1
  // (docs/getting-started.md, "Environment variables").
  const auto vars = env_rank_and_size(first);
  const auto rank_var = vars.first, size_var = vars.second;
  if (rank_var.first) o.rank = static_cast<int>(as_int(rank_var, -(1LL << 31), (1LL << 31) - 1));
  if (size_var.first) o.world_size = static_cast<int>(as_int(size_var, -(1LL << 31), (1LL << 31) - 1));
  if (auto v = first({"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}); v.first)
    o.local_rank = static_cast<int>(as_int(v, 0, (1LL << 31) - 1));
  if (auto v = first({"MASTER_ADDR"}); v.first) o.master_addr = v.second;
  if (auto v = first({"MASTER_PORT"}); v.first) o.master_port = static_cast<int>(as_int(v, 1, 65535));
  // A rank that Slurm started: what MASTER_ADDR and MASTER_PORT do not say comes from Slurm's
  // own variables, so that `srun -n 4 ./prog` needs nothing set by hand (docs/process-group.md).
  // The rank is Slurm's when it is SLURM_PROCID, or the PMI rank `srun --mpi=pmi2/pmix` sets
  // beside it in a step (same rank, same size). Ranks that mpirun or mpiexec started inside an
  // allocation inherit a SLURM_PROCID that is not theirs (the batch script's, a daemon's), so
  // nothing is derived for them.
  const auto procid = first({"SLURM_PROCID"});
  const auto ntasks = first({"SLURM_NTASKS"});
  auto same = [](std::pair<const char*, const char*> a, std::pair<const char*, const char*> b) {
    return a.second != nullptr && b.second != nullptr && std::string_view(a.second) == b.second;
  };
  const std::string_view rank_name = rank_var.first ? rank_var.first : "";
  if (procid.first && (rank_name == "SLURM_PROCID" ||
                       ((rank_name == "PMI_RANK" || rank_name == "PMIX_RANK") && first({"SLURM_STEP_ID"}).first &&
                        same(rank_var, procid) && same(size_var, ntasks)))) {
    if (!first({"MASTER_ADDR"}).first)
      if (auto v = first({"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}); v.first) {
        // Slurm starts task 0 on the list's first host; when that is the only host, every
        // rank is on it and the store stays on loopback.
        auto hosts = detail::parse_slurm_hostlist(v.first, v.second);
        o.master_addr = hosts.several ? std::move(hosts.first) : "127.0.0.1";
      }
    if (auto job = first({"SLURM_JOB_ID"}); job.first && !first({"MASTER_PORT"}).first) {
      const auto step = first({"SLURM_STEP_ID"});
      const long long j = as_int(job, 0, 0xffffffffLL), s = step.first ? as_int(step, 0, 0xffffffffLL) : 0;
      o.master_port = detail::slurm_port(static_cast<std::uint64_t>(j), static_cast<std::uint64_t>(s));
      // Names the step, so a stale store of another step on the same port is told apart
      // (DDP_JOB_ID, read below, wins).
      o.job_id = "slurm-" + std::to_string(j) + "." + std::to_string(s);
    }
  }
  if (auto v = first({"DDP_TIMEOUT"}); v.first) o.timeout = std::chrono::seconds(as_int(v, 1, 1LL << 31));
  if (auto v = first({"DDP_HEARTBEAT_MS"}); v.first) o.heartbeat = std::chrono::milliseconds(as_int(v, 0, 1LL << 31));
  if (auto v = first({"DDP_AUTH_TOKEN"}); v.first) o.auth_token = v.second;
  if (auto v = first({"DDP_JOB_ID"}); v.first) o.job_id = v.second;
  if (auto v = first({"DDP_INSECURE"}); v.first) o.insecure = as_int(v, 0, 1) == 1;
  if (auto v = first({"DDP_EXTERNAL_STORE"}); v.first) o.external_store = as_int(v, 0, 1) == 1;
  if (auto v = first({"DDP_STORE"}); v.first && *v.second != '\0') o.store_url = v.second;
  if (auto v = first({"DDP_ELASTIC"}); v.first) {
    // "MIN:MAX", or "N" for N:N: the sizes an elastic group may take (group/elastic.hpp).
    const std::string s = v.second;
    const auto colon = s.find(':');
    const std::string a = s.substr(0, colon), b = colon == std::string::npos ? a : s.substr(colon + 1);
    o.elastic_min = static_cast<int>(as_int({"DDP_ELASTIC (its minimum)", a.c_str()}, 1, 1 << 20));
    o.elastic_max = static_cast<int>(as_int({"DDP_ELASTIC (its maximum)", b.c_str()}, 1, 1 << 20));
  }
  if (auto v = first({"DDP_BACKEND"}); v.first) {
    const auto b = parse_backend(v.second);
    if (!b)
      detail::raise(errc::invalid_argument, -1,
                    std::string("environment variable DDP_BACKEND='") + v.second +
                        "' names no backend: use auto, shm, tcp, hierarchical, mpi or nccl");
    o.backend = *b;
  }
  if (auto v = first({"DDP_DEBUG"}); v.first) {
    const std::string_view d(v.second);
    o.debug_info = d == "info" || d == "INFO" || d == "1" || d == "detail" || d == "DETAIL";
  }
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
