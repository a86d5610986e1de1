// What data parallelism adds to a step of the GPU GPT or Flux on each rank (CUDA builds with
// NCCL): the sum of every replica's fp32 gradients, after the last backward (or, for the GPT,
// overlapped with it), and for delayed scaling the largest amax any rank saw. The training
// engines and `bench gpt|flux` both run them, so that the benchmarks time what training does.
#pragma once

#include <memory>
#include <vector>

#include "distributed/communicator.h"
#include "distributed/nccl_group.h"
#include "models/cuda/flux_model_cuda.h"
#include "models/cuda/gpt_model_cuda.h"
#include "optim/optimizer_shard.h"

namespace fp8t::train {

class GptRankSums {
 public:
  // Joins the ranks of `host` through NCCL on the current device (every rank together). The
  // collectives run on the model's stream, the overlapped sums on NCCL's own. Under tensor
  // parallelism (layout.tensor > 1) each rank's shares are summed with the same shares of the
  // other replicas only, over this rank's data-parallel group, as FluxRankSums does. `shard`:
  // which replica updates each parameter when the optimizer state is sharded (ZeRO-1), else
  // null.
  GptRankSums(distributed::Communicator& host, CudaGptModel& model,
              const distributed::ParallelLayout& layout, bool overlap_grad_reduce,
              const optim::OptimizerShard* shard = nullptr);

  // The step's last backward; with overlap_grad_reduce each finished range of gradients is
  // summed over the ranks while it goes on.
  void last_backward();
  // Queued after the last backward: every rank's gradients summed (not yet averaged).
  void sum_gradients();
  // After the update and before the model's end_step:
  //   - with a shard, each parameter from the rank that updated it to the others (fp32, or bf16
  //     where the layout keeps it so);
  //   - delayed scaling: every rank folds the largest amax any rank saw, so the scales stay the
  //     same on every rank (scales and inverse scales are the same everywhere already: their
  //     max is themselves).
  void after_update();

 private:
  CudaGptModel& model_;
  bool overlap_;
  bool delayed_;
  std::unique_ptr<distributed::NcclGroup> nccl_;
  std::vector<distributed::NcclGroup::Piece> parameter_pieces_;  // with a shard
};

class FluxRankSums {
 public:
  // Joins the ranks of `host` through NCCL on the current device (every rank together); the
  // collectives run on the model's stream. Under tensor parallelism (layout.tensor > 1) each
  // rank's shares are summed with the same shares of the other replicas only: the sums, the
  // amax maxima and the shard's broadcasts run over this rank's data-parallel group. `shard`:
  // which replica updates each parameter with ZeRO-1 (optim/optimizer_shard.h), else null.
  FluxRankSums(distributed::Communicator& host, CudaFluxModel& model,
               const distributed::ParallelLayout& layout,
               const optim::OptimizerShard* shard = nullptr);

  // Queued after the last backward: every replica's gradients summed (not yet averaged).
  void sum_gradients();
  // As GptRankSums::after_update.
  void after_update();

 private:
  CudaFluxModel& model_;
  bool delayed_;
  std::unique_ptr<distributed::NcclGroup> nccl_;
  std::vector<distributed::NcclGroup::Piece> parameter_pieces_;  // with a shard
};

}  // namespace fp8t::train
