// CudaAdamW against the CPU's AdamWOptimizer, step for step: tensors of several chunks, a
// matrix that fits one, and a 1-D tensor (no weight decay), at their places in a device
// parameter layout whose gaps must keep their poison. Fresh random draws each run.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "numerics/test_util.h"
#include "ops/gpu_compare.h"
#include "optim/adamw.h"
#include "optim/cuda/adamw_cuda.h"
#include "optim/cuda/device_parameters.h"
#include "optim/cuda/gpu_optimizer.h"

namespace fp8t::optim {
namespace {

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel() const {
    int64_t count = 1;
    for (const int64_t extent : shape)
      count *= extent;
    return count;
  }
};

// The CPU's fp32 operations in the CPU's order: any bound above fp32 rounding catches a wrong
// formula, a wrong gradient or a decay where there is none.
constexpr test::Tolerance kExact{1e-6, 1e-6, 0.0};

constexpr AdamWHyperparameters kHyper{
    .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};

// One tensor of normal draws per spec.
std::vector<std::vector<float>> normal_tensors(const std::vector<Spec>& specs, test::TestRng& rng) {
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> tensors;
  for (const Spec& spec : specs) {
    tensors.emplace_back(static_cast<size_t>(spec.numel()));
    for (float& value : tensors.back())
      value = normal(rng.engine());
  }
  return tensors;
}

std::vector<AdamWOptimizer::Parameter> parameters_of(const std::vector<Spec>& specs) {
  std::vector<AdamWOptimizer::Parameter> parameters;
  for (const Spec& spec : specs)
    parameters.push_back({spec.name, spec.shape});
  return parameters;
}

TEST(CudaAdamW, StepsMatchTheCpuOptimizer) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  // 3 chunks and a part, one chunk, and a bias.
  const std::vector<Spec> specs = {
      {"w1", {3, cuda::kAdamWChunkElements + 100}}, {"w2", {64, 96}}, {"b", {17}}};
  const DeviceParameterLayout layout = device_parameter_layout(specs);
  const std::vector<AdamWOptimizer::Parameter> parameters = parameters_of(specs);
  AdamWOptimizer cpu(parameters, kHyper);
  CudaAdamW gpu(layout, kHyper);

  std::vector<std::vector<float>> params = normal_tensors(specs, rng);
  std::vector<std::vector<float>> grads;
  DeviceBuffer<float> device_params(static_cast<size_t>(layout.total_elements));  // poisoned
  DeviceBuffer<float> device_grads(static_cast<size_t>(layout.total_elements));
  const auto upload = [&](const std::vector<std::vector<float>>& values, float* device) {
    for (size_t i = 0; i < specs.size(); ++i) {
      FP8T_CUDA_CHECK(cudaMemcpy(device + layout.parameters[i].offset, values[i].data(),
                                 values[i].size() * sizeof(float), cudaMemcpyHostToDevice));
    }
  };
  upload(params, device_params.get());
  const std::vector<float> poison = device_params.download();

  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreate(&stream));
  for (int step = 0; step < 3; ++step) {
    grads = normal_tensors(specs, rng);
    upload(grads, device_grads.get());
    const double lr_multiplier = 1.0 - 0.2 * step;
    std::vector<float*> param_data;
    std::vector<const float*> grad_data;
    for (size_t i = 0; i < specs.size(); ++i) {
      param_data.push_back(params[i].data());
      grad_data.push_back(grads[i].data());
    }
    cpu.step(param_data, grad_data, lr_multiplier);
    gpu.step(device_params.get(), device_grads.get(), lr_multiplier, stream);
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> result = device_params.download();
    for (size_t i = 0; i < specs.size(); ++i) {
      const float* actual = result.data() + layout.parameters[i].offset;
      test::expect_close(std::vector<double>(actual, actual + params[i].size()),
                         std::vector<double>(params[i].begin(), params[i].end()), kExact,
                         "step " + std::to_string(step + 1) + ", " + specs[i].name);
    }
    int64_t end = 0, overwritten = 0;
    for (const DeviceParameter& tensor : layout.parameters) {
      for (int64_t j = end; j < tensor.offset; ++j)
        overwritten += std::memcmp(&result[size_t(j)], &poison[size_t(j)], sizeof(float)) != 0;
      end = tensor.offset + tensor.numel;
    }
    EXPECT_EQ(overwritten, 0) << "step " << step + 1 << ": the step wrote between tensors";
  }
  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
}

// ZeRO-1 on 2 ranks, one GPU: each rank's CudaAdamW holds the moments of its own tensors only
// and updates only them, as the CPU's unsharded optimizer does; the other tensors stay as they
// were; the downloaded moments of its tensors are the CPU's.
TEST(CudaAdamW, ShardedStepsUpdateOnlyTheOwnedTensors) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<Spec> specs = {{"w1", {3, cuda::kAdamWChunkElements + 100}},
                                   {"w2", {64, 96}},
                                   {"b", {17}},
                                   {"w3", {32, 48}}};
  const DeviceParameterLayout layout = device_parameter_layout(specs);
  const std::vector<AdamWOptimizer::Parameter> parameters = parameters_of(specs);
  const std::vector<std::vector<float>> start = normal_tensors(specs, rng);
  const std::vector<std::vector<float>> grads = normal_tensors(specs, rng);
  AdamWOptimizer cpu(parameters, kHyper);
  std::vector<std::vector<float>> expected = start;
  std::vector<float*> param_data;
  std::vector<const float*> grad_data;
  for (size_t i = 0; i < specs.size(); ++i) {
    param_data.push_back(expected[i].data());
    grad_data.push_back(grads[i].data());
  }
  for (int step = 0; step < 2; ++step)
    cpu.step(param_data, grad_data, 1.0);
  std::map<std::string, std::vector<float>> cpu_moments;
  for (const NamedTensor& buffer : cpu.state()) {
    if (buffer.view.dtype() != DType::F32) continue;
    const float* values = buffer.view.data<float>();
    cpu_moments[buffer.name].assign(values, values + buffer.view.numel());
  }

  const CudaAdamW whole(layout, kHyper);
  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreate(&stream));
  std::vector<int> owners(specs.size(), 0);
  for (int rank = 0; rank < 2; ++rank) {
    AdamWOptimizer host(parameters, kHyper, rank, 2);
    CudaAdamW gpu(layout, kHyper, &host.shard());
    EXPECT_LT(gpu.device_bytes(), whole.device_bytes()) << "rank " << rank;
    DeviceBuffer<float> device_params(static_cast<size_t>(layout.total_elements));
    DeviceBuffer<float> device_grads(static_cast<size_t>(layout.total_elements));
    for (size_t i = 0; i < specs.size(); ++i) {
      const int64_t offset = layout.parameters[i].offset;
      FP8T_CUDA_CHECK(cudaMemcpy(device_params.get() + offset, start[i].data(),
                                 start[i].size() * sizeof(float), cudaMemcpyHostToDevice));
      FP8T_CUDA_CHECK(cudaMemcpy(device_grads.get() + offset, grads[i].data(),
                                 grads[i].size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    for (int step = 0; step < 2; ++step)
      gpu.step(device_params.get(), device_grads.get(), 1.0, stream);
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> result = device_params.download();
    gpu.download_state(&host);
    std::map<std::string, TensorView> moments;
    for (const NamedTensor& buffer : host.state())
      moments.emplace(buffer.name, buffer.view);
    for (size_t i = 0; i < specs.size(); ++i) {
      const std::string where = "rank " + std::to_string(rank) + ", " + specs[i].name;
      const float* actual = result.data() + layout.parameters[i].offset;
      const std::vector<double> got(actual, actual + start[i].size());
      if (!host.shard().owns(specs[i].name)) {
        EXPECT_EQ(got, std::vector<double>(start[i].begin(), start[i].end())) << where;
        continue;
      }
      ++owners[i];
      test::expect_close(got, std::vector<double>(expected[i].begin(), expected[i].end()), kExact,
                         where);
      for (const char* kind : {".exp_avg", ".exp_avg_sq"}) {
        const TensorView& view = moments.at(specs[i].name + kind);
        const float* values = view.data<float>();
        test::expect_close(std::vector<double>(values, values + view.numel()),
                           std::vector<double>(cpu_moments.at(specs[i].name + kind).begin(),
                                               cpu_moments.at(specs[i].name + kind).end()),
                           kExact, where + kind);
      }
    }
  }
  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
  for (size_t i = 0; i < specs.size(); ++i)
    EXPECT_EQ(owners[i], 1) << specs[i].name;
}

}  // namespace
}  // namespace fp8t::optim
