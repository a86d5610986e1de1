// The launch environment: each launcher's variables, their precedence, and errors that name the
// variable and its value.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "core/error.h"
#include "distributed/launch.h"

namespace fp8t::distributed {
namespace {

// An environment of its own, so the test does not depend on how it was started.
struct Environment {
  std::map<std::string, std::string> values;
  LaunchInfo detect() const {
    return detect_launch([this](const char* name) -> const char* {
      const auto found = values.find(name);
      return found == values.end() ? nullptr : found->second.c_str();
    });
  }
};

std::string error_of(const Environment& environment) {
  try {
    environment.detect();
  } catch (const ConfigError& error) {
    return error.what();
  }
  return "no error";
}

TEST(Launch, WithoutLauncherVariablesIsASingleProcess) {
  const LaunchInfo info = Environment{}.detect();
  EXPECT_FALSE(info.several());
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.describe(), "single process");
}

TEST(Launch, ReadsEachLauncher) {
  const LaunchInfo mpi = Environment{
      {{"OMPI_COMM_WORLD_SIZE", "4"},
       {"OMPI_COMM_WORLD_RANK", "3"},
       {"OMPI_COMM_WORLD_LOCAL_RANK",
        "1"}}}.detect();
  EXPECT_EQ(mpi.launcher, "OpenMPI");
  EXPECT_EQ(mpi.rank, 3);
  EXPECT_EQ(mpi.world_size, 4);
  EXPECT_EQ(mpi.local_rank, 1);
  EXPECT_EQ(mpi.describe(), "rank 3 of 4 (OpenMPI, local rank 1)");

  const LaunchInfo slurm =
      Environment{{{"SLURM_NTASKS", "8"}, {"SLURM_PROCID", "5"}, {"SLURM_LOCALID", "5"}}}.detect();
  EXPECT_EQ(slurm.launcher, "Slurm");
  EXPECT_EQ(slurm.rank, 5);
  EXPECT_EQ(slurm.local_rank, 5);

  // torchrun without LOCAL_RANK: local rank 0.
  const LaunchInfo torchrun = Environment{{{"WORLD_SIZE", "2"}, {"RANK", "1"}}}.detect();
  EXPECT_EQ(torchrun.launcher, "torchrun");
  EXPECT_EQ(torchrun.rank, 1);
  EXPECT_EQ(torchrun.world_size, 2);
  EXPECT_EQ(torchrun.local_rank, 0);
}

TEST(Launch, OpenMpiComesBeforeSlurmAndSlurmBeforeTorchrun) {
  // mpirun inside a Slurm allocation: the MPI ranks are this job's.
  const LaunchInfo info = Environment{
      {{"OMPI_COMM_WORLD_SIZE", "2"},
       {"OMPI_COMM_WORLD_RANK", "1"},
       {"SLURM_NTASKS", "1"},
       {"SLURM_PROCID", "0"},
       {"WORLD_SIZE", "16"},
       {"RANK", "7"}}}.detect();
  EXPECT_EQ(info.launcher, "OpenMPI");
  EXPECT_EQ(info.world_size, 2);
  const LaunchInfo slurm =
      Environment{{{"SLURM_NTASKS", "3"}, {"SLURM_PROCID", "2"}, {"WORLD_SIZE", "16"}}}.detect();
  EXPECT_EQ(slurm.launcher, "Slurm");
  EXPECT_EQ(slurm.rank, 2);
}

TEST(Launch, BadValuesNameTheVariable) {
  EXPECT_EQ(error_of({{{"WORLD_SIZE", "2"}, {"RANK", "2"}}}),
            "RANK=2: expected a whole number from 0 to 1, found '2'");
  EXPECT_EQ(error_of({{{"WORLD_SIZE", "two"}, {"RANK", "0"}}}),
            "WORLD_SIZE=two: expected a whole number from 1 to 1048576, found 'two'");
  EXPECT_EQ(error_of({{{"SLURM_NTASKS", "0"}, {"SLURM_PROCID", "0"}}}),
            "SLURM_NTASKS=0: expected a whole number from 1 to 1048576, found '0'");
  EXPECT_EQ(error_of({{{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1 "}}}),
            "OMPI_COMM_WORLD_RANK=1 : expected a whole number from 0 to 1, found '1 '");
  EXPECT_EQ(error_of({{{"WORLD_SIZE", "2"}}}),
            "WORLD_SIZE is set (2) but RANK is not: which rank is this process?");
}

// Where ranks without MPI meet: MASTER_ADDR:MASTER_PORT, the port overridden by
// FP8TRAIN_RENDEZVOUS_PORT, or one above torchrun's own store; the wait from
// FP8TRAIN_RENDEZVOUS_TIMEOUT.
TEST(Launch, ReadsTheRendezvous) {
  const std::map<std::string, std::string> torchrun = {
      {"WORLD_SIZE", "2"}, {"RANK", "1"}, {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29500"}};
  const LaunchInfo plain = Environment{torchrun}.detect();
  EXPECT_EQ(plain.rendezvous_address, "node7");
  EXPECT_EQ(plain.rendezvous_port, 29500);
  EXPECT_EQ(plain.rendezvous_timeout_seconds, 300.0);

  Environment elastic{torchrun};
  elastic.values["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  EXPECT_EQ(elastic.detect().rendezvous_port, 29501);
  elastic.values["FP8TRAIN_RENDEZVOUS_PORT"] = "40000";
  elastic.values["FP8TRAIN_RENDEZVOUS_TIMEOUT"] = "20";
  EXPECT_EQ(elastic.detect().rendezvous_port, 40000);
  EXPECT_EQ(elastic.detect().rendezvous_timeout_seconds, 20.0);

  const LaunchInfo unset = Environment{{{"WORLD_SIZE", "2"}, {"RANK", "0"}}}.detect();
  EXPECT_TRUE(unset.rendezvous_address.empty());
  EXPECT_EQ(unset.rendezvous_port, 0);

  Environment bad{torchrun};
  bad.values["MASTER_PORT"] = "70000";
  EXPECT_EQ(error_of(bad),
            "MASTER_PORT=70000: expected a whole number from 1 to 65535, found '70000'");
}

}  // namespace
}  // namespace fp8t::distributed
