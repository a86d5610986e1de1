// Copies between a model's host parameter set (the GPT's ParameterSet, the Flux's
// FluxParameterSet: f32 tensors by name) and its device buffers laid out by
// optim::DeviceParameterLayout (CUDA builds only). Both synchronize the stream first, so that
// no queued step still reads or writes the buffer.
#pragma once

#include <algorithm>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/tensor.h"
#include "numerics/float_bits.h"
#include "optim/cuda/device_parameters.h"

namespace fp8t {

// base: the fp32 values, at each tensor's offset. bf16_base: the layout's bf16 parameters, at
// offset − bf16_offset (rounded to bf16 on the way up); null for buffers that hold every tensor
// in fp32 (the gradients).
template <typename HostSet>
void upload_parameter_set(const HostSet& host, const optim::DeviceParameterLayout& layout,
                          float* base, cudaStream_t stream, bf16* bf16_base = nullptr) {
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<bf16> staging;
  for (const optim::DeviceParameter& tensor : layout.parameters) {
    const TensorView& view = host[tensor.name];
    FP8T_CHECK(view.dtype() == DType::F32, "expected f32 parameters, '{}' is {}", tensor.name,
               dtype_name(view.dtype()));
    if (bf16_base != nullptr && tensor.bf16) {
      staging.resize(static_cast<size_t>(view.numel()));
      std::transform(view.data<float>(), view.data<float>() + view.numel(), staging.begin(),
                     float_to_bf16);
      FP8T_CUDA_CHECK(cudaMemcpy(bf16_base + (tensor.offset - layout.bf16_offset), staging.data(),
                                 staging.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    } else {
      FP8T_CUDA_CHECK(
          cudaMemcpy(base + tensor.offset, view.raw(), view.bytes(), cudaMemcpyHostToDevice));
    }
  }
}

template <typename HostSet>
void download_parameter_set(const optim::DeviceParameterLayout& layout, const float* base,
                            HostSet& host, cudaStream_t stream, const bf16* bf16_base = nullptr) {
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<bf16> staging;
  for (const optim::DeviceParameter& tensor : layout.parameters) {
    TensorView& view = host[tensor.name];
    if (bf16_base != nullptr && tensor.bf16) {
      staging.resize(static_cast<size_t>(view.numel()));
      FP8T_CUDA_CHECK(cudaMemcpy(staging.data(), bf16_base + (tensor.offset - layout.bf16_offset),
                                 staging.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
      std::ranges::transform(staging, view.data<float>(), bf16_to_float);
    } else {
      FP8T_CUDA_CHECK(
          cudaMemcpy(view.raw(), base + tensor.offset, view.bytes(), cudaMemcpyDeviceToHost));
    }
  }
}

}  // namespace fp8t
