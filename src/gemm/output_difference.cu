#include "gemm/output_difference.h"

#include <cmath>
#include <limits>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "numerics/float_bits.h"
#include "numerics/formats.h"

namespace fp8t::gemm {
namespace {

__device__ float element(const void* data, GemmType type, int64_t index) {
  switch (type) {
    case GemmType::F32:
      return static_cast<const float*>(data)[index];
    case GemmType::BF16:
      return bf16_to_float(static_cast<const bf16*>(data)[index]);
    case GemmType::E4M3:
      return decode(static_cast<const uint8_t*>(data)[index], Fp8Format::E4M3);
    case GemmType::E5M2:
      return decode(static_cast<const uint8_t*>(data)[index], Fp8Format::E5M2);
  }
  return 0.0f;
}

// sums[0] += Σ (out − ref)², sums[1] += Σ ref²; a non-finite element sets sums[2].
__global__ void difference_sums(OutputView view, const void* out, const void* ref, double* sums) {
  const int64_t count = view.batch * view.cols * view.rows;
  double squared_difference = 0.0, squared_reference = 0.0;
  bool finite = true;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i % view.rows;
    const int64_t col = i / view.rows % view.cols;
    const int64_t matrix = i / (view.rows * view.cols);
    const int64_t index = matrix * view.stride + col * view.ld + row;
    const double a = element(out, view.type, index), b = element(ref, view.type, index);
    finite = finite && isfinite(a) && isfinite(b);
    squared_difference += (a - b) * (a - b);
    squared_reference += b * b;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    squared_difference += __shfl_down_sync(0xFFFFFFFFu, squared_difference, offset);
    squared_reference += __shfl_down_sync(0xFFFFFFFFu, squared_reference, offset);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&sums[0], squared_difference);
    atomicAdd(&sums[1], squared_reference);
  }
  if (!finite) sums[2] = 1.0;
}

}  // namespace

double relative_difference(const OutputView& view, const void* out, const void* ref,
                           cudaStream_t stream) {
  DeviceBuffer<double> sums(3);
  FP8T_CUDA_CHECK(cudaMemsetAsync(sums.get(), 0, sums.bytes(), stream));
  constexpr int kThreads = 256;
  const int64_t count = view.batch * view.cols * view.rows;
  const auto blocks =
      static_cast<unsigned>(std::min<int64_t>(1024, (count + kThreads - 1) / kThreads));
  difference_sums<<<std::max(1u, blocks), kThreads, 0, stream>>>(view, out, ref, sums.get());
  FP8T_CUDA_CHECK(cudaGetLastError());
  double host[3] = {};
  FP8T_CUDA_CHECK(cudaMemcpyAsync(host, sums.get(), sizeof host, cudaMemcpyDeviceToHost, stream));
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (host[2] != 0.0) return std::numeric_limits<double>::quiet_NaN();
  if (host[1] == 0.0) return host[0] == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(host[0] / host[1]);
}

}  // namespace fp8t::gemm
