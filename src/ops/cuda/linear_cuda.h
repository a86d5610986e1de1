// A linear layer of the GPU path (CUDA builds only): y = x·Wᵀ with bf16 activations and an fp32
// master weight, computed either in BF16 (a bf16 copy of the weight, cuBLASLt BF16 GEMMs) or in
// FP8 with a per-tensor recipe (delayed or tensorwise) or block scales (blockwise: 1x128 blocks
// for activations and gradients, 128x128 tiles for weights, split accumulation throughout, the
// only mode cuBLASLt runs them in on sm_90), the GEMMs of ops/fp8_linear.h:
//   forward  y  = x̂·Ŵᵀ        fast accumulation
//   dgrad    dx = dŷ·(Ŵᵗ)ᵀ     split accumulation (fast accumulation off)
//   wgrad    dW += dŷᵗ·(x̂ᵗ)ᵀ  split accumulation; a BF16 GEMM on x when fp8_wgrad is off
// Quantization (numerics/quantize_cuda.h) is one cast + amax pass per activation, fused into
// the kernel that produces it where the model offers one (fused_input_cast: its RMSNorms), one
// fused cast + transpose + amax pass per gradient (tensorwise: after an amax pass, which the
// model's bias gradient takes where the layer has a bias: fused_grad_output_amax), and one per
// weight and optimizer step. The wgrad's x̂ᵗ is cast again in backward from the forward's
// input, which the models keep in bf16 anyway (their norms and attention need it): FP8 saves no
// activation copy of its own. The GPT's blockwise mlp.c_fc casts mlp.c_proj's x̂ᵗ in its own
// gradient cast, which reads the same input (casts_reader_input_t). Scales and amaxes live on
// the device (LinearScaling), so a step needs no host sync: tensorwise derives each scale from
// the tensor's own amax on the device; delayed reads the scale its history gave and records the
// amax, which the model folds into the history at the end of the step. The backward cast reuses the
// forward's scale, so x̂ᵗ holds the forward's numbers. Ŵᵗ is kept from the weight cast, or
// (WeightTransposes::InBackward) transposed from Ŵ into the shared scratch before each backward:
// the same bytes for one byte per weight less.
//
// MXFP8 (1x32 blocks, E8M0 scales) is emulated: Hopper has no MX GEMM, so each operand is
// quantized as the recipe says, dequantized to bf16 (exact: FP8 values times powers of two) and
// multiplied by a BF16 GEMM with fp32 accumulation. The numbers are MXFP8's; the speed is not.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/device_arena.h"
#include "core/device_buffer.h"
#include "gemm/cublaslt_gemm.h"
#include "numerics/float_bits.h"
#include "numerics/quantize_cuda.h"
#include "numerics/scaling.h"
#include "ops/cuda/ops_cuda.h"
#include "ops/fp8_linear_layout.h"

namespace fp8t::ops::cuda {

// The scaling floats' layout (ops/fp8_linear_layout.h).
using ops::kAmaxSlot;
using ops::kLinearScalingFloats;
using ops::kScaleInvSlot;
using ops::kScaleSlot;
using ops::kScalingFloatsPerRole;

// Quantized operands that live only during one call, shared by the FP8 linears of a model
// (they run one at a time on one stream); take_fp8_scratch sizes them.
class CudaLinear;
// The rows of x̂ᵗ the input_t scratch holds, and whose they are.
struct InputTHolder {
  const CudaLinear* layer = nullptr;
  int64_t first_row = 0;
  int64_t rows = 0;
  // A joint weight gradient (LinearSetup::wgrad_group) under way: the group's rows whose dŷᵗ is
  // in the scratch, and the group's gradient.
  int64_t wgrad_rows_cast = 0;
  float* wgrad_output = nullptr;
  // A relu² reader (CudaLinear::backward_leaving_wgrad) whose weight gradient waits, its dŷᵗ in
  // the input scratch, over `waiting_rows` rows.
  const CudaLinear* waiting_wgrad = nullptr;
  int64_t waiting_rows = 0;
};
struct Fp8Scratch {
  uint8_t* input = nullptr;    // >= max_tokens * the largest in_features
  int64_t input_elements = 0;  // input's size
  // The backward's operands, backward_elements each: a layer whose tokens times its widest
  // side exceed that runs its backward in chunks of rows (the GPT's lm_head, Flux's linear1).
  int64_t backward_elements = 0;
  uint8_t* input_t = nullptr;        // x̂ᵗ, cast in backward for the wgrad
  uint8_t* grad_output = nullptr;    // dŷ
  uint8_t* grad_output_t = nullptr;  // dŷᵗ
  // Whose x̂ᵗ input_t holds: the layers sharing an input read it right after their owner.
  std::shared_ptr<InputTHolder> input_t_holder;
  // Blockwise and MXFP8 only: the operands' scales in the GEMMs' layouts.
  float* input_scales = nullptr;
  float* input_t_scales = nullptr;
  float* grad_output_scales = nullptr;
  float* grad_output_t_scales = nullptr;
  int64_t scale_floats = 0;  // of each of the four above
  // MXFP8 only: the two operands of an emulated GEMM, dequantized to bf16; lhs >= max_tokens *
  // the largest feature count, rhs >= max_tokens * the largest in_features. The scale buffers
  // above hold E8M0 bytes.
  bf16* dequantized_lhs = nullptr;
  bf16* dequantized_rhs = nullptr;
  // WeightTransposes::InBackward only: Ŵᵗ of the layer whose backward runs, and for blockwise
  // its padded 128x128 scales, in the room weight_t_room says.
  uint8_t* weight_t = nullptr;
  float* weight_t_scales = nullptr;
  WeightTScratch weight_t_room;
};

// Takes from `arena` (a planning arena only counts) the scratch of a model's FP8 linears under
// `recipe`, for at most max_tokens rows and the largest in_features and out_features among them,
// with backward operands of max_tokens * backward_width elements (at most the widest layer's,
// at least 128 rows of it): layers wider than backward_width run their backward in chunks. With
// WeightTransposes::InBackward also weight_t, the room its largest Ŵᵗ needs.
Fp8Scratch take_fp8_scratch(DeviceArena& arena, ScalingRecipe recipe, int64_t max_tokens,
                            int64_t max_in, int64_t max_out, int64_t backward_width,
                            const WeightTScratch& weight_t = {});

// Whether `scratch` holds a joint weight gradient (LinearSetup::wgrad_group) of `rows` rows over
// max_tokens tokens, for layers of in_features inputs: their x̂ᵗ and every row's dŷᵗ and scales.
bool holds_wgrad_group(const Fp8Scratch& scratch, int64_t max_tokens, int64_t in_features,
                       int64_t rows);

struct LinearSetup {
  int64_t in_features = 0;
  int64_t out_features = 0;
  int64_t max_tokens = 0;
  // FP8 (per-tensor recipes) or, when false, BF16.
  bool fp8 = false;
  Fp8Config fp8_config;
  Fp8Family family = Fp8Family::Ocp;  // cuBLASLt runs OCP formats only
  bool fp8_wgrad = true;
  // FP8: Ŵᵗ kept from the weight cast, or transposed from Ŵ into the scratch in backward (not
  // with MXFP8).
  WeightTransposes weight_transposes = WeightTransposes::Kept;
  // y = x·Wᵀ + b: the bias (fp32 master, cast to bf16 with the weight) is added by the GEMM's
  // epilogue; its gradient, a column sum of dy, is the caller's (ops/cuda/flux_ops.h).
  bool bias = false;
  // FP8: kLinearScalingFloats device floats, 16-byte aligned, owned by the caller.
  float* scaling = nullptr;
  // FP8: 3 device counters (by TensorRole), owned by the caller, that the casts add their
  // saturated and underflowed values to while set_record_health(true).
  CastHealth* health = nullptr;
  // FP8: a layer that quantizes the same input just before this one (q, k and v read the same
  // normed activations): its x̂, x̂ᵗ and input scale serve this layer too, instead of a second
  // cast. The same numbers as casting again: the input and its amax are the same, so
  // per-tensor scales are too. Its backward must run just before this one's.
  const CudaLinear* input_from = nullptr;
  // FP8 with a per-tensor or blockwise recipe and fp8_wgrad: the layer's input is relu(x)² of
  // the x it is given, cast straight from x (the GPT's mlp.c_proj), so the activation is never
  // stored.
  bool input_relu2 = false;
  // FP8 with a per-tensor or blockwise recipe and fp8_wgrad: the layer's output y feeds relu² (the
  // GPT's mlp.c_fc), and backward() takes the gradient of relu(y)² with y, casting dy = 2·relu(y)·
  // d(relu(y)²) straight from the two, so dy is never stored.
  bool output_relu2 = false;
  // Blockwise, FP8 weight gradient: the layers sharing an input (input_from) whose weight
  // gradients lie back to back in memory, each [out, in], compute them as one GEMM of all their
  // rows: the GPT's c_q, c_k and c_v make one of 3·1536 rows, which fills the GPU where a GEMM of
  // 1536 x 1536 output tiles leaves it half idle in its last wave. The same numbers: 1x128 blocks
  // along the tokens never mix the layers' rows. This layer's rows begin at first_row of the
  // group's `rows` (0: no group); the owner of the input comes first, and the layer that
  // completes the group runs the GEMM. Needs the backward scratch to hold every row of the group.
  struct WgradGroup {
    int64_t first_row = 0;
    int64_t rows = 0;
  };
  WgradGroup wgrad_group;
  // Tensor parallelism, tensorwise: the roles (by TensorRole) whose tensor is this rank's share
  // of one split over the group. Their scale comes from the group's largest amax, which
  // group_max reduces in place on the device (queued on the stream), so that every rank casts
  // with the same scale. Delayed scaling reduces the recorded amaxes at the step's end instead
  // (the model's), and block scales are the blocks' own.
  std::array<bool, 3> split_roles{};
  std::function<void(float* amax, cudaStream_t stream)> group_max;
};

// The layer reading relu² of an output_relu2 layer's output (an input_relu2 layer: the GPT's
// mlp.c_proj reading relu²(mlp.c_fc)) whose weight gradient waits for that layer's gradient
// cast, and the gradient it adds to.
struct Relu2Reader {
  CudaLinear* layer = nullptr;
  float* dweight = nullptr;
};

class CudaLinear {
 public:
  // Allocates the weight copy (bf16, or FP8 Ŵ and, when kept, Ŵᵗ, and for MXFP8 their bf16
  // dequantizations). Throws for shapes cuBLASLt's FP8 GEMMs cannot take (features and tokens
  // must be multiples of 16; 32 for MXFP8's features) and for the fnuz family.
  CudaLinear(const LinearSetup& setup, gemm::CublasLtGemm& gemm, const Fp8Scratch& scratch);

  // Once per optimizer step, before the first forward: the weight [out, in] fp32 cast to the
  // operand(s) the GEMMs use, and the bias [out] (given exactly when setup.bias) to bf16.
  // Delayed: records the weight's amax when record_amax. amax_measured: weight_amax_slot()
  // holds this weight's amax already (the optimizer's step took it), so the cast reads it.
  void prepare_weight(const float* weight, bool record_amax, cudaStream_t stream,
                      const float* bias = nullptr, bool amax_measured = false);

  // prepare_weight(weight, true, stream, bias, amax_measured) for each of a model's layers. The
  // blockwise layers' weight casts, each too small to fill the GPU, go in as few launches as
  // their block scalings allow (fp8t::cuda::quantize_tiles_grouped): the same bytes.
  struct WeightToPrepare {
    CudaLinear* layer = nullptr;
    const float* weight = nullptr;
    const float* bias = nullptr;
    bool amax_measured = false;
  };
  static void prepare_weights(const std::vector<WeightToPrepare>& weights, cudaStream_t stream);

  // Where the weight's per-tensor amax goes before its cast, for the optimizer step that writes
  // the weight to take in the same pass (optim::CudaAdamW::measure_amaxes). Null (nothing to
  // take) unless the layer is FP8 under tensorwise.
  float* weight_amax_slot() const;

  // The cast the kernel producing this layer's next input can do for it, in the same pass:
  // delayed, the whole cast (x̂ and the amax); tensorwise, the amax, the scale depending on it;
  // blockwise, x̂ and its 1x128 block scales. The next forward() does the rest. Empty (no fused
  // work) for layers that cast their input themselves: BF16, MXFP8, blockwise layers whose
  // in_features are no multiple of 128, shared or relu² inputs.
  FusedCast fused_input_cast(bool record_amax, cudaStream_t stream);

  // The per-tensor amax of the next forward's input, for a kernel that writes that input as it is
  // (the Flux's GELU, a copy) to take in the same pass: a zeroed slot, which the next forward()
  // then reads instead of measuring x itself. Null (nothing to take) unless the layer is FP8
  // under tensorwise and casts its input itself (not another layer's, not through relu²).
  float* fused_input_amax(cudaStream_t stream);

  // The per-tensor amax of the next backward's dy, for a kernel that reads dy before it (the
  // bias gradient) to take in the same pass: a zeroed slot, which the next backward() then reads
  // instead of measuring dy itself. Null (nothing to take) unless the layer is FP8 under
  // tensorwise and casts dy as it is (not through relu²).
  float* fused_grad_output_amax(cudaStream_t stream);

  // Blockwise with an FP8 weight gradient: where the kernel producing the next backward's dy
  // (tokens rows) can put its 1x128 cast in the same pass, dŷ and dŷᵗ with their block-major
  // scales, the bytes of the backward's own cast; that backward() then takes a null dy. Nothing
  // for layers that cast dy themselves: other recipes, output_relu2 layers, backwards in chunks,
  // and while FP8 health is recorded.
  std::optional<fp8t::cuda::BlockCastOutput> fused_grad_output_cast(int64_t tokens);

  // y [tokens, out] = x [tokens, in]·Wᵀ (+ b), bf16, written. FP8 layers take multiples of 16
  // tokens; BF16 ones any count (the modulation linears of the Flux read one row per sample).
  // With `residual` ([tokens, out], not overlapping y, no bias): y = x·Wᵀ + residual, the sum
  // taken in the GEMM's epilogue from its fp32 result and rounded once.
  void forward(const bf16* x, int64_t tokens, bf16* y, bool record_amax, cudaStream_t stream,
               const bf16* residual = nullptr);

  // dx [tokens, in] (bf16; written, or added to when accumulate_dx; null: not needed) and
  // dweight [out, in] (fp32, added to). x is the forward's input (as it was then), which the
  // weight gradient reads: in bf16, or cast again to x̂ᵗ (except for layers that share it).
  // FP8 layers wider than the scratch take the tokens in chunks of rows: the same numbers (the
  // per-tensor scale is the whole dy's), the weight gradient summed chunk by chunk.
  // output_relu2 layers: dy is the gradient of relu(y)², y [tokens, out] the forward's output.
  // With a `reader` (output_relu2 layers for which casts_reader_input_t(reader, tokens) holds,
  // right after the reader's backward_leaving_wgrad()): the gradient cast, which reads y anyway,
  // also casts the reader's x̂ᵗ, and the reader's weight gradient runs before this layer's x̂ᵗ
  // and GEMMs. dy is null when fused_grad_output_cast() gave the kernel that made it its cast.
  void backward(const bf16* dy, const bf16* x, int64_t tokens, bf16* dx, bool accumulate_dx,
                float* dweight, bool record_amax, cudaStream_t stream, const bf16* y = nullptr,
                Relu2Reader reader = {});

  // Blockwise, FP8 weight gradients: whether this output_relu2 layer's backward over `tokens`
  // rows can cast the x̂ᵗ of `reader` (the input_relu2 layer reading relu² of its output), both
  // layers' operands held whole in the scratch. The pair's backward is then
  // reader.backward_leaving_wgrad(), then backward(…, reader): the numbers of reader.backward()
  // then backward(), without the reader's cast of x̂ᵗ, which would read y once more.
  bool casts_reader_input_t(const CudaLinear& reader, int64_t tokens) const;

  // The backward of such a reader before that of the layer feeding it: dŷ, dŷᵗ (kept in the
  // input scratch, free in backward) and dx written; the weight gradient waits for backward(…,
  // reader) of the layer feeding it.
  void backward_leaving_wgrad(const bf16* dy, int64_t tokens, bf16* dx, bool record_amax,
                              cudaStream_t stream);

  // FP8 health (ops/fp8_health.h): while on, the first cast of each tensor (x̂ in forward, Ŵ in
  // prepare_weight, dŷ in backward; not backward's x̂ᵗ, made again from the same values) adds its
  // counts to setup.health and its values to health_elements(); inputs are then cast here, not
  // fused into the norm before (fused_input_cast gives nothing), as those casts do not count.
  void set_record_health(bool record) { record_health_ = record && setup_.fp8; }
  const std::array<uint64_t, 3>& health_elements() const { return health_elements_; }
  void clear_health_elements() { health_elements_ = {}; }

  bool fp8() const { return setup_.fp8; }
  bool input_relu2() const { return setup_.input_relu2; }
  bool output_relu2() const { return setup_.output_relu2; }
  int64_t in_features() const { return setup_.in_features; }
  int64_t out_features() const { return setup_.out_features; }
  // Device memory this layer owns.
  size_t device_bytes() const;

 private:
  float* slot(TensorRole role, int index) const {
    return setup_.scaling + static_cast<int>(role) * kScalingFloatsPerRole + index;
  }
  // Where a per-tensor cast takes its scale from: Measure (tensorwise: the tensor's amax, then
  // its scale; delayed: the history's, recording the amax when asked), Measured (tensorwise:
  // the amax slot already holds the tensor's amax) or Reuse (the role's last scale: a second
  // cast of the same tensor). Block scales always come from the data.
  enum class ScaleSource : uint8_t { Measure, Measured, Reuse };
  // What fused_input_cast() left for the next forward to do.
  enum class InputCast : uint8_t { None, AmaxDone, CastDone };

  // Where the cast of `rows` tokens' dŷ puts dŷᵗ and its scales: this layer's rows of its joint
  // weight gradient's operand, or the scratch's start for a layer outside a group.
  struct TransposedTarget {
    uint8_t* codes = nullptr;
    float* scales = nullptr;
    int64_t scale_lines = 0;  // the lines the scales are strided by; 0: the layer's own rows
  };
  TransposedTarget grad_output_t_target(int64_t rows) const;

  // Quantizes x [rows, cols] for `role` into out (may be null with an out_t) and, when
  // not null, out_t [cols, rows]. Block recipes: their scales land in scales and scales_t, in
  // the GEMMs' layouts (1x128 ones of out_t strided by scale_lines_t lines when not 0). y: the
  // forward's output rows beside x, for output_relu2's GradOutput. `first_cast`: false for a second
  // cast of values already cast (x̂ᵗ in backward), which FP8 health does not count again.
  // activation_t: output_relu2 layers' blockwise GradOutput casts only (quantize_blocks).
  template <typename T>
  void quantize(const T* x, int64_t rows, int64_t cols, TensorRole role, uint8_t* out,
                uint8_t* out_t, ScaleSource source, bool record_amax, cudaStream_t stream,
                float* scales = nullptr, float* scales_t = nullptr, const bf16* y = nullptr,
                bool first_cast = true, int64_t scale_lines_t = 0,
                const fp8t::cuda::ActivationTCast& activation_t = {});
  // Tensorwise: the role's scale from the amax of x [count] (measured here, or already in the
  // slot when amax_measured), on the device.
  template <typename T>
  void tensorwise_scale(const T* x, int64_t count, TensorRole role, bool amax_measured,
                        cudaStream_t stream, const bf16* y = nullptr);
  // What a per-tensor or 1x128 cast of `role` reads: relu² of the given input for input_relu2
  // layers, the gradient through relu² for output_relu2 layers.
  fp8t::cuda::CastInput cast_input(TensorRole role) const {
    if (role == TensorRole::Input && setup_.input_relu2) return fp8t::cuda::CastInput::Relu2;
    if (role == TensorRole::GradOutput && setup_.output_relu2) {
      return fp8t::cuda::CastInput::Relu2Gradient;
    }
    return fp8t::cuda::CastInput::Value;
  }
  // Backward: x̂ᵗ of the forward's input rows [first_row, first_row + rows) (x points at the
  // first) into the scratch, or, for a layer sharing its input, the check that its owner has
  // just put those rows there.
  void cast_input_t(const bf16* x, int64_t first_row, int64_t rows, cudaStream_t stream);
  // Rows per chunk of an FP8 backward over `tokens` rows: all of them, or what the scratch holds.
  int64_t backward_chunk(int64_t tokens) const;
  bool weight_t_kept() const { return setup_.weight_transposes == WeightTransposes::Kept; }
  // Ŵᵗ and its block scales (null for per-tensor recipes): the kept ones, or the scratch's.
  const uint8_t* weight_t() const;
  const float* weight_t_scales() const;
  // WeightTransposes::InBackward: Ŵ transposed into the scratch, with its block scales.
  void transpose_weight(cudaStream_t stream);
  // prepare_weight's bias cast, and its weight cast as one tensor of a grouped cast: blockwise FP8
  // layers not recording FP8 health only (else empty).
  void prepare_bias(const float* bias, cudaStream_t stream);
  std::optional<fp8t::cuda::TileCastJob> weight_cast_job(const float* weight) const;
  // Blockwise: the block scaling of a role's casts, 128x128 tiles for the weight, 1x128 blocks
  // for the others.
  BlockQuantization block_spec(TensorRole role) const;
  // The FP8 backward of rows [first_row, first_row + rows): dy, x, dx and y point at that row.
  // dy_cast: dŷ and dŷᵗ are in the scratch already (fused_grad_output_cast).
  void backward_rows(const bf16* dy, const bf16* x, int64_t first_row, int64_t rows, bf16* dx,
                     bool accumulate_dx, float* dweight, bool record_amax, ScaleSource grad_scale,
                     cudaStream_t stream, const bf16* y, Relu2Reader reader, bool dy_cast);
  // Blockwise with an FP8 weight gradient of its own (no joint one), `tokens` rows in one chunk.
  bool whole_blockwise_backward(int64_t tokens) const;
  // Whether backward_leaving_wgrad() can run over `tokens` rows: an input_relu2 layer with a
  // whole blockwise backward whose dŷᵗ fits the input scratch.
  bool can_leave_wgrad(int64_t tokens) const;
  // dx[rows, in] (+)= dŷ[rows, out] · (Ŵᵗ[in, out])ᵀ, dŷ in the scratch.
  void dgrad_gemm(int64_t rows, bf16* dx, bool accumulate_dx, cudaStream_t stream);
  // dW[wgrad_rows, in] += dŷᵗ[wgrad_rows, rows] · (x̂ᵗ[in, rows])ᵀ, x̂ᵗ in the scratch.
  void wgrad_gemm(int64_t rows, int64_t wgrad_rows, float* dweight, const uint8_t* grad_output_t,
                  const float* grad_output_t_scales, cudaStream_t stream);
  // A wgrad_group layer's part of the joint weight gradient, its dŷᵗ cast: records it, and
  // returns the group's gradient when this layer completes the group (null otherwise).
  float* joint_wgrad(float* dweight);
  // An operand of `role`: per-tensor scales from the role's slot, block scales from `scales`.
  gemm::Fp8Operand operand(const uint8_t* data, int64_t ld, TensorRole role,
                           const float* scales = nullptr) const;
  bool blockwise() const { return setup_.fp8_config.recipe == ScalingRecipe::Blockwise; }
  bool tensorwise() const { return setup_.fp8_config.recipe == ScalingRecipe::Tensorwise; }
  // The role's amax slot, zeroed on the stream: for a kernel before the cast to fold into.
  float* zeroed_amax(TensorRole role, cudaStream_t stream);
  bool mx() const { return setup_.fp8_config.recipe == ScalingRecipe::Mxfp8; }
  // MXFP8's dgrad (grad_input.data null: none) and wgrad (null: none) on the quantized dŷ and
  // dŷᵗ in the scratch, as BF16 GEMMs of the dequantized operands.
  void mx_backward(int64_t tokens, const gemm::GemmOutput& grad_input,
                   const gemm::GemmOutput* grad_weight, cudaStream_t stream);
  // MXFP8: data [rows, cols] with its E8M0 scales dequantized to bf16 into out.
  void dequantize_mx(const uint8_t* data, const float* scales, int64_t rows, int64_t cols,
                     TensorRole role, bf16* out, cudaStream_t stream) const;
  // The layer whose input quantization this one reads: itself, or setup.input_from.
  const CudaLinear& input_owner() const {
    return setup_.input_from != nullptr ? *setup_.input_from : *this;
  }

  LinearSetup setup_;
  gemm::CublasLtGemm& gemm_;
  Fp8Scratch scratch_;
  std::unique_ptr<DeviceBuffer<bf16>> weight_bf16_;      // BF16: [out, in]; MXFP8: Ŵ in bf16
  std::unique_ptr<DeviceBuffer<bf16>> weight_t_bf16_;    // MXFP8: Ŵᵗ [in, out] in bf16
  std::unique_ptr<DeviceBuffer<bf16>> bias_bf16_;        // setup.bias: [out]
  std::unique_ptr<DeviceBuffer<uint8_t>> weight_fp8_;    // FP8: Ŵ [out, in]
  std::unique_ptr<DeviceBuffer<uint8_t>> weight_fp8_t_;  // FP8: Ŵᵗ [in, out]
  // Blockwise: the scales of Ŵ and Ŵᵗ, in the GEMMs' layouts (MXFP8: E8M0 bytes, row-major over
  // the blocks).
  std::unique_ptr<DeviceBuffer<float>> weight_scales_, weight_t_scales_;
  InputCast input_cast_ = InputCast::None;
  bool grad_output_amax_done_ = false;  // fused_grad_output_amax() for the next backward
  int64_t grad_output_cast_rows_ = 0;   // fused_grad_output_cast()'s rows for the next backward
  bool record_health_ = false;
  std::array<uint64_t, 3> health_elements_{};  // by TensorRole
};

}  // namespace fp8t::ops::cuda
