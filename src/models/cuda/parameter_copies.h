// Copies between a model's host parameter set (the GPT's ParameterSet, the Flux's
// FluxParameterSet: f32 tensors by name) and its device buffer laid out by
// optim::DeviceParameterLayout (CUDA builds only). Both synchronize the stream first, so that
// no queued step still reads or writes the buffer.
#pragma once

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/tensor.h"
#include "optim/cuda/device_parameters.h"

namespace fp8t {

template <typename HostSet>
void upload_parameter_set(const HostSet& host, const optim::DeviceParameterLayout& layout,
                          float* base, cudaStream_t stream) {
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (const optim::DeviceParameter& tensor : layout.parameters) {
    const TensorView& view = host[tensor.name];
    FP8T_CHECK(view.dtype() == DType::F32, "expected f32 parameters, '{}' is {}", tensor.name,
               dtype_name(view.dtype()));
    FP8T_CUDA_CHECK(
        cudaMemcpy(base + tensor.offset, view.raw(), view.bytes(), cudaMemcpyHostToDevice));
  }
}

template <typename HostSet>
void download_parameter_set(const optim::DeviceParameterLayout& layout, const float* base,
                            HostSet& host, cudaStream_t stream) {
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (const optim::DeviceParameter& tensor : layout.parameters) {
    TensorView& view = host[tensor.name];
    FP8T_CUDA_CHECK(
        cudaMemcpy(view.raw(), base + tensor.offset, view.bytes(), cudaMemcpyDeviceToHost));
  }
}

}  // namespace fp8t
