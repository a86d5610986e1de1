#include "models/flux_memory.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/device_arena.h"
#include "core/error.h"
#include "numerics/float_bits.h"
#include "numerics/quantize.h"
#include "ops/fp8_linear_layout.h"
#include "optim/cuda/device_parameters.h"

namespace fp8t {

namespace {

// The floats of the reduction workspace every Flux kernel that sums over tokens shares
// (ops/cuda/flux_ops.h: flux_reduction_workspace_floats(), which CPU builds lack).
constexpr size_t kReductionWorkspaceFloats = size_t{1} << 21;

size_t round_up(size_t bytes, size_t granule) {
  return (bytes + granule - 1) / granule * granule;
}

// Counts one device arena's bytes as DeviceArena::take counts them.
class ArenaBytes {
 public:
  template <typename T>
  void take(int64_t count) {
    bytes_ += round_up(static_cast<size_t>(count) * sizeof(T), DeviceArena::kAlignment);
  }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_ = 0;
};

bool block_scaled(ScalingRecipe recipe) {
  return recipe == ScalingRecipe::Blockwise || recipe == ScalingRecipe::Mxfp8;
}

// The shapes CudaFluxModel::lay_out() sizes its tensors by: A, M and H are one tensor-parallel
// rank's attention width, MLP hidden features and heads; Oi, Ot and O its image, text and joint
// tokens per sample in the residual streams (all of them without sequence parallelism).
struct Dims {
  int64_t B, Li, Lt, L, Oi, Ot, O, C, A, M, H, D, Cin, ctx, vec, sinusoid, N, Ls;
  bool sequence;
};

Dims dims_of(const FluxConfig& config, const FluxMicroBatch& micro_batch, int tensor_parallel,
             bool sequence_parallel) {
  Dims d{};
  d.B = micro_batch.batch;
  d.Li = micro_batch.img_tokens;
  d.Lt = micro_batch.txt_tokens;
  d.L = d.Li + d.Lt;
  d.sequence = sequence_parallel;
  d.Oi = d.sequence ? d.Li / tensor_parallel : d.Li;
  d.Ot = d.sequence ? d.Lt / tensor_parallel : d.Lt;
  d.O = d.Oi + d.Ot;
  d.C = config.hidden_size;
  d.A = config.hidden_size / tensor_parallel;
  d.M = config.mlp_hidden() / tensor_parallel;
  d.H = config.num_heads / tensor_parallel;
  d.D = config.head_dim();
  d.Cin = config.in_channels;
  d.ctx = config.context_in_dim;
  d.vec = config.vec_in_dim;
  d.sinusoid = config.timestep_dim();
  d.N = d.B * d.L;
  d.Ls = std::max(d.Li, d.Lt);
  return d;
}

// The saved activations, tensor by tensor in lay_out()'s order.
size_t activation_bytes(const FluxConfig& config, const Dims& d,
                        const RecomputeOptions& recompute) {
  const bool selective = recompute.granularity == RecomputeGranularity::Selective;
  ArenaBytes act;
  act.take<bf16>(d.B * d.Oi * d.Cin);  // img
  act.take<bf16>(d.B * d.Ot * d.ctx);  // txt
  const int embedders = config.guidance_embed ? 3 : 2;
  const int64_t embedder_inputs[] = {d.sinusoid, d.vec, d.sinusoid};
  for (int e = 0; e < embedders; ++e) {
    act.take<bf16>(d.B * embedder_inputs[e]);
    act.take<bf16>(d.B * d.C);  // in_layer's output
    act.take<bf16>(d.B * d.C);  // after SiLU
  }
  act.take<bf16>(d.B * d.C);  // vec
  act.take<bf16>(d.B * d.C);  // SiLU(vec)
  const auto attention = [&] {
    for (int view = 0; view < 6; ++view)  // q, k, v, q and k before scale and rotation, out
      act.take<bf16>(d.N * d.A);
    act.take<float>(d.N * d.H);        // q's rstd
    act.take<float>(d.N * d.H);        // k's rstd
    act.take<float>(d.B * d.H * d.L);  // softmax statistics
  };
  const auto double_block = [&] {
    for (const auto& [rows, own_rows] :
         {std::pair{d.B * d.Li, d.B * d.Oi}, std::pair{d.B * d.Lt, d.B * d.Ot}}) {
      act.take<bf16>(d.B * 6 * d.C);        // modulation
      for (int view = 0; view < 6; ++view)  // norm1, modulated1, proj, norm2, ...
        act.take<bf16>(own_rows * d.C);
      act.take<bf16>(rows * d.A);                  // the attention's output
      act.take<float>(own_rows);                   // rstd1
      act.take<float>(own_rows);                   // rstd2
      act.take<bf16>(rows * d.M);                  // MLP hidden
      if (!selective) act.take<bf16>(rows * d.M);  // after GELU
    }
    attention();
  };
  const auto single_block = [&] {
    act.take<bf16>(d.B * 3 * d.C);          // modulation
    act.take<bf16>(d.B * d.O * d.C);        // normed
    act.take<bf16>(d.B * d.O * d.C);        // modulated
    act.take<float>(d.B * d.O);             // rstd
    act.take<bf16>(d.N * (3 * d.A + d.M));  // linear1's output
    attention();
    if (!selective) act.take<bf16>(d.N * (d.A + d.M));  // linear2's input
    act.take<bf16>(d.B * d.O * d.C);                    // linear2's output
  };
  // Full recompute: the blocks outside the groups save their own; those in groups share one set
  // per place in a group; each group saves its input (the streams, or the joint sequence).
  const FluxRecomputeGroups groups =
      flux_recompute_groups(recompute, config.double_blocks, config.single_blocks);
  // Selective: GELU's outputs and the single blocks' linear2 input, one buffer each for all.
  if (selective && config.double_blocks > 0) act.take<bf16>(d.B * d.Ls * d.M);
  if (selective && config.single_blocks > 0) act.take<bf16>(d.N * (d.A + d.M));
  for (int set = 0; set < recompute_saved_sets(groups.doubles, config.double_blocks); ++set)
    double_block();
  for (size_t group = 0; group < groups.doubles.size(); ++group) {
    act.take<bf16>(d.B * d.Oi * d.C);
    act.take<bf16>(d.B * d.Ot * d.C);
  }
  for (int set = 0; set < recompute_saved_sets(groups.singles, config.single_blocks); ++set)
    single_block();
  for (size_t group = 0; group < groups.singles.size(); ++group)
    act.take<bf16>(d.B * d.O * d.C);
  act.take<bf16>(d.B * 2 * d.C);       // final modulation
  act.take<bf16>(d.B * d.Oi * d.C);    // final normed
  act.take<bf16>(d.B * d.Oi * d.C);    // final modulated
  act.take<float>(d.B * d.Oi);         // final rstd
  act.take<bf16>(d.B * d.Li * d.Cin);  // prediction
  return act.bytes();
}

// The temporaries of one step, in lay_out()'s order.
size_t workspace_bytes(const FluxConfig& config, const Dims& d) {
  ArenaBytes ws;
  ws.take<float>(d.B * d.Li * d.Cin);  // img, fp32 from the host
  ws.take<float>(d.B * d.Lt * d.ctx);  // txt
  ws.take<float>(d.B * d.vec);         // y
  ws.take<float>(d.B * d.Li * d.Cin);  // target
  ws.take<float>(d.B * d.sinusoid);    // sinusoid of the timesteps
  ws.take<float>(d.B * d.sinusoid);    // and of the guidance
  ws.take<float>(d.L * d.D / 2);       // RoPE cos
  ws.take<float>(d.L * d.D / 2);       // RoPE sin
  ws.take<float>(1);                   // loss
  ws.take<float>(static_cast<int64_t>(kReductionWorkspaceFloats));
  ws.take<bf16>(d.B * d.Oi * d.C);      // x_img
  ws.take<bf16>(d.B * d.Ot * d.C);      // x_txt
  ws.take<bf16>(d.B * d.O * d.C);       // x_joint
  ws.take<bf16>(d.B * d.C);             // embedding
  ws.take<bf16>(d.B * d.Ls * 3 * d.A);  // a stream's qkv
  ws.take<bf16>(d.B * d.Oi * d.C);      // d_img
  ws.take<bf16>(d.B * d.Ot * d.C);      // d_txt
  ws.take<bf16>(d.B * d.O * d.C);       // d_joint
  ws.take<bf16>(d.B * d.Li * d.Cin);    // d(prediction)
  ws.take<float>(d.B * 6 * d.C);        // modulation gradients, img
  ws.take<float>(d.B * 6 * d.C);        // and txt
  ws.take<bf16>(d.B * 6 * d.C);         // their bf16 copy
  for (int view = 0; view < 4; ++view)  // d_vec_act, d_vec, d_embed_act, d_embed_hidden
    ws.take<bf16>(d.B * d.C);
  // d_branch (this rank's tokens, or a modulation's chunks), then d_modulated.
  ws.take<bf16>(d.B * std::max<int64_t>(d.O, 6) * d.C);
  ws.take<bf16>(d.N * d.C);
  for (int view = 0; view < 4; ++view)  // d_attn, dq, dk, dv
    ws.take<bf16>(d.N * d.A);
  ws.take<bf16>(d.B * d.Ls * d.M);      // d_mlp_act
  ws.take<bf16>(d.B * d.Ls * d.M);      // d_mlp_hidden
  ws.take<bf16>(d.B * d.Ls * 3 * d.A);  // d_qkv
  if (config.single_blocks > 0) {
    ws.take<bf16>(d.N * (3 * d.A + d.M));  // d(linear1's output)
    ws.take<bf16>(d.N * (d.A + d.M));      // d(linear2's input)
  }
  if (d.sequence) {
    ws.take<bf16>(std::max(d.N * d.C, d.B * d.Li * d.Cin));  // the collectives' staging
    ws.take<bf16>(std::max({d.N * d.C, d.B * d.Li * d.Cin, d.B * d.Lt * d.ctx}));  // every token
    ws.take<bf16>(d.B * d.O * d.C);     // a summed input gradient's own tokens
    ws.take<bf16>(d.B * d.Oi * d.Cin);  // the final layer's own output
  }
  return ws.bytes();
}

// The scaling floats, the FP8 health counters (models/cuda/linear_scalings.h) and the shared
// quantization scratch (ops/cuda/linear_cuda.h
// take_fp8_scratch) of the FP8 linears, in the scratch arena. The backward's three operands
// (x̂ᵗ, dŷ, dŷᵗ) hold max_tokens rows of backward_width bytes, and at least 128 rows of the
// widest layer: wider layers run their backward in chunks of rows.
size_t fp8_scratch_bytes(ScalingRecipe recipe, int64_t fp8_count, int64_t max_tokens,
                         int64_t max_in, int64_t max_out, int64_t backward_width,
                         const ops::WeightTScratch& weight_t) {
  ArenaBytes scratch;
  scratch.take<float>(fp8_count * ops::kLinearScalingFloats);
  scratch.take<CastHealth>(fp8_count * ops::kHealthCountersPerLinear);
  scratch.take<uint8_t>(max_tokens * max_in);  // x̂
  const int64_t backward = ops::fp8_backward_elements(max_tokens, max_in, max_out, backward_width);
  for (int buffer = 0; buffer < 3; ++buffer)
    scratch.take<uint8_t>(backward);
  scratch.take<uint8_t>(weight_t.bytes);  // the largest Ŵᵗ and its scales, if made in backward
  scratch.take<float>(weight_t.scale_floats);
  if (!block_scaled(recipe)) return scratch.bytes();
  const int64_t widest = std::max(max_in, max_out);
  const int64_t floats = ops::fp8_scale_scratch_floats(max_tokens, max_in, max_out);
  for (int buffer = 0; buffer < 4; ++buffer)  // the scales of x̂, x̂ᵗ, dŷ and dŷᵗ
    scratch.take<float>(floats);
  if (recipe == ScalingRecipe::Mxfp8) {
    scratch.take<bf16>(max_tokens * widest);  // the emulated GEMMs' dequantized operands
    scratch.take<bf16>(max_tokens * max_in);
  }
  return scratch.bytes();
}

size_t linear_copy_bytes(const FluxConfig& config, const FluxMicroBatch& micro_batch,
                         const FluxPrecision& precision, int tensor_parallel) {
  const ScalingRecipe recipe = precision.fp8.recipe;
  size_t bytes = 0;
  int64_t fp8_count = 0, max_in = 0, max_out = 0, max_rows = 0;
  ops::WeightTScratch weight_t;
  std::vector<FluxLinearPrecision> decisions = decide_flux_precision(config, precision.policy);
  keep_unblocked_flux_shares_in_bf16(decisions, config, recipe, tensor_parallel);
  for (const FluxLinearPrecision& decision : decisions) {
    const auto [in, out] = flux_tensor_share(decision.linear, config, tensor_parallel, 0)
                               .features(decision.linear.in_features, decision.linear.out_features);
    bytes += ops::linear_weight_bytes(in, out, /*bias=*/true, decision.fp8, recipe,
                                      precision.fp8_weight_transposes);
    if (!decision.fp8) continue;
    ++fp8_count;
    max_in = std::max(max_in, in);
    max_out = std::max(max_out, out);
    max_rows = std::max(max_rows, flux_linear_rows(decision.linear, micro_batch.batch,
                                                   micro_batch.img_tokens, micro_batch.txt_tokens));
    if (precision.fp8_weight_transposes == ops::WeightTransposes::InBackward)
      weight_t.fit(in, out, recipe);
  }
  // CudaFluxModel's backward operands fit the MLPs whole; linear1 and linear2 run in chunks.
  if (fp8_count > 0) {
    const int64_t mlp = config.mlp_hidden() / tensor_parallel;
    bytes += fp8_scratch_bytes(recipe, fp8_count, max_rows, max_in, max_out,
                               std::max<int64_t>(config.hidden_size, mlp), weight_t);
  }
  return bytes;
}

}  // namespace

FluxMemoryPlan plan_flux_memory(const FluxConfig& config, const FluxMicroBatch& micro_batch,
                                const FluxPrecision& precision, int gpus,
                                const RecomputeOptions& recompute, int tensor_parallel,
                                bool sequence_parallel) {
  config.validate();
  check_flux_tensor_parallel(config, tensor_parallel);
  if (sequence_parallel) {
    check_flux_sequence_parallel(tensor_parallel, micro_batch.img_tokens, micro_batch.txt_tokens);
  }
  FP8T_CHECK(micro_batch.batch >= 1 && micro_batch.img_tokens >= 1 && micro_batch.txt_tokens >= 1,
             "expected a batch, image and text tokens of at least 1, found {}, {}, {}",
             micro_batch.batch, micro_batch.img_tokens, micro_batch.txt_tokens);
  FP8T_CHECK(gpus >= 1 && gpus % tensor_parallel == 0,
             "expected a positive multiple of the {} GPUs of a tensor-parallel group, found {}",
             tensor_parallel, gpus);
  const optim::DeviceParameterLayout layout =
      optim::device_parameter_layout(flux_rank_parameters(config, tensor_parallel, 0).parameters);
  const Dims dims = dims_of(config, micro_batch, tensor_parallel, sequence_parallel);
  FluxMemoryPlan plan;
  plan.parameters = layout.total_bytes();
  plan.gradients = layout.total_bytes();
  const int replicas = gpus / tensor_parallel;  // ZeRO-1 shards over a share's replicas
  const auto shard_elements =
      static_cast<size_t>((layout.total_elements + replicas - 1) / replicas);
  plan.optimizer_state =
      2 * round_up(shard_elements * sizeof(float), optim::DeviceParameterLayout::kAlignmentBytes);
  plan.activations = activation_bytes(config, dims, recompute);
  plan.workspace = workspace_bytes(config, dims);
  plan.linear_copies = linear_copy_bytes(config, micro_batch, precision, tensor_parallel);
  return plan;
}

size_t flux_runtime_reserve_bytes(const FluxConfig& config, const FluxMicroBatch& micro_batch) {
  const int64_t tokens = micro_batch.batch * (micro_batch.img_tokens + micro_batch.txt_tokens);
  return (size_t{1} << 30) + sizeof(float) * static_cast<size_t>(tokens * config.hidden_size);
}

bool flux_fits(const FluxConfig& config, const FluxMicroBatch& micro_batch,
               const FluxMemoryPlan& plan, size_t capacity_bytes) {
  return plan.total() + flux_runtime_reserve_bytes(config, micro_batch) <= capacity_bytes;
}

std::optional<FluxConfig> largest_fitting_flux(const FluxConfig& config,
                                               const FluxMicroBatch& micro_batch,
                                               const FluxPrecision& precision, int gpus,
                                               size_t capacity_bytes,
                                               const RecomputeOptions& recompute,
                                               int tensor_parallel, bool sequence_parallel) {
  // With double blocks, their count steps and the single blocks follow in proportion; without,
  // the single blocks step alone. Memory grows with each block, so the first fit is the largest.
  const bool by_double = config.double_blocks > 0;
  for (int step = by_double ? config.double_blocks : config.single_blocks; step >= 1; --step) {
    FluxConfig candidate = config;
    if (by_double) {
      candidate.double_blocks = step;
      candidate.single_blocks =
          static_cast<int>(std::lround(double(step) * config.single_blocks / config.double_blocks));
    } else {
      candidate.single_blocks = step;
    }
    const FluxMemoryPlan plan = plan_flux_memory(candidate, micro_batch, precision, gpus, recompute,
                                                 tensor_parallel, sequence_parallel);
    if (flux_fits(candidate, micro_batch, plan, capacity_bytes)) return candidate;
  }
  return std::nullopt;
}

}  // namespace fp8t
