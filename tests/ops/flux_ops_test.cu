// The Flux GPU kernels (ops/cuda/flux_ops.h) against the CPU ops (ops/layernorm.h,
// modulation.h, gelu.h, flux_rope.h, rmsnorm.h, models/flux_objective.h), composed in double on
// the same bf16-rounded inputs where the GPU fuses them. Outputs a launcher writes start as NaN
// and outputs it adds to start from random values; rows and columns outside a strided or joint
// view must keep their bits. Sums over tokens are bounded relative to the sum of their terms'
// magnitudes and must repeat bit for bit. FP8 casts fused into the LayerNorm match the CPU's
// quantization of its output bit for bit. Failures name the op, the shape and the case; the
// trace gives the seed to replay (FP8T_TEST_SEED). FP8T_TEST_VERBOSE=1 prints every comparison.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/error.h"
#include "models/flux_objective.h"
#include "numerics/float_bits.h"
#include "numerics/quantize.h"
#include "numerics/scaling.h"
#include "numerics/test_util.h"
#include "ops/cuda/flux_ops.h"
#include "ops/cuda/ops_cuda.h"
#include "ops/flux_rope.h"
#include "ops/gelu.h"
#include "ops/gpu_compare.h"
#include "ops/layernorm.h"
#include "ops/modulation.h"
#include "ops/rmsnorm.h"

namespace fp8t {
namespace {

using ops::cuda::GradStore;
using ops::cuda::JointRows;
using ops::cuda::StreamShape;
// The GPU test helpers (ops/gpu_compare.h).
using namespace test;

// ‖gpu − cpu‖ / ‖cpu‖ <= norm, and per element |gpu − cpu| <= relative |cpu| + floor max|cpu|.
// bf16 outputs are one rounding of an fp32 result: at most half an ulp, 2^-8 relative (about
// 2^-9 / √3 in the mean square for random mantissas). The norm bound sits just above 2^-8, so it
// holds for any number of elements; per element 2^-7 leaves room for fp32 and double to round
// to different sides of a tie, and the floor for fp32 error where terms cancel.
constexpr Tolerance kBf16Tolerance{4e-3, 1.0 / 128, 1e-4};
// fp32 outputs (statistics): fp32 math against double.
constexpr Tolerance kFp32Tolerance{1e-5, 2e-5, 1e-5};
constexpr double kQkNormEps = 1e-6;

class FluxOpsCuda : public test::StreamTest {};

double as_double(bf16 value) {
  return bf16_to_float(value);
}
double as_double(float value) {
  return value;
}

// A view's rows inside a buffer [batch, sample_rows, ld]: row r = b · tokens + t is buffer row
// b · sample_rows + first + t, its `width` elements from column col.
struct RowView {
  int64_t batch, tokens, first, sample_rows, ld, col, width;

  int64_t rows() const { return batch * tokens; }
  int64_t count() const { return rows() * width; }
  size_t at(int64_t r, int64_t i) const {
    const int64_t b = r / tokens;
    return static_cast<size_t>((b * sample_rows + first + r - b * tokens) * ld + col + i);
  }
  size_t buffer_size() const { return static_cast<size_t>(batch * sample_rows * ld); }
};

// The view's elements of a buffer, row after row.
template <typename T>
std::vector<double> gather(const std::vector<T>& buffer, const RowView& view) {
  std::vector<double> values;
  values.reserve(static_cast<size_t>(view.count()));
  for (int64_t r = 0; r < view.rows(); ++r)
    for (int64_t i = 0; i < view.width; ++i)
      values.push_back(as_double(buffer[view.at(r, i)]));
  return values;
}

// The view's elements of a GPU result; every element outside the view must have kept its bits
// from `before`.
template <typename T>
std::vector<double> view_values(const std::vector<T>& gpu, const std::vector<T>& before,
                                const RowView& view, const std::string& what) {
  std::vector<bool> inside(gpu.size(), false);
  for (int64_t r = 0; r < view.rows(); ++r)
    for (int64_t i = 0; i < view.width; ++i)
      inside[view.at(r, i)] = true;
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (!inside[i] && std::memcmp(&gpu[i], &before[i], sizeof(T)) != 0) {
      ADD_FAILURE() << what << ": element " << i << " outside the view changed";
      break;
    }
  }
  return gather(gpu, view);
}

std::vector<double> plus(std::vector<double> a, const std::vector<double>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    a[i] += b[i];
  return a;
}

// Buffers an op starts from: NaN where it writes, random values where it adds.
std::vector<bf16> start_values(TestRng& rng, size_t count, GradStore store) {
  return store == GradStore::Write ? std::vector<bf16>(count, bf16{0xFFFF})
                                   : random_bf16(rng, count);
}

// ---------------------------------------------------------------------------------------------
// A stream's tokens: LayerNorm + modulation, the gated residual

struct StreamCase {
  int64_t batch, tokens, dim;
  int64_t x_first;        // x's rows start this far into each sample (a joint sequence)
  int64_t x_sample_rows;  // >= x_first + tokens
  int64_t mod_chunks;     // mod_stride = mod_chunks · dim: shift, scale, ..., gate (the last)
  int64_t dmod_pad;       // dmod_stride = mod_stride + dmod_pad
  size_t offset;          // 1: unaligned bf16 pointers
};

std::string describe(const StreamCase& c) {
  return fmt::format("B {} T {} dim {} x rows [{}, {}) of {}, mod chunks {}, dmod pad {}{}",
                     c.batch, c.tokens, c.dim, c.x_first, c.x_first + c.tokens, c.x_sample_rows,
                     c.mod_chunks, c.dmod_pad, c.offset ? " unaligned" : "");
}

const StreamCase kStreamCases[] = {
    {1, 1, 8, 0, 1, 2, 0, 0},          // one token
    {3, 5, 100, 0, 5, 6, 0, 0},        // dim not a multiple of 8: the scalar path
    {3, 17, 64, 4, 30, 3, 8, 0},       // x inside a longer sample; a wider dmod
    {2, 9, 256, 2, 11, 6, 0, 1},       // unaligned
    {2, 33, 1000, 0, 33, 2, 0, 0},     // 125 chunks: a partly idle last warp
    {1, 1000, 24, 0, 1000, 3, 0, 0},   // many tokens, short rows
    {1, 7, 8192, 0, 7, 2, 0, 0},       // the longest row
    {2, 300, 3072, 0, 300, 6, 0, 0},   // Flux's width, a double block's stream
    {2, 256, 3072, 77, 333, 3, 0, 0},  // the image tokens inside the joint sequence
};

StreamShape stream_shape(const StreamCase& c) {
  return {c.batch, c.tokens, c.dim, c.x_sample_rows};
}

RowView x_view(const StreamCase& c) {
  return {c.batch, c.tokens, c.x_first, c.x_sample_rows, c.dim, 0, c.dim};
}

int64_t mod_stride(const StreamCase& c) {
  return c.mod_chunks * c.dim;
}

int64_t dmod_stride(const StreamCase& c) {
  return mod_stride(c) + c.dmod_pad;
}

// Chunk `chunk` of every sample's modulation, as a compact [batch, dim] array.
std::vector<double> mod_chunk(const std::vector<bf16>& mod, const StreamCase& c, int64_t chunk) {
  return gather(mod, RowView{c.batch, 1, 0, 1, mod_stride(c), chunk * c.dim, c.dim});
}

// The dmod entries of chunks [chunk, chunk + chunks) of every sample.
RowView dmod_view(const StreamCase& c, int64_t chunk, int64_t chunks) {
  return {c.batch, 1, 0, 1, dmod_stride(c), chunk * c.dim, chunks * c.dim};
}

// x with rows of different means and spreads: the LayerNorm must remove both.
std::vector<bf16> stream_input(TestRng& rng, const StreamCase& c) {
  const RowView view = x_view(c);
  std::vector<bf16> x = random_bf16(rng, view.buffer_size(), -2.0, 2.0);
  for (size_t i = 0; i < x.size(); ++i) {
    const int64_t row = static_cast<int64_t>(i) / c.dim;
    const float spread = std::ldexp(1.0f, int(row % 5) - 2);
    x[i] = float_to_bf16(bf16_to_float(x[i]) * spread + float(row % 3) * 1.5f);
  }
  return x;
}

TEST_F(FluxOpsCuda, LayerNormModulateMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const StreamCase& c : kStreamCases) {
    const std::string shape = describe(c);
    const StreamShape s = stream_shape(c);
    const RowView xs = x_view(c);
    const int64_t rows = c.batch * c.tokens;
    const size_t n = static_cast<size_t>(rows * c.dim);
    const std::vector<bf16> x = stream_input(rng_, c);
    const std::vector<bf16> mod =
        random_bf16(rng_, static_cast<size_t>(c.batch * mod_stride(c)), -1.0, 1.0);
    Device<bf16> device_x(x, c.offset), device_mod(mod, c.offset);
    Device<bf16> out(n, c.offset), normed(n, c.offset);
    Device<float> rstd(static_cast<size_t>(rows));
    out.poison_nan();
    normed.poison_nan();
    rstd.poison_nan();
    // x points at the stream's first row; shift is chunk 0 of the modulation, scale chunk 1.
    ops::cuda::layernorm_modulate_forward(out.get(), normed.get(), rstd.get(),
                                          device_x.get() + c.x_first * c.dim, device_mod.get(),
                                          device_mod.get() + c.dim, mod_stride(c), s, stream_);
    const std::vector<bf16> gpu_normed = normed.download();
    const std::vector<float> gpu_rstd = rstd.download();

    const std::vector<double> shift = mod_chunk(mod, c, 0), scale = mod_chunk(mod, c, 1);
    const ops::ModulationShape mshape{c.batch, c.tokens, c.dim};
    std::vector<double> cpu_normed(n), cpu_rstd(static_cast<size_t>(rows)), cpu_out(n);
    ops::layernorm_forward(cpu_normed.data(), cpu_rstd.data(), gather(x, xs).data(), rows, c.dim);
    ops::modulate_forward(cpu_out.data(), cpu_normed.data(), scale.data(), shift.data(), c.dim,
                          mshape);
    expect_close(widen(out.download()), cpu_out, kBf16Tolerance,
                 "layernorm_modulate_forward out, " + shape);
    expect_close(widen(gpu_normed), cpu_normed, kBf16Tolerance,
                 "layernorm_modulate_forward normed, " + shape);
    expect_close(widen(gpu_rstd), cpu_rstd, kFp32Tolerance,
                 "layernorm_modulate_forward rstd, " + shape);

    // The FP8 casts fused into it: the same output, and the bytes and amax of the CPU's
    // quantize() of that output, or the bytes and block-major scales of its 1x128
    // quantize_blocks(); refused off the vector path (and for blocks, unless dim is a multiple of
    // 128).
    const std::vector<bf16> gpu_out = out.download();
    const bool vector = c.dim % 8 == 0 && c.offset == 0;
    const auto fused_forward = [&](const ops::cuda::FusedCast& cast, Device<bf16>& fused_out) {
      ops::cuda::layernorm_modulate_forward(
          fused_out.get(), normed.get(), rstd.get(), device_x.get() + c.x_first * c.dim,
          device_mod.get(), device_mod.get() + c.dim, mod_stride(c), s, stream_, cast);
    };
    {
      const Fp8Format format = Fp8Format::E4M3;
      const float scale =
          fp8t::scale_from_amax(amax(gpu_out.data(), int64_t(n)), format_max(format), false, 0.0f) *
          0.5f;  // some values saturate
      const Device<float> device_scale(std::vector<float>{scale});
      Device<float> device_amax(std::vector<float>{0.0f});
      Device<uint8_t> codes(n);
      Device<bf16> fused_out(n, c.offset);
      codes.poison_nan();
      fused_out.poison_nan();
      const ops::cuda::FusedCast cast{device_scale.get(), format, codes.get(), device_amax.get()};
      if (!vector) {
        EXPECT_THROW(fused_forward(cast, fused_out), Error) << "a fused cast, " << shape;
      } else {
        fused_forward(cast, fused_out);
        expect_bitwise_equal(fused_out.download(), gpu_out, "fused cast out, " + shape);
        std::vector<uint8_t> expected(n);
        float expected_amax = 0.0f;
        quantize(gpu_out.data(), int64_t(n), scale, format, expected.data(), &expected_amax);
        expect_bitwise_equal(codes.download(), expected, "fused cast codes, " + shape);
        expect_bitwise_equal(device_amax.download(), std::vector<float>{expected_amax},
                             "fused cast amax, " + shape);
      }
    }
    {
      const int64_t blocks = (c.dim + 127) / 128;
      Device<uint8_t> codes(n);
      Device<float> scales(static_cast<size_t>(blocks * rows));
      Device<bf16> fused_out(n, c.offset);
      codes.poison_nan();
      scales.poison_nan();
      fused_out.poison_nan();
      ops::cuda::FusedCast cast;
      cast.out = codes.get();
      cast.block_scales = scales.get();
      if (!vector || c.dim % 128 != 0) {
        EXPECT_THROW(fused_forward(cast, fused_out), Error) << "a fused block cast, " << shape;
      } else {
        fused_forward(cast, fused_out);
        expect_bitwise_equal(fused_out.download(), gpu_out, "fused block cast out, " + shape);
        const BlockMajorCast expected = block_major_cast(
            gpu_out, rows, c.dim,
            {BlockScaling::Rows1x128, cast.format, cast.power_of_2_scales, cast.amax_epsilon});
        expect_bitwise_equal(codes.download(), expected.codes, "fused block cast codes, " + shape);
        expect_bitwise_equal(scales.download(), expected.scales,
                             "fused block cast scales, " + shape);
      }
    }

    // The backward from the GPU forward's normed and rstd: the CPU's modulate backward, then its
    // LayerNorm backward.
    const std::vector<bf16> dout = random_bf16(rng_, n);
    const std::vector<float> dmod_start =
        random_floats(rng_, static_cast<size_t>(c.batch * dmod_stride(c)));
    Device<bf16> device_dout(dout, c.offset);
    const std::vector<double> normed_d = widen(gpu_normed);
    std::vector<double> dnorm(n, 0.0), dshift(static_cast<size_t>(c.batch * c.dim), 0.0);
    std::vector<double> dscale = dshift, dshift_terms = dshift, dscale_terms = dshift;
    ops::modulate_backward(dnorm.data(), dscale.data(), dshift.data(), widen(dout).data(),
                           normed_d.data(), scale.data(), c.dim, mshape);
    std::vector<double> unused(n, 0.0);
    ops::modulate_backward(unused.data(), dscale_terms.data(), dshift_terms.data(),
                           absolute(widen(dout)).data(), absolute(normed_d).data(), scale.data(),
                           c.dim, mshape);
    // The dmod rows as [dshift, dscale] per sample.
    std::vector<double> dmod_delta, dmod_terms;
    for (int64_t b = 0; b < c.batch; ++b) {
      const auto row = [&](const std::vector<double>& v) {
        return std::vector<double>(v.begin() + b * c.dim, v.begin() + (b + 1) * c.dim);
      };
      for (const std::vector<double>* part : {&dshift, &dscale}) {
        const std::vector<double> values = row(*part);
        dmod_delta.insert(dmod_delta.end(), values.begin(), values.end());
      }
      for (const std::vector<double>* part : {&dshift_terms, &dscale_terms}) {
        const std::vector<double> values = row(*part);
        dmod_terms.insert(dmod_terms.end(), values.begin(), values.end());
      }
    }
    const RowView dmod_rows = dmod_view(c, 0, 2);
    const std::vector<double> cpu_dmod = plus(gather(dmod_start, dmod_rows), dmod_delta);

    Device<float> workspace(static_cast<size_t>(ops::cuda::flux_reduction_workspace_floats()));
    std::vector<float> first_dmod;
    std::vector<bf16> first_dx;
    for (GradStore store : {GradStore::Write, GradStore::Add, GradStore::Write}) {
      const std::string what =
          fmt::format("layernorm_modulate_backward ({}), {}", store_name(store), shape);
      const std::vector<bf16> dx_start = start_values(rng_, xs.buffer_size(), store);
      Device<bf16> dx(dx_start, c.offset);
      Device<float> dmod(dmod_start);
      workspace.poison_nan();
      ops::cuda::layernorm_modulate_backward(dx.get() + c.x_first * c.dim, dmod.get(),
                                             dmod.get() + c.dim, dmod_stride(c), device_dout.get(),
                                             normed.get(), rstd.get(), device_mod.get() + c.dim,
                                             mod_stride(c), s, store, workspace.get(), stream_);
      std::vector<double> cpu_dx =
          store == GradStore::Add ? gather(dx_start, xs) : std::vector<double>(n, 0.0);
      ops::layernorm_backward(cpu_dx.data(), dnorm.data(), normed_d.data(), widen(gpu_rstd).data(),
                              rows, c.dim);
      const std::vector<bf16> gpu_dx = dx.download();
      const std::vector<float> gpu_dmod = dmod.download();
      expect_close(view_values(gpu_dx, dx_start, xs, what + " dx"), cpu_dx, kBf16Tolerance,
                   what + " dx");
      expect_close_sums(view_values(gpu_dmod, dmod_start, dmod_rows, what + " dmod"), cpu_dmod,
                        dmod_terms, what + " dshift, dscale");
      // The sums do not depend on the store and repeat bit for bit; so do two written dx.
      if (first_dmod.empty()) {
        first_dmod = gpu_dmod;
        first_dx = gpu_dx;
      }
      expect_bitwise_equal(gpu_dmod, first_dmod, what + " dmod repeated");
      if (store == GradStore::Write) expect_bitwise_equal(gpu_dx, first_dx, what + " dx repeated");
    }
  }
}

TEST_F(FluxOpsCuda, GatedResidualMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const StreamCase& c : kStreamCases) {
    const std::string shape = describe(c);
    const StreamShape s = stream_shape(c);
    const RowView xs = x_view(c);
    const int64_t rows = c.batch * c.tokens;
    const size_t n = static_cast<size_t>(rows * c.dim);
    const ops::ModulationShape mshape{c.batch, c.tokens, c.dim};
    const int64_t gate_chunk = c.mod_chunks - 1;
    const std::vector<bf16> x = random_bf16(rng_, xs.buffer_size(), -2.0, 2.0);
    const std::vector<bf16> branch = random_bf16(rng_, n, -2.0, 2.0);
    const std::vector<bf16> mod =
        random_bf16(rng_, static_cast<size_t>(c.batch * mod_stride(c)), -1.0, 1.0);
    const std::vector<double> gate = mod_chunk(mod, c, gate_chunk);
    Device<bf16> device_x(x, c.offset), device_branch(branch, c.offset), device_mod(mod, c.offset);
    const bf16* device_gate = device_mod.get() + gate_chunk * c.dim;

    ops::cuda::gated_residual_forward(device_x.get() + c.x_first * c.dim, device_branch.get(),
                                      device_gate, mod_stride(c), s, stream_);
    std::vector<double> cpu_x = gather(x, xs);
    ops::gated_residual_forward(cpu_x.data(), widen(branch).data(), gate.data(), c.dim, mshape);
    const std::string forward = "gated_residual_forward, " + shape;
    expect_close(view_values(device_x.download(), x, xs, forward), cpu_x, kBf16Tolerance, forward);

    // Backward: dx is read through x's view; dbranch is written, dgate added to.
    const std::vector<bf16> dx = random_bf16(rng_, xs.buffer_size());
    const std::vector<float> dmod_start =
        random_floats(rng_, static_cast<size_t>(c.batch * dmod_stride(c)));
    Device<bf16> device_dx(dx, c.offset);
    const std::vector<double> dx_rows = gather(dx, xs);
    std::vector<double> cpu_dbranch(n, 0.0), dgate(static_cast<size_t>(c.batch * c.dim), 0.0);
    std::vector<double> dgate_terms = dgate, unused(n, 0.0);
    ops::gated_residual_backward(cpu_dbranch.data(), dgate.data(), dx_rows.data(),
                                 widen(branch).data(), gate.data(), c.dim, mshape);
    ops::gated_residual_backward(unused.data(), dgate_terms.data(), absolute(dx_rows).data(),
                                 absolute(widen(branch)).data(), gate.data(), c.dim, mshape);
    const RowView dgate_rows = dmod_view(c, gate_chunk, 1);
    const std::vector<double> cpu_dgate = plus(gather(dmod_start, dgate_rows), dgate);

    Device<float> workspace(static_cast<size_t>(ops::cuda::flux_reduction_workspace_floats()));
    std::vector<float> first_dmod;
    std::vector<bf16> first_dbranch;
    for (int run = 0; run < 2; ++run) {
      const std::string what = fmt::format("gated_residual_backward (run {}), {}", run, shape);
      Device<bf16> dbranch(n, c.offset);
      Device<float> dmod(dmod_start);
      dbranch.poison_nan();
      workspace.poison_nan();
      ops::cuda::gated_residual_backward(dbranch.get(), dmod.get() + gate_chunk * c.dim,
                                         dmod_stride(c), device_dx.get() + c.x_first * c.dim,
                                         device_branch.get(), device_gate, mod_stride(c), s,
                                         workspace.get(), stream_);
      const std::vector<bf16> gpu_dbranch = dbranch.download();
      const std::vector<float> gpu_dmod = dmod.download();
      expect_close(widen(gpu_dbranch), cpu_dbranch, kBf16Tolerance, what + " dbranch");
      expect_close_sums(view_values(gpu_dmod, dmod_start, dgate_rows, what + " dmod"), cpu_dgate,
                        dgate_terms, what + " dgate");
      if (run == 0) {
        first_dmod = gpu_dmod;
        first_dbranch = gpu_dbranch;
      } else {
        expect_bitwise_equal(gpu_dmod, first_dmod, what + " dgate repeated");
        expect_bitwise_equal(gpu_dbranch, first_dbranch, what + " dbranch repeated");
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GELU with row strides, SiLU

struct GeluCase {
  int64_t rows, cols;
  int64_t in_ld, in_col;    // in (and din) inside [rows, in_ld] from column in_col
  int64_t out_ld, out_col;  // out (and dout) inside [rows, out_ld] from column out_col
  size_t offset;            // 1: unaligned pointers
};

std::string describe(const GeluCase& c) {
  return fmt::format("[{}, {}] in ld {} col {}, out ld {} col {}{}", c.rows, c.cols, c.in_ld,
                     c.in_col, c.out_ld, c.out_col, c.offset ? " unaligned" : "");
}

const GeluCase kGeluCases[] = {
    {1, 1, 1, 0, 1, 0, 0},
    {7, 13, 13, 0, 13, 0, 0},          // contiguous: one row of 91
    {4, 4099, 4099, 0, 4099, 0, 1},    // contiguous, unaligned
    {9, 21, 40, 3, 24, 0, 0},          // strides that break the vectors
    {5, 100, 104, 0, 112, 8, 0},       // vectors, then a 4-element tail per row
    {300, 384, 768, 384, 512, 128, 0}  // a single block's MLP half (C 128, M 384)
};

RowView gelu_in_view(const GeluCase& c) {
  return {1, c.rows, 0, c.rows, c.in_ld, c.in_col, c.cols};
}

RowView gelu_out_view(const GeluCase& c) {
  return {1, c.rows, 0, c.rows, c.out_ld, c.out_col, c.cols};
}

void check_gelu(TestRng& rng, const GeluCase& c, cudaStream_t stream) {
  const std::string shape = describe(c);
  const RowView in_view = gelu_in_view(c), out_view = gelu_out_view(c);
  const size_t n = static_cast<size_t>(c.rows * c.cols);
  const std::vector<bf16> in = random_bf16(rng, in_view.buffer_size(), -4.0, 4.0);
  Device<bf16> device_in(in, c.offset), out(out_view.buffer_size(), c.offset);
  out.poison_nan();
  const std::vector<bf16> out_before = out.download();
  ops::cuda::gelu_tanh_forward(out.get() + c.out_col, c.out_ld, device_in.get() + c.in_col, c.in_ld,
                               c.rows, c.cols, stream);
  const std::vector<double> x = gather(in, in_view);
  std::vector<double> cpu_out(n);
  ops::gelu_tanh_forward(cpu_out.data(), x.data(), c.cols * c.rows);
  const std::string forward = "gelu_tanh_forward, " + shape;
  const std::vector<bf16> first = out.download();
  const std::vector<double> values = view_values(first, out_before, out_view, forward);
  expect_close(values, cpu_out, kBf16Tolerance, forward);
  // Again, taking the outputs' amax: into zero, then into a larger one already there.
  double largest = 0.0;
  for (const double value : values)
    largest = std::max(largest, std::fabs(value));
  for (const float start : {0.0f, float(2.0 * largest + 1.0)}) {
    Device<float> amax(std::vector<float>{start});
    ops::cuda::gelu_tanh_forward(out.get() + c.out_col, c.out_ld, device_in.get() + c.in_col,
                                 c.in_ld, c.rows, c.cols, stream, amax.get());
    expect_bitwise_equal(out.download(), first, forward + " with the amax");
    EXPECT_EQ(amax.download()[0], start > 0.0f ? start : float(largest)) << forward;
  }

  // din (written) in the input's layout, dout in the output's.
  const std::vector<bf16> dout = random_bf16(rng, out_view.buffer_size());
  Device<bf16> device_dout(dout, c.offset), din(in_view.buffer_size(), c.offset);
  din.poison_nan();
  const std::vector<bf16> din_before = din.download();
  ops::cuda::gelu_tanh_backward(din.get() + c.in_col, c.in_ld, device_dout.get() + c.out_col,
                                c.out_ld, device_in.get() + c.in_col, c.in_ld, c.rows, c.cols,
                                stream);
  std::vector<double> cpu_din(n, 0.0);
  ops::gelu_tanh_backward(cpu_din.data(), gather(dout, out_view).data(), x.data(), c.rows * c.cols);
  const std::string backward = "gelu_tanh_backward, " + shape;
  expect_close(view_values(din.download(), din_before, in_view, backward), cpu_din, kBf16Tolerance,
               backward);
}

TEST_F(FluxOpsCuda, GeluMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const GeluCase& c : kGeluCases)
    check_gelu(rng_, c, stream_);
  // Flux's MLP at 300 tokens: linear1's [3C + M] output, linear2's [C + M] input.
  check_gelu(rng_, {300, 12288, 3 * 3072 + 12288, 3 * 3072, 3072 + 12288, 3072, 0}, stream_);
}

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

TEST_F(FluxOpsCuda, SiluMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const PointwiseCase& c : kPointwiseCases) {
    const std::string shape = describe(c);
    const size_t n = static_cast<size_t>(c.n);
    const std::vector<bf16> x = random_bf16(rng_, n, -6.0, 6.0);
    Device<bf16> device_x(x, c.offset), out(n, c.offset);
    out.poison_nan();
    ops::cuda::silu_forward(out.get(), device_x.get(), c.n, stream_);
    std::vector<double> cpu_out(n);
    for (size_t i = 0; i < n; ++i) {
      const double v = bf16_to_float(x[i]);
      cpu_out[i] = v * sigmoid(v);
    }
    expect_close(widen(out.download()), cpu_out, kBf16Tolerance, "silu_forward, " + shape);

    const std::vector<bf16> dout = random_bf16(rng_, n);
    Device<bf16> device_dout(dout, c.offset);
    for (GradStore store : {GradStore::Write, GradStore::Add}) {
      GradientStart start = gradient_start(rng_, n, store);
      Device<bf16> din(start.device, c.offset);
      ops::cuda::silu_backward(din.get(), device_dout.get(), device_x.get(), c.n, store, stream_);
      for (size_t i = 0; i < n; ++i) {
        const double v = bf16_to_float(x[i]), s = sigmoid(v);
        start.cpu[i] += bf16_to_float(dout[i]) * s * (1.0 + v * (1.0 - s));
      }
      expect_close(widen(din.download()), start.cpu, kBf16Tolerance,
                   fmt::format("silu_backward ({}), {}", store_name(store), shape));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// QK norm + RoPE into the joint sequence

struct QkCase {
  JointRows rows;  // batch, tokens, first, joint_tokens
  int64_t heads, head_dim;
  int64_t raw_ld, raw_col;  // raw (and draw) inside [batch · tokens, raw_ld] from column raw_col
  size_t offset;            // 1: unaligned bf16 pointers
};

std::string describe(const QkCase& c) {
  return fmt::format("B {} T {} at [{}, {}) of {}, H {} D {}, raw ld {} col {}{}", c.rows.batch,
                     c.rows.tokens, c.rows.first, c.rows.first + c.rows.tokens, c.rows.joint_tokens,
                     c.heads, c.head_dim, c.raw_ld, c.raw_col, c.offset ? " unaligned" : "");
}

const QkCase kQkCases[] = {
    {{1, 1, 0, 1}, 1, 2, 2, 0, 0},         // one pair: a thread per head, scalar
    {{2, 5, 3, 9}, 3, 10, 34, 4, 0},       // head_dim 10: a pair past the first chunk
    {{1, 3, 1, 4}, 5, 8, 40, 0, 0},        // a thread per head, vectors
    {{3, 7, 0, 7}, 2, 32, 64, 0, 0},       // the whole joint sequence
    {{2, 17, 4, 30}, 3, 64, 576, 192, 0},  // k of a qkv output
    {{2, 33, 10, 50}, 4, 128, 512, 0, 1},  // unaligned
    {{1, 9, 2, 11}, 2, 96, 192, 0, 0},     // 12 chunks in groups of 16
    {{1, 5, 0, 5}, 2, 256, 512, 0, 0},     // a warp per head
    // Flux's image k: 256 image tokens after 44 text tokens, from the [3C] qkv output.
    {{2, 256, 44, 300}, 24, 128, 3 * 3072, 3072, 0},
};

RowView raw_view(const QkCase& c) {
  return {c.rows.batch, c.rows.tokens, 0, c.rows.tokens, c.raw_ld, c.raw_col, c.heads * c.head_dim};
}

// The stream's rows of a joint [batch, joint_tokens, width] tensor.
RowView joint_view(const QkCase& c, int64_t width) {
  return {c.rows.batch, c.rows.tokens, c.rows.first, c.rows.joint_tokens, width, 0, width};
}

// cos and sin [joint_tokens, head_dim / 2]: Flux's tables for head_dim 128 (axes 16, 56, 56;
// text ids 0, image ids (0, row, col)), random angles otherwise.
void rope_tables(TestRng& rng, const QkCase& c, std::vector<float>& cos, std::vector<float>& sin) {
  const int64_t joint = c.rows.joint_tokens, half = c.head_dim / 2;
  cos.resize(static_cast<size_t>(joint * half));
  sin.resize(cos.size());
  if (c.head_dim == 128) {
    std::vector<float> ids(static_cast<size_t>(joint * 3), 0.0f);
    for (int64_t t = c.rows.first; t < joint; ++t) {
      ids[size_t(t * 3 + 1)] = float((t - c.rows.first) / 16);
      ids[size_t(t * 3 + 2)] = float((t - c.rows.first) % 16);
    }
    ops::flux_rope_tables(cos.data(), sin.data(), ids.data(), joint, {16, 56, 56}, 10000.0);
    return;
  }
  for (size_t i = 0; i < cos.size(); ++i) {
    const double angle = rng.uniform(-3.14159265358979, 3.14159265358979);
    cos[i] = static_cast<float>(std::cos(angle));
    sin[i] = static_cast<float>(std::sin(angle));
  }
}

TEST_F(FluxOpsCuda, QkNormRopeMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const QkCase& c : kQkCases) {
    const std::string shape = describe(c);
    const JointRows& j = c.rows;
    const int64_t width = c.heads * c.head_dim, half = c.head_dim / 2;
    const int64_t head_rows = j.batch * j.tokens * c.heads;
    const size_t n = static_cast<size_t>(head_rows * c.head_dim);
    const RowView raw_rows = raw_view(c), joint_rows = joint_view(c, width);
    const RowView joint_heads = joint_view(c, c.heads);
    const size_t joint_count = static_cast<size_t>(j.batch * j.joint_tokens * width);
    const size_t joint_heads_count = static_cast<size_t>(j.batch * j.joint_tokens * c.heads);
    std::vector<float> cos, sin;
    rope_tables(rng_, c, cos, sin);
    const std::vector<bf16> raw = random_bf16(rng_, raw_rows.buffer_size(), -3.0, 3.0);
    const std::vector<float> scale = random_floats(rng_, size_t(c.head_dim), 0.5, 1.5);
    Device<bf16> device_raw(raw, c.offset);
    Device<float> device_scale(scale), device_cos(cos), device_sin(sin);
    Device<bf16> out(joint_count, c.offset), normed(joint_count, c.offset);
    Device<float> rstd(joint_heads_count);
    out.poison_nan();
    normed.poison_nan();
    rstd.poison_nan();
    const std::vector<bf16> poisoned = out.download();
    const std::vector<float> poisoned_rstd = rstd.download();
    ops::cuda::qk_norm_rope_forward(
        out.get(), normed.get(), rstd.get(), device_raw.get() + c.raw_col, c.raw_ld,
        device_scale.get(), device_cos.get(), device_sin.get(), j, c.heads, c.head_dim, stream_);
    const std::vector<bf16> gpu_normed = normed.download();
    const std::vector<float> gpu_rstd = rstd.download();

    // The CPU: RMSNorm per head, × scale, then the rotation of each sample's tokens by the
    // tables' rows first.. (as flux_model.cpp's attention_forward).
    const float* cos_rows = cos.data() + j.first * half;
    const float* sin_rows = sin.data() + j.first * half;
    std::vector<double> cpu_normed(n), cpu_rstd(static_cast<size_t>(head_rows)), cpu_out(n);
    ops::rmsnorm_forward(cpu_normed.data(), cpu_rstd.data(), gather(raw, raw_rows).data(),
                         head_rows, c.head_dim, kQkNormEps);
    for (size_t i = 0; i < n; ++i)
      cpu_out[i] = cpu_normed[i] * scale[i % size_t(c.head_dim)];
    const int64_t sample = j.tokens * width;
    for (int64_t b = 0; b < j.batch; ++b) {
      double* y = cpu_out.data() + b * sample;
      ops::flux_rope_forward(y, y, cos_rows, sin_rows, j.tokens, c.heads, c.head_dim);
    }
    const std::string forward = "qk_norm_rope_forward, " + shape;
    expect_close(view_values(out.download(), poisoned, joint_rows, forward + " out"), cpu_out,
                 kBf16Tolerance, forward + " out");
    expect_close(view_values(gpu_normed, poisoned, joint_rows, forward + " normed"), cpu_normed,
                 kBf16Tolerance, forward + " normed");
    const std::vector<double> rstd_rows =
        view_values(gpu_rstd, poisoned_rstd, joint_heads, forward + " rstd");
    expect_close(rstd_rows, cpu_rstd, kFp32Tolerance, forward + " rstd");

    // The backward from the GPU forward's normed and rstd: the CPU's inverse rotation, dscale,
    // then its RMSNorm backward of ds · scale.
    const std::vector<bf16> dout = random_bf16(rng_, joint_count);
    const std::vector<float> dscale_start = random_floats(rng_, size_t(c.head_dim));
    Device<bf16> device_dout(dout, c.offset);
    const std::vector<double> dout_rows = gather(dout, joint_rows);
    const std::vector<double> normed_rows = gather(gpu_normed, joint_rows);
    std::vector<double> ds(n, 0.0);
    for (int64_t b = 0; b < j.batch; ++b) {
      ops::flux_rope_backward(ds.data() + b * sample, dout_rows.data() + b * sample, cos_rows,
                              sin_rows, j.tokens, c.heads, c.head_dim);
    }
    std::vector<double> cpu_dscale(dscale_start.begin(), dscale_start.end());
    std::vector<double> dscale_terms(size_t(c.head_dim), 0.0), dnormed(n);
    for (size_t i = 0; i < n; ++i) {
      const size_t channel = i % size_t(c.head_dim);
      cpu_dscale[channel] += ds[i] * normed_rows[i];
      dscale_terms[channel] += std::fabs(ds[i] * normed_rows[i]);
      dnormed[i] = ds[i] * scale[channel];
    }
    std::vector<double> cpu_draw(n, 0.0);
    ops::rmsnorm_backward(cpu_draw.data(), dnormed.data(), normed_rows.data(), rstd_rows.data(),
                          head_rows, c.head_dim);

    Device<float> workspace(static_cast<size_t>(ops::cuda::flux_reduction_workspace_floats()));
    std::vector<float> first_dscale;
    std::vector<bf16> first_draw;
    for (int run = 0; run < 2; ++run) {
      const std::string what = fmt::format("qk_norm_rope_backward (run {}), {}", run, shape);
      Device<bf16> draw(raw_rows.buffer_size(), c.offset);
      Device<float> dscale(dscale_start);
      draw.poison_nan();
      workspace.poison_nan();
      const std::vector<bf16> draw_before = draw.download();
      ops::cuda::qk_norm_rope_backward(draw.get() + c.raw_col, c.raw_ld, dscale.get(),
                                       device_dout.get(), normed.get(), rstd.get(),
                                       device_scale.get(), device_cos.get(), device_sin.get(), j,
                                       c.heads, c.head_dim, workspace.get(), stream_);
      const std::vector<bf16> gpu_draw = draw.download();
      const std::vector<float> gpu_dscale = dscale.download();
      expect_close(view_values(gpu_draw, draw_before, raw_rows, what + " draw"), cpu_draw,
                   kBf16Tolerance, what + " draw");
      expect_close_sums(widen(gpu_dscale), cpu_dscale, dscale_terms, what + " dscale");
      if (run == 0) {
        first_dscale = gpu_dscale;
        first_draw = gpu_draw;
      } else {
        expect_bitwise_equal(gpu_dscale, first_dscale, what + " dscale repeated");
        expect_bitwise_equal(gpu_draw, first_draw, what + " draw repeated");
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Row copies between streams and the joint sequence

struct RowCopyCase {
  int64_t samples, rows, width;
  int64_t dst_ld, dst_sample_rows, src_ld, src_sample_rows;
  size_t offset;
};

// Every sample's rows land where the strides say, bit for bit, and every other destination
// value keeps what it held (random values there beforehand); taking the amax, it is the copied
// values' largest magnitude and the copy is the same.
TEST_F(FluxOpsCuda, CopyRowsMovesEachSamplesRowsAndNothingElse) {
  SCOPED_TRACE(rng_.trace());
  const RowCopyCase cases[] = {
      {3, 5, 16, 24, 9, 16, 5, 0},          // vectors, gaps between rows and samples
      {2, 7, 13, 13, 7, 20, 10, 0},         // odd width: element by element
      {1, 4, 64, 64, 4, 64, 4, 1},          // unaligned
      {4, 96, 384, 384, 160, 1152, 96, 0},  // a stream's v into the joint sequence
      {4, 64, 384, 1152, 64, 384, 160, 0},  // and its gradient out of it
      {0, 5, 8, 8, 5, 8, 5, 0}};
  for (const RowCopyCase& c : cases) {
    const std::string what = fmt::format(
        "copy_rows of {} samples of [{}, {}], dst ld {} every {} rows, src ld {} every "
        "{} rows{}",
        c.samples, c.rows, c.width, c.dst_ld, c.dst_sample_rows, c.src_ld, c.src_sample_rows,
        c.offset ? ", unaligned" : "");
    const size_t dst_count = size_t(std::max<int64_t>(c.samples, 1) * c.dst_sample_rows * c.dst_ld);
    const size_t src_count = size_t(std::max<int64_t>(c.samples, 1) * c.src_sample_rows * c.src_ld);
    std::vector<bf16> expected = random_bf16(rng_, dst_count);
    const std::vector<bf16> src = random_bf16(rng_, src_count);
    Device<bf16> device_dst(expected, c.offset);
    const Device<bf16> device_src(src, c.offset);
    for (int64_t b = 0; b < c.samples; ++b) {
      for (int64_t r = 0; r < c.rows; ++r) {
        for (int64_t k = 0; k < c.width; ++k) {
          expected[size_t((b * c.dst_sample_rows + r) * c.dst_ld + k)] =
              src[size_t((b * c.src_sample_rows + r) * c.src_ld + k)];
        }
      }
    }
    float copied_amax = 0.0f;
    for (int64_t b = 0; b < c.samples; ++b) {
      for (int64_t r = 0; r < c.rows; ++r) {
        for (int64_t k = 0; k < c.width; ++k) {
          const bf16 value = src[size_t((b * c.src_sample_rows + r) * c.src_ld + k)];
          copied_amax = std::max(copied_amax, std::fabs(bf16_to_float(value)));
        }
      }
    }
    // Once without the amax, once taking it (the same copy again).
    for (const bool take : {false, true}) {
      Device<float> amax(std::vector<float>{0.0f});
      ops::cuda::copy_rows({device_dst.get(), c.dst_ld, c.dst_sample_rows},
                           {device_src.get(), c.src_ld, c.src_sample_rows}, c.samples, c.rows,
                           c.width, stream_, take ? amax.get() : nullptr);
      FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
      expect_bitwise_equal(device_dst.download(), expected, what);
      if (take) EXPECT_EQ(amax.download()[0], copied_amax) << what << ": the copied values' amax";
    }
  }
  Device<bf16> a(64), b(64);
  EXPECT_THROW(ops::cuda::copy_rows({a.get(), 4, 2}, {b.get(), 8, 2}, 2, 2, 8, stream_), Error)
      << "dst ld below the width";
  EXPECT_THROW(ops::cuda::copy_rows({a.get(), 8, 1}, {b.get(), 8, 2}, 2, 2, 8, stream_), Error)
      << "samples overlapping in dst";
  EXPECT_THROW(ops::cuda::copy_rows({nullptr, 8, 2}, {b.get(), 8, 2}, 2, 2, 8, stream_), Error)
      << "null dst";
}

// ---------------------------------------------------------------------------------------------
// Bias gradients and the loss

struct BiasCase {
  int64_t rows, cols;
  size_t offset;
};

TEST_F(FluxOpsCuda, BiasBackwardMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  const BiasCase cases[] = {{1, 1, 0},      {3, 13, 0},    {7, 100, 0},
                            {1000, 24, 0},  {37, 264, 1},  {4096, 8, 0},
                            {600, 3072, 0}, {64, 21504, 0}};  // a single block's linear1 (3C + M)
  for (const BiasCase& c : cases) {
    const std::string shape =
        fmt::format("[{}, {}]{}", c.rows, c.cols, c.offset ? " unaligned" : "");
    const std::vector<bf16> dy = random_bf16(rng_, static_cast<size_t>(c.rows * c.cols));
    const std::vector<float> dbias_start = random_floats(rng_, static_cast<size_t>(c.cols));
    Device<bf16> device_dy(dy, c.offset);
    std::vector<double> cpu_dbias = widen(dbias_start), terms(size_t(c.cols), 0.0);
    for (size_t i = 0; i < dy.size(); ++i) {
      cpu_dbias[i % size_t(c.cols)] += bf16_to_float(dy[i]);
      terms[i % size_t(c.cols)] += std::fabs(bf16_to_float(dy[i]));
    }
    float cpu_amax = 0.0f;
    for (bf16 value : dy)
      cpu_amax = std::max(cpu_amax, std::fabs(bf16_to_float(value)));
    Device<float> workspace(static_cast<size_t>(ops::cuda::flux_reduction_workspace_floats()));
    std::vector<float> first;
    // Runs 1 and 2 also take dy's amax, into a zero and into a larger amax already there.
    for (int run = 0; run < 3; ++run) {
      const std::string what = fmt::format("bias_backward (run {}), {}", run, shape);
      Device<float> dbias(dbias_start);
      const float amax_start = run == 2 ? 2.0f * cpu_amax + 1.0f : 0.0f;
      Device<float> amax(std::vector<float>{amax_start});
      workspace.poison_nan();
      ops::cuda::bias_backward(dbias.get(), device_dy.get(), c.rows, c.cols, workspace.get(),
                               stream_, run > 0 ? amax.get() : nullptr);
      const std::vector<float> gpu = dbias.download();
      expect_close_sums(widen(gpu), cpu_dbias, terms, what);
      if (run == 0) first = gpu;
      expect_bitwise_equal(gpu, first, what + " repeated");
      const float expected_amax = run == 0 ? 0.0f : std::max(amax_start, cpu_amax);
      EXPECT_EQ(amax.download()[0], expected_amax) << what << ": amax";
    }
  }
}

TEST_F(FluxOpsCuda, FlowMseMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  const float dloss = 0.75f;
  for (const PointwiseCase& c : kPointwiseCases) {
    const std::string shape = describe(c);
    const size_t n = static_cast<size_t>(c.n);
    const std::vector<bf16> pred = random_bf16(rng_, n, -2.0, 2.0);
    const std::vector<float> target = random_floats(rng_, n, -2.0, 2.0);
    std::vector<float> pred_f(n), cpu_dpred(n);
    for (size_t i = 0; i < n; ++i)
      pred_f[i] = bf16_to_float(pred[i]);
    const double cpu_loss =
        flow_mse_loss_with_gradient(cpu_dpred.data(), pred_f.data(), target.data(), c.n, dloss);
    Device<bf16> device_pred(pred, c.offset);
    Device<float> device_target(target, c.offset);
    // The loss's partials need no alignment of the workspace.
    Device<float> workspace(static_cast<size_t>(ops::cuda::flux_reduction_workspace_floats()), 1);
    float first_loss = 0.0f;
    std::vector<bf16> first_dpred;
    for (int run = 0; run < 2; ++run) {
      const std::string what = fmt::format("flow_mse_forward_backward (run {}), {}", run, shape);
      Device<float> loss(1);
      Device<bf16> dpred(n, c.offset);
      loss.poison_nan();
      dpred.poison_nan();
      workspace.poison_nan();
      ops::cuda::flow_mse_forward_backward(loss.get(), dpred.get(), device_pred.get(),
                                           device_target.get(), c.n, dloss, workspace.get(),
                                           stream_);
      const float gpu_loss = loss.download()[0];
      const std::vector<bf16> gpu_dpred = dpred.download();
      // fp32 differences (2^-24 relative each), summed in double, the mean rounded to fp32.
      EXPECT_NEAR(gpu_loss, cpu_loss, 1e-6 * cpu_loss) << what << " loss";
      expect_close(widen(gpu_dpred), widen(cpu_dpred), kBf16Tolerance, what + " dpred");
      if (run == 0) {
        first_loss = gpu_loss;
        first_dpred = gpu_dpred;
      } else {
        expect_bitwise_equal(std::vector<float>{gpu_loss}, std::vector<float>{first_loss},
                             what + " loss repeated");
        expect_bitwise_equal(gpu_dpred, first_dpred, what + " dpred repeated");
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Argument checks

TEST_F(FluxOpsCuda, LaunchersRejectBadArguments) {
  Device<bf16> a(1 << 16), b(1 << 16), c(1 << 16), d(1 << 16);
  Device<float> f(1 << 12), g(1 << 12), h(1 << 12);
  Device<float> workspace(static_cast<size_t>(ops::cuda::flux_reduction_workspace_floats()));
  float* ws = workspace.get();
  const StreamShape ok{2, 4, 64, 4};
  const cudaStream_t s = stream_;

  // LayerNorm + modulation.
  EXPECT_THROW(ops::cuda::layernorm_modulate_forward(nullptr, b.get(), f.get(), c.get(), d.get(),
                                                     d.get(), 64, ok, s),
               Error);
  EXPECT_THROW(ops::cuda::layernorm_modulate_forward(a.get(), b.get(), f.get(), c.get(), d.get(),
                                                     d.get(), 64, {2, 4, 64, 3}, s),
               Error);  // x_sample_rows < tokens
  EXPECT_THROW(ops::cuda::layernorm_modulate_forward(a.get(), b.get(), f.get(), c.get(), d.get(),
                                                     d.get(), 32, ok, s),
               Error);  // mod_stride < dim
  EXPECT_THROW(ops::cuda::layernorm_modulate_forward(a.get(), b.get(), f.get(), c.get(), d.get(),
                                                     d.get(), 8200, {1, 1, 8200, 1}, s),
               Error);  // a row longer than a block
  EXPECT_THROW(ops::cuda::layernorm_modulate_forward(a.get(), b.get(), f.get(), c.get(), d.get(),
                                                     d.get(), 64, {2, 4, 0, 4}, s),
               Error);
  EXPECT_THROW(ops::cuda::layernorm_modulate_backward(a.get(), f.get(), g.get(), 64, b.get(),
                                                      c.get(), h.get(), d.get(), 64, ok,
                                                      GradStore::Write, nullptr, s),
               Error);
  EXPECT_THROW(
      ops::cuda::layernorm_modulate_backward(a.get(), f.get(), g.get(), 32, b.get(), c.get(),
                                             h.get(), d.get(), 64, ok, GradStore::Add, ws, s),
      Error);  // dmod_stride < dim
  EXPECT_THROW(ops::cuda::layernorm_modulate_backward(a.get(), f.get(), g.get(), 8192, b.get(),
                                                      c.get(), h.get(), d.get(), 8192,
                                                      {200, 1, 8192, 1}, GradStore::Add, ws, s),
               Error);  // partial sums larger than the workspace
  // The gated residual.
  EXPECT_THROW(ops::cuda::gated_residual_forward(a.get(), b.get(), nullptr, 64, ok, s), Error);
  EXPECT_THROW(ops::cuda::gated_residual_forward(a.get(), b.get(), c.get(), 64, {-1, 4, 64, 4}, s),
               Error);
  EXPECT_THROW(ops::cuda::gated_residual_backward(a.get(), f.get(), 64, b.get(), c.get(), d.get(),
                                                  64, ok, nullptr, s),
               Error);
  EXPECT_THROW(ops::cuda::gated_residual_backward(a.get(), f.get(), 63, b.get(), c.get(), d.get(),
                                                  64, ok, ws, s),
               Error);
  // GELU and SiLU.
  EXPECT_THROW(ops::cuda::gelu_tanh_forward(a.get(), 64, b.get(), 32, 4, 64, s), Error);
  EXPECT_THROW(ops::cuda::gelu_tanh_forward(a.get(), 64, nullptr, 64, 4, 64, s), Error);
  EXPECT_THROW(ops::cuda::gelu_tanh_backward(a.get(), 64, b.get(), 64, c.get(), 64, -1, 64, s),
               Error);
  EXPECT_THROW(ops::cuda::gelu_tanh_backward(a.get(), 8, b.get(), 64, c.get(), 64, 4, 64, s),
               Error);
  EXPECT_THROW(ops::cuda::silu_forward(a.get(), nullptr, 8, s), Error);
  EXPECT_THROW(ops::cuda::silu_backward(a.get(), b.get(), c.get(), -1, GradStore::Write, s), Error);
  // QK norm + RoPE.
  const JointRows rows{2, 4, 2, 6};
  EXPECT_THROW(ops::cuda::qk_norm_rope_forward(a.get(), b.get(), f.get(), c.get(), 128, nullptr,
                                               g.get(), h.get(), rows, 2, 64, s),
               Error);
  EXPECT_THROW(ops::cuda::qk_norm_rope_forward(a.get(), b.get(), f.get(), c.get(), 128, f.get(),
                                               g.get(), h.get(), {2, 4, 3, 6}, 2, 64, s),
               Error);  // rows past the joint sequence
  EXPECT_THROW(ops::cuda::qk_norm_rope_forward(a.get(), b.get(), f.get(), c.get(), 127, f.get(),
                                               g.get(), h.get(), rows, 2, 64, s),
               Error);  // raw_ld < heads · head_dim
  EXPECT_THROW(ops::cuda::qk_norm_rope_forward(a.get(), b.get(), f.get(), c.get(), 130, f.get(),
                                               g.get(), h.get(), rows, 2, 65, s),
               Error);  // odd head_dim
  EXPECT_THROW(ops::cuda::qk_norm_rope_forward(a.get(), b.get(), f.get(), c.get(), 1024, f.get(),
                                               g.get(), h.get(), rows, 2, 512, s),
               Error);  // head_dim > 256
  EXPECT_THROW(ops::cuda::qk_norm_rope_backward(a.get(), 128, f.get(), b.get(), c.get(), g.get(),
                                                h.get(), f.get(), g.get(), rows, 2, 64, nullptr, s),
               Error);
  EXPECT_THROW(ops::cuda::qk_norm_rope_backward(a.get(), 128, f.get(), b.get(), c.get(), g.get(),
                                                h.get(), f.get(), g.get(), rows, 0, 64, ws, s),
               Error);
  // Bias gradients and the loss.
  EXPECT_THROW(ops::cuda::bias_backward(f.get(), a.get(), 4, 64, nullptr, s), Error);
  EXPECT_THROW(ops::cuda::bias_backward(f.get(), a.get(), 4, 0, ws, s), Error);
  EXPECT_THROW(
      ops::cuda::flow_mse_forward_backward(f.get(), a.get(), b.get(), g.get(), 0, 1.0f, ws, s),
      Error);
  EXPECT_THROW(
      ops::cuda::flow_mse_forward_backward(nullptr, a.get(), b.get(), g.get(), 8, 1.0f, ws, s),
      Error);
}

}  // namespace
}  // namespace fp8t
