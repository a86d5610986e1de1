#include "distributed/tcp_group.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include "core/error.h"

namespace fp8t::distributed {

namespace {

// A collective's code on the wire.
enum class Operation : uint32_t {
  kSumFloat = 1,
  kSumDouble = 2,
  kMaxFloat = 3,
  kMaxInt = 4,
  kBroadcast = 5,
  kBarrier = 6,
  kAllGather = 7,
};

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x54385046;  // "FP8T" in little-endian memory order
constexpr uint32_t kProtocolVersion = 2;
constexpr uint32_t kMaxReplyBytes = 1 << 16;
constexpr auto kRetryInterval = std::chrono::milliseconds(100);
constexpr auto kAnswerGrace = std::chrono::seconds(5);

struct Hello {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  int32_t world_size;
  uint64_t job_hash;
};
static_assert(sizeof(Hello) == 24 && std::is_trivially_copyable_v<Hello>, "sent as its bytes");

struct CollectiveHeader {
  uint32_t operation;
  uint32_t reserved;
  uint64_t count;  // elements; bytes for a broadcast; 0 for a barrier
};
static_assert(sizeof(CollectiveHeader) == 16, "sent as its bytes");

// Owns a socket descriptor.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Socket& operator=(Socket&& other) noexcept {
    if (this != &other) {
      close_fd();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~Socket() { close_fd(); }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }

 private:
  // A failed close of a socket loses nothing we could still report.
  void close_fd() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int fd_ = -1;
};

std::string system_error(std::string_view call) {
  return fmt::format("{}: {}", call, std::strerror(errno));
}

std::string closed_text(int remote) {
  return fmt::format("rank {} closed its connection (it stopped: see its own error)", remote);
}

bool closed_by_remote(int error) {
  return error == ECONNRESET || error == EPIPE || error == ECONNABORTED;
}

// Throws the text a failed recv or send on the connection to `remote` deserves.
[[noreturn]] void throw_transfer_error(const char* call, int remote) {
  if (closed_by_remote(errno)) throw Error(closed_text(remote));
  if (errno == ETIMEDOUT) {
    throw Error(fmt::format("rank {} stopped answering ({}: {}): its host may be down", remote,
                            call, std::strerror(errno)));
  }
  throw Error(fmt::format("{} with rank {}: {}", call, remote, std::strerror(errno)));
}

// Blocking: no timeout, since a live rank may be busy for minutes; a stopped one closes its
// socket, which ends the wait.
void send_all(int fd, const void* data, size_t size, int remote) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    // MSG_NOSIGNAL: a closed peer is an error to report, not a SIGPIPE that kills the process.
    const ssize_t sent = ::send(fd, bytes, size, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      throw_transfer_error("send", remote);
    }
    bytes += sent;
    size -= static_cast<size_t>(sent);
  }
}

// Reads what is there (at most `size` bytes); throws when the connection closed.
size_t receive_some(int fd, void* data, size_t size, int remote) {
  while (true) {
    const ssize_t got = ::recv(fd, data, size, 0);
    if (got > 0) return static_cast<size_t>(got);
    if (got == 0) throw Error(closed_text(remote));
    if (errno != EINTR) throw_transfer_error("recv", remote);
  }
}

void receive_all(int fd, void* data, size_t size, int remote) {
  auto* bytes = static_cast<char*>(data);
  while (size > 0) {
    const size_t got = receive_some(fd, bytes, size, remote);
    bytes += got;
    size -= got;
  }
}

int milliseconds_until(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, 1 << 30));
}

// poll() that resumes after a signal; returns the number of ready descriptors (0: timed out).
// Clock::time_point::max(): no deadline.
int poll_until(std::vector<pollfd>& fds, Clock::time_point deadline) {
  while (true) {
    const int timeout = deadline == Clock::time_point::max() ? -1 : milliseconds_until(deadline);
    const int ready = ::poll(fds.data(), fds.size(), timeout);
    if (ready >= 0) return ready;
    if (errno != EINTR) throw Error(system_error("poll"));
  }
}

// Waits for `fd` to be readable until `deadline`; false when it passed.
bool wait_readable(int fd, Clock::time_point deadline) {
  std::vector<pollfd> fds{{fd, POLLIN, 0}};
  return poll_until(fds, deadline) > 0;
}

void set_option(int fd, int level, int name, int value, const char* what) {
  if (::setsockopt(fd, level, name, &value, sizeof value) != 0) {
    throw Error(system_error(fmt::format("setsockopt({})", what)));
  }
}

void tune_connection(int fd) {
  // Collectives are request/answer exchanges: Nagle's delay would add up to 40 ms to each.
  set_option(fd, IPPROTO_TCP, TCP_NODELAY, 1, "TCP_NODELAY");
  // A host that vanishes (power, network) sends no reset; keepalive probes notice it within about
  // two minutes. The kernel of a live host answers them however long its process is busy.
  set_option(fd, SOL_SOCKET, SO_KEEPALIVE, 1, "SO_KEEPALIVE");
  set_option(fd, IPPROTO_TCP, TCP_KEEPIDLE, 60, "TCP_KEEPIDLE");
  set_option(fd, IPPROTO_TCP, TCP_KEEPINTVL, 10, "TCP_KEEPINTVL");
  set_option(fd, IPPROTO_TCP, TCP_KEEPCNT, 6, "TCP_KEEPCNT");
}

void set_blocking(int fd, bool blocking) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) throw Error(system_error("fcntl(F_GETFL)"));
  const int wanted = blocking ? flags & ~O_NONBLOCK : flags | O_NONBLOCK;
  if (::fcntl(fd, F_SETFL, wanted) != 0) throw Error(system_error("fcntl(F_SETFL)"));
}

// "rank 2", "ranks 2, 5, 7", at most 16 named.
std::string rank_list(const std::vector<int>& ranks) {
  constexpr size_t kNamed = 16;
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < std::min(ranks.size(), kNamed); ++i) {
    text += fmt::format("{}{}", i == 0 ? "" : ", ", ranks[i]);
  }
  if (ranks.size() > kNamed) text += fmt::format(", … ({} in all)", ranks.size());
  return text;
}

std::string describe(Operation operation, uint64_t count) {
  switch (operation) {
    case Operation::kSumFloat:
      return fmt::format("sum of {} floats", count);
    case Operation::kSumDouble:
      return fmt::format("sum of {} doubles", count);
    case Operation::kMaxFloat:
      return fmt::format("max of {} floats", count);
    case Operation::kMaxInt:
      return fmt::format("max of {} ints", count);
    case Operation::kBroadcast:
      return fmt::format("broadcast of {} bytes", count);
    case Operation::kBarrier:
      return "barrier";
    case Operation::kAllGather:
      return fmt::format("all-gather of {} bytes per rank", count);
  }
  return fmt::format("unknown collective {}", static_cast<uint32_t>(operation));
}

// Function objects rather than function pointers, so that the combining loops inline them.
struct Add {
  template <typename T>
  void operator()(T& into, T value) const {
    into += value;
  }
};

// A NaN wins, so that an overflow on one rank reaches every rank.
struct KeepMax {
  template <typename T>
  void operator()(T& into, T value) const {
    if constexpr (std::is_floating_point_v<T>) {
      if (std::isnan(into)) return;
      if (std::isnan(value)) {
        into = value;
        return;
      }
    }
    if (value > into) into = value;
  }
};

// ---- rendezvous -----------------------------------------------------------------------------

std::string endpoint(const TcpRendezvous& where) {
  return fmt::format("{}:{}", where.address, where.port);
}

Socket listen_on(int port, int backlog) {
  Socket listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!listener.valid()) throw Error(system_error("socket"));
  // A job restarted on the same port must not wait for the last run's connections in TIME_WAIT.
  set_option(listener.get(), SOL_SOCKET, SO_REUSEADDR, 1, "SO_REUSEADDR");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(listener.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
    throw Error(fmt::format(
        "rank 0 cannot listen on port {}: bind: {} (another process may use it: choose another "
        "MASTER_PORT)",
        port, std::strerror(errno)));
  }
  if (::listen(listener.get(), backlog) != 0) throw Error(system_error("listen"));
  return listener;
}

// One attempt to reach rank 0 within `deadline`; an empty socket and `error` set on failure.
Socket try_connect(const TcpRendezvous& where, Clock::time_point deadline, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(where.port);
  // Retried like a refused connection: rank 0's name may appear in DNS only once it started.
  if (const int status = ::getaddrinfo(where.address.c_str(), service.c_str(), &hints, &found);
      status != 0) {
    error = fmt::format("getaddrinfo({}): {}", where.address,
                        status == EAI_SYSTEM ? std::strerror(errno) : ::gai_strerror(status));
    return {};
  }
  const sockaddr_in address = *reinterpret_cast<const sockaddr_in*>(found->ai_addr);
  ::freeaddrinfo(found);

  // Non-blocking connect: a host that drops packets would otherwise hold a blocking connect for
  // minutes, past the rendezvous timeout.
  Socket socket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!socket.valid()) throw Error(system_error("socket"));
  if (::connect(socket.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0 &&
      errno != EINPROGRESS && errno != EINTR) {
    error = system_error("connect");
    return {};
  }
  std::vector<pollfd> fds{{socket.get(), POLLOUT, 0}};
  if (poll_until(fds, deadline) == 0) {
    error = "connect: no answer";
    return {};
  }
  int status = 0;
  socklen_t length = sizeof status;
  if (::getsockopt(socket.get(), SOL_SOCKET, SO_ERROR, &status, &length) != 0) {
    throw Error(system_error("getsockopt(SO_ERROR)"));
  }
  if (status != 0) {
    error = fmt::format("connect: {}", std::strerror(status));
    return {};
  }
  set_blocking(socket.get(), true);
  return socket;
}

void send_reply(int fd, const std::string& text, int remote) {
  const auto length = static_cast<uint32_t>(std::min<size_t>(text.size(), kMaxReplyBytes));
  send_all(fd, &length, sizeof length, remote);
  send_all(fd, text.data(), length, remote);
}

// A connection rank 0 accepted whose hello is still arriving.
struct Arriving {
  Socket socket;
  Hello hello{};
  size_t received = 0;
};

// Rank 0's verdict on a complete hello: empty when the peer may join.
std::string check_hello(const Hello& hello, int world_size, uint64_t job_hash,
                        const std::vector<Socket>& peers, const TcpRendezvous& where) {
  if (hello.version != kProtocolVersion) {
    return fmt::format(
        "rank {} speaks protocol version {}, rank 0 version {}: start every rank with the same "
        "fp8train build",
        hello.rank, hello.version, kProtocolVersion);
  }
  if (hello.world_size != world_size) {
    return fmt::format(
        "rank {} was started with world size {}, rank 0 with {}: start every rank with the same "
        "WORLD_SIZE",
        hello.rank, hello.world_size, world_size);
  }
  if (hello.rank == 0) {
    return fmt::format(
        "a second process says it is rank 0, while rank 0 listens at {}: every rank needs its own "
        "RANK",
        endpoint(where));
  }
  if (hello.rank < 0 || hello.rank >= world_size) {
    return fmt::format("a process says it is rank {}, outside 1 .. {} of world size {}", hello.rank,
                       world_size - 1, world_size);
  }
  if (peers[static_cast<size_t>(hello.rank)].valid()) {
    return fmt::format("two processes say they are rank {}: every rank needs its own RANK",
                       hello.rank);
  }
  if (hello.job_hash != job_hash) {
    return fmt::format(
        "rank {}'s configuration differs from rank 0's (hash {:016x} vs {:016x}): start every "
        "rank with the same config and flags",
        hello.rank, hello.job_hash, job_hash);
  }
  return {};
}

// Rank 0's side: accepts world_size-1 peers and answers them all at once.
std::vector<Socket> gather_peers(int world_size, const TcpRendezvous& where, uint64_t job_hash) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(where.timeout_seconds));
  const Socket listener = listen_on(where.port, world_size);
  std::vector<Socket> peers(static_cast<size_t>(world_size));
  std::vector<Arriving> arriving;
  int joined = 0;

  // Every peer that waits hears why the rendezvous failed, so each rank's log says it. Best
  // effort: one that left already cannot be told.
  const auto fail = [&](const std::string& text, Socket* also) -> void {
    const auto tell = [&](int fd) {
      try {
        send_reply(fd, text, -1);
      } catch (const Error&) {
      }
    };
    if (also != nullptr) tell(also->get());
    for (const Socket& peer : peers) {
      if (peer.valid()) tell(peer.get());
    }
    throw Error(text);
  };

  while (joined < world_size - 1) {
    // Layout: the listener, the connections whose hello is arriving, then the peers that joined
    // (they send nothing until "ok": readable means closed).
    std::vector<pollfd> fds{{listener.get(), POLLIN, 0}};
    for (const Arriving& connection : arriving) {
      fds.push_back({connection.socket.get(), POLLIN, 0});
    }
    std::vector<int> joined_ranks;
    for (int peer = 1; peer < world_size; ++peer) {
      if (!peers[static_cast<size_t>(peer)].valid()) continue;
      fds.push_back({peers[static_cast<size_t>(peer)].get(), POLLIN, 0});
      joined_ranks.push_back(peer);
    }
    if (poll_until(fds, deadline) == 0) {
      std::vector<int> missing;
      for (int peer = 1; peer < world_size; ++peer) {
        if (!peers[static_cast<size_t>(peer)].valid()) missing.push_back(peer);
      }
      fail(fmt::format(
               "rendezvous at {}: {} of {} did not arrive within {} s (check that every rank was "
               "started, with MASTER_ADDR and MASTER_PORT naming rank 0's host and port)",
               endpoint(where), rank_list(missing), world_size, where.timeout_seconds),
           nullptr);
    }

    for (size_t i = 0; i < joined_ranks.size(); ++i) {
      if (fds[1 + arriving.size() + i].revents != 0) fail(closed_text(joined_ranks[i]), nullptr);
    }
    std::vector<Arriving> still_arriving;
    for (size_t i = 0; i < arriving.size(); ++i) {
      Arriving& connection = arriving[i];
      if (fds[1 + i].revents == 0) {
        still_arriving.push_back(std::move(connection));
        continue;
      }
      auto* bytes = reinterpret_cast<char*>(&connection.hello);
      const ssize_t got = ::recv(connection.socket.get(), bytes + connection.received,
                                 sizeof(Hello) - connection.received, 0);
      if (got < 0 && errno == EINTR) {
        still_arriving.push_back(std::move(connection));
        continue;
      }
      // Closed before its hello, or a stranger (a port scanner, a health check): not a rank.
      if (got <= 0) continue;
      connection.received += static_cast<size_t>(got);
      if (connection.hello.magic != kMagic && connection.received >= sizeof(uint32_t)) continue;
      if (connection.received < sizeof(Hello)) {
        still_arriving.push_back(std::move(connection));
        continue;
      }
      const std::string problem = check_hello(connection.hello, world_size, job_hash, peers, where);
      if (!problem.empty()) fail(problem, &connection.socket);
      peers[static_cast<size_t>(connection.hello.rank)] = std::move(connection.socket);
      ++joined;
    }
    arriving = std::move(still_arriving);

    if (fds[0].revents != 0) {
      while (true) {
        Socket accepted(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (accepted.valid()) {
          tune_connection(accepted.get());
          arriving.push_back({std::move(accepted)});
          continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        // A connection that went away before it was accepted is not an error here.
        if (errno == EINTR || errno == ECONNABORTED) continue;
        throw Error(system_error("accept4"));
      }
    }
  }
  for (int peer = 1; peer < world_size; ++peer) {
    send_reply(peers[static_cast<size_t>(peer)].get(), "ok", peer);
  }
  return peers;
}

// A peer's side: connects to rank 0, says hello and waits for rank 0's answer.
Socket join(int rank, int world_size, const TcpRendezvous& where, uint64_t job_hash) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(where.timeout_seconds));
  std::string last_error;
  Socket socket;
  while (true) {
    socket = try_connect(where, deadline, last_error);
    if (socket.valid()) break;
    if (Clock::now() + kRetryInterval >= deadline) {
      throw Error(fmt::format(
          "rank {} could not reach rank 0 at {} within {} s ({}): check MASTER_ADDR and "
          "MASTER_PORT, and that rank 0 started",
          rank, endpoint(where), where.timeout_seconds, last_error));
    }
    std::this_thread::sleep_for(kRetryInterval);
  }
  tune_connection(socket.get());
  const Hello hello{kMagic, kProtocolVersion, rank, world_size, job_hash};
  send_all(socket.get(), &hello, sizeof hello, 0);

  // Rank 0 answers once every rank arrived, or with its error. A few seconds' grace: when the
  // ranks started together, rank 0's own timeout, naming the missing ranks, comes first.
  if (!wait_readable(socket.get(), deadline + kAnswerGrace)) {
    throw Error(fmt::format(
        "rank {} reached rank 0 at {}, but not every rank arrived there within {} s: see rank 0's "
        "error",
        rank, endpoint(where), where.timeout_seconds));
  }
  uint32_t length = 0;
  receive_all(socket.get(), &length, sizeof length, 0);
  if (length > kMaxReplyBytes) {
    throw Error(fmt::format("rank 0 at {} answered with {} bytes: is it an fp8train rank?",
                            endpoint(where), length));
  }
  std::string reply(length, '\0');
  receive_all(socket.get(), reply.data(), length, 0);
  if (reply != "ok") throw Error(reply);
  return socket;
}

// ---- collectives ------------------------------------------------------------------------------

// Rank 0: reads `bytes` from every peer into destination(peer), whichever sends first. `sockets`
// as in TcpGroup::sockets_.
template <typename Destination>
void receive_from_peers(const std::vector<int>& sockets, size_t bytes, Destination destination) {
  std::vector<size_t> received(sockets.size(), 0);
  size_t done = 0;
  while (done < sockets.size() - 1) {
    // Polled together: a stopped rank is noticed at once, even while another is still busy.
    std::vector<pollfd> fds;
    std::vector<int> ranks;
    for (size_t peer = 1; peer < sockets.size(); ++peer) {
      if (received[peer] == bytes) continue;
      fds.push_back({sockets[peer], POLLIN, 0});
      ranks.push_back(static_cast<int>(peer));
    }
    poll_until(fds, Clock::time_point::max());
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const int peer = ranks[i];
      size_t& got = received[static_cast<size_t>(peer)];
      auto* target = reinterpret_cast<char*>(destination(peer));
      got += receive_some(fds[i].fd, target + got, bytes - got, peer);
      if (got == bytes) ++done;
    }
  }
}

// Rank 0: reads every peer's collective header and throws unless all match its own.
void check_peers_agree(const std::vector<int>& sockets, Operation operation, uint64_t count) {
  std::vector<CollectiveHeader> headers(sockets.size());
  receive_from_peers(sockets, sizeof(CollectiveHeader),
                     [&](int peer) { return &headers[static_cast<size_t>(peer)]; });
  for (size_t peer = 1; peer < sockets.size(); ++peer) {
    const CollectiveHeader& header = headers[peer];
    if (header.operation != static_cast<uint32_t>(operation) || header.count != count) {
      throw Error(fmt::format("rank {} called {} while rank 0 called {}: the ranks are out of step",
                              peer,
                              describe(static_cast<Operation>(header.operation), header.count),
                              describe(operation, count)));
    }
  }
}

template <typename T, typename Combine>
void reduce(const std::vector<int>& sockets, int rank, T* values, size_t count, Operation operation,
            Combine combine) {
  const size_t chunk = TcpGroup::kChunkBytes / sizeof(T);
  if (rank != 0) {
    const int fd = sockets[0];
    const CollectiveHeader header{static_cast<uint32_t>(operation), 0, count};
    send_all(fd, &header, sizeof header, 0);
    // Lockstep: one chunk out, its result back, so neither side's buffers fill up.
    for (size_t done = 0; done < count; done += chunk) {
      const size_t bytes = std::min(chunk, count - done) * sizeof(T);
      send_all(fd, values + done, bytes, 0);
      receive_all(fd, values + done, bytes, 0);
    }
    return;
  }
  check_peers_agree(sockets, operation, count);
  std::vector<std::vector<T>> incoming(sockets.size());
  for (size_t peer = 1; peer < sockets.size(); ++peer) {
    incoming[peer].resize(std::min(chunk, count));
  }
  for (size_t done = 0; done < count; done += chunk) {
    const size_t length = std::min(chunk, count - done);
    receive_from_peers(sockets, length * sizeof(T),
                       [&](int peer) { return incoming[static_cast<size_t>(peer)].data(); });
    // In rank order, whichever rank's data came first: the same sum on every run.
    T* result = values + done;
    for (size_t peer = 1; peer < sockets.size(); ++peer) {
      const T* theirs = incoming[peer].data();
      for (size_t i = 0; i < length; ++i)
        combine(result[i], theirs[i]);
    }
    for (size_t peer = 1; peer < sockets.size(); ++peer) {
      send_all(sockets[peer], result, length * sizeof(T), static_cast<int>(peer));
    }
  }
}

}  // namespace

TcpGroup::TcpGroup(int rank, int world_size, const TcpRendezvous& where, uint64_t job_hash)
    : rank_(rank), world_size_(world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw Error(
        fmt::format("TcpGroup: expected a rank in 0 .. world size − 1 and a world size of "
                    "at least 1, found rank {} of {}",
                    rank, world_size));
  }
  if (world_size == 1) return;
  if (where.port < 1 || where.port > 65535) {
    throw Error(fmt::format("rendezvous port: expected 1 .. 65535, found {}", where.port));
  }
  if (!(where.timeout_seconds > 0) || !std::isfinite(where.timeout_seconds)) {
    throw Error(fmt::format("rendezvous timeout: expected a finite number of seconds > 0, found {}",
                            where.timeout_seconds));
  }
  sockets_.assign(static_cast<size_t>(world_size), -1);
  if (rank == 0) {
    std::vector<Socket> peers = gather_peers(world_size, where, job_hash);
    for (size_t peer = 1; peer < peers.size(); ++peer) {
      sockets_[peer] = peers[peer].release();
    }
  } else {
    sockets_[0] = join(rank, world_size, where, job_hash).release();
  }
}

TcpGroup::~TcpGroup() {
  // A failed close loses nothing: the job is done with these connections.
  for (const int fd : sockets_) {
    if (fd >= 0) ::close(fd);
  }
}

void TcpGroup::sum(float* values, size_t count) {
  if (world_size_ > 1) reduce(sockets_, rank_, values, count, Operation::kSumFloat, Add{});
}

void TcpGroup::sum(double* values, size_t count) {
  if (world_size_ > 1) reduce(sockets_, rank_, values, count, Operation::kSumDouble, Add{});
}

void TcpGroup::max(float* values, size_t count) {
  if (world_size_ > 1) reduce(sockets_, rank_, values, count, Operation::kMaxFloat, KeepMax{});
}

void TcpGroup::max(int* values, size_t count) {
  if (world_size_ > 1) reduce(sockets_, rank_, values, count, Operation::kMaxInt, KeepMax{});
}

void TcpGroup::broadcast(void* bytes, size_t size) {
  if (world_size_ == 1) return;
  const CollectiveHeader header{static_cast<uint32_t>(Operation::kBroadcast), 0, size};
  if (rank_ != 0) {
    send_all(sockets_[0], &header, sizeof header, 0);
    receive_all(sockets_[0], bytes, size, 0);
    return;
  }
  check_peers_agree(sockets_, Operation::kBroadcast, size);
  // Chunk by chunk to every peer in turn: each peer only reads here, so no send blocks for long.
  const auto* data = static_cast<const char*>(bytes);
  for (size_t done = 0; done < size; done += kChunkBytes) {
    const size_t length = std::min(kChunkBytes, size - done);
    for (size_t peer = 1; peer < sockets_.size(); ++peer) {
      send_all(sockets_[peer], data + done, length, static_cast<int>(peer));
    }
  }
}

void TcpGroup::all_gather(const void* own, void* all, size_t bytes) {
  auto* gathered = static_cast<char*>(all);
  std::memcpy(gathered + static_cast<size_t>(rank_) * bytes, own, bytes);
  if (world_size_ == 1) return;
  const CollectiveHeader header{static_cast<uint32_t>(Operation::kAllGather), 0, bytes};
  const size_t whole = static_cast<size_t>(world_size_) * bytes;
  if (rank_ != 0) {
    // Rank 0 reads every peer at once, so this send completes before the answer comes.
    send_all(sockets_[0], &header, sizeof header, 0);
    send_all(sockets_[0], own, bytes, 0);
    receive_all(sockets_[0], gathered, whole, 0);
    return;
  }
  check_peers_agree(sockets_, Operation::kAllGather, bytes);
  receive_from_peers(sockets_, bytes,
                     [&](int peer) { return gathered + static_cast<size_t>(peer) * bytes; });
  for (size_t done = 0; done < whole; done += kChunkBytes) {  // as in broadcast
    const size_t length = std::min(kChunkBytes, whole - done);
    for (size_t peer = 1; peer < sockets_.size(); ++peer) {
      send_all(sockets_[peer], gathered + done, length, static_cast<int>(peer));
    }
  }
}

void TcpGroup::barrier() {
  if (world_size_ == 1) return;
  CollectiveHeader header{static_cast<uint32_t>(Operation::kBarrier), 0, 0};
  if (rank_ != 0) {
    send_all(sockets_[0], &header, sizeof header, 0);
    receive_all(sockets_[0], &header, sizeof header, 0);
    return;
  }
  check_peers_agree(sockets_, Operation::kBarrier, 0);
  for (size_t peer = 1; peer < sockets_.size(); ++peer) {
    send_all(sockets_[peer], &header, sizeof header, static_cast<int>(peer));
  }
}

}  // namespace fp8t::distributed
