// The engine's own block-scaled FP8 GEMM for Hopper (sm_90a), the recipe of DeepSeek-V3:
// out[M, N] (+)= a[M, K]·b[N, K]ᵀ with a scaled in 1x128 blocks along K and b in 1x128 blocks
// or 128x128 tiles (the layouts of ScaleMode). Each 128-wide K block's partial sums leave the
// tensor cores after that block and join an fp32 accumulator multiplied by their two scales, so
// no partial sum spans more than 128 products. It is one more candidate that autotuning times
// against cuBLASLt's block-scaled GEMMs (cublaslt_gemm.h).
//
// Tiles of 128x128 outputs, one per thread block (and run of K, where K is split): a producer
// thread loads the operands' 128x128 K blocks by TMA, and their scales, into a ring of
// shared-memory stages; two consumer warpgroups multiply them with wgmma (64 rows each) and
// promote the partial sums (docs/gemm.md).
//
// This header stays within C++17 and without fmt: CUDA tests and benchmarks include it.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "gemm/cublaslt_gemm.h"

namespace fp8t::gemm {

// Whether block_gemm_sm90 serves the problem on the current device: a program built for sm_90a
// running on an sm_90 GPU; a in 1x128 blocks, b in 1x128 blocks or 128x128 tiles; an f32 or
// bf16 output, accumulated or not, without bias, addend, output scale or amax. Otherwise
// returns false and, when `why` is given, says what rules it out.
bool block_gemm_sm90_serves(const Fp8Operand& a, const Fp8Operand& b, const GemmOutput& out,
                            std::string* why = nullptr);

// Runs the GEMM asynchronously on `stream`. The sizes, strides and alignments follow
// CublasLtGemm::fp8_gemm's rules (K a multiple of 16, M and N multiples of 4, 16-byte aligned
// operands, scales and output rows); throws fp8t::Error when the problem is not served.
// An accumulated f32 output may be summed over runs of K in parallel, by atomics whose order
// varies from call to call; `repeatable` rules that out, so every call gives the same bits.
void block_gemm_sm90(int64_t m, int64_t n, int64_t k, const Fp8Operand& a, const Fp8Operand& b,
                     const GemmOutput& out, bool repeatable, cudaStream_t stream);

// How block_gemm_sm90 runs a problem: in how many runs of K, summed by atomics (1: none; more
// only for an accumulated f32 output).
struct BlockGemmPlan {
  int splits = 1;
};

// The plan block_gemm_sm90 chooses for a problem it serves on the current device.
BlockGemmPlan block_gemm_sm90_plan(int64_t m, int64_t n, int64_t k, const GemmOutput& out,
                                   bool repeatable);

// block_gemm_sm90 with a given plan, for tests and benchmarks; throws fp8t::Error for a plan
// the problem cannot take.
void block_gemm_sm90_planned(int64_t m, int64_t n, int64_t k, const Fp8Operand& a,
                             const Fp8Operand& b, const GemmOutput& out, const BlockGemmPlan& plan,
                             cudaStream_t stream);

// A fingerprint of this kernel's source (the start of its SHA-256, taken when the build is
// configured): autotuning's saved choices, timed against another version of it, are not reused.
std::string block_gemm_sm90_fingerprint();

}  // namespace fp8t::gemm
