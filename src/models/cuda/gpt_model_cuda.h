// The nanochat GPT on the GPU path (CUDA builds only): the forward and backward of the CPU model
// (models/gpt_model.h) with bf16 activations, fp32 master parameters except the embedding tables
// (wte, value_embeds: bf16, as nanochat stores them on a GPU), fp32 gradients, linears in
// BF16 or FP8 (ops/cuda/linear_cuda.h) per the precision policy, attention through cuDNN and the
// soft-capped cross-entropy fused with its gradient. Everything runs asynchronously on one
// stream; a step synchronizes only where the caller reads a result (loss_value()).
//
// Memory is planned from the configuration and taken at construction, one allocation per
// category (core/device_arena.h): parameters and gradients (optim::device_parameter_layout),
// the activations saved for backward, the workspace of one step, and the weight copies and FP8
// scratch of the linears.
//
// Tensor parallelism (models/tensor_parallel.h) splits each block over a group of GPUs as the CPU
// model does: this rank computes its heads and its share of the MLP's hidden features, the
// output projections' partial outputs are summed over the group in bf16 (the residual added by
// the group's first rank), as are the input gradients of q, k, v and the MLP's first linear. The
// rank holds only its shares of the split tensors (gpt_parameter_split: the blocks' linears, the
// value gates and the value embeddings), each one contiguous matrix, with their gradients
// (layout(): optim::device_parameter_layout of the rank); the rest stays whole on every rank.
// Sequence parallelism (the group's `sequence`) keeps this rank's consecutive 1/size of the
// micro-batch's B·T rows in the residual stream, its norms and lm_head, as the CPU model does:
// the norms' outputs are gathered (all-gather) before the split linears, and the partial sums
// become a reduce-scatter that leaves each rank its rows. The embedding and the smear run on
// every row.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "models/cuda/device_tensor_parallel.h"
#include "models/cuda/fp8_health_cuda.h"
#include "models/cuda/linear_scalings.h"
#include "models/gpt_config.h"
#include "models/gpt_memory.h"
#include "models/gpt_model.h"
#include "models/precision_policy.h"
#include "models/recompute.h"
#include "numerics/float_bits.h"
#include "numerics/scaling.h"
#include "optim/cuda/device_parameters.h"

namespace fp8t {

namespace gemm {
class CublasLtGemm;
}
namespace ops::cuda {
class CudaLinear;
}

// Device bytes per category, for the plan printed before step 1.
struct CudaGptMemory {
  size_t parameters = 0;     // fp32 master weights, bf16 embedding tables
  size_t gradients = 0;      // fp32
  size_t activations = 0;    // saved for backward (bf16, fp32 statistics)
  size_t workspace = 0;      // temporaries of one step, logits included
  size_t linear_copies = 0;  // bf16 / FP8 weight copies, FP8 scratch
  // Of linear_copies: the FP8 scratch, which grows with the micro-batch as the activations do,
  // but for a few fixed bytes (scaling floats, the shared Ŵᵗ); not a category: total() leaves
  // it out.
  size_t linear_scratch = 0;
  // In the plan only, for FP8 linears that keep Ŵᵗ: what fp8_weight_transposes: in_backward
  // would take off linear_copies (not a category: total() leaves it out).
  size_t weight_transposes_saving = 0;
  // Of workspace: what the step's temporaries need of the region scratch_between_steps() lends,
  // which holds between_steps_bytes at the least (not a category).
  size_t step_temporaries = 0;
  size_t total() const { return parameters + gradients + activations + workspace + linear_copies; }
};

class CudaGptModel {
 public:
  // Called once the device memory is planned and before any of it is allocated, with the plan
  // (linear_copies as the linears will allocate them), the parameter layout and the bytes of
  // scratch_between_steps(): the engine checks what it will need against the free memory.
  using PlanCheck =
      std::function<void(const CudaGptMemory& planned, const optim::DeviceParameterLayout& layout,
                         size_t scratch_between_steps)>;

  // Runs on the current CUDA device. fp8 recipes: delayed, tensorwise, blockwise and mxfp8
  // (emulated), in the OCP formats.
  // recompute: full reruns the forward of the groups it picks before their backward
  // (models/recompute.h); the path saves what selective leaves whatever the setting. Full
  // recompute does not combine with fp8_attention, whose saved state a rerun would change.
  // tensor_parallel: the group this rank splits its blocks with; every rank of it sees the same
  // tokens and calls forward() and backward() in step with the others. Not with fp8_attention.
  // Its `sequence` needs this rank's rows, B·T / size, to be a multiple of 16 (ConfigError
  // naming sequence_parallel otherwise).
  // between_steps_bytes: the least scratch_between_steps() holds, for the optimizer's workspace
  // (optim::CudaGptOptimizer::planned_workspace_bytes) to live there rather than beside it.
  CudaGptModel(const GptConfig& config, int64_t batch, int64_t seq, const GptPrecision& precision,
               cudaStream_t stream, const PlanCheck& check_plan = {},
               const RecomputeOptions& recompute = {},
               const DeviceTensorParallel& tensor_parallel = {}, size_t between_steps_bytes = 0);
  ~CudaGptModel();
  CudaGptModel(const CudaGptModel&) = delete;
  CudaGptModel& operator=(const CudaGptModel&) = delete;

  const GptConfig& config() const { return config_; }
  cudaStream_t stream() const { return stream_; }
  const CudaGptMemory& memory() const { return memory_; }
  // The model's GEMM runner (its workspace and algorithm cache), for the optimizer's GEMMs on
  // the same stream.
  gemm::CublasLtGemm& gemm();
  const gemm::CublasLtGemm& gemm() const;
  // Device memory the model uses only inside forward() and backward() (the logits and their
  // gradient), 256-byte aligned: free for other work on the model's stream between a step's
  // last backward and the next forward. The GPU optimizer keeps its workspace there.
  std::span<uint8_t> scratch_between_steps() const;

  // Parameters and gradients on the device, laid out by optim::device_parameter_layout with the
  // embedding tables in bf16 (the gaps between tensors stay zero): the fp32 parameters, the bf16
  // ones, and every gradient in fp32.
  float* parameters() const { return parameters_; }
  bf16* bf16_parameters() const { return bf16_parameters_; }
  float* gradients() const { return gradients_; }
  const optim::DeviceParameterLayout& layout() const { return layout_; }
  // Copies between a host ParameterSet (f32, whole tensors) and the device parameters
  // (synchronizes); an upload makes the next forward cast the weights again. Under tensor
  // parallelism an upload takes this rank's shares of the host's tensors, and a download gathers
  // the group's shares: every rank of the group downloads together.
  void upload_parameters(const ParameterSet& host);
  void download_parameters(ParameterSet& host) const;
  void download_gradients(ParameterSet& host) const;

  // idx and targets [batch, seq] on the host (checked against the vocabulary, then copied).
  // Queues the forward; with_gradient also writes the loss's gradient into the logits, ready
  // for backward(). The mean loss lands on the device: loss_value() reads it.
  void forward(const int32_t* idx, const int32_t* targets, bool with_gradient);
  // Adds d(loss)/d(parameter) to the gradients. Needs a forward with_gradient first. Under
  // tensor parallelism each rank adds the gradients of its shares of the split parameters only,
  // and under sequence parallelism its rows' part of lm_head's and the residual scalars'.
  void backward();
  // Under tensor parallelism, once per optimizer step after the last backward: every rank of
  // the group takes the first rank's gradients of the tensors it holds whole, and under
  // sequence parallelism the gradients of lm_head and the residual scalars summed over the
  // group, so that every rank holds the same whole gradients of them. A share's gradient is
  // whole already. Nothing without tensor parallelism.
  void gather_split_gradients();
  // Called by backward(), when set, with each range of the gradients (elements of the layout)
  // as soon as the work queued on the stream completes it: lm_head's, each block's (its value
  // embedding's with it), the block below's next, and last the rest. Data parallelism reduces
  // each range while the backward goes on. Every gradient lies in exactly one range.
  using GradientsReady = std::function<void(int64_t offset, int64_t count)>;
  void set_gradients_ready(GradientsReady ready) { gradients_ready_ = std::move(ready); }
  void zero_gradients();
  // Waits for the stream and returns the mean loss of the last forward (under sequence
  // parallelism the group's, over every rank's rows).
  double loss_value();
  // The device pointer of that loss (fp32), for callers that sum it on the device.
  const float* loss_device() const { return loss_; }

  // Per linear: "fp8" or the reason it is not (from the precision policy).
  const std::vector<LinearPrecision>& linear_precision() const { return linear_precision_; }
  // Once per optimizer step, after the weights changed: the delayed-scaling update (reads the
  // step's amaxes back: one synchronization) and the weight casts of the next forward.
  void end_step();
  void set_training(bool training) { training_ = training; }
  // Host delayed-scaling state, named as GptModel::delayed_scalings(); the trainer saves and
  // loads it. After load_state on these, call scalings_changed().
  std::vector<std::pair<std::string, DelayedScaling*>> delayed_scalings();
  void scalings_changed();
  // FP8 health (ops/fp8_health.h): while on, the FP8 linears' casts count (fused input casts
  // give way to counting ones); take_fp8_health() returns the last counted step's records, per
  // FP8 linear (in linear_precision()'s order) and operand (synchronizes).
  void set_record_fp8_health(bool record);
  std::vector<Fp8TensorHealth> take_fp8_health();
  // The device floats of every FP8 linear's scaling (CudaLinearScalings::device_floats).
  CudaLinearScalings& scalings();

 private:
  struct Linear;
  struct Layer;
  struct Buffers;
  // Takes every device tensor from its arena: run once to plan, once more to allocate.
  void lay_out();
  // The residual a block starts from: the previous block's output, x0 for the first (for
  // n_layer, the last block's output).
  const bf16* previous_output(int index) const;
  // One block's forward, from previous_output(index); `record` as the linears' forward takes it.
  void block_forward(int index, bool record);
  void prepare_weights();
  Linear& linear(const std::string& name);
  // What mlp.c_proj reads: the hidden layer fc itself when it casts relu²(fc) on its own, else
  // relu²(fc) in the workspace.
  const bf16* mlp_activation(const bf16* fc, const ops::cuda::CudaLinear& mlp_proj);
  // This rank's share of a linear's weight and of its gradient (the whole without tensor
  // parallelism): where its rows or columns start in the whole tensor.
  const float* weight(const Linear& linear) const;
  float* weight_gradient(const Linear& linear) const;
  float* parameter(const std::string& name) const;  // an fp32 parameter
  const bf16* embedding_table(const std::string& name) const;
  // download_parameters and download_gradients: the tensors of a layout-ordered buffer (its bf16
  // ones from bf16_base, when not null) into host, the split ones gathered over the group.
  void download(const float* base, const bf16* bf16_base, ParameterSet& host) const;
  float* gradient(const std::string& name) const;
  // Sequence parallelism: the group's rows [B·T, C] of a tensor of this rank's rows, gathered
  // into the workspace's `whole` (valid until its next use); otherwise the tensor itself.
  const bf16* gather_rows(const bf16* own);
  // Where a row-parallel linear writes its partial output [B·T, C]: `whole` under sequence
  // parallelism, else `own` itself.
  bf16* partial_rows(bf16* own) const;
  // The partial output of partial_rows(own) summed over the group into `own`: in place, or under
  // sequence parallelism this rank's rows of the sum, to which it adds `residual` (its rows;
  // without sequence parallelism the first rank's GEMM has added it).
  void sum_partial_rows(bf16* own, const bf16* residual);
  // A partial [B·T, C] summed over the group: in place, or under sequence parallelism this
  // rank's rows of the sum, into `own`. Returns where the sum is.
  const bf16* sum_rows(bf16* partial, bf16* own);
  // Groups the layout into the ranges backward() reports, in its order.
  void plan_gradient_ranges();
  void report_gradients(size_t group) const;

  GptConfig config_;
  int64_t batch_, seq_, tokens_;
  GptPrecision precision_;
  std::vector<RecomputeGroup> recompute_groups_;  // full recompute's; empty otherwise
  DeviceTensorParallel tensor_parallel_;
  // This rank's query and kv heads and MLP hidden features (all of them without tensor
  // parallelism).
  int64_t heads_, kv_heads_, hidden_;
  bool sequence_ = false;           // sequence parallelism (tensor_parallel_.sequence)
  size_t between_steps_bytes_ = 0;  // the least scratch_between_steps() holds
  // This rank's rows of the residual stream (B·T without sequence parallelism) and the first.
  int64_t rows_ = 0, first_row_ = 0;
  cudaStream_t stream_;
  bool training_ = true;
  bool weights_ready_ = false;
  CudaFp8HealthRecording fp8_health_;
  std::vector<LinearPrecision> linear_precision_;
  optim::DeviceParameterLayout layout_;
  GradientsReady gradients_ready_;
  // Per group of gradients that complete together (lm_head, blocks n-1 .. 0, the rest): ranges
  // {offset, count} of the layout, padding between tensors included.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> gradient_ranges_;
  // Under sequence parallelism, the ranges {offset, count} of the gradients
  // gather_split_gradients() sums (lm_head's, the scalars'), adjacent ones merged.
  std::vector<std::pair<int64_t, int64_t>> split_gradient_ranges_;
  // Under tensor parallelism the other tensors every rank holds whole, whose gradients are the
  // first rank's (gather_split_gradients).
  std::vector<std::pair<int64_t, int64_t>> replicated_gradient_ranges_;
  float* parameters_ = nullptr;
  bf16* bf16_parameters_ = nullptr;
  float* gradients_ = nullptr;
  float* loss_ = nullptr;
  CudaGptMemory memory_;
  std::unique_ptr<Buffers> buffers_;
};

}  // namespace fp8t
