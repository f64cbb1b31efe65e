#include <ddp/process_group.hpp>
#include <ddp/endpoint.hpp>

#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <set>
#include <string>

namespace {
ddp::init_options parse(const std::map<std::string, std::string>& env) {
  return ddp::init_options::from_env([&](const char* n) -> const char* {
    auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}
}  // namespace

TEST_CASE("torchrun-style variables") {
  auto o = parse({{"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "1234"}, {"RANK", "3"}, {"WORLD_SIZE", "8"},
                  {"LOCAL_RANK", "1"}, {"DDP_TIMEOUT", "7"}, {"DDP_AUTH_TOKEN", "s3cret"}});
  CHECK(o.master_addr == "10.1.2.3");
  CHECK(o.master_port == 1234);
  CHECK(o.rank == 3);
  CHECK(o.world_size == 8);
  CHECK(o.local_rank == 1);
  CHECK(o.timeout == std::chrono::seconds(7));
  CHECK(o.auth_token == "s3cret");
  CHECK(o.validate().empty());
}

TEST_CASE("defaults when nothing is set") {
  auto o = parse({});
  CHECK(o.rank == 0);
  CHECK(o.world_size == 1);
  CHECK(o.master_addr == "127.0.0.1");
  CHECK(o.master_port == 29500);
  CHECK(o.local_rank == -1);
  CHECK(o.validate().empty());
}

TEST_CASE("Open MPI, MPICH/PMI and Slurm variables, in that order of precedence") {
  auto ompi = parse({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                     {"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "16"}});
  CHECK(ompi.rank == 2);
  CHECK(ompi.world_size == 4);
  CHECK(ompi.local_rank == 0);
  auto pmi = parse({{"PMI_RANK", "5"}, {"PMI_SIZE", "6"}, {"MPI_LOCALRANKID", "2"}});
  CHECK(pmi.rank == 5);
  CHECK(pmi.world_size == 6);
  CHECK(pmi.local_rank == 2);
  auto slurm = parse({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"}});
  CHECK(slurm.rank == 9);
  CHECK(slurm.world_size == 16);
  CHECK(slurm.local_rank == 1);
  // The explicit torch-style variables win over the launcher's.
  auto both = parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}});
  CHECK(both.rank == 1);
  CHECK(both.world_size == 2);
}

TEST_CASE("IPv6 and host names are kept as given") {
  CHECK(parse({{"MASTER_ADDR", "::1"}}).master_addr == "::1");
  CHECK(parse({{"MASTER_ADDR", "[fe80::1]"}}).master_addr == "[fe80::1]");
  CHECK(parse({{"MASTER_ADDR", "node-17.cluster"}}).master_addr == "node-17.cluster");
}

TEST_CASE("malformed numbers name the variable") {
  CHECK_THROWS_WITH_AS(parse({{"RANK", "two"}, {"WORLD_SIZE", "4"}}), doctest::Contains("RANK='two' is not an integer"),
                       ddp::error);
  CHECK_THROWS_WITH_AS(parse({{"RANK", "0"}, {"WORLD_SIZE", "4x"}}), doctest::Contains("WORLD_SIZE='4x' is not an integer"),
                       ddp::error);
  CHECK_THROWS_WITH_AS(parse({{"MASTER_PORT", "-5"}}), doctest::Contains("MASTER_PORT"), ddp::error);
  CHECK_THROWS_WITH_AS(parse({{"DDP_TIMEOUT", "0"}}), doctest::Contains("DDP_TIMEOUT"), ddp::error);
}

TEST_CASE("hardening: ports are range-checked before any cast; host names longer than DNS allows are refused") {
  // 2^31 once wrapped to a negative port, under a message that advertised [0, 2147483648].
  for (const char* port : {"2147483648", "65536", "0", "4294967297"}) {
    CAPTURE(port);
    const std::string text = std::string("MASTER_PORT='") + port + "' is not an integer in [1, 65535]";
    CHECK_THROWS_WITH_AS(parse({{"MASTER_PORT", port}}), doctest::Contains(text.c_str()), ddp::error);
  }
  CHECK(parse({{"MASTER_PORT", "65535"}}).master_port == 65535);
  ddp::init_options o;
  o.master_port = 29500;
  o.master_addr = std::string(1'000'000, 'a');
  CHECK(o.validate() == "master_addr of 1000000 characters is longer than a host name may be (253)");
  o.master_addr = std::string(253, 'a');
  CHECK(o.validate().empty());
}

TEST_CASE("hardening: a NUL byte in an error's text is written as \\0, and nothing after it is lost") {
  const ddp::error e(ddp::errc::mismatch, 2, std::string("parameter 'emb\0edded' differs", 29));
  CHECK(std::string(e.what()) == "[ddp.mismatch] rank 2: parameter 'emb\\0edded' differs");
  CHECK(e.message() == "parameter 'emb\\0edded' differs");
}

TEST_CASE("validate() explains what is wrong") {
  ddp::init_options o;
  o.world_size = 4;
  o.rank = 4;
  CHECK(o.validate().find("rank 4 is outside [0, 4)") != std::string::npos);
  o.rank = 0;
  o.master_port = 65536;
  CHECK(o.validate().find("master_port") != std::string::npos);
  o.master_port = 1;
  o.world_size = 0;
  CHECK(o.validate().find("world_size") != std::string::npos);
}

namespace {
// Runs this test program again, only the case `name`, and returns what it wrote to stderr. A
// fresh process: the note is said once per process, and earlier cases here may have said it.
std::string stderr_of_case(const char* name, const char* env) {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(p[1], 2);
    ::close(p[0]);
    ::close(p[1]);
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 1);
    ::setenv("DDP_TEST_ENV_CHILD", env, 1);
    const std::string filter = std::string("-tc=") + name;
    ::execl("/proc/self/exe", "unit_env", filter.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(p[1]);
  std::string out;
  char buf[4096];
  ssize_t k;
  while ((k = ::read(p[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(k));
  ::close(p[0]);
  int st = 0;
  ::waitpid(pid, &st, 0);
  CHECK((WIFEXITED(st) && WEXITSTATUS(st) == 0));
  return out;
}

std::size_t count(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (auto p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}
}  // namespace

// Runs only in the child started by the case below (DDP_TEST_ENV_CHILD names the environment).
TEST_CASE("env child: from_env three times") {
  const char* which = std::getenv("DDP_TEST_ENV_CHILD");
  if (which == nullptr) return;
  const std::string w = which;
  std::map<std::string, std::string> env{{"MASTER_PORT", "1234"}};
  if (w == "torchrun") env = {{"RANK", "0"}, {"WORLD_SIZE", "1"}};
  if (w == "ompi") env = {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}};
  if (w == "slurm") env = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}};
  if (w == "salloc") env = {{"SLURM_NTASKS", "4"}, {"SLURM_JOB_ID", "7"}};
  if (w == "batch") env = {{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}, {"SLURM_JOB_ID", "7"}};
  for (int i = 0; i < 3; ++i) (void)parse(env);
}

TEST_CASE("no rank environment at all: said once on stderr that the program runs as a world of 1") {
  const auto err = stderr_of_case("env child: from_env three times", "none");
  CHECK(count(err, "world of 1") == 1);
  CHECK(err.find("RANK/WORLD_SIZE") != std::string::npos);
  // A launcher's variables (any of them) mean the world size is meant: nothing is said.
  for (const char* env : {"torchrun", "ompi", "slurm"}) {
    CAPTURE(env);
    CHECK(count(stderr_of_case("env child: from_env three times", env), "world of 1") == 0);
  }
  // Slurm's job-wide variables without a task's: a shell, not a rank; the note says which.
  const auto salloc = stderr_of_case("env child: from_env three times", "salloc");
  CHECK(count(salloc, "world of 1") == 1);
  CHECK(salloc.find("SLURM_NTASKS without SLURM_PROCID is a shell of salloc or sbatch") != std::string::npos);
  const auto batch = stderr_of_case("env child: from_env three times", "batch");
  CHECK(count(batch, "world of 1") == 1);
  CHECK(batch.find("SLURM_PROCID=0 without SLURM_NTASKS is a batch script's own process") != std::string::npos);
}

namespace {
// The message of from_env's error for `env`, after checking that it is errc::invalid_argument.
std::string env_error(const std::map<std::string, std::string>& env) {
  try {
    (void)parse(env);
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::invalid_argument);
    return e.what();
  }
  FAIL("from_env accepted a partial rank environment");
  return {};
}
}  // namespace

TEST_CASE("a partial rank environment is refused, naming the variable that is missing") {
  // RANK alone used to run as a world of 1 on rank 0 (and rank 1 failed with "outside [0, 1)").
  auto msg = env_error({{"RANK", "1"}, {"MASTER_ADDR", "10.0.0.1"}});
  CHECK(msg.find("environment variable RANK='1' is set but WORLD_SIZE is not") != std::string::npos);
  CHECK(msg.find("set WORLD_SIZE too, or unset RANK") != std::string::npos);
  msg = env_error({{"WORLD_SIZE", "4"}});
  CHECK(msg.find("environment variable WORLD_SIZE='4' is set but RANK is not") != std::string::npos);
  msg = env_error({{"LOCAL_RANK", "1"}});
  CHECK(msg.find("environment variable LOCAL_RANK='1' is set but RANK and WORLD_SIZE are not") != std::string::npos);
  // Half of torchrun's pair is refused even where another launcher's pair is complete: which
  // one was meant is not known.
  msg = env_error({{"RANK", "1"}, {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  CHECK(msg.find("RANK='1' is set but WORLD_SIZE is not") != std::string::npos);
  // Each launcher family names its own pair.
  msg = env_error({{"OMPI_COMM_WORLD_RANK", "2"}});
  CHECK(msg.find("OMPI_COMM_WORLD_RANK='2' is set but OMPI_COMM_WORLD_SIZE is not") != std::string::npos);
  msg = env_error({{"OMPI_COMM_WORLD_SIZE", "8"}});
  CHECK(msg.find("OMPI_COMM_WORLD_SIZE='8' is set but OMPI_COMM_WORLD_RANK is not") != std::string::npos);
  msg = env_error({{"OMPI_COMM_WORLD_LOCAL_RANK", "0"}});
  CHECK(msg.find("OMPI_COMM_WORLD_LOCAL_RANK='0' is set but OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE are not") !=
        std::string::npos);
  msg = env_error({{"PMI_RANK", "3"}});
  CHECK(msg.find("PMI_RANK='3' is set but PMI_SIZE is not") != std::string::npos);
  msg = env_error({{"PMI_SIZE", "3"}});
  CHECK(msg.find("PMI_SIZE='3' is set but PMI_RANK is not") != std::string::npos);
  msg = env_error({{"MPI_LOCALRANKID", "1"}});
  CHECK(msg.find("MPI_LOCALRANKID='1' is set but PMI_RANK and PMI_SIZE are not") != std::string::npos);
  msg = env_error({{"PMIX_RANK", "1"}});
  CHECK(msg.find("PMIX_RANK='1' is set but no world size is") != std::string::npos);
  CHECK(msg.find("SLURM_NTASKS") != std::string::npos);
  msg = env_error({{"SLURM_PROCID", "3"}, {"SLURM_LOCALID", "1"}});
  CHECK(msg.find("SLURM_PROCID='3' is set but SLURM_NTASKS is not") != std::string::npos);
  // An empty variable counts as absent.
  msg = env_error({{"RANK", "1"}, {"WORLD_SIZE", ""}});
  CHECK(msg.find("RANK='1' is set but WORLD_SIZE is not") != std::string::npos);
}

TEST_CASE("launchers that set only part of a family keep working") {
  // torchrun-style without LOCAL_RANK (ranks started by hand).
  auto o = parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
  CHECK(o.rank == 1);
  CHECK(o.world_size == 2);
  CHECK(o.local_rank == -1);
  // srun --mpi=pmix: PMIX_RANK and Slurm's size, no PMIX size variable.
  o = parse({{"PMIX_RANK", "3"}, {"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}});
  CHECK(o.rank == 3);
  CHECK(o.world_size == 4);
  // An salloc or sbatch shell: the job's SLURM_NTASKS, no task; a world of 1, not rank 0 of 4
  // waiting for ranks that never come.
  o = parse({{"SLURM_NTASKS", "4"}, {"SLURM_JOB_ID", "7"}});
  CHECK(o.rank == 0);
  CHECK(o.world_size == 1);
  // A batch script's own process without --ntasks: SLURM_PROCID=0 (and SLURM_LOCALID=0) alone.
  o = parse({{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}});
  CHECK(o.rank == 0);
  CHECK(o.world_size == 1);
  CHECK(o.validate().empty());
}

TEST_CASE("DDP_JOB_ID names the job") {
  CHECK(parse({{"DDP_JOB_ID", "run-7"}}).job_id == "run-7");
  CHECK(parse({}).job_id.empty());
}

TEST_CASE("DDP_INSECURE opts in to a store beyond loopback without a secret") {
  CHECK(parse({{"DDP_INSECURE", "1"}}).insecure);
  CHECK_FALSE(parse({{"DDP_INSECURE", "0"}}).insecure);
  CHECK_FALSE(parse({}).insecure);
  CHECK_THROWS_WITH_AS(parse({{"DDP_INSECURE", "yes"}}), doctest::Contains("DDP_INSECURE"), ddp::error);
}

TEST_CASE("an impossible WORLD_SIZE is refused by validate(), not discovered by an allocation") {
  auto o = parse({{"RANK", "1"}, {"WORLD_SIZE", "2147483647"}});
  CHECK(o.world_size == 2147483647);
  CHECK(o.validate().find("world_size 2147483647 is larger than the 1048576 ranks a group supports") !=
        std::string::npos);
  o.world_size = ddp::init_options::max_world_size;
  CHECK(o.validate().empty());
}

// ddp::endpoint: the public host + port a store_server binds (ground layer, no resolution).
TEST_CASE("endpoint: parse and format host:port, IPv6 in brackets") {
  const auto v6 = ddp::endpoint::parse("[::1]:29500");
  CHECK(v6.host == "::1");
  CHECK(v6.port == 29500);
  CHECK(v6.to_string() == "[::1]:29500");
  const auto named = ddp::endpoint::parse("node7:0");
  CHECK(named == ddp::endpoint{"node7", 0});
  CHECK(named.to_string() == "node7:0");
  CHECK(ddp::endpoint{"10.0.0.1", 29500}.to_string() == "10.0.0.1:29500");
  CHECK(ddp::endpoint{"", 80}.to_string() == ":80");
  CHECK(ddp::endpoint::parse(":80") == ddp::endpoint{"", 80});
  for (const char* bad : {"::1:80", "host", "host:", "host:70000", "host:-1", "host:8x", "[::1]80", "[::1"}) {
    CAPTURE(bad);
    try {
      (void)ddp::endpoint::parse(bad);
      FAIL("parsed");
    } catch (const ddp::error& e) {
      CHECK(e.condition() == ddp::errc::invalid_argument);
      CHECK(std::string(e.what()).find(std::string("endpoint '") + bad + "'") != std::string::npos);
    }
  }
}

// Under srun: the master and its port come from Slurm's variables when MASTER_ADDR/MASTER_PORT
// are absent (docs/process-group.md, "Running under Slurm").
namespace {
// What srun sets for task `rank` of a step, with `nodes` as every node list variable.
std::map<std::string, std::string> srun_env(const std::string& nodes, const std::string& rank = "1") {
  return {{"SLURM_PROCID", rank},        {"SLURM_NTASKS", "8"},    {"SLURM_LOCALID", "1"},
          {"SLURM_JOB_ID", "4242"},      {"SLURM_STEP_ID", "3"},   {"SLURM_STEP_NODELIST", nodes},
          {"SLURM_JOB_NODELIST", nodes}, {"SLURM_NODELIST", nodes}};
}
std::string master_of(const std::string& nodes) { return parse(srun_env(nodes)).master_addr; }
}  // namespace

TEST_CASE("slurm: the master is the first host of the step's node list, in Slurm's compressed syntax") {
  CHECK(master_of("node[01-04,07],gpu3") == "node01");
  CHECK(master_of("host-[1-3]") == "host-1");
  CHECK(master_of("node[009-011]") == "node009");            // the lower bound's zero padding
  CHECK(master_of("node[04,01-03]") == "node04");            // the order as written
  CHECK(master_of("rack[1-2]-n[001-008]") == "rack1-n001");  // several bracketed groups
  CHECK(master_of("gpu3,node[01-04]") == "gpu3");
  CHECK(master_of("a.example.org,b.example.org") == "a.example.org");
  CHECK(master_of("n[1-2]x") == "n1x");
  CHECK(master_of("c1,c2") == "c1");
  // One host: every rank is on it, and the store stays on loopback.
  for (const char* one : {"gpu3", "node[07]", "node[5-5]", "node-17.cluster"}) {
    CAPTURE(one);
    CHECK(master_of(one) == "127.0.0.1");
  }
  // The step's list first (a step may use part of the job's nodes), then the job's.
  auto env = srun_env("step[1-2]");
  env["SLURM_JOB_NODELIST"] = "job[1-4]";
  env["SLURM_NODELIST"] = "old[1-4]";
  CHECK(parse(env).master_addr == "step1");
  env.erase("SLURM_STEP_NODELIST");
  CHECK(parse(env).master_addr == "job1");
  env.erase("SLURM_JOB_NODELIST");
  CHECK(parse(env).master_addr == "old1");
  env.erase("SLURM_NODELIST");
  CHECK(parse(env).master_addr == "127.0.0.1");
  // The rank, size and local rank are Slurm's, as before.
  const auto o = parse(srun_env("node[01-04]", "5"));
  CHECK(o.rank == 5);
  CHECK(o.world_size == 8);
  CHECK(o.local_rank == 1);
  CHECK(o.validate().empty());
}

TEST_CASE("slurm: the port is derived from the job and step ids, the same on every rank") {
  const auto a = parse(srun_env("node[01-04]", "0"));
  const auto b = parse(srun_env("node[01-04]", "7"));
  CHECK(a.master_port == 12000 + (16 * 4242 + 3) % 20000);
  CHECK(a.master_port == b.master_port);  // every rank of the step agrees
  CHECK(a.job_id == "slurm-4242.3");      // and names the step
  CHECK(b.job_id == a.job_id);
  CHECK(a.validate().empty());
  // Another step of the same job, another job: another port.
  auto step = srun_env("node[01-04]");
  step["SLURM_STEP_ID"] = "4";
  CHECK(parse(step).master_port == a.master_port + 1);
  CHECK(parse(step).job_id == "slurm-4242.4");
  auto job = srun_env("node[01-04]");
  job["SLURM_JOB_ID"] = "4243";
  CHECK(parse(job).master_port != a.master_port);
  // No step id (a batch script's own environment): step 0.
  auto batch = srun_env("node[01-04]", "0");
  batch.erase("SLURM_STEP_ID");
  CHECK(parse(batch).master_port == 12000 + (16 * 4242) % 20000);
  // In [12000, 31999] for any ids Slurm hands out (32-bit; the batch step is 4294967294),
  // distinct for steps 0-15 of a job and for jobs less than 1250 apart.
  std::set<int> seen;
  for (std::uint64_t j : {0ull, 1ull, 1249ull, 4242ull, 4294967295ull})
    for (std::uint64_t s : {0ull, 1ull, 15ull, 16ull, 4294967294ull}) {
      const int p = ddp::detail::slurm_port(j, s);
      CHECK(p >= 12000);
      CHECK(p <= 31999);
    }
  for (std::uint64_t j = 100000; j < 101250; ++j)
    for (std::uint64_t s = 0; s < 16; ++s) seen.insert(ddp::detail::slurm_port(j, s));
  CHECK(seen.size() == 1250 * 16);
}

TEST_CASE("slurm: explicit MASTER_ADDR, MASTER_PORT and DDP_JOB_ID win") {
  auto env = srun_env("node[01-04]");
  env["MASTER_ADDR"] = "10.0.0.9";
  env["SLURM_STEP_NODELIST"] = "node[01-";  // not even read
  auto o = parse(env);
  CHECK(o.master_addr == "10.0.0.9");
  CHECK(o.master_port == 12000 + (16 * 4242 + 3) % 20000);
  env.erase("MASTER_ADDR");
  env["SLURM_STEP_NODELIST"] = "node[01-04]";
  env["MASTER_PORT"] = "23456";
  o = parse(env);
  CHECK(o.master_addr == "node01");
  CHECK(o.master_port == 23456);
  CHECK(o.job_id.empty());  // the port is the user's: so is the job
  env.erase("MASTER_PORT");
  env["DDP_JOB_ID"] = "mine";
  CHECK(parse(env).job_id == "mine");
}

TEST_CASE("slurm: nothing is derived for ranks that Slurm did not start") {
  // An salloc shell: a job, but no task (a world of 1).
  auto o = parse({{"SLURM_JOB_ID", "4242"}, {"SLURM_JOB_NODELIST", "node[01-04]"}, {"SLURM_NTASKS", "2"}});
  CHECK(o.world_size == 1);
  CHECK(o.master_addr == "127.0.0.1");
  CHECK(o.master_port == 29500);
  CHECK(o.job_id.empty());
  // mpirun inside an allocation: the ranks inherit a daemon's SLURM_PROCID.
  auto env = srun_env("node[01-04]", "0");
  env["OMPI_COMM_WORLD_RANK"] = "0";
  env["OMPI_COMM_WORLD_SIZE"] = "8";
  o = parse(env);
  CHECK(o.master_addr == "127.0.0.1");
  CHECK(o.master_port == 29500);
  // mpiexec (PMI) inside a batch script: the script's SLURM_PROCID=0 and no step, on every
  // rank alike (rank 0's PMI_RANK equals it, and still nothing is derived).
  for (const char* r : {"0", "1"}) {
    CAPTURE(r);
    env = {{"PMI_RANK", r},       {"PMI_SIZE", "8"},        {"SLURM_PROCID", "0"},
           {"SLURM_NTASKS", "8"}, {"SLURM_JOB_ID", "4242"}, {"SLURM_JOB_NODELIST", "node[01-04]"}};
    o = parse(env);
    CHECK(o.master_addr == "127.0.0.1");
    CHECK(o.master_port == 29500);
  }
  // mpiexec's proxies started by srun, one per node: the ranks inherit a proxy's step.
  env = srun_env("node[01-04]", "1");
  env["SLURM_NTASKS"] = "4";
  env["PMI_RANK"] = "5";
  env["PMI_SIZE"] = "8";
  o = parse(env);
  CHECK(o.rank == 5);
  CHECK(o.master_addr == "127.0.0.1");
  CHECK(o.master_port == 29500);
  // srun --mpi=pmi2 / --mpi=pmix: the PMI rank is Slurm's own.
  env = srun_env("node[01-04]");
  env["PMI_RANK"] = "1";
  env["PMI_SIZE"] = "8";
  CHECK(parse(env).master_addr == "node01");
  env.erase("PMI_RANK");
  env.erase("PMI_SIZE");
  env["PMIX_RANK"] = "1";
  CHECK(parse(env).master_addr == "node01");
}

TEST_CASE("slurm: a malformed node list or job id names the variable and its value") {
  for (const char* bad : {"node[01-", "node[]", "node[3-1]", "a,,b", "a,", ",a", "no de", "node[a-b]",
                          "node[1-2]]", "node[[1]]", "node[1:2]", "node[-2]", "node[1-]", "", "node[01-04"}) {
    CAPTURE(bad);
    auto env = srun_env("ok[1-2]");
    env["SLURM_STEP_NODELIST"] = bad;
    if (*bad == '\0') {  // an empty variable counts as absent: the job's list is used
      CHECK(parse(env).master_addr == "ok1");
      continue;
    }
    try {
      (void)parse(env);
      FAIL("parsed");
    } catch (const ddp::error& e) {
      CHECK(e.condition() == ddp::errc::invalid_argument);
      CHECK(std::string(e.what()).find(std::string("SLURM_STEP_NODELIST='") + bad + "' is not a Slurm host list") !=
            std::string::npos);
    }
  }
  auto env = srun_env("node[01-04]");
  env["SLURM_JOB_ID"] = "12x";
  CHECK_THROWS_WITH_AS(parse(env), doctest::Contains("SLURM_JOB_ID='12x'"), ddp::error);
  env["SLURM_JOB_ID"] = "4242";
  env["SLURM_STEP_ID"] = "batch";
  CHECK_THROWS_WITH_AS(parse(env), doctest::Contains("SLURM_STEP_ID='batch'"), ddp::error);
}

TEST_CASE("DDP_ELASTIC gives an elastic group's sizes; validate() checks them") {
  auto o = parse({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"DDP_ELASTIC", "2:4"}});
  CHECK(o.elastic_min == 2);
  CHECK(o.elastic_max == 4);
  CHECK(o.validate().empty());
  o = parse({{"DDP_ELASTIC", "3"}});
  CHECK(o.elastic_min == 3);
  CHECK(o.elastic_max == 3);
  CHECK(parse({}).elastic_max == 0);
  CHECK_THROWS_WITH_AS(parse({{"DDP_ELASTIC", "2:x"}}), doctest::Contains("DDP_ELASTIC (its maximum)='x'"), ddp::error);
  CHECK_THROWS_WITH_AS(parse({{"DDP_ELASTIC", "0:4"}}), doctest::Contains("DDP_ELASTIC (its minimum)='0'"), ddp::error);
  o = parse({{"DDP_ELASTIC", "4:2"}});
  CHECK(o.validate() == "elastic sizes 4:2 are not MIN:MAX with 1 <= MIN <= MAX");
  o = ddp::init_options{};
  o.key_prefix = std::string(65, 'k');
  CHECK(o.validate() == "key_prefix is longer than 64 characters");
}
