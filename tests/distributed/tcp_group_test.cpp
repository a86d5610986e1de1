// The TCP transport between ranks: each rank a forked process on 127.0.0.1. Collectives against
// results computed here from the same seeds (in rank order, so sums match to the bit), buffers of
// several chunks, and every failure a rank can meet: a mismatched world size or configuration, a
// rank that never arrives, one that stops mid-collective, a port in use, no rank 0.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include "core/error.h"
#include "distributed/tcp_group.h"

namespace fp8t::distributed {
namespace {

using Clock = std::chrono::steady_clock;

// A port nothing listens on: the kernel picks it for a socket bound to port 0.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw Error(fmt::format("socket: {}", std::strerror(errno)));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    ::close(fd);
    throw Error(fmt::format("bind/getsockname: {}", std::strerror(errno)));
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

TcpRendezvous local(int port, double timeout_seconds = 30) {
  return {"127.0.0.1", port, timeout_seconds};
}

// gtest's assertions in a child process do not reach the parent: a child prints what failed and
// reports it in its exit code.
class ChildChecks {
 public:
  explicit ChildChecks(int rank) : rank_(rank) {}
  void expect(bool ok, const std::string& what) {
    if (ok) return;
    std::fprintf(stderr, "rank %d: %s\n", rank_, what.c_str());
    ++failures_;
  }
  void expect_contains(const std::string& text, const std::string& part) {
    expect(text.find(part) != std::string::npos,
           fmt::format("expected an error containing '{}', found '{}'", part, text));
  }
  int exit_code() const { return failures_ == 0 ? 0 : 1; }

 private:
  int rank_;
  int failures_ = 0;
};

// Runs body(rank) for each rank in `ranks` in a process of its own and returns their exit codes
// (128 + the signal for a killed one). A child that hangs is ended by its alarm.
std::vector<int> run_ranks(const std::vector<int>& ranks, const std::function<int(int)>& body) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> children;
  for (const int rank : ranks) {
    const pid_t child = ::fork();
    if (child < 0) throw Error(fmt::format("fork: {}", std::strerror(errno)));
    if (child == 0) {
      ::alarm(30);
      int code = 2;
      try {
        code = body(rank);
      } catch (const std::exception& error) {
        std::fprintf(stderr, "rank %d: unexpected error: %s\n", rank, error.what());
      }
      ::_exit(code);
    }
    children.push_back(child);
  }
  std::vector<int> codes;
  for (const pid_t child : children) {
    int status = 0;
    if (::waitpid(child, &status, 0) != child) {
      throw Error(fmt::format("waitpid: {}", std::strerror(errno)));
    }
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

std::vector<int> run_ranks(int world_size, const std::function<int(int)>& body) {
  std::vector<int> ranks(static_cast<size_t>(world_size));
  for (int rank = 0; rank < world_size; ++rank) {
    ranks[static_cast<size_t>(rank)] = rank;
  }
  return run_ranks(ranks, body);
}

std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    return error.what();
  }
  return "no error";
}

// Each rank's values, fresh per rank and reproducible from the rank.
template <typename T>
std::vector<T> values_of(int rank, size_t count, unsigned test) {
  std::mt19937 generator(test * 1000 + static_cast<unsigned>(rank));
  std::vector<T> values(count);
  if constexpr (std::is_floating_point_v<T>) {
    std::uniform_real_distribution<T> distribution(-1, 1);
    for (T& value : values) {
      value = distribution(generator);
    }
  } else {
    std::uniform_int_distribution<T> distribution(-1000000, 1000000);
    for (T& value : values) {
      value = distribution(generator);
    }
  }
  return values;
}

// What the group must give: every rank's values combined in rank order.
template <typename T, typename Combine>
std::vector<T> expected(int world_size, size_t count, unsigned test, Combine combine) {
  std::vector<T> result = values_of<T>(0, count, test);
  for (int rank = 1; rank < world_size; ++rank) {
    const std::vector<T> theirs = values_of<T>(rank, count, test);
    for (size_t i = 0; i < count; ++i) {
      result[i] = combine(result[i], theirs[i]);
    }
  }
  return result;
}

template <typename T>
T plus(T a, T b) {
  return a + b;
}

template <typename T>
T larger(T a, T b) {
  return b > a ? b : a;
}

template <typename T>
size_t count_differences(const std::vector<T>& got, const std::vector<T>& want) {
  size_t differences = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    differences += got[i] != want[i];
  }
  return differences;
}

TEST(TcpGroup, SingleRankOpensNoSocketAndKeepsValues) {
  TcpGroup group(0, 1, local(0), 42);
  std::vector<float> values{1.5f, -2.0f};
  group.sum(values.data(), values.size());
  group.max(values.data(), values.size());
  group.barrier();
  EXPECT_EQ(values, (std::vector<float>{1.5f, -2.0f}));
}

TEST(TcpGroup, RejectsARankOutsideTheWorld) {
  EXPECT_NE(error_of([] {
              TcpGroup{3, 3, local(free_port()), 0};
            }).find("found rank 3 of 3"),
            std::string::npos);
}

TEST(TcpGroup, ThreeRanksSumAndMaxInRankOrder) {
  constexpr int kRanks = 3;
  constexpr size_t kCount = 1001;
  const int port = free_port();
  const std::vector<int> codes = run_ranks(kRanks, [&](int rank) {
    ChildChecks checks(rank);
    TcpGroup group(rank, kRanks, local(port), 7);

    std::vector<float> floats = values_of<float>(rank, kCount, 1);
    group.sum(floats.data(), floats.size());
    checks.expect(floats == expected<float>(kRanks, kCount, 1, plus<float>), "float sum differs");

    std::vector<double> doubles = values_of<double>(rank, kCount, 2);
    group.sum(doubles.data(), doubles.size());
    checks.expect(doubles == expected<double>(kRanks, kCount, 2, plus<double>),
                  "double sum differs");

    std::vector<float> maxima = values_of<float>(rank, kCount, 3);
    maxima[5] = rank == 1 ? std::numeric_limits<float>::quiet_NaN() : maxima[5];
    group.max(maxima.data(), maxima.size());
    std::vector<float> want = expected<float>(kRanks, kCount, 3, larger<float>);
    checks.expect(std::isnan(maxima[5]), "a NaN on rank 1 did not win max");
    maxima[5] = want[5] = 0;
    checks.expect(maxima == want, "float max differs");

    std::vector<int> ints = values_of<int>(rank, kCount, 4);
    group.max(ints.data(), ints.size());
    checks.expect(ints == expected<int>(kRanks, kCount, 4, larger<int>), "int max differs");

    // Nothing to move is still a collective every rank takes part in.
    group.sum(static_cast<float*>(nullptr), 0);
    return checks.exit_code();
  });
  EXPECT_EQ(codes, std::vector<int>(kRanks, 0));
}

TEST(TcpGroup, BuffersOfSeveralChunks) {
  constexpr int kRanks = 3;
  // Two whole chunks and a partial one.
  constexpr size_t kFloats = 2 * TcpGroup::kChunkBytes / sizeof(float) + 17;
  constexpr size_t kInts = TcpGroup::kChunkBytes / sizeof(int) + 3;
  const int port = free_port();
  const std::vector<int> codes = run_ranks(kRanks, [&](int rank) {
    ChildChecks checks(rank);
    TcpGroup group(rank, kRanks, local(port), 7);
    std::vector<float> floats = values_of<float>(rank, kFloats, 5);
    group.sum(floats.data(), floats.size());
    const size_t differences =
        count_differences(floats, expected<float>(kRanks, kFloats, 5, plus<float>));
    checks.expect(differences == 0, fmt::format("{} of {} sums differ", differences, kFloats));
    std::vector<int> ints = values_of<int>(rank, kInts, 6);
    group.max(ints.data(), ints.size());
    checks.expect(ints == expected<int>(kRanks, kInts, 6, larger<int>), "int max differs");
    return checks.exit_code();
  });
  EXPECT_EQ(codes, std::vector<int>(kRanks, 0));
}

TEST(TcpGroup, BroadcastsRank0sBytesAndBarrierWaitsForEveryRank) {
  constexpr int kRanks = 3;
  constexpr int kRounds = 6;
  // Shared between the processes: which rank entered which round's barrier.
  static_assert(std::atomic<int>::is_always_lock_free);
  void* shared = ::mmap(nullptr, sizeof(std::atomic<int>) * kRanks * kRounds,
                        PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(shared, MAP_FAILED) << std::strerror(errno);
  auto* entered = static_cast<std::atomic<int>*>(shared);
  for (int i = 0; i < kRanks * kRounds; ++i) {
    new (&entered[i]) std::atomic<int>(0);
  }

  const int port = free_port();
  const std::vector<int> codes = run_ranks(kRanks, [&](int rank) {
    ChildChecks checks(rank);
    TcpGroup group(rank, kRanks, local(port), 7);

    std::vector<unsigned char> id(128, 0);
    const std::vector<int> rank0_id = values_of<int>(0, id.size(), 7);
    if (rank == 0) {
      for (size_t i = 0; i < id.size(); ++i) {
        id[i] = static_cast<unsigned char>(rank0_id[i]);
      }
    }
    group.broadcast(id.data(), id.size());
    for (size_t i = 0; i < id.size(); ++i) {
      checks.expect(id[i] == static_cast<unsigned char>(rank0_id[i]),
                    fmt::format("id byte {} differs", i));
    }

    std::vector<unsigned char> large(TcpGroup::kChunkBytes + 3, static_cast<unsigned char>(rank));
    group.broadcast(large.data(), large.size());
    checks.expect(large == std::vector<unsigned char>(large.size(), 0), "large broadcast differs");

    for (int round = 0; round < kRounds; ++round) {
      // One rank comes late each round; nobody may leave the barrier before it entered.
      if (round % kRanks == rank) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      entered[round * kRanks + rank].store(1);
      group.barrier();
      for (int other = 0; other < kRanks; ++other) {
        checks.expect(entered[round * kRanks + other].load() == 1,
                      fmt::format("left round {}'s barrier before rank {} entered", round, other));
      }
    }
    return checks.exit_code();
  });
  ::munmap(shared, sizeof(std::atomic<int>) * kRanks * kRounds);
  EXPECT_EQ(codes, std::vector<int>(kRanks, 0));
}

// Each rank's values, of several chunks in all, land at its place on every rank; a count that
// differs between the ranks is named.
TEST(TcpGroup, AllGatherPlacesEveryRanksValuesInRankOrder) {
  constexpr int kRanks = 3;
  constexpr size_t kCount = TcpGroup::kChunkBytes / sizeof(float) + 5;
  const int port = free_port();
  const std::vector<int> codes = run_ranks(kRanks, [&](int rank) {
    ChildChecks checks(rank);
    TcpGroup group(rank, kRanks, local(port), 7);
    const std::vector<float> own = values_of<float>(rank, kCount, 8);
    std::vector<float> all(kRanks * kCount, std::numeric_limits<float>::quiet_NaN());
    group.all_gather(own.data(), all.data(), kCount * sizeof(float));
    for (int from = 0; from < kRanks; ++from) {
      const std::vector<float> want = values_of<float>(from, kCount, 8);
      const size_t differences = count_differences(
          std::vector<float>(all.begin() + from * kCount, all.begin() + (from + 1) * kCount), want);
      checks.expect(differences == 0,
                    fmt::format("{} values of rank {} differ", differences, from));
    }
    const std::string error = error_of([&] {
      std::vector<float> more(rank == 2 ? 4 : 3), gathered(kRanks * 4);
      group.all_gather(more.data(), gathered.data(), more.size() * sizeof(float));
    });
    if (rank == 0) {
      checks.expect_contains(error,
                             "rank 2 called all-gather of 16 bytes per rank while rank 0 "
                             "called all-gather of 12 bytes per rank");
    } else {
      checks.expect_contains(error, "rank 0 closed its connection");
    }
    return checks.exit_code();
  });
  EXPECT_EQ(codes, std::vector<int>(kRanks, 0));
}

TEST(TcpGroup, WorldSizeMismatchFailsOnBothSides) {
  const int port = free_port();
  const std::vector<int> codes = run_ranks(2, [&](int rank) {
    ChildChecks checks(rank);
    const int world_size = rank == 0 ? 2 : 3;
    const std::string error = error_of([&] { TcpGroup{rank, world_size, local(port), 7}; });
    checks.expect_contains(error, "rank 1 was started with world size 3, rank 0 with 2");
    return checks.exit_code();
  });
  EXPECT_EQ(codes, std::vector<int>(2, 0));
}

TEST(TcpGroup, ConfigurationMismatchFailsOnBothSides) {
  const int port = free_port();
  const std::vector<int> codes = run_ranks(2, [&](int rank) {
    ChildChecks checks(rank);
    const uint64_t job_hash = rank == 0 ? 0xaa : 0xbb;
    const std::string error = error_of([&] { TcpGroup{rank, 2, local(port), job_hash}; });
    checks.expect_contains(error,
                           "rank 1's configuration differs from rank 0's (hash 00000000000000bb "
                           "vs 00000000000000aa): start every rank with the same config");
    return checks.exit_code();
  });
  EXPECT_EQ(codes, std::vector<int>(2, 0));
}

TEST(TcpGroup, TwoProcessesWithOneRankFailOnEverySide) {
  const int port = free_port();
  // Processes: rank 0 and two that both say they are rank 1.
  const std::vector<int> codes = run_ranks({0, 1, 1}, [&](int rank) {
    ChildChecks checks(rank);
    const std::string error = error_of([&] { TcpGroup{rank, 3, local(port), 7}; });
    checks.expect_contains(error, "two processes say they are rank 1");
    return checks.exit_code();
  });
  EXPECT_EQ(codes, std::vector<int>(3, 0));
}

TEST(TcpGroup, MissingRankTimesOutNamingIt) {
  const int port = free_port();
  const std::string endpoint = fmt::format("127.0.0.1:{}", port);
  // Rank 2 of 3 never starts.
  const std::vector<int> codes = run_ranks(2, [&](int rank) {
    ChildChecks checks(rank);
    const auto start = Clock::now();
    const std::string error = error_of([&] { TcpGroup{rank, 3, local(port, 1), 7}; });
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    checks.expect(seconds > 0.9 && seconds < 3, fmt::format("failed after {} s", seconds));
    checks.expect_contains(error, endpoint);
    checks.expect_contains(error, "within 1 s");
    if (rank == 0) checks.expect_contains(error, "rank 2 of 3 did not arrive");
    return checks.exit_code();
  });
  EXPECT_EQ(codes, std::vector<int>(2, 0));
}

TEST(TcpGroup, RankThatStopsMidCollectiveEndsTheOthers) {
  constexpr int kRanks = 3;
  constexpr int kStopped = 3;  // rank 2's exit code
  constexpr size_t kCount = 2 * TcpGroup::kChunkBytes / sizeof(float);
  const int port = free_port();
  const std::vector<int> codes = run_ranks(kRanks, [&](int rank) {
    ChildChecks checks(rank);
    TcpGroup group(rank, kRanks, local(port), 7);
    std::vector<float> values(kCount, 1.0f);
    if (rank == 2) {
      // Sends its first chunk and waits for the result (rank 1 is late), then the process ends.
      std::thread collective([&] { error_of([&] { group.sum(values.data(), values.size()); }); });
      collective.detach();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      ::_exit(kStopped);
    }
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const std::string error = error_of([&] { group.sum(values.data(), values.size()); });
    checks.expect_contains(
        error, rank == 0 ? "rank 2 closed its connection (it stopped: see its own error)"
                         : "rank 0 closed its connection (it stopped: see its own error)");
    return checks.exit_code();
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0, kStopped}));
}

TEST(TcpGroup, CollectivesOutOfStepAreNamed) {
  const int port = free_port();
  const std::vector<int> codes = run_ranks(2, [&](int rank) {
    ChildChecks checks(rank);
    TcpGroup group(rank, 2, local(port), 7);
    std::vector<float> values(10, 1.0f);
    const std::string error = error_of([&] {
      if (rank == 0) group.sum(values.data(), values.size());
      if (rank == 1) group.max(values.data(), values.size());
    });
    checks.expect_contains(error, rank == 0 ? "rank 1 called max of 10 floats while rank 0 called "
                                              "sum of 10 floats: the ranks are out of step"
                                            : "rank 0 closed its connection");
    return checks.exit_code();
  });
  EXPECT_EQ(codes, std::vector<int>(2, 0));
}

TEST(TcpGroup, PortInUseNamesThePort) {
  const int port = free_port();
  const int holder = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(holder, 0) << std::strerror(errno);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(static_cast<uint16_t>(port));
  ASSERT_EQ(::bind(holder, reinterpret_cast<const sockaddr*>(&address), sizeof address), 0)
      << std::strerror(errno);
  ASSERT_EQ(::listen(holder, 1), 0) << std::strerror(errno);
  const std::string error = error_of([&] { TcpGroup{0, 2, local(port, 1), 7}; });
  ::close(holder);
  EXPECT_NE(error.find(fmt::format("cannot listen on port {}: bind: Address already in use", port)),
            std::string::npos)
      << error;
}

TEST(TcpGroup, PeerWithoutRank0TimesOutNamingWhere) {
  const int port = free_port();
  const auto start = Clock::now();
  const std::string error = error_of([&] { TcpGroup{1, 2, local(port, 0.5), 7}; });
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_NE(error.find(fmt::format("rank 1 could not reach rank 0 at 127.0.0.1:{} within 0.5 s "
                                   "(connect: Connection refused)",
                                   port)),
            std::string::npos)
      << error;
  EXPECT_LT(seconds, 2);
}

}  // namespace
}  // namespace fp8t::distributed
