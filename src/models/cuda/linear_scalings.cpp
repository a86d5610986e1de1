#if FP8TRAIN_WITH_CUDA

#include "models/cuda/linear_scalings.h"

#include "core/cuda_check.h"
#include "core/error.h"
#include "ops/cuda/linear_cuda.h"

namespace fp8t {

namespace kernels = ops::cuda;

void CudaLinearScalings::take(DeviceArena& arena, int linears) {
  host_.assign(static_cast<size_t>(linears) * kernels::kLinearScalingFloats, 0.0f);
  device_ = linears > 0 ? arena.take<float>(host_.size()) : nullptr;
  health_ =
      linears > 0
          ? arena.take<CastHealth>(static_cast<size_t>(linears) * ops::kHealthCountersPerLinear)
          : nullptr;
}

void CudaLinearScalings::initialize() {
  for (size_t i = 0; i < host_.size(); ++i) {
    const auto slot = static_cast<int>(i % kernels::kScalingFloatsPerRole);
    host_[i] = slot == kernels::kScaleSlot || slot == kernels::kScaleInvSlot ? 1.0f : 0.0f;
  }
  if (host_.empty()) return;
  FP8T_CUDA_CHECK(
      cudaMemcpy(device_, host_.data(), host_.size() * sizeof(float), cudaMemcpyHostToDevice));
}

size_t CudaLinearScalings::linears() const {
  return host_.size() / kernels::kLinearScalingFloats;
}

void CudaLinearScalings::check_index(int index) const {
  FP8T_CHECK(index >= 0 && size_t(index) < linears(),
             "expected an FP8 linear index below {}, found {}", linears(), index);
}

float* CudaLinearScalings::floats(int index) const {
  check_index(index);
  return device_ + index * kernels::kLinearScalingFloats;
}

void CudaLinearScalings::add(const std::string& name, int index, int input_index) {
  added_.push_back({name, index, input_index});
  if (config_.recipe != ScalingRecipe::Delayed) return;
  Linear linear{index, input_index, {}};
  for (TensorRole role : kTensorRoles) {
    linear.roles.emplace_back(config_.amax_history_len, config_.amax_compute_algo, config_.margin,
                              format_max(config_.format_for(role, family_)), role);
  }
  delayed_.emplace(name, std::move(linear));
}

CastHealth* CudaLinearScalings::health(int index) const {
  check_index(index);
  return health_ + ops::kHealthCountersPerLinear * index;
}

void CudaLinearScalings::clear_health(cudaStream_t stream) {
  if (linears() == 0) return;
  FP8T_CUDA_CHECK(cudaMemsetAsync(
      health_, 0, ops::kHealthCountersPerLinear * linears() * sizeof(CastHealth), stream));
}

std::vector<Fp8TensorHealth> CudaLinearScalings::read_health(
    const std::vector<std::array<uint64_t, 3>>& elements, cudaStream_t stream) {
  std::vector<Fp8TensorHealth> records;
  if (linears() == 0) return records;
  FP8T_CHECK(elements.size() == linears(), "expected the values cast by {} FP8 linears, found {}",
             linears(), elements.size());
  std::vector<CastHealth> counts(ops::kHealthCountersPerLinear * linears());
  std::vector<float> floats(host_.size());
  FP8T_CUDA_CHECK(cudaMemcpyAsync(counts.data(), health_, counts.size() * sizeof(CastHealth),
                                  cudaMemcpyDeviceToHost, stream));
  FP8T_CUDA_CHECK(cudaMemcpyAsync(floats.data(), device_, floats.size() * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream));
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
  const bool per_tensor =
      config_.recipe == ScalingRecipe::Delayed || config_.recipe == ScalingRecipe::Tensorwise;
  for (const Added& linear : added_) {
    for (TensorRole role : kTensorRoles) {
      const auto r = static_cast<size_t>(role);
      const auto caster =
          static_cast<size_t>(role == TensorRole::Input ? linear.input_index : linear.index);
      Fp8TensorHealth record;
      record.layer = linear.name;
      record.role = role;
      record.health.elements = elements[caster][r];
      record.health.counts = counts[ops::kHealthCountersPerLinear * caster + r];
      if (per_tensor) {
        const float* slots = floats.data() + caster * kernels::kLinearScalingFloats +
                             r * kernels::kScalingFloatsPerRole;
        record.health.amax = slots[kernels::kAmaxSlot];
        record.health.scale = slots[kernels::kScaleSlot];
      }
      records.push_back(std::move(record));
    }
  }
  return records;
}

void CudaLinearScalings::end_step(cudaStream_t stream, const DeviceTensorParallel& group) {
  if (delayed_.empty()) return;
  if (group.split()) group.max(device_, host_.size(), stream);
  FP8T_CUDA_CHECK(cudaMemcpyAsync(host_.data(), device_, host_.size() * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream));
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (auto& [name, linear] : delayed_) {
    for (size_t role = 0; role < linear.roles.size(); ++role) {
      // A shared input's amax is its owner's: the history stays as the CPU path's would.
      const int source = role == size_t(TensorRole::Input) ? linear.input_index : linear.index;
      const float* slots = host_.data() + source * kernels::kLinearScalingFloats +
                           role * kernels::kScalingFloatsPerRole;
      DelayedScaling& state = linear.roles[role];
      state.record_amax(slots[kernels::kAmaxSlot]);
      state.update();
    }
  }
  scalings_changed(stream);
}

void CudaLinearScalings::scalings_changed(cudaStream_t stream) {
  if (delayed_.empty()) return;
  for (auto& [name, linear] : delayed_) {
    for (size_t role = 0; role < linear.roles.size(); ++role) {
      float* slots = host_.data() + linear.index * kernels::kLinearScalingFloats +
                     role * kernels::kScalingFloatsPerRole;
      slots[kernels::kScaleSlot] = linear.roles[role].scale();
      slots[kernels::kScaleInvSlot] = linear.roles[role].scale_inv();
      slots[kernels::kAmaxSlot] = 0.0f;
    }
  }
  FP8T_CUDA_CHECK(cudaMemcpyAsync(device_, host_.data(), host_.size() * sizeof(float),
                                  cudaMemcpyHostToDevice, stream));
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));  // host_ may change after we return
}

std::vector<std::pair<std::string, DelayedScaling*>> CudaLinearScalings::delayed_scalings() {
  std::vector<std::pair<std::string, DelayedScaling*>> scalings;
  for (auto& [name, linear] : delayed_) {  // std::map: ordered by name, as the CPU's
    for (size_t role = 0; role < linear.roles.size(); ++role)
      scalings.emplace_back(name + "." + tensor_role_name(kTensorRoles[role]), &linear.roles[role]);
  }
  return scalings;
}

}  // namespace fp8t

#endif  // FP8TRAIN_WITH_CUDA
