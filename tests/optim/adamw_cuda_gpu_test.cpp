// CudaAdamW against the CPU's AdamWOptimizer, step for step: tensors of several chunks, a
// matrix that fits one, and a 1-D tensor (no weight decay), at their places in a device
// parameter layout whose gaps must keep their poison; and the amaxes a step takes of its new
// values. Fresh random draws each run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

// Each tensor's values to its place in the layout on the device.
void upload_tensors(const DeviceParameterLayout& layout,
                    const std::vector<std::vector<float>>& values, float* device) {
  for (size_t i = 0; i < values.size(); ++i) {
    FP8T_CUDA_CHECK(cudaMemcpy(device + layout.parameters[i].offset, values[i].data(),
                               values[i].size() * sizeof(float), cudaMemcpyHostToDevice));
  }
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
  upload_tensors(layout, params, device_params.get());
  const std::vector<float> poison = device_params.download();

  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreate(&stream));
  for (int step = 0; step < 3; ++step) {
    grads = normal_tensors(specs, rng);
    upload_tensors(layout, grads, device_grads.get());
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

// Amaxes taken by the step: each slot holds the largest |value| of its tensor's new values, bit
// for bit, whether that lies in a late chunk of a long tensor, a part vector or a tensor whose
// count takes no vectors; a NaN among the new values gives NaN. Tensors the layout lacks or another
// rank updates are refused by name; with no slots a step leaves the old ones alone.
TEST(CudaAdamW, MeasuredAmaxesAreTheLargestNewMagnitudes) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<Spec> specs = {
      {"w1", {3, cuda::kAdamWChunkElements + 100}}, {"w2", {64, 96}}, {"b", {17}}, {"w3", {5, 7}}};
  const DeviceParameterLayout layout = device_parameter_layout(specs);
  std::vector<std::vector<float>> params = normal_tensors(specs, rng);
  params[0].back() = 50.0f;  // in w1's last chunk
  DeviceBuffer<float> device_params(static_cast<size_t>(layout.total_elements));
  DeviceBuffer<float> device_grads(static_cast<size_t>(layout.total_elements));
  upload_tensors(layout, params, device_params.get());
  DeviceBuffer<float> slots(3);
  const std::vector<size_t> measured = {0, 2, 3};  // w1, b, w3
  CudaAdamW gpu(layout, kHyper);
  gpu.measure_amaxes({{"w1", slots.get()}, {"b", slots.get() + 1}, {"w3", slots.get() + 2}});
  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreate(&stream));
  for (int step = 0; step < 2; ++step) {
    std::vector<std::vector<float>> grads = normal_tensors(specs, rng);
    if (step == 1) grads[2][5] = std::numeric_limits<float>::quiet_NaN();  // b's
    upload_tensors(layout, grads, device_grads.get());
    slots.poison();
    gpu.step(device_params.get(), device_grads.get(), 1.0, stream);
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> result = device_params.download();
    const std::vector<float> amaxes = slots.download();
    for (size_t k = 0; k < measured.size(); ++k) {
      const DeviceParameter& tensor = layout.parameters[measured[k]];
      const std::string where = "step " + std::to_string(step + 1) + ", " + tensor.name;
      float expected = 0.0f;
      bool nan = false;
      for (int64_t j = 0; j < tensor.numel; ++j) {
        const float value = result[size_t(tensor.offset + j)];
        nan = nan || std::isnan(value);
        expected = std::max(expected, std::fabs(value));
      }
      if (nan) {
        EXPECT_TRUE(std::isnan(amaxes[k])) << where;
      } else {
        EXPECT_EQ(amaxes[k], expected) << where;
      }
    }
  }
  EXPECT_GE(slots.download()[0], 49.0f) << "w1's largest value lies in its last chunk";

  gpu.measure_amaxes({});
  const std::vector<float> before = {1.0f, 2.0f, 3.0f};
  slots.upload(before.data());
  gpu.step(device_params.get(), device_grads.get(), 1.0, stream);
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(slots.download(), before) << "a step without slots writes none";
  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));

  EXPECT_THROW(gpu.measure_amaxes({{"w9", slots.get()}}), Error);
  AdamWOptimizer host(parameters_of(specs), kHyper, 1, 2);
  CudaAdamW sharded(layout, kHyper, &host.shard());
  for (const Spec& spec : specs) {
    if (host.shard().owns(spec.name)) {
      EXPECT_NO_THROW(sharded.measure_amaxes({{spec.name, slots.get()}})) << spec.name;
      continue;
    }
    try {
      sharded.measure_amaxes({{spec.name, slots.get()}});
      ADD_FAILURE() << spec.name << ": another rank's tensor was accepted";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("'" + spec.name + "'"), std::string::npos)
          << error.what();
    }
  }
}

}  // namespace
}  // namespace fp8t::optim
