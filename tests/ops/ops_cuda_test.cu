// The GPU ops (ops/cuda/ops_cuda.h) against the CPU ops (src/ops), which run in double on the
// same bf16-rounded inputs. Each comparison takes ‖gpu − cpu‖ / ‖cpu‖ against a per-dtype
// tolerance and also bounds every element (so that one wrong row cannot hide in a norm);
// outputs a launcher writes are poisoned with NaN first, so an element it skips fails. Casts fused
// into a kernel match the quantization of its output bit for bit. Every
// failure names the op, the shape and the case, and the trace gives the seed to replay
// (FP8T_TEST_SEED). FP8T_TEST_VERBOSE=1 prints every comparison's error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "numerics/float_bits.h"
#include "numerics/quantize.h"
#include "numerics/quantize_cuda.h"
#include "numerics/scaling.h"
// The GPU tests target has no tests/ include directory.
#include "numerics/test_util.h"
#include "ops/cross_entropy.h"
#include "ops/cuda/ops_cuda.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gpu_compare.h"
#include "ops/rmsnorm.h"
#include "ops/rotary.h"

namespace fp8t {
namespace {

using ops::cuda::GradStore;
// The GPU test helpers (ops/gpu_compare.h).
using namespace test;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
const float kEps = static_cast<float>(ops::kRmsNormEps);
const float kSoftcap = static_cast<float>(ops::kLogitSoftcap);

// ---------------------------------------------------------------------------------------------
// Comparison

// ‖gpu − cpu‖ / ‖cpu‖ <= norm, and per element |gpu − cpu| <= relative |cpu| + floor max|cpu|.
// bf16 outputs: one rounding (2^-9 relative) over fp32 math.
constexpr Tolerance kBf16Tolerance{1e-2, 1.0 / 256, 1e-4};
// fp32 outputs (statistics, losses, parameter gradients): fp32 math against double.
constexpr Tolerance kFp32Tolerance{1e-5, 2e-5, 1e-5};

// A sum over many terms errs relative to the terms, not to itself: |gpu - cpu| <= 1e-5 terms.
void expect_close_sum(double gpu, double cpu, double terms, const std::string& what) {
  const double allowed = 1e-5 * (terms + std::fabs(cpu));
  if (verbose()) {
    std::printf("[ compare  ] %s: gpu %.9g cpu %.9g (error %.3g, allowed %.3g)\n", what.c_str(),
                gpu, cpu, std::fabs(gpu - cpu), allowed);
  }
  EXPECT_TRUE(std::fabs(gpu - cpu) <= allowed)
      << what << ": gpu " << gpu << " cpu " << cpu << " error " << std::fabs(gpu - cpu)
      << " > allowed " << allowed << " (terms " << terms << ")";
}

class OpsCuda : public test::StreamTest {};

// ---------------------------------------------------------------------------------------------
// RMSNorm

struct NormCase {
  int64_t rows;
  int64_t dim;
  size_t offset;  // 1: unaligned pointers
};

TEST_F(OpsCuda, RmsNormMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  const NormCase cases[] = {{1, 8, 0},     {37, 768, 0}, {1000, 1536, 0}, {129, 100, 0},
                            {5, 2048, 0},  {300, 64, 0}, {3, 7, 0},       {7, 256, 1},
                            {513, 128, 0}, {2, 4096, 0}};
  for (const NormCase& c : cases) {
    const std::string shape =
        fmt::format("rows {} dim {}{}", c.rows, c.dim, c.offset ? " unaligned" : "");
    const size_t n = static_cast<size_t>(c.rows * c.dim);
    // Rows of different scales: rstd must follow each.
    std::vector<bf16> x = random_bf16(rng_, n, -2.0, 2.0);
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t i = 0; i < c.dim; ++i)
        x[r * c.dim + i] =
            float_to_bf16(bf16_to_float(x[r * c.dim + i]) * std::ldexp(1.0f, int(r % 7) - 3));
    // A zero block in a row that has others (a block cast's amax 0), and blocks of different
    // scales within rows.
    if (c.rows > 1 && c.dim >= 256) std::fill_n(x.begin() + c.dim, 128, bf16{});
    for (int64_t i = 0; i < int64_t(n); ++i)
      if ((i % c.dim) / 128 % 3 == 2) x[i] = float_to_bf16(bf16_to_float(x[i]) * 1e-3f);

    Device<bf16> device_x(x, c.offset);
    Device<bf16> out(n, c.offset);
    Device<float> rstd(static_cast<size_t>(c.rows));
    out.poison_nan();
    rstd.poison_nan();
    ops::cuda::rmsnorm_forward(out.get(), rstd.get(), device_x.get(), c.rows, c.dim, kEps, stream_);
    const std::vector<bf16> gpu_out = out.download();
    const std::vector<float> gpu_rstd = rstd.download();

    std::vector<double> cpu_out(n), cpu_rstd(static_cast<size_t>(c.rows));
    ops::rmsnorm_forward(cpu_out.data(), cpu_rstd.data(), widen(x).data(), c.rows, c.dim);
    expect_close(widen(gpu_out), cpu_out, kBf16Tolerance, "rmsnorm_forward out, " + shape);
    expect_close(widen(gpu_rstd), cpu_rstd, kFp32Tolerance, "rmsnorm_forward rstd, " + shape);

    // In place: the same bits as out of place.
    rstd.poison_nan();
    ops::cuda::rmsnorm_forward(device_x.get(), rstd.get(), device_x.get(), c.rows, c.dim, kEps,
                               stream_);
    expect_bitwise_equal(device_x.download(), gpu_out, "rmsnorm_forward in place, " + shape);
    expect_bitwise_equal(rstd.download(), gpu_rstd, "rmsnorm_forward in place rstd, " + shape);

    // The fused FP8 cast: the same bf16 output and rstd, the bytes and amax of quantize() on
    // that output (E4M3 and E5M2: the formats an FP8 linear's input takes). The in-place run
    // above overwrote device_x.
    const Device<bf16> fresh_x(x, c.offset);
    for (Fp8Format format : {Fp8Format::E4M3, Fp8Format::E5M2}) {
      const std::string where =
          fmt::format("rmsnorm_forward {} cast, {}", format_name(format), shape);
      const float scale =
          fp8t::scale_from_amax(amax(gpu_out.data(), int64_t(n)), format_max(format), false, 0.0f) *
          0.5f;  // some values saturate past the overflow threshold
      Device<bf16> fused_out(n, c.offset);
      Device<float> fused_rstd(static_cast<size_t>(c.rows));
      Device<float> device_scale(std::vector<float>{scale});
      Device<float> device_amax(std::vector<float>{0.0f});
      Device<uint8_t> codes(n, c.offset);
      fused_out.poison_nan();
      fused_rstd.poison_nan();
      codes.poison_nan();
      ops::cuda::FusedCast cast{device_scale.get(), format, codes.get(), device_amax.get()};
      ops::cuda::rmsnorm_forward(fused_out.get(), fused_rstd.get(), fresh_x.get(), c.rows, c.dim,
                                 kEps, stream_, cast);
      expect_bitwise_equal(fused_out.download(), gpu_out, where + " out");
      expect_bitwise_equal(fused_rstd.download(), gpu_rstd, where + " rstd");
      std::vector<uint8_t> expected(n);
      float expected_amax = 0.0f;
      quantize(gpu_out.data(), int64_t(n), scale, format, expected.data(), &expected_amax);
      expect_bitwise_equal(codes.download(), expected, where + " codes");
      expect_bitwise_equal(device_amax.download(), std::vector<float>{expected_amax},
                           where + " amax");
      // The amax alone (tensorwise measures it before the scale exists).
      Device<float> amax_only(std::vector<float>{0.0f});
      ops::cuda::rmsnorm_forward(fused_out.get(), fused_rstd.get(), fresh_x.get(), c.rows, c.dim,
                                 kEps, stream_, {nullptr, format, nullptr, amax_only.get()});
      expect_bitwise_equal(amax_only.download(), std::vector<float>{expected_amax},
                           where + " amax only");
    }

    // The fused block cast (blockwise): the bytes and scales of the CPU's 1x128 quantize_blocks()
    // of that output, the scales block-major.
    if (c.dim % 128 == 0 && c.offset == 0) {
      for (Fp8Format format : {Fp8Format::E4M3, Fp8Format::E5M2}) {
        for (bool power_of_2 : {true, false}) {
          const std::string where =
              fmt::format("rmsnorm_forward {} block cast{}, {}", format_name(format),
                          power_of_2 ? " (power-of-2 scales)" : "", shape);
          const auto scale_count = static_cast<size_t>(c.dim / 128 * c.rows);
          Device<bf16> fused_out(n);
          Device<float> fused_rstd(static_cast<size_t>(c.rows));
          Device<uint8_t> codes(n);
          Device<float> scales(scale_count);
          fused_out.poison_nan();
          fused_rstd.poison_nan();
          codes.poison_nan();
          scales.poison_nan();
          ops::cuda::FusedCast cast;
          cast.format = format;
          cast.out = codes.get();
          cast.block_scales = scales.get();
          cast.power_of_2_scales = power_of_2;
          cast.amax_epsilon = power_of_2 ? 0.0f : 1e-6f;
          ops::cuda::rmsnorm_forward(fused_out.get(), fused_rstd.get(), fresh_x.get(), c.rows,
                                     c.dim, kEps, stream_, cast);
          expect_bitwise_equal(fused_out.download(), gpu_out, where + " out");
          expect_bitwise_equal(fused_rstd.download(), gpu_rstd, where + " rstd");
          const BlockMajorCast expected =
              block_major_cast(gpu_out, c.rows, c.dim,
                               {BlockScaling::Rows1x128, format, power_of_2, cast.amax_epsilon});
          expect_bitwise_equal(codes.download(), expected.codes, where + " codes");
          expect_bitwise_equal(scales.download(), expected.scales, where + " scales");
        }
      }
    } else {
      ops::cuda::FusedCast cast;
      cast.out = reinterpret_cast<uint8_t*>(out.get());
      cast.block_scales = rstd.get();
      EXPECT_THROW(ops::cuda::rmsnorm_forward(out.get(), rstd.get(), fresh_x.get(), c.rows, c.dim,
                                              kEps, stream_, cast),
                   Error)
          << "a block cast of " << shape;
    }

    // Backward from the GPU forward's output and rstd.
    const std::vector<bf16> dout = random_bf16(rng_, n);
    Device<bf16> device_dout(dout, c.offset);
    Device<bf16> device_out(gpu_out, c.offset);
    for (GradStore store : {GradStore::Write, GradStore::Add}) {
      GradientStart start = gradient_start(rng_, n, store);
      Device<bf16> dinp(start.device, c.offset);
      ops::cuda::rmsnorm_backward(dinp.get(), device_dout.get(), device_out.get(), rstd.get(),
                                  c.rows, c.dim, store, stream_);
      ops::rmsnorm_backward(start.cpu.data(), widen(dout).data(), widen(gpu_out).data(),
                            widen(gpu_rstd).data(), c.rows, c.dim);
      expect_close(widen(dinp.download()), start.cpu, kBf16Tolerance,
                   fmt::format("rmsnorm_backward ({}), {}", store_name(store), shape));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Rotary, alone and fused with the per-head RMSNorm

struct RotaryCase {
  ops::cuda::RotaryShape shape;
  size_t offset;
};

std::string describe(const RotaryCase& c) {
  return fmt::format("B {} T {} H {} D {}{}", c.shape.batch, c.shape.seq_len, c.shape.heads,
                     c.shape.head_dim, c.offset ? " unaligned" : "");
}

const RotaryCase kRotaryCases[] = {
    {{2, 17, 3, 128}, 0}, {{1, 64, 5, 64}, 0}, {{3, 9, 2, 10}, 0},  {{1, 33, 4, 256}, 0},
    {{2, 5, 3, 128}, 1},  {{1, 1, 1, 2}, 0},   {{4, 31, 6, 64}, 0}, {{1, 7, 3, 96}, 0},
};

struct RotaryTables {
  std::vector<float> cos, sin;
  Device<float> device_cos, device_sin;
};

// Tables for more positions than the sequence: only the first seq_len rows are used.
RotaryTables make_tables(const ops::cuda::RotaryShape& shape) {
  const int64_t positions = shape.seq_len + 3;
  const size_t count = static_cast<size_t>(positions * shape.head_dim / 2);
  std::vector<float> cos(count), sin(count);
  ops::rotary_tables(cos.data(), sin.data(), positions, shape.head_dim);
  return {cos, sin, Device<float>(cos), Device<float>(sin)};
}

size_t element_count(const ops::cuda::RotaryShape& s) {
  return static_cast<size_t>(s.batch * s.seq_len * s.heads * s.head_dim);
}

TEST_F(OpsCuda, RotaryMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const RotaryCase& c : kRotaryCases) {
    const ops::cuda::RotaryShape& s = c.shape;
    const std::string shape = describe(c);
    const size_t n = element_count(s);
    const RotaryTables tables = make_tables(s);
    const std::vector<bf16> x = random_bf16(rng_, n, -3.0, 3.0);

    Device<bf16> device_x(x, c.offset);
    Device<bf16> out(n, c.offset);
    out.poison_nan();
    ops::cuda::rotary_forward(out.get(), device_x.get(), tables.device_cos.get(),
                              tables.device_sin.get(), s, stream_);
    const std::vector<bf16> gpu_out = out.download();
    std::vector<double> cpu_out(n);
    ops::rotary_forward(cpu_out.data(), widen(x).data(), tables.cos.data(), tables.sin.data(),
                        s.batch, s.seq_len, s.heads, s.head_dim);
    expect_close(widen(gpu_out), cpu_out, kBf16Tolerance, "rotary_forward, " + shape);

    ops::cuda::rotary_forward(device_x.get(), device_x.get(), tables.device_cos.get(),
                              tables.device_sin.get(), s, stream_);
    expect_bitwise_equal(device_x.download(), gpu_out, "rotary_forward in place, " + shape);

    const std::vector<bf16> dout = random_bf16(rng_, n);
    Device<bf16> device_dout(dout, c.offset);
    for (GradStore store : {GradStore::Write, GradStore::Add}) {
      GradientStart start = gradient_start(rng_, n, store);
      Device<bf16> dinp(start.device, c.offset);
      ops::cuda::rotary_backward(dinp.get(), device_dout.get(), tables.device_cos.get(),
                                 tables.device_sin.get(), s, store, stream_);
      ops::rotary_backward(start.cpu.data(), widen(dout).data(), tables.cos.data(),
                           tables.sin.data(), s.batch, s.seq_len, s.heads, s.head_dim);
      expect_close(widen(dinp.download()), start.cpu, kBf16Tolerance,
                   fmt::format("rotary_backward ({}), {}", store_name(store), shape));
    }
  }
}

TEST_F(OpsCuda, RotaryRmsNormMatchesCpuRotaryThenRmsNorm) {
  SCOPED_TRACE(rng_.trace());
  for (const RotaryCase& c : kRotaryCases) {
    const ops::cuda::RotaryShape& s = c.shape;
    const std::string shape = describe(c);
    const size_t n = element_count(s);
    const int64_t head_rows = s.batch * s.seq_len * s.heads;
    const RotaryTables tables = make_tables(s);
    const std::vector<bf16> x = random_bf16(rng_, n, -3.0, 3.0);

    Device<bf16> device_x(x, c.offset);
    Device<bf16> out(n, c.offset);
    Device<float> rstd(static_cast<size_t>(head_rows));
    out.poison_nan();
    rstd.poison_nan();
    ops::cuda::rotary_rmsnorm_forward(out.get(), rstd.get(), device_x.get(),
                                      tables.device_cos.get(), tables.device_sin.get(), s, kEps,
                                      stream_);
    const std::vector<bf16> gpu_out = out.download();
    const std::vector<float> gpu_rstd = rstd.download();
    std::vector<double> rotated(n), cpu_out(n), cpu_rstd(static_cast<size_t>(head_rows));
    ops::rotary_forward(rotated.data(), widen(x).data(), tables.cos.data(), tables.sin.data(),
                        s.batch, s.seq_len, s.heads, s.head_dim);
    ops::rmsnorm_forward(cpu_out.data(), cpu_rstd.data(), rotated.data(), head_rows, s.head_dim);
    expect_close(widen(gpu_out), cpu_out, kBf16Tolerance, "rotary_rmsnorm_forward out, " + shape);
    expect_close(widen(gpu_rstd), cpu_rstd, kFp32Tolerance,
                 "rotary_rmsnorm_forward rstd, " + shape);

    rstd.poison_nan();
    ops::cuda::rotary_rmsnorm_forward(device_x.get(), rstd.get(), device_x.get(),
                                      tables.device_cos.get(), tables.device_sin.get(), s, kEps,
                                      stream_);
    expect_bitwise_equal(device_x.download(), gpu_out, "rotary_rmsnorm_forward in place, " + shape);
    expect_bitwise_equal(rstd.download(), gpu_rstd,
                         "rotary_rmsnorm_forward in place rstd, " + shape);

    // Backward from the GPU forward's output and rstd: the CPU runs the RMSNorm backward, then
    // the rotary backward.
    const std::vector<bf16> dout = random_bf16(rng_, n);
    Device<bf16> device_dout(dout, c.offset);
    Device<bf16> device_out(gpu_out, c.offset);
    std::vector<double> dnorm(n, 0.0);
    ops::rmsnorm_backward(dnorm.data(), widen(dout).data(), widen(gpu_out).data(),
                          widen(gpu_rstd).data(), head_rows, s.head_dim);
    for (GradStore store : {GradStore::Write, GradStore::Add}) {
      GradientStart start = gradient_start(rng_, n, store);
      Device<bf16> dinp(start.device, c.offset);
      ops::cuda::rotary_rmsnorm_backward(dinp.get(), device_dout.get(), device_out.get(),
                                         rstd.get(), tables.device_cos.get(),
                                         tables.device_sin.get(), s, store, stream_);
      ops::rotary_backward(start.cpu.data(), dnorm.data(), tables.cos.data(), tables.sin.data(),
                           s.batch, s.seq_len, s.heads, s.head_dim);
      expect_close(widen(dinp.download()), start.cpu, kBf16Tolerance,
                   fmt::format("rotary_rmsnorm_backward ({}), {}", store_name(store), shape));
    }
  }
}

// The rotary norm's gradient cast in 1x128 blocks without being stored: the bytes of
// rotary_rmsnorm_backward followed by the block cast of its output, in both orientations, into
// the rows [128, 128 + cols) of a larger transposed operand (a joint weight gradient's), nothing
// written outside; its codes decode to the CPU's gradient within the format's precision.
TEST_F(OpsCuda, RotaryRmsNormBackwardCastMatchesBackwardThenBlockCast) {
  SCOPED_TRACE(rng_.trace());
  const ops::cuda::RotaryShape shapes[] = {
      {2, 192, 3, 128}, {1, 200, 2, 128}, {3, 40, 1, 128}, {8, 512, 12, 128}};
  for (const ops::cuda::RotaryShape& s : shapes) {
    const int64_t rows = s.batch * s.seq_len, cols = s.heads * s.head_dim;
    const int64_t head_rows = rows * s.heads, blocks = cols / 128;
    const int64_t lines = cols + 256, first_line = 128;  // of the transposed operand
    const int64_t row_blocks = (rows + 127) / 128;
    const size_t n = element_count(s);
    const std::string shape = describe({s, 0});
    const RotaryTables tables = make_tables(s);
    // Heads of different magnitudes, so that blocks take different scales.
    std::vector<bf16> x = random_bf16(rng_, n, -3.0, 3.0), dout = random_bf16(rng_, n);
    for (size_t i = 0; i < n; ++i) {
      const double magnitude = std::ldexp(1.0, static_cast<int>(i / 128 % 7) * 3 - 9);
      dout[i] = float_to_bf16(static_cast<float>(bf16_to_float(dout[i]) * magnitude));
    }
    Device<bf16> device_x(x), out(n), dinp(n), device_dout(dout);
    Device<float> rstd(static_cast<size_t>(head_rows));
    ops::cuda::rotary_rmsnorm_forward(out.get(), rstd.get(), device_x.get(),
                                      tables.device_cos.get(), tables.device_sin.get(), s, kEps,
                                      stream_);
    dinp.poison_nan();
    ops::cuda::rotary_rmsnorm_backward(dinp.get(), device_dout.get(), out.get(), rstd.get(),
                                       tables.device_cos.get(), tables.device_sin.get(), s,
                                       GradStore::Write, stream_);
    std::vector<double> dnorm(n, 0.0), cpu_dinp(n, 0.0);
    ops::rmsnorm_backward(dnorm.data(), widen(dout).data(), widen(out.download()).data(),
                          widen(rstd.download()).data(), head_rows, s.head_dim);
    ops::rotary_backward(cpu_dinp.data(), dnorm.data(), tables.cos.data(), tables.sin.data(),
                         s.batch, s.seq_len, s.heads, s.head_dim);
    for (const Fp8Format format : {Fp8Format::E5M2, Fp8Format::E4M3}) {
      for (const bool power_of_2 : {true, false}) {
        const std::string where = fmt::format("{} {}, {}", format_name(format),
                                              power_of_2 ? "2^k scales" : "scales", shape);
        // Poisoned copies; the transposed ones hold `lines` lines, of which the cast fills
        // cols from first_line on.
        struct Copies {
          Device<uint8_t> codes, codes_t;
          Device<float> scales, scales_t;
          fp8t::cuda::BlockCastOutput target(const BlockQuantization& spec, int64_t rows,
                                             int64_t lines, int64_t first_line) {
            for (auto* bytes : {&codes, &codes_t})
              bytes->poison_nan();
            scales.poison_nan();
            scales_t.poison_nan();
            return {spec,
                    codes.get(),
                    scales.get(),
                    codes_t.get() + first_line * rows,
                    scales_t.get() + first_line,
                    lines};
          }
        };
        const BlockQuantization spec{BlockScaling::Rows1x128, format, power_of_2, 0.0f};
        Copies fused{Device<uint8_t>(n), Device<uint8_t>(static_cast<size_t>(lines * rows)),
                     Device<float>(static_cast<size_t>(blocks * rows)),
                     Device<float>(static_cast<size_t>(row_blocks * lines))};
        Copies apart{Device<uint8_t>(n), Device<uint8_t>(static_cast<size_t>(lines * rows)),
                     Device<float>(static_cast<size_t>(blocks * rows)),
                     Device<float>(static_cast<size_t>(row_blocks * lines))};
        const fp8t::cuda::BlockCastOutput to_fused = fused.target(spec, rows, lines, first_line);
        ops::cuda::rotary_rmsnorm_backward_cast(device_dout.get(), out.get(), rstd.get(),
                                                tables.device_cos.get(), tables.device_sin.get(), s,
                                                to_fused, stream_);
        const fp8t::cuda::BlockCastOutput to_apart = apart.target(spec, rows, lines, first_line);
        fp8t::cuda::quantize_blocks(dinp.get(), rows, cols, spec, to_apart.out, to_apart.scales,
                                    to_apart.out_t, to_apart.scales_t, stream_, nullptr,
                                    fp8t::cuda::BlockScaleOrder::BlockMajor,
                                    fp8t::cuda::CastInput::Value, nullptr, lines);
        const std::vector<uint8_t> codes = fused.codes.download();
        const std::vector<float> scales = fused.scales.download();
        expect_bitwise_equal(codes, apart.codes.download(), "codes, " + where);
        expect_bitwise_equal(scales, apart.scales.download(), "scales, " + where);
        expect_bitwise_equal(fused.codes_t.download(), apart.codes_t.download(),
                             "transposed codes, " + where);
        expect_bitwise_equal(fused.scales_t.download(), apart.scales_t.download(),
                             "transposed scales, " + where);
        // Block-major scales: block b of row r at b * rows + r.
        std::vector<double> decoded(n);
        for (size_t i = 0; i < n; ++i) {
          const int64_t row = static_cast<int64_t>(i) / cols,
                        block = static_cast<int64_t>(i) % cols / 128;
          decoded[i] = static_cast<double>(decode(codes[i], format)) *
                       scales[static_cast<size_t>(block * rows + row)];
        }
        const double precision = format == Fp8Format::E5M2 ? 0.125 : 0.0625;
        expect_close(decoded, cpu_dinp, Tolerance{precision, precision, 1e-3},
                     "decoded codes against the CPU, " + where);
      }
    }
  }
  // Refused: other head dims, 128x128 tiles, a missing transposed copy, unaligned inputs.
  const ops::cuda::RotaryShape s{1, 128, 2, 128};
  const RotaryTables tables = make_tables(s);
  const size_t n = element_count(s);
  Device<bf16> dout(n), unaligned_dout(n, 1), out(n);
  Device<float> rstd(256);
  Device<uint8_t> codes(n), codes_t(n);
  Device<float> scales(256), scales_t(256);
  const BlockQuantization rows_spec{BlockScaling::Rows1x128, Fp8Format::E5M2, true, 0.0f};
  const BlockQuantization tile_spec{BlockScaling::Tile128x128, Fp8Format::E5M2, true, 0.0f};
  const fp8t::cuda::BlockCastOutput target{rows_spec,     codes.get(),    scales.get(),
                                           codes_t.get(), scales_t.get(), 0};
  const auto cast = [&](const ops::cuda::RotaryShape& shape, const bf16* gradient,
                        const fp8t::cuda::BlockCastOutput& to) {
    ops::cuda::rotary_rmsnorm_backward_cast(gradient, out.get(), rstd.get(),
                                            tables.device_cos.get(), tables.device_sin.get(), shape,
                                            to, stream_);
  };
  EXPECT_THROW(cast({1, 128, 4, 64}, dout.get(), target), Error) << "head dim 64";
  fp8t::cuda::BlockCastOutput tiles = target;
  tiles.spec = tile_spec;
  EXPECT_THROW(cast(s, dout.get(), tiles), Error) << "128x128 tiles";
  fp8t::cuda::BlockCastOutput rows_only = target;
  rows_only.out_t = nullptr;
  EXPECT_THROW(cast(s, dout.get(), rows_only), Error) << "no transposed copy";
  EXPECT_THROW(cast(s, unaligned_dout.get(), target), Error) << "an unaligned gradient";
  cast(s, dout.get(), target);
  FP8T_CUDA_CHECK(cudaDeviceSynchronize());
}

// ---------------------------------------------------------------------------------------------
// relu^2 and the residual mix

TEST_F(OpsCuda, Relu2MatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const PointwiseCase& c : kPointwiseCases) {
    const std::string shape = describe(c);
    const size_t n = static_cast<size_t>(c.n);
    std::vector<bf16> x = random_bf16(rng_, n, -3.0, 3.0);
    for (size_t i = 0; i < n; i += 11)
      x[i] = bf16{0};  // relu's kink: no gradient at 0

    Device<bf16> device_x(x, c.offset);
    Device<bf16> out(n, c.offset);
    out.poison_nan();
    ops::cuda::relu2_forward(out.get(), device_x.get(), c.n, stream_);
    const std::vector<bf16> gpu_out = out.download();
    std::vector<double> cpu_out(n);
    ops::relu2_forward(cpu_out.data(), widen(x).data(), c.n);
    expect_close(widen(gpu_out), cpu_out, kBf16Tolerance, "relu2_forward, " + shape);

    const std::vector<bf16> dout = random_bf16(rng_, n);
    Device<bf16> device_dout(dout, c.offset);
    for (GradStore store : {GradStore::Write, GradStore::Add}) {
      GradientStart start = gradient_start(rng_, n, store);
      Device<bf16> dinp(start.device, c.offset);
      ops::cuda::relu2_backward(dinp.get(), device_dout.get(), device_x.get(), c.n, store, stream_);
      ops::relu2_backward(start.cpu.data(), widen(dout).data(), widen(x).data(), c.n);
      expect_close(widen(dinp.download()), start.cpu, kBf16Tolerance,
                   fmt::format("relu2_backward ({}), {}", store_name(store), shape));
    }

    ops::cuda::relu2_forward(device_x.get(), device_x.get(), c.n, stream_);
    expect_bitwise_equal(device_x.download(), gpu_out, "relu2_forward in place, " + shape);
  }
}

TEST_F(OpsCuda, ResidualMixMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const PointwiseCase& c : kPointwiseCases) {
    const std::string shape = describe(c);
    const size_t n = static_cast<size_t>(c.n);
    const std::vector<bf16> x = random_bf16(rng_, n, -4.0, 4.0);
    const std::vector<bf16> x0 = random_bf16(rng_, n, -1.0, 1.0);
    const float resid_lambda = static_cast<float>(rng_.uniform(0.5, 1.5));
    const float x0_lambda = static_cast<float>(rng_.uniform(-0.5, 0.5));
    Device<float> lambdas(std::vector<float>{resid_lambda, x0_lambda});
    Device<bf16> device_x(x, c.offset), device_x0(x0, c.offset);

    Device<bf16> out(n, c.offset);
    out.poison_nan();
    ops::cuda::residual_mix_forward(out.get(), device_x.get(), device_x0.get(), lambdas.get(),
                                    lambdas.get() + 1, c.n, stream_);
    const std::vector<bf16> gpu_out = out.download();
    std::vector<double> cpu_out(n);
    ops::residual_mix_forward(cpu_out.data(), widen(x).data(), widen(x0).data(), resid_lambda,
                              x0_lambda, c.n);
    expect_close(widen(gpu_out), cpu_out, kBf16Tolerance, "residual_mix_forward, " + shape);

    const std::vector<bf16> dout = random_bf16(rng_, n);
    Device<bf16> device_dout(dout, c.offset);
    Device<float> workspace(static_cast<size_t>(ops::cuda::kResidualMixWorkspaceFloats));
    double terms_x = 0.0, terms_x0 = 0.0;
    for (size_t i = 0; i < n; ++i) {
      terms_x += std::fabs(double(bf16_to_float(dout[i])) * bf16_to_float(x[i]));
      terms_x0 += std::fabs(double(bf16_to_float(dout[i])) * bf16_to_float(x0[i]));
    }
    const GradStore store_pairs[][2] = {{GradStore::Write, GradStore::Write},
                                        {GradStore::Add, GradStore::Add},
                                        {GradStore::Write, GradStore::Add}};
    std::vector<float> first_lambda_gradients;
    for (const auto& stores : store_pairs) {
      const std::string what = fmt::format("residual_mix_backward (dx {}, dx0 {}), {}",
                                           store_name(stores[0]), store_name(stores[1]), shape);
      GradientStart dx = gradient_start(rng_, n, stores[0]);
      GradientStart dx0 = gradient_start(rng_, n, stores[1]);
      Device<bf16> device_dx(dx.device, c.offset), device_dx0(dx0.device, c.offset);
      // Parameter gradients always accumulate: start them from fixed values.
      const std::vector<float> lambda_start = {0.25f, -0.5f};
      Device<float> lambda_gradients(lambda_start);
      workspace.poison_nan();
      ops::cuda::residual_mix_backward(
          device_dx.get(), device_dx0.get(), lambda_gradients.get(), lambda_gradients.get() + 1,
          device_dout.get(), device_x.get(), device_x0.get(), lambdas.get(), lambdas.get() + 1, c.n,
          stores[0], stores[1], workspace.get(), stream_);
      double cpu_dresid = lambda_start[0], cpu_dx0_lambda = lambda_start[1];
      ops::residual_mix_backward(dx.cpu.data(), dx0.cpu.data(), &cpu_dresid, &cpu_dx0_lambda,
                                 widen(dout).data(), widen(x).data(), widen(x0).data(),
                                 double(resid_lambda), double(x0_lambda), c.n);
      expect_close(widen(device_dx.download()), dx.cpu, kBf16Tolerance, what + " dx");
      expect_close(widen(device_dx0.download()), dx0.cpu, kBf16Tolerance, what + " dx0");
      const std::vector<float> gpu_lambda_gradients = lambda_gradients.download();
      expect_close_sum(gpu_lambda_gradients[0], cpu_dresid, terms_x, what + " dresid_lambda");
      expect_close_sum(gpu_lambda_gradients[1], cpu_dx0_lambda, terms_x0, what + " dx0_lambda");
      // The lambda gradients do not depend on the stores, and are reproducible bit for bit.
      if (first_lambda_gradients.empty()) first_lambda_gradients = gpu_lambda_gradients;
      expect_bitwise_equal(gpu_lambda_gradients, first_lambda_gradients,
                           what + " lambda gradients, repeated");
    }

    ops::cuda::residual_mix_forward(device_x.get(), device_x.get(), device_x0.get(), lambdas.get(),
                                    lambdas.get() + 1, c.n, stream_);
    expect_bitwise_equal(device_x.download(), gpu_out, "residual_mix_forward in place, " + shape);
  }
}

// ---------------------------------------------------------------------------------------------
// Embedding

struct EmbeddingCase {
  int64_t tokens;
  int64_t vocab;
  int64_t dim;
  double repeated;  // fraction of the tokens that are id 3 (or 0 for vocab <= 3)
  size_t offset;
};

const EmbeddingCase kEmbeddingCases[] = {
    {1, 10, 8, 0.0, 0},    {257, 1000, 768, 0.0, 0}, {4096, 512, 64, 0.3, 0},
    {100, 50, 13, 0.2, 0}, {333, 70, 24, 0.5, 1},    {2048, 32768, 128, 0.05, 0},
    {64, 5, 1536, 0.0, 0}, {1000, 3, 40, 0.0, 0},
};

std::string describe(const EmbeddingCase& c) {
  return fmt::format("tokens {} vocab {} dim {} repeated {}{}", c.tokens, c.vocab, c.dim,
                     c.repeated, c.offset ? " unaligned" : "");
}

std::vector<int32_t> random_ids(TestRng& rng, const EmbeddingCase& c) {
  std::vector<int32_t> ids(static_cast<size_t>(c.tokens));
  const int32_t frequent = c.vocab > 3 ? 3 : 0;
  for (int32_t& id : ids)
    id = rng.chance(c.repeated) ? frequent : rng.uniform_int(0, static_cast<int>(c.vocab) - 1);
  return ids;
}

TEST_F(OpsCuda, EmbeddingMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const EmbeddingCase& c : kEmbeddingCases) {
    const std::string shape = describe(c);
    const size_t n = static_cast<size_t>(c.tokens * c.dim);
    const std::vector<int32_t> ids = random_ids(rng_, c);
    const std::vector<float> table = random_floats(rng_, static_cast<size_t>(c.vocab * c.dim));
    Device<int32_t> device_ids(ids);
    Device<float> device_table(table, c.offset);

    Device<bf16> out(n, c.offset);
    out.poison_nan();
    ops::cuda::embedding_forward(out.get(), device_ids.get(), device_table.get(), c.tokens, c.vocab,
                                 c.dim, stream_);
    std::vector<double> cpu_out(n);
    ops::embedding_forward(cpu_out.data(), ids.data(), widen(table).data(), c.tokens, c.vocab,
                           c.dim);
    // Exactly the rounded table rows.
    std::vector<bf16> rounded(n);
    for (size_t i = 0; i < n; ++i)
      rounded[i] = float_to_bf16(static_cast<float>(cpu_out[i]));
    expect_bitwise_equal(out.download(), rounded, "embedding_forward, " + shape);

    const std::vector<bf16> dout = random_bf16(rng_, n);
    Device<bf16> device_dout(dout, c.offset);
    const std::vector<float> dtable_start = random_floats(rng_, table.size());
    std::vector<double> cpu_dtable = widen(dtable_start);
    ops::embedding_backward(cpu_dtable.data(), widen(dout).data(), ids.data(), c.tokens, c.vocab,
                            c.dim);

    Device<float> dtable(dtable_start, c.offset);
    ops::cuda::embedding_backward(dtable.get(), device_dout.get(), device_ids.get(), c.tokens,
                                  c.vocab, c.dim, stream_);
    expect_close(widen(dtable.download()), cpu_dtable, kFp32Tolerance,
                 "embedding_backward (atomic), " + shape);

    const size_t workspace_bytes =
        ops::cuda::embedding_backward_deterministic_workspace_bytes(c.tokens, c.vocab);
    Device<unsigned char> workspace(workspace_bytes);
    std::vector<float> first_run;
    for (int run = 0; run < 2; ++run) {
      dtable.upload(dtable_start);
      workspace.poison_nan();
      ops::cuda::embedding_backward_deterministic(dtable.get(), device_dout.get(), device_ids.get(),
                                                  c.tokens, c.vocab, c.dim, workspace.get(),
                                                  workspace_bytes, stream_);
      const std::vector<float> gpu_dtable = dtable.download();
      if (run == 0) {
        expect_close(widen(gpu_dtable), cpu_dtable, kFp32Tolerance,
                     "embedding_backward_deterministic, " + shape);
        first_run = gpu_dtable;
      } else {
        expect_bitwise_equal(gpu_dtable, first_run,
                             "embedding_backward_deterministic repeated, " + shape);
      }
    }
  }
}

// Ids outside [0, vocab) give NaN rows in the forward and are skipped by both backwards.
TEST_F(OpsCuda, EmbeddingBadIdsGiveNanRowsAndNoGradient) {
  SCOPED_TRACE(rng_.trace());
  const EmbeddingCase c{64, 40, 16, 0.0, 0};
  std::vector<int32_t> ids = random_ids(rng_, c);
  ids[5] = -1;
  ids[17] = static_cast<int32_t>(c.vocab);
  ids[63] = std::numeric_limits<int32_t>::max();
  const size_t n = static_cast<size_t>(c.tokens * c.dim);
  const std::vector<float> table = random_floats(rng_, static_cast<size_t>(c.vocab * c.dim));
  Device<int32_t> device_ids(ids);
  Device<float> device_table(table);
  Device<bf16> out(n);
  out.poison_nan();
  ops::cuda::embedding_forward(out.get(), device_ids.get(), device_table.get(), c.tokens, c.vocab,
                               c.dim, stream_);
  // The CPU op throws on bad ids: run it on the good tokens only.
  std::vector<int32_t> good_ids;
  std::vector<size_t> good_tokens;
  for (size_t t = 0; t < ids.size(); ++t) {
    if (ids[t] >= 0 && ids[t] < c.vocab) good_ids.push_back(ids[t]), good_tokens.push_back(t);
  }
  std::vector<double> expected(n, kNaN);
  for (size_t k = 0; k < good_tokens.size(); ++k)
    for (int64_t i = 0; i < c.dim; ++i)
      expected[good_tokens[k] * c.dim + i] =
          bf16_to_float(float_to_bf16(table[static_cast<size_t>(good_ids[k] * c.dim + i)]));
  expect_close(widen(out.download()), expected, kBf16Tolerance, "embedding_forward, bad ids");

  const std::vector<bf16> dout = random_bf16(rng_, n);
  std::vector<double> good_dout;
  for (size_t t : good_tokens)
    for (int64_t i = 0; i < c.dim; ++i)
      good_dout.push_back(bf16_to_float(dout[t * c.dim + i]));
  std::vector<double> cpu_dtable(table.size(), 0.0);
  ops::embedding_backward(cpu_dtable.data(), good_dout.data(), good_ids.data(),
                          static_cast<int64_t>(good_ids.size()), c.vocab, c.dim);
  Device<bf16> device_dout(dout);
  Device<float> dtable(table.size());
  dtable.upload(std::vector<float>(table.size(), 0.0f));
  ops::cuda::embedding_backward(dtable.get(), device_dout.get(), device_ids.get(), c.tokens,
                                c.vocab, c.dim, stream_);
  expect_close(widen(dtable.download()), cpu_dtable, kFp32Tolerance,
               "embedding_backward (atomic), bad ids");
  const size_t workspace_bytes =
      ops::cuda::embedding_backward_deterministic_workspace_bytes(c.tokens, c.vocab);
  Device<unsigned char> workspace(workspace_bytes);
  dtable.upload(std::vector<float>(table.size(), 0.0f));
  ops::cuda::embedding_backward_deterministic(dtable.get(), device_dout.get(), device_ids.get(),
                                              c.tokens, c.vocab, c.dim, workspace.get(),
                                              workspace_bytes, stream_);
  expect_close(widen(dtable.download()), cpu_dtable, kFp32Tolerance,
               "embedding_backward_deterministic, bad ids");
}

// ---------------------------------------------------------------------------------------------
// Soft-capped cross-entropy

struct CrossEntropyCase {
  int64_t rows;
  int64_t vocab;
  int64_t padded_vocab;
  double logit_range;  // raw logits uniform in +-range: 3 (soft) or 40 (deep in the cap)
  double ignored;      // fraction of ignored rows
  size_t offset;
};

const CrossEntropyCase kCrossEntropyCases[] = {
    {1, 8, 8, 3.0, 0.0, 0},          {7, 11, 16, 40.0, 0.3, 0},
    {300, 1000, 1024, 3.0, 0.2, 0},  {37, 1001, 1008, 40.0, 0.2, 0},
    {5, 50, 50, 10.0, 0.0, 0},       {64, 32768, 32768, 3.0, 0.1, 0},
    {3, 50257, 50304, 20.0, 0.0, 0}, {512, 8192, 8192, 40.0, 0.2, 0},
    {9, 100, 104, 5.0, 0.2, 1},
};

std::string describe(const CrossEntropyCase& c) {
  return fmt::format("rows {} vocab {} padded {} logits +-{} ignored {}{}", c.rows, c.vocab,
                     c.padded_vocab, c.logit_range, c.ignored, c.offset ? " unaligned" : "");
}

struct CrossEntropyInputs {
  std::vector<bf16> logits;  // padding columns NaN: they must never be read
  std::vector<int32_t> targets;
};

CrossEntropyInputs cross_entropy_inputs(TestRng& rng, const CrossEntropyCase& c) {
  CrossEntropyInputs inputs;
  inputs.logits =
      random_bf16(rng, static_cast<size_t>(c.rows * c.padded_vocab), -c.logit_range, c.logit_range);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t j = c.vocab; j < c.padded_vocab; ++j)
      inputs.logits[r * c.padded_vocab + j] = bf16{0x7FC0};
  inputs.targets.resize(static_cast<size_t>(c.rows));
  for (int32_t& target : inputs.targets) {
    target = rng.chance(c.ignored) ? ops::kIgnoreTarget
                                   : rng.uniform_int(0, static_cast<int>(c.vocab) - 1);
  }
  // The first and the last real column as targets.
  if (c.rows > 1) inputs.targets[0] = static_cast<int32_t>(c.vocab - 1);
  if (c.rows > 2) inputs.targets[1] = 0;
  return inputs;
}

struct CrossEntropyOutputs {
  Device<float> row_losses;
  Device<float> mean_loss;
  Device<int32_t> valid_rows;

  explicit CrossEntropyOutputs(int64_t rows)
      : row_losses(static_cast<size_t>(rows)), mean_loss(1), valid_rows(1) {
    row_losses.poison_nan();
    mean_loss.poison_nan();
    valid_rows.poison_nan();  // -1
  }
};

int32_t count_valid(const std::vector<int32_t>& targets) {
  return static_cast<int32_t>(std::count_if(
      targets.begin(), targets.end(), [](int32_t target) { return target != ops::kIgnoreTarget; }));
}

TEST_F(OpsCuda, CrossEntropyWithGradientMatchesCpu) {
  SCOPED_TRACE(rng_.trace());
  for (const CrossEntropyCase& c : kCrossEntropyCases) {
    for (const float dloss : {1.0f, 0.25f}) {
      const std::string shape = fmt::format("{} dloss {}", describe(c), dloss);
      const CrossEntropyInputs inputs = cross_entropy_inputs(rng_, c);
      Device<bf16> logits(inputs.logits, c.offset);
      Device<int32_t> targets(inputs.targets);
      CrossEntropyOutputs outputs(c.rows);
      ops::cuda::softcap_cross_entropy_with_gradient(
          logits.get(), targets.get(), c.rows, c.vocab, c.padded_vocab, kSoftcap, dloss,
          outputs.row_losses.get(), outputs.mean_loss.get(), outputs.valid_rows.get(), stream_);

      std::vector<double> cpu_gradient = widen(inputs.logits);
      std::vector<double> cpu_losses(static_cast<size_t>(c.rows));
      const ops::CrossEntropyShape cpu_shape{c.rows, c.vocab, c.padded_vocab};
      const double cpu_mean = ops::softcap_cross_entropy_with_gradient(
          cpu_gradient.data(), inputs.targets.data(), cpu_shape, double(dloss), cpu_losses.data());

      EXPECT_EQ(outputs.valid_rows.download()[0], count_valid(inputs.targets))
          << "valid_rows, " << shape;
      expect_close(widen(logits.download()), cpu_gradient, kBf16Tolerance,
                   "softcap_cross_entropy_with_gradient gradient, " + shape);
      expect_close(widen(outputs.row_losses.download()), cpu_losses, kFp32Tolerance,
                   "softcap_cross_entropy_with_gradient row losses, " + shape);
      expect_close(widen(outputs.mean_loss.download()), {cpu_mean}, kFp32Tolerance,
                   "softcap_cross_entropy_with_gradient mean loss, " + shape);
    }
  }
}

TEST_F(OpsCuda, CrossEntropyForwardMatchesCpuAndLeavesLogits) {
  SCOPED_TRACE(rng_.trace());
  for (const CrossEntropyCase& c : kCrossEntropyCases) {
    const std::string shape = describe(c);
    const CrossEntropyInputs inputs = cross_entropy_inputs(rng_, c);
    Device<bf16> logits(inputs.logits, c.offset);
    Device<int32_t> targets(inputs.targets);
    CrossEntropyOutputs outputs(c.rows);
    ops::cuda::softcap_cross_entropy_forward(
        logits.get(), targets.get(), c.rows, c.vocab, c.padded_vocab, kSoftcap,
        outputs.row_losses.get(), outputs.mean_loss.get(), outputs.valid_rows.get(), stream_);
    std::vector<double> cpu_losses(static_cast<size_t>(c.rows));
    const ops::CrossEntropyShape cpu_shape{c.rows, c.vocab, c.padded_vocab};
    const double cpu_mean = ops::softcap_cross_entropy(
        widen(inputs.logits).data(), inputs.targets.data(), cpu_shape, cpu_losses.data());
    EXPECT_EQ(outputs.valid_rows.download()[0], count_valid(inputs.targets))
        << "valid_rows, " << shape;
    expect_bitwise_equal(logits.download(), inputs.logits,
                         "softcap_cross_entropy_forward logits untouched, " + shape);
    expect_close(widen(outputs.row_losses.download()), cpu_losses, kFp32Tolerance,
                 "softcap_cross_entropy_forward row losses, " + shape);
    expect_close(widen(outputs.mean_loss.download()), {cpu_mean}, kFp32Tolerance,
                 "softcap_cross_entropy_forward mean loss, " + shape);
  }
}

// Every target ignored: loss 0 (not NaN), a zero gradient, no valid rows.
TEST_F(OpsCuda, CrossEntropyAllIgnoredGivesZeros) {
  SCOPED_TRACE(rng_.trace());
  const CrossEntropyCase c{33, 100, 104, 10.0, 1.0, 0};
  const CrossEntropyInputs inputs = cross_entropy_inputs(rng_, c);
  std::vector<int32_t> all_ignored(inputs.targets.size(), ops::kIgnoreTarget);
  Device<bf16> logits(inputs.logits);
  Device<int32_t> targets(all_ignored);
  CrossEntropyOutputs outputs(c.rows);
  ops::cuda::softcap_cross_entropy_with_gradient(
      logits.get(), targets.get(), c.rows, c.vocab, c.padded_vocab, kSoftcap, 1.0f,
      outputs.row_losses.get(), outputs.mean_loss.get(), outputs.valid_rows.get(), stream_);
  EXPECT_EQ(outputs.valid_rows.download()[0], 0);
  EXPECT_EQ(outputs.mean_loss.download()[0], 0.0f);
  expect_close(widen(outputs.row_losses.download()),
               std::vector<double>(static_cast<size_t>(c.rows), 0.0), kFp32Tolerance,
               "row losses, all ignored");
  expect_close(widen(logits.download()), std::vector<double>(inputs.logits.size(), 0.0),
               kBf16Tolerance, "gradient, all ignored");
}

// A target outside [0, vocab) (other than -1) makes its row's loss and gradient NaN, and the
// mean NaN; the other rows are unaffected.
TEST_F(OpsCuda, CrossEntropyBadTargetGivesNan) {
  SCOPED_TRACE(rng_.trace());
  const CrossEntropyCase c{6, 64, 64, 5.0, 0.0, 0};
  CrossEntropyInputs inputs = cross_entropy_inputs(rng_, c);
  const int bad_row = 4;
  std::vector<int32_t> good_targets = inputs.targets;
  good_targets[bad_row] = ops::kIgnoreTarget;
  inputs.targets[bad_row] = static_cast<int32_t>(c.vocab);
  Device<bf16> logits(inputs.logits);
  Device<int32_t> targets(inputs.targets);
  CrossEntropyOutputs outputs(c.rows);
  ops::cuda::softcap_cross_entropy_with_gradient(
      logits.get(), targets.get(), c.rows, c.vocab, c.padded_vocab, kSoftcap, 1.0f,
      outputs.row_losses.get(), outputs.mean_loss.get(), outputs.valid_rows.get(), stream_);
  // Expected: the CPU op with that row ignored, except that it counts as a valid row.
  std::vector<double> cpu_gradient = widen(inputs.logits);
  std::vector<double> cpu_losses(static_cast<size_t>(c.rows));
  const ops::CrossEntropyShape cpu_shape{c.rows, c.vocab, c.padded_vocab};
  const double valid = count_valid(good_targets);
  ops::softcap_cross_entropy_with_gradient(cpu_gradient.data(), good_targets.data(), cpu_shape,
                                           valid / (valid + 1.0), cpu_losses.data());
  cpu_losses[bad_row] = kNaN;
  std::fill(cpu_gradient.begin() + bad_row * c.padded_vocab,
            cpu_gradient.begin() + (bad_row + 1) * c.padded_vocab, kNaN);
  EXPECT_EQ(outputs.valid_rows.download()[0], count_valid(inputs.targets));
  EXPECT_TRUE(std::isnan(outputs.mean_loss.download()[0]));
  expect_close(widen(outputs.row_losses.download()), cpu_losses, kFp32Tolerance,
               "row losses, bad target");
  expect_close(widen(logits.download()), cpu_gradient, kBf16Tolerance, "gradient, bad target");
}

// Launchers check their arguments on the host before launching anything.
TEST_F(OpsCuda, LaunchersRejectBadArguments) {
  Device<bf16> a(64), b(64);
  Device<float> f(64);
  EXPECT_THROW(ops::cuda::rmsnorm_forward(a.get(), f.get(), b.get(), 4, 0, kEps, stream_), Error);
  EXPECT_THROW(
      ops::cuda::rotary_forward(a.get(), b.get(), f.get(), f.get(), {1, 2, 2, 15}, stream_), Error);
  EXPECT_THROW(ops::cuda::relu2_forward(a.get(), nullptr, 8, stream_), Error);
  EXPECT_THROW(ops::cuda::softcap_cross_entropy_forward(a.get(), nullptr, 1, 64, 32, kSoftcap,
                                                        f.get(), nullptr, nullptr, stream_),
               Error);
  Device<int32_t> ids(std::vector<int32_t>{0, 1, 2, 3});
  Device<unsigned char> small(8);
  EXPECT_THROW(ops::cuda::embedding_backward_deterministic(f.get(), a.get(), ids.get(), 4, 8, 8,
                                                           small.get(), 8, stream_),
               Error);
}

}  // namespace
}  // namespace fp8t
