// cuBLASLt GEMMs against the CPU GEMM (float64) of the same operands: BF16 in its three forms
// (single and in strided batches, accumulating into f32 or bf16), FP8 with per-tensor, row-wise
// and block scales. Inputs are fresh random draws (replay a
// failure with the FP8T_TEST_SEED the failure prints); outputs are poisoned with NaN before
// each call, so unwritten elements show, and padding beyond the output's columns must stay
// poisoned. Every comparison prints its measured error ("[ measured ]"), and the block-scaled
// test prints which modes this cuBLASLt accepts on this GPU ("[ support  ]").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "../numerics/test_util.h"
#include "../test_files.h"
#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "gemm/block_gemm_sm90.h"
#include "gemm/cpu_gemm.h"
#include "gemm/cublaslt_gemm.h"
#include "gemm/output_difference.h"
#include "numerics/quantize.h"
#include "numerics/scaling.h"

namespace fp8t::gemm {
namespace {

using test::TestRng;

// ‖out − ref‖ / ‖ref‖ bounds, the reference being the exact (float64) product of the operands
// the GPU reads.
// BF16 products are exact in fp32 and the sums are fp32: rounding grows like sqrt(K)·2^-24,
// about 5e-6 at K = 6144 even for plain recursive summation; one seed in a few dozen reached
// 1.01e-5 there (H200, 2026-11-30), so the bound is 4x the estimate. A wrong layout gives O(1).
constexpr double kF32Bound = 2e-5;
// A bf16 output rounds each element by up to 2^-9 relative.
constexpr double kBf16OutBound = 1e-2;
// Hopper's FP8 tensor cores add products with about 14 bits kept (DeepSeek-V3 report, §3.3.2),
// so even fp32 outputs are not fp32-accurate. Without fast accumulation cuBLASLt promotes the
// partial sums to fp32 every few K-blocks, which bounds the loss near 2^-14 per block;
// 2e-3 leaves a margin of ~10x over that estimate. With fast accumulation the partial sums are
// never promoted and the loss grows with K: DeepSeek measured ~2 % (max relative) at K = 4096.
// A wrong layout or scale gives errors of order 1, far above both bounds. Measured on the H200
// (cuBLASLt 13.1, 2026-11-29), fp32 outputs, K up to 6144: at most 1.6e-4 without fast
// accumulation and 2.2e-3 with it.
constexpr double kFp8Bound = 2e-3;
constexpr double kFp8FastBound = 1e-2;

double fp8_bound(GemmType out_type, bool fast_accumulation) {
  const double accumulation = fast_accumulation ? kFp8FastBound : kFp8Bound;
  return out_type == GemmType::F32 ? accumulation : std::max(accumulation, kBf16OutBound);
}

struct Shape {
  int64_t m;
  int64_t n;
  int64_t k;
};

std::string text(const Shape& shape) {
  return "M=" + std::to_string(shape.m) + " N=" + std::to_string(shape.n) +
         " K=" + std::to_string(shape.k);
}

Fp8Format format_of(GemmType type) {
  return type == GemmType::E5M2 ? Fp8Format::E5M2 : Fp8Format::E4M3;
}

// Normal values whose magnitudes vary by row and by 128-column block (2^-3 to 2^3), so that
// per-tensor, row-wise and block scales all differ.
std::vector<float> random_values(TestRng& rng, int64_t rows, int64_t cols) {
  std::normal_distribution<float> normal;
  std::vector<int> row_exponent(static_cast<size_t>(rows));
  std::vector<int> block_exponent(static_cast<size_t>((cols + 127) / 128));
  for (int& e : row_exponent)
    e = rng.uniform_int(-3, 3);
  for (int& e : block_exponent)
    e = rng.uniform_int(-3, 3);
  std::vector<float> values(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      values[r * cols + c] =
          std::ldexp(normal(rng.engine()), row_exponent[r] + block_exponent[c / 128]);
    }
  }
  return values;
}

// A bf16 matrix [rows, cols] with row stride ld (padding zero), and its values.
struct Bf16Matrix {
  std::vector<bf16> data;
  std::vector<double> values;  // [rows, cols]
};

Bf16Matrix random_bf16(TestRng& rng, int64_t rows, int64_t cols, int64_t ld) {
  const std::vector<float> x = random_values(rng, rows, cols);
  Bf16Matrix matrix{std::vector<bf16>(static_cast<size_t>(rows * ld), bf16{0}),
                    std::vector<double>(static_cast<size_t>(rows * cols))};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const bf16 value = float_to_bf16(x[r * cols + c]);
      matrix.data[r * ld + c] = value;
      matrix.values[r * cols + c] = bf16_to_float(value);
    }
  }
  return matrix;
}

// Values exactly representable in `type` (f32 or bf16), and their bytes.
std::vector<double> random_exact(TestRng& rng, size_t count, GemmType type) {
  std::vector<double> values(count);
  for (double& value : values) {
    const float x = static_cast<float>(rng.uniform(-4.0, 4.0));
    value = type == GemmType::BF16 ? bf16_to_float(float_to_bf16(x)) : x;
  }
  return values;
}

std::vector<uint8_t> to_bytes(const std::vector<double>& values, GemmType type) {
  std::vector<uint8_t> bytes(values.size() * gemm_type_bytes(type));
  for (size_t i = 0; i < values.size(); ++i) {
    if (type == GemmType::BF16) {
      const bf16 value = float_to_bf16(static_cast<float>(values[i]));
      std::memcpy(&bytes[2 * i], &value, 2);
    } else {
      const float value = static_cast<float>(values[i]);
      std::memcpy(&bytes[4 * i], &value, 4);
    }
  }
  return bytes;
}

// An output [rows, cols] with row stride ld in device memory, of any GEMM output type.
class DeviceOutput {
 public:
  DeviceOutput(GemmType type, int64_t rows, int64_t cols, int64_t ld)
      : type_(type), rows_(rows), cols_(cols), ld_(ld), bytes_(rows * ld * gemm_type_bytes(type)) {
    fill_nan();
  }

  // NaN in every element, padding included.
  void fill_nan() {
    const size_t size = gemm_type_bytes(type_);
    std::vector<uint8_t> host(bytes_.count());
    for (size_t i = 0; i < host.size(); i += size) {
      if (type_ == GemmType::F32) {
        const uint32_t nan = 0x7FC00000u;
        std::memcpy(&host[i], &nan, 4);
      } else if (type_ == GemmType::BF16) {
        const uint16_t nan = 0x7FC0u;
        std::memcpy(&host[i], &nan, 2);
      } else {
        host[i] = 0x7F;  // NaN in E4M3 and in E5M2
      }
    }
    bytes_.upload(host.data());
  }

  // Sets the elements (f32 or bf16 outputs) to `values` [rows, cols]; the padding stays NaN.
  void set(const std::vector<double>& values) {
    fill_nan();
    std::vector<uint8_t> host(bytes_.count());
    FP8T_CUDA_CHECK(cudaMemcpy(host.data(), bytes_.get(), host.size(), cudaMemcpyDeviceToHost));
    for (int64_t r = 0; r < rows_; ++r) {
      const std::vector<double> row(values.begin() + r * cols_, values.begin() + (r + 1) * cols_);
      const std::vector<uint8_t> row_bytes = to_bytes(row, type_);
      std::memcpy(&host[r * ld_ * gemm_type_bytes(type_)], row_bytes.data(), row_bytes.size());
    }
    bytes_.upload(host.data());
  }

  // The elements [rows, cols] as doubles (FP8 codes decoded).
  std::vector<double> values() const {
    const std::vector<uint8_t> host = bytes_.download();
    std::vector<double> result(static_cast<size_t>(rows_ * cols_));
    for (int64_t r = 0; r < rows_; ++r) {
      for (int64_t c = 0; c < cols_; ++c)
        result[r * cols_ + c] = element(host, r * ld_ + c);
    }
    return result;
  }

  std::vector<uint8_t> codes() const {  // FP8 outputs: the codes [rows, cols]
    const std::vector<uint8_t> host = bytes_.download();
    std::vector<uint8_t> result(static_cast<size_t>(rows_ * cols_));
    for (int64_t r = 0; r < rows_; ++r)
      std::copy_n(&host[r * ld_], cols_, &result[r * cols_]);
    return result;
  }

  // Padding elements (columns cols..ld-1) that are no longer NaN: the GEMM wrote past its output.
  int64_t written_padding() const {
    const std::vector<uint8_t> host = bytes_.download();
    int64_t written = 0;
    for (int64_t r = 0; r < rows_; ++r) {
      for (int64_t c = cols_; c < ld_; ++c)
        written += std::isnan(element(host, r * ld_ + c)) ? 0 : 1;
    }
    return written;
  }

  GemmOutput view(bool accumulate = false) const {
    GemmOutput out;
    out.data = bytes_.get();
    out.ld = ld_;
    out.type = type_;
    out.accumulate = accumulate;
    return out;
  }

 private:
  double element(const std::vector<uint8_t>& host, int64_t index) const {
    const size_t offset = static_cast<size_t>(index) * gemm_type_bytes(type_);
    if (type_ == GemmType::F32) {
      float value;
      std::memcpy(&value, &host[offset], 4);
      return value;
    }
    if (type_ == GemmType::BF16) {
      bf16 value;
      std::memcpy(&value, &host[offset], 2);
      return bf16_to_float(value);
    }
    return decode(host[offset], format_of(type_));
  }

  GemmType type_;
  int64_t rows_, cols_, ld_;
  DeviceBuffer<uint8_t> bytes_;
};

struct Errors {
  double relative = 0;     // ‖out − ref‖ / ‖ref‖; inf when an element is not finite
  int64_t non_finite = 0;  // NaN or inf outputs (poison left unwritten shows here)
  int64_t worst = -1;      // index of the largest |out − ref|
  double worst_out = 0, worst_ref = 0;
  int64_t mismatches = 0;  // elements with out != ref exactly
};

Errors compare(const std::vector<double>& out, const std::vector<double>& ref) {
  Errors errors;
  double diff2 = 0, ref2 = 0, worst_diff = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    ref2 += ref[i] * ref[i];
    if (!std::isfinite(out[i])) {
      if (errors.non_finite++ == 0) errors.worst = static_cast<int64_t>(i);
      continue;
    }
    const double diff = out[i] - ref[i];
    errors.mismatches += diff != 0 ? 1 : 0;
    diff2 += diff * diff;
    if (std::fabs(diff) > worst_diff && errors.non_finite == 0) {
      worst_diff = std::fabs(diff);
      errors.worst = static_cast<int64_t>(i);
    }
  }
  errors.relative = errors.non_finite > 0 ? std::numeric_limits<double>::infinity()
                                          : std::sqrt(diff2 / std::max(ref2, 1e-300));
  if (errors.worst >= 0) {
    errors.worst_out = out[errors.worst];
    errors.worst_ref = ref[errors.worst];
  }
  return errors;
}

// Compares, prints the measured error, and fails with the details when it exceeds `bound`.
void check(const std::vector<double>& out, const std::vector<double>& ref, int64_t cols,
           double bound, const std::string& what) {
  const Errors errors = compare(out, ref);
  std::printf("[ measured ] %s: |out - ref|/|ref| = %.3g (bound %.3g)\n", what.c_str(),
              errors.relative, bound);
  EXPECT_LE(errors.relative, bound)
      << what << ": " << errors.non_finite << " non-finite outputs; worst element [row "
      << errors.worst / cols << ", col " << errors.worst % cols << "]: out " << errors.worst_out
      << ", ref " << errors.worst_ref;
}

void check_padding(const DeviceOutput& out, const std::string& what) {
  EXPECT_EQ(out.written_padding(), 0) << what << ": the GEMM wrote into the output's padding";
}

std::vector<double> xwt_reference(const Shape& s, const std::vector<double>& a,
                                  const std::vector<double>& b) {
  std::vector<double> ref(static_cast<size_t>(s.m * s.n));
  forward_xwt(s.m, s.n, s.k, a.data(), s.k, b.data(), s.k, ref.data(), s.n, false);
  return ref;
}

void add_bias(std::vector<double>& ref, const std::vector<double>& bias) {
  for (size_t i = 0; i < ref.size(); ++i)
    ref[i] += bias[i % bias.size()];
}

// ---- FP8 operands ----

// An FP8 operand [rows, K] as the GEMM reads it (codes with row stride ld, scale_inv in the
// GEMM's layout) and the values it stands for.
struct HostOperand {
  int64_t rows = 0, k = 0, ld = 0;
  Fp8Format format = Fp8Format::E4M3;
  ScaleMode mode = ScaleMode::Tensor;
  std::vector<uint8_t> codes;    // [rows, ld]
  std::vector<float> scale_inv;  // scale_count(mode, rows, k) values
  std::vector<double> values;    // dequantized, [rows, k]
};

HostOperand empty_operand(int64_t rows, int64_t k, int64_t ld, Fp8Format format, ScaleMode mode) {
  HostOperand op;
  op.rows = rows;
  op.k = k;
  op.ld = ld;
  op.format = format;
  op.mode = mode;
  op.codes.assign(static_cast<size_t>(rows * ld), 0);
  op.scale_inv.assign(static_cast<size_t>(scale_count(mode, rows, k)), 0.0f);
  op.values.assign(static_cast<size_t>(rows * k), 0.0);
  return op;
}

// The index in scale_inv of element (r, c)'s scale.
int64_t scale_index(const HostOperand& op, int64_t r, int64_t c) {
  const int64_t k_blocks = (op.k + 127) / 128;
  switch (op.mode) {
    case ScaleMode::Tensor:
      return 0;
    case ScaleMode::Row:
      return r;
    case ScaleMode::Block1x128:
      return (c / 128) * op.rows + r;
    case ScaleMode::Block128x128:
      return (r / 128) * ((k_blocks + 3) / 4 * 4) + c / 128;
  }
  return 0;
}

void fill_values(HostOperand& op) {
  for (int64_t r = 0; r < op.rows; ++r) {
    for (int64_t c = 0; c < op.k; ++c) {
      op.values[r * op.k + c] = double(decode(op.codes[r * op.ld + c], op.format)) *
                                double(op.scale_inv[scale_index(op, r, c)]);
    }
  }
}

// Quantizes x [rows, k] with the CPU reference of quantize.h: per-tensor and row-wise scales
// by current scaling (scale_from_amax), blocks by quantize_blocks() (power-of-2 scales).
HostOperand quantize_operand(const std::vector<float>& x, int64_t rows, int64_t k, int64_t ld,
                             Fp8Format format, ScaleMode mode) {
  HostOperand op = empty_operand(rows, k, ld, format, mode);
  const float top = format_max(format);
  if (mode == ScaleMode::Tensor || mode == ScaleMode::Row) {
    const float tensor_amax = amax(x.data(), rows * k);
    for (int64_t r = 0; r < rows; ++r) {
      const float row_amax = mode == ScaleMode::Row ? amax(x.data() + r * k, k) : tensor_amax;
      const float scale = scale_from_amax(row_amax, top, false, 0.0f);
      quantize(x.data() + r * k, k, scale, format, op.codes.data() + r * ld, nullptr);
      op.scale_inv[mode == ScaleMode::Row ? r : 0] = 1.0f / scale;
    }
  } else {
    const BlockScaling scaling =
        mode == ScaleMode::Block1x128 ? BlockScaling::Rows1x128 : BlockScaling::Tile128x128;
    const BlockQuantization spec{scaling, format, true, 0.0f};
    const BlockShape grid = scale_grid(scaling, rows, k);
    std::vector<uint8_t> dense(static_cast<size_t>(rows * k));
    std::vector<float> scales(static_cast<size_t>(grid.rows * grid.cols));
    quantize_blocks(x.data(), rows, k, spec, dense.data(), scales.data());
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(&dense[r * k], k, &op.codes[r * ld]);
    // From quantize_blocks()' row-major grid to the GEMM's layout (see ScaleMode).
    for (int64_t gr = 0; gr < grid.rows; ++gr) {
      for (int64_t gc = 0; gc < grid.cols; ++gc) {
        op.scale_inv[scale_index(op, gr * block_shape(scaling).rows, gc * 128)] =
            scales[gr * grid.cols + gc];
      }
    }
  }
  fill_values(op);
  return op;
}

// Small integers (|v| <= 4, exact in E4M3 and E5M2) times power-of-2 scales (2^-1 .. 2^1): every
// product, every 128-long partial sum and the whole sum are exact in 14 bits and in fp32, so a
// GEMM that promotes its partial sums (no fast accumulation) must give the exact result.
HostOperand integer_operand(TestRng& rng, int64_t rows, int64_t k, Fp8Format format,
                            ScaleMode mode) {
  HostOperand op = empty_operand(rows, k, k, format, mode);
  for (float& scale : op.scale_inv)
    scale = std::ldexp(1.0f, rng.uniform_int(-1, 1));
  for (uint8_t& code : op.codes)
    code =
        encode_reference(static_cast<float>(rng.uniform_int(-4, 4)), format, Saturation::Saturate);
  fill_values(op);
  return op;
}

struct DeviceOperand {
  explicit DeviceOperand(const HostOperand& host)
      : codes(host.codes),
        scales(host.scale_inv),
        format(host.format),
        mode(host.mode),
        ld(host.ld) {}
  Fp8Operand view() const {
    Fp8Operand op;
    op.data = codes.get();
    op.ld = ld;
    op.format = format;
    op.scale_mode = mode;
    op.scale_inv = scales.get();
    return op;
  }
  DeviceBuffer<uint8_t> codes;
  DeviceBuffer<float> scales;
  Fp8Format format;
  ScaleMode mode;
  int64_t ld;
};

std::string fp8_text(const Shape& shape, const HostOperand& a, const HostOperand& b,
                     GemmType out_type, bool fast) {
  return std::string("FP8 ") + text(shape) + " a " + std::string(format_name(a.format)) + " (" +
         scale_mode_name(a.mode) + ") b " + std::string(format_name(b.format)) + " (" +
         scale_mode_name(b.mode) + ") out " + gemm_type_name(out_type) + " fast accumulation " +
         (fast ? "on" : "off");
}

// Runs a·bᵀ in FP8 and waits for it: "" when it ran, else cuBLASLt's refusal (the error message).
std::string try_fp8_gemm(CublasLtGemm& gemm, const Shape& s, const DeviceOperand& a,
                         const DeviceOperand& b, const DeviceOutput& out, bool fast,
                         cudaStream_t stream) {
  try {
    gemm.fp8_gemm(s.m, s.n, s.k, a.view(), b.view(), out.view(), fast, stream);
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
    return "";
  } catch (const Error& error) {
    return error.what();
  }
}

// Random operands a [M, K] and b [N, K], E4M3 scaled per tensor.
std::pair<HostOperand, HostOperand> random_e4m3_operands(TestRng& rng, const Shape& s) {
  return {quantize_operand(random_values(rng, s.m, s.k), s.m, s.k, s.k, Fp8Format::E4M3,
                           ScaleMode::Tensor),
          quantize_operand(random_values(rng, s.n, s.k), s.n, s.k, s.k, Fp8Format::E4M3,
                           ScaleMode::Tensor)};
}

class CublasLtGemmTest : public ::testing::Test {
 protected:
  void SetUp() override { FP8T_CUDA_CHECK(cudaStreamCreate(&stream_)); }
  void TearDown() override { cudaStreamDestroy(stream_); }

  // Runs a·bᵀ in FP8 and compares with the float64 product of the dequantized operands.
  void run_fp8(const Shape& shape, const HostOperand& a, const HostOperand& b, GemmType out_type,
               bool fast, const std::vector<double>& ref, int64_t out_ld) {
    const std::string what = fp8_text(shape, a, b, out_type, fast);
    const DeviceOperand device_a(a), device_b(b);
    DeviceOutput out(out_type, shape.m, shape.n, out_ld);
    const std::string refusal = try_fp8_gemm(gemm_, shape, device_a, device_b, out, fast, stream_);
    if (!refusal.empty()) {
      ADD_FAILURE() << what << ": " << refusal;
      return;
    }
    check(out.values(), ref, shape.n, fp8_bound(out_type, fast), what);
    check_padding(out, what);
  }

  TestRng rng_;
  cudaStream_t stream_ = nullptr;
  CublasLtGemm gemm_;
};

// ---- BF16 ----

constexpr Shape kBf16Shapes[] = {{48, 80, 32}, {33, 17, 45}, {256, 512, 1024}, {1024, 1536, 6144}};

TEST_F(CublasLtGemmTest, ReportsLibraryAndDevice) {
  std::printf("[ device   ] %s, cuBLASLt %s\n", gemm_.architecture().c_str(),
              CublasLtGemm::library_version().c_str());
  EXPECT_EQ(gemm_.counters().heuristic_queries, 0);
  EXPECT_EQ(gemm_.cached_problems(), 0u);
}

TEST_F(CublasLtGemmTest, Bf16ForwardMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (size_t index = 0; index < std::size(kBf16Shapes); ++index) {
    const Shape s = kBf16Shapes[index];
    const bool padded = index % 2 == 0;  // row strides beyond the row lengths
    const int64_t ldx = padded ? s.k + 8 : s.k, ldw = padded ? s.k + 24 : s.k;
    const Bf16Matrix x = random_bf16(rng_, s.m, s.k, ldx);
    const Bf16Matrix w = random_bf16(rng_, s.n, s.k, ldw);
    const DeviceBuffer<bf16> device_x(x.data), device_w(w.data);
    const std::vector<double> product = xwt_reference(s, x.values, w.values);
    for (GemmType out_type : {GemmType::F32, GemmType::BF16}) {
      for (bool with_bias : {false, true}) {
        const std::string what = std::string("BF16 forward ") + text(s) + " out " +
                                 gemm_type_name(out_type) + (with_bias ? " + bias" : "") +
                                 (padded ? " (padded strides)" : "");
        const std::vector<double> bias = random_exact(rng_, static_cast<size_t>(s.n), out_type);
        const DeviceBuffer<uint8_t> device_bias(to_bytes(bias, out_type));
        DeviceOutput out(out_type, s.m, s.n, padded ? s.n + 8 : s.n);
        GemmOutput view = out.view();
        if (with_bias) {
          view.bias = device_bias.get();
          view.bias_type = out_type;
        }
        gemm_.bf16_gemm(Bf16Form::XWt, s.m, s.n, s.k, device_x.get(), ldx, device_w.get(), ldw,
                        view, stream_);
        std::vector<double> ref = product;
        if (with_bias) add_bias(ref, bias);
        check(out.values(), ref, s.n, out_type == GemmType::F32 ? kF32Bound : kBf16OutBound, what);
        check_padding(out, what);
      }
    }
  }
}

TEST_F(CublasLtGemmTest, Bf16DgradMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const Shape s : kBf16Shapes) {
    const Bf16Matrix dy = random_bf16(rng_, s.m, s.n, s.n);
    const Bf16Matrix w = random_bf16(rng_, s.n, s.k, s.k);
    const DeviceBuffer<bf16> device_dy(dy.data), device_w(w.data);
    std::vector<double> ref(static_cast<size_t>(s.m * s.k), 0.0);
    dgrad_dyw(s.m, s.n, s.k, dy.values.data(), s.n, w.values.data(), s.k, ref.data(), s.k);
    for (GemmType out_type : {GemmType::F32, GemmType::BF16}) {
      const std::string what =
          std::string("BF16 dgrad dx = dy·W ") + text(s) + " out " + gemm_type_name(out_type);
      DeviceOutput out(out_type, s.m, s.k, s.k + 8);
      gemm_.bf16_gemm(Bf16Form::DyW, s.m, s.n, s.k, device_dy.get(), s.n, device_w.get(), s.k,
                      out.view(), stream_);
      check(out.values(), ref, s.k, out_type == GemmType::F32 ? kF32Bound : kBf16OutBound, what);
      check_padding(out, what);
    }
  }
}

// Weight gradients accumulate over micro-batches: dW starts from existing values and takes two
// products in turn.
TEST_F(CublasLtGemmTest, Bf16WgradAccumulatesIntoFp32) {
  SCOPED_TRACE(rng_.trace());
  for (const Shape s : kBf16Shapes) {
    const std::string what = std::string("BF16 wgrad dW += dyᵀ·x, two micro-batches ") + text(s);
    std::vector<double> ref = random_exact(rng_, static_cast<size_t>(s.n * s.k), GemmType::F32);
    DeviceOutput dw(GemmType::F32, s.n, s.k, s.k + 4);
    dw.set(ref);
    for (int micro_batch = 0; micro_batch < 2; ++micro_batch) {
      const Bf16Matrix dy = random_bf16(rng_, s.m, s.n, s.n);
      const Bf16Matrix x = random_bf16(rng_, s.m, s.k, s.k);
      const DeviceBuffer<bf16> device_dy(dy.data), device_x(x.data);
      wgrad_dytx(s.m, s.n, s.k, dy.values.data(), s.n, x.values.data(), s.k, ref.data(), s.k);
      gemm_.bf16_gemm(Bf16Form::DytX, s.m, s.n, s.k, device_dy.get(), s.n, device_x.get(), s.k,
                      dw.view(/*accumulate=*/true), stream_);
      FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the inputs die with this iteration
    }
    check(dw.values(), ref, s.k, kF32Bound, what);
    check_padding(dw, what);
  }
}

TEST_F(CublasLtGemmTest, Bf16ForwardAccumulatesWithBias) {
  SCOPED_TRACE(rng_.trace());
  const Shape s{256, 512, 1024};
  const Bf16Matrix x = random_bf16(rng_, s.m, s.k, s.k);
  const Bf16Matrix w = random_bf16(rng_, s.n, s.k, s.k);
  const DeviceBuffer<bf16> device_x(x.data), device_w(w.data);
  const std::vector<double> bias = random_exact(rng_, static_cast<size_t>(s.n), GemmType::F32);
  const DeviceBuffer<uint8_t> device_bias(to_bytes(bias, GemmType::F32));
  std::vector<double> ref = random_exact(rng_, static_cast<size_t>(s.m * s.n), GemmType::F32);
  DeviceOutput out(GemmType::F32, s.m, s.n, s.n);
  out.set(ref);
  GemmOutput view = out.view(/*accumulate=*/true);
  view.bias = device_bias.get();
  view.bias_type = GemmType::F32;
  gemm_.bf16_gemm(Bf16Form::XWt, s.m, s.n, s.k, device_x.get(), s.k, device_w.get(), s.k, view,
                  stream_);
  const std::vector<double> product = xwt_reference(s, x.values, w.values);
  for (size_t i = 0; i < ref.size(); ++i)
    ref[i] += product[i] + bias[i % bias.size()];
  check(out.values(), ref, s.n, kF32Bound, "BF16 forward y += x·Wᵀ + bias " + text(s));
}

// A BF16 output accumulates: out = bf16(out + a·bᵀ), the fp32 sum rounded once. The prior
// values are of the product's size, so that a GEMM ignoring them misses by far more than the
// bound.
TEST_F(CublasLtGemmTest, Bf16AccumulatesIntoBf16) {
  SCOPED_TRACE(rng_.trace());
  const Shape s{256, 512, 1024};
  const Bf16Matrix x = random_bf16(rng_, s.m, s.k, s.k);
  const Bf16Matrix w = random_bf16(rng_, s.n, s.k, s.k);
  const DeviceBuffer<bf16> device_x(x.data), device_w(w.data);
  const std::vector<double> product = xwt_reference(s, x.values, w.values);
  std::vector<double> ref(product.size());
  for (size_t i = 0; i < ref.size(); ++i)
    ref[i] = bf16_to_float(float_to_bf16(static_cast<float>(product[i] * rng_.uniform(-1, 1))));
  DeviceOutput out(GemmType::BF16, s.m, s.n, s.n + 8);
  out.set(ref);
  gemm_.bf16_gemm(Bf16Form::XWt, s.m, s.n, s.k, device_x.get(), s.k, device_w.get(), s.k,
                  out.view(/*accumulate=*/true), stream_);
  for (size_t i = 0; i < ref.size(); ++i)
    ref[i] += product[i];
  const std::string what = "BF16 forward y += x·Wᵀ into bf16 " + text(s);
  check(out.values(), ref, s.n, kBf16OutBound, what);
  check_padding(out, what);
}

// The row-major shapes of a BF16 GEMM's operands and output, per form.
struct Bf16Shapes {
  int64_t a_rows, a_cols, b_rows, b_cols, out_rows, out_cols;
};

Bf16Shapes bf16_shapes(Bf16Form form, const Shape& s) {
  switch (form) {
    case Bf16Form::XWt:
      return {s.m, s.k, s.n, s.k, s.m, s.n};
    case Bf16Form::DyW:
      return {s.m, s.n, s.n, s.k, s.m, s.k};
    case Bf16Form::DytX:
      return {s.m, s.n, s.m, s.k, s.n, s.k};
  }
  return {};
}

// The float64 product of one matrix of each operand, in the form's result shape.
std::vector<double> bf16_reference(Bf16Form form, const Shape& s, const std::vector<double>& a,
                                   const std::vector<double>& b) {
  const Bf16Shapes shapes = bf16_shapes(form, s);
  std::vector<double> out(static_cast<size_t>(shapes.out_rows * shapes.out_cols), 0.0);
  switch (form) {
    case Bf16Form::XWt:
      forward_xwt(s.m, s.n, s.k, a.data(), s.k, b.data(), s.k, out.data(), s.n, false);
      break;
    case Bf16Form::DyW:
      dgrad_dyw(s.m, s.n, s.k, a.data(), s.n, b.data(), s.k, out.data(), s.k);
      break;
    case Bf16Form::DytX:
      wgrad_dytx(s.m, s.n, s.k, a.data(), s.n, b.data(), s.k, out.data(), s.k);
      break;
  }
  return out;
}

// `count` random matrices [rows, cols] stacked `stride` elements apart (the gaps zero); a stride
// of 0 gives one matrix that stands for all of them.
struct Bf16Stack {
  std::vector<bf16> data;
  std::vector<std::vector<double>> values;  // per matrix of the batch
};

Bf16Stack random_stack(TestRng& rng, int64_t count, int64_t rows, int64_t cols, int64_t stride) {
  Bf16Stack stack;
  const int64_t stored = stride == 0 ? 1 : count;
  stack.data.assign(static_cast<size_t>(std::max<int64_t>(stride, rows * cols) * stored), bf16{0});
  for (int64_t index = 0; index < stored; ++index) {
    const Bf16Matrix matrix = random_bf16(rng, rows, cols, cols);
    std::copy(matrix.data.begin(), matrix.data.end(), stack.data.begin() + index * stride);
    stack.values.push_back(matrix.values);
  }
  stack.values.resize(static_cast<size_t>(count), stack.values.front());
  return stack;
}

// Strided batches in the three forms: each matrix against the CPU product of its operands. The
// operands' strides leave gaps (matrices 16-byte aligned, or 2-byte for odd sizes), one case
// shares b across the batch (stride 0), and the output keeps two rows of NaN between matrices,
// which must stay NaN.
TEST_F(CublasLtGemmTest, Bf16BatchedMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  constexpr int64_t kBatch = 3;
  constexpr int64_t kGapRows = 2;
  const Shape shapes[] = {{48, 80, 32}, {33, 17, 45}, {128, 128, 512}};
  for (const Shape s : shapes) {
    for (Bf16Form form : {Bf16Form::XWt, Bf16Form::DyW, Bf16Form::DytX}) {
      for (bool shared_b : {false, true}) {
        const Bf16Shapes shape = bf16_shapes(form, s);
        const int64_t stride_a = shape.a_rows * shape.a_cols + 40;
        const int64_t stride_b = shared_b ? 0 : shape.b_rows * shape.b_cols + 24;
        const Bf16Stack a = random_stack(rng_, kBatch, shape.a_rows, shape.a_cols, stride_a);
        const Bf16Stack b = random_stack(rng_, kBatch, shape.b_rows, shape.b_cols, stride_b);
        const DeviceBuffer<bf16> device_a(a.data), device_b(b.data);
        for (GemmType out_type : {GemmType::F32, GemmType::BF16}) {
          const std::string what = std::string("BF16 batch of ") + std::to_string(kBatch) + " " +
                                   bf16_form_name(form) + " " + text(s) + " out " +
                                   gemm_type_name(out_type) + (shared_b ? ", b shared" : "");
          const int64_t rows_apart = shape.out_rows + kGapRows;
          DeviceOutput out(out_type, kBatch * rows_apart, shape.out_cols, shape.out_cols);
          const GemmBatch batch{kBatch, stride_a, stride_b, rows_apart * shape.out_cols};
          gemm_.bf16_gemm(form, s.m, s.n, s.k, device_a.get(), shape.a_cols, device_b.get(),
                          shape.b_cols, out.view(), batch, stream_);
          const std::vector<double> values = out.values();
          for (int64_t index = 0; index < kBatch; ++index) {
            const auto first = values.begin() + index * rows_apart * shape.out_cols;
            const std::vector<double> matrix(first, first + shape.out_rows * shape.out_cols);
            const std::vector<double> ref =
                bf16_reference(form, s, a.values[static_cast<size_t>(index)],
                               b.values[static_cast<size_t>(index)]);
            check(matrix, ref, shape.out_cols,
                  out_type == GemmType::F32 ? kF32Bound : kBf16OutBound,
                  what + ", matrix " + std::to_string(index));
            const int64_t gap_nan = std::count_if(first + shape.out_rows * shape.out_cols,
                                                  first + rows_apart * shape.out_cols,
                                                  [](double value) { return std::isnan(value); });
            EXPECT_EQ(gap_nan, kGapRows * shape.out_cols)
                << what << ": the GEMM wrote between matrices " << index << " and " << index + 1;
          }
        }
      }
    }
  }
}

// A batch with an addend, as Polar Express's B = c·A² + b·A and X' = B·X + a·X use it: out =
// bf16(result_scale·a·b + addend_scale·addend), summed in fp32 and rounded once. The addend is of
// the product's size, so that a GEMM ignoring it or its scale misses by far more than the bound;
// it stays as it was, and the rows between the output's matrices stay NaN.
TEST_F(CublasLtGemmTest, Bf16BatchedAddsAScaledAddend) {
  SCOPED_TRACE(rng_.trace());
  constexpr int64_t kBatch = 3;
  constexpr int64_t kGapRows = 2;
  constexpr float kResultScale = -1.75f, kAddendScale = 3.5f;
  for (const Shape s : {Shape{64, 64, 64}, Shape{96, 32, 32}}) {
    const Bf16Shapes shape = bf16_shapes(Bf16Form::DyW, s);
    const int64_t stride_a = shape.a_rows * shape.a_cols, stride_b = shape.b_rows * shape.b_cols;
    const Bf16Stack a = random_stack(rng_, kBatch, shape.a_rows, shape.a_cols, stride_a);
    const Bf16Stack b = random_stack(rng_, kBatch, shape.b_rows, shape.b_cols, stride_b);
    const DeviceBuffer<bf16> device_a(a.data), device_b(b.data);
    const int64_t rows_apart = shape.out_rows + kGapRows, out_count = rows_apart * shape.out_cols;
    DeviceOutput out(GemmType::BF16, kBatch * rows_apart, shape.out_cols, shape.out_cols);
    DeviceOutput addend(GemmType::BF16, kBatch * rows_apart, shape.out_cols, shape.out_cols);
    std::vector<double> addend_values(static_cast<size_t>(kBatch * out_count), 0.0);
    std::vector<std::vector<double>> products;
    for (int64_t index = 0; index < kBatch; ++index) {
      products.push_back(bf16_reference(Bf16Form::DyW, s, a.values[static_cast<size_t>(index)],
                                        b.values[static_cast<size_t>(index)]));
      for (size_t i = 0; i < products.back().size(); ++i) {
        const auto value = static_cast<float>(products.back()[i] * rng_.uniform(-1, 1));
        addend_values[static_cast<size_t>(index * out_count) + i] =
            bf16_to_float(float_to_bf16(value));
      }
    }
    addend.set(addend_values);
    GemmOutput view = out.view();
    view.addend = addend.view().data;
    view.result_scale = kResultScale;
    view.addend_scale = kAddendScale;
    gemm_.bf16_gemm(Bf16Form::DyW, s.m, s.n, s.k, device_a.get(), shape.a_cols, device_b.get(),
                    shape.b_cols, view, GemmBatch{kBatch, stride_a, stride_b, out_count}, stream_);
    const std::vector<double> values = out.values();
    const std::string what = "BF16 batch c·a·b + d·addend " + text(s);
    for (int64_t index = 0; index < kBatch; ++index) {
      const auto first = values.begin() + index * out_count;
      const std::vector<double> matrix(first, first + shape.out_rows * shape.out_cols);
      std::vector<double> ref = products[static_cast<size_t>(index)];
      for (size_t i = 0; i < ref.size(); ++i) {
        ref[i] = kResultScale * ref[i] +
                 kAddendScale * addend_values[static_cast<size_t>(index * out_count) + i];
      }
      check(matrix, ref, shape.out_cols, kBf16OutBound, what + ", matrix " + std::to_string(index));
      EXPECT_EQ(std::count_if(first + shape.out_rows * shape.out_cols, first + out_count,
                              [](double value) { return std::isnan(value); }),
                kGapRows * shape.out_cols)
          << what << ": the GEMM wrote between matrices " << index << " and " << index + 1;
    }
    const std::vector<double> addend_after = addend.values();
    for (size_t i = 0; i < addend_after.size(); ++i)
      ASSERT_EQ(addend_after[i], addend_values[i]) << what << ": the addend changed at " << i;
  }
}

// The batch (count and strides) is part of the problem a plan is cached for.
TEST_F(CublasLtGemmTest, BatchIsPartOfTheCachedProblem) {
  CublasLtGemm gemm;
  const Shape s{64, 64, 64};
  const DeviceBuffer<bf16> operands(static_cast<size_t>(4 * s.m * s.k));
  const DeviceOutput out(GemmType::F32, 4 * s.m, s.n, s.n);
  const auto run = [&](int64_t count, int64_t stride) {
    gemm.bf16_gemm(Bf16Form::XWt, s.m, s.n, s.k, operands.get(), s.k, operands.get(), s.k,
                   out.view(), GemmBatch{count, stride, stride, s.m * s.n}, stream_);
  };
  run(2, s.m * s.k);
  run(2, s.m * s.k);
  EXPECT_EQ(gemm.counters().heuristic_queries, 1);
  EXPECT_EQ(gemm.counters().cache_hits, 1);
  run(3, s.m * s.k);
  run(2, 2 * s.m * s.k);
  EXPECT_EQ(gemm.counters().heuristic_queries, 3);
  EXPECT_EQ(gemm.cached_problems(), 3u);
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// ---- FP8 ----

constexpr Shape kFp8Shapes[] = {{48, 80, 32}, {40, 48, 144}, {256, 512, 1024}, {1024, 1536, 6144}};

struct FormatPair {
  Fp8Format a;
  Fp8Format b;
};
// E4M3 everywhere, and the hybrid recipe's gradients (E5M2) on either side.
constexpr FormatPair kFormatPairs[] = {{Fp8Format::E4M3, Fp8Format::E4M3},
                                       {Fp8Format::E5M2, Fp8Format::E4M3},
                                       {Fp8Format::E4M3, Fp8Format::E5M2}};

// Every shape, format pair, output type and accumulation mode with `mode` scales on both sides.
void run_scaled_cases(
    TestRng& rng, ScaleMode mode,
    const std::function<void(const Shape&, const HostOperand&, const HostOperand&, GemmType, bool,
                             const std::vector<double>&, int64_t)>& run) {
  for (size_t index = 0; index < std::size(kFp8Shapes); ++index) {
    const Shape s = kFp8Shapes[index];
    const bool padded = index == 1;  // strides beyond the rows, multiples of 16 bytes
    const int64_t ld_a = padded ? s.k + 16 : s.k, ld_b = padded ? s.k + 32 : s.k;
    const std::vector<float> x = random_values(rng, s.m, s.k);
    const std::vector<float> w = random_values(rng, s.n, s.k);
    for (const FormatPair formats : kFormatPairs) {
      const HostOperand a = quantize_operand(x, s.m, s.k, ld_a, formats.a, mode);
      const HostOperand b = quantize_operand(w, s.n, s.k, ld_b, formats.b, mode);
      const std::vector<double> ref = xwt_reference(s, a.values, b.values);
      for (GemmType out_type : {GemmType::F32, GemmType::BF16}) {
        for (bool fast : {false, true})
          run(s, a, b, out_type, fast, ref, padded ? s.n + 16 : s.n);
      }
    }
  }
}

TEST_F(CublasLtGemmTest, Fp8TensorScaledMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  run_scaled_cases(
      rng_, ScaleMode::Tensor,
      [this](const Shape& s, const HostOperand& a, const HostOperand& b, GemmType t, bool fast,
             const std::vector<double>& ref, int64_t ld) { run_fp8(s, a, b, t, fast, ref, ld); });
}

TEST_F(CublasLtGemmTest, Fp8RowWiseMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  run_scaled_cases(
      rng_, ScaleMode::Row,
      [this](const Shape& s, const HostOperand& a, const HostOperand& b, GemmType t, bool fast,
             const std::vector<double>& ref, int64_t ld) { run_fp8(s, a, b, t, fast, ref, ld); });
}

struct ModePair {
  ScaleMode a;
  ScaleMode b;
};
// The combinations cuBLASLt documents for sm_90 (128x128 on both sides is not one of them).
constexpr ModePair kBlockModes[] = {{ScaleMode::Block1x128, ScaleMode::Block1x128},
                                    {ScaleMode::Block1x128, ScaleMode::Block128x128},
                                    {ScaleMode::Block128x128, ScaleMode::Block1x128}};

// Whether cuBLASLt accepts block scales here is for this test to find out: it tries every
// documented combination with fast accumulation off and on, prints what the library accepts,
// and checks the accepted ones against the CPU. A refusal must come as the API's clear error.
TEST_F(CublasLtGemmTest, Fp8BlockScaledReportsSupportAndMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  const Shape shapes[] = {{48, 80, 144}, {256, 512, 1024}, {1024, 1536, 6144}};
  std::vector<std::string> accepted, refused;
  for (const Shape s : shapes) {
    const std::vector<float> x = random_values(rng_, s.m, s.k);
    const std::vector<float> w = random_values(rng_, s.n, s.k);
    for (const ModePair modes : kBlockModes) {
      for (const FormatPair formats : {kFormatPairs[0], kFormatPairs[1]}) {
        const HostOperand a = quantize_operand(x, s.m, s.k, s.k, formats.a, modes.a);
        const HostOperand b = quantize_operand(w, s.n, s.k, s.k, formats.b, modes.b);
        const std::vector<double> ref = xwt_reference(s, a.values, b.values);
        for (GemmType out_type : {GemmType::BF16, GemmType::F32}) {
          for (bool fast : {false, true}) {
            const std::string what = fp8_text(s, a, b, out_type, fast);
            const DeviceOperand device_a(a), device_b(b);
            DeviceOutput out(out_type, s.m, s.n, s.n);
            const std::string message =
                try_fp8_gemm(gemm_, s, device_a, device_b, out, fast, stream_);
            if (!message.empty()) {
              std::printf("[ support  ] %s: refused: %s\n", what.c_str(), message.c_str());
              refused.push_back(what);
              EXPECT_NE(message.find("M=" + std::to_string(s.m) + ", N=" + std::to_string(s.n) +
                                     ", K=" + std::to_string(s.k)),
                        std::string::npos)
                  << "the refusal should name the shape: " << message;
              if (message.find("cublasLtMatmulAlgoGetHeuristic") != std::string::npos) {
                EXPECT_NE(message.find("does not support block-scaled FP8 on sm_"),
                          std::string::npos)
                    << message;
              }
              continue;
            }
            std::printf("[ support  ] %s: accepted\n", what.c_str());
            accepted.push_back(what);
            check(out.values(), ref, s.n, fp8_bound(out_type, fast), what);
          }
        }
      }
    }
  }
  std::printf("[ support  ] block-scaled FP8 on %s, cuBLASLt %s: %zu accepted, %zu refused\n",
              gemm_.architecture().c_str(), CublasLtGemm::library_version().c_str(),
              accepted.size(), refused.size());
}

// Block-scaled GEMMs adding to their output (beta = 1: weight gradients over micro-batches in
// f32, dgrads of layers sharing an input in bf16) or to an addend (the residual of a projection,
// bf16): whether cuBLASLt accepts each is printed; an accepted one must give prior + product, the
// prior values of the product's size so that a GEMM ignoring them misses by far more than the
// bound; a refusal must come as a clear error.
TEST_F(CublasLtGemmTest, Fp8BlockScaledAccumulatesOrRefusesClearly) {
  SCOPED_TRACE(rng_.trace());
  const Shape s{256, 512, 1024};
  const std::vector<float> x = random_values(rng_, s.m, s.k);
  const std::vector<float> w = random_values(rng_, s.n, s.k);
  for (const ModePair modes : {kBlockModes[0], kBlockModes[1]}) {
    const HostOperand a = quantize_operand(x, s.m, s.k, s.k, Fp8Format::E4M3, modes.a);
    const HostOperand b = quantize_operand(w, s.n, s.k, s.k, Fp8Format::E4M3, modes.b);
    const std::vector<double> product = xwt_reference(s, a.values, b.values);
    const DeviceOperand device_a(a), device_b(b);
    struct Case {
      GemmType out_type;
      bool addend;
    };
    for (const Case c :
         {Case{GemmType::BF16, false}, Case{GemmType::F32, false}, Case{GemmType::BF16, true}}) {
      std::vector<double> ref(product.size());
      for (size_t i = 0; i < ref.size(); ++i) {
        const double prior = product[i] * rng_.uniform(-1, 1);
        ref[i] = c.out_type == GemmType::BF16
                     ? bf16_to_float(float_to_bf16(static_cast<float>(prior)))
                     : static_cast<float>(prior);
      }
      // The prior values in the output (accumulating) or in an addend of the output's layout.
      DeviceOutput out(c.out_type, s.m, s.n, s.n + 8), addend(c.out_type, s.m, s.n, s.n + 8);
      (c.addend ? addend : out).set(ref);
      GemmOutput view = out.view(/*accumulate=*/!c.addend);
      if (c.addend) view.addend = addend.view().data;
      const std::string what = std::string(c.addend ? "adding an addend, " : "accumulating, ") +
                               fp8_text(s, a, b, c.out_type, false);
      try {
        gemm_.fp8_gemm(s.m, s.n, s.k, device_a.view(), device_b.view(), view,
                       /*fast_accumulation=*/false, stream_);
        FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
      } catch (const Error& error) {
        std::printf("[ support  ] %s: refused: %s\n", what.c_str(), error.what());
        EXPECT_NE(std::string(error.what()).find("M=256, N=512, K=1024"), std::string::npos)
            << "the refusal should name the shape: " << error.what();
        continue;
      }
      std::printf("[ support  ] %s: accepted\n", what.c_str());
      for (size_t i = 0; i < ref.size(); ++i)
        ref[i] += product[i];
      check(out.values(), ref, s.n, fp8_bound(c.out_type, false), what);
      check_padding(out, what);
    }
  }
}

// Integer codes and power-of-2 scales make the exact product reachable (see integer_operand):
// without fast accumulation every scaling mode must give it, element for element. This checks
// layouts and scale placement with no tolerance at all.
TEST_F(CublasLtGemmTest, Fp8IntegerInputsGiveExactProducts) {
  SCOPED_TRACE(rng_.trace());
  const ModePair modes[] = {{ScaleMode::Tensor, ScaleMode::Tensor},
                            {ScaleMode::Row, ScaleMode::Row},
                            kBlockModes[0],
                            kBlockModes[1],
                            kBlockModes[2]};
  for (const Shape s : {Shape{48, 80, 144}, Shape{256, 512, 1024}}) {
    for (const ModePair mode : modes) {
      for (const FormatPair formats : kFormatPairs) {
        const HostOperand a = integer_operand(rng_, s.m, s.k, formats.a, mode.a);
        const HostOperand b = integer_operand(rng_, s.n, s.k, formats.b, mode.b);
        const std::vector<double> ref = xwt_reference(s, a.values, b.values);
        for (bool fast : {false, true}) {
          const std::string what = "integer " + fp8_text(s, a, b, GemmType::F32, fast);
          const DeviceOperand device_a(a), device_b(b);
          DeviceOutput out(GemmType::F32, s.m, s.n, s.n);
          const std::string refusal =
              try_fp8_gemm(gemm_, s, device_a, device_b, out, fast, stream_);
          if (!refusal.empty()) {
            // Only block scales may be refused: the block-scaled test reports those.
            EXPECT_TRUE(mode.a != ScaleMode::Tensor && mode.a != ScaleMode::Row) << refusal;
            std::printf("[ support  ] %s: refused (see the block-scaled test)\n", what.c_str());
            continue;
          }
          const Errors errors = compare(out.values(), ref);
          std::printf("[ measured ] %s: %lld of %lld elements differ, |out - ref|/|ref| = %.3g\n",
                      what.c_str(), static_cast<long long>(errors.mismatches),
                      static_cast<long long>(ref.size()), errors.relative);
          if (!fast) {
            EXPECT_EQ(errors.mismatches + errors.non_finite, 0)
                << what << ": worst element [row " << errors.worst / s.n << ", col "
                << errors.worst % s.n << "]: out " << errors.worst_out << ", ref "
                << errors.worst_ref;
          } else {
            EXPECT_LE(errors.relative, kFp8FastBound) << what;
          }
        }
      }
    }
  }
}

// FP8 outputs: the codes of encode(result · scale), and amax of the result before the scale.
TEST_F(CublasLtGemmTest, Fp8OutputWithScaleAndAmax) {
  SCOPED_TRACE(rng_.trace());
  struct Case {
    Shape shape;
    FormatPair formats;
    GemmType out_type;
  };
  const Case cases[] = {{{48, 80, 32}, kFormatPairs[0], GemmType::E4M3},
                        {{256, 512, 1024}, kFormatPairs[0], GemmType::E4M3},
                        {{256, 512, 1024}, kFormatPairs[1], GemmType::E5M2},
                        {{1024, 1536, 6144}, kFormatPairs[2], GemmType::E4M3}};
  for (const Case& c : cases) {
    const Shape s = c.shape;
    const HostOperand a = quantize_operand(random_values(rng_, s.m, s.k), s.m, s.k, s.k,
                                           c.formats.a, ScaleMode::Tensor);
    const HostOperand b = quantize_operand(random_values(rng_, s.n, s.k), s.n, s.k, s.k,
                                           c.formats.b, ScaleMode::Tensor);
    const std::vector<double> ref = xwt_reference(s, a.values, b.values);
    double ref_amax = 0, ref2 = 0;
    for (double value : ref) {
      ref_amax = std::max(ref_amax, std::fabs(value));
      ref2 += value * value;
    }
    const double ref_rms = std::sqrt(ref2 / double(ref.size()));
    const Fp8Format out_format = format_of(c.out_type);
    const DeviceOperand device_a(a), device_b(b);
    for (bool overflow : {false, true}) {
      // In range: the scale that maps the result's amax to the format's max. Overflowing: 4x
      // that, to see what cuBLASLt writes for values beyond the format (printed, not checked).
      const float scale =
          scale_from_amax(static_cast<float>(ref_amax), format_max(out_format), false, 0.0f) *
          (overflow ? 4.0f : 1.0f);
      const DeviceBuffer<float> device_scale(std::vector<float>{scale});
      DeviceBuffer<float> device_amax(std::vector<float>{std::nanf("")});
      DeviceOutput out(c.out_type, s.m, s.n, s.n);
      GemmOutput view = out.view();
      view.scale = device_scale.get();
      view.amax = device_amax.get();
      const std::string what = fp8_text(s, a, b, c.out_type, false) + " scale " +
                               std::to_string(scale) + (overflow ? " (overflowing)" : "");
      gemm_.fp8_gemm(s.m, s.n, s.k, device_a.view(), device_b.view(), view, false, stream_);
      const std::vector<uint8_t> codes = out.codes();
      const float amax_out = device_amax.download()[0];
      EXPECT_NEAR(amax_out, ref_amax, kFp8Bound * ref_amax) << what << ": amax";
      if (overflow) {
        const size_t top = static_cast<size_t>(
            std::max_element(ref.begin(), ref.end(),
                             [](double x, double y) { return std::fabs(x) < std::fabs(y); }) -
            ref.begin());
        std::printf("[ info     ] %s: result %.6g x scale -> code 0x%02X (%g): %s\n", what.c_str(),
                    ref[top], codes[top], double(decode(codes[top], out_format)),
                    std::isnan(decode(codes[top], out_format))   ? "NaN, not saturating"
                    : std::isinf(decode(codes[top], out_format)) ? "inf, not saturating"
                                                                 : "saturated");
        continue;
      }
      // Each code within one step of the format at that magnitude (the rounding plus the
      // accumulation error, which can carry the value across a rounding boundary).
      int64_t out_of_bounds = 0, identical = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        const double target = ref[i] * double(scale);
        const double got = decode(codes[i], out_format);
        const double allowed = 2 * test::half_ulp(out_format, std::fabs(target)) +
                               4 * kFp8Bound * ref_rms * double(scale);
        if (!(std::fabs(got - target) <= allowed) && ++out_of_bounds <= 5) {
          ADD_FAILURE() << what << ": element [" << i / s.n << ", " << i % s.n << "]: code 0x"
                        << std::hex << int(codes[i]) << std::dec << " = " << got << ", expected "
                        << target;
        }
        identical += codes[i] == encode_reference(static_cast<float>(target), out_format,
                                                  Saturation::Saturate)
                         ? 1
                         : 0;
      }
      std::printf(
          "[ measured ] %s: amax %.7g (ref %.7g); %.2f%% of codes equal the reference "
          "cast of the float64 result\n",
          what.c_str(), double(amax_out), ref_amax, 100.0 * double(identical) / double(ref.size()));
      EXPECT_EQ(out_of_bounds, 0) << what;
    }
  }
}

TEST_F(CublasLtGemmTest, Fp8BiasAndAccumulate) {
  SCOPED_TRACE(rng_.trace());
  const Shape s{256, 512, 1024};
  const auto [a, b] = random_e4m3_operands(rng_, s);
  const DeviceOperand device_a(a), device_b(b);
  const std::vector<double> product = xwt_reference(s, a.values, b.values);
  const std::vector<double> bias = random_exact(rng_, static_cast<size_t>(s.n), GemmType::BF16);
  const DeviceBuffer<uint8_t> device_bias(to_bytes(bias, GemmType::BF16));
  for (GemmType out_type : {GemmType::F32, GemmType::BF16}) {
    const std::string what = fp8_text(s, a, b, out_type, false) + " + bf16 bias";
    DeviceOutput out(out_type, s.m, s.n, s.n);
    GemmOutput view = out.view();
    view.bias = device_bias.get();
    view.bias_type = GemmType::BF16;
    gemm_.fp8_gemm(s.m, s.n, s.k, device_a.view(), device_b.view(), view, false, stream_);
    std::vector<double> ref = product;
    add_bias(ref, bias);
    check(out.values(), ref, s.n, fp8_bound(out_type, false), what);
  }
  for (bool fast : {false, true}) {
    const std::string what = fp8_text(s, a, b, GemmType::F32, fast) + ", accumulating";
    std::vector<double> ref = random_exact(rng_, static_cast<size_t>(s.m * s.n), GemmType::F32);
    DeviceOutput out(GemmType::F32, s.m, s.n, s.n);
    out.set(ref);
    gemm_.fp8_gemm(s.m, s.n, s.k, device_a.view(), device_b.view(), out.view(true), fast, stream_);
    for (size_t i = 0; i < ref.size(); ++i)
      ref[i] += product[i];
    check(out.values(), ref, s.n, fp8_bound(GemmType::F32, fast), what);
  }
}

// The heuristic runs once per problem; a repeated problem reuses its answer, a refusal included.
TEST_F(CublasLtGemmTest, AlgorithmCacheHitsOnSecondCall) {
  SCOPED_TRACE(rng_.trace());
  CublasLtGemm gemm;
  const Shape s{256, 512, 1024};
  const Bf16Matrix x = random_bf16(rng_, s.m, s.k, s.k);
  const Bf16Matrix w = random_bf16(rng_, s.n, s.k, s.k);
  const DeviceBuffer<bf16> device_x(x.data), device_w(w.data);
  DeviceOutput out(GemmType::F32, s.m, s.n, s.n);
  const auto counters = [&gemm] { return gemm.counters(); };
  EXPECT_EQ(counters().heuristic_queries, 0);

  gemm.bf16_gemm(Bf16Form::XWt, s.m, s.n, s.k, device_x.get(), s.k, device_w.get(), s.k, out.view(),
                 stream_);
  EXPECT_EQ(counters().heuristic_queries, 1);
  EXPECT_EQ(counters().cache_hits, 0);
  // Other buffers of the same shape and alignment: the same problem.
  const DeviceBuffer<bf16> other_x(x.data);
  gemm.bf16_gemm(Bf16Form::XWt, s.m, s.n, s.k, other_x.get(), s.k, device_w.get(), s.k, out.view(),
                 stream_);
  EXPECT_EQ(counters().heuristic_queries, 1);
  EXPECT_EQ(counters().cache_hits, 1);
  // A new problem: another output type, another shape.
  const DeviceOutput out_bf16(GemmType::BF16, s.m, s.n, s.n);
  gemm.bf16_gemm(Bf16Form::XWt, s.m, s.n, s.k, device_x.get(), s.k, device_w.get(), s.k,
                 out_bf16.view(), stream_);
  gemm.bf16_gemm(Bf16Form::XWt, s.m / 2, s.n, s.k, device_x.get(), s.k, device_w.get(), s.k,
                 out.view(), stream_);
  EXPECT_EQ(counters().heuristic_queries, 3);
  EXPECT_EQ(gemm.cached_problems(), 3u);

  const HostOperand a = quantize_operand(random_values(rng_, s.m, s.k), s.m, s.k, s.k,
                                         Fp8Format::E4M3, ScaleMode::Tensor);
  const HostOperand b = quantize_operand(random_values(rng_, s.n, s.k), s.n, s.k, s.k,
                                         Fp8Format::E4M3, ScaleMode::Tensor);
  const DeviceOperand device_a(a), device_b(b);
  for (int call = 0; call < 3; ++call) {
    gemm.fp8_gemm(s.m, s.n, s.k, device_a.view(), device_b.view(), out.view(), true, stream_);
  }
  EXPECT_EQ(counters().heuristic_queries, 4);
  EXPECT_EQ(counters().cache_hits, 3);
  check(out.values(), xwt_reference(s, a.values, b.values), s.n, kFp8FastBound,
        "FP8 after cache hits");

  // A problem cuBLASLt may refuse (128x128 tiles with fast accumulation): asked once either way.
  const HostOperand tiled = quantize_operand(random_values(rng_, s.n, s.k), s.n, s.k, s.k,
                                             Fp8Format::E4M3, ScaleMode::Block128x128);
  const HostOperand blocks = quantize_operand(random_values(rng_, s.m, s.k), s.m, s.k, s.k,
                                              Fp8Format::E4M3, ScaleMode::Block1x128);
  const DeviceOperand device_tiled(tiled), device_blocks(blocks);
  const auto attempt = [&] {
    return try_fp8_gemm(gemm, s, device_blocks, device_tiled, out, true, stream_);
  };
  const std::string first = attempt();
  const CublasLtGemm::Counters before = counters();
  const std::string second = attempt();
  EXPECT_EQ(counters().heuristic_queries, before.heuristic_queries) << first;
  EXPECT_EQ(counters().cache_hits, before.cache_hits + 1);
  EXPECT_EQ(first, second);
  EXPECT_EQ(counters().calls, 9);
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// Errors name the problem and what is wrong, before anything reaches cuBLASLt.
TEST_F(CublasLtGemmTest, RejectsBadArguments) {
  const auto expect_error = [](const std::function<void()>& call,
                               std::initializer_list<const char*> expected) {
    try {
      call();
      ADD_FAILURE() << "expected an error mentioning '" << *expected.begin() << "'";
    } catch (const Error& error) {
      const std::string message = error.what();
      for (const char* part : expected) {
        EXPECT_NE(message.find(part), std::string::npos)
            << "expected '" << part << "' in: " << message;
      }
    }
  };
  const int64_t m = 64, n = 64, k = 256;
  DeviceBuffer<uint8_t> codes(static_cast<size_t>(4 * m * k) + 16);
  DeviceBuffer<float> scales(static_cast<size_t>(4 * m * k));
  DeviceOutput out(GemmType::F32, m, n, n);
  DeviceOutput out_bf16(GemmType::BF16, m, n, n);
  Fp8Operand a;
  a.data = codes.get();
  a.ld = k;
  a.scale_inv = scales.get();
  const Fp8Operand b = a;
  const auto fp8 = [&](int64_t mm, int64_t nn, int64_t kk, const Fp8Operand& aa,
                       const Fp8Operand& bb, const GemmOutput& o) {
    return [&, mm, nn, kk, aa, bb, o] { gemm_.fp8_gemm(mm, nn, kk, aa, bb, o, false, stream_); };
  };

  expect_error(fp8(m, n, 40, a, b, out.view()), {"K to be a multiple of 16", "K=40", "M=64"});
  Fp8Operand e5m2 = a;
  e5m2.format = Fp8Format::E5M2;
  expect_error(fp8(m, n, k, e5m2, e5m2, out.view()), {"e5m2 x e5m2"});
  Fp8Operand fnuz = a;
  fnuz.format = Fp8Format::E4M3FNUZ;
  expect_error(fp8(m, n, k, fnuz, b, out.view()), {"no fnuz formats", "e4m3fnuz"});
  Fp8Operand odd_ld = a;
  odd_ld.ld = k + 8;
  expect_error(fp8(m, n, k, odd_ld, b, out.view()), {"leading dimension of a", "264"});
  Fp8Operand misaligned = a;
  misaligned.data = codes.get() + 1;
  expect_error(fp8(m, n, k, misaligned, b, out.view()), {"16-byte aligned"});
  Fp8Operand no_scale = a;
  no_scale.scale_inv = nullptr;
  expect_error(fp8(m, n, k, a, no_scale, out.view()), {"b's scale_inv", "null"});
  Fp8Operand row = a;
  row.scale_mode = ScaleMode::Row;
  expect_error(fp8(m, n, k, row, b, out.view()), {"both operands tensor-scaled"});
  Fp8Operand tiles = a;
  tiles.scale_mode = ScaleMode::Block128x128;
  expect_error(fp8(m, n, k, tiles, tiles, out.view()), {"two 128x128"});
  Fp8Operand blocks = a;
  blocks.scale_mode = ScaleMode::Block1x128;
  expect_error(fp8(18, n, k, blocks, blocks, out.view()), {"multiples of 4", "M=18"});
  expect_error(fp8(m, 36, k, a, b, out_bf16.view()), {"multiples of 16 bytes", "N=36"});
  DeviceOutput fp8_out(GemmType::E4M3, m, n, n);
  expect_error(fp8(m, n, k, a, b, fp8_out.view(true)), {"accumulation needs an f32 or bf16"});
  expect_error(fp8(m, n, k, row, row, fp8_out.view()), {"per-tensor scaled"});
  expect_error(fp8(m, n, k, a, b, fp8_out.view()), {"output's scale"});
  DeviceOutput e5m2_out(GemmType::E5M2, m, n, n);
  GemmOutput e5m2_view = e5m2_out.view();
  e5m2_view.scale = scales.get();
  expect_error(fp8(m, n, k, a, b, e5m2_view), {"e5m2 only from an e5m2 operand"});
  GemmOutput f32_bias = out.view();
  f32_bias.bias = scales.get();
  f32_bias.bias_type = GemmType::F32;
  expect_error(fp8(m, n, k, a, b, f32_bias), {"bf16 bias"});
  GemmOutput fp8_out_addend = fp8_out.view();
  fp8_out_addend.scale = scales.get();
  fp8_out_addend.addend = scales.get();
  expect_error(fp8(m, n, k, a, b, fp8_out_addend), {"an addend needs an f32 or bf16 output"});
  expect_error(fp8(0, n, k, a, b, out.view()), {"positive sizes", "M=0"});

  DeviceBuffer<bf16> matrix(static_cast<size_t>(m * k));
  expect_error(
      [&] {
        gemm_.bf16_gemm(Bf16Form::XWt, m, n, k, matrix.get(), k - 1, matrix.get(), k, out.view(),
                        stream_);
      },
      {"leading dimension of x", "255"});
  const auto batched = [&](const GemmOutput& output, const GemmBatch& batch) {
    return [&, output, batch] {
      gemm_.bf16_gemm(Bf16Form::XWt, m, n, k, matrix.get(), k, matrix.get(), k, output, batch,
                      stream_);
    };
  };
  expect_error(batched(out.view(), GemmBatch{0, 0, 0, 0}), {"batch of 1 to", "found 0"});
  expect_error(batched(out.view(), GemmBatch{2, m * k, -1, m * n}), {"operand strides >= 0"});
  expect_error(batched(out.view(), GemmBatch{2, m * k, m * k, m * n - 1}),
               {"output's batch stride >= rows x ld = 4096", "batch of 2"});
  GemmOutput batched_bias = out.view();
  batched_bias.bias = scales.get();
  batched_bias.bias_type = GemmType::F32;
  expect_error(batched(batched_bias, GemmBatch{2, m * k, m * k, m * n}), {"no bias"});
  GemmOutput addend_and_accumulate = out.view(/*accumulate=*/true);
  addend_and_accumulate.addend = matrix.get();
  expect_error(batched(addend_and_accumulate, GemmBatch{}), {"an addend or accumulation"});
  GemmOutput scale_without_addend = out.view();
  scale_without_addend.result_scale = 2.0f;
  expect_error(batched(scale_without_addend, GemmBatch{}), {"scales need an addend"});
  GemmOutput bf16_bias = out.view();
  bf16_bias.bias = matrix.get();
  bf16_bias.bias_type = GemmType::BF16;
  expect_error(
      [&] {
        gemm_.bf16_gemm(Bf16Form::XWt, m, n, k, matrix.get(), k, matrix.get(), k, bf16_bias,
                        stream_);
      },
      {"bias of the output's type f32"});
  expect_error(
      [&] {
        gemm_.bf16_gemm(Bf16Form::DytX, m, n, k, matrix.get(), n, nullptr, k, out.view(), stream_);
      },
      {"expected x", "null"});
  EXPECT_EQ(gemm_.counters().calls, 0);
}

// ---- Autotuning ----

GemmTuning autotune_both(const std::string& cache_path = "") {
  GemmTuning tuning;
  tuning.autotune_bf16 = tuning.autotune_fp8 = true;
  tuning.cache_path = cache_path;
  return tuning;
}

// Every problem has a record; those with a choice were timed here (not from a file) and kept
// one of the candidates that agreed.
void check_records(const CublasLtGemm& gemm, size_t problems) {
  const std::vector<CublasLtGemm::TuningRecord> records = gemm.tuning_records();
  ASSERT_EQ(records.size(), problems);
  int64_t timed = 0;
  for (const CublasLtGemm::TuningRecord& record : records) {
    std::printf("[ tuned    ] %s: %d candidates, %d agreeing, kept #%d: %.4f ms (first %.4f ms)\n",
                record.problem.c_str(), record.candidates, record.agreeing, record.winner,
                record.best_ms, record.heuristic_ms);
    EXPECT_FALSE(record.from_cache) << record.problem;
    EXPECT_FALSE(record.no_scratch) << record.problem;
    EXPECT_GE(record.candidates, 1) << record.problem;
    // cuBLASLt's candidates, and the engine's kernel where it serves the problem.
    EXPECT_LE(record.candidates, CublasLtGemm::kTuneCandidates + 1) << record.problem;
    EXPECT_GE(record.agreeing, 1) << record.problem;  // the first agrees with itself
    EXPECT_LE(record.agreeing, record.candidates) << record.problem;
    EXPECT_GE(record.winner, 0) << record.problem;
    EXPECT_LT(record.winner, record.candidates) << record.problem;
    if (record.candidates == 1) continue;  // nothing to time
    ++timed;
    EXPECT_GT(record.best_ms, 0.0) << record.problem;
    EXPECT_LE(record.best_ms, record.heuristic_ms) << record.problem;
  }
  EXPECT_EQ(gemm.counters().tuned, timed);
}

// Whatever candidate wins, the call's result is the product: BF16 in each form (wgrad adding
// into an output that already holds values, which the candidates' trial runs must not touch),
// FP8 per tensor and in blocks, and an FP8 output whose amax must come from the real call.
TEST_F(CublasLtGemmTest, AutotunedGemmsMatchCpu) {
  SCOPED_TRACE(rng_.trace());
  CublasLtGemm gemm;
  gemm.configure_tuning(autotune_both());
  size_t problems = 0;
  for (const Shape s : {Shape{256, 512, 1024}, Shape{1024, 1536, 6144}}) {
    const Bf16Matrix x = random_bf16(rng_, s.m, s.k, s.k);
    const Bf16Matrix w = random_bf16(rng_, s.n, s.k, s.k);
    const Bf16Matrix dy = random_bf16(rng_, s.m, s.n, s.n);
    const DeviceBuffer<bf16> device_x(x.data), device_w(w.data), device_dy(dy.data);

    DeviceOutput y(GemmType::BF16, s.m, s.n, s.n + 8);
    gemm.bf16_gemm(Bf16Form::XWt, s.m, s.n, s.k, device_x.get(), s.k, device_w.get(), s.k, y.view(),
                   stream_);
    check(y.values(), xwt_reference(s, x.values, w.values), s.n, kBf16OutBound,
          "autotuned BF16 forward " + text(s));
    check_padding(y, "autotuned BF16 forward");

    std::vector<double> dx_ref(static_cast<size_t>(s.m * s.k), 0.0);
    dgrad_dyw(s.m, s.n, s.k, dy.values.data(), s.n, w.values.data(), s.k, dx_ref.data(), s.k);
    DeviceOutput dx(GemmType::F32, s.m, s.k, s.k);
    gemm.bf16_gemm(Bf16Form::DyW, s.m, s.n, s.k, device_dy.get(), s.n, device_w.get(), s.k,
                   dx.view(), stream_);
    check(dx.values(), dx_ref, s.k, kF32Bound, "autotuned BF16 dgrad " + text(s));

    std::vector<double> dw_ref = random_exact(rng_, static_cast<size_t>(s.n * s.k), GemmType::F32);
    DeviceOutput dw(GemmType::F32, s.n, s.k, s.k + 4);
    dw.set(dw_ref);
    wgrad_dytx(s.m, s.n, s.k, dy.values.data(), s.n, x.values.data(), s.k, dw_ref.data(), s.k);
    gemm.bf16_gemm(Bf16Form::DytX, s.m, s.n, s.k, device_dy.get(), s.n, device_x.get(), s.k,
                   dw.view(/*accumulate=*/true), stream_);
    check(dw.values(), dw_ref, s.k, kF32Bound, "autotuned BF16 wgrad dW += dyᵀ·x " + text(s));
    check_padding(dw, "autotuned BF16 wgrad");

    const std::vector<float> xf = random_values(rng_, s.m, s.k), wf = random_values(rng_, s.n, s.k);
    for (const ModePair modes : {ModePair{ScaleMode::Tensor, ScaleMode::Tensor},
                                 ModePair{ScaleMode::Block1x128, ScaleMode::Block128x128}}) {
      const HostOperand a = quantize_operand(xf, s.m, s.k, s.k, Fp8Format::E4M3, modes.a);
      const HostOperand b = quantize_operand(wf, s.n, s.k, s.k, Fp8Format::E4M3, modes.b);
      const DeviceOperand device_a(a), device_b(b);
      DeviceOutput out(GemmType::BF16, s.m, s.n, s.n);
      const bool fast = modes.a == ScaleMode::Tensor;  // blocks: split accumulation only
      const std::string refusal = try_fp8_gemm(gemm, s, device_a, device_b, out, fast, stream_);
      ASSERT_EQ(refusal, "") << "autotuned " << fp8_text(s, a, b, GemmType::BF16, fast);
      check(out.values(), xwt_reference(s, a.values, b.values), s.n,
            fp8_bound(GemmType::BF16, fast),
            "autotuned " + fp8_text(s, a, b, GemmType::BF16, fast));
    }

    // An FP8 output with its amax: the trial runs write a scratch amax, the call the real one.
    const HostOperand a = quantize_operand(xf, s.m, s.k, s.k, Fp8Format::E4M3, ScaleMode::Tensor);
    const HostOperand b = quantize_operand(wf, s.n, s.k, s.k, Fp8Format::E4M3, ScaleMode::Tensor);
    const std::vector<double> ref = xwt_reference(s, a.values, b.values);
    double ref_amax = 0.0;
    for (double value : ref)
      ref_amax = std::max(ref_amax, std::fabs(value));
    const DeviceOperand device_a(a), device_b(b);
    const DeviceBuffer<float> device_scale(std::vector<float>{
        scale_from_amax(static_cast<float>(ref_amax), format_max(Fp8Format::E4M3), false, 0.0f)});
    DeviceBuffer<float> device_amax(std::vector<float>{std::nanf("")});
    DeviceOutput out(GemmType::E4M3, s.m, s.n, s.n);
    GemmOutput view = out.view();
    view.scale = device_scale.get();
    view.amax = device_amax.get();
    gemm.fp8_gemm(s.m, s.n, s.k, device_a.view(), device_b.view(), view, false, stream_);
    EXPECT_NEAR(device_amax.download()[0], ref_amax, kFp8Bound * ref_amax) << "autotuned amax";
    problems += 6;
  }
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
  check_records(gemm, problems);
  std::printf("[ tuned    ] %s\n", gemm.tuning_summary().c_str());
}

// Without autotuning nothing is timed and the heuristic is asked for one algorithm.
TEST_F(CublasLtGemmTest, UntunedGemmsTimeNothing) {
  SCOPED_TRACE(rng_.trace());
  CublasLtGemm gemm;
  GemmTuning pinned = autotune_both();
  pinned.autotune_bf16 = false;  // as a pinned bf16 backend leaves it
  gemm.configure_tuning(pinned);
  const Shape s{256, 512, 1024};
  const Bf16Matrix x = random_bf16(rng_, s.m, s.k, s.k);
  const Bf16Matrix w = random_bf16(rng_, s.n, s.k, s.k);
  const DeviceBuffer<bf16> device_x(x.data), device_w(w.data);
  DeviceOutput y(GemmType::BF16, s.m, s.n, s.n);
  gemm.bf16_gemm(Bf16Form::XWt, s.m, s.n, s.k, device_x.get(), s.k, device_w.get(), s.k, y.view(),
                 stream_);
  check(y.values(), xwt_reference(s, x.values, w.values), s.n, kBf16OutBound, "untuned BF16");
  EXPECT_EQ(gemm.counters().tuned, 0);
  EXPECT_TRUE(gemm.tuning_records().empty());
  EXPECT_EQ(gemm.tuning_summary(), "");
}

// A second instance (a second run) takes the winners from the file without timing; entries of
// another GPU are ignored, and kept in the file.
TEST_F(CublasLtGemmTest, TuningCacheFileServesTheNextRun) {
  SCOPED_TRACE(rng_.trace());
  const test::TempFolder folder;
  const std::string path = (folder / "gemm_tuning.json").string();
  const Shape s{1024, 1536, 6144};
  const auto [a, b] = random_e4m3_operands(rng_, s);
  const DeviceOperand device_a(a), device_b(b);
  const std::vector<double> ref = xwt_reference(s, a.values, b.values);
  const auto run = [&](CublasLtGemm& gemm, const std::string& what) {
    DeviceOutput out(GemmType::BF16, s.m, s.n, s.n);
    gemm.fp8_gemm(s.m, s.n, s.k, device_a.view(), device_b.view(), out.view(), true, stream_);
    check(out.values(), ref, s.n, kFp8FastBound, what);
  };
  int kept = 0;
  {
    CublasLtGemm first;
    first.configure_tuning(autotune_both(path));
    run(first, "first run");
    EXPECT_EQ(first.counters().tuned, 1);
    EXPECT_EQ(first.counters().tuned_from_file, 0);
    kept = first.tuning_records().at(0).winner;
  }
  ASSERT_TRUE(std::filesystem::exists(path));
  {
    CublasLtGemm second;
    second.configure_tuning(autotune_both(path));
    run(second, "second run, from the file");
    EXPECT_EQ(second.counters().tuned, 0);
    EXPECT_EQ(second.counters().tuned_from_file, 1);
    ASSERT_EQ(second.tuning_records().size(), 1u);
    EXPECT_TRUE(second.tuning_records()[0].from_cache);
    EXPECT_EQ(second.tuning_records()[0].winner, kept);
  }
  // The same entries, said to come from another GPU: stale for this one.
  std::string text;
  {
    std::ifstream file(path);
    text.assign(std::istreambuf_iterator<char>(file), {});
  }
  // Each entry names the engine's kernel it was timed with: 16 hex digits of its source's hash.
  const std::string fingerprint = block_gemm_sm90_fingerprint();
  EXPECT_EQ(fingerprint.size(), 16u);
  EXPECT_EQ(fingerprint.find_first_not_of("0123456789abcdef"), std::string::npos) << fingerprint;
  EXPECT_NE(text.find("\"engine_kernel\": \"" + fingerprint + "\""), std::string::npos) << text;
  const std::string name_key = "\"gpu\": \"";
  const size_t at = text.find(name_key);
  ASSERT_NE(at, std::string::npos) << text;
  text.insert(at + name_key.size(), "Another ");
  std::ofstream(path) << text;
  CublasLtGemm third;
  third.configure_tuning(autotune_both(path));
  run(third, "third run, the file's entry of another GPU");
  EXPECT_EQ(third.counters().tuned, 1);
  EXPECT_EQ(third.counters().tuned_from_file, 0);
  std::ifstream file(path);
  const std::string saved((std::istreambuf_iterator<char>(file)), {});
  EXPECT_NE(saved.find("\"gpu\": \"Another "), std::string::npos) << "the other GPU's entry";
}

// ---- The engine's block-scaled kernel (block_gemm_sm90.h) ----

// Values whose magnitudes span 1e-6 to 1e3 (2^-20 to 2^10) within every 128-element block: each
// element's binary exponent is drawn uniformly, so the blocks' scales have to carry the large
// ones and the small ones lose digits exactly as the reference's dequantized codes say.
std::vector<float> wide_values(TestRng& rng, int64_t rows, int64_t cols) {
  std::vector<float> values(static_cast<size_t>(rows * cols));
  for (float& value : values)
    value = rng.wide(-20, 9);
  return values;
}

// The problem on the engine's kernel, waited for.
void run_engine(const Shape& s, const DeviceOperand& a, const DeviceOperand& b,
                const GemmOutput& out, cudaStream_t stream, bool repeatable = false) {
  block_gemm_sm90(s.m, s.n, s.k, a.view(), b.view(), out, repeatable, stream);
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
}

class EngineBlockGemmTest : public CublasLtGemmTest {
 protected:
  void SetUp() override {
    CublasLtGemmTest::SetUp();
    Fp8Operand a, b;
    a.scale_mode = b.scale_mode = ScaleMode::Block1x128;
    GemmOutput out;
    std::string why;
    if (!block_gemm_sm90_serves(a, b, out, &why)) GTEST_SKIP() << why;
  }
};

// The plans a problem can run with: K in 1 run, and in 2 or 3 where the output is an
// accumulated f32.
std::vector<BlockGemmPlan> every_plan(GemmType out_type, bool accumulate) {
  if (!(out_type == GemmType::F32 && accumulate)) return {{.splits = 1}};
  return {{.splits = 1}, {.splits = 2}, {.splits = 3}};
}

// Awkward sizes (M, N and K not multiples of the 128 tiles, padded strides) and large ones, every
// format pair wgmma takes, b in 1x128 blocks and in 128x128 tiles, f32 and bf16 outputs, written
// and accumulated, each with every plan; values spanning 1e-6 to 1e3 within each block. The
// kernel takes K in pairs of blocks, then a single block: the K block counts (1, 2, 3, 5, 7, 9,
// 48, 64 and runs of 22) take pairs alone, one block alone, and both. The last shape has 198 tiles,
// more than a Hopper GPU has multiprocessors, so its thread blocks run in more than one wave,
// and its two K blocks in 3 runs leave one run with none.
TEST_F(EngineBlockGemmTest, MatchesCpuOnAwkwardAndLargeShapes) {
  SCOPED_TRACE(rng_.trace());
  const Shape shapes[] = {{4, 4, 16},      {48, 80, 144},    {100, 36, 272},     {260, 388, 1040},
                          {128, 128, 128}, {136, 264, 880},  {1024, 1536, 6144}, {640, 512, 8192},
                          {200, 400, 528}, {1400, 2200, 208}};
  const FormatPair formats[] = {{Fp8Format::E4M3, Fp8Format::E4M3},
                                {Fp8Format::E5M2, Fp8Format::E4M3},
                                {Fp8Format::E4M3, Fp8Format::E5M2},
                                {Fp8Format::E5M2, Fp8Format::E5M2}};
  for (size_t index = 0; index < std::size(shapes); ++index) {
    const Shape s = shapes[index];
    const bool padded = index % 2 == 1;
    const int64_t ld_a = padded ? s.k + 16 : s.k, ld_b = padded ? s.k + 48 : s.k;
    const int64_t ld_out = padded ? s.n + 8 : s.n;
    const std::vector<float> x = wide_values(rng_, s.m, s.k), w = wide_values(rng_, s.n, s.k);
    // The large shapes (their float64 references take seconds) with the hybrid recipe's pairs.
    const size_t pairs = s.m * s.n * s.k > int64_t{1} << 30 ? 2 : std::size(formats);
    for (const ScaleMode b_mode : {ScaleMode::Block1x128, ScaleMode::Block128x128}) {
      for (size_t pair_index = 0; pair_index < pairs; ++pair_index) {
        const FormatPair pair = formats[pair_index];
        const HostOperand a = quantize_operand(x, s.m, s.k, ld_a, pair.a, ScaleMode::Block1x128);
        const HostOperand b = quantize_operand(w, s.n, s.k, ld_b, pair.b, b_mode);
        const DeviceOperand device_a(a), device_b(b);
        const std::vector<double> product = xwt_reference(s, a.values, b.values);
        for (const GemmType out_type : {GemmType::F32, GemmType::BF16}) {
          for (const bool accumulate : {false, true}) {
            for (const BlockGemmPlan& plan : every_plan(out_type, accumulate)) {
              const std::string what = "engine " + fp8_text(s, a, b, out_type, false) +
                                       (accumulate ? " accumulated" : "") + " in " +
                                       std::to_string(plan.splits) + " runs of K";
              DeviceOutput out(out_type, s.m, s.n, ld_out);
              std::vector<double> ref = product;
              if (accumulate) {
                const std::vector<double> before =
                    random_exact(rng_, static_cast<size_t>(s.m * s.n), out_type);
                out.set(before);
                for (size_t i = 0; i < ref.size(); ++i)
                  ref[i] += before[i];
              }
              block_gemm_sm90_planned(s.m, s.n, s.k, device_a.view(), device_b.view(),
                                      out.view(accumulate), plan, stream_);
              FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
              check(out.values(), ref, s.n, fp8_bound(out_type, false), what);
              check_padding(out, what);
            }
          }
        }
      }
    }
  }
}

// Split K sums the runs by atomics, so only an accumulated f32 output of a caller that does not
// ask for repeatable sums gets it; repeatable calls give the same bits every time.
TEST_F(EngineBlockGemmTest, SplitsKOnlyWhereAllowedAndRepeatsWhenAsked) {
  SCOPED_TRACE(rng_.trace());
  const Shape s{640, 512, 8192};
  const std::vector<float> x = random_values(rng_, s.m, s.k), w = random_values(rng_, s.n, s.k);
  const HostOperand a = quantize_operand(x, s.m, s.k, s.k, Fp8Format::E4M3, ScaleMode::Block1x128);
  const HostOperand b = quantize_operand(w, s.n, s.k, s.k, Fp8Format::E4M3, ScaleMode::Block1x128);
  const DeviceOperand device_a(a), device_b(b);
  DeviceOutput f32(GemmType::F32, s.m, s.n, s.n), bf16(GemmType::BF16, s.m, s.n, s.n);
  EXPECT_GT(block_gemm_sm90_plan(s.m, s.n, s.k, f32.view(true), false).splits, 1);
  EXPECT_EQ(block_gemm_sm90_plan(s.m, s.n, s.k, f32.view(true), true).splits, 1);
  EXPECT_EQ(block_gemm_sm90_plan(s.m, s.n, s.k, f32.view(false), false).splits, 1);
  EXPECT_EQ(block_gemm_sm90_plan(s.m, s.n, s.k, bf16.view(true), false).splits, 1);
  const std::vector<double> before =
      random_exact(rng_, static_cast<size_t>(s.m * s.n), GemmType::F32);
  std::vector<double> first;
  for (int call = 0; call < 2; ++call) {
    f32.set(before);
    run_engine(s, device_a, device_b, f32.view(true), stream_, true);
    if (call == 0) {
      first = f32.values();
      std::vector<double> ref = xwt_reference(s, a.values, b.values);
      for (size_t i = 0; i < ref.size(); ++i)
        ref[i] += before[i];
      check(first, ref, s.n, fp8_bound(GemmType::F32, false), "engine repeatable");
    } else {
      EXPECT_TRUE(f32.values() == first) << "two repeatable calls gave different bits";
    }
  }
}

// Integer codes and power-of-2 scales (see integer_operand): the kernel promotes every 128-wide
// K block, so it must give the exact product element for element.
TEST_F(EngineBlockGemmTest, IntegerInputsGiveExactProducts) {
  SCOPED_TRACE(rng_.trace());
  for (const Shape s : {Shape{48, 80, 144}, Shape{256, 512, 1024}, Shape{132, 260, 400}}) {
    for (const ScaleMode b_mode : {ScaleMode::Block1x128, ScaleMode::Block128x128}) {
      for (const FormatPair formats : kFormatPairs) {
        const HostOperand a = integer_operand(rng_, s.m, s.k, formats.a, ScaleMode::Block1x128);
        const HostOperand b = integer_operand(rng_, s.n, s.k, formats.b, b_mode);
        const std::vector<double> ref = xwt_reference(s, a.values, b.values);
        const DeviceOperand device_a(a), device_b(b);
        DeviceOutput out(GemmType::F32, s.m, s.n, s.n);
        run_engine(s, device_a, device_b, out.view(), stream_);
        const Errors errors = compare(out.values(), ref);
        const std::string what = "engine integer " + fp8_text(s, a, b, GemmType::F32, false);
        std::printf("[ measured ] %s: %lld of %lld elements differ\n", what.c_str(),
                    static_cast<long long>(errors.mismatches + errors.non_finite),
                    static_cast<long long>(ref.size()));
        EXPECT_EQ(errors.mismatches + errors.non_finite, 0)
            << what << ": worst element [row " << errors.worst / s.n << ", col "
            << errors.worst % s.n << "]: out " << errors.worst_out << ", ref " << errors.worst_ref;
      }
    }
  }
}

// What the kernel does not serve, it refuses with the reason, and the call names the problem.
TEST_F(EngineBlockGemmTest, RefusesWhatItDoesNotServe) {
  Fp8Operand blocks, tensor;
  blocks.scale_mode = ScaleMode::Block1x128;
  tensor.scale_mode = ScaleMode::Tensor;
  GemmOutput out;
  std::string why;
  EXPECT_FALSE(block_gemm_sm90_serves(tensor, blocks, out, &why));
  EXPECT_NE(why.find("1x128"), std::string::npos) << why;
  GemmOutput with_bias;
  const float bias = 0.0f;
  with_bias.bias = &bias;
  EXPECT_FALSE(block_gemm_sm90_serves(blocks, blocks, with_bias, &why));
  EXPECT_NE(why.find("bias"), std::string::npos) << why;
  GemmOutput fp8_out;
  fp8_out.type = GemmType::E4M3;
  EXPECT_FALSE(block_gemm_sm90_serves(blocks, blocks, fp8_out, &why));
  try {
    block_gemm_sm90(64, 64, 128, tensor, blocks, out, false, stream_);
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("M=64, N=64, K=128"), std::string::npos)
        << error.what();
  }
  // Plans a problem cannot take: K split for a bf16 output or one written, not accumulated, and
  // more runs than the kernel makes.
  GemmOutput bf16_out, f32_out;
  bf16_out.type = GemmType::BF16;
  bf16_out.accumulate = true;
  f32_out.type = GemmType::F32;
  GemmOutput f32_accumulated = f32_out;
  f32_accumulated.accumulate = true;
  for (const auto& [target, splits] :
       {std::pair{bf16_out, 2}, std::pair{f32_out, 2}, std::pair{f32_accumulated, 5},
        std::pair{f32_accumulated, 0}}) {
    try {
      block_gemm_sm90_planned(64, 64, 128, blocks, blocks, target, {.splits = splits}, stream_);
      ADD_FAILURE() << "expected a refusal of " << splits << " runs of K";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("cannot run M=64, N=64, K=128 in"),
                std::string::npos)
          << error.what();
    }
  }
}

// Autotuning offers the engine's kernel as one more candidate of the block-scaled problems (the
// weight gradient's 1x128 x 1x128 and the forward's 1x128 x 128x128), and whichever wins, the
// result is the product; pinned for fp8, the kernel serves the calls without timing.
TEST_F(EngineBlockGemmTest, IsACandidateOfAutotuningAndCanBePinned) {
  SCOPED_TRACE(rng_.trace());
  const Shape s{512, 768, 2048};
  const std::vector<float> x = random_values(rng_, s.m, s.k), w = random_values(rng_, s.n, s.k);
  for (const bool pinned : {false, true}) {
    CublasLtGemm gemm;
    GemmTuning tuning;
    tuning.autotune_fp8 = !pinned;
    if (pinned) tuning.pins.fp8 = GemmBackend::Fp8train;
    gemm.configure_tuning(tuning);
    for (const ScaleMode b_mode : {ScaleMode::Block1x128, ScaleMode::Block128x128}) {
      const HostOperand a =
          quantize_operand(x, s.m, s.k, s.k, Fp8Format::E5M2, ScaleMode::Block1x128);
      const HostOperand b = quantize_operand(w, s.n, s.k, s.k, Fp8Format::E4M3, b_mode);
      const DeviceOperand device_a(a), device_b(b);
      const std::vector<double> before =
          random_exact(rng_, static_cast<size_t>(s.m * s.n), GemmType::F32);
      std::vector<double> ref = xwt_reference(s, a.values, b.values);
      for (size_t i = 0; i < ref.size(); ++i)
        ref[i] += before[i];
      DeviceOutput out(GemmType::F32, s.m, s.n, s.n);
      out.set(before);
      gemm.fp8_gemm(s.m, s.n, s.k, device_a.view(), device_b.view(), out.view(true), false,
                    stream_);
      FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
      const std::string what = std::string(pinned ? "pinned " : "autotuned ") +
                               fp8_text(s, a, b, GemmType::F32, false) + " accumulated";
      check(out.values(), ref, s.n, kFp8Bound, what);
    }
    if (pinned) {
      EXPECT_EQ(gemm.counters().engine_calls, 2);
      EXPECT_TRUE(gemm.tuning_records().empty());
    } else {
      const std::vector<CublasLtGemm::TuningRecord> records = gemm.tuning_records();
      ASSERT_EQ(records.size(), 2u);
      for (const CublasLtGemm::TuningRecord& record : records) {
        std::printf(
            "[ tuned    ] %s: %d candidates, %d agreeing, kept #%d%s: %.4f ms (first "
            "%.4f ms)\n",
            record.problem.c_str(), record.candidates, record.agreeing, record.winner,
            record.engine ? " (the engine's kernel)" : "", record.best_ms, record.heuristic_ms);
        EXPECT_GE(record.candidates, 2) << "the engine's kernel is a candidate";
        EXPECT_EQ(record.engine, record.winner == record.candidates - 1) << record.problem;
      }
      EXPECT_EQ(gemm.counters().engine_calls,
                (records[0].engine ? 1 : 0) + (records[1].engine ? 1 : 0));
    }
  }
}

// The agreement check itself: ‖out − ref‖/‖ref‖ over the elements only (not the padding), FP8
// codes decoded, NaN for a non-finite value.
TEST(GemmOutputDifference, MeasuresTheRelativeDistanceOverTheElements) {
  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreate(&stream));
  // Two column-major matrices [rows 2, cols 2] with ld 3 (one padding element per column), 7
  // elements apart.
  const OutputView view{
      .type = GemmType::F32, .rows = 2, .cols = 2, .ld = 3, .batch = 2, .stride = 7};
  const float pad = 1e30f;
  const std::vector<float> ref = {3, 0, pad, 0, 0, pad, pad, 0, 4, pad, 0, 0, pad, pad};
  std::vector<float> out = ref;
  out[8] = 4.5f;  // an element: off by 0.5 of ‖ref‖ = 5
  out[2] = 7.0f;  // padding: not counted
  const DeviceBuffer<float> device_ref(ref), device_out(out);
  EXPECT_NEAR(relative_difference(view, device_out.get(), device_ref.get(), stream), 0.1, 1e-12);
  EXPECT_EQ(relative_difference(view, device_ref.get(), device_ref.get(), stream), 0.0);
  out[8] = std::nanf("");
  const DeviceBuffer<float> with_nan(out);
  EXPECT_TRUE(std::isnan(relative_difference(view, with_nan.get(), device_ref.get(), stream)));

  // E4M3 codes: 0x38 = 1.0, 0x40 = 2.0, 0x3C = 1.5.
  const OutputView codes{.type = GemmType::E4M3, .rows = 2, .cols = 1, .ld = 2};
  const DeviceBuffer<uint8_t> ones(std::vector<uint8_t>{0x38, 0x40}),
      other(std::vector<uint8_t>{0x3C, 0x40});
  EXPECT_NEAR(relative_difference(codes, other.get(), ones.get(), stream), 0.5 / std::sqrt(5.0),
              1e-12);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace fp8t::gemm
