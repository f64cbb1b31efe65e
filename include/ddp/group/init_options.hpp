#pragma once
/// \file group/init_options.hpp
/// `ddp::init_options`: how a process joins its group, given explicitly or read from the
/// environment that torchrun-style launchers, `ddprun`, `mpirun` (Open MPI, MPICH/PMI) and Slurm
/// set (`from_env`; the parsing is in group/detail/env.hpp). See docs/process-group.md.

#include <chrono>
#include <cstdlib>
#include <string>
#include <utility>

#include <ddp/version.hpp>
#include <ddp/group/backend.hpp>
#include <ddp/detail/compiled.hpp>
#include <ddp/group/detail/env.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// How a process joins its group. See docs/process-group.md.
///
/// \code
/// auto pg = ddp::init_process_group({.rank = 1, .world_size = 4, .master_addr = "10.0.0.1",
///                                    .master_port = 29500, .timeout = std::chrono::seconds(60)});
/// \endcode
struct init_options {
  int rank = 0;                                                 ///< this process, in [0, world_size)
  int world_size = 1;                                           ///< number of processes in the group
  std::string master_addr = "127.0.0.1";                        ///< host name, IPv4 or IPv6 address of rank 0
  int master_port = 29500;                                      ///< rank 0's store port
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};  ///< every blocking wait's bound
  std::string auth_token = {};  ///< shared secret; needs an authenticator (docs/security.md)
  int local_rank = -1;          ///< rank on this host, -1 when unknown
  std::string job_id = {};      ///< names the job; tells two jobs on one port apart (optional)
  /// Lets a group without a secret serve its store beyond loopback (any host that reaches the
  /// port could then join or disturb the group). Off by default; DDP_INSECURE=1 sets it.
  bool insecure = false;
  /// The default reducer's engine (`DDP_BACKEND`); `automatic` picks by topology.
  ddp::backend backend = ddp::backend::automatic;
  /// Says on stderr (rank 0) what the default reducer chose and why (`DDP_DEBUG=info`).
  bool debug_info = false;
  /// The heartbeat's lease (`DDP_HEARTBEAT_MS`); 0, the default, runs none. With a lease L the
  /// ranks beat to each other every L / 8 on connections of their own, and a rank silent for L
  /// (frozen, stopped, cut off) fails the group within about L, however long `timeout` is: every
  /// survivor's collective ends with errc::timeout naming it; a rank that died fails it at once
  /// (errc::peer_lost). Costs one thread and two connections per rank (docs/reliability.md).
  std::chrono::milliseconds heartbeat{0};
  /// The group's store is served by the launcher (`DDP_EXTERNAL_STORE=1`, which `ddprun` sets
  /// when it serves one), not by rank 0: rank 0 then only joins it, and its loss leaves the
  /// store, and the failure record the survivors read, in place. Every rank must agree.
  bool external_store = false;
  /// The group's store when it is not the built-in one (`DDP_STORE`): `etcd://h1:2379,h2:2379`
  /// with an optional `/prefix`, `user:password@` and `?tls=1` (docs/cluster.md; the program
  /// must include <ddp/etcd.hpp>). Then no process serves a store: rank 0 and the launcher only
  /// use it, like every rank, and master_addr/master_port are not needed. Empty: the built-in
  /// store at master_addr:master_port.
  std::string store_url = {};
  /// An elastic group's smallest and largest size (`DDP_ELASTIC=MIN:MAX`; 0: not elastic).
  /// Read by `ddp::elastic_group` (group/elastic.hpp, docs/elastic.md); a plain
  /// `init_process_group` refuses the mpi backend for an elastic group (errc::unsupported:
  /// MPI_COMM_WORLD cannot shrink).
  int elastic_min = 0;
  int elastic_max = 0;
  /// Bound on joining (rendezvous, the first barrier, the heartbeat's links) when shorter than
  /// `timeout`; 0: `timeout`. An elastic group's generations join within a few seconds, so that
  /// a member lost while one forms costs that long, not a whole timeout.
  std::chrono::milliseconds rendezvous_timeout{0};
  /// Prepended to every key this group writes in its store, so that several groups share one
  /// store apart (an elastic group's generations do). At most 64 characters.
  std::string key_prefix = {};

  /// Largest group: 2^20 ranks. Larger sizes are refused at once (errc::invalid_argument).
  static constexpr int max_world_size = 1 << 20;

  /// Reads the environment: `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`;
  /// when those are absent Open MPI's `OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK`, MPICH/PMI's
  /// `PMI_RANK/PMI_SIZE` (`MPI_LOCALRANKID`) and Slurm's `SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID`;
  /// `DDP_TIMEOUT` (seconds), `DDP_AUTH_TOKEN` and `DDP_JOB_ID` (set by `ddprun`), `DDP_BACKEND`
  /// (auto, shm, tcp, hierarchical, mpi, nccl), `DDP_DEBUG` (`info`), `DDP_HEARTBEAT_MS`
  /// (the heartbeat's lease in milliseconds, 0 for none), `DDP_EXTERNAL_STORE` (1: the
  /// launcher serves the store), `DDP_STORE` (etcd://...: the store on etcd, store_url) and
  /// `DDP_ELASTIC` (MIN:MAX, an elastic group's sizes). Throws
  /// errc::invalid_argument for a variable that is not a number or not a backend's name.
  ///
  /// In a rank that `srun` started (its rank is `SLURM_PROCID`), an absent `MASTER_ADDR` is
  /// the first host of `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`, `SLURM_NODELIST`;
  /// 127.0.0.1 when it names one host), and an absent `MASTER_PORT` is
  /// `12000 + (16 * SLURM_JOB_ID + SLURM_STEP_ID % 16) % 20000` (in [12000, 31999], below
  /// Linux's ephemeral ports), with `job_id` "slurm-<job>.<step>". A malformed node list is
  /// errc::invalid_argument too.
  static init_options from_env();

  /// The same, with a custom lookup (used by tests and by embedders with their own config).
  template <class Getenv>
  static init_options from_env(Getenv&& get) {
    init_options o;
    detail::read_env(o, get);
    return o;
  }

  /// Says once per process, on stderr, that no launcher set a rank: a program started by hand
  /// runs alone, which is easy to miss when several ranks were meant. `why`, when given, is
  /// what the environment did hold (a Slurm shell's variables).
  static void note_world_of_one(const char* why = nullptr) noexcept { detail::note_world_of_one(why); }

  /// The variables that hold the rank and the world size (name and value each; null names
  /// when no launcher set a rank). `first(names)` is the first of `names` set and not empty.
  /// Each launcher sets a pair: torchrun and ddprun `RANK`/`WORLD_SIZE`, Open MPI
  /// `OMPI_COMM_WORLD_RANK/SIZE`, MPICH `PMI_RANK`/`PMI_SIZE`, srun `SLURM_PROCID`/`SLURM_NTASKS`
  /// (with `--mpi=pmix`, `PMIX_RANK` beside them: PMIx puts no size in the environment). The
  /// first pair with either variable set is the one; half a pair is errc::invalid_argument
  /// naming the missing variable, and so is a local rank without its rank. Slurm's job-wide
  /// variables alone are a shell, not a task: `SLURM_NTASKS` without `SLURM_PROCID` (salloc,
  /// sbatch) and `SLURM_PROCID=0` without `SLURM_NTASKS` (a batch script) are a world of 1.
  template <class First>
  static std::pair<std::pair<const char*, const char*>, std::pair<const char*, const char*>> rank_and_size(
      First& first) {
    return detail::env_rank_and_size(first);
  }

  /// Cheap check before any socket is opened; empty when the options are usable.
  std::string validate() const {
    if (world_size < 1) return "world_size must be at least 1 (got " + std::to_string(world_size) + ")";
    if (world_size > max_world_size)
      return "world_size " + std::to_string(world_size) + " is larger than the " + std::to_string(max_world_size) +
             " ranks a group supports";
    if (rank < 0 || rank >= world_size)
      return "rank " + std::to_string(rank) + " is outside [0, " + std::to_string(world_size) + ")";
    if (master_port < 1 || master_port > 65535)
      return "master_port " + std::to_string(master_port) + " is outside [1, 65535]";
    if (master_addr.empty()) return "master_addr is empty";
    // A DNS name has at most 253 characters (RFC 1035); an address literal is shorter still.
    if (master_addr.size() > 253)
      return "master_addr of " + std::to_string(master_addr.size()) +
             " characters is longer than a host name may be (253)";
    if (timeout.count() <= 0) return "timeout must be positive";
    if (rendezvous_timeout.count() < 0) return "rendezvous_timeout must not be negative (0: timeout)";
    if (heartbeat.count() < 0) return "heartbeat must not be negative (0 runs none)";
    if (key_prefix.size() > 64) return "key_prefix is longer than 64 characters";
    if (elastic_max != 0 && (elastic_min < 1 || elastic_min > elastic_max))
      return "elastic sizes " + std::to_string(elastic_min) + ":" + std::to_string(elastic_max) +
             " are not MIN:MAX with 1 <= MIN <= MAX";
    return {};
  }
};

namespace detail {
/// errc::unsupported for an elastic group (`elastic_max` > 0) on a backend that cannot shrink
/// or grow (mpi); said by `init_process_group` and `elastic_group` alike. (nccl can: each
/// generation's nccl_reducer shrinks the last one's communicator or builds its own.)
inline void refuse_elastic_backend(const init_options& o) {
  if (o.elastic_max == 0 || o.backend != backend::mpi) return;
  raise(errc::unsupported, o.rank,
        "an elastic group (DDP_ELASTIC) with the mpi backend: it cannot shrink or grow (Open MPI 4.1 has no "
        "ULFM); use the default, tcp, shm, hierarchical or nccl");
}
}  // namespace detail

}  // namespace DDP_ABI
}  // namespace ddp

#if !defined(DDP_SEPARATE_COMPILATION)
#include <ddp/group/detail/init_options_impl.hpp>
#endif
