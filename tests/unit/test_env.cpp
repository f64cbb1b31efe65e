#include <ddp/process_group.hpp>
#include <ddp/endpoint.hpp>

#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
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
  CHECK_THROWS_WITH_AS(parse({{"RANK", "two"}}), doctest::Contains("RANK='two'"), ddp::error);
  CHECK_THROWS_WITH_AS(parse({{"WORLD_SIZE", "4x"}}), doctest::Contains("WORLD_SIZE"), ddp::error);
  CHECK_THROWS_WITH_AS(parse({{"MASTER_PORT", "-5"}}), doctest::Contains("MASTER_PORT"), ddp::error);
  CHECK_THROWS_WITH_AS(parse({{"DDP_TIMEOUT", "0"}}), doctest::Contains("DDP_TIMEOUT"), ddp::error);
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
  if (w == "ompi") env = {{"OMPI_COMM_WORLD_SIZE", "1"}};
  if (w == "slurm") env = {{"SLURM_PROCID", "0"}};
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
