// cuBLASLt calls for the GEMMs of cublaslt_gemm.h. CUDA builds only: in a CPU-only build this
// file compiles to nothing.
#if FP8TRAIN_WITH_CUDA

#include "gemm/cublaslt_gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include <fmt/format.h>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "core/phase_timer.h"
#include "gemm/block_gemm_sm90.h"
#include "gemm/output_difference.h"

namespace fp8t::gemm {

const char* gemm_type_name(GemmType type) {
  switch (type) {
    case GemmType::F32:
      return "f32";
    case GemmType::BF16:
      return "bf16";
    case GemmType::E4M3:
      return "e4m3";
    case GemmType::E5M2:
      return "e5m2";
  }
  return "?";
}

const char* bf16_form_name(Bf16Form form) {
  switch (form) {
    case Bf16Form::XWt:
      return "forward y[M, N] = x[M, K]·W[N, K]ᵀ";
    case Bf16Form::DyW:
      return "dgrad dx[M, K] = dy[M, N]·W[N, K]";
    case Bf16Form::DytX:
      return "wgrad dW[N, K] = dy[M, N]ᵀ·x[M, K]";
  }
  return "?";
}

const char* scale_mode_name(ScaleMode mode) {
  switch (mode) {
    case ScaleMode::Tensor:
      return "tensor";
    case ScaleMode::Row:
      return "row-wise";
    case ScaleMode::Block1x128:
      return "1x128 blocks";
    case ScaleMode::Block128x128:
      return "128x128 tiles";
  }
  return "?";
}

namespace {

constexpr int32_t kNone = -1;

bool is_fp8(GemmType type) {
  return type == GemmType::E4M3 || type == GemmType::E5M2;
}

cudaDataType_t cuda_type(GemmType type) {
  switch (type) {
    case GemmType::F32:
      return CUDA_R_32F;
    case GemmType::BF16:
      return CUDA_R_16BF;
    case GemmType::E4M3:
      return CUDA_R_8F_E4M3;
    case GemmType::E5M2:
      return CUDA_R_8F_E5M2;
  }
  return CUDA_R_32F;
}

cudaDataType_t cuda_type(Fp8Format format) {
  return format == Fp8Format::E5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
}

int32_t cublas_scale_mode(ScaleMode mode) {
  switch (mode) {
    case ScaleMode::Tensor:
      return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case ScaleMode::Row:
      return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    case ScaleMode::Block1x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case ScaleMode::Block128x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

bool is_block(ScaleMode mode) {
  return mode == ScaleMode::Block1x128 || mode == ScaleMode::Block128x128;
}

// The largest power of two (at most 256, cuBLASLt's default assumption) dividing the address:
// the heuristic must only offer algorithms that work at the alignment the buffers really have.
uint32_t alignment_of(uintptr_t address) {
  uint32_t alignment = 1;
  while (alignment < 256 && address % (2 * alignment) == 0)
    alignment *= 2;
  return alignment;
}

uint32_t alignment_of(const void* pointer) {
  return alignment_of(reinterpret_cast<uintptr_t>(pointer));
}

size_t cuda_type_bytes(cudaDataType_t type) {
  switch (type) {
    case CUDA_R_32F:
      return 4;
    case CUDA_R_16BF:
      return 2;
    default:
      return 1;  // the FP8 types
  }
}

std::string status_text(cublasStatus_t status) {
  return fmt::format("{} ({})", cublasLtGetStatusName(status), cublasLtGetStatusString(status));
}

// A matrix as cuBLASLt sees it: column-major [rows, cols] with leading dimension ld. A row-major
// [r, c] buffer with row stride ld is the column-major [c, r] matrix with the same ld.
struct Matrix {
  const void* data = nullptr;
  cudaDataType_t type = CUDA_R_32F;
  uint64_t rows = 0;
  uint64_t cols = 0;
  int64_t ld = 0;
  int64_t batch = 1;   // matrices in a strided batch
  int64_t stride = 0;  // elements from one matrix of the batch to the next
};

// The alignment every matrix of the batch has: the first one's, and the stride's in bytes.
uint32_t alignment_of(const Matrix& matrix) {
  const uint32_t first = alignment_of(matrix.data);
  if (matrix.batch <= 1 || matrix.stride == 0) return first;
  const auto stride_bytes = static_cast<uintptr_t>(matrix.stride) * cuda_type_bytes(matrix.type);
  return std::min(first, alignment_of(stride_bytes));
}

enum class Kind : uint8_t { Bf16XWt, Bf16DyW, Bf16DytX, Fp8 };

// One GEMM request, in cuBLASLt's terms (D = alpha·op(A)·op(B) + beta·C, column-major), plus
// what an error message needs to name it in the caller's terms.
struct Problem {
  Kind kind = Kind::Fp8;
  int64_t m = 0, n = 0, k = 0;  // the caller's sizes
  cublasOperation_t trans_a = CUBLAS_OP_N;
  cublasOperation_t trans_b = CUBLAS_OP_N;
  Matrix a, b, d;                // C has D's layout (read only when beta != 0)
  void* out = nullptr;           // D's data
  const void* addend = nullptr;  // C's data when it is not D's
  GemmType out_type = GemmType::F32;
  float alpha = 1.0f;
  float beta = 0.0f;
  // FP8 only. cuBLASLt's A is the caller's b and its B the caller's a (see map_xwt).
  Fp8Format a_format = Fp8Format::E4M3, b_format = Fp8Format::E4M3;  // the caller's a and b
  ScaleMode a_scale_mode = ScaleMode::Tensor, b_scale_mode = ScaleMode::Tensor;
  const void* a_scale = nullptr;  // the caller's a
  const void* b_scale = nullptr;  // the caller's b
  const void* d_scale = nullptr;
  void* amax = nullptr;
  bool fast_accumulation = false;
  const void* bias = nullptr;
  GemmType bias_type = GemmType::BF16;
  // FP8 only: the call as the caller made it, for the engine's own kernel (block_gemm_sm90.h).
  Fp8Operand caller_a, caller_b;
  GemmOutput caller_out;
};

std::string describe(const Problem& p) {
  std::string text;
  if (p.kind == Kind::Fp8) {
    text = fmt::format(
        "FP8 GEMM out[M, N] = a[M, K]·b[N, K]ᵀ with M={}, N={}, K={}: a {} ({}), b {} ({}), "
        "out {}",
        p.m, p.n, p.k, format_name(p.a_format), scale_mode_name(p.a_scale_mode),
        format_name(p.b_format), scale_mode_name(p.b_scale_mode), gemm_type_name(p.out_type));
  } else {
    const Bf16Form form = p.kind == Kind::Bf16XWt   ? Bf16Form::XWt
                          : p.kind == Kind::Bf16DyW ? Bf16Form::DyW
                                                    : Bf16Form::DytX;
    text = fmt::format("BF16 GEMM {} with M={}, N={}, K={}: out {}", bf16_form_name(form), p.m, p.n,
                       p.k, gemm_type_name(p.out_type));
  }
  if (p.d.batch > 1) text += fmt::format(", batch of {}", p.d.batch);
  if (p.addend != nullptr) {
    text += fmt::format(" ({} x result + {} x addend)", p.alpha, p.beta);
  } else if (p.beta != 0.0f) {
    text += " (accumulate)";
  }
  if (p.bias != nullptr) text += fmt::format(", {} bias", gemm_type_name(p.bias_type));
  if (p.kind == Kind::Fp8) {
    text += fmt::format(", fast accumulation {}", p.fast_accumulation ? "on" : "off");
  }
  return text;
}

bool is_block_scaled(const Problem& p) {
  return p.kind == Kind::Fp8 && is_block(p.a_scale_mode);
}

std::string library_version_text() {
  const size_t version = cublasLtGetVersion();  // major * 10000 + minor * 100 + patch
  return fmt::format("{}.{}.{}", version / 10000, version % 10000 / 100, version % 100);
}

std::string current_architecture() {
  int device = 0, major = 0, minor = 0;
  FP8T_CUDA_CHECK(cudaGetDevice(&device));
  FP8T_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FP8T_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return fmt::format("sm_{}{}", major, minor);
}

// Where cuBLASLt refuses block scales (on Hopper the support depends on the library version and
// on fast accumulation), the message starts with what the caller needs to know.
std::string refusal_prefix(const Problem& p, cublasStatus_t status) {
  if (!is_block_scaled(p) || status != CUBLAS_STATUS_NOT_SUPPORTED) return "";
  return fmt::format("cuBLASLt {} does not support block-scaled FP8 on {}: ",
                     library_version_text(), current_architecture());
}

[[noreturn]] void throw_cublaslt_failure(const char* file, int line, const char* call,
                                         cublasStatus_t status, const Problem& problem) {
  throw Error(fmt::format("{}:{}: {}cuBLASLt call '{}' failed for {}: {}", file, line,
                          refusal_prefix(problem, status), call, describe(problem),
                          status_text(status)));
}

}  // namespace
}  // namespace fp8t::gemm

// Checks a cuBLASLt call made for `problem`; the error names the call, the problem (shape,
// types, modes) and the status.
#define FP8T_CUBLASLT_CHECK(call, problem)                                                    \
  do {                                                                                        \
    const cublasStatus_t fp8t_status_ = (call);                                               \
    if (fp8t_status_ != CUBLAS_STATUS_SUCCESS) {                                              \
      ::fp8t::gemm::throw_cublaslt_failure(__FILE__, __LINE__, #call, fp8t_status_, problem); \
    }                                                                                         \
  } while (false)

namespace fp8t::gemm {
namespace {

struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* desc) const { cublasLtMatmulDescDestroy(desc); }
};
struct LayoutDeleter {
  void operator()(cublasLtMatrixLayoutOpaque_t* layout) const {
    cublasLtMatrixLayoutDestroy(layout);
  }
};
struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreferenceOpaque_t* preference) const {
    cublasLtMatmulPreferenceDestroy(preference);
  }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LayoutDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, PreferenceDeleter>;

// Everything that selects an algorithm. Pointers enter only through their alignment.
struct PlanKey {
  Kind kind;
  int64_t m, n, k, lda, ldb, ldd;
  int64_t batch, stride_a, stride_b, stride_d;  // cuBLASLt's A and B
  int32_t a_type, b_type, d_type, bias_type;    // cudaDataType_t; bias kNone when absent
  int32_t a_scale_mode, b_scale_mode;           // kNone for BF16
  bool d_scale, amax, accumulate, fast_accumulation;
  uint32_t align_a, align_b, align_d, align_bias;

  auto tie() const {
    return std::tie(kind, m, n, k, lda, ldb, ldd, batch, stride_a, stride_b, stride_d, a_type,
                    b_type, d_type, bias_type, a_scale_mode, b_scale_mode, d_scale, amax,
                    accumulate, fast_accumulation, align_a, align_b, align_d, align_bias);
  }
  bool operator==(const PlanKey& other) const { return tie() == other.tie(); }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    size_t hash = 0;
    std::apply(
        [&hash](const auto&... field) {
          ((hash = hash * 1000003u ^ std::hash<std::decay_t<decltype(field)>>{}(field)), ...);
        },
        key.tie());
    return hash;
  }
};

// D's alignment, and C's where C is another buffer: the two share one layout.
uint32_t output_alignment(const Problem& p) {
  const uint32_t d = alignment_of(p.d);
  if (p.addend == nullptr) return d;
  Matrix c = p.d;
  c.data = p.addend;
  return std::min(d, alignment_of(c));
}

PlanKey key_of(const Problem& p) {
  const bool fp8 = p.kind == Kind::Fp8;
  return {.kind = p.kind,
          .m = p.m,
          .n = p.n,
          .k = p.k,
          .lda = p.a.ld,
          .ldb = p.b.ld,
          .ldd = p.d.ld,
          .batch = p.d.batch,
          .stride_a = p.a.stride,
          .stride_b = p.b.stride,
          .stride_d = p.d.stride,
          .a_type = static_cast<int32_t>(p.a.type),
          .b_type = static_cast<int32_t>(p.b.type),
          .d_type = static_cast<int32_t>(p.d.type),
          .bias_type = p.bias != nullptr ? static_cast<int32_t>(cuda_type(p.bias_type)) : kNone,
          .a_scale_mode = fp8 ? cublas_scale_mode(p.a_scale_mode) : kNone,
          .b_scale_mode = fp8 ? cublas_scale_mode(p.b_scale_mode) : kNone,
          .d_scale = p.d_scale != nullptr,
          .amax = p.amax != nullptr,
          .accumulate = p.beta != 0.0f,
          .fast_accumulation = fp8 && p.fast_accumulation,
          .align_a = alignment_of(p.a),
          .align_b = alignment_of(p.b),
          .align_d = output_alignment(p),
          .align_bias = p.bias != nullptr ? alignment_of(p.bias) : 0u};
}

// The key as text: how the tuning cache file names a problem.
std::string problem_text(const PlanKey& key) {
  static constexpr const char* kKinds[] = {"bf16 x.wt", "bf16 dy.w", "bf16 dyt.x", "fp8"};
  return fmt::format(
      "{} m={} n={} k={} ld={}/{}/{} batch={} strides={}/{}/{} types={}/{}/{}/{} scales={}/{} "
      "d_scale={} amax={} accumulate={} fast={} align={}/{}/{}/{}",
      kKinds[static_cast<int>(key.kind)], key.m, key.n, key.k, key.lda, key.ldb, key.ldd, key.batch,
      key.stride_a, key.stride_b, key.stride_d, key.a_type, key.b_type, key.d_type, key.bias_type,
      key.a_scale_mode, key.b_scale_mode, int(key.d_scale), int(key.amax), int(key.accumulate),
      int(key.fast_accumulation), key.align_a, key.align_b, key.align_d, key.align_bias);
}

std::string algorithm_hex(const cublasLtMatmulAlgo_t& algo) {
  std::string text;
  for (const uint64_t word : algo.data)
    text += fmt::format("{:016x}", word);
  return text;
}

// How the tuning cache names the engine's own kernel in place of a cuBLASLt algorithm.
constexpr const char* kEngineAlgorithm = "fp8train";

// How far a candidate's output may lie from the heuristic's first choice's (‖Δ‖/‖ref‖): the
// two differ in summation order, and an output type rounds the difference up to its precision.
double agreement_tolerance(GemmType type) {
  switch (type) {
    case GemmType::F32:
      return 1e-3;
    case GemmType::BF16:
      return 1e-2;
    case GemmType::E4M3:
      return 0.1;
    case GemmType::E5M2:
      return 0.2;
  }
  return 0.0;
}

// The descriptors of one problem and the algorithm the heuristic chose, or why it chose none.
struct Plan {
  MatmulDesc desc;
  Layout a, b, c, d;  // c differs from d only for FP8 outputs, whose C must be BF16
  cublasLtMatmulAlgo_t algo{};
  bool engine = false;  // the engine's own kernel serves the problem instead of cuBLASLt
  std::string refusal;  // non-empty: cuBLASLt offers no algorithm; the message to throw
  // Autotuning: what the heuristic offered, first choice first (emptied once one is kept).
  std::vector<cublasLtMatmulAlgo_t> candidates;
};

// Device memory that is freed on scope exit; null when the allocation failed.
class ScratchMemory {
 public:
  explicit ScratchMemory(size_t bytes) {
    if (cudaMalloc(&data_, bytes) != cudaSuccess) {
      (void)cudaGetLastError();  // a failed allocation leaves no sticky error; clear it
      data_ = nullptr;
    }
  }
  ~ScratchMemory() { cudaFree(data_); }
  ScratchMemory(const ScratchMemory&) = delete;
  ScratchMemory& operator=(const ScratchMemory&) = delete;
  void* get() const { return data_; }

 private:
  void* data_ = nullptr;
};

Layout make_layout(const Matrix& matrix, const Problem& problem) {
  cublasLtMatrixLayout_t raw_layout = nullptr;
  FP8T_CUBLASLT_CHECK(
      cublasLtMatrixLayoutCreate(&raw_layout, matrix.type, matrix.rows, matrix.cols, matrix.ld),
      problem);
  Layout layout(raw_layout);
  if (matrix.batch > 1) {
    const auto count = static_cast<int32_t>(matrix.batch);
    FP8T_CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(
                            raw_layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count),
                        problem);
    FP8T_CUBLASLT_CHECK(
        cublasLtMatrixLayoutSetAttribute(raw_layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                         &matrix.stride, sizeof matrix.stride),
        problem);
  }
  return layout;
}

template <typename T>
void set_attribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute,
                   const T& value, const char* name, const Problem& problem) {
  const cublasStatus_t status =
      cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof value);
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw_cublaslt_failure(__FILE__, __LINE__,
                           fmt::format("cublasLtMatmulDescSetAttribute({})", name).c_str(), status,
                           problem);
  }
}
#define FP8T_SET_ATTRIBUTE(desc, attribute, value, problem) \
  set_attribute(desc, attribute, value, #attribute, problem)

// The pointers of a call: set on every call, since a cached plan serves many buffers.
void set_pointers(cublasLtMatmulDesc_t desc, const Problem& p) {
  if (p.kind == Kind::Fp8) {
    // cuBLASLt's A is the caller's b (see map_xwt).
    FP8T_SET_ATTRIBUTE(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, p.b_scale, p);
    FP8T_SET_ATTRIBUTE(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, p.a_scale, p);
    if (p.d_scale != nullptr) {
      FP8T_SET_ATTRIBUTE(desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, p.d_scale, p);
    }
    if (p.amax != nullptr) FP8T_SET_ATTRIBUTE(desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, p.amax, p);
  }
  if (p.bias != nullptr) FP8T_SET_ATTRIBUTE(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias, p);
}

// cuBLASLt is column-major: a row-major [r, c] buffer with row stride ld is the column-major
// [c, r] matrix with leading dimension ld, so a row-major product P = X·Y is computed as the
// column-major Pᵀ = Yᵀ·Xᵀ: cuBLASLt's A is the caller's second operand, its B the first.
//   forward y[M, N] = x·Wᵀ:  D[N, M] = op_T(W stored [K, N])·(x stored [K, M]), (m, n, k) = (N, M,
//   K)
//     ("TN": both operands K-major, the one form Hopper's FP8 kernels accept);
//   dgrad dx[M, K] = dy·W:   D[K, M] = (W stored [K, N])·(dy stored [N, M]),   (m, n, k) = (K, M,
//   N); wgrad dW[N, K] = dyᵀ·x:  D[K, N] = (x stored [K, M])·op_T(dy stored [N, M]), (m, n, k) =
//   (K, N, M).
void map_operands(Problem& p, const void* a, cudaDataType_t a_type, int64_t lda, const void* b,
                  cudaDataType_t b_type, int64_t ldb) {
  const auto m = static_cast<uint64_t>(p.m), n = static_cast<uint64_t>(p.n),
             k = static_cast<uint64_t>(p.k);
  switch (p.kind) {
    case Kind::Fp8:
    case Kind::Bf16XWt:
      p.trans_a = CUBLAS_OP_T;
      p.trans_b = CUBLAS_OP_N;
      p.a = {b, b_type, k, n, ldb};
      p.b = {a, a_type, k, m, lda};
      p.d.rows = n;
      p.d.cols = m;
      break;
    case Kind::Bf16DyW:
      p.trans_a = CUBLAS_OP_N;
      p.trans_b = CUBLAS_OP_N;
      p.a = {b, b_type, k, n, ldb};
      p.b = {a, a_type, n, m, lda};
      p.d.rows = k;
      p.d.cols = m;
      break;
    case Kind::Bf16DytX:
      p.trans_a = CUBLAS_OP_N;
      p.trans_b = CUBLAS_OP_T;
      p.a = {b, b_type, k, m, ldb};
      p.b = {a, a_type, n, m, lda};
      p.d.rows = k;
      p.d.cols = n;
      break;
  }
}

// The shape of the caller's row-major output: [M, N], [M, K] or [N, K].
std::pair<int64_t, int64_t> output_shape(const Problem& p) {
  switch (p.kind) {
    case Kind::Fp8:
    case Kind::Bf16XWt:
      return {p.m, p.n};
    case Kind::Bf16DyW:
      return {p.m, p.k};
    case Kind::Bf16DytX:
      return {p.n, p.k};
  }
  return {0, 0};
}

// The output's type and what the epilogue adds: D = alpha·AB + beta·C, C the output itself
// (accumulate) or an addend, and the bias.
void take_epilogue(Problem& p, const GemmOutput& out) {
  p.out_type = out.type;
  p.beta = out.accumulate ? 1.0f : 0.0f;
  if (out.addend != nullptr) {
    p.addend = out.addend;
    p.alpha = out.result_scale;
    p.beta = out.addend_scale;
  }
  p.bias = out.bias;
  p.bias_type = out.bias_type;
}

void check_addend(const GemmOutput& out, const Problem& p) {
  FP8T_CHECK(out.addend == nullptr || !out.accumulate,
             "{}: expected an addend or accumulation, found both", describe(p));
  FP8T_CHECK(out.addend != nullptr || (out.result_scale == 1.0f && out.addend_scale == 1.0f),
             "{}: result and addend scales need an addend", describe(p));
  FP8T_CHECK(out.addend == nullptr || out.bias == nullptr, "{}: expected an addend or a bias",
             describe(p));
}

void check_output(const GemmOutput& out, const Problem& p) {
  const auto [rows, cols] = output_shape(p);
  FP8T_CHECK(out.data != nullptr, "{}: expected an output [{}, {}], found null", describe(p), rows,
             cols);
  FP8T_CHECK(out.ld >= cols, "{}: expected the output's leading dimension >= {}, found {}",
             describe(p), cols, out.ld);
}

}  // namespace

struct CublasLtGemm::State {
  cublasLtHandle_t handle = nullptr;
  int device = 0;
  int cc_major = 0;
  int cc_minor = 0;
  DeviceBuffer<uint8_t> workspace{kWorkspaceBytes};
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
  Counters counters;
  GemmTuning tuning;
  std::unique_ptr<GemmTuningCache> tuning_cache;
  std::vector<TuningRecord> tuning_records;

  State() {
    FP8T_CUDA_CHECK(cudaGetDevice(&device));
    FP8T_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device));
    FP8T_CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, device));
    const cublasStatus_t status = cublasLtCreate(&handle);
    if (status != CUBLAS_STATUS_SUCCESS) {
      throw Error(fmt::format("cublasLtCreate failed: {}", status_text(status)));
    }
  }
  ~State() { cublasLtDestroy(handle); }
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  std::string architecture() const { return fmt::format("sm_{}{}", cc_major, cc_minor); }

  GemmTuningIdentity identity() const {
    cudaDeviceProp properties{};
    FP8T_CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
    int runtime = 0;
    FP8T_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    return {properties.name, architecture(), library_version_text(),
            fmt::format("{}.{}", runtime / 1000, runtime % 1000 / 10),
            block_gemm_sm90_fingerprint()};
  }

  bool autotuned(const Problem& p) const {
    return tuning.autotune(p.kind == Kind::Fp8 ? GemmPrecision::Fp8 : GemmPrecision::Bf16);
  }

  static bool engine_serves(const Problem& p) {
    return p.kind == Kind::Fp8 && block_gemm_sm90_serves(p.caller_a, p.caller_b, p.caller_out);
  }

  // The problem on the engine's kernel, into `out` (the caller's output or a scratch one).
  void launch_engine(const Problem& p, void* out, cudaStream_t stream) const {
    GemmOutput target = p.caller_out;
    target.data = out;
    block_gemm_sm90(p.m, p.n, p.k, p.caller_a, p.caller_b, target, tuning.deterministic, stream);
  }

  // The cached plan of the problem. A new problem asks the heuristic once, whatever it answers:
  // a refusal (at any step) is cached too, and thrown again on every call. An autotuned one
  // then chooses among the candidates (on `stream`, waiting for the answer).
  Plan& plan_for(const Problem& p, cudaStream_t stream) {
    const PlanKey key = key_of(p);
    if (const auto found = plans.find(key); found != plans.end()) {
      ++counters.cache_hits;
      return found->second;
    }
    Plan plan;
    try {
      build(p, plan);
    } catch (const Error& error) {
      plan.refusal = error.what();
    }
    const bool engine = engine_serves(p);
    if (engine && tuning.pins.fp8 == GemmBackend::Fp8train) {
      plan.engine = true;
      plan.refusal.clear();
    } else if (plan.refusal.empty() && autotuned(p)) {
      if (plan.candidates.size() > 1 || engine) {
        choose(p, key, plan, stream, engine);
      } else {  // nothing to choose from
        tuning_records.push_back({.problem = describe(p), .candidates = 1, .agreeing = 1});
      }
    }
    plan.candidates.clear();
    return plans.emplace(key, std::move(plan)).first->second;
  }

  cublasStatus_t launch(const Plan& plan, const cublasLtMatmulAlgo_t& algo, const Problem& p,
                        cudaStream_t stream) {
    set_pointers(plan.desc.get(), p);
    const void* c = plan.c ? nullptr : p.addend != nullptr ? p.addend : p.out;
    return cublasLtMatmul(handle, plan.desc.get(), &p.alpha, p.a.data, plan.a.get(), p.b.data,
                          plan.b.get(), &p.beta, c, plan.c ? plan.c.get() : plan.d.get(), p.out,
                          plan.d.get(), &algo, workspace.get(), kWorkspaceBytes, stream);
  }

  // Autotuning: the tuned choice from the cache file when the heuristic still offers it at the
  // same place (or it is the engine's kernel, which serves the problem); otherwise each
  // candidate runs into scratch outputs, those that disagree with the first (the heuristic's
  // choice) drop out, and the fastest of the rest wins. The engine's kernel, when it serves
  // the problem, is the last candidate.
  void choose(const Problem& p, const PlanKey& key, Plan& plan, cudaStream_t stream, bool engine) {
    const std::string text = problem_text(key);
    const int offered = static_cast<int>(plan.candidates.size());
    const int engine_index = engine ? offered : -1;
    const int total = offered + (engine ? 1 : 0);
    TuningRecord record{.problem = describe(p), .candidates = total};
    if (tuning_cache) {
      const TunedGemm* tuned = tuning_cache->find(text);
      const bool cached_engine = tuned != nullptr && engine && tuned->algorithm == kEngineAlgorithm;
      if (tuned != nullptr && tuned->candidates == kTuneCandidates &&
          (cached_engine ||
           (tuned->candidate < offered &&
            algorithm_hex(plan.candidates[size_t(tuned->candidate)]) == tuned->algorithm))) {
        if (cached_engine) {
          plan.engine = true;
        } else {
          plan.algo = plan.candidates[size_t(tuned->candidate)];
        }
        ++counters.tuned_from_file;
        record.from_cache = true;
        record.engine = cached_engine;
        record.winner = cached_engine ? engine_index : tuned->candidate;
        record.heuristic_ms = tuned->heuristic_ms;
        record.best_ms = tuned->ms;
        tuning_records.push_back(record);
        return;
      }
    }
    // The scratch outputs: the reference (the first candidate's result) and a candidate's,
    // with the output's layout; the amax of FP8 outputs goes to scratch too.
    const OutputView view{.type = p.out_type,
                          .rows = static_cast<int64_t>(p.d.rows),
                          .cols = static_cast<int64_t>(p.d.cols),
                          .ld = p.d.ld,
                          .batch = p.d.batch,
                          .stride = p.d.stride};
    const int64_t elements = (view.batch - 1) * view.stride + (view.cols - 1) * view.ld + view.rows;
    const size_t bytes = static_cast<size_t>(elements) * gemm_type_bytes(p.out_type);
    const ScratchMemory reference(bytes), candidate(bytes), amax(sizeof(float));
    if (reference.get() == nullptr || candidate.get() == nullptr || amax.get() == nullptr) {
      record.no_scratch = true;
      tuning_records.push_back(record);
      return;
    }
    Problem trial = p;
    if (p.amax != nullptr) trial.amax = amax.get();
    // Runs candidate `index` into trial.out; false when it fails.
    const auto run_candidate = [&](int index) {
      if (index == engine_index) {
        try {
          launch_engine(trial, trial.out, stream);
          return true;
        } catch (const Error&) {
          return false;
        }
      }
      return launch(plan, plan.candidates[size_t(index)], trial, stream) == CUBLAS_STATUS_SUCCESS;
    };
    const auto run_into = [&](const ScratchMemory& out, int index) {
      trial.out = out.get();
      trial.d.data = out.get();
      FP8T_CUDA_CHECK(cudaMemsetAsync(out.get(), 0, bytes, stream));
      return run_candidate(index);
    };
    std::vector<CandidateTrial> trials(static_cast<size_t>(total));
    trials[0].ran = run_into(reference, 0);
    if (!trials[0].ran) {  // the first choice fails here: the call will say why
      tuning_records.push_back(record);
      return;
    }
    for (int index = 1; index < total; ++index) {
      CandidateTrial& result = trials[size_t(index)];
      result.ran = run_into(candidate, index);
      if (result.ran) {
        result.relative_difference =
            relative_difference(view, candidate.get(), reference.get(), stream);
      }
    }
    const double tolerance = agreement_tolerance(p.out_type);
    TimingEvents events(2);
    for (int index = 0; index < total; ++index) {
      CandidateTrial& result = trials[size_t(index)];
      if (!result.ran || !(result.relative_difference <= tolerance)) continue;
      ++record.agreeing;
      trial.out = candidate.get();
      trial.d.data = candidate.get();
      std::vector<double> times;
      for (int run = 0; run <= kTuneRuns && result.ran; ++run) {  // run 0 warms up
        events.record(0, stream);
        result.ran = run_candidate(index);
        events.record(1, stream);
        events.synchronize(1);
        if (run > 0) times.push_back(events.ms(0, 1));
      }
      if (!result.ran) continue;
      std::sort(times.begin(), times.end());
      result.ms = times[times.size() / 2];
    }
    const int winner = std::max(0, fastest_agreeing(trials, tolerance));
    plan.engine = winner == engine_index;
    if (!plan.engine) plan.algo = plan.candidates[size_t(winner)];
    ++counters.tuned;
    record.winner = winner;
    record.engine = plan.engine;
    record.heuristic_ms = trials[0].ms;
    record.best_ms = trials[size_t(winner)].ms;
    tuning_records.push_back(record);
    if (tuning_cache) {
      tuning_cache->put(text, {.candidate = winner,
                               .candidates = kTuneCandidates,
                               .algorithm = plan.engine ? std::string(kEngineAlgorithm)
                                                        : algorithm_hex(plan.algo),
                               .ms = record.best_ms,
                               .heuristic_ms = record.heuristic_ms});
    }
  }

  void build(const Problem& p, Plan& plan) {
    cublasLtMatmulDesc_t desc = nullptr;
    FP8T_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), p);
    plan.desc.reset(desc);
    FP8T_SET_ATTRIBUTE(desc, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(p.trans_a), p);
    FP8T_SET_ATTRIBUTE(desc, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(p.trans_b), p);
    if (p.kind == Kind::Fp8) {
      const int8_t fast_accumulation = p.fast_accumulation ? 1 : 0;
      FP8T_SET_ATTRIBUTE(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accumulation, p);
      // cuBLASLt's A is the caller's b, its B the caller's a.
      FP8T_SET_ATTRIBUTE(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, cublas_scale_mode(p.b_scale_mode),
                         p);
      FP8T_SET_ATTRIBUTE(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, cublas_scale_mode(p.a_scale_mode),
                         p);
    }
    if (p.bias != nullptr) {
      const auto epilogue = static_cast<uint32_t>(CUBLASLT_EPILOGUE_BIAS);
      FP8T_SET_ATTRIBUTE(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue, p);
      FP8T_SET_ATTRIBUTE(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                         static_cast<int32_t>(cuda_type(p.bias_type)), p);
    }
    set_pointers(desc, p);
    plan.a = make_layout(p.a, p);
    plan.b = make_layout(p.b, p);
    plan.d = make_layout(p.d, p);
    if (is_fp8(p.out_type))
      plan.c = make_layout({p.out, CUDA_R_16BF, p.d.rows, p.d.cols, p.d.ld}, p);

    cublasLtMatmulPreference_t raw_preference = nullptr;
    FP8T_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&raw_preference), p);
    const Preference preference(raw_preference);
    const uint64_t workspace_bytes = kWorkspaceBytes;
    const uint32_t alignments[] = {alignment_of(p.a), alignment_of(p.b), output_alignment(p)};
    FP8T_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
                            raw_preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                            &workspace_bytes, sizeof workspace_bytes),
                        p);
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignment_preferences[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignments[0]},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignments[1]},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignments[2]},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignments[2]}};
    for (const auto& [attribute, bytes] : alignment_preferences) {
      FP8T_CUBLASLT_CHECK(
          cublasLtMatmulPreferenceSetAttribute(raw_preference, attribute, &bytes, sizeof bytes), p);
    }

    ++counters.heuristic_queries;
    cublasLtMatmulHeuristicResult_t results[kTuneCandidates] = {};
    const int requested = autotuned(p) ? kTuneCandidates : 1;
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        handle, desc, plan.a.get(), plan.b.get(), plan.c ? plan.c.get() : plan.d.get(),
        plan.d.get(), raw_preference, requested, results, &found);
    const cublasLtMatmulHeuristicResult_t& result = results[0];
    if (status == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
      plan.algo = result.algo;
      for (int index = 0; index < found; ++index) {
        if (results[index].state == CUBLAS_STATUS_SUCCESS)
          plan.candidates.push_back(results[index].algo);
      }
    } else {
      const std::string answer =
          status != CUBLAS_STATUS_SUCCESS
              ? fmt::format("cublasLtMatmulAlgoGetHeuristic returned {}", status_text(status))
          : found == 0
              ? std::string("cublasLtMatmulAlgoGetHeuristic found no algorithm")
              : fmt::format("cublasLtMatmulAlgoGetHeuristic offered an algorithm in state {}",
                            status_text(result.state));
      plan.refusal =
          is_block_scaled(p)
              ? fmt::format("cuBLASLt {} does not support block-scaled FP8 on {}: {}: {}",
                            library_version_text(), architecture(), describe(p), answer)
              : fmt::format("cuBLASLt {} has no algorithm on {} for {}: {}", library_version_text(),
                            architecture(), describe(p), answer);
    }
  }

  void run(const Problem& p, cudaStream_t stream) {
    int current = 0;
    FP8T_CUDA_CHECK(cudaGetDevice(&current));
    FP8T_CHECK(current == device, "{}: this CublasLtGemm belongs to device {}, called on device {}",
               describe(p), device, current);
    ++counters.calls;
    Plan& plan = plan_for(p, stream);
    if (!plan.refusal.empty()) throw Error(plan.refusal);
    if (plan.engine) {
      ++counters.engine_calls;
      launch_engine(p, p.out, stream);
      return;
    }
    FP8T_CUBLASLT_CHECK(launch(plan, plan.algo, p, stream), p);
  }
};

CublasLtGemm::CublasLtGemm() : state_(std::make_unique<State>()) {}
CublasLtGemm::~CublasLtGemm() = default;

CublasLtGemm::Counters CublasLtGemm::counters() const {
  return state_->counters;
}
void CublasLtGemm::configure_tuning(const GemmTuning& tuning) {
  state_->tuning = tuning;
  state_->tuning_cache.reset();
  if (tuning.autotunes_any() && !tuning.cache_path.empty()) {
    state_->tuning_cache = std::make_unique<GemmTuningCache>(tuning.cache_path, state_->identity());
  }
}
std::vector<std::string> CublasLtGemm::tuning_warnings() const {
  return state_->tuning_cache ? state_->tuning_cache->warnings() : std::vector<std::string>{};
}
std::vector<CublasLtGemm::TuningRecord> CublasLtGemm::tuning_records() const {
  return state_->tuning_records;
}
std::string CublasLtGemm::tuning_summary() const {
  std::string text;
  for (const std::string& warning : tuning_warnings())
    text += warning + "\n";
  const std::vector<TuningRecord>& records = state_->tuning_records;
  if (records.empty()) return text;
  int single = 0, changed = 0, engine = 0, no_scratch = 0;
  double heuristic_ms = 0.0, best_ms = 0.0;
  for (const TuningRecord& record : records) {
    single += record.candidates == 1 ? 1 : 0;
    no_scratch += record.no_scratch ? 1 : 0;
    changed += record.winner != 0 ? 1 : 0;
    engine += record.engine ? 1 : 0;
    heuristic_ms += record.heuristic_ms;
    best_ms += record.best_ms;
  }
  text += fmt::format(
      "GEMM autotuning: {} problems: {} timed now, {} from {}, {} with one candidate only; {} "
      "run another algorithm than the heuristic's first ({} the engine's block-scaled kernel); "
      "one call of each takes {:.3f} ms in all against {:.3f} ms ({:+.1f} %)",
      records.size(), state_->counters.tuned, state_->counters.tuned_from_file,
      state_->tuning_cache ? state_->tuning_cache->path() : std::string("the cache file"), single,
      changed, engine, best_ms, heuristic_ms,
      heuristic_ms > 0.0 ? 100.0 * (best_ms / heuristic_ms - 1.0) : 0.0);
  if (no_scratch > 0) {
    text += fmt::format("; {} not timed for want of device memory for scratch outputs", no_scratch);
  }
  return text;
}

size_t CublasLtGemm::cached_problems() const {
  return state_->plans.size();
}
std::string CublasLtGemm::architecture() const {
  return state_->architecture();
}
std::string CublasLtGemm::library_version() {
  return library_version_text();
}

void CublasLtGemm::bf16_gemm(Bf16Form form, int64_t m, int64_t n, int64_t k, const bf16* a,
                             int64_t lda, const bf16* b, int64_t ldb, const GemmOutput& out,
                             cudaStream_t stream) {
  bf16_gemm(form, m, n, k, a, lda, b, ldb, out, GemmBatch{}, stream);
}

void CublasLtGemm::bf16_gemm(Bf16Form form, int64_t m, int64_t n, int64_t k, const bf16* a,
                             int64_t lda, const bf16* b, int64_t ldb, const GemmOutput& out,
                             const GemmBatch& batch, cudaStream_t stream) {
  const PhaseScope timed(StepPhase::Gemm, stream);
  Problem p;
  p.kind = form == Bf16Form::XWt   ? Kind::Bf16XWt
           : form == Bf16Form::DyW ? Kind::Bf16DyW
                                   : Kind::Bf16DytX;
  p.m = m;
  p.n = n;
  p.k = k;
  take_epilogue(p, out);
  p.d.batch = batch.count;
  FP8T_CHECK(m > 0 && n > 0 && k > 0, "{}: expected positive sizes", describe(p));
  FP8T_CHECK(out.type == GemmType::F32 || out.type == GemmType::BF16,
             "{}: expected an f32 or bf16 output, found {}", describe(p), gemm_type_name(out.type));
  FP8T_CHECK(out.scale == nullptr && out.amax == nullptr,
             "{}: an output scale and amax apply to FP8 outputs only", describe(p));
  FP8T_CHECK(out.bias == nullptr || out.bias_type == out.type,
             "{}: expected a bias of the output's type {}, found {}", describe(p),
             gemm_type_name(out.type), gemm_type_name(out.bias_type));
  // The operands' row-major shapes: a is x [M, K] or dy [M, N]; b is W [N, K] or x [M, K].
  const int64_t a_cols = form == Bf16Form::XWt ? k : n;
  const int64_t b_rows = form == Bf16Form::DytX ? m : n;
  const char* a_name = form == Bf16Form::XWt ? "x" : "dy";
  const char* b_name = form == Bf16Form::DytX ? "x" : "W";
  FP8T_CHECK(a != nullptr, "{}: expected {} ([{}, {}]), found null", describe(p), a_name, m,
             a_cols);
  FP8T_CHECK(lda >= a_cols, "{}: expected the leading dimension of {} >= {}, found {}", describe(p),
             a_name, a_cols, lda);
  FP8T_CHECK(b != nullptr, "{}: expected {} ([{}, {}]), found null", describe(p), b_name, b_rows,
             k);
  FP8T_CHECK(ldb >= k, "{}: expected the leading dimension of {} >= {}, found {}", describe(p),
             b_name, k, ldb);
  check_output(out, p);
  check_addend(out, p);
  FP8T_CHECK(batch.count >= 1 && batch.count <= std::numeric_limits<int32_t>::max(),
             "{}: expected a batch of 1 to {} matrices, found {}", describe(p),
             std::numeric_limits<int32_t>::max(), batch.count);
  if (batch.count > 1) {
    const int64_t out_rows = output_shape(p).first;
    FP8T_CHECK(batch.stride_a >= 0 && batch.stride_b >= 0,
               "{}: expected operand strides >= 0, found {} ({}) and {} ({})", describe(p),
               batch.stride_a, a_name, batch.stride_b, b_name);
    FP8T_CHECK(batch.stride_out >= out_rows * out.ld,
               "{}: expected the output's batch stride >= rows x ld = {}, found {}", describe(p),
               out_rows * out.ld, batch.stride_out);
    FP8T_CHECK(out.bias == nullptr, "{}: batched GEMMs take no bias", describe(p));
  }
  map_operands(p, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb);
  p.out = out.data;
  p.d.data = out.data;
  p.d.type = cuda_type(out.type);
  p.d.ld = out.ld;
  if (batch.count > 1) {  // a single matrix's strides are no part of its problem
    // cuBLASLt's A is the caller's b, its B the caller's a (see map_operands).
    p.a.batch = p.b.batch = batch.count;
    p.a.stride = batch.stride_b;
    p.b.stride = batch.stride_a;
    p.d.stride = batch.stride_out;
  }
  state_->run(p, stream);
}

void CublasLtGemm::fp8_gemm(int64_t m, int64_t n, int64_t k, const Fp8Operand& a,
                            const Fp8Operand& b, const GemmOutput& out, bool fast_accumulation,
                            cudaStream_t stream) {
  const PhaseScope timed(StepPhase::Gemm, stream);
  Problem p;
  p.kind = Kind::Fp8;
  p.m = m;
  p.n = n;
  p.k = k;
  take_epilogue(p, out);
  p.a_format = a.format;
  p.b_format = b.format;
  p.a_scale_mode = a.scale_mode;
  p.b_scale_mode = b.scale_mode;
  p.a_scale = a.scale_inv;
  p.b_scale = b.scale_inv;
  p.d_scale = out.scale;
  p.amax = out.amax;
  p.fast_accumulation = fast_accumulation;

  FP8T_CHECK(m > 0 && n > 0 && k > 0, "{}: expected positive sizes", describe(p));
  for (const auto& [operand, name] : {std::pair{&a, "a"}, std::pair{&b, "b"}}) {
    FP8T_CHECK(operand->format == Fp8Format::E4M3 || operand->format == Fp8Format::E5M2,
               "{}: expected {} in e4m3 or e5m2 (cuBLASLt has no fnuz formats), found {}",
               describe(p), name, format_name(operand->format));
  }
  FP8T_CHECK(a.format == Fp8Format::E4M3 || b.format == Fp8Format::E4M3,
             "{}: cuBLASLt has no e5m2 x e5m2 GEMM; expected an e4m3 operand", describe(p));
  // Hopper's FP8 tensor cores read 16-byte K-major rows: K, the strides and the pointers must
  // be multiples of 16 bytes.
  FP8T_CHECK(k % 16 == 0, "{}: expected K to be a multiple of 16, found K={}", describe(p), k);
  for (const auto& [operand, name, rows] : {std::tuple{&a, "a", m}, std::tuple{&b, "b", n}}) {
    FP8T_CHECK(operand->data != nullptr, "{}: expected {} ([{}, {}]), found null", describe(p),
               name, rows, k);
    FP8T_CHECK(operand->ld >= k && operand->ld % 16 == 0,
               "{}: expected the leading dimension of {} >= K={} and a multiple of 16, found {}",
               describe(p), name, k, operand->ld);
    FP8T_CHECK(alignment_of(operand->data) >= 16, "{}: expected {} 16-byte aligned, found {}",
               describe(p), name, static_cast<const void*>(operand->data));
    FP8T_CHECK(operand->scale_inv != nullptr, "{}: expected {}'s scale_inv ({}), found null",
               describe(p), name, scale_mode_name(operand->scale_mode));
    FP8T_CHECK(!is_block(operand->scale_mode) || alignment_of(operand->scale_inv) >= 16,
               "{}: expected {}'s block scales 16-byte aligned, found {}", describe(p), name,
               static_cast<const void*>(operand->scale_inv));
  }
  const bool blocks = is_block(a.scale_mode) && is_block(b.scale_mode);
  FP8T_CHECK(blocks || a.scale_mode == b.scale_mode,
             "{}: expected both operands tensor-scaled, both row-wise, or both block-scaled",
             describe(p));
  FP8T_CHECK(!(a.scale_mode == ScaleMode::Block128x128 && b.scale_mode == ScaleMode::Block128x128),
             "{}: cuBLASLt has no GEMM of two 128x128-tile-scaled operands; scale one of them in "
             "1x128 blocks",
             describe(p));
  FP8T_CHECK(!blocks || (m % 4 == 0 && n % 4 == 0),
             "{}: block scales need M and N multiples of 4, found M={}, N={}", describe(p), m, n);

  check_output(out, p);
  check_addend(out, p);
  FP8T_CHECK(out.addend == nullptr || !is_fp8(out.type),
             "{}: an addend needs an f32 or bf16 output, found {}", describe(p),
             gemm_type_name(out.type));
  FP8T_CHECK(!out.accumulate || !is_fp8(out.type),
             "{}: accumulation needs an f32 or bf16 output, found {}", describe(p),
             gemm_type_name(out.type));
  const auto out_bytes = static_cast<int64_t>(gemm_type_bytes(out.type));
  FP8T_CHECK(n * out_bytes % 16 == 0 && out.ld * out_bytes % 16 == 0,
             "{}: expected N and the output's leading dimension to be multiples of 16 bytes "
             "({} {} elements), found N={}, ld={}",
             describe(p), 16 / out_bytes, gemm_type_name(out.type), n, out.ld);
  FP8T_CHECK(alignment_of(out.data) >= 16, "{}: expected the output 16-byte aligned, found {}",
             describe(p), out.data);
  if (is_fp8(out.type)) {
    FP8T_CHECK(a.scale_mode == ScaleMode::Tensor, "{}: FP8 outputs need per-tensor scaled operands",
               describe(p));
    FP8T_CHECK(out.scale != nullptr, "{}: expected the output's scale, found null", describe(p));
    FP8T_CHECK(
        out.type == GemmType::E4M3 || a.format == Fp8Format::E5M2 || b.format == Fp8Format::E5M2,
        "{}: cuBLASLt writes e5m2 only from an e5m2 operand", describe(p));
  } else {
    FP8T_CHECK(out.scale == nullptr && out.amax == nullptr,
               "{}: an output scale and amax apply to FP8 outputs only", describe(p));
  }
  FP8T_CHECK(out.bias == nullptr || out.bias_type == GemmType::BF16,
             "{}: FP8 GEMMs take a bf16 bias, found {}", describe(p),
             gemm_type_name(out.bias_type));

  map_operands(p, a.data, cuda_type(a.format), a.ld, b.data, cuda_type(b.format), b.ld);
  p.caller_a = a;
  p.caller_b = b;
  p.caller_out = out;
  p.out = out.data;
  p.d.data = out.data;
  p.d.type = cuda_type(out.type);
  p.d.ld = out.ld;
  state_->run(p, stream);
}

}  // namespace fp8t::gemm

#endif  // FP8TRAIN_WITH_CUDA
