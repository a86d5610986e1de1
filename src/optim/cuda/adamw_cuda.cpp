#if FP8TRAIN_WITH_CUDA

#include "optim/cuda/adamw_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "optim/cuda/gpu_optimizer.h"

namespace fp8t::optim {

namespace {

// AdamWStep's groups: the matrices decay, 1-D tensors (biases, norm scales) do not.
constexpr int32_t kDecayGroup = 0;
constexpr int32_t kNoDecayGroup = 1;

// The moments of the tensors a rank updates, one after the other, each 256-byte aligned:
// where each tensor's begin, and how many floats they take.
struct MomentLayout {
  std::map<std::string, int64_t> offsets;
  int64_t floats = 0;

  MomentLayout(const DeviceParameterLayout& layout, const OptimizerShard* shard) {
    constexpr auto kGranule =
        static_cast<int64_t>(DeviceParameterLayout::kAlignmentBytes / sizeof(float));
    for (const DeviceParameter& tensor : layout.parameters) {
      if (shard != nullptr && !shard->owns(tensor.name)) continue;
      offsets[tensor.name] = floats;
      floats += (tensor.numel + kGranule - 1) / kGranule * kGranule;
    }
  }
};

}  // namespace

struct CudaAdamW::State {
  DeviceParameterLayout layout;
  AdamWHyperparameters hyperparameters;
  MomentLayout moments;
  GradientShares shares;
  int64_t chunk_count = 0;
  DeviceBuffer<float> exp_avg, exp_avg_sq;  // at moments.offsets
  std::unique_ptr<DeviceBuffer<cuda::AdamWChunk>> chunks;
  DeviceBuffer<double> partials{static_cast<size_t>(cuda::kNormPartials)};
  DeviceBuffer<float> squares;  // with shares: theirs summed over the group, the rest's
  // Per updated tensor, its chunks {first, count} in the chunk table; with measure_amaxes, each
  // chunk's amax bits and the slots' table.
  std::map<std::string, std::pair<int64_t, int64_t>> tensor_chunks;
  std::unique_ptr<DeviceBuffer<uint32_t>> chunk_amax;
  std::unique_ptr<DeviceBuffer<cuda::TensorAmax>> amax_slots;
  int64_t amax_slot_count = 0;

  State(const DeviceParameterLayout& layout_, const AdamWHyperparameters& hyperparameters_,
        const OptimizerShard* shard, GradientShares shares_)
      : layout(layout_),
        hyperparameters(hyperparameters_),
        moments(layout_, shard),
        shares(std::move(shares_)),
        exp_avg(static_cast<size_t>(std::max<int64_t>(1, moments.floats))),
        exp_avg_sq(static_cast<size_t>(std::max<int64_t>(1, moments.floats))),
        squares(shares.elements > 0 ? 2 : 0) {}
};

CudaAdamW::CudaAdamW(const DeviceParameterLayout& layout,
                     const AdamWHyperparameters& hyperparameters, const OptimizerShard* shard,
                     GradientShares shares)
    : state_(std::make_unique<State>(layout, hyperparameters, shard, std::move(shares))) {
  FP8T_CHECK(layout.element_bytes == sizeof(float) && layout.total_elements > 0,
             "expected a layout of fp32 parameters");
  const GradientShares& split = state_->shares;
  FP8T_CHECK(split.elements >= 0 && split.elements <= layout.total_elements &&
                 (split.elements == 0 || split.group_sum),
             "expected the shares' {} elements within the layout's {}, with the group's sum",
             split.elements, layout.total_elements);
  std::vector<cuda::AdamWChunk> chunks;
  for (const DeviceParameter& tensor : layout.parameters) {
    const auto owned = state_->moments.offsets.find(tensor.name);
    if (owned == state_->moments.offsets.end()) continue;
    state_->tensor_chunks[tensor.name] = {
        std::ssize(chunks),
        (tensor.numel + cuda::kAdamWChunkElements - 1) / cuda::kAdamWChunkElements};
    for (int64_t begin = 0; begin < tensor.numel; begin += cuda::kAdamWChunkElements) {
      const auto count =
          static_cast<int32_t>(std::min<int64_t>(cuda::kAdamWChunkElements, tensor.numel - begin));
      chunks.push_back({.param = tensor.offset + begin,
                        .grad = tensor.offset + begin,
                        .state = owned->second + begin,
                        .count = count,
                        .group = tensor.shape.size() < 2 ? kNoDecayGroup : kDecayGroup});
    }
  }
  state_->chunk_count = std::ssize(chunks);
  state_->chunks =
      std::make_unique<DeviceBuffer<cuda::AdamWChunk>>(std::max<size_t>(1, chunks.size()));
  if (!chunks.empty()) state_->chunks->upload(chunks.data());
  state_->exp_avg.zero();
  state_->exp_avg_sq.zero();
}

CudaAdamW::~CudaAdamW() = default;

void CudaAdamW::clip(float* grads, float* norm, float max_norm, cudaStream_t stream) {
  const int64_t count = state_->layout.total_elements;
  const GradientShares& shares = state_->shares;
  if (shares.elements > 0) {
    float* squares = state_->squares.get();
    cuda::sum_of_squares(squares, grads, shares.elements, state_->partials.get(), stream);
    shares.group_sum(squares, 1, stream);
    cuda::sum_of_squares(squares + 1, grads + shares.elements, count - shares.elements,
                         state_->partials.get(), stream);
    cuda::norm_of_squares(norm, squares, 2, stream);
  } else {
    cuda::sum_of_squares_norm(norm, grads, count, state_->partials.get(), stream);
  }
  if (max_norm > 0.0f) cuda::clip_by_norm(grads, count, norm, max_norm, stream);
}

void CudaAdamW::step(float* params, const float* grads, double lr_multiplier, cudaStream_t stream) {
  FP8T_CHECK(std::isfinite(lr_multiplier) && lr_multiplier >= 0,
             "expected a finite lr multiplier >= 0, found {}", lr_multiplier);
  ++steps_;
  const AdamWHyperparameters& h = state_->hyperparameters;
  cuda::AdamWStep adamw{};
  for (const int32_t group : {kDecayGroup, kNoDecayGroup}) {
    adamw.groups[group] =
        cuda::adamw_step_scalars(h.lr * lr_multiplier, h.beta1, h.beta2, h.eps,
                                 group == kDecayGroup ? h.weight_decay : 0.0, steps_);
  }
  uint32_t* chunk_amax = state_->amax_slot_count > 0 ? state_->chunk_amax->get() : nullptr;
  cuda::adamw_multi_tensor(params, grads, state_->exp_avg.get(), state_->exp_avg_sq.get(),
                           state_->chunks->get(), state_->chunk_count, adamw, stream, chunk_amax);
  if (chunk_amax != nullptr)
    cuda::tensor_amaxes(state_->amax_slots->get(), state_->amax_slot_count, chunk_amax, stream);
}

void CudaAdamW::measure_amaxes(const std::vector<TensorAmaxSlot>& slots) {
  std::vector<cuda::TensorAmax> table;
  for (const TensorAmaxSlot& slot : slots) {
    static_cast<void>(state_->layout[slot.parameter]);  // throws for a tensor it lacks
    const auto chunks = state_->tensor_chunks.find(slot.parameter);
    FP8T_CHECK(chunks != state_->tensor_chunks.end(),
               "measure_amaxes: '{}' is another rank's to update, so its amax is not taken here",
               slot.parameter);
    FP8T_CHECK(slot.amax != nullptr, "measure_amaxes: '{}' has no amax slot", slot.parameter);
    table.push_back({slot.amax, chunks->second.first, chunks->second.second});
  }
  state_->amax_slot_count = std::ssize(table);
  if (table.empty()) return;
  if (!state_->chunk_amax) {
    state_->chunk_amax =
        std::make_unique<DeviceBuffer<uint32_t>>(static_cast<size_t>(state_->chunk_count));
  }
  state_->amax_slots = std::make_unique<DeviceBuffer<cuda::TensorAmax>>(table.size());
  state_->amax_slots->upload(table.data());
}

namespace {

// The moments of the tensors this rank updates (those of the others are skipped) in the
// layout's order, the same on every rank of a tensor-parallel group (whose transfers run
// collectives in step): visit(host tensor of that name or null without a host, parameter name,
// offset among the moments, moment). An empty `host` is none: a host state always holds the
// step counter.
template <typename Visit>
void match_moments(std::vector<NamedTensor>& host, const DeviceParameterLayout& layout,
                   const MomentLayout& moments, bool whole, Visit&& visit) {
  const bool has_host = !host.empty();
  std::map<std::string, NamedTensor*, std::less<>> named;
  for (NamedTensor& tensor : host)
    named[tensor.name] = &tensor;
  for (const DeviceParameter& parameter : layout.parameters) {
    const auto owned = moments.offsets.find(parameter.name);
    if (owned == moments.offsets.end()) continue;
    for (const char* moment : {".exp_avg", ".exp_avg_sq"}) {
      NamedTensor* tensor = nullptr;
      if (has_host) {
        const auto found = named.find(parameter.name + moment);
        FP8T_CHECK(found != named.end(), "optimizer state: no '{}{}' on the host", parameter.name,
                   moment);
        tensor = found->second;
        FP8T_CHECK(!whole || tensor->view.numel() == parameter.numel,
                   "optimizer state: '{}' holds {} values, the parameter {}", tensor->name,
                   tensor->view.numel(), parameter.numel);
      }
      visit(tensor, parameter.name, owned->second, moment);
    }
  }
}

// The host state's step counter, or null.
int64_t* step_counter(std::vector<NamedTensor>& host) {
  for (NamedTensor& tensor : host)
    if (tensor.view.dtype() == DType::I64) return tensor.view.data<int64_t>();
  return nullptr;
}

}  // namespace

void CudaAdamW::download_state(AdamWOptimizer* host, const StateTransfer& transfer) const {
  FP8T_CHECK(host != nullptr || transfer.download,
             "optimizer state: a download without a host needs a transfer through the group");
  FP8T_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<NamedTensor> state = host != nullptr ? host->state() : std::vector<NamedTensor>{};
  match_moments(
      state, state_->layout, state_->moments, !transfer.download,
      [&](NamedTensor* tensor, const std::string& parameter, int64_t offset, const char* moment) {
        const float* source =
            (std::strcmp(moment, ".exp_avg") == 0 ? state_->exp_avg : state_->exp_avg_sq).get() +
            offset;
        float* target = tensor != nullptr ? tensor->view.data<float>() : nullptr;
        if (transfer.download) {
          transfer.download(parameter, source, target);
          return;
        }
        FP8T_CUDA_CHECK(cudaMemcpy(target, source, tensor->view.bytes(), cudaMemcpyDeviceToHost));
      });
  if (int64_t* steps = step_counter(state)) *steps = steps_;
}

void CudaAdamW::upload_state(AdamWOptimizer* host, const StateTransfer& transfer) {
  FP8T_CHECK(host != nullptr || transfer.upload,
             "optimizer state: an upload without a host needs a transfer through the group");
  FP8T_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<NamedTensor> state = host != nullptr ? host->state() : std::vector<NamedTensor>{};
  if (const int64_t* steps = step_counter(state)) {
    FP8T_CHECK(*steps >= 0, "optimizer state: 'optimizer.step' must be >= 0, found {}", *steps);
    steps_ = *steps;
  }
  match_moments(
      state, state_->layout, state_->moments, !transfer.upload,
      [&](NamedTensor* tensor, const std::string& parameter, int64_t offset, const char* moment) {
        float* target =
            (std::strcmp(moment, ".exp_avg") == 0 ? state_->exp_avg : state_->exp_avg_sq).get() +
            offset;
        const float* source = tensor != nullptr ? tensor->view.data<float>() : nullptr;
        if (transfer.upload) {
          transfer.upload(parameter, source, target);
          return;
        }
        FP8T_CUDA_CHECK(cudaMemcpy(target, source, tensor->view.bytes(), cudaMemcpyHostToDevice));
      });
}

size_t CudaAdamW::device_bytes() const {
  return state_->exp_avg.bytes() + state_->exp_avg_sq.bytes() + state_->chunks->bytes() +
         state_->partials.bytes() + state_->squares.bytes() +
         (state_->chunk_amax ? state_->chunk_amax->bytes() : 0) +
         (state_->amax_slots ? state_->amax_slots->bytes() : 0);
}

}  // namespace fp8t::optim

#endif  // FP8TRAIN_WITH_CUDA
