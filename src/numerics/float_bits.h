// Bit-level views of fp32 and a storage type for bf16, shared by host and device code.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/host_device.h"

namespace fp8t {

FP8T_HD inline uint32_t float_to_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

FP8T_HD inline float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

// 2^exponent as an exact fp32, for exponent in [-149, 127] (fp32 subnormals included).
FP8T_HD inline float exact_power_of_two(int exponent) {
  if (exponent >= -126) return bits_to_float(static_cast<uint32_t>(exponent + 127) << 23);
  return bits_to_float(1u << (exponent + 149));
}

// |x| as bits. For non-negative floats the bit patterns order like the values, and every NaN
// sorts above inf, so an unsigned max over these is a NaN-propagating amax (also atomically).
FP8T_HD inline uint32_t abs_bits(float value) {
  return float_to_bits(value) & 0x7FFFFFFFu;
}

#if defined(__CUDACC__)
// The largest of every thread's bits (such as abs_bits) over the block, in thread 0; the other
// threads get an unspecified value. Blocks of whole warps; contains __syncthreads(): call from
// every thread of the block.
__device__ inline uint32_t block_max_bits(uint32_t bits) {
  constexpr unsigned kWarp = 32;
  __shared__ uint32_t warp_max[kWarp];
  bits = __reduce_max_sync(0xFFFFFFFFu, bits);
  const unsigned warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) warp_max[warp] = bits;
  __syncthreads();
  if (warp == 0) {
    bits = lane < blockDim.x / kWarp ? warp_max[lane] : 0u;
    bits = __reduce_max_sync(0xFFFFFFFFu, bits);
  }
  __syncthreads();  // warp_max may be written again by the caller's next call
  return bits;
}
#endif

// bf16 storage: the upper half of an fp32. Layout-compatible with CUDA's __nv_bfloat16.
struct bf16 {
  uint16_t bits;
};

FP8T_HD inline float bf16_to_float(bf16 value) {
  return bits_to_float(static_cast<uint32_t>(value.bits) << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN.
FP8T_HD inline bf16 float_to_bf16(float value) {
  const uint32_t bits = float_to_bits(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return bf16{static_cast<uint16_t>((bits >> 16) | 0x40u)};
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return bf16{static_cast<uint16_t>((bits + rounding) >> 16)};
}

// The value a bf16 tensor would hold.
FP8T_HD inline float round_to_bf16(float value) {
  return bf16_to_float(float_to_bf16(value));
}

FP8T_HD inline float to_float(float value) {
  return value;
}
FP8T_HD inline float to_float(bf16 value) {
  return bf16_to_float(value);
}

}  // namespace fp8t
