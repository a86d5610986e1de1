// `fp8train train --nproc-per-node N`: N copies of this program on this node, one rank each,
// started as a torchrun-style launcher would start them, so that they meet over TCP
// (communicator.h).
#pragma once

#include <string>
#include <vector>

namespace fp8t::distributed {

// Runs this program's executable N times with `arguments` (argv after the program name): rank r
// gets RANK = LOCAL_RANK = r, WORLD_SIZE = LOCAL_WORLD_SIZE = N, and every rank MASTER_ADDR
// 127.0.0.1 and a free MASTER_PORT unless they are set; another launcher's variables (OpenMPI,
// Slurm) are removed, so the ranks do not take themselves for its ranks. SIGINT, SIGTERM and
// SIGUSR1 received here go on to every rank (each saves its checkpoint). Waits for them all; when
// one fails, stops the others (SIGTERM, then SIGKILL after a grace period, since a rank blocked in
// a collective does not see the signal) and returns its exit code (128 + signal for a rank
// that a signal ended); else 0, or the ranks' stop code when a signal stopped them.
int run_local_ranks(int processes, const std::vector<std::string>& arguments);

}  // namespace fp8t::distributed
