// FP8 attention on the GPU (ops/cuda/attention_fp8_cuda.h: casts and cuDNN's FP8 SDPA) against
// the CPU emulation (ops/attention_fp8.h) in double, and against exact attention. The scales the
// device computed are checked bit for bit against the CPU rule applied to the device's amaxes;
// the outputs are compared within FP8 rounding (the flash kernel quantizes the probabilities
// relative to a running maximum, the emulation after normalizing). Outputs are NaN-poisoned.
// Failures name the shape; the trace gives the seed (FP8T_TEST_SEED); FP8T_TEST_VERBOSE=1 prints
// every comparison's error.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "numerics/float_bits.h"
#include "numerics/test_util.h"
#include "ops/attention.h"
#include "ops/attention_fp8.h"
#include "ops/cuda/attention_cudnn.h"
#include "ops/cuda/attention_fp8_cuda.h"
#include "ops/gpu_compare.h"

namespace fp8t {
namespace {

using ops::AttentionFp8Amaxes;
using ops::AttentionFp8Formats;
using ops::AttentionFp8Scales;
using ops::AttentionShape;
using ops::cuda::CudaFp8Attention;
using ops::cuda::CudnnAttention;
using ops::cuda::Fp8AttentionSaved;
using ops::cuda::Fp8AttentionScratch;
using test::expect_close;
using test::random_bf16;
using test::TestRng;
using test::Tolerance;
using test::widen;

namespace slot = ops::cuda;

// Against the emulation: the same quantization points, but the flash kernel's probabilities
// round differently, and the output (E4M3) and gradients (E5M2) then land on other codes; the
// H200 measured norms up to 0.049 (out) and 0.098 (dk). Single elements can differ by more
// than their own size: a row of dS sums to zero, so dQ and dK are small sums of large terms,
// which one code rounded the other way moves; the element bound only catches gross errors.
constexpr Tolerance kOutTolerance{0.07, 1.0, 0.1};
constexpr Tolerance kGradTolerance{0.12, 1.0, 0.25};
// Against exact attention: what FP8 costs (E4M3 forward, E5M2 gradients); the emulation's own
// error measured 0.06 (out) and 0.09 to 0.11 (gradients).
constexpr Tolerance kOutExactTolerance{0.08, 1.0, 0.1};
constexpr Tolerance kGradExactTolerance{0.15, 1.0, 0.25};
// The GPU's error against exact attention may exceed the emulation's by this factor: it is as
// accurate as FP8 attention can be, not just close to one FP8 answer.
constexpr double kErrorRatio = 1.25;
// fp32 log-sum-exp of the same FP8 q and k (single elements measured up to 2e-4 off).
constexpr Tolerance kStatsTolerance{1e-4, 1e-3, 1e-3};

template <typename T>
void poison_nan(DeviceBuffer<T>& buffer) {
  FP8T_CUDA_CHECK(cudaMemset(buffer.get(), 0xFF, buffer.bytes()));
}

std::string describe(const AttentionShape& s) {
  return fmt::format("B={} T={} H={} Hkv={} D={} {}", s.batch, s.seq_len, s.heads, s.kv_heads,
                     s.head_dim,
                     !s.causal                   ? "no mask"
                     : s.window >= s.seq_len - 1 ? "full causal"
                                                 : fmt::format("window {}", s.window));
}

double amax_of(const std::vector<double>& values) {
  double amax = 0.0;
  for (double value : values)
    amax = std::max(amax, std::fabs(value));
  return amax;
}

// ‖a − b‖ / ‖b‖
double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double difference = 0.0, norm = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    difference += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return std::sqrt(difference / norm);
}

// The GPU is at most kErrorRatio times as far from exact attention as the emulation.
void expect_as_accurate(const std::vector<double>& gpu, const std::vector<double>& emulation,
                        const std::vector<double>& exact, const std::string& what) {
  const double gpu_error = relative_error(gpu, exact);
  const double emulation_error = relative_error(emulation, exact);
  EXPECT_LE(gpu_error, kErrorRatio * emulation_error + 1e-3)
      << what << ": the GPU's error against exact attention, " << gpu_error
      << ", against the emulation's " << emulation_error;
}

// The device's scale and descale of tensor t equal the CPU rule's scale, bit for bit.
void expect_scale(const std::vector<float>& floats, ops::cuda::AttentionFp8Tensor t, float scale,
                  const std::string& what) {
  EXPECT_EQ(float_to_bits(floats[size_t(slot::attention_fp8_scale_slot(t))]), float_to_bits(scale))
      << what << ": device scale " << floats[size_t(slot::attention_fp8_scale_slot(t))]
      << ", CPU rule " << scale;
  EXPECT_EQ(float_to_bits(floats[size_t(slot::attention_fp8_descale_slot(t))]),
            float_to_bits(1.0f / scale))
      << what << ": descale";
}

float amax_at(const std::vector<float>& floats, ops::cuda::AttentionFp8Tensor t) {
  return floats[size_t(slot::attention_fp8_amax_slot(t))];
}

class CudaFp8AttentionTest : public test::StreamTest {
 protected:
  void check_shape(const AttentionShape& shape, double gradient_size) {
    const std::string what = describe(shape);
    SCOPED_TRACE(what);
    const AttentionFp8Formats formats;  // hybrid: E4M3 forward, E5M2 backward
    const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(shape.head_dim)));
    const auto q_count = size_t(shape.batch * shape.seq_len * shape.heads * shape.head_dim);
    const auto kv_count = size_t(shape.batch * shape.seq_len * shape.kv_heads * shape.head_dim);
    const auto stats_count = size_t(shape.batch * shape.heads * shape.seq_len);

    const std::vector<bf16> q = random_bf16(rng_, q_count, -2.0, 2.0);
    const std::vector<bf16> k = random_bf16(rng_, kv_count, -2.0, 2.0);
    const std::vector<bf16> v = random_bf16(rng_, kv_count, -1.5, 1.5);
    // Gradients far from 1: the scales, not luck, must bring them into FP8's range.
    const std::vector<bf16> dout = random_bf16(rng_, q_count, -gradient_size, gradient_size);
    const std::vector<double> q64 = widen(q), k64 = widen(k), v64 = widen(v), dout64 = widen(dout);

    DeviceBuffer<bf16> q_d(q), k_d(k), v_d(v), dout_d(dout);
    DeviceBuffer<bf16> out_d(q_count), dq_d(q_count), dk_d(kv_count), dv_d(kv_count);
    DeviceBuffer<float> stats_d(stats_count), floats_d(size_t(ops::cuda::kAttentionFp8Floats));
    DeviceBuffer<uint8_t> q8(q_count), k8(kv_count), v8(kv_count), out8(q_count);
    DeviceBuffer<uint8_t> dout8(q_count), dq8(q_count), dk8(kv_count), dv8(kv_count);
    FP8T_CUDA_CHECK(cudaMemset(floats_d.get(), 0, floats_d.bytes()));
    Fp8AttentionSaved saved{q8.get(), k8.get(), v8.get(), out8.get(), floats_d.get()};
    const Fp8AttentionScratch scratch{dout8.get(), dq8.get(), dk8.get(), dv8.get()};
    CudaFp8Attention fp8_attention(attention_, formats);

    for (int round = 0; round < 2; ++round) {
      const std::string call = fmt::format("{} call {}", what, round + 1);
      for (DeviceBuffer<bf16>* buffer : {&out_d, &dq_d, &dk_d, &dv_d})
        poison_nan(*buffer);
      poison_nan(stats_d);
      const int64_t built_before = attention_.graphs_built();
      try {
        fp8_attention.forward(out_d.get(), stats_d.get(), q_d.get(), k_d.get(), v_d.get(), saved,
                              shape, scale, stream_);
        fp8_attention.backward(dq_d.get(), dk_d.get(), dv_d.get(), dout_d.get(), saved,
                               stats_d.get(), scratch, shape, scale, stream_);
        FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
      } catch (const Error& error) {
        FAIL() << "cuDNN " << CudnnAttention::cudnn_version() << " FP8 attention threw for " << call
               << ": " << error.what();
      }
      if (round == 0) {
        EXPECT_TRUE(saved.measured) << call << ": the first backward measures";
      } else {
        EXPECT_EQ(attention_.graphs_built(), built_before)
            << call << ": a repeated shape must reuse the cached graphs";
      }
      // The backward leaves the forward's floats alone: one download serves both checks.
      const std::vector<float> floats = floats_d.download();
      check_forward(call, shape, scale, formats, floats, q64, k64, v64, widen(out_d.download()),
                    widen(stats_d.download()));
      check_backward(call, shape, scale, formats, round == 0, q64, k64, v64, dout64, floats,
                     widen(dq_d.download()), widen(dk_d.download()), widen(dv_d.download()));
    }
  }

  void check_forward(const std::string& call, const AttentionShape& shape, float scale,
                     const AttentionFp8Formats& formats, const std::vector<float>& floats,
                     const std::vector<double>& q64, const std::vector<double>& k64,
                     const std::vector<double>& v64, const std::vector<double>& out,
                     const std::vector<double>& stats) {
    using ops::cuda::kFp8K;
    using ops::cuda::kFp8O;
    using ops::cuda::kFp8P;
    using ops::cuda::kFp8Q;
    using ops::cuda::kFp8V;
    // amax of bf16 values is exact on both sides.
    EXPECT_EQ(amax_at(floats, kFp8Q), static_cast<float>(amax_of(q64))) << call << ": amax q";
    EXPECT_EQ(amax_at(floats, kFp8K), static_cast<float>(amax_of(k64))) << call << ": amax k";
    EXPECT_EQ(amax_at(floats, kFp8V), static_cast<float>(amax_of(v64))) << call << ": amax v";
    AttentionFp8Scales scales;
    ops::attention_fp8_forward_scales(scales, amax_at(floats, kFp8Q), amax_at(floats, kFp8K),
                                      amax_at(floats, kFp8V), formats);
    expect_scale(floats, kFp8Q, scales.q, call + " q");
    expect_scale(floats, kFp8K, scales.k, call + " k");
    expect_scale(floats, kFp8V, scales.v, call + " v");
    expect_scale(floats, kFp8P, scales.p, call + " P");
    expect_scale(floats, kFp8O, scales.o, call + " O");
    forward_scales_ = scales;

    out64_.assign(q64.size(), 0.0);
    lse64_.assign(stats.size(), 0.0);
    AttentionFp8Amaxes amaxes;
    ops::attention_fp8_forward<double>(out64_.data(), lse64_.data(), q64.data(), k64.data(),
                                       v64.data(), shape, scale, formats, scales, &amaxes);
    // cuDNN's P is exp(score − running max): at most 1 (to its exp's rounding), like the
    // normalized probabilities.
    const float amax_p = amax_at(floats, kFp8P);
    EXPECT_TRUE(amax_p > 0.0f && amax_p <= 1.001f) << call << ": amax P " << amax_p;
    EXPECT_NEAR(amax_at(floats, kFp8O), amaxes.o, 0.1 * amaxes.o) << call << ": amax O";
    expect_close(out, out64_, kOutTolerance, call + " out");
    expect_close(stats, lse64_, kStatsTolerance, call + " stats");

    std::vector<double> exact_out(q64.size());
    exact_lse_.assign(stats.size(), 0.0);
    ops::attention_forward<double>(exact_out.data(), exact_lse_.data(), q64.data(), k64.data(),
                                   v64.data(), shape, scale);
    expect_close(out, exact_out, kOutExactTolerance, call + " out vs exact attention");
    expect_as_accurate(out, out64_, exact_out, call + " out");
  }

  void check_backward(const std::string& call, const AttentionShape& shape, float scale,
                      const AttentionFp8Formats& formats, bool first,
                      const std::vector<double>& q64, const std::vector<double>& k64,
                      const std::vector<double>& v64, const std::vector<double>& dout64,
                      const std::vector<float>& floats, const std::vector<double>& dq,
                      const std::vector<double>& dk, const std::vector<double>& dv) {
    using ops::cuda::kFp8Dk;
    using ops::cuda::kFp8Dout;
    using ops::cuda::kFp8Dq;
    using ops::cuda::kFp8Ds;
    using ops::cuda::kFp8Dv;
    // The CPU rule: the first backward measures twice (from scale 1, then from what that
    // measured) and scales from the second; a later one scales from the previous backward's.
    AttentionFp8Scales scales = forward_scales_;
    AttentionFp8Amaxes previous = first ? AttentionFp8Amaxes{} : previous_;
    std::vector<double> dq64, dk64, dv64;
    AttentionFp8Amaxes measured;
    const auto backward = [&] {
      ops::attention_fp8_backward_scales(scales, static_cast<float>(amax_of(dout64)), previous,
                                         formats);
      dq64.assign(q64.size(), 0.0);
      dk64.assign(k64.size(), 0.0);
      dv64.assign(v64.size(), 0.0);
      ops::attention_fp8_backward<double>(dq64.data(), dk64.data(), dv64.data(), dout64.data(),
                                          q64.data(), k64.data(), v64.data(), out64_.data(),
                                          lse64_.data(), shape, scale, formats, scales, &measured);
    };
    for (int run = 0; first && run < 2; ++run) {
      backward();
      previous = measured;
    }
    backward();
    previous_ = measured;

    // The device measured about what the emulation did, and scaled dO by the rule.
    const std::tuple<const char*, float, float> amaxes[] = {
        {"dS", amax_at(floats, kFp8Ds), measured.ds},
        {"dQ", amax_at(floats, kFp8Dq), measured.dq},
        {"dK", amax_at(floats, kFp8Dk), measured.dk},
        {"dV", amax_at(floats, kFp8Dv), measured.dv}};
    for (const auto& [name, gpu, cpu] : amaxes)
      EXPECT_NEAR(gpu, cpu, 0.15 * cpu) << call << ": amax " << name;
    EXPECT_EQ(amax_at(floats, kFp8Dout), static_cast<float>(amax_of(dout64))) << call;
    expect_scale(floats, kFp8Dout, scales.dout, call + " dO");

    expect_close(dq, dq64, kGradTolerance, call + " dq");
    expect_close(dk, dk64, kGradTolerance, call + " dk");
    expect_close(dv, dv64, kGradTolerance, call + " dv");

    std::vector<double> dq_exact(q64.size(), 0.0), dk_exact(k64.size(), 0.0),
        dv_exact(v64.size(), 0.0);
    ops::attention_backward<double>(dq_exact.data(), dk_exact.data(), dv_exact.data(),
                                    dout64.data(), q64.data(), k64.data(), v64.data(),
                                    exact_lse_.data(), shape, scale);
    expect_close(dq, dq_exact, kGradExactTolerance, call + " dq vs exact attention");
    expect_close(dk, dk_exact, kGradExactTolerance, call + " dk vs exact attention");
    expect_close(dv, dv_exact, kGradExactTolerance, call + " dv vs exact attention");
    expect_as_accurate(dq, dq64, dq_exact, call + " dq");
    expect_as_accurate(dk, dk64, dk_exact, call + " dk");
    expect_as_accurate(dv, dv64, dv_exact, call + " dv");
  }

  CudnnAttention attention_;
  AttentionFp8Scales forward_scales_;
  AttentionFp8Amaxes previous_;
  std::vector<double> out64_, lse64_, exact_lse_;
};

// d24's attention (head_dim 128, full causal), batch and length cut down.
TEST_F(CudaFp8AttentionTest, FullCausalMatchesEmulation) {
  SCOPED_TRACE(rng_.trace());
  check_shape({2, 256, 2, 2, 128, 255}, 1e-3);
}

TEST_F(CudaFp8AttentionTest, GroupedQueryHeadsMatchEmulation) {
  SCOPED_TRACE(rng_.trace());
  check_shape({1, 192, 4, 2, 128, 191}, 1e-2);
}

// Flux's joint attention: no mask, gradients of order one.
TEST_F(CudaFp8AttentionTest, NoMaskMatchesEmulation) {
  SCOPED_TRACE(rng_.trace());
  AttentionShape shape{1, 320, 2, 2, 128, 0};
  shape.causal = false;
  check_shape(shape, 1.0);
}

// A zero output gradient (the GPT's first step, its projections zero-initialized) gives zero
// gradients and measures nothing: the next backward measures again.
TEST_F(CudaFp8AttentionTest, ZeroGradientMeasuresAgainNextTime) {
  SCOPED_TRACE(rng_.trace());
  const AttentionShape shape{1, 128, 1, 1, 128, 127};
  const size_t count = 128 * 128;
  DeviceBuffer<bf16> q(random_bf16(rng_, count)), k(random_bf16(rng_, count));
  DeviceBuffer<bf16> v(random_bf16(rng_, count)), out(count), dq(count), dk(count), dv(count);
  DeviceBuffer<bf16> dout(std::vector<bf16>(count, float_to_bf16(0.0f)));
  DeviceBuffer<float> stats(128), floats(size_t(ops::cuda::kAttentionFp8Floats));
  DeviceBuffer<uint8_t> q8(count), k8(count), v8(count), out8(count);
  DeviceBuffer<uint8_t> dout8(count), dq8(count), dk8(count), dv8(count);
  FP8T_CUDA_CHECK(cudaMemset(floats.get(), 0, floats.bytes()));
  Fp8AttentionSaved saved{q8.get(), k8.get(), v8.get(), out8.get(), floats.get()};
  const Fp8AttentionScratch scratch{dout8.get(), dq8.get(), dk8.get(), dv8.get()};
  CudaFp8Attention fp8_attention(attention_, AttentionFp8Formats{});
  const float scale = 0.0884f;
  fp8_attention.forward(out.get(), stats.get(), q.get(), k.get(), v.get(), saved, shape, scale,
                        stream_);
  poison_nan(dq);
  fp8_attention.backward(dq.get(), dk.get(), dv.get(), dout.get(), saved, stats.get(), scratch,
                         shape, scale, stream_);
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
  EXPECT_FALSE(saved.measured);
  for (const bf16 value : dq.download())
    ASSERT_EQ(bf16_to_float(value), 0.0f);
  // A real gradient now: measured, and dq no longer zero.
  DeviceBuffer<bf16> dout2(random_bf16(rng_, count, -1e-4, 1e-4));
  fp8_attention.backward(dq.get(), dk.get(), dv.get(), dout2.get(), saved, stats.get(), scratch,
                         shape, scale, stream_);
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
  EXPECT_TRUE(saved.measured);
  double sum = 0.0;
  for (const bf16 value : dq.download())
    sum += std::fabs(bf16_to_float(value));
  EXPECT_GT(sum, 0.0) << "dq underflowed: the measuring runs did not scale it";
}

// AMD's fnuz formats are emulated on the CPU only: the GPU refuses them by name.
TEST_F(CudaFp8AttentionTest, FnuzFormatsAreRefusedByName) {
  const AttentionShape shape{1, 64, 1, 1, 128, 63};
  const size_t count = 64 * 128;
  TestRng& rng = rng_;
  const std::vector<bf16> x = random_bf16(rng, count);
  DeviceBuffer<bf16> q(x), out(count);
  DeviceBuffer<float> stats(64), floats(size_t(ops::cuda::kAttentionFp8Floats));
  DeviceBuffer<uint8_t> q8(count), k8(count), v8(count), out8(count);
  FP8T_CUDA_CHECK(cudaMemset(floats.get(), 0, floats.bytes()));
  Fp8AttentionSaved saved{q8.get(), k8.get(), v8.get(), out8.get(), floats.get()};
  AttentionFp8Formats formats;
  formats.forward = Fp8Format::E4M3FNUZ;
  formats.backward = Fp8Format::E5M2FNUZ;
  CudaFp8Attention fp8_attention(attention_, formats);
  try {
    fp8_attention.forward(out.get(), stats.get(), q.get(), q.get(), q.get(), saved, shape, 0.1f,
                          stream_);
    FAIL() << "fnuz FP8 attention ran on the GPU";
  } catch (const Error& error) {
    EXPECT_NE(std::strstr(error.what(), "fp8_dot_product_attention"), nullptr) << error.what();
    EXPECT_NE(std::strstr(error.what(), "e4m3fnuz"), nullptr) << error.what();
  }
}

}  // namespace
}  // namespace fp8t
