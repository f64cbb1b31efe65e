#include <ddp/process_group.hpp>

#include <doctest/doctest.h>

#include <map>

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
