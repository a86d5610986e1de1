// The GPU gates and small pointwise ops (ops/cuda/gpt_gates.h) against the CPU ops
// (ops/elementwise.h), which run in double on the same bf16-rounded inputs. Each comparison
// bounds ‖gpu − cpu‖ / ‖cpu‖ and every element; outputs a launcher writes are poisoned with NaN
// first, so an element it skips fails. Parameter gradients are sums over tokens: each is bounded
// relative to the sum of its terms' magnitudes, and must repeat bit for bit. Failures name the
// op, the shape and the case; the trace gives the seed to replay (FP8T_TEST_SEED).
// FP8T_TEST_VERBOSE=1 prints every comparison's error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "numerics/float_bits.h"
#include "numerics/test_util.h"
#include "ops/cuda/gpt_gates.h"
#include "ops/cuda/ops_cuda.h"
#include "ops/elementwise.h"
#include "ops/gpu_compare.h"

namespace fp8t {
namespace {

using ops::SmearShape;
using ops::ValueGateShape;
using ops::cuda::GradStore;
// The GPU test helpers (ops/gpu_compare.h).
using namespace test;

// ‖gpu − cpu‖ / ‖cpu‖ <= norm, and per element |gpu − cpu| <= relative |cpu| + floor max|cpu|.
// bf16 outputs: one rounding of an fp32 result (at most 2^-8 relative), with room for fp32 and
// double to round to different sides of a bf16 tie.
constexpr Tolerance kBf16Tolerance{1e-2, 1.0 / 128, 1e-4};
// fp32 outputs (gates, scaled values): fp32 math against double.
constexpr Tolerance kFp32Tolerance{1e-5, 2e-5, 1e-5};

class GptGatesCuda : public test::StreamTest {};

// ---------------------------------------------------------------------------------------------
// Value-embedding gate

struct ValueGateCase {
  ValueGateShape shape;  // tokens, channels, kv_heads, head_dim, gate_channels
  size_t offset;         // 1: unaligned bf16 pointers
};

std::string describe(const ValueGateCase& c) {
  const ValueGateShape& s = c.shape;
  return fmt::format("tokens {} channels {} kv_heads {} head_dim {} gate_channels {}{}", s.tokens,
                     s.channels, s.kv_heads, s.head_dim, s.gate_channels,
                     c.offset ? " unaligned" : "");
}

const ValueGateCase kValueGateCases[] = {
    {{1, 16, 1, 8, 12}, 0},         {{37, 64, 3, 128, 12}, 0}, {{37, 64, 3, 128, 12}, 1},
    {{29, 40, 2, 20, 12}, 0},        // head_dim not a multiple of 8: the scalar path
    {{33, 48, 4, 16, 40}, 0},        // more gate channels than lanes
    {{301, 96, 64, 8, 12}, 0},       // 768 gate weights
    {{4096, 1280, 10, 128, 12}, 0},  // nanochat d20's attention, 4096 tokens
};

TEST_F(GptGatesCuda, ValueGateMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const ValueGateCase& c : kValueGateCases) {
    const ValueGateShape& s = c.shape;
    const std::string shape = describe(c);
    const size_t kv_count = static_cast<size_t>(s.tokens * s.kv_heads * s.head_dim);
    const size_t x_count = static_cast<size_t>(s.tokens * s.channels);
    const size_t gate_count = static_cast<size_t>(s.tokens * s.kv_heads);
    const size_t weight_count = static_cast<size_t>(s.kv_heads * s.gate_channels);
    const std::vector<bf16> x_norm = random_bf16(rng_, x_count, -2.0, 2.0);
    const std::vector<bf16> value_embed = random_bf16(rng_, kv_count);
    const std::vector<bf16> v = random_bf16(rng_, kv_count);
    const std::vector<float> gate_weight = random_floats(rng_, weight_count, -0.5, 0.5);
    Device<bf16> device_x(x_norm, c.offset), device_ve(value_embed, c.offset);
    Device<bf16> device_v(v, c.offset);
    Device<float> device_w(gate_weight), device_gate(gate_count);

    device_gate.poison_nan();
    ops::cuda::value_gate_forward(device_v.get(), device_gate.get(), device_x.get(),
                                  device_ve.get(), device_w.get(), s, stream_);
    const std::vector<float> gpu_gate = device_gate.download();
    std::vector<double> cpu_v = widen(v), cpu_gate(gate_count);
    ops::value_gate_forward(cpu_v.data(), cpu_gate.data(), widen(x_norm).data(),
                            widen(value_embed).data(), widen(gate_weight).data(), s);
    expect_close(widen(device_v.download()), cpu_v, kBf16Tolerance,
                 "value_gate_forward v, " + shape);
    expect_close(widen(gpu_gate), cpu_gate, kFp32Tolerance, "value_gate_forward gate, " + shape);

    // Backward from the GPU forward's gate. dx_norm and dgate_weight accumulate, dvalue_embed
    // is written.
    const std::vector<bf16> dv = random_bf16(rng_, kv_count);
    const std::vector<bf16> dx_start = random_bf16(rng_, x_count);
    const std::vector<float> dw_start = random_floats(rng_, weight_count);
    Device<bf16> device_dv(dv, c.offset);
    std::vector<double> cpu_dx = widen(dx_start), cpu_dw = widen(dw_start), cpu_dve(kv_count);
    ops::value_gate_backward(cpu_dx.data(), cpu_dw.data(), cpu_dve.data(), widen(dv).data(),
                             widen(x_norm).data(), widen(value_embed).data(),
                             widen(gate_weight).data(), widen(gpu_gate).data(), s);
    std::vector<double> terms(weight_count), unused_dx(x_count), unused_dve(kv_count);
    ops::value_gate_backward(unused_dx.data(), terms.data(), unused_dve.data(),
                             absolute(widen(dv)).data(), absolute(widen(x_norm)).data(),
                             absolute(widen(value_embed)).data(),
                             absolute(widen(gate_weight)).data(), widen(gpu_gate).data(), s);

    Device<float> workspace(static_cast<size_t>(ops::cuda::kValueGateWorkspaceFloats));
    std::vector<float> first_dw;
    std::vector<bf16> first_dx;
    for (int run = 0; run < 2; ++run) {
      const std::string what = fmt::format("value_gate_backward (run {}), {}", run, shape);
      Device<bf16> device_dx(dx_start, c.offset), device_dve(kv_count, c.offset);
      Device<float> device_dw(dw_start);
      device_dve.poison_nan();
      workspace.poison_nan();
      ops::cuda::value_gate_backward(
          device_dx.get(), device_dw.get(), device_dve.get(), device_dv.get(), device_x.get(),
          device_ve.get(), device_w.get(), device_gate.get(), s, workspace.get(), stream_);
      const std::vector<bf16> gpu_dx = device_dx.download();
      const std::vector<float> gpu_dw = device_dw.download();
      expect_close(widen(gpu_dx), cpu_dx, kBf16Tolerance, what + " dx_norm");
      expect_close(widen(device_dve.download()), cpu_dve, kBf16Tolerance, what + " dvalue_embed");
      expect_close_sums(gpu_dw, cpu_dw, terms, what + " dgate_weight");
      if (run == 0) {
        first_dw = gpu_dw;
        first_dx = gpu_dx;
      } else {
        expect_bitwise_equal(gpu_dw, first_dw, what + " dgate_weight repeated");
        expect_bitwise_equal(gpu_dx, first_dx, what + " dx_norm repeated");
      }
    }
  }
}

TEST_F(GptGatesCuda, ValueGateBackwardRejectsMoreGateWeightsThanItAccumulates) {
  const ValueGateShape shape{4, 2048, 128, 8, 12};  // 1536 > kValueGateMaxWeights
  const size_t kv_count = static_cast<size_t>(shape.tokens * shape.kv_heads * shape.head_dim);
  Device<bf16> x(static_cast<size_t>(shape.tokens * shape.channels));
  Device<bf16> dx(static_cast<size_t>(shape.tokens * shape.channels));
  Device<bf16> dv(kv_count), value_embed(kv_count), dvalue_embed(kv_count);
  Device<float> gate_weight(static_cast<size_t>(shape.kv_heads * shape.gate_channels));
  Device<float> dgate_weight(static_cast<size_t>(shape.kv_heads * shape.gate_channels));
  Device<float> gate(static_cast<size_t>(shape.tokens * shape.kv_heads));
  Device<float> workspace(static_cast<size_t>(ops::cuda::kValueGateWorkspaceFloats));
  EXPECT_THROW(
      ops::cuda::value_gate_backward(dx.get(), dgate_weight.get(), dvalue_embed.get(), dv.get(),
                                     x.get(), value_embed.get(), gate_weight.get(), gate.get(),
                                     shape, workspace.get(), stream_),
      Error);
}

// ---------------------------------------------------------------------------------------------
// Smear

struct SmearCase {
  SmearShape shape;  // batch, seq_len, channels, gate_channels
  size_t offset;     // 1: unaligned bf16 pointers
};

std::string describe(const SmearCase& c) {
  const SmearShape& s = c.shape;
  return fmt::format("B {} T {} channels {} gate_channels {}{}", s.batch, s.seq_len, s.channels,
                     s.gate_channels, c.offset ? " unaligned" : "");
}

const SmearCase kSmearCases[] = {
    {{1, 1, 24, 24}, 0},  // one position: nothing to smear
    {{3, 17, 64, 24}, 0},   {{3, 17, 64, 24}, 1},
    {{2, 9, 30, 24}, 0},   // channels not a multiple of 8: the scalar path
    {{2, 5, 100, 40}, 0},  // more gate channels than lanes, scalar
    {{2, 7, 96, 40}, 0},   // the gate channels span five vectors
    {{4, 257, 768, 24}, 0}, {{4, 1024, 1280, 24}, 0},  // nanochat d20's width
};

TEST_F(GptGatesCuda, SmearMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const SmearCase& c : kSmearCases) {
    const SmearShape& s = c.shape;
    const std::string shape = describe(c);
    const size_t rows = static_cast<size_t>(s.batch * s.seq_len);
    const size_t n = rows * static_cast<size_t>(s.channels);
    const size_t weight_count = static_cast<size_t>(s.gate_channels);
    const std::vector<bf16> inp = random_bf16(rng_, n, -2.0, 2.0);
    const std::vector<float> gate_weight = random_floats(rng_, weight_count, -0.5, 0.5);
    const float smear_lambda = static_cast<float>(rng_.uniform(0.25, 1.0));
    Device<bf16> device_inp(inp, c.offset), device_out(n, c.offset);
    Device<float> device_w(gate_weight), device_gate(rows);
    Device<float> device_lambda(std::vector<float>{smear_lambda});

    device_out.poison_nan();
    device_gate.poison_nan();
    ops::cuda::smear_forward(device_out.get(), device_gate.get(), device_inp.get(), device_w.get(),
                             device_lambda.get(), s, stream_);
    const std::vector<float> gpu_gate = device_gate.download();
    std::vector<double> cpu_out(n), cpu_gate(rows);
    ops::smear_forward(cpu_out.data(), cpu_gate.data(), widen(inp).data(),
                       widen(gate_weight).data(), double(smear_lambda), s);
    expect_close(widen(device_out.download()), cpu_out, kBf16Tolerance,
                 "smear_forward out, " + shape);
    expect_close(widen(gpu_gate), cpu_gate, kFp32Tolerance, "smear_forward gate, " + shape);

    // Backward from the GPU forward's gate; the parameter gradients start from fixed values.
    const std::vector<bf16> dout = random_bf16(rng_, n);
    const std::vector<float> dw_start = random_floats(rng_, weight_count);
    const float dlambda_start = 0.375f;
    Device<bf16> device_dout(dout, c.offset);
    std::vector<double> dw_terms(weight_count), unused_dinp(n);
    double dlambda_terms = 0.0;
    ops::smear_backward(unused_dinp.data(), dw_terms.data(), &dlambda_terms,
                        absolute(widen(dout)).data(), absolute(widen(inp)).data(),
                        widen(gpu_gate).data(), absolute(widen(gate_weight)).data(),
                        std::fabs(double(smear_lambda)), s);

    Device<float> workspace(static_cast<size_t>(ops::cuda::kSmearWorkspaceFloats));
    std::vector<float> first_dw;
    float first_dlambda = 0.0f;
    for (GradStore store : {GradStore::Write, GradStore::Add}) {
      const std::string what = fmt::format("smear_backward ({}), {}", store_name(store), shape);
      GradientStart dinp = gradient_start(rng_, n, store);
      Device<bf16> device_dinp(dinp.device, c.offset);
      Device<float> device_dw(dw_start), device_dlambda(std::vector<float>{dlambda_start});
      workspace.poison_nan();
      ops::cuda::smear_backward(device_dinp.get(), device_dw.get(), device_dlambda.get(),
                                device_dout.get(), device_inp.get(), device_gate.get(),
                                device_w.get(), device_lambda.get(), s, store, workspace.get(),
                                stream_);
      std::vector<double> cpu_dw = widen(dw_start);
      double cpu_dlambda = dlambda_start;
      ops::smear_backward(dinp.cpu.data(), cpu_dw.data(), &cpu_dlambda, widen(dout).data(),
                          widen(inp).data(), widen(gpu_gate).data(), widen(gate_weight).data(),
                          double(smear_lambda), s);
      expect_close(widen(device_dinp.download()), dinp.cpu, kBf16Tolerance, what + " dinp");
      const std::vector<float> gpu_dw = device_dw.download();
      const float gpu_dlambda = device_dlambda.download()[0];
      expect_close_sums(gpu_dw, cpu_dw, dw_terms, what + " dgate_weight");
      expect_close_sums(std::vector<float>{gpu_dlambda}, {cpu_dlambda}, {dlambda_terms},
                        what + " dsmear_lambda");
      // The parameter gradients do not depend on the store, and repeat bit for bit.
      if (first_dw.empty()) {
        first_dw = gpu_dw;
        first_dlambda = gpu_dlambda;
      }
      expect_bitwise_equal(gpu_dw, first_dw, what + " dgate_weight repeated");
      expect_bitwise_equal(std::vector<float>{gpu_dlambda}, std::vector<float>{first_dlambda},
                           what + " dsmear_lambda repeated");
    }
  }
}

TEST_F(GptGatesCuda, SmearForwardRejectsOverlappingOutput) {
  const SmearShape shape{2, 8, 64, 24};
  const size_t n = static_cast<size_t>(shape.batch * shape.seq_len * shape.channels);
  Device<bf16> inp(n + 8);
  Device<float> gate(static_cast<size_t>(shape.batch * shape.seq_len));
  Device<float> gate_weight(static_cast<size_t>(shape.gate_channels)), lambda(1);
  for (size_t shift : {size_t{0}, size_t{8}}) {
    EXPECT_THROW(ops::cuda::smear_forward(inp.get() + shift, gate.get(), inp.get(),
                                          gate_weight.get(), lambda.get(), shape, stream_),
                 Error)
        << "out = inp + " << shift;
  }
}

// ---------------------------------------------------------------------------------------------
// Backout, add and scale

TEST_F(GptGatesCuda, BackoutMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const PointwiseCase& c : kPointwiseCases) {
    const std::string shape = describe(c);
    const size_t n = static_cast<size_t>(c.n);
    const std::vector<bf16> x = random_bf16(rng_, n, -4.0, 4.0);
    const std::vector<bf16> x_backout = random_bf16(rng_, n, -4.0, 4.0);
    const float backout_lambda = static_cast<float>(rng_.uniform(0.0, 1.0));
    Device<float> lambda(std::vector<float>{backout_lambda});
    Device<bf16> device_x(x, c.offset), device_xb(x_backout, c.offset), out(n, c.offset);

    out.poison_nan();
    ops::cuda::backout_forward(out.get(), device_x.get(), device_xb.get(), lambda.get(), c.n,
                               stream_);
    const std::vector<bf16> gpu_out = out.download();
    std::vector<double> cpu_out(n);
    ops::backout_forward(cpu_out.data(), widen(x).data(), widen(x_backout).data(),
                         double(backout_lambda), c.n);
    expect_close(widen(gpu_out), cpu_out, kBf16Tolerance, "backout_forward, " + shape);

    const std::vector<bf16> dout = random_bf16(rng_, n);
    Device<bf16> device_dout(dout, c.offset);
    Device<float> workspace(static_cast<size_t>(ops::cuda::kBackoutWorkspaceFloats));
    double terms = 0.0;
    for (size_t i = 0; i < n; ++i)
      terms += std::fabs(double(bf16_to_float(dout[i])) * bf16_to_float(x_backout[i]));
    const GradStore store_pairs[][2] = {{GradStore::Write, GradStore::Write},
                                        {GradStore::Add, GradStore::Add},
                                        {GradStore::Add, GradStore::Write}};
    std::vector<float> first_dlambda;
    for (const auto& stores : store_pairs) {
      const std::string what = fmt::format("backout_backward (dx {}, dx_backout {}), {}",
                                           store_name(stores[0]), store_name(stores[1]), shape);
      GradientStart dx = gradient_start(rng_, n, stores[0]);
      GradientStart dxb = gradient_start(rng_, n, stores[1]);
      Device<bf16> device_dx(dx.device, c.offset), device_dxb(dxb.device, c.offset);
      const float dlambda_start = -0.25f;
      Device<float> dlambda(std::vector<float>{dlambda_start});
      workspace.poison_nan();
      ops::cuda::backout_backward(device_dx.get(), device_dxb.get(), dlambda.get(),
                                  device_dout.get(), device_xb.get(), lambda.get(), c.n, stores[0],
                                  stores[1], workspace.get(), stream_);
      double cpu_dlambda = dlambda_start;
      ops::backout_backward(dx.cpu.data(), dxb.cpu.data(), &cpu_dlambda, widen(dout).data(),
                            widen(x_backout).data(), double(backout_lambda), c.n);
      expect_close(widen(device_dx.download()), dx.cpu, kBf16Tolerance, what + " dx");
      expect_close(widen(device_dxb.download()), dxb.cpu, kBf16Tolerance, what + " dx_backout");
      const std::vector<float> gpu_dlambda = dlambda.download();
      expect_close_sums(gpu_dlambda, {cpu_dlambda}, {terms}, what + " dbackout_lambda");
      if (first_dlambda.empty()) first_dlambda = gpu_dlambda;
      expect_bitwise_equal(gpu_dlambda, first_dlambda, what + " dbackout_lambda repeated");
    }

    ops::cuda::backout_forward(device_x.get(), device_x.get(), device_xb.get(), lambda.get(), c.n,
                               stream_);
    expect_bitwise_equal(device_x.download(), gpu_out, "backout_forward in place, " + shape);
  }
}

TEST_F(GptGatesCuda, AddAndScaleMatchCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const PointwiseCase& c : kPointwiseCases) {
    const std::string shape = describe(c);
    const size_t n = static_cast<size_t>(c.n);
    const std::vector<bf16> a = random_bf16(rng_, n, -4.0, 4.0);
    const std::vector<bf16> b = random_bf16(rng_, n, -4.0, 4.0);
    Device<bf16> device_a(a, c.offset), device_b(b, c.offset), out(n, c.offset);
    out.poison_nan();
    ops::cuda::add_forward(out.get(), device_a.get(), device_b.get(), c.n, stream_);
    const std::vector<bf16> gpu_out = out.download();
    std::vector<double> cpu_out(n);
    for (size_t i = 0; i < n; ++i)
      cpu_out[i] = double(bf16_to_float(a[i])) + bf16_to_float(b[i]);
    expect_close(widen(gpu_out), cpu_out, kBf16Tolerance, "add_forward, " + shape);
    // In place into either input: the same bits.
    ops::cuda::add_forward(device_b.get(), device_a.get(), device_b.get(), c.n, stream_);
    expect_bitwise_equal(device_b.download(), gpu_out, "add_forward into b, " + shape);
    Device<bf16> device_b_again(b, c.offset);
    ops::cuda::add_forward(device_a.get(), device_a.get(), device_b_again.get(), c.n, stream_);
    expect_bitwise_equal(device_a.download(), gpu_out, "add_forward into a, " + shape);

    const std::vector<float> x = random_floats(rng_, n, -100.0, 100.0);
    const float factor = 1.0f / 3.0f;
    Device<float> device_x(x, c.offset);
    ops::cuda::scale_f32(device_x.get(), factor, c.n, stream_);
    std::vector<double> cpu_x(n);
    for (size_t i = 0; i < n; ++i)
      cpu_x[i] = double(x[i]) * factor;
    expect_close(widen(device_x.download()), cpu_x, kFp32Tolerance, "scale_f32, " + shape);
  }
}

}  // namespace
}  // namespace fp8t
