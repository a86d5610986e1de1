// Helpers of the GPU tests: bf16 and fp32 test data, device buffers that can be misaligned, a
// fixture with a stream, gradient buffers to start a backward from, and the comparison of GPU
// results with the CPU reference (the norm of the error relative to the reference's, and a
// bound on every element, so that one wrong row cannot hide in a norm) or with another GPU
// result (bit for bit). C++17 (CUDA tests include it).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "numerics/float_bits.h"
#include "numerics/quantize.h"
#include "numerics/test_util.h"
#include "ops/cuda/ops_cuda.h"

namespace fp8t::test {

// ‖gpu − cpu‖ / ‖cpu‖ ≤ norm, and every |gpu − cpu| ≤ relative·|cpu| + floor·max|cpu|.
struct Tolerance {
  double norm;
  double relative;
  double floor;
};

// Uniform in [lo, hi), rounded to bf16.
inline std::vector<bf16> random_bf16(TestRng& rng, size_t count, double lo = -1.0,
                                     double hi = 1.0) {
  std::vector<bf16> values(count);
  for (bf16& value : values)
    value = float_to_bf16(static_cast<float>(rng.uniform(lo, hi)));
  return values;
}

// Uniform in [lo, hi), in fp32.
inline std::vector<float> random_floats(TestRng& rng, size_t count, double lo = -1.0,
                                        double hi = 1.0) {
  std::vector<float> values(count);
  for (float& value : values)
    value = static_cast<float>(rng.uniform(lo, hi));
  return values;
}

// GPU results as doubles, for expect_close.
inline std::vector<double> widen(const std::vector<bf16>& values) {
  std::vector<double> wide(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    wide[i] = bf16_to_float(values[i]);
  return wide;
}

inline std::vector<double> widen(const std::vector<float>& values) {
  return std::vector<double>(values.begin(), values.end());
}

// FP8T_TEST_VERBOSE=1 prints every comparison's error.
inline bool verbose() {
  const char* text = std::getenv("FP8T_TEST_VERBOSE");
  return text != nullptr && std::strcmp(text, "0") != 0;
}

// cpu NaN means "must be NaN" (a deliberately invalid input); otherwise a NaN or inf from the
// GPU fails, and its index is reported.
inline void expect_close(const std::vector<double>& gpu, const std::vector<double>& cpu,
                         const Tolerance& tolerance, const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  double largest = 0.0;
  for (double value : cpu)
    if (std::isfinite(value)) largest = std::max(largest, std::fabs(value));
  double difference_squares = 0.0, reference_squares = 0.0, worst_ratio = 0.0;
  int64_t bad_elements = 0, nonfinite = 0, first_nonfinite = -1, worst = -1;
  std::string examples;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (std::isnan(cpu[i])) {
      if (!std::isnan(gpu[i]) && ++bad_elements <= 5)
        examples += fmt::format("\n  [{}] gpu {} where NaN was expected", i, gpu[i]);
      continue;
    }
    if (!std::isfinite(gpu[i])) {
      if (nonfinite++ == 0) first_nonfinite = static_cast<int64_t>(i);
      continue;
    }
    const double error = std::fabs(gpu[i] - cpu[i]);
    difference_squares += error * error;
    reference_squares += cpu[i] * cpu[i];
    const double allowed = tolerance.relative * std::fabs(cpu[i]) + tolerance.floor * largest;
    const double ratio = allowed > 0.0 ? error / allowed : (error > 0.0 ? INFINITY : 0.0);
    if (ratio > worst_ratio) worst_ratio = ratio, worst = static_cast<int64_t>(i);
    if (ratio > 1.0 && ++bad_elements <= 5) {
      examples += fmt::format("\n  [{}] gpu {:.8g} cpu {:.8g} error {:.3g} > allowed {:.3g}", i,
                              gpu[i], cpu[i], error, allowed);
    }
  }
  const double norm_error = reference_squares > 0.0
                                ? std::sqrt(difference_squares / reference_squares)
                                : std::sqrt(difference_squares);
  if (verbose()) {
    std::printf("[ compare  ] %s: relative error %.3g (tolerance %.3g), worst element at %lld\n",
                what.c_str(), norm_error, tolerance.norm, static_cast<long long>(worst));
  }
  EXPECT_TRUE(nonfinite == 0 && bad_elements == 0 && norm_error <= tolerance.norm)
      << what << ": |gpu - cpu| / |cpu| = " << norm_error << " (tolerance " << tolerance.norm
      << "); " << nonfinite << " NaN/inf from the GPU (first at " << first_nonfinite << "); "
      << bad_elements << " of " << cpu.size() << " elements beyond " << tolerance.relative
      << " |cpu| + " << tolerance.floor << " max|cpu| (max|cpu| = " << largest << ")" << examples;
}

// Sums over tokens (parameter and modulation gradients) err relative to their terms, not to
// themselves: |gpu - cpu| <= 1e-5 (terms + |cpu|), terms the sum of the terms' magnitudes. The
// first five misses are reported.
template <typename T>
void expect_close_sums(const std::vector<T>& gpu, const std::vector<double>& cpu,
                       const std::vector<double>& terms, const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  ASSERT_EQ(terms.size(), cpu.size()) << what;
  double worst_ratio = 0.0;
  int failures = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double error = std::fabs(double(gpu[i]) - cpu[i]);
    const double allowed = 1e-5 * (terms[i] + std::fabs(cpu[i]));
    worst_ratio = std::max(worst_ratio, error / allowed);
    if (!(error <= allowed) && ++failures <= 5) {
      ADD_FAILURE() << what << " [" << i << "]: gpu " << gpu[i] << " cpu " << cpu[i] << " error "
                    << error << " > allowed " << allowed << " (terms " << terms[i] << ")";
    }
  }
  if (verbose()) {
    std::printf("[ compare  ] %s: worst error / allowed %.3g\n", what.c_str(), worst_ratio);
  }
}

// The CPU's 1x128 block cast of x [rows, cols] (quantize_blocks), its scales moved to the GEMMs'
// block-major layout (block b of row r at b · rows + r): what the fused block casts write.
struct BlockMajorCast {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};
inline BlockMajorCast block_major_cast(const std::vector<bf16>& x, int64_t rows, int64_t cols,
                                       const BlockQuantization& spec) {
  const int64_t blocks = scale_grid(spec.scaling, rows, cols).cols;
  BlockMajorCast cast{std::vector<uint8_t>(x.size()), std::vector<float>(size_t(blocks * rows))};
  std::vector<float> grid(cast.scales.size());
  quantize_blocks(x.data(), rows, cols, spec, cast.codes.data(), grid.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      cast.scales[size_t(b * rows + r)] = grid[size_t(r * blocks + b)];
  return cast;
}

// |values|: inputs for a CPU run whose sums are the terms' magnitudes.
inline std::vector<double> absolute(std::vector<double> values) {
  for (double& value : values)
    value = std::fabs(value);
  return values;
}

// Lengths for the pointwise kernels: shorter than a vector, a vector tail, misaligned (offset 1
// element into the buffer), and more blocks than the grid has.
struct PointwiseCase {
  int64_t n;
  size_t offset;
};

inline constexpr PointwiseCase kPointwiseCases[] = {{1, 0},
                                                    {7, 0},
                                                    {8, 0},
                                                    {4099, 0},
                                                    {4099, 1},
                                                    {65536, 0},
                                                    {(1 << 20) + 3, 0},
                                                    {(1 << 20) + 3, 1}};

inline std::string describe(const PointwiseCase& c) {
  return fmt::format("n {}{}", c.n, c.offset ? " unaligned" : "");
}

// Bitwise equality of two GPU results (in place against out of place, repeated runs).
template <typename T>
void expect_bitwise_equal(const std::vector<T>& a, const std::vector<T>& b,
                          const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      ADD_FAILURE() << what << ": first difference at " << i;
      return;
    }
  }
}

// Device memory starting offset elements into its allocation: offset 1 makes a bf16 or fp32
// pointer that is not 16-byte aligned, for the kernels' unvectorized paths.
template <typename T>
class Device {
 public:
  explicit Device(size_t count, size_t offset = 0)
      : buffer_(count + offset), offset_(offset), count_(count) {}
  explicit Device(const std::vector<T>& host, size_t offset = 0) : Device(host.size(), offset) {
    upload(host);
  }

  T* get() const { return buffer_.get() + offset_; }
  void upload(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), count_);
    FP8T_CUDA_CHECK(cudaMemcpy(get(), host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    FP8T_CUDA_CHECK(cudaDeviceSynchronize());
    FP8T_CUDA_CHECK(cudaMemcpy(host.data(), get(), count_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  // All-ones bytes: NaN as bf16 and as fp32.
  void poison_nan() { FP8T_CUDA_CHECK(cudaMemset(get(), 0xFF, count_ * sizeof(T))); }

 private:
  DeviceBuffer<T> buffer_;
  size_t offset_;
  size_t count_;
};

// A test with its own stream, synchronized and checked for a pending error at the end, and a
// random generator whose seed the failure trace gives.
class StreamTest : public ::testing::Test {
 protected:
  void SetUp() override { FP8T_CUDA_CHECK(cudaStreamCreate(&stream_)); }
  void TearDown() override {
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
    FP8T_CUDA_CHECK(cudaGetLastError());
    FP8T_CUDA_CHECK(cudaStreamDestroy(stream_));
  }

  TestRng rng_;
  cudaStream_t stream_ = nullptr;
};

inline const char* store_name(ops::cuda::GradStore store) {
  return store == ops::cuda::GradStore::Write ? "write" : "add";
}

// An activation gradient before a backward: NaN for Write (every element must be written),
// random values for Add (which the CPU reference starts from too).
struct GradientStart {
  std::vector<bf16> device;
  std::vector<double> cpu;
};

inline GradientStart gradient_start(TestRng& rng, size_t count, ops::cuda::GradStore store) {
  if (store == ops::cuda::GradStore::Write) {
    return {std::vector<bf16>(count, bf16{0xFFFF}), std::vector<double>(count, 0.0)};
  }
  std::vector<bf16> start = random_bf16(rng, count);
  return {start, widen(start)};
}

}  // namespace fp8t::test
