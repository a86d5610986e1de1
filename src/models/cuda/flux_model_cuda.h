// The Flux MMDiT on the GPU path (CUDA builds only): the forward and backward of the CPU model
// (models/flux_model.h) with bf16 activations, fp32 master parameters and gradients, linears in
// BF16 or FP8 (ops/cuda/linear_cuda.h, biases in the GEMM epilogue) per decide_flux_precision,
// the joint attention through cuDNN without a mask, and the rectified-flow MSE fused with its
// gradient. Everything runs asynchronously on one stream; a step synchronizes only where the
// caller reads a result (loss_value()).
//
// Memory is planned from the configuration and the token counts and taken at construction, one
// allocation per category (core/device_arena.h), as the GPU GPT does.
//
// FP8 recipes: delayed, tensorwise, blockwise and mxfp8 (emulated). Delayed scaling runs as in
// the GPU GPT (models/cuda/linear_scalings.h): the histories on the host, the step's amaxes read
// back once per step by end_step().
//
// Tensor parallelism splits the blocks over a group of GPUs as the CPU model does
// (flux_tensor_share): this rank computes its heads and its share of the MLP's hidden features;
// the row-parallel linears' partial outputs (their bias added by the group's first rank) and the
// column-parallel linears' input gradients are summed over the group in bf16. Each rank holds
// only its shares of the split tensors, with their gradients (flux_rank_parameters: the shares
// first, each one contiguous matrix for the GEMMs, then the replicated tensors whole), and so
// does an optimizer over layout(); the host copies gather the shares over the group.
//
// Sequence parallelism (the group's `sequence`) splits the tokens outside the split linears as
// the CPU model does: each rank keeps its 1/T of every sample's image and text tokens in img_in
// and txt_in, the residual streams, the LayerNorms and modulated outputs, the gated sums and the
// final layer; the modulated inputs are all-gathered before the column-parallel linears (in the
// forward and again in the backward), and the row-parallel outputs and the column-parallel
// input gradients reduce-scattered to each rank's tokens (NCCL's all-gather and reduce-scatter,
// as many bytes as plain tensor parallelism's all-reduces). The prediction is gathered, so that
// the loss is the whole micro-batch's on every rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "models/cuda/device_tensor_parallel.h"
#include "models/cuda/fp8_health_cuda.h"
#include "models/cuda/linear_scalings.h"
#include "models/flux_config.h"
#include "models/flux_model.h"
#include "models/recompute.h"
#include "numerics/scaling.h"
#include "optim/cuda/adamw_cuda.h"
#include "optim/cuda/device_parameters.h"

namespace fp8t {

namespace gemm {
class CublasLtGemm;
}
namespace ops::cuda {
struct FusedCast;
}

// Device bytes per category, for the plan printed before step 1.
struct CudaFluxMemory {
  size_t parameters = 0;     // fp32 master weights
  size_t gradients = 0;      // fp32
  size_t activations = 0;    // saved for backward (bf16, fp32 statistics)
  size_t workspace = 0;      // temporaries of one step, inputs and gradients of the streams
  size_t linear_copies = 0;  // bf16 / FP8 weight copies, FP8 scratch
  size_t total() const { return parameters + gradients + activations + workspace + linear_copies; }
};

class CudaFluxModel {
 public:
  // Runs on the current CUDA device. batch · (img_tokens + txt_tokens), batch · img_tokens and
  // batch · txt_tokens must be multiples of 16 (the FP8 GEMMs' rows). recompute: full reruns
  // the forward of the groups of blocks flux_recompute_groups picks (models/recompute.h) from
  // their saved input, before their backward; not with fp8_attention, whose saved scales a
  // rerun would change. Selective keeps GELU's outputs (a single block's linear2 input) in one
  // buffer shared by the blocks and computes them again before mlp.2's (linear2's) backward.
  // tensor_parallel: the group this rank splits its blocks with; every rank of it sees the same
  // inputs and calls forward() and backward() in step with the others. Not with fp8_attention.
  // With its `sequence` on, the group's size must divide img_tokens and txt_tokens (ConfigError
  // naming sequence_parallel).
  CudaFluxModel(const FluxConfig& config, int64_t batch, int64_t img_tokens, int64_t txt_tokens,
                const FluxPrecision& precision, cudaStream_t stream,
                const RecomputeOptions& recompute = {},
                const DeviceTensorParallel& tensor_parallel = {});
  ~CudaFluxModel();
  CudaFluxModel(const CudaFluxModel&) = delete;
  CudaFluxModel& operator=(const CudaFluxModel&) = delete;

  const FluxConfig& config() const { return config_; }
  const CudaFluxMemory& memory() const { return memory_; }
  gemm::CublasLtGemm& gemm();
  const gemm::CublasLtGemm& gemm() const;
  cudaStream_t stream() const { return stream_; }

  // This rank's parameters and gradients, laid out by layout() (flux_rank_parameters).
  float* parameters() const { return parameters_; }
  float* gradients() const { return gradients_; }
  const optim::DeviceParameterLayout& layout() const { return layout_; }
  // For an optimizer over layout(): under tensor parallelism its leading shares, whose squares
  // the gradient norm sums over the group; none otherwise.
  optim::GradientShares gradient_shares() const;
  // Copies between a host FluxParameterSet (f32, whole tensors) and the device (synchronizes);
  // an upload makes the next forward cast the weights again. Under tensor parallelism every
  // rank of the group calls each together: a download gathers the shares over the group, and
  // an upload sends the group's first rank's host tensors to every rank of it, so that the
  // other ranks need no host copy (null: none; they download nothing).
  void upload_parameters(const FluxParameterSet* host);
  void upload_parameters(const FluxParameterSet& host) { upload_parameters(&host); }
  void download_parameters(FluxParameterSet* host) const;
  void download_parameters(FluxParameterSet& host) const { download_parameters(&host); }
  void download_gradients(FluxParameterSet& host) const;
  // One tensor of layout() (a parameter's, a gradient's or a moment's values on this rank, at
  // `device`) from and to its whole values on the host, as the copies above (synchronizes).
  void download_tensor(const std::string& name, const float* device, float* host) const;
  void upload_tensor(const std::string& name, const float* host, float* device) const;

  // Queues the forward of one micro-batch (host fp32 inputs, copied first) and the loss
  // mean((prediction − target)²) against target [B, L_img, in_channels] (host fp32); with
  // with_gradient also the loss's gradient times grad_scale (1 / micro-batches when they
  // accumulate), ready for backward().
  void forward(const FluxInputs& inputs, const float* target, bool with_gradient,
               float grad_scale = 1.0f);
  // Adds d(loss)/d(parameter) to the gradients. Needs a forward with_gradient first. Under
  // tensor parallelism each rank adds its shares' gradients, and to the replicated tensors' its
  // heads' part of the QK norms' scales' and (the first rank alone) the row-parallel biases'.
  void backward();
  // Under tensor parallelism, once per optimizer step after the last backward: those partial
  // gradients of replicated tensors summed over the group (under sequence parallelism also
  // img_in's, txt_in's and final_layer.linear's, which each rank takes from its tokens), so that
  // every rank holds them whole. Nothing otherwise.
  void sum_partial_gradients();
  void zero_gradients();
  // Waits for the stream and returns the loss of the last forward.
  double loss_value();
  // The last forward's loss on the device (one float), for callers that copy it without waiting.
  const float* loss_device() const;
  // The last forward's prediction [B, L_img, in_channels] as fp32 (synchronizes).
  std::vector<float> prediction() const;

  const std::vector<FluxLinearPrecision>& linear_precision() const { return linear_precision_; }
  // The weights whose per-tensor amax the optimizer's step can take for their next cast (tensorwise
  // FP8 linears; CudaAdamW::measure_amaxes), each with its slot.
  std::vector<optim::TensorAmaxSlot> weight_amax_slots() const;
  // Once per optimizer step, after the weights changed: the delayed-scaling update (one
  // synchronization) and the weight casts of the next forward. weight_amaxes_measured: the step
  // wrote every weight_amax_slots() amax, which those casts then read instead of measuring.
  void end_step(bool weight_amaxes_measured = false);
  // Training records the amaxes delayed scaling learns from; evaluation leaves them alone.
  void set_training(bool training) { training_ = training; }
  // Host delayed-scaling state, named as FluxModel::delayed_scalings(); the trainer saves and
  // loads it. After load_state on these, call scalings_changed().
  std::vector<std::pair<std::string, DelayedScaling*>> delayed_scalings();
  void scalings_changed();
  // FP8 health (ops/fp8_health.h): while on, the FP8 linears' casts count (fused input casts
  // give way to counting ones); take_fp8_health() returns the last counted step's records, per
  // FP8 linear (in linear_precision()'s order) and operand (synchronizes).
  void set_record_fp8_health(bool record);
  std::vector<Fp8TensorHealth> take_fp8_health();
  // The FP8 linears' device scaling floats (data parallelism max-reduces their amaxes).
  CudaLinearScalings& scalings();

 private:
  struct Linear;
  struct AttentionSaved;
  struct Stream;
  struct DoubleBlock;
  struct SingleBlock;
  struct Buffers;
  void lay_out();
  void prepare_weights();
  void upload_inputs(const FluxInputs& inputs, const float* target);
  Linear& linear(const std::string& name);
  float* parameter(const std::string& name) const;
  float* gradient(const std::string& name) const;
  // Forward and backward pieces, in the order of BFL's Flux.forward.
  void linear_forward(const std::string& name, const bf16* x, int64_t rows, bf16* y);
  // The input cast the modulated LayerNorm before linear `name` does for it (its next forward);
  // none under sequence parallelism for the linears that read gathered tokens.
  ops::cuda::FusedCast norm_cast(const std::string& name);
  // The input amax a kernel writing linear `name`'s input can take for it (tensorwise; null
  // otherwise: CudaLinear::fused_input_amax).
  float* fused_input_amax(const std::string& name);
  // dx (bf16; written, or added to when accumulate_dx; null: none), dW and db (added).
  void linear_backward(const std::string& name, const bf16* dy, const bf16* x, int64_t rows,
                       bf16* dx, bool accumulate_dx);
  // A modulation linear on SiLU(vec): its whole chunks into mod [B, chunks·C] (gathered over the
  // group when split); backward reads dmod and adds its part of d SiLU(vec).
  void modulation_forward(const std::string& name, bf16* mod);
  void modulation_backward(const std::string& name);
  void embedder_forward(const std::string& name, int index, bf16* out);
  void embedder_backward(const std::string& name, int index, const bf16* dout);
  // Per sample, a stream's `tokens` rows of `width` values (row stride ld) into and out of rows
  // first .. first + tokens of a joint [B, L, width] tensor.
  void into_joint(bf16* joint, const bf16* rows, int64_t ld, int64_t first, int64_t tokens,
                  int64_t width);
  // amax (not null): the largest magnitude copied out, for the FP8 cast of the rows written
  // (CudaLinear::fused_input_amax).
  void out_of_joint(bf16* rows, int64_t ld, const bf16* joint, int64_t first, int64_t tokens,
                    int64_t width, float* amax = nullptr);
  // One stream's q, k (QK norm with its scales, RoPE) and v into the joint sequence of
  // `attention`, from raw [B·L_s, ·] with row stride ld; and the way back.
  // The joint attention of a block, in BF16 or FP8 (fp8_dot_product_attention): forward writes
  // attention.out and .stats; backward writes the workspace's dq, dk and dv from d_attn.
  void joint_attention_forward(AttentionSaved& attention);
  void joint_attention_backward(AttentionSaved& attention);
  void stream_into_joint(AttentionSaved& attention, const std::string& norm, const bf16* raw,
                         int64_t ld, int64_t first, int64_t tokens);
  void stream_from_joint(const AttentionSaved& attention, const std::string& norm, bf16* draw,
                         int64_t ld, int64_t first, int64_t tokens);
  void double_block_forward(int block);
  void double_block_backward(int block);
  void single_block_forward(int block);
  // A single block's linear2 input: its attention output beside GELU of its MLP input; amax as
  // out_of_joint's.
  void linear2_input(const SingleBlock& block, float* amax = nullptr);
  void single_block_backward(int block);
  // Full recompute: before the first block of a group runs forward, its input (the streams, or
  // the joint sequence) is saved; before the backward of a group's last block, the group's
  // forward runs again from it, recording no amax and counting no FP8 health.
  void save_group_input(bool doubles, int block);
  void rerun_group_ending_at(bool doubles, int block);
  // A group's input from the forward's streams (or joint sequence) into its saved copy (save),
  // or back.
  void copy_group_input(bool doubles, size_t group, bool save);
  // Sequence parallelism: where this rank's tokens of a stream sit (all of them without it).
  FluxOwnTokens own_tokens(FluxStream stream) const;
  // A stream's tokens [B, L_s, width] gathered into `whole` from every rank's own [B, O_s,
  // width]; returns whole, or own itself without sequence parallelism.
  const bf16* gather_tokens(const bf16* own, FluxStream stream, int64_t width, bf16* whole);
  // Between one rank's tokens of a stream, own [B, O_s, width], and their places (`at`) among
  // the stream's every token, whole [B, L_s, width]: into own, or into whole when to_whole.
  void copy_token_runs(const FluxOwnTokens& at, bf16* own, bf16* whole, int64_t width,
                       bool to_whole) const;
  // Between every rank's tokens of a stream one after the other in the staging ([T, B·O_s,
  // width], the collectives' order) and their places in whole [B, L_s, width]: into whole when
  // to_whole, else out of it.
  void copy_staging(bf16* whole, FluxStream stream, int64_t width, bool to_whole);
  // Reduces a partial [B, L_s, width] (a row-parallel output, a column-parallel input's
  // gradient) over the group and returns this rank's tokens of the sum: reduce-scattered into
  // `own` under sequence parallelism, the partial itself (summed in place) otherwise.
  const bf16* reduce_to_own_tokens(bf16* partial, FluxStream stream, int64_t width, bf16* own);
  // Where a row-parallel linear writes its partial output whose own tokens go to `own`: the
  // workspace under sequence parallelism, else own itself.
  bf16* partial_output(bf16* own);
  // A modulation's gradient [B, width] (fp32), summed over the group under sequence
  // parallelism, where each rank's tokens add their part.
  void sum_modulation_gradient(float* dmod, int64_t width);

  FluxConfig config_;
  int64_t batch_, img_tokens_, txt_tokens_, tokens_;
  FluxPrecision precision_;
  DeviceTensorParallel tensor_parallel_;
  bool sequence_ = false;  // sequence parallelism (the constructor refuses it without a group)
  // This rank's image, text and joint tokens per sample in the residual streams: all of them,
  // or under sequence parallelism its 1/T of each stream.
  int64_t own_img_, own_txt_, own_tokens_;
  // This rank's attention width (its heads' features), heads and MLP hidden features: all of
  // them without tensor parallelism.
  int64_t attention_width_, heads_, mlp_hidden_;
  cudaStream_t stream_;
  bool weights_ready_ = false;
  bool weight_amaxes_measured_ = false;  // for the next prepare_weights(): see end_step()
  CudaFp8HealthRecording fp8_health_;
  bool training_ = true;
  FluxRecomputeGroups recompute_;
  bool rerunning_ = false;  // inside rerun_group_ending_at
  bool selective_;          // selective recompute
  std::vector<FluxLinearPrecision> linear_precision_;
  optim::DeviceParameterLayout layout_;
  float* parameters_ = nullptr;
  float* gradients_ = nullptr;
  // Tensor parallelism: the elements of layout_'s shares; each share's tensor by name, with its
  // whole shape [out, in] (in 1 for a bias); the ranges {offset, count} of the gradients
  // sum_partial_gradients() sums.
  int64_t share_elements_ = 0;
  struct TensorPart {
    TensorShare share;
    int64_t whole_out = 0, whole_in = 1;
  };
  std::map<std::string, TensorPart> tensor_parts_;
  std::vector<std::pair<int64_t, int64_t>> partial_gradient_ranges_;
  CudaFluxMemory memory_;
  std::unique_ptr<Buffers> buffers_;
};

}  // namespace fp8t
