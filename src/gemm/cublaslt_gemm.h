// GEMMs on the GPU by cuBLASLt (CUDA builds only): BF16, and FP8 with per-tensor, row-wise or
// block scales. Row-major with the nn.Linear layout of cpu_gemm.h: x is [M, K], W is [N, K],
// y = x·Wᵀ is [M, N]; leading dimensions are row strides in elements. Pointers are device
// pointers; every call is asynchronous on the stream it is given.
//
// A CublasLtGemm owns a cuBLASLt handle, a 32 MiB workspace and a cache of algorithms: the first
// call for a problem (sizes, strides, batch, types, scale modes, accumulate, fast accumulation,
// bias, pointer alignments) asks cuBLASLt's heuristic and keeps its answer, a refusal included;
// later calls reuse it and query nothing. With autotuning on for the problem's precision
// (configure_tuning, gemm_tuning.h) the first call instead asks the heuristic for up to
// kTuneCandidates algorithms, runs each on the call's own operands into scratch outputs,
// rejects those whose result differs from the first candidate's by more than the output type's
// tolerance, times the rest (median of kTuneRuns) and keeps the fastest; with a cache file the
// winner is saved, and a later process takes it from the file without timing. Block-scaled FP8
// problems that the engine's own kernel serves (block_gemm_sm90.h) have it as one more
// candidate, checked and timed like the others; with the fp8 backend pinned to fp8train they
// run on it untimed. The workspace is shared by all calls, so calls on different streams must
// not overlap in time (use one CublasLtGemm per concurrent stream); an instance is not
// thread-safe.
//
// This header stays within C++17 and without fmt: CUDA tests and benchmarks include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "gemm/gemm_tuning.h"
#include "numerics/float_bits.h"
#include "numerics/formats.h"
#include "numerics/scaling.h"

namespace fp8t::gemm {

// Element types of GEMM outputs and bias vectors. FP8 outputs are OCP E4M3 or E5M2.
enum class GemmType : uint8_t { F32, BF16, E4M3, E5M2 };

inline size_t gemm_type_bytes(GemmType type) {
  switch (type) {
    case GemmType::F32:
      return 4;
    case GemmType::BF16:
      return 2;
    case GemmType::E4M3:
    case GemmType::E5M2:
      return 1;
  }
  return 0;
}

// The three GEMMs of a linear layer, with the sizes of cpu_gemm.h (M tokens, N outputs, K inputs):
enum class Bf16Form : uint8_t {
  XWt,   // forward: y[M, N] = x[M, K]·W[N, K]ᵀ   (a = x, b = W)
  DyW,   // dgrad:  dx[M, K] = dy[M, N]·W[N, K]   (a = dy, b = W)
  DytX,  // wgrad:  dW[N, K] = dy[M, N]ᵀ·x[M, K]  (a = dy, b = x)
};

// How an FP8 operand [rows, K] is scaled: `scale_inv` (fp32, device) holds the factors that
// multiply its codes back to values (1 / the quantization scale), laid out as follows.
// The row-wise and block modes are Hopper-only (sm_90).
enum class ScaleMode : uint8_t {
  Tensor,        // one value
  Row,           // one per row: [rows] (cuBLASLt's outer-vector scaling)
  Block1x128,    // one per 1x128 block along K: [ceil(K/128), rows], rows contiguous. This is
                 // the transpose of quantize_blocks()' Rows1x128 grid [rows, ceil(K/128)].
  Block128x128,  // one per 128x128 tile: [ceil(rows/128), L4] with L4 = ceil(K/128) rounded up
                 // to a multiple of 4 (K-blocks contiguous): the Tile128x128 grid of
                 // quantize_blocks() with its rows padded to L4 (write zeros in the pads).
};

// Number of fp32 values a scale_inv buffer holds for an operand [rows, k].
inline int64_t scale_count(ScaleMode mode, int64_t rows, int64_t k) {
  const int64_t k_blocks = (k + 127) / 128;
  switch (mode) {
    case ScaleMode::Tensor:
      return 1;
    case ScaleMode::Row:
      return rows;
    case ScaleMode::Block1x128:
      return k_blocks * rows;
    case ScaleMode::Block128x128:
      return (rows + 127) / 128 * padded_tile_scale_row(k_blocks);
  }
  return 0;
}

// An FP8 operand: row-major [rows, K] with K contiguous ("K-major"), as Hopper's FP8 GEMMs
// require of both operands. A transposed copy (quantize_transpose) provides this layout for
// dgrad and wgrad.
struct Fp8Operand {
  const uint8_t* data = nullptr;       // 16-byte aligned
  int64_t ld = 0;                      // row stride in elements: >= K and a multiple of 16
  Fp8Format format = Fp8Format::E4M3;  // E4M3 or E5M2 (cuBLASLt has no fnuz formats)
  ScaleMode scale_mode = ScaleMode::Tensor;
  const float* scale_inv = nullptr;  // see ScaleMode; 16-byte aligned for the block modes
};

// Where a GEMM writes, row-major [rows, cols] of its form.
struct GemmOutput {
  void* data = nullptr;
  int64_t ld = 0;  // row stride in elements, >= cols
  GemmType type = GemmType::F32;
  // data += result (beta = 1) instead of data = result: F32 or BF16 outputs (gradient
  // accumulation, sums of dgrads). A BF16 output adds the fp32 result to its bf16
  // value and rounds once. Without it the output is only written and may hold anything, NaN
  // included.
  bool accumulate = false;
  // F32 or BF16 outputs: data = result_scale·result + addend_scale·addend, summed in fp32 and
  // rounded once, addend another buffer laid out as the output (its type, ld and batch stride)
  // that does not overlap it (Polar Express's b·A + c·A² and a·X + B·X, a residual added to a
  // projection, in one pass). Not with accumulate or a bias.
  const void* addend = nullptr;
  float result_scale = 1.0f;
  float addend_scale = 1.0f;
  // Optional bias, one value per output column, added to every row before any output scale.
  // BF16 GEMMs: of the output's type (BF16 or F32). FP8 GEMMs: BF16.
  const void* bias = nullptr;
  GemmType bias_type = GemmType::BF16;
  // FP8 outputs (per-tensor scaled GEMMs only): data = encode(result · *scale), and, when amax
  // is given, *amax = max |result| over the output, before the scale. cuBLASLt overwrites amax;
  // it does not accumulate like the quantization kernels' amax buffers.
  const float* scale = nullptr;
  float* amax = nullptr;
};

// A strided batch of BF16 GEMMs: how many, and the distance in elements from one matrix of each
// operand and of the output to the next.
struct GemmBatch {
  int64_t count = 1;
  int64_t stride_a = 0;
  int64_t stride_b = 0;
  int64_t stride_out = 0;
};

class CublasLtGemm {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  static constexpr int kTuneCandidates = 8;
  static constexpr int kTuneRuns = 5;

  // Creates the handle and the workspace on the current device; calls must run on it.
  CublasLtGemm();
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  // BF16 operands, fp32 accumulation; the output is BF16 or F32. `a` and `b` are the operands
  // named by `form`, with their leading dimensions; the output has the form's result shape.
  void bf16_gemm(Bf16Form form, int64_t m, int64_t n, int64_t k, const bf16* a, int64_t lda,
                 const bf16* b, int64_t ldb, const GemmOutput& out, cudaStream_t stream);
  // The same GEMM for batch.count independent matrices in one launch: matrix i of a, b and the
  // output starts batch.stride_* elements after matrix i - 1. An operand stride of 0 uses one
  // matrix for the whole batch; the output's stride must keep the matrices apart (>= rows · ld).
  // No bias.
  void bf16_gemm(Bf16Form form, int64_t m, int64_t n, int64_t k, const bf16* a, int64_t lda,
                 const bf16* b, int64_t ldb, const GemmOutput& out, const GemmBatch& batch,
                 cudaStream_t stream);

  // out[M, N] = (a[M, K] · b[N, K]ᵀ) with a's and b's scales applied: the one form of every FP8
  // GEMM (forward x·Wᵀ; dgrad dy·(Wᵀ)ᵀ; wgrad dyᵀ·(xᵀ)ᵀ). K must be a multiple of 16, N·(output
  // element size) a multiple of 16 bytes. Formats: E4M3×E4M3, E4M3×E5M2, E5M2×E4M3 (not
  // E5M2×E5M2). Scale modes: both Tensor, both Row, or blocks (1x128 with 1x128 or with
  // 128x128, either way round; M and N multiples of 4). Outputs: F32, BF16, or (Tensor scaling
  // only) E4M3 or E5M2, E5M2 only when an operand is E5M2. Fast accumulation skips the periodic
  // promotion of the tensor cores' partial sums to fp32: faster, less accurate. Throws
  // fp8t::Error, naming the problem and cuBLASLt's status, when cuBLASLt refuses the problem.
  void fp8_gemm(int64_t m, int64_t n, int64_t k, const Fp8Operand& a, const Fp8Operand& b,
                const GemmOutput& out, bool fast_accumulation, cudaStream_t stream);

  // From now on, new problems follow `tuning`: autotuned per precision, or the heuristic's first
  // algorithm; problems already planned keep theirs. Loads tuning.cache_path when autotuning is
  // on for a precision.
  void configure_tuning(const GemmTuning& tuning);
  // The cache file's warnings (a file that is not a tuning cache), for the log.
  std::vector<std::string> tuning_warnings() const;

  // What autotuning found for one problem.
  struct TuningRecord {
    std::string problem;  // the GEMM in words (sizes, types, scale modes)
    bool from_cache = false;
    int candidates = 0;       // algorithms the heuristic offered (1: none timed)
    int agreeing = 0;         // of them: ran and agreed with the first (from_cache: 0)
    int winner = 0;           // the index of the one kept (0: the heuristic's first)
    bool engine = false;      // the one kept is the engine's kernel (the last candidate)
    bool no_scratch = false;  // not timed: no device memory for the scratch outputs
    double heuristic_ms = 0.0, best_ms = 0.0;  // medians (from the cache: when it was tuned)
  };
  std::vector<TuningRecord> tuning_records() const;
  // One line for the log: problems tuned and taken from the cache file, the summed medians of
  // the kept algorithms against the heuristic's first choices, and the cache file's warnings;
  // empty when nothing was autotuned.
  std::string tuning_summary() const;

  struct Counters {
    int64_t calls = 0;              // GEMMs requested (refused ones included)
    int64_t heuristic_queries = 0;  // cublasLtMatmulAlgoGetHeuristic calls: one per new problem
    int64_t cache_hits = 0;         // calls that reused a cached answer
    int64_t tuned = 0;              // problems autotuned by timing their candidates
    int64_t tuned_from_file = 0;    // problems whose tuned algorithm came from the cache file
    int64_t engine_calls = 0;       // calls the engine's own kernel served (block_gemm_sm90.h)
  };
  Counters counters() const;
  size_t cached_problems() const;

  // "sm_90"; the cuBLASLt version the program runs with, as "13.1.0".
  std::string architecture() const;
  static std::string library_version();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

const char* gemm_type_name(GemmType type);
const char* bf16_form_name(Bf16Form form);
const char* scale_mode_name(ScaleMode mode);

}  // namespace fp8t::gemm
