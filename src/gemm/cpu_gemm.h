// The three GEMMs of a linear layer on the CPU, by OpenBLAS. Row-major throughout, with the
// nn.Linear layout: x is [M, K] (M tokens), W is [N, K], y = x·Wᵀ is [M, N]. Leading dimensions
// are row strides in elements (>= the row length), so callers can pass views into wider
// buffers. The double versions exist for reference computations in tests.
#pragma once

#include <cstdint>

namespace fp8t::gemm {

// y[M, N] = x[M, K] · W[N, K]ᵀ, or y += x·Wᵀ when `accumulate`. Without `accumulate` y is only
// written, so it may hold anything (NaN included) on entry.
// Also the form of every FP8 GEMM here: both operands K-major ("TN"), as Hopper requires.
void forward_xwt(int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w,
                 int64_t ldw, float* y, int64_t ldy, bool accumulate);
void forward_xwt(int64_t m, int64_t n, int64_t k, const double* x, int64_t ldx, const double* w,
                 int64_t ldw, double* y, int64_t ldy, bool accumulate);

// dx[M, K] += dy[M, N] · W[N, K]: the input gradient. Always accumulates.
void dgrad_dyw(int64_t m, int64_t n, int64_t k, const float* dy, int64_t lddy, const float* w,
               int64_t ldw, float* dx, int64_t lddx);
void dgrad_dyw(int64_t m, int64_t n, int64_t k, const double* dy, int64_t lddy, const double* w,
               int64_t ldw, double* dx, int64_t lddx);

// dW[N, K] += dy[M, N]ᵀ · x[M, K]: the weight gradient, summed over the M tokens. Always
// accumulates (gradient accumulation over micro-batches).
void wgrad_dytx(int64_t m, int64_t n, int64_t k, const float* dy, int64_t lddy, const float* x,
                int64_t ldx, float* dw, int64_t lddw);
void wgrad_dytx(int64_t m, int64_t n, int64_t k, const double* dy, int64_t lddy, const double* x,
                int64_t ldx, double* dw, int64_t lddw);

}  // namespace fp8t::gemm
