// `fp8train check-numerics`: the numerics self-check. Quantizes a random normal tensor with every
// scaling recipe on the CPU path and bounds the errors, checks every format's code round trip
// and, with a GPU, that the CUDA kernels produce the CPU path's bytes.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <ios>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "cli/commands.h"
#include "core/error.h"
#include "numerics/float_bits.h"
#include "numerics/formats.h"
#include "numerics/quantize.h"
#include "numerics/scaling.h"
#include "platform/device_info.h"

#if FP8TRAIN_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/device_buffer.h"
#include "numerics/quantize_cuda.h"
#endif

namespace fp8t::cli {

namespace {

constexpr uint32_t kSeed = 1234;
// Delayed scaling runs this many steps, the checked tensor's being the last, so that the scale
// comes from an amax history; the history holds the checked tensor's amax, so nothing saturates.
constexpr int kDelayedSteps = 3;

Fp8Config load_fp8_config(const std::string& path) {
  try {
    return fp8_config_from_yaml(YAML::LoadFile(path), path);
  } catch (const YAML::BadFile&) {
    // yaml-cpp does not say why the file could not be opened; access() does.
    const char* reason =
        ::access(path.c_str(), R_OK) != 0 ? std::strerror(errno) : "cannot be opened";
    throw ConfigError(fmt::format("{}: cannot read the config file: {}", path, reason));
  } catch (const std::ios_base::failure& error) {  // opened, but reading failed (a directory)
    throw ConfigError(fmt::format("{}: cannot read the config file: {}", path, error.what()));
  } catch (const YAML::Exception& error) {
    // Syntax errors, and keys that are not plain scalars.
    if (error.mark.is_null()) throw ConfigError(fmt::format("{}: {}", path, error.msg));
    throw ConfigError(fmt::format("{}:{}:{}: invalid YAML: {}", path, error.mark.line + 1,
                                  error.mark.column + 1, error.msg));
  }
}

struct TestTensor {
  int64_t rows;
  int64_t cols;
  std::vector<bf16> values;  // row-major [rows, cols]

  int64_t count() const { return rows * cols; }
};

std::vector<bf16> random_normal_bf16(int64_t count, uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<bf16> values(static_cast<size_t>(count));
  for (bf16& value : values) {
    value = float_to_bf16(normal(generator));
  }
  return values;
}

struct RecipeCase {
  ScalingRecipe recipe;
  std::optional<BlockScaling> blocks;  // nothing: one scale for the whole tensor
};

constexpr RecipeCase kRecipeCases[] = {
    {ScalingRecipe::Delayed, std::nullopt},
    {ScalingRecipe::Tensorwise, std::nullopt},
    {ScalingRecipe::Blockwise, BlockScaling::Rows1x128},    // activations and gradients
    {ScalingRecipe::Blockwise, BlockScaling::Tile128x128},  // weights
    {ScalingRecipe::Mxfp8, BlockScaling::Mx1x32},
};

std::string scaling_label(const RecipeCase& recipe_case) {
  if (!recipe_case.blocks) return "tensor";
  const BlockShape block = block_shape(*recipe_case.blocks);
  return fmt::format("{}x{}", block.rows, block.cols);
}

// The configuration as one recipe sees it: settings such as power-of-2 scales default per recipe.
Fp8Config config_for_recipe(const Fp8Config& config, ScalingRecipe recipe) {
  Fp8Config recipe_config = config;
  recipe_config.recipe = recipe;
  return recipe_config;
}

// The formats a run with this configuration uses; with fp8: none, those of hybrid, so that the
// check still covers both the forward and the backward format.
std::vector<Fp8Format> formats_to_check(const Fp8Config& config, Fp8Family family) {
  Fp8Config checked = config;
  if (checked.mode == Fp8Mode::None) checked.mode = Fp8Mode::Hybrid;
  const Fp8Format forward = checked.format_for(TensorRole::Input, family);
  const Fp8Format backward = checked.format_for(TensorRole::GradOutput, family);
  if (forward == backward) return {forward};
  return {forward, backward};
}

BlockQuantization block_spec(BlockScaling scaling, Fp8Format format,
                             const Fp8Config& recipe_config) {
  return {.scaling = scaling,
          .format = format,
          .power_of_2_scales = recipe_config.use_power_of_2_scales(),
          .amax_epsilon = recipe_config.amax_epsilon};
}

size_t scale_count(BlockScaling scaling, int64_t rows, int64_t cols) {
  const BlockShape grid = scale_grid(scaling, rows, cols);
  return static_cast<size_t>(grid.rows) * static_cast<size_t>(grid.cols);
}

// Delayed: from the amax history of the steps; tensorwise: from the last step's own amax.
float tensor_scale(const Fp8Config& recipe_config, Fp8Format format,
                   std::span<const float> step_amaxes) {
  if (recipe_config.recipe == ScalingRecipe::Delayed) {
    DelayedScaling scaling(recipe_config.amax_history_len, recipe_config.amax_compute_algo,
                           recipe_config.margin, format_max(format));
    for (float step_amax : step_amaxes) {
      scaling.record_amax(step_amax);
      scaling.update();
    }
    return scaling.scale();
  }
  return scale_from_amax(step_amaxes.back(), format_max(format),
                         recipe_config.use_power_of_2_scales(), recipe_config.amax_epsilon);
}

// One tensor quantized by one recipe on the CPU path.
struct Quantized {
  std::vector<uint8_t> data;        // [rows, cols]
  std::vector<uint8_t> transposed;  // [cols, rows]; only for the comparison with the CUDA path
  float scale = 1.0f;               // per-tensor recipes
  float amax = 0.0f;                // per-tensor recipes
  // Block recipes: the scale grids. The fp32 storage also holds E8M0 codes (one byte each).
  std::vector<float> scales;
  std::vector<float> transposed_scales;
  std::vector<float> dequantized;
};

Quantized quantize_on_cpu(const TestTensor& x, const RecipeCase& recipe_case,
                          const Fp8Config& recipe_config, Fp8Format format,
                          std::span<const float> step_amaxes, bool with_transpose) {
  const auto count = static_cast<size_t>(x.count());
  Quantized q;
  q.data.resize(count);
  q.dequantized.resize(count);
  if (with_transpose) q.transposed.resize(count);
  if (!recipe_case.blocks) {
    q.scale = tensor_scale(recipe_config, format, step_amaxes);
    if (with_transpose) {
      quantize_transpose(x.values.data(), x.rows, x.cols, q.scale, format, q.data.data(),
                         q.transposed.data(), &q.amax);
    } else {
      quantize(x.values.data(), x.count(), q.scale, format, q.data.data(), &q.amax);
    }
    dequantize(q.data.data(), x.count(), 1.0f / q.scale, format, q.dequantized.data());
    return q;
  }
  const BlockQuantization spec = block_spec(*recipe_case.blocks, format, recipe_config);
  q.scales.resize(scale_count(spec.scaling, x.rows, x.cols));
  if (with_transpose) {
    q.transposed_scales.resize(scale_count(spec.scaling, x.cols, x.rows));
    quantize_transpose_blocks(x.values.data(), x.rows, x.cols, spec, q.data.data(), q.scales.data(),
                              q.transposed.data(), q.transposed_scales.data());
  } else {
    quantize_blocks(x.values.data(), x.rows, x.cols, spec, q.data.data(), q.scales.data());
  }
  dequantize_blocks(q.data.data(), x.rows, x.cols, spec, q.scales.data(), q.dequantized.data());
  return q;
}

struct ErrorBounds {
  double relative;
  double max_elementwise;
};

// Round to nearest errs by at most half a step: relative to the value, 2^-(m+1) in the normal
// range, and 2^-(m+1) / (1 - 2^-(m+1)) for a value just below the smallest normal that rounds up
// to it. The norm-wise bound is loose on purpose: normal data gives about 2.5% with E4M3.
ErrorBounds error_bounds(Fp8Format format) {
  const double half_step = std::ldexp(1.0, -(format_traits(format).mantissa_bits + 1));
  // Scaling by a non-power-of-2 factor in fp32 adds a few 2^-24 of relative error.
  return {half_step, half_step / (1.0 - half_step) * (1.0 + 0x1p-20)};
}

struct QuantizationErrors {
  double relative;         // ||dequantized - x|| / ||x||
  double max_elementwise;  // max |dequantized - x| / |x| over elements with normal codes
};

QuantizationErrors measure_errors(std::span<const bf16> x, const Quantized& q, Fp8Format format) {
  const int mantissa_bits = format_traits(format).mantissa_bits;
  double error_squares = 0.0;
  double value_squares = 0.0;
  double max_elementwise = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double value = bf16_to_float(x[i]);
    const double error = double{q.dequantized[i]} - value;
    error_squares += error * error;
    value_squares += value * value;
    // Subnormal codes have a fixed spacing, so their relative error has no bound: skip them.
    const bool normal_code = ((q.data[i] & 0x7Fu) >> mantissa_bits) != 0;
    if (normal_code) max_elementwise = std::max(max_elementwise, std::abs(error / value));
  }
  return {std::sqrt(error_squares / value_squares), max_elementwise};
}

// Codes that do not survive decode then encode. Each format produces one NaN code, so a NaN
// code passes when it comes back as a NaN. Non-saturating, so that infinities come back as such.
int count_round_trip_failures(Fp8Format format) {
  int failures = 0;
  for (int code = 0; code < 256; ++code) {
    const auto byte = static_cast<uint8_t>(code);
    const float value = decode(byte, format);
    const uint8_t encoded = encode(value, format, Saturation::NonSaturate);
    const bool survives = std::isnan(value) ? std::isnan(decode(encoded, format)) : encoded == byte;
    if (!survives) ++failures;
  }
  return failures;
}

#if FP8TRAIN_WITH_CUDA
constexpr cudaStream_t kDefaultStream = nullptr;  // synchronous with cudaMemcpy

// Bytes of a device buffer that differ from the expected host bytes.
template <typename T>
size_t count_differing_bytes(const DeviceBuffer<T>& actual, const void* expected) {
  const std::vector<T> values = actual.download();
  const auto* actual_bytes = reinterpret_cast<const uint8_t*>(values.data());
  const auto* expected_bytes = static_cast<const uint8_t*>(expected);
  size_t differing = 0;
  for (size_t i = 0; i < actual.bytes(); ++i) {
    if (actual_bytes[i] != expected_bytes[i]) ++differing;
  }
  return differing;
}

// Runs the recipes through fp8t::cuda on the current GPU and names each output whose bytes
// differ from the CPU path's.
class CudaComparison {
 public:
  explicit CudaComparison(const TestTensor& x) : x_(x), x_device_(x.values) {}

  std::vector<std::string> differences(const RecipeCase& recipe_case,
                                       const Fp8Config& recipe_config, Fp8Format format,
                                       const Quantized& expected) const {
    std::vector<std::string> found;
    const auto compare = [&found](std::string_view output, const auto& actual,
                                  const void* expected_bytes) {
      const size_t differing = count_differing_bytes(actual, expected_bytes);
      if (differing != 0) {
        found.push_back(
            fmt::format("{}: {} of {} bytes differ", output, differing, actual.bytes()));
      }
    };
    const bf16* x = x_device_.get();
    const auto count = static_cast<size_t>(x_.count());
    DeviceBuffer<uint8_t> data(count);
    DeviceBuffer<uint8_t> transposed(count);
    if (!recipe_case.blocks) {
      DeviceBuffer<float> scale(1);
      DeviceBuffer<float> amax(1);
      if (recipe_case.recipe == ScalingRecipe::Tensorwise) {
        // Current scaling runs whole on the device: the amax, then the scale from it.
        DeviceBuffer<float> scale_inv(1);
        amax.zero();
        cuda::amax(x, x_.count(), amax.get(), kDefaultStream);
        cuda::scale_from_amax(amax.get(), format_max(format), recipe_config.use_power_of_2_scales(),
                              recipe_config.amax_epsilon, scale.get(), scale_inv.get(),
                              kDefaultStream);
        compare("scale_from_amax scale", scale, &expected.scale);
      } else {
        scale.upload(&expected.scale);  // delayed scaling updates its scale on the host
      }
      amax.zero();
      cuda::quantize(x, x_.count(), scale.get(), format, data.get(), amax.get(), kDefaultStream);
      compare("quantize data", data, expected.data.data());
      compare("quantize amax", amax, &expected.amax);
      amax.zero();
      cuda::quantize_transpose(x, x_.rows, x_.cols, scale.get(), format, data.get(),
                               transposed.get(), amax.get(), kDefaultStream);
      compare("quantize_transpose data", data, expected.data.data());
      compare("quantize_transpose transposed", transposed, expected.transposed.data());
      compare("quantize_transpose amax", amax, &expected.amax);
      return found;
    }
    const BlockQuantization spec = block_spec(*recipe_case.blocks, format, recipe_config);
    const size_t scale_bytes = spec.scaling == BlockScaling::Mx1x32 ? 1 : sizeof(float);
    DeviceBuffer<uint8_t> scales(scale_count(spec.scaling, x_.rows, x_.cols) * scale_bytes);
    DeviceBuffer<uint8_t> transposed_scales(scale_count(spec.scaling, x_.cols, x_.rows) *
                                            scale_bytes);
    cuda::quantize_blocks(x, x_.rows, x_.cols, spec, data.get(), scales.get(), transposed.get(),
                          transposed_scales.get(), kDefaultStream);
    compare("quantize_blocks data", data, expected.data.data());
    compare("quantize_blocks scales", scales, expected.scales.data());
    compare("quantize_blocks transposed", transposed, expected.transposed.data());
    compare("quantize_blocks transposed scales", transposed_scales,
            expected.transposed_scales.data());
    return found;
  }

 private:
  const TestTensor& x_;
  DeviceBuffer<bf16> x_device_;
};
#endif

// Counts the checks and their failures.
class Tally {
 public:
  const char* record(bool passed) {
    ++checks_;
    if (!passed) ++failures_;
    return passed ? "PASS" : "FAIL";
  }
  int checks() const { return checks_; }
  int failures() const { return failures_; }

 private:
  int checks_ = 0;
  int failures_ = 0;
};

void check_round_trips(Tally& tally) {
  fmt::print("\nCode round trips (decode, then encode, all 256 codes):\n");
  for (Fp8Format format : kAllFormats) {
    const int round_trip_failures = count_round_trip_failures(format);
    fmt::print("  {:<10}{:>3} codes differ  {}\n", format_name(format), round_trip_failures,
               tally.record(round_trip_failures == 0));
  }
}

void check_quantization(const TestTensor& x, const Fp8Config& config,
                        const std::vector<Fp8Format>& formats,
                        [[maybe_unused]] const std::vector<GpuInfo>& gpus, Tally& tally) {
  std::vector<float> step_amaxes;
  for (int step = 1; step < kDelayedSteps; ++step) {
    const std::vector<bf16> earlier =
        random_normal_bf16(x.count(), kSeed + static_cast<uint32_t>(step));
    step_amaxes.push_back(amax(earlier.data(), x.count()));
  }
  step_amaxes.push_back(amax(x.values.data(), x.count()));

  std::string cuda_status = "not run: built without CUDA";
#if FP8TRAIN_WITH_CUDA
  std::optional<CudaComparison> cuda_comparison;
  if (gpus.empty()) {
    cuda_status = "not run: no GPU found";
  } else {
    cuda_comparison.emplace(x);
    cuda_status = fmt::format("GPU 0 {} ({}), bytes compared with the CPU path", gpus[0].name,
                              gpus[0].architecture());
  }
  const bool compare_with_cuda = cuda_comparison.has_value();
#else
  const bool compare_with_cuda = false;
#endif

  fmt::print("\nQuantize, then dequantize, on the CPU path:\n");
  for (Fp8Format format : formats) {
    const ErrorBounds bounds = error_bounds(format);
    fmt::print("  bounds for {}: rel. error <= {:.4f}, max rel. error (normal codes) <= {:.4f}\n",
               format_name(format), bounds.relative, bounds.max_elementwise);
  }
  fmt::print("  CUDA path: {}\n\n", cuda_status);
  fmt::print("  {:<12}{:<9}{:<10}{:<12}{:<16}{:<11}{}\n", "recipe", "scaling", "format",
             "rel. error", "max rel. error", "CUDA", "result");
  for (const RecipeCase& recipe_case : kRecipeCases) {
    const Fp8Config recipe_config = config_for_recipe(config, recipe_case.recipe);
    for (Fp8Format format : formats) {
      const Quantized q =
          quantize_on_cpu(x, recipe_case, recipe_config, format, step_amaxes, compare_with_cuda);
      const QuantizationErrors errors = measure_errors(x.values, q, format);
      const ErrorBounds bounds = error_bounds(format);
      bool passed =
          errors.relative <= bounds.relative && errors.max_elementwise <= bounds.max_elementwise;
      std::string cuda_result = "-";
      std::vector<std::string> cuda_differences;
#if FP8TRAIN_WITH_CUDA
      if (cuda_comparison) {
        cuda_differences = cuda_comparison->differences(recipe_case, recipe_config, format, q);
        cuda_result = cuda_differences.empty() ? "identical" : "DIFFERS";
        passed = passed && cuda_differences.empty();
      }
#endif
      fmt::print("  {:<12}{:<9}{:<10}{:<12.4f}{:<16.4f}{:<11}{}\n", recipe_name(recipe_case.recipe),
                 scaling_label(recipe_case), format_name(format), errors.relative,
                 errors.max_elementwise, cuda_result, tally.record(passed));
      for (const std::string& difference : cuda_differences) {
        fmt::print("      {}\n", difference);
      }
    }
  }
}

}  // namespace

int run_check_numerics(const CheckNumericsOptions& options) {
  const bool from_file = !options.config_path.empty();
  const Fp8Config config = from_file ? load_fp8_config(options.config_path) : Fp8Config{};
  const std::vector<GpuInfo> gpus = query_gpus();
  const std::string architecture = fp8_architecture(gpus);
  const Fp8Family family = resolve_family(config.dtype_family, architecture);
  const std::vector<Fp8Format> formats = formats_to_check(config, family);

  fmt::print("config: {} ({})\n", describe(config), from_file ? options.config_path : "defaults");
  if (config.mode == Fp8Mode::None) {
    fmt::print("fp8: none trains in BF16; checking hybrid's formats\n");
  }
  fmt::print("family: {} (for {}); formats:", family_name(family), architecture);
  for (Fp8Format format : formats) {
    fmt::print(" {}", format_name(format));
  }
  fmt::print("\ntensor: {} x {} bf16 from N(0, 1), seed {}\n", options.rows, options.cols, kSeed);

  Tally tally;
  check_round_trips(tally);
  const TestTensor x{options.rows, options.cols,
                     random_normal_bf16(options.rows * options.cols, kSeed)};
  check_quantization(x, config, formats, gpus, tally);

  fmt::print("\nresult: {} ({} of {} checks passed)\n", tally.failures() == 0 ? "PASS" : "FAIL",
             tally.checks() - tally.failures(), tally.checks());
  return tally.failures() == 0 ? kExitOk : kExitProblemFound;
}

}  // namespace fp8t::cli
