// Bandwidth of the quantization kernels on one [rows, cols] BF16 tensor, against a
// device-to-device copy measured in the same run.
//
//   quantize_bench [--rows 16384] [--cols 6144] [--iterations 50]
//
// Bytes counted are the fewest each kernel must move: BF16 read once, each FP8 output
// written once (scales are < 1 % and not counted). Two rows more cast W-GPT24's 145 fp32
// weights, whatever the tensor's shape: one launch per weight, and grouped.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "numerics/quantize_cuda.h"
#include "numerics/scaling.h"
#include "ops/cuda/ops_cuda.h"

namespace {

using fp8t::bf16;

// Deterministic pseudo-random BF16 values of mixed magnitude (never zeros).
__global__ void fill_random(bf16* x, int64_t count, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float uniform = (h & 0xFFFFFF) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
    const int exponent = static_cast<int>((h >> 24) % 16) - 8;
    x[i] = fp8t::float_to_bf16(ldexpf(uniform + 1e-3f, exponent));
  }
}

struct Result {
  std::string name;
  double bytes;
  double median_us;
};

double median_time_us(const std::function<void()>& launch, int iterations) {
  for (int i = 0; i < 5; ++i)
    launch();  // warm-up
  cudaEvent_t start, stop;
  FP8T_CUDA_CHECK(cudaEventCreate(&start));
  FP8T_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < iterations; ++i) {
    FP8T_CUDA_CHECK(cudaEventRecord(start));
    launch();
    FP8T_CUDA_CHECK(cudaEventRecord(stop));
    FP8T_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    FP8T_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  FP8T_CUDA_CHECK(cudaEventDestroy(start));
  FP8T_CUDA_CHECK(cudaEventDestroy(stop));
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return 1000.0 * times[times.size() / 2];
}

int64_t flag(int argc, char** argv, const char* name, int64_t fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoll(argv[i + 1]);
  }
  return fallback;
}

int run(int argc, char** argv) {
  const int64_t rows = flag(argc, argv, "--rows", 16384);
  const int64_t cols = flag(argc, argv, "--cols", 6144);
  const int iterations = static_cast<int>(flag(argc, argv, "--iterations", 50));
  const int64_t n = rows * cols;
  constexpr double kCopyCeiling = 4.27e12;  // bytes/s, H200 device-to-device (read + write)

  cudaDeviceProp properties{};
  FP8T_CUDA_CHECK(cudaGetDeviceProperties(&properties, 0));

  bf16 *x = nullptr, *relu2_input = nullptr, *copy_target = nullptr;
  uint8_t *out = nullptr, *out_t = nullptr, *scales = nullptr, *scales_t = nullptr;
  uint8_t *activation_t = nullptr, *activation_scales_t = nullptr;
  float *scale = nullptr, *amax = nullptr, *rstd = nullptr, *cos = nullptr, *sin = nullptr;
  fp8t::CastHealth* health = nullptr;
  const int64_t scale_bytes =
      (rows / 32 + 1) * (cols / 32 + 1) * 32;  // enough for every block grid
  FP8T_CUDA_CHECK(cudaMalloc(&x, n * sizeof(bf16)));
  FP8T_CUDA_CHECK(cudaMalloc(&relu2_input, n * sizeof(bf16)));
  FP8T_CUDA_CHECK(cudaMalloc(&copy_target, n * sizeof(bf16)));
  FP8T_CUDA_CHECK(cudaMalloc(&out, n));
  FP8T_CUDA_CHECK(cudaMalloc(&out_t, n));
  FP8T_CUDA_CHECK(cudaMalloc(&scales, scale_bytes));
  FP8T_CUDA_CHECK(cudaMalloc(&scales_t, scale_bytes));
  FP8T_CUDA_CHECK(cudaMalloc(&activation_t, n));
  FP8T_CUDA_CHECK(cudaMalloc(&activation_scales_t, scale_bytes));
  FP8T_CUDA_CHECK(cudaMalloc(&scale, sizeof(float)));
  FP8T_CUDA_CHECK(cudaMalloc(&amax, sizeof(float)));
  FP8T_CUDA_CHECK(cudaMalloc(&health, sizeof(fp8t::CastHealth)));
  // The GPT's q or k as the rotary norm's backward reads them: heads of 128, sequences of 2048.
  const int64_t seq_len = rows % 2048 == 0 ? 2048 : rows;
  const fp8t::ops::cuda::RotaryShape rotary{rows / seq_len, seq_len, cols / 128, 128};
  FP8T_CUDA_CHECK(cudaMalloc(&rstd, rows * (cols / 128) * sizeof(float)));
  FP8T_CUDA_CHECK(cudaMalloc(&cos, seq_len * 64 * sizeof(float)));
  FP8T_CUDA_CHECK(cudaMalloc(&sin, seq_len * 64 * sizeof(float)));
  for (float* table : {rstd, cos, sin})  // 0x3F3F3F3F: 0.747
    FP8T_CUDA_CHECK(cudaMemset(
        table, 0x3F, (table == rstd ? rows * (cols / 128) : seq_len * 64) * sizeof(float)));
  FP8T_CUDA_CHECK(cudaMemset(health, 0, sizeof(fp8t::CastHealth)));
  fill_random<<<1024, 256>>>(x, n, 12345u);
  FP8T_CUDA_CHECK_LAUNCH();
  fill_random<<<1024, 256>>>(relu2_input, n, 54321u);
  FP8T_CUDA_CHECK_LAUNCH();
  const float one = 1.0f;
  FP8T_CUDA_CHECK(cudaMemcpy(scale, &one, sizeof one, cudaMemcpyHostToDevice));
  FP8T_CUDA_CHECK(cudaMemset(amax, 0, sizeof(float)));

  const double input_bytes = double(n) * sizeof(bf16);
  const auto block_spec = [](fp8t::BlockScaling scaling) {
    return fp8t::BlockQuantization{scaling, fp8t::Fp8Format::E4M3, true, 0.0f};
  };
  std::vector<Result> results;
  const auto measure = [&](std::string name, double bytes, const std::function<void()>& launch) {
    results.push_back({std::move(name), bytes, median_time_us(launch, iterations)});
  };
  measure("copy (device to device, bf16)", 2 * input_bytes, [&] {
    FP8T_CUDA_CHECK(cudaMemcpyAsync(copy_target, x, n * sizeof(bf16), cudaMemcpyDeviceToDevice));
  });
  measure("amax", input_bytes, [&] { fp8t::cuda::amax(x, n, amax, nullptr); });
  measure("cast + amax (e4m3)", input_bytes + n,
          [&] { fp8t::cuda::quantize(x, n, scale, fp8t::Fp8Format::E4M3, out, amax, nullptr); });
  measure("cast + transpose + amax (e4m3)", input_bytes + 2.0 * n, [&] {
    fp8t::cuda::quantize_transpose(x, rows, cols, scale, fp8t::Fp8Format::E4M3, out, out_t, amax,
                                   nullptr);
  });
  measure("cast + amax + saturation/underflow counts (e4m3)", input_bytes + n, [&] {
    fp8t::cuda::quantize(x, n, scale, fp8t::Fp8Format::E4M3, out, amax, nullptr,
                         fp8t::cuda::CastInput::Value, nullptr, health);
  });
  measure("cast + transpose + amax + counts (e4m3)", input_bytes + 2.0 * n, [&] {
    fp8t::cuda::quantize_transpose(x, rows, cols, scale, fp8t::Fp8Format::E4M3, out, out_t, amax,
                                   nullptr, fp8t::cuda::CastInput::Value, nullptr, health);
  });
  measure("cast + amax (e4m3fnuz, software)", input_bytes + n, [&] {
    fp8t::cuda::quantize(x, n, scale, fp8t::Fp8Format::E4M3FNUZ, out, amax, nullptr);
  });
  const std::pair<const char*, fp8t::BlockScaling> block_casts[] = {
      {"blockwise 1x128", fp8t::BlockScaling::Rows1x128},
      {"blockwise 128x128", fp8t::BlockScaling::Tile128x128},
      {"mxfp8 1x32", fp8t::BlockScaling::Mx1x32}};
  for (const auto& [name, scaling] : block_casts) {
    const fp8t::BlockQuantization spec = block_spec(scaling);
    measure(std::string(name) + " + transposed", input_bytes + 2.0 * n, [&] {
      fp8t::cuda::quantize_blocks(x, rows, cols, spec, out, scales, out_t, scales_t, nullptr);
    });
  }
  // The blockwise linears' own forms: x̂ in forward, dŷ with dŷᵗ and x̂ᵗ alone in backward,
  // with 1x128 scales block-major (the GEMMs' layout).
  const fp8t::BlockQuantization rows_spec = block_spec(fp8t::BlockScaling::Rows1x128);
  const auto block_major = fp8t::cuda::BlockScaleOrder::BlockMajor;
  measure("blockwise 1x128, block-major scales", input_bytes + n, [&] {
    fp8t::cuda::quantize_blocks(x, rows, cols, rows_spec, out, scales, nullptr, nullptr, nullptr,
                                nullptr, block_major);
  });
  measure("blockwise 1x128 + transposed, block-major scales", input_bytes + 2.0 * n, [&] {
    fp8t::cuda::quantize_blocks(x, rows, cols, rows_spec, out, scales, out_t, scales_t, nullptr,
                                nullptr, block_major);
  });
  measure("blockwise 1x128 transposed alone, block-major scales", input_bytes + n, [&] {
    fp8t::cuda::quantize_blocks(x, rows, cols, rows_spec, nullptr, nullptr, out_t, scales_t,
                                nullptr, nullptr, block_major);
  });
  // The GPT MLP's casts through relu²: relu²(x) for mlp.c_proj (x̂ in forward, x̂ᵗ in backward)
  // and the gradient of relu²'s input for mlp.c_fc (dŷ with dŷᵗ, E5M2), which reads x as the
  // gradient and a second tensor as relu²'s input.
  const auto relu2 = fp8t::cuda::CastInput::Relu2;
  measure("blockwise 1x128 of relu², block-major scales", input_bytes + n, [&] {
    fp8t::cuda::quantize_blocks(x, rows, cols, rows_spec, out, scales, nullptr, nullptr, nullptr,
                                nullptr, block_major, relu2);
  });
  measure("blockwise 1x128 of relu² transposed alone, block-major", input_bytes + n, [&] {
    fp8t::cuda::quantize_blocks(x, rows, cols, rows_spec, nullptr, nullptr, out_t, scales_t,
                                nullptr, nullptr, block_major, relu2);
  });
  fp8t::BlockQuantization gradient_spec = rows_spec;
  gradient_spec.format = fp8t::Fp8Format::E5M2;
  measure("blockwise 1x128 + transposed of relu²'s gradient (e5m2)", 2 * input_bytes + 2.0 * n,
          [&] {
            fp8t::cuda::quantize_blocks(x, rows, cols, gradient_spec, out, scales, out_t, scales_t,
                                        nullptr, nullptr, block_major,
                                        fp8t::cuda::CastInput::Relu2Gradient, relu2_input);
          });
  // The same, also casting relu² of its input for mlp.c_proj's x̂ᵗ (e4m3) from the same reads:
  // the work of the two rows above it.
  measure("relu²'s gradient (e5m2) + relu² transposed (e4m3), one pass", 2 * input_bytes + 3.0 * n,
          [&] {
            fp8t::cuda::quantize_blocks(
                x, rows, cols, gradient_spec, out, scales, out_t, scales_t, nullptr, nullptr,
                block_major, fp8t::cuda::CastInput::Relu2Gradient, relu2_input, 0,
                {activation_t, reinterpret_cast<float*>(activation_scales_t)});
          });
  // q's and k's gradients through their norm and rotary (x the output's gradient, relu2_input the
  // forward's output; cols a multiple of 128): stored in bf16 and then cast (e5m2), or cast
  // without being stored.
  if (cols % 128 == 0) {
    measure("rotary norm backward, bf16 out", 3 * input_bytes, [&] {
      fp8t::ops::cuda::rotary_rmsnorm_backward(copy_target, x, relu2_input, rstd, cos, sin, rotary,
                                               fp8t::ops::cuda::GradStore::Write, nullptr);
    });
    measure("rotary norm backward cast 1x128 + transposed (e5m2), one pass",
            2 * input_bytes + 2.0 * n, [&] {
              fp8t::ops::cuda::rotary_rmsnorm_backward_cast(
                  x, relu2_input, rstd, cos, sin, rotary,
                  {gradient_spec, out, reinterpret_cast<float*>(scales), out_t,
                   reinterpret_cast<float*>(scales_t), 0},
                  nullptr);
            });
  }
  for (const auto& [name, scaling] : block_casts) {
    const fp8t::BlockQuantization spec = block_spec(scaling);
    measure(std::string(name) + " + transposed + counts", input_bytes + 2.0 * n, [&] {
      fp8t::cuda::quantize_blocks(x, rows, cols, spec, out, scales, out_t, scales_t, nullptr,
                                  health);
    });
  }

  // W-GPT24's weights as a step casts them (128x128 tiles and their transposes, e4m3), each in
  // its own buffers: per layer q, k, v and attn.c_proj [1536, 1536], mlp.c_fc [6144, 1536],
  // mlp.c_proj [1536, 6144], and lm_head [32768, 1536].
  std::vector<std::pair<int64_t, int64_t>> weight_shapes;
  for (int layer = 0; layer < 24; ++layer) {
    weight_shapes.insert(
        weight_shapes.end(),
        {{1536, 1536}, {1536, 1536}, {1536, 1536}, {1536, 1536}, {6144, 1536}, {1536, 6144}});
  }
  weight_shapes.push_back({32768, 1536});
  const auto tile_scale_floats = [](int64_t tensor_rows, int64_t tensor_cols) {
    return (tensor_rows + 127) / 128 * fp8t::padded_tile_scale_row((tensor_cols + 127) / 128);
  };
  int64_t weight_elements = 0, weight_scale_floats = 0;
  for (const auto& [weight_rows, weight_cols] : weight_shapes) {
    weight_elements += weight_rows * weight_cols;
    weight_scale_floats += tile_scale_floats(weight_rows, weight_cols);
  }
  float *weights = nullptr, *weight_scales = nullptr, *weight_scales_t = nullptr;
  uint8_t *weight_codes = nullptr, *weight_codes_t = nullptr;
  FP8T_CUDA_CHECK(cudaMalloc(&weights, weight_elements * sizeof(float)));
  FP8T_CUDA_CHECK(cudaMemset(weights, 0x3F, weight_elements * sizeof(float)));
  FP8T_CUDA_CHECK(cudaMalloc(&weight_codes, weight_elements));
  FP8T_CUDA_CHECK(cudaMalloc(&weight_codes_t, weight_elements));
  FP8T_CUDA_CHECK(cudaMalloc(&weight_scales, weight_scale_floats * sizeof(float)));
  FP8T_CUDA_CHECK(cudaMalloc(&weight_scales_t, weight_scale_floats * sizeof(float)));
  std::vector<fp8t::cuda::TileCastJob> weight_jobs;
  int64_t element_offset = 0, scale_offset = 0;
  for (const auto& [weight_rows, weight_cols] : weight_shapes) {
    weight_jobs.push_back({weights + element_offset, weight_rows, weight_cols,
                           weight_codes + element_offset, weight_scales + scale_offset,
                           weight_codes_t + element_offset, weight_scales_t + scale_offset});
    element_offset += weight_rows * weight_cols;
    scale_offset += tile_scale_floats(weight_rows, weight_cols);
  }
  const fp8t::BlockQuantization tile_spec = block_spec(fp8t::BlockScaling::Tile128x128);
  const double weight_bytes = double(weight_elements) * (sizeof(float) + 2);
  measure("W-GPT24's 145 fp32 weights, 128x128 + transposed, a launch each", weight_bytes, [&] {
    for (const fp8t::cuda::TileCastJob& job : weight_jobs) {
      fp8t::cuda::quantize_blocks(job.x, job.rows, job.cols, tile_spec, job.out, job.scales,
                                  job.out_t, job.scales_t, nullptr, nullptr,
                                  fp8t::cuda::BlockScaleOrder::PaddedLineMajor);
    }
  });
  measure("W-GPT24's 145 fp32 weights, 128x128 + transposed, grouped", weight_bytes,
          [&] { fp8t::cuda::quantize_tiles_grouped(weight_jobs, tile_spec, nullptr); });
  for (void* pointer : {static_cast<void*>(weights), static_cast<void*>(weight_codes),
                        static_cast<void*>(weight_codes_t), static_cast<void*>(weight_scales),
                        static_cast<void*>(weight_scales_t)}) {
    FP8T_CUDA_CHECK(cudaFree(pointer));
  }

  const double copy_rate = results[0].bytes / (results[0].median_us * 1e-6);
  std::printf("GPU: %s, %d SMs; tensor [%lld, %lld] bf16; median of %d\n", properties.name,
              properties.multiProcessorCount, static_cast<long long>(rows),
              static_cast<long long>(cols), iterations);
  std::printf(
      "| kernel | median us | GB/s | of the H200 copy (4.27 TB/s) | of measured copy "
      "|\n|---|---|---|---|---|\n");
  for (const Result& result : results) {
    const double rate = result.bytes / (result.median_us * 1e-6);
    std::printf("| %s | %.1f | %.0f | %.1f %% | %.1f %% |\n", result.name.c_str(), result.median_us,
                rate / 1e9, 100.0 * rate / kCopyCeiling, 100.0 * rate / copy_rate);
  }
  for (void* pointer :
       {static_cast<void*>(x), static_cast<void*>(relu2_input), static_cast<void*>(copy_target),
        static_cast<void*>(out), static_cast<void*>(out_t), static_cast<void*>(scales),
        static_cast<void*>(scales_t), static_cast<void*>(activation_t),
        static_cast<void*>(activation_scales_t), static_cast<void*>(scale),
        static_cast<void*>(amax), static_cast<void*>(health), static_cast<void*>(rstd),
        static_cast<void*>(cos), static_cast<void*>(sin)}) {
    FP8T_CUDA_CHECK(cudaFree(pointer));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "quantize_bench: error: %s\n", error.what());
    return 2;
  }
}
