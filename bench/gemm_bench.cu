// Throughput of the GEMMs of a nanochat d24 step and a flux_535m step (W-GPT24 and W-FLUX535
// of shared/BENCHMARKS.md) through CublasLtGemm: BF16 against FP8 with per-tensor, row-wise and
// block scales, in the TN form every FP8 GEMM takes (out[M, N] = a[M, K]·b[N, K]ᵀ), and the
// engine's own block-scaled kernel (gemm/block_gemm_sm90.h) called directly. Outputs are bf16,
// except the weight gradients', which are added to f32 as training does (dW += ...). A mode
// that is refused shows as such; the engine's cells say in how many runs of K it summed.
//
//   gemm_bench [--iterations 50] [--shapes gpt|flux|all] [--m M --n N --k K [--weight-gradient 1]]
//              [--autotune 1] [--engine-plans 1]
//
// Default: the d24 shapes (forward and weight gradients). --m/--n/--k: one shape instead, a
// weight gradient (f32, added to) with --weight-gradient 1. --autotune 1: each cuBLASLt problem
// runs the algorithm autotuning keeps (gemm/gemm_tuning.h; timed in the warm-up, no cache file)
// instead of the heuristic's first.
//
// --engine-plans 1: a second table times the engine's 1x128 x 1x128 kernel on the weight
// gradients with K in 1 to 4 runs, the run count it chooses starred.
//
// Times are medians of CUDA-event-timed calls after warm-up (the first call of a shape also
// asks the heuristic, which the warm-up absorbs). Operands are random, never zeros.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "gemm/block_gemm_sm90.h"
#include "gemm/cublaslt_gemm.h"
#include "numerics/formats.h"

namespace {

using fp8t::DeviceBuffer;
using fp8t::gemm::CublasLtGemm;
using fp8t::gemm::Fp8Operand;
using fp8t::gemm::GemmOutput;
using fp8t::gemm::GemmType;
using fp8t::gemm::ScaleMode;

__device__ float random_value(int64_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return (h & 0xFFFFFF) * (2.0f / 16777216.0f) - 1.0f + 1e-3f;  // in (-1, 1], never 0
}

__global__ void fill_bf16(fp8t::bf16* x, int64_t count, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = fp8t::float_to_bf16(random_value(i, seed));
  }
}

// E4M3 codes of values in (-448, 448]: what a cast with a well-chosen scale produces.
__global__ void fill_e4m3(uint8_t* x, int64_t count, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = fp8t::encode(448.0f * random_value(i, seed), fp8t::Fp8Format::E4M3,
                        fp8t::Saturation::Saturate);
  }
}

__global__ void fill_f32(float* x, int64_t count, float value) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = value;
  }
}

struct Shape {
  int64_t m, n, k;
  const char* what;
  bool weight_gradient = false;  // the output is f32 and accumulated (dW += ...)

  std::string sizes() const {
    return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k);
  }
};

// d24 at 16k tokens (half a W-GPT24 micro-batch): forward (dgrad has the same sizes) and the
// weight gradients, whose K is the tokens.
constexpr Shape kD24Shapes[] = {{16384, 1536, 1536, "d24 q/k/v/proj, 16k tokens"},
                                {16384, 6144, 1536, "d24 MLP up"},
                                {16384, 1536, 6144, "d24 MLP down"},
                                {1536, 1536, 16384, "d24 q/k/v/proj weight gradient", true},
                                {6144, 1536, 16384, "d24 MLP-up weight gradient", true},
                                {1536, 6144, 16384, "d24 MLP-down weight gradient", true}};
// flux_535m at micro-batch 4: the double block's image stream (4 x 4096 tokens) and the single
// block (4 x 4608 tokens), forward and weight gradients.
constexpr Shape kFluxShapes[] = {{16384, 9216, 3072, "flux image qkv, 16k tokens"},
                                 {16384, 12288, 3072, "flux image MLP up"},
                                 {16384, 3072, 12288, "flux image MLP down"},
                                 {18432, 21504, 3072, "flux single linear1, 18k tokens"},
                                 {18432, 3072, 15360, "flux single linear2"},
                                 {9216, 3072, 16384, "flux image qkv weight gradient", true},
                                 {3072, 12288, 16384, "flux image MLP-down weight gradient", true},
                                 {21504, 3072, 18432, "flux single linear1 weight gradient", true}};

// Median milliseconds of `launch` on `stream`; negative when the first call throws (a mode
// cuBLASLt refuses), with the message in `refusal`.
double median_ms(const std::function<void()>& launch, cudaStream_t stream, int iterations,
                 std::string& refusal) {
  try {
    for (int i = 0; i < 5; ++i)
      launch();
  } catch (const fp8t::Error& error) {
    refusal = error.what();
    return -1.0;
  }
  cudaEvent_t start, stop;
  FP8T_CUDA_CHECK(cudaEventCreate(&start));
  FP8T_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < iterations; ++i) {
    FP8T_CUDA_CHECK(cudaEventRecord(start, stream));
    launch();
    FP8T_CUDA_CHECK(cudaEventRecord(stop, stream));
    FP8T_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    FP8T_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  FP8T_CUDA_CHECK(cudaEventDestroy(start));
  FP8T_CUDA_CHECK(cudaEventDestroy(stop));
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

const char* text_flag(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  }
  return fallback;
}

int64_t flag(int argc, char** argv, const char* name, int64_t fallback) {
  const char* text = text_flag(argc, argv, name, nullptr);
  return text != nullptr ? std::atoll(text) : fallback;
}

int run(int argc, char** argv) {
  const int iterations = static_cast<int>(flag(argc, argv, "--iterations", 50));
  std::vector<Shape> shapes;
  const char* set = text_flag(argc, argv, "--shapes", "gpt");
  const bool gpt = std::strcmp(set, "flux") != 0, flux = std::strcmp(set, "gpt") != 0;
  FP8T_CHECK(gpt || flux || std::strcmp(set, "all") == 0,
             "--shapes: expected gpt, flux or all, found '{}'", set);
  if (gpt) shapes.insert(shapes.end(), std::begin(kD24Shapes), std::end(kD24Shapes));
  if (flux) shapes.insert(shapes.end(), std::begin(kFluxShapes), std::end(kFluxShapes));
  if (flag(argc, argv, "--m", 0) > 0) {
    shapes = {{flag(argc, argv, "--m", 0), flag(argc, argv, "--n", 0), flag(argc, argv, "--k", 0),
               "command line", flag(argc, argv, "--weight-gradient", 0) != 0}};
  }
  cudaDeviceProp properties{};
  FP8T_CUDA_CHECK(cudaGetDeviceProperties(&properties, 0));
  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreate(&stream));
  CublasLtGemm gemm;
  const bool autotune = flag(argc, argv, "--autotune", 0) != 0;
  if (autotune) {
    fp8t::gemm::GemmTuning tuning;
    tuning.autotune_bf16 = tuning.autotune_fp8 = true;
    gemm.configure_tuning(tuning);
  }

  const char* columns[] = {"BF16",
                           "FP8 tensor, fast acc.",
                           "FP8 tensor",
                           "FP8 row-wise, fast acc.",
                           "FP8 row-wise",
                           "FP8 1x128 x 128x128",
                           "FP8 1x128 x 1x128",
                           "fp8train 1x128 x 128x128",
                           "fp8train 1x128 x 1x128"};
  constexpr size_t kFirstEngineColumn = 7;
  const bool engine_plans = flag(argc, argv, "--engine-plans", 0) != 0;
  std::vector<std::string> rows, refusals, plan_rows;
  for (const Shape& s : shapes) {
    const int64_t a_count = s.m * s.k, b_count = s.n * s.k;
    DeviceBuffer<fp8t::bf16> a_bf16(static_cast<size_t>(a_count)),
        b_bf16(static_cast<size_t>(b_count));
    DeviceBuffer<float> out(static_cast<size_t>(s.m * s.n));  // room for f32 outputs
    FP8T_CUDA_CHECK(cudaMemsetAsync(out.get(), 0, out.count() * sizeof(float), stream));
    DeviceBuffer<uint8_t> a_fp8(static_cast<size_t>(a_count)), b_fp8(static_cast<size_t>(b_count));
    // Scale factors of every mode, all 1 (the values do not change the speed): enough for the
    // largest layout (the 128x128 grid, padded) of either operand.
    const int64_t scale_values =
        std::max({fp8t::gemm::scale_count(ScaleMode::Block1x128, s.m, s.k),
                  fp8t::gemm::scale_count(ScaleMode::Block1x128, s.n, s.k),
                  fp8t::gemm::scale_count(ScaleMode::Block128x128, s.n, s.k)});
    DeviceBuffer<float> a_scales(static_cast<size_t>(scale_values)),
        b_scales(static_cast<size_t>(scale_values));
    fill_bf16<<<1024, 256, 0, stream>>>(a_bf16.get(), a_count, 1u);
    fill_bf16<<<1024, 256, 0, stream>>>(b_bf16.get(), b_count, 2u);
    fill_e4m3<<<1024, 256, 0, stream>>>(a_fp8.get(), a_count, 3u);
    fill_e4m3<<<1024, 256, 0, stream>>>(b_fp8.get(), b_count, 4u);
    fill_f32<<<64, 256, 0, stream>>>(a_scales.get(), scale_values, 1.0f);
    fill_f32<<<64, 256, 0, stream>>>(b_scales.get(), scale_values, 1.0f);
    FP8T_CUDA_CHECK_LAUNCH();

    GemmOutput output;
    output.data = out.get();
    output.ld = s.n;
    output.type = s.weight_gradient ? GemmType::F32 : GemmType::BF16;
    output.accumulate = s.weight_gradient;
    const auto fp8_operands = [&](ScaleMode a_mode, ScaleMode b_mode) {
      Fp8Operand a, b;
      a.data = a_fp8.get();
      a.ld = s.k;
      a.scale_mode = a_mode;
      a.scale_inv = a_scales.get();
      b.data = b_fp8.get();
      b.ld = s.k;
      b.scale_mode = b_mode;
      b.scale_inv = b_scales.get();
      return std::make_pair(a, b);
    };
    const auto cublaslt = [&](ScaleMode a_mode, ScaleMode b_mode, bool fast) {
      const std::pair<Fp8Operand, Fp8Operand> ab = fp8_operands(a_mode, b_mode);
      return [&, ab, fast] {
        gemm.fp8_gemm(s.m, s.n, s.k, ab.first, ab.second, output, fast, stream);
      };
    };
    const auto engine = [&](ScaleMode b_mode) {
      const std::pair<Fp8Operand, Fp8Operand> ab = fp8_operands(ScaleMode::Block1x128, b_mode);
      return [&, ab] {
        fp8t::gemm::block_gemm_sm90(s.m, s.n, s.k, ab.first, ab.second, output, false, stream);
      };
    };
    const std::function<void()> launches[] = {
        [&] {
          gemm.bf16_gemm(fp8t::gemm::Bf16Form::XWt, s.m, s.n, s.k, a_bf16.get(), s.k, b_bf16.get(),
                         s.k, output, stream);
        },
        cublaslt(ScaleMode::Tensor, ScaleMode::Tensor, true),
        cublaslt(ScaleMode::Tensor, ScaleMode::Tensor, false),
        cublaslt(ScaleMode::Row, ScaleMode::Row, true),
        cublaslt(ScaleMode::Row, ScaleMode::Row, false),
        cublaslt(ScaleMode::Block1x128, ScaleMode::Block128x128, false),
        cublaslt(ScaleMode::Block1x128, ScaleMode::Block1x128, false),
        engine(ScaleMode::Block128x128),
        engine(ScaleMode::Block1x128)};
    const double flops = 2.0 * double(s.m) * double(s.n) * double(s.k);
    const std::string label = s.sizes() + " (" + s.what + ")";
    // How the engine's kernel runs the problem (either b layout).
    const int engine_splits = fp8t::gemm::block_gemm_sm90_plan(s.m, s.n, s.k, output, false).splits;
    std::string row = label;
    for (size_t column = 0; column < std::size(launches); ++column) {
      std::string refusal;
      const double ms = median_ms(launches[column], stream, iterations, refusal);
      if (ms < 0) {
        row += " | refused";
        refusals.push_back(std::string(columns[column]) + ", " + s.sizes() + ": " + refusal);
      } else {
        char cell[96];
        std::snprintf(cell, sizeof cell, " | %.0f (%.3f ms)", flops / (ms * 1e-3) / 1e12, ms);
        row += cell;
        if (column >= kFirstEngineColumn) {
          std::snprintf(cell, sizeof cell, " [%d run%s of K]", engine_splits,
                        engine_splits > 1 ? "s" : "");
          row += cell;
        }
      }
    }
    rows.push_back(row);
    if (engine_plans && s.weight_gradient) {
      const std::pair<Fp8Operand, Fp8Operand> ab =
          fp8_operands(ScaleMode::Block1x128, ScaleMode::Block1x128);
      std::string plan_row = label;
      for (int splits = 1; splits <= 4; ++splits) {
        std::string refusal;
        const double ms = median_ms(
            [&] {
              fp8t::gemm::block_gemm_sm90_planned(s.m, s.n, s.k, ab.first, ab.second, output,
                                                  {.splits = splits}, stream);
            },
            stream, iterations, refusal);
        char cell[64];
        std::snprintf(cell, sizeof cell, " | %.0f%s", ms < 0 ? 0.0 : flops / (ms * 1e-3) / 1e12,
                      engine_splits == splits ? " *" : "");
        plan_row += cell;
      }
      plan_rows.push_back(plan_row);
    }
  }

  std::printf(
      "GPU: %s, %d SMs; cuBLASLt %s; TFLOP/s (median ms of %d), bf16 output (weight "
      "gradients: added to f32); %s\n",
      properties.name, properties.multiProcessorCount, CublasLtGemm::library_version().c_str(),
      iterations, autotune ? "autotuned algorithms" : "the heuristic's first algorithms");
  std::printf("| GEMM M x N x K (TN)");
  for (const char* column : columns)
    std::printf(" | %s", column);
  std::printf(" |\n|---");
  for (size_t i = 0; i < std::size(columns); ++i)
    std::printf("|---");
  std::printf("|\n");
  for (const std::string& row : rows)
    std::printf("| %s |\n", row.c_str());
  for (const std::string& refusal : refusals)
    std::printf("refused: %s\n", refusal.c_str());
  if (engine_plans) {
    std::printf("\nThe engine's 1x128 x 1x128 kernel by runs of K, TFLOP/s (*: its choice)\n");
    std::printf(
        "| weight gradient M x N x K | 1 run | 2 runs | 3 runs | 4 runs "
        "|\n|---|---|---|---|---|\n");
    for (const std::string& row : plan_rows)
      std::printf("| %s |\n", row.c_str());
  }
  const CublasLtGemm::Counters counters = gemm.counters();
  std::printf("cuBLASLt heuristic queries: %lld for %lld calls\n",
              static_cast<long long>(counters.heuristic_queries),
              static_cast<long long>(counters.calls));
  if (autotune) std::printf("%s\n", gemm.tuning_summary().c_str());
  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "gemm_bench: error: %s\n", error.what());
    return 2;
  }
}
