// CudaGptOptimizer's host side: the plan of its device memory, built once from the host
// optimizer's groups and the parameter layout, and the sequence of launches of a step. CUDA
// builds only: in a CPU-only build this file compiles to nothing.
#if FP8TRAIN_WITH_CUDA

#include "optim/cuda/gpu_optimizer.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "models/cuda/share_transfer.h"
#include "optim/gpt_optimizer.h"
#include "optim/muon.h"

namespace fp8t::optim {

namespace {

// 256 bytes: the alignment of every state buffer, work buffer and stacked matrix.
constexpr int64_t kAlignmentBytes = 256;
constexpr int64_t kFloatAlignment = kAlignmentBytes / int64_t{sizeof(float)};
constexpr int64_t kBf16Alignment = kAlignmentBytes / int64_t{sizeof(bf16)};
// The name GptOptimizer::state() gives its step counter.
const char* const kStepCounterName = "optimizer.step";

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

cuda::AdamWScalars adamw_scalars(const OptimizerGroup& group, int64_t step) {
  return cuda::adamw_step_scalars(group.lr, group.beta1, group.beta2, group.eps, group.weight_decay,
                                  step);
}

// Where a state buffer of GptOptimizer::state() lives: in the fp32 device state, or in the bf16
// one (the moments of bf16 parameters); in elements.
struct StateSlice {
  int64_t offset;
  int64_t count;
  bool bf16 = false;
  // A share's state (the host's is the whole tensor's): the parameter it is the share of.
  const DeviceParameter* share = nullptr;
};

// One Muon group: its matrices stacked in the bf16 work buffers, their Gram matrices, and its
// state and offset table.
struct MuonPlan {
  size_t group;
  cuda::MuonShape stack;  // [count, rows, cols]
  cuda::MuonShape gram;   // [count, side, side], side = min(rows, cols)
  bool tall;              // rows > cols: the Gram matrix is XᵀX, else X·Xᵀ
  int64_t first_offset;   // index of the group's first matrix in the offset table
  int64_t momentum;       // offsets (floats) in the state
  int64_t second_moment;
  // Under tensor parallelism, matrices split over the group: this rank's shares of them
  // stacked (one matrix shape that holds each share's elements), and where their MuonShare
  // entries start in the share table; shares.count 0 for whole matrices.
  cuda::MuonShape shares{};
  int64_t first_share = 0;
  int64_t min_share_cols = 0;
};

// A table on the device; an empty one still gets an element, and no copy.
template <typename T>
std::unique_ptr<DeviceBuffer<T>> upload_table(const std::vector<T>& table) {
  auto buffer = std::make_unique<DeviceBuffer<T>>(std::max<size_t>(1, table.size()));
  if (!table.empty()) buffer->upload(table.data());
  return buffer;
}

}  // namespace

struct CudaGptOptimizer::State {
  gemm::CublasLtGemm* gemm;  // null for a plan only (planned_device_bytes)
  DeviceParameterLayout layout;
  std::vector<OptimizerGroup> groups;
  OptimizerShard shard;         // the parameters this rank updates, and has state for
  std::vector<int> adamw_slot;  // per group: its index in AdamWStep::groups, -1 for Muon groups
  std::vector<MuonPlan> muon;
  std::map<std::string, StateSlice> slices;
  int64_t adamw_floats = 0;  // of exp_avg, and again of exp_avg_sq (fp32 parameters)
  int64_t adamw_bf16 = 0;    // the same for bf16 parameters
  int64_t chunk_count = 0, bf16_chunk_count = 0;
  int64_t state_floats = 0;  // the fp32 state: AdamW's moments, then the Muon groups'
  int64_t steps = 0;

  // State: exp_avg, exp_avg_sq (AdamW tensors, each aligned), then per Muon group its momentum
  // [count, rows·cols] and second moment [count, max(rows, cols)]; the bf16 parameters'
  // exp_avg and exp_avg_sq in bf16_state.
  std::unique_ptr<DeviceBuffer<float>> state;
  std::unique_ptr<DeviceBuffer<bf16>> bf16_state;
  std::unique_ptr<DeviceBuffer<cuda::AdamWChunk>> chunks, bf16_chunks;
  std::unique_ptr<DeviceBuffer<int64_t>> offsets;  // the Muon matrices' offsets in the layout
  std::unique_ptr<DeviceBuffer<cuda::MuonShare>> share_table;  // the split Muon matrices' shares
  ShareCollectives collectives;                                // with a layout of shares
  // The gradient norm's ranges {offset, count} of shares (their squares summed over the group)
  // and of whole tensors, and a float per range for their sums of squares.
  std::vector<std::pair<int64_t, int64_t>> share_ranges, whole_ranges;
  std::unique_ptr<DeviceBuffer<float>> range_squares;
  std::unique_ptr<DeviceBuffer<uint8_t>> workspace;  // null when borrowed
  // Pieces of the workspace, sized for the largest Muon group (groups take turns).
  bf16* update = nullptr;      // the stacked update X
  bf16* own_shares = nullptr;  // this rank's shares of it, and every rank's gathered
  bf16* gathered = nullptr;
  bf16* product = nullptr;     // Polar Express's next X, a·X + B·X (the two take turns)
  bf16* gram = nullptr;        // A
  bf16* combined = nullptr;    // B = b·A + c·A²
  double* lines = nullptr;     // sums of squares per row or column
  float* scalars = nullptr;    // per matrix: MuonEq's target, then Polar Express's divisor
  float* factors = nullptr;    // per matrix: Muon+'s factor
  float* scales = nullptr;     // NorMuon's, per row or column
  double* partials = nullptr;  // the gradient norm's block sums

  State(gemm::CublasLtGemm* gemm_, const DeviceParameterLayout& layout_, const GptOptimizer& host,
        ShareCollectives collectives_ = {})
      : gemm(gemm_),
        layout(layout_),
        groups(host.groups()),
        shard(host.shard()),
        collectives(std::move(collectives_)) {}

  float* exp_avg() const { return state->get(); }
  float* exp_avg_sq() const { return state->get() + adamw_floats; }

  // The AdamW chunks of the fp32 parameters and of the bf16 ones, and the Muon matrices'
  // offsets, for the device.
  struct Tables {
    std::vector<cuda::AdamWChunk> chunks, bf16_chunks;
    std::vector<int64_t> offsets;
    std::vector<cuda::MuonShare> shares;
  };
  // Sets the state's slices and sizes and returns the tables; allocates nothing.
  Tables plan();
  // Elements of the fp32 and of the bf16 state, as allocated.
  size_t state_count() const { return static_cast<size_t>(std::max<int64_t>(1, state_floats)); }
  size_t bf16_state_count() const {
    return static_cast<size_t>(std::max<int64_t>(1, 2 * adamw_bf16));
  }
  // Byte offsets of the workspace's pieces, each aligned, and its size.
  struct WorkspaceLayout {
    int64_t update, own_shares, gathered, product, gram, combined, lines, scales, scalars, factors,
        partials, bytes;
  };
  WorkspaceLayout workspace_layout() const;
  void allocate_workspace(uint8_t* borrowed, size_t borrowed_bytes);
  void muon_step(const MuonPlan& plan, float* params, const float* grads,
                 const StepSchedule& schedule, cudaStream_t stream);
  bf16* polar_express(const MuonPlan& plan, cudaStream_t stream);
  // A slice's values on the device, in the fp32 or the bf16 state.
  template <typename T>
  T* slice_values(const StateSlice& slice) const;
  // A slice's values into host (synchronizes): a share's gathered over the group.
  template <typename T>
  void download_slice(const StateSlice& slice, T* host) const;
  // The host's state buffers, each checked against the device state (name, dtype, size), with
  // the slice it maps to; the step counter maps to none.
  std::vector<std::pair<NamedTensor, const StateSlice*>> match(GptOptimizer& host) const;
};

CudaGptOptimizer::State::Tables CudaGptOptimizer::State::plan() {
  Tables tables;
  std::map<std::string, int> uses;
  for (const OptimizerGroup& group : groups) {
    for (const std::string& name : group.parameters) {
      static_cast<void>(layout[name]);  // throws for a parameter the layout lacks
      ++uses[name];
    }
  }
  for (const DeviceParameter& parameter : layout.parameters) {
    FP8T_CHECK(uses[parameter.name] == 1,
               "expected the parameter '{}' in one optimizer group, found it in {}", parameter.name,
               uses[parameter.name]);
  }

  int adamw_groups = 0;
  for (const OptimizerGroup& group : groups)
    adamw_slot.push_back(group.rule == UpdateRule::AdamW ? adamw_groups++ : -1);
  FP8T_CHECK(adamw_groups <= cuda::kMaxAdamWGroups, "expected at most {} AdamW groups, found {}",
             cuda::kMaxAdamWGroups, adamw_groups);
  std::vector<std::pair<std::string, StateSlice>> adamw_tensors;
  for (size_t index = 0; index < groups.size(); ++index) {
    if (adamw_slot[index] < 0) continue;
    for (const std::string& name : groups[index].parameters) {
      if (!shard.owns(name)) continue;
      const DeviceParameter& parameter = layout[name];
      // bf16 parameters: their values at offset − bf16_offset in the bf16 buffer.
      int64_t& state_end = parameter.bf16 ? adamw_bf16 : adamw_floats;
      const int64_t param =
          parameter.bf16 ? parameter.offset - layout.bf16_offset : parameter.offset;
      adamw_tensors.emplace_back(
          name, StateSlice{state_end, parameter.numel, parameter.bf16,
                           parameter.split != TensorSplit::None ? &parameter : nullptr});
      for (int64_t begin = 0; begin < parameter.numel; begin += cuda::kAdamWChunkElements) {
        (parameter.bf16 ? tables.bf16_chunks : tables.chunks)
            .push_back({.param = param + begin,
                        .grad = parameter.offset + begin,
                        .state = state_end + begin,
                        .count = static_cast<int32_t>(
                            std::min(cuda::kAdamWChunkElements, parameter.numel - begin)),
                        .group = adamw_slot[index]});
      }
      state_end += round_up(parameter.numel, parameter.bf16 ? kBf16Alignment : kFloatAlignment);
    }
  }
  for (const auto& [name, slice] : adamw_tensors) {
    slices[name + ".exp_avg"] = slice;
    slices[name + ".exp_avg_sq"] = {(slice.bf16 ? adamw_bf16 : adamw_floats) + slice.offset,
                                    slice.count, slice.bf16, slice.share};
  }
  chunk_count = std::ssize(tables.chunks);
  bf16_chunk_count = std::ssize(tables.bf16_chunks);

  state_floats = 2 * adamw_floats;
  for (size_t index = 0; index < groups.size(); ++index) {
    if (adamw_slot[index] >= 0) continue;
    const std::vector<std::string>& names = groups[index].parameters;
    const DeviceParameter& front = layout[names.front()];
    const bool split = front.split != TensorSplit::None;
    const std::vector<int64_t>& shape = split ? front.whole_shape : front.shape;
    FP8T_CHECK(shape.size() == 2, "Muon group '{}': expected matrices, found '{}' of rank {}",
               groups[index].name, names.front(), shape.size());
    const int64_t rows = shape[0], cols = shape[1];
    const auto [first, count] = shard.muon_range(index);
    if (count == 0) continue;
    const int64_t side = std::min(rows, cols);
    const int64_t kept = std::max(rows, cols);
    const int64_t held = split ? front.numel : rows * cols;  // of each matrix on this rank
    MuonPlan muon_plan{.group = index,
                       .stack = {count, rows, cols, round_up(rows * cols, kBf16Alignment)},
                       .gram = {count, side, side, round_up(side * side, kBf16Alignment)},
                       .tall = rows > cols,
                       .first_offset = std::ssize(tables.offsets),
                       .momentum = state_floats,
                       .second_moment = state_floats + round_up(count * held, kFloatAlignment)};
    if (split) {
      muon_plan.shares = {count, front.shape[0], front.shape[1], round_up(held, kBf16Alignment)};
      muon_plan.first_share = std::ssize(tables.shares);
      muon_plan.min_share_cols = cols;
    }
    state_floats = muon_plan.second_moment + round_up(count * kept, kFloatAlignment);
    for (int64_t matrix = 0; matrix < count; ++matrix) {
      const std::string& name = names[static_cast<size_t>(first + matrix)];
      const DeviceParameter& parameter = layout[name];
      FP8T_CHECK(!parameter.bf16, "Muon group '{}': expected fp32 matrices, found '{}' in bf16",
                 groups[index].name, name);
      const bool this_split = parameter.split != TensorSplit::None;
      FP8T_CHECK(
          (this_split ? parameter.whole_shape : parameter.shape) == shape && this_split == split,
          "Muon group '{}': expected every matrix [{}, {}]{}, found '{}' [{}]{}",
          groups[index].name, rows, cols, split ? " split over the group" : "", name,
          fmt::join(this_split ? parameter.whole_shape : parameter.shape, ", "),
          this_split ? " split over the group" : "");
      tables.offsets.push_back(parameter.offset);
      if (split) {
        tables.shares.push_back({parameter.shape[0], parameter.shape[1],
                                 parameter.split == TensorSplit::Outputs ? 1 : 0});
        muon_plan.min_share_cols = std::min(muon_plan.min_share_cols, parameter.shape[1]);
      }
      slices[name + ".momentum"] = {muon_plan.momentum + matrix * held, held, false,
                                    split ? &parameter : nullptr};
      slices[name + ".second_moment"] = {muon_plan.second_moment + matrix * kept, kept};
    }
    muon.push_back(muon_plan);
  }

  // The gradient norm's ranges: each tensor with the padding after it, adjacent ones merged.
  for (size_t i = 0; i < layout.parameters.size(); ++i) {
    append_range(layout.parameters[i].split != TensorSplit::None ? share_ranges : whole_ranges,
                 layout.padded_range(i));
  }
  return tables;
}

CudaGptOptimizer::State::WorkspaceLayout CudaGptOptimizer::State::workspace_layout() const {
  int64_t stack = 0, grams = 0, lines_count = 0, matrices = 0, shares = 0;
  for (const MuonPlan& plan : muon) {
    stack = std::max(stack, plan.stack.count * plan.stack.stride);
    shares = std::max(shares, plan.shares.count * plan.shares.stride);
    grams = std::max(grams, plan.gram.count * plan.gram.stride);
    lines_count =
        std::max(lines_count, plan.stack.count * std::max(plan.stack.rows, plan.stack.cols));
    matrices = std::max(matrices, plan.stack.count);
  }
  int64_t bytes = 0;
  const auto take = [&bytes](int64_t size) {
    const int64_t offset = bytes;
    bytes += round_up(size, kAlignmentBytes);
    return offset;
  };
  WorkspaceLayout pieces{};
  pieces.update = take(stack * 2);
  pieces.own_shares = take(shares * 2);
  pieces.gathered = take(shares * layout.tensor_parallel * 2);
  pieces.product = take(stack * 2);
  pieces.gram = take(grams * 2);
  pieces.combined = take(grams * 2);
  pieces.lines = take(lines_count * 8);
  pieces.scales = take(lines_count * 4);
  pieces.scalars = take(matrices * 4);
  pieces.factors = take(matrices * 4);
  pieces.partials = take(int64_t{cuda::kNormPartials} * 8);
  pieces.bytes = bytes;
  return pieces;
}

void CudaGptOptimizer::State::allocate_workspace(uint8_t* borrowed, size_t borrowed_bytes) {
  const WorkspaceLayout pieces = workspace_layout();
  const auto bytes = static_cast<size_t>(pieces.bytes);
  uint8_t* base = borrowed;
  if (borrowed == nullptr || borrowed_bytes < bytes) {
    workspace = std::make_unique<DeviceBuffer<uint8_t>>(bytes);
    base = workspace->get();
  } else {
    FP8T_CHECK(reinterpret_cast<uintptr_t>(base) % kAlignmentBytes == 0,
               "expected the borrowed optimizer workspace {}-byte aligned, found {}",
               kAlignmentBytes, static_cast<const void*>(base));
  }
  update = reinterpret_cast<bf16*>(base + pieces.update);
  own_shares = reinterpret_cast<bf16*>(base + pieces.own_shares);
  gathered = reinterpret_cast<bf16*>(base + pieces.gathered);
  product = reinterpret_cast<bf16*>(base + pieces.product);
  gram = reinterpret_cast<bf16*>(base + pieces.gram);
  combined = reinterpret_cast<bf16*>(base + pieces.combined);
  lines = reinterpret_cast<double*>(base + pieces.lines);
  scales = reinterpret_cast<float*>(base + pieces.scales);
  scalars = reinterpret_cast<float*>(base + pieces.scalars);
  factors = reinterpret_cast<float*>(base + pieces.factors);
  partials = reinterpret_cast<double*>(base + pieces.partials);
}

// muon.h's steps 1 to 6 for every matrix of the group, with its scalars rounded as
// MuonGroup::step rounds them.
void CudaGptOptimizer::State::muon_step(const MuonPlan& plan, float* params, const float* grads,
                                        const StepSchedule& schedule, cudaStream_t stream) {
  const OptimizerGroup& group = groups[plan.group];
  const cuda::MuonShape& x = plan.stack;
  const auto mu = static_cast<float>(schedule.muon_momentum);
  const auto lr = static_cast<float>(group.lr * muon_lr_scale(x.rows, x.cols));
  const float decay =
      lr * static_cast<float>(group.weight_decay * schedule.weight_decay_multiplier);
  const auto beta2 = static_cast<float>(group.beta2);
  float* momentum = state->get() + plan.momentum;
  float* second_moment = state->get() + plan.second_moment;
  const int64_t* matrix_offsets = offsets->get() + plan.first_offset;

  cuda::MuonShares shares;
  if (plan.shares.count == 0) {
    cuda::muon_nesterov(update, lines, momentum, grads, matrix_offsets, x, mu, stream);
  } else {  // this rank's shares, then the whole matrices from every rank's
    shares = {share_table->get() + plan.first_share, layout.tensor_rank,
              plan.shares.rows * plan.shares.cols, plan.min_share_cols};
    cuda::muon_nesterov(own_shares, lines, momentum, grads, matrix_offsets, plan.shares, mu,
                        stream);
    collectives.all_gather_bf16(own_shares, gathered,
                                size_t(plan.shares.count * plan.shares.stride), stream);
    cuda::muon_place_shares(update, gathered, shares, x, plan.shares.stride, layout.tensor_parallel,
                            stream);
    cuda::muon_row_squares(lines, update, nullptr, x, stream);
  }
  cuda::muon_matrix_scalars(scalars, lines, x, cuda::MatrixScalar::MuonEqTarget, stream);
  cuda::muon_equilibrate_rows(update, lines, scalars, x, stream);
  cuda::muon_matrix_scalars(scalars, lines, x, cuda::MatrixScalar::PolarExpressDivisor, stream);
  cuda::muon_divide(update, scalars, x, stream);
  const bf16* orthogonalized = polar_express(plan, stream);
  cuda::muon_row_squares(lines, orthogonalized, nullptr, x, stream);
  cuda::muon_matrix_scalars(factors, lines, x, cuda::MatrixScalar::MuonPlusFactor, stream);
  if (x.rows >= x.cols) {
    cuda::muon_row_squares(lines, orthogonalized, factors, x, stream);
  } else {
    cuda::muon_column_squares(lines, orthogonalized, factors, x, stream);
  }
  cuda::normuon_scales(scales, second_moment, lines, x, beta2, stream);
  cuda::muon_cautious_update(params, matrix_offsets, orthogonalized, factors, scales, x, lr, decay,
                             stream, shares);
}

// The iterations of muon.cpp's polar_express() on the whole stack, three batched GEMMs each
// (fp32 sums): A = X·Xᵀ (bf16), then B = c·A² + b·A and X' = B·X + a·X with the sums in the
// GEMMs' epilogues, each rounded to bf16 once. X' goes to the other stack buffer; returns the
// one that holds the result after all five steps, as GptOptimizer runs.
bf16* CudaGptOptimizer::State::polar_express(const MuonPlan& plan, cudaStream_t stream) {
  using gemm::Bf16Form;
  const int64_t rows = plan.stack.rows, cols = plan.stack.cols, side = plan.gram.rows;
  const int64_t count = plan.stack.count, xs = plan.stack.stride, gs = plan.gram.stride;
  const gemm::GemmBatch grams{.count = count, .stride_a = gs, .stride_b = gs, .stride_out = gs};
  const gemm::GemmBatch of_stack{.count = count, .stride_a = xs, .stride_b = xs, .stride_out = gs};
  bf16* x = update;
  bf16* next = product;
  for (const auto& coefficients : kPolarExpressCoefficients) {
    const auto a = static_cast<float>(coefficients[0]);
    const auto b = static_cast<float>(coefficients[1]);
    const auto c = static_cast<float>(coefficients[2]);
    const gemm::GemmOutput gram_out{.data = gram, .ld = side, .type = gemm::GemmType::BF16};
    if (plan.tall) {  // A = XᵀX [cols, cols]
      gemm->bf16_gemm(Bf16Form::DytX, rows, cols, cols, x, cols, x, cols, gram_out, of_stack,
                      stream);
    } else {  // A = X·Xᵀ [rows, rows]
      gemm->bf16_gemm(Bf16Form::XWt, rows, rows, cols, x, cols, x, cols, gram_out, of_stack,
                      stream);
    }
    const gemm::GemmOutput combined_out{.data = combined,
                                        .ld = side,
                                        .type = gemm::GemmType::BF16,
                                        .addend = gram,
                                        .result_scale = c,
                                        .addend_scale = b};
    gemm->bf16_gemm(Bf16Form::DyW, side, side, side, gram, side, gram, side, combined_out, grams,
                    stream);
    const gemm::GemmOutput next_out{.data = next,
                                    .ld = cols,
                                    .type = gemm::GemmType::BF16,
                                    .addend = x,
                                    .result_scale = 1.0f,
                                    .addend_scale = a};
    if (plan.tall) {  // X·B
      gemm->bf16_gemm(Bf16Form::DyW, rows, cols, cols, x, cols, combined, cols, next_out,
                      {.count = count, .stride_a = xs, .stride_b = gs, .stride_out = xs}, stream);
    } else {  // B·X
      gemm->bf16_gemm(Bf16Form::DyW, rows, rows, cols, combined, rows, x, cols, next_out,
                      {.count = count, .stride_a = gs, .stride_b = xs, .stride_out = xs}, stream);
    }
    std::swap(x, next);
  }
  return x;
}

std::vector<std::pair<NamedTensor, const StateSlice*>> CudaGptOptimizer::State::match(
    GptOptimizer& host) const {
  std::vector<std::pair<NamedTensor, const StateSlice*>> matched;
  for (NamedTensor& buffer : host.state()) {
    if (buffer.name == kStepCounterName) {
      FP8T_CHECK(buffer.view.dtype() == DType::I64 && buffer.view.numel() == 1,
                 "optimizer state: expected '{}' to be one I64", buffer.name);
      matched.emplace_back(std::move(buffer), nullptr);
      continue;
    }
    const auto found = slices.find(buffer.name);
    if (found == slices.end() && !shard.owns(parameter_of_state(buffer.name))) continue;
    FP8T_CHECK(found != slices.end(),
               "optimizer state: the GPU optimizer has no buffer '{}' (a host optimizer of "
               "another model?)",
               buffer.name);
    const StateSlice& slice = found->second;
    const int64_t count = slice.share != nullptr ? slice.share->whole_numel() : slice.count;
    FP8T_CHECK(buffer.view.dtype() == DType::F32 && buffer.view.numel() == count,
               "optimizer state: expected '{}' to be {} f32 values, found {} of {}", buffer.name,
               count, buffer.view.numel(), dtype_name(buffer.view.dtype()));
    matched.emplace_back(std::move(buffer), &found->second);
  }
  FP8T_CHECK(std::ssize(matched) == std::ssize(slices) + 1,
             "optimizer state: expected {} buffers and the step counter, found {} buffers",
             slices.size(), matched.size());
  return matched;
}

namespace cuda {

AdamWScalars adamw_step_scalars(double lr, double beta1, double beta2, double eps,
                                double weight_decay, int64_t step) {
  return {.decay = static_cast<float>(1.0 - lr * weight_decay),
          .weight1 = static_cast<float>(1.0 - beta1),
          .weight2 = static_cast<float>(1.0 - beta2),
          .inv_bias2 = static_cast<float>(1.0 / (1.0 - std::pow(beta2, double(step)))),
          .step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, double(step)))),
          .eps = static_cast<float>(eps)};
}

}  // namespace cuda

CudaGptOptimizer::CudaGptOptimizer(const GptOptimizer& host, const DeviceParameterLayout& layout,
                                   gemm::CublasLtGemm& gemm, uint8_t* borrowed,
                                   size_t borrowed_bytes, ShareCollectives collectives)
    : state_(std::make_unique<State>(&gemm, layout, host, std::move(collectives))) {
  FP8T_CHECK(layout.element_bytes == sizeof(float),
             "expected a layout of fp32 parameters, found {}-byte elements", layout.element_bytes);
  const State::Tables tables = state_->plan();
  const ShareCollectives& group = state_->collectives;
  FP8T_CHECK(!layout.has_shares() || (group.all_gather_bf16 && group.sum && group.sum_bf16),
             "a layout of tensor-parallel shares needs its group's collectives, found none");
  state_->state = std::make_unique<DeviceBuffer<float>>(state_->state_count());
  state_->state->zero();
  state_->bf16_state = std::make_unique<DeviceBuffer<bf16>>(state_->bf16_state_count());
  state_->bf16_state->zero();
  state_->chunks = upload_table(tables.chunks);
  state_->bf16_chunks = upload_table(tables.bf16_chunks);
  state_->offsets = upload_table(tables.offsets);
  state_->share_table = upload_table(tables.shares);
  state_->range_squares = std::make_unique<DeviceBuffer<float>>(state_->share_ranges.size() +
                                                                state_->whole_ranges.size());
  state_->allocate_workspace(borrowed, borrowed_bytes);
}

CudaGptOptimizer::~CudaGptOptimizer() = default;

size_t CudaGptOptimizer::planned_device_bytes(const GptOptimizer& host,
                                              const DeviceParameterLayout& layout,
                                              size_t borrowed_bytes) {
  State plan(nullptr, layout, host);
  const State::Tables tables = plan.plan();
  const auto table_bytes = [](const auto& table) {
    return std::max<size_t>(1, table.size()) * sizeof(table.front());
  };
  const auto workspace = static_cast<size_t>(plan.workspace_layout().bytes);
  const size_t range_squares =
      std::max<size_t>(1, plan.share_ranges.size() + plan.whole_ranges.size()) * sizeof(float);
  return plan.state_count() * sizeof(float) + plan.bf16_state_count() * sizeof(bf16) +
         table_bytes(tables.chunks) + table_bytes(tables.bf16_chunks) +
         table_bytes(tables.offsets) + table_bytes(tables.shares) + range_squares +
         (borrowed_bytes < workspace ? workspace : 0);
}

size_t CudaGptOptimizer::planned_workspace_bytes(const GptOptimizer& host,
                                                 const DeviceParameterLayout& layout) {
  State plan(nullptr, layout, host);
  plan.plan();
  return static_cast<size_t>(plan.workspace_layout().bytes);
}

void CudaGptOptimizer::step(float* params, bf16* bf16_params, const float* grads,
                            const StepSchedule& schedule, cudaStream_t stream) {
  State& s = *state_;
  FP8T_CHECK(params != nullptr && grads != nullptr,
             "expected device parameters and gradients, found null");
  FP8T_CHECK(bf16_params != nullptr || s.bf16_chunk_count == 0,
             "expected the bf16 parameters of the layout, found null");
  FP8T_CHECK(std::isfinite(schedule.lr_multiplier) && schedule.lr_multiplier >= 0,
             "expected a finite lr multiplier >= 0, found {}", schedule.lr_multiplier);
  FP8T_CHECK(s.muon.empty() || (schedule.muon_momentum >= 0 && schedule.muon_momentum <= 1),
             "expected a Muon momentum in [0, 1], found {}", schedule.muon_momentum);

  ++s.steps;  // as GptOptimizer: the first step's bias correction uses 1
  cuda::AdamWStep adamw{};
  for (size_t index = 0; index < s.groups.size(); ++index) {
    OptimizerGroup& group = s.groups[index];
    group.lr = group.initial_lr * schedule.lr_multiplier;
    if (s.adamw_slot[index] >= 0) {
      adamw.groups[s.adamw_slot[index]] = adamw_scalars(group, s.steps);
    }
  }
  cuda::adamw_multi_tensor(params, grads, s.exp_avg(), s.exp_avg_sq(), s.chunks->get(),
                           s.chunk_count, adamw, stream);
  cuda::adamw_multi_tensor(bf16_params, grads, s.bf16_state->get(),
                           s.bf16_state->get() + s.adamw_bf16, s.bf16_chunks->get(),
                           s.bf16_chunk_count, adamw, stream);
  for (const MuonPlan& plan : s.muon) {
    s.muon_step(plan, params, grads, schedule, stream);
    s.groups[plan.group].lr *= muon_lr_scale(plan.stack.rows, plan.stack.cols);
  }
}

void CudaGptOptimizer::global_norm(const float* grads, int64_t count, float* norm_out,
                                   cudaStream_t stream) {
  const State& s = *state_;
  if (s.share_ranges.empty()) {
    cuda::sum_of_squares_norm(norm_out, grads, count, s.partials, stream);
    return;
  }
  FP8T_CHECK(count == s.layout.total_elements,
             "the gradient norm of a layout of shares takes all of its {} elements, found {}",
             s.layout.total_elements, count);
  float* squares = s.range_squares->get();
  int sums = 0;
  for (const auto& [offset, elements] : s.share_ranges)
    cuda::sum_of_squares(squares + sums++, grads + offset, elements, s.partials, stream);
  s.collectives.sum(squares, s.share_ranges.size(), stream);
  for (const auto& [offset, elements] : s.whole_ranges)
    cuda::sum_of_squares(squares + sums++, grads + offset, elements, s.partials, stream);
  cuda::norm_of_squares(norm_out, squares, sums, stream);
}

void CudaGptOptimizer::clip(float* grads, int64_t count, const float* norm, float max_norm,
                            cudaStream_t stream) {
  cuda::clip_by_norm(grads, count, norm, max_norm, stream);
}

void CudaGptOptimizer::download_state(GptOptimizer& host) const {
  const auto matched = state_->match(host);
  FP8T_CUDA_CHECK(cudaDeviceSynchronize());
  for (const auto& [buffer, slice] : matched) {
    if (slice == nullptr) {
      *buffer.view.data<int64_t>() = state_->steps;
      continue;
    }
    if (slice->bf16) {
      std::vector<bf16> values(static_cast<size_t>(buffer.view.numel()));
      state_->download_slice(*slice, values.data());
      std::ranges::transform(values, buffer.view.data<float>(), bf16_to_float);
    } else {
      state_->download_slice(*slice, buffer.view.data<float>());
    }
  }
}

template <typename T>
void CudaGptOptimizer::State::download_slice(const StateSlice& slice, T* host) const {
  const T* device = slice_values<T>(slice);
  if (slice.share == nullptr) {
    FP8T_CUDA_CHECK(
        cudaMemcpy(host, device, size_t(slice.count) * sizeof(T), cudaMemcpyDeviceToHost));
    return;
  }
  const ShareStaging staging(size_t(slice.share->whole_numel()) * sizeof(T));
  gather_share(share_blocks(layout, *slice.share), device, staging.as<T>(),
               group_sum<T>(collectives), host, nullptr);
}

template <typename T>
T* CudaGptOptimizer::State::slice_values(const StateSlice& slice) const {
  if constexpr (std::is_same_v<T, bf16>) {
    return bf16_state->get() + slice.offset;
  } else {
    return state->get() + slice.offset;
  }
}

void CudaGptOptimizer::upload_state(GptOptimizer& host) {
  const auto matched = state_->match(host);
  int64_t steps = 0;
  for (const auto& [buffer, slice] : matched) {
    if (slice != nullptr) continue;
    steps = *buffer.view.data<int64_t>();
    FP8T_CHECK(steps >= 0, "optimizer state: '{}' must be >= 0, found {}", buffer.name, steps);
  }
  FP8T_CUDA_CHECK(cudaDeviceSynchronize());
  state_->steps = steps;
  for (const auto& [buffer, slice] : matched) {
    if (slice == nullptr) continue;
    std::vector<float> share;
    const float* values = buffer.view.data<float>();
    if (slice->share != nullptr) {
      share = host_share(state_->layout, *slice->share, values);
      values = share.data();
    }
    if (slice->bf16) {  // rounded to the values the bf16 state holds
      std::vector<bf16> rounded(static_cast<size_t>(slice->count));
      std::transform(values, values + slice->count, rounded.begin(), float_to_bf16);
      FP8T_CUDA_CHECK(cudaMemcpy(state_->slice_values<bf16>(*slice), rounded.data(),
                                 rounded.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    } else {
      FP8T_CUDA_CHECK(cudaMemcpy(state_->slice_values<float>(*slice), values,
                                 size_t(slice->count) * sizeof(float), cudaMemcpyHostToDevice));
    }
  }
}

size_t CudaGptOptimizer::device_state_bytes() const {
  return state_->state->bytes() + state_->bf16_state->bytes();
}

size_t CudaGptOptimizer::device_workspace_bytes() const {
  const size_t own = state_->workspace ? state_->workspace->bytes() : 0;
  return own + state_->chunks->bytes() + state_->bf16_chunks->bytes() + state_->offsets->bytes() +
         state_->share_table->bytes() + state_->range_squares->bytes();
}

bool CudaGptOptimizer::workspace_borrowed() const {
  return state_->workspace == nullptr;
}

int64_t CudaGptOptimizer::steps_taken() const {
  return state_->steps;
}

const std::vector<OptimizerGroup>& CudaGptOptimizer::groups() const {
  return state_->groups;
}

}  // namespace fp8t::optim

#endif  // FP8TRAIN_WITH_CUDA
