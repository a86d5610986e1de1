// How this process was started: alone, or as one rank of several, read from the variables the
// launchers set: OpenMPI's mpirun (OMPI_COMM_WORLD_*), Slurm's srun (SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID) and torchrun-style launchers (RANK, WORLD_SIZE, LOCAL_RANK). Checked in that
// order; the first launcher whose world-size variable is set decides. Ranks that cannot meet
// through MPI meet over TCP at MASTER_ADDR:MASTER_PORT.
#pragma once

#include <functional>
#include <string>

namespace fp8t::distributed {

struct LaunchInfo {
  std::string launcher = "single process";  // or "OpenMPI", "Slurm", "torchrun"
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // the rank among this node's processes: which GPU to take
  // Where the ranks meet over TCP when they do not through MPI: rank 0's host (MASTER_ADDR) and
  // port: FP8TRAIN_RENDEZVOUS_PORT when set, else MASTER_PORT, or MASTER_PORT + 1 under torchrun,
  // whose own store holds MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE). Empty: not set.
  std::string rendezvous_address;
  int rendezvous_port = 0;
  // How long the ranks wait for each other there: FP8TRAIN_RENDEZVOUS_TIMEOUT seconds (300).
  double rendezvous_timeout_seconds = 300.0;

  bool several() const { return world_size > 1; }
  // "single process", or "rank 1 of 4 (OpenMPI, local rank 1)".
  std::string describe() const;
};

// Reads the environment through `variable` (std::getenv by default). Throws fp8t::ConfigError
// naming the variable and its value when a value is not a whole number in range (a rank outside
// 0 .. world size − 1, a world size below 1) or a launcher's rank variable is missing.
LaunchInfo detect_launch(const std::function<const char*(const char*)>& variable = {});

}  // namespace fp8t::distributed
