#include "distributed/launch.h"

#include <charconv>
#include <cstdlib>
#include <string_view>

#include <fmt/format.h>

#include "core/error.h"

namespace fp8t::distributed {

namespace {

// One launcher's variables.
struct LauncherVariables {
  const char* name;
  const char* world_size;
  const char* rank;
  const char* local_rank;  // optional
};

constexpr LauncherVariables kLaunchers[] = {
    {"OpenMPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"Slurm", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"},
    {"torchrun", "WORLD_SIZE", "RANK", "LOCAL_RANK"},
};

int whole_number(const char* name, const char* text, int at_least, int below) {
  const std::string_view value(text);
  int number = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), number);
  if (error != std::errc() || end != value.data() + value.size() || number < at_least ||
      number >= below) {
    throw ConfigError(fmt::format("{}={}: expected a whole number from {} to {}, found '{}'", name,
                                  value, at_least, below - 1, value));
  }
  return number;
}

// MASTER_ADDR, the port and the timeout of the TCP rendezvous.
void read_rendezvous(LaunchInfo& info, const std::function<const char*(const char*)>& read) {
  const char* address = read("MASTER_ADDR");
  const char* port = read("MASTER_PORT");
  const char* own_port = read("FP8TRAIN_RENDEZVOUS_PORT");
  if (address != nullptr) info.rendezvous_address = address;
  if (own_port != nullptr) {
    info.rendezvous_port = whole_number("FP8TRAIN_RENDEZVOUS_PORT", own_port, 1, 65536);
  } else if (port != nullptr) {
    const bool torchrun_store = read("TORCHELASTIC_USE_AGENT_STORE") != nullptr;
    info.rendezvous_port = whole_number("MASTER_PORT", port, 1, torchrun_store ? 65535 : 65536) +
                           (torchrun_store ? 1 : 0);
  }
  if (const char* timeout = read("FP8TRAIN_RENDEZVOUS_TIMEOUT"); timeout != nullptr) {
    info.rendezvous_timeout_seconds =
        whole_number("FP8TRAIN_RENDEZVOUS_TIMEOUT", timeout, 1, 24 * 3600 + 1);
  }
}

}  // namespace

std::string LaunchInfo::describe() const {
  if (!several()) return launcher;
  return fmt::format("rank {} of {} ({}, local rank {})", rank, world_size, launcher, local_rank);
}

LaunchInfo detect_launch(const std::function<const char*(const char*)>& variable) {
  const auto read = [&](const char* name) -> const char* {
    return variable ? variable(name) : std::getenv(name);
  };
  constexpr int kMaxRanks = 1 << 20;
  for (const LauncherVariables& launcher : kLaunchers) {
    const char* world_size = read(launcher.world_size);
    if (world_size == nullptr) continue;
    LaunchInfo info;
    info.launcher = launcher.name;
    info.world_size = whole_number(launcher.world_size, world_size, 1, kMaxRanks + 1);
    const char* rank = read(launcher.rank);
    if (rank == nullptr) {
      throw ConfigError(fmt::format("{} is set ({}) but {} is not: which rank is this process?",
                                    launcher.world_size, world_size, launcher.rank));
    }
    info.rank = whole_number(launcher.rank, rank, 0, info.world_size);
    const char* local_rank = read(launcher.local_rank);
    info.local_rank = local_rank != nullptr
                          ? whole_number(launcher.local_rank, local_rank, 0, info.world_size)
                          : 0;
    read_rendezvous(info, read);
    return info;
  }
  return {};
}

}  // namespace fp8t::distributed
