#include "distributed/local_ranks.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"

namespace fp8t::distributed {

namespace {

volatile std::sig_atomic_t g_forward = 0;  // a signal to pass on to the ranks

void remember(int signal) {
  g_forward = signal;
}

// A TCP port nobody listens on now (the kernel's choice); rank 0 binds it moments later.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw Error(fmt::format("socket failed: {}", std::strerror(errno)));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  const int error = errno;
  ::close(fd);
  if (!ok) throw Error(fmt::format("no free TCP port for the ranks: {}", std::strerror(error)));
  return ntohs(address.sin_port);
}

// The child's side of fork(): its variables, then this program again.
[[noreturn]] void become_rank(int rank, int processes, const std::vector<char*>& argv) {
  ::setpgid(0, 0);  // the terminal's Ctrl-C reaches the launcher, which passes it on once
  for (const char* other :
       {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"})
    ::unsetenv(other);
  const std::string rank_text = std::to_string(rank), size_text = std::to_string(processes);
  ::setenv("RANK", rank_text.c_str(), 1);
  ::setenv("LOCAL_RANK", rank_text.c_str(), 1);
  ::setenv("WORLD_SIZE", size_text.c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", size_text.c_str(), 1);
  ::execv("/proc/self/exe", argv.data());
  fmt::print(stderr, "fp8train: cannot start rank {}: exec failed: {}\n", rank,
             std::strerror(errno));
  std::_Exit(127);
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

void signal_all(const std::vector<pid_t>& ranks, int signal) {
  for (const pid_t pid : ranks)
    if (pid > 0) ::kill(pid, signal);
}

}  // namespace

int run_local_ranks(int processes, const std::vector<std::string>& arguments) {
  FP8T_CHECK(processes >= 1, "--nproc-per-node: expected at least 1, found {}", processes);
  if (std::getenv("MASTER_ADDR") == nullptr) ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  if (std::getenv("MASTER_PORT") == nullptr) {
    ::setenv("MASTER_PORT", std::to_string(free_port()).c_str(), 1);
  }
  std::vector<std::string> owned{"fp8train"};
  owned.insert(owned.end(), arguments.begin(), arguments.end());
  std::vector<char*> argv;
  for (std::string& argument : owned)
    argv.push_back(argument.data());
  argv.push_back(nullptr);

  struct sigaction action {};
  action.sa_handler = remember;
  sigemptyset(&action.sa_mask);
  struct sigaction previous_int {
  }, previous_term{}, previous_usr1{};
  sigaction(SIGINT, &action, &previous_int);
  sigaction(SIGTERM, &action, &previous_term);
  sigaction(SIGUSR1, &action, &previous_usr1);

  std::vector<pid_t> ranks(static_cast<size_t>(processes), 0);
  for (int rank = 0; rank < processes; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      signal_all(ranks, SIGKILL);
      throw Error(fmt::format("fork failed for rank {}: {}", rank, std::strerror(errno)));
    }
    if (pid == 0) become_rank(rank, processes, argv);
    ranks[static_cast<size_t>(rank)] = pid;
  }

  constexpr auto kGrace = std::chrono::seconds(20);
  constexpr auto kNever = std::chrono::steady_clock::time_point::max();
  int result = 0;
  bool stopping = false;   // a signal went on to the ranks: they end with 128 + signal
  auto deadline = kNever;  // SIGKILL then: a rank failed and the others have not ended
  for (int running = processes; running > 0;) {
    if (const int signal = g_forward; signal != 0) {
      g_forward = 0;
      stopping = true;
      signal_all(ranks, signal);
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno != EINTR) throw Error(fmt::format("waitpid: {}", std::strerror(errno)));
    if (pid <= 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        signal_all(ranks, SIGKILL);
        deadline = kNever;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    --running;
    for (pid_t& rank : ranks)
      if (rank == pid) rank = 0;
    const int code = exit_code(status);
    if (code == 0 || result != 0) continue;
    result = code;  // the first rank that did not succeed decides
    if (!stopping) {
      signal_all(ranks, SIGTERM);
      deadline = std::chrono::steady_clock::now() + kGrace;
    }
  }
  sigaction(SIGINT, &previous_int, nullptr);
  sigaction(SIGTERM, &previous_term, nullptr);
  sigaction(SIGUSR1, &previous_usr1, nullptr);
  return result;
}

}  // namespace fp8t::distributed
