// The rotary norm's per-element math (a per-head RMSNorm after the rotary embedding), shared by
// the rotary kernels of ops/cuda/norm_rotary.cu and the block cast of quantize_cuda.cu that
// stages their backward's gradient: both round the same operations in the same order, so the
// cast's codes are those of casting the rotary kernel's output. nvcc only.
#pragma once

namespace fp8t::cuda::rotary {

// The rotation of a pair (a, b) by the table angle (c, s): forward a c + b s, -a s + b c;
// backward (the transposed rotation) a c - b s, a s + b c.
template <bool kBackward>
__device__ inline float rotated_first(float a, float b, float c, float s) {
  return kBackward ? fmaf(a, c, -b * s) : fmaf(a, c, b * s);
}
template <bool kBackward>
__device__ inline float rotated_second(float a, float b, float c, float s) {
  return kBackward ? fmaf(a, s, b * c) : fmaf(-a, s, b * c);
}
template <bool kBackward>
__device__ inline void rotate_pair(float a, float b, float c, float s, float& first,
                                   float& second) {
  first = rotated_first<kBackward>(a, b, c, s);
  second = rotated_second<kBackward>(a, b, c, s);
}

// One pair's term of the dot product dy·y, folded into `sum`.
__device__ inline float add_pair_dot(float dy1, float y1, float dy2, float y2, float sum) {
  return fmaf(dy1, y1, fmaf(dy2, y2, sum));
}

// The gradient before the norm y = x rstd: rstd (dy - y mean(dy y)).
__device__ inline float norm_input_gradient(float dy, float y, float mean_dy_y, float rstd) {
  return rstd * fmaf(-y, mean_dy_y, dy);
}

}  // namespace fp8t::cuda::rotary
