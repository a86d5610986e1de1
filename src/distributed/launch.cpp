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
    return info;
  }
  return {};
}

}  // namespace fp8t::distributed
