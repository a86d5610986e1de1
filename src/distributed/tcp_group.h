// Host-side collectives between the processes of one training job over plain TCP, for ranks
// started without MPI (torchrun-style: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). A star: every
// rank connects to rank 0, which combines the ranks' values in rank order (the same result on
// every run) and sends the result back. Data moves in fixed chunks in lockstep, so buffers of any
// size go through without filling the TCP buffers both ways, and rank 0 holds one chunk per peer.
//
// Wire protocol (native byte order: the ranks of a job run one build on one architecture):
//   rendezvous  peer → 0: hello {magic "FP8T", protocol version, rank, world size, job hash}
//               0 → peer: u32 length + text, "ok" once every rank has arrived, else the error
//   collective  peer → 0: {operation, element count} (rank 0 checks that all ranks agree)
//               reductions: per chunk, peer → 0 its values, 0 → peer the combined values
//               broadcast: 0 → peer the bytes; barrier: 0 → peer the header back
//               all-gather: peer → 0 its bytes, then 0 → peer every rank's, in rank order
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fp8t::distributed {

// Where rank 0 listens and how long the ranks wait for each other there.
struct TcpRendezvous {
  std::string address;           // rank 0's host name or IPv4 address (MASTER_ADDR)
  int port = 0;                  // MASTER_PORT (or the override the caller chose)
  double timeout_seconds = 300;  // for the rendezvous only
};

class TcpGroup {
 public:
  // Reductions and broadcasts move this many bytes per step and per rank.
  static constexpr size_t kChunkBytes = size_t{4} << 20;

  // Rank 0 listens on `port` (all interfaces, SO_REUSEADDR) and accepts world_size-1 peers; every
  // other rank connects to address:port, retrying every 100 ms until the timeout. A peer sends a
  // hello {magic, protocol version, rank, world_size, job_hash}; rank 0 answers every peer with
  // "ok" once all have arrived, or with an error text, and both sides throw fp8t::Error with it:
  // a world size that differs from rank 0's, a rank out of range or seen twice, a job_hash that
  // differs from rank 0's. When ranks have not arrived within the timeout, rank 0 throws naming
  // address:port, the timeout and the missing ranks, and the waiting peers throw naming
  // address:port and the timeout. A port rank 0 cannot bind: Error naming the port and strerror.
  // world_size 1 opens no socket.
  TcpGroup(int rank, int world_size, const TcpRendezvous& where, uint64_t job_hash);
  ~TcpGroup();  // closes the sockets
  TcpGroup(const TcpGroup&) = delete;
  TcpGroup& operator=(const TcpGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return world_size_; }

  // All in place; every rank ends with the same result. Rank 0 combines the ranks' values in rank
  // order (deterministic), then sends the result back. A NaN wins in max. A rank whose process
  // stopped makes the others throw fp8t::Error ("rank R closed its connection ..."); there is no
  // timeout otherwise (a rank may wait minutes while rank 0 saves a checkpoint). Ranks that call
  // different collectives, or with different counts, make rank 0 throw naming both.
  void sum(float* values, size_t count);
  void sum(double* values, size_t count);
  void max(float* values, size_t count);
  void max(int* values, size_t count);
  // Rank 0's bytes to every rank.
  void broadcast(void* bytes, size_t size);
  // Every rank's `bytes` bytes of `own` into `all` [world size, bytes], in rank order, on every
  // rank. `own` must not overlap `all`.
  void all_gather(const void* own, void* all, size_t bytes);
  void barrier();

 private:
  int rank_ = 0;
  int world_size_ = 1;
  // Indexed by rank, -1 where there is no connection: rank 0 holds one per peer, a peer only
  // sockets_[0].
  std::vector<int> sockets_;
};

}  // namespace fp8t::distributed
