// The device memory of Flux training on the GPU path, planned on the host: per category, the
// bytes CudaFluxModel (models/cuda/flux_model_cuda.h) takes, counted as it takes them (each
// arena piece rounded up to DeviceArena's alignment, the linears' weight copies as CudaLinear
// allocates them), and the AdamW moments of optim/cuda/adamw_cuda.h; then what one GPU of N
// holds under data parallelism with ZeRO-1. Plain C++: CPU builds print it (`fp8train model
// --preset`), and a GPU test compares it with CudaFluxModel::memory() category by category.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "models/flux_config.h"
#include "models/flux_model.h"
#include "models/recompute.h"

namespace fp8t {

// One micro-batch: `batch` samples of img_tokens image and txt_tokens text tokens.
struct FluxMicroBatch {
  int64_t batch = 1;
  int64_t img_tokens = 4096;  // 1024² images
  int64_t txt_tokens = 512;
};

// Device bytes on one GPU, by category; all but optimizer_state as CudaFluxMemory counts them.
struct FluxMemoryPlan {
  size_t parameters = 0;       // fp32 master weights
  size_t gradients = 0;        // fp32
  size_t optimizer_state = 0;  // AdamW's fp32 exp_avg and exp_avg_sq: this GPU's shard
  size_t activations = 0;      // saved for backward
  size_t workspace = 0;        // temporaries of one step
  size_t linear_copies = 0;    // bf16 / FP8 weight copies, FP8 scaling and scratch
  size_t total() const {
    return parameters + gradients + optimizer_state + activations + workspace + linear_copies;
  }
};

// An H200's memory as the device reports it (fp8train doctor).
inline constexpr double kH200MemoryGib = 139.8;

// The plan of one GPU out of `gpus` under ZeRO-1 over the data-parallel ones: each GPU holds the
// parameters, gradients and activations of its own micro-batch as a single GPU does, and its
// share of the AdamW moments (ceil(elements / replicas) of the parameter buffer, rounded up to
// the arenas' alignment, where replicas = gpus / tensor_parallel). The FP8 linears are those of
// decide_flux_precision(config, precision.policy), run with precision.fp8.recipe and
// precision.fp8_weight_transposes (in_backward: Ŵ alone, the largest Ŵᵗ in the scratch); FP8
// linears keep no saved input: they share the scratch's transposed input. Selective recompute saves
// one GELU output (and single-block linear2 input) for all blocks; full recompute saves the
// activations of fewer blocks. With tensor_parallel > 1 (which must divide gpus), the plan of the
// first rank of a tensor-parallel group of that many GPUs (the largest: it also holds the
// row-parallel biases' copies): its shares of the split tensors with their gradients and moments
// (flux_rank_parameters), its heads' and MLP share's activations and workspace, and its shares'
// weight copies; with sequence_parallel also only its tokens of the residual streams (the
// tokens must split over the group: ConfigError naming sequence_parallel otherwise).
FluxMemoryPlan plan_flux_memory(const FluxConfig& config, const FluxMicroBatch& micro_batch,
                                const FluxPrecision& precision, int gpus = 1,
                                const RecomputeOptions& recompute = {}, int tensor_parallel = 1,
                                bool sequence_parallel = false);

// What a GPU needs beyond the plan: the CUDA context with the kernels, cuBLASLt's workspace,
// cuDNN's attention workspace (which grows with the micro-batch's tokens) and, with several
// GPUs, NCCL's buffers. W-FLUX535's measured peaks exceed the plan by 0.6 GiB + 4 bytes per
// token and hidden unit (within 0.05 GiB at micro-batches 4 and 16); the reserve takes 1 GiB
// instead of 0.6, leaving room for NCCL.
size_t flux_runtime_reserve_bytes(const FluxConfig& config, const FluxMicroBatch& micro_batch);

// Whether the plan and the runtime reserve fit in capacity_bytes.
bool flux_fits(const FluxConfig& config, const FluxMicroBatch& micro_batch,
               const FluxMemoryPlan& plan, size_t capacity_bytes);

// The deepest model of config's shape whose plan on one of `gpus` GPUs fits capacity_bytes,
// with config's ratio of single to double blocks: d ≤ config.double_blocks double blocks and
// round(d · single_blocks / double_blocks) single ones, the largest d that fits (with no double
// blocks, the most single blocks up to config's). config itself when it fits; nullopt when not
// even the smallest such model does. tensor_parallel and sequence_parallel as for
// plan_flux_memory.
std::optional<FluxConfig> largest_fitting_flux(
    const FluxConfig& config, const FluxMicroBatch& micro_batch, const FluxPrecision& precision,
    int gpus, size_t capacity_bytes, const RecomputeOptions& recompute = {},
    int tensor_parallel = 1, bool sequence_parallel = false);

}  // namespace fp8t
