// cuDNN SDPA attention (ops/cuda/attention_cudnn.h) against the CPU op (ops/attention.h), run in
// double on the same bf16-rounded inputs. Each comparison bounds ‖gpu − cpu‖ / ‖cpu‖ and every
// element; outputs are NaN-poisoned first, so an element cuDNN skips fails. A configuration
// cuDNN rejects (a sliding window this cuDNN cannot run, say) fails with cuDNN's reason and
// version instead of crashing. Failures name the shape; the trace gives the seed to replay
// (FP8T_TEST_SEED). FP8T_TEST_VERBOSE=1 prints every comparison's error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "numerics/float_bits.h"
#include "numerics/test_util.h"
#include "ops/attention.h"
#include "ops/cuda/attention_cudnn.h"
#include "ops/gpu_compare.h"

namespace fp8t {
namespace {

using test::expect_close;
using test::random_bf16;
using test::Tolerance;
using test::widen;

using ops::AttentionShape;
using ops::cuda::CudnnAttention;
using test::TestRng;

// ‖gpu − cpu‖ / ‖cpu‖ <= norm, and per element |gpu − cpu| <= relative |cpu| + floor max|cpu|.
// bf16 out: cuDNN rounds the probabilities to bf16 for the P·V product, then the output.
constexpr Tolerance kOutTolerance{1e-2, 2e-2, 1e-2};
// bf16 gradients: two more bf16 products (dP, dS) on top of the forward's roundings.
constexpr Tolerance kGradTolerance{2e-2, 5e-2, 2e-2};
// fp32 log-sum-exp of fp32 scores from exact bf16 inputs.
constexpr Tolerance kStatsTolerance{1e-4, 1e-4, 1e-4};

// All-ones bytes: NaN as bf16 and as fp32.
template <typename T>
void poison_nan(DeviceBuffer<T>& buffer) {
  FP8T_CUDA_CHECK(cudaMemset(buffer.get(), 0xFF, buffer.bytes()));
}

std::string describe(const AttentionShape& s) {
  return fmt::format("B={} T={} H={} Hkv={} D={} window={}{}", s.batch, s.seq_len, s.heads,
                     s.kv_heads, s.head_dim, s.window,
                     !s.causal                   ? " (no mask)"
                     : s.window >= s.seq_len - 1 ? " (full causal)"
                                                 : " (sliding window)");
}

class CudnnAttentionTest : public test::StreamTest {
 protected:
  // Forward and backward of one shape against the CPU op, then the same calls again, which
  // must reuse the cached graphs. new_graphs: what the first call builds (0 where an equivalent
  // shape ran before).
  void check_shape(const AttentionShape& shape, int64_t new_graphs = 2) {
    const std::string what = describe(shape);
    SCOPED_TRACE(what);
    const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(shape.head_dim)));
    const size_t q_count =
        static_cast<size_t>(shape.batch * shape.seq_len * shape.heads * shape.head_dim);
    const size_t kv_count =
        static_cast<size_t>(shape.batch * shape.seq_len * shape.kv_heads * shape.head_dim);
    const size_t stats_count = static_cast<size_t>(shape.batch * shape.heads * shape.seq_len);

    // q, k in [-2, 2): peaked enough softmax rows that a wrong mask shows.
    const std::vector<bf16> q = random_bf16(rng_, q_count, -2.0, 2.0);
    const std::vector<bf16> k = random_bf16(rng_, kv_count, -2.0, 2.0);
    const std::vector<bf16> v = random_bf16(rng_, kv_count, -1.0, 1.0);
    const std::vector<bf16> dout = random_bf16(rng_, q_count, -1.0, 1.0);

    // CPU reference in double (backward adds, so its gradients start at zero).
    const std::vector<double> q64 = widen(q), k64 = widen(k), v64 = widen(v), dout64 = widen(dout);
    std::vector<double> out64(q_count), lse64(stats_count), dq64(q_count, 0.0), dk64(kv_count, 0.0),
        dv64(kv_count, 0.0);
    ops::attention_forward<double>(out64.data(), lse64.data(), q64.data(), k64.data(), v64.data(),
                                   shape, scale);
    ops::attention_backward<double>(dq64.data(), dk64.data(), dv64.data(), dout64.data(),
                                    q64.data(), k64.data(), v64.data(), lse64.data(), shape, scale);

    DeviceBuffer<bf16> q_d(q), k_d(k), v_d(v), dout_d(dout);
    DeviceBuffer<bf16> out_d(q_count), dq_d(q_count), dk_d(kv_count), dv_d(kv_count);
    DeviceBuffer<float> stats_d(stats_count);
    for (int round = 0; round < 2; ++round) {
      const std::string call = fmt::format("{} call {}", what, round + 1);
      poison_nan(out_d);
      poison_nan(stats_d);
      poison_nan(dq_d);
      poison_nan(dk_d);
      poison_nan(dv_d);
      const int64_t built_before = attention_.graphs_built();
      try {
        attention_.forward(out_d.get(), stats_d.get(), q_d.get(), k_d.get(), v_d.get(), shape,
                           scale, stream_);
        attention_.backward(dq_d.get(), dk_d.get(), dv_d.get(), dout_d.get(), q_d.get(), k_d.get(),
                            v_d.get(), out_d.get(), stats_d.get(), shape, scale, stream_);
      } catch (const Error& error) {
        const bool unsupported = std::strstr(error.what(), "not supported") != nullptr;
        FAIL() << (unsupported ? "cuDNN " + std::to_string(CudnnAttention::cudnn_version()) +
                                     " cannot run " + what +
                                     (shape.causal && shape.window < shape.seq_len - 1
                                          ? " — this cuDNN does not support this SLIDING WINDOW"
                                          : "") +
                                     ": "
                               : "cuDNN attention threw for " + what + ": ")
               << error.what();
      }
      FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
      if (round == 0) {
        EXPECT_EQ(attention_.graphs_built(), built_before + new_graphs)
            << call << ": expected " << new_graphs << " new graphs (forward and backward)";
      } else {
        EXPECT_EQ(attention_.graphs_built(), built_before)
            << call << ": a repeated shape must reuse the cached graphs";
      }
      expect_close(widen(out_d.download()), out64, kOutTolerance, call + " out");
      expect_close(widen(stats_d.download()), lse64, kStatsTolerance,
                   call + " stats (natural-log log-sum-exp of the scaled scores)");
      expect_close(widen(dq_d.download()), dq64, kGradTolerance, call + " dq");
      expect_close(widen(dk_d.download()), dk64, kGradTolerance, call + " dk");
      expect_close(widen(dv_d.download()), dv64, kGradTolerance, call + " dv");
    }
  }

  CudnnAttention attention_;
};

TEST_F(CudnnAttentionTest, FullCausalMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  std::printf("[ cudnn    ] version %lld\n",
              static_cast<long long>(CudnnAttention::cudnn_version()));
  check_shape({2, 256, 4, 4, 128, 255});
}

TEST_F(CudnnAttentionTest, SlidingWindow64MatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  check_shape({2, 256, 4, 4, 128, 64});
}

TEST_F(CudnnAttentionTest, SlidingWindow128HeadDim64MatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  check_shape({1, 512, 2, 2, 64, 128});
}

TEST_F(CudnnAttentionTest, GroupedQueryHeadsMatchCpu) {
  SCOPED_TRACE(rng_.trace());
  check_shape({1, 256, 4, 2, 128, 255});
}

// Windows past seq_len - 1 are all the full-causal graph: a larger one builds nothing new.
TEST_F(CudnnAttentionTest, WiderWindowReusesFullCausalGraph) {
  SCOPED_TRACE(rng_.trace());
  check_shape({1, 128, 2, 2, 64, 127});
  check_shape({1, 128, 2, 2, 64, 1000}, 0);
}

// Flux's joint attention: no mask (the window is ignored), a sequence that is not a multiple of
// 64 (512 text + 4096 image tokens at 1024², here a smaller odd split), and its own graphs
// beside a causal one of the same sizes.
TEST_F(CudnnAttentionTest, NoMaskMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  check_shape({2, 320, 4, 4, 128, 0, false});
  check_shape({2, 320, 4, 4, 128, 319});
  check_shape({1, 77 + 256, 2, 2, 64, 5, false});
}

}  // namespace
}  // namespace fp8t
