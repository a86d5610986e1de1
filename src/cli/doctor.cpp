// `fp8train doctor`: what this machine and build offer for FP8 training.
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "distributed/launch.h"
#include "numerics/formats.h"
#include "platform/device_info.h"

namespace fp8t::cli {

namespace {

// The formats fp8_dtype_family: auto resolves to on this machine.
struct FamilyChoice {
  std::string architecture;  // GPU 0's "sm_NN", or "cpu"
  Fp8Family family;
  Fp8Format forward_format;   // input and weight
  Fp8Format backward_format;  // grad_output with fp8: hybrid
};

FamilyChoice choose_family(const DeviceInfo& info) {
  const std::string architecture = fp8_architecture(info.gpus);
  const Fp8Family family = resolve_family(FamilySetting::Auto, architecture);
  return {architecture, family, e4m3_format(family), e5m2_format(family)};
}

// The conclusion of the report, shared by the text and JSON forms.
struct Verdict {
  int exit_code;
  std::string status;  // a stable word for scripts
  std::string summary;
};

constexpr const char* kCpuEmulation = "the CPU path emulates FP8 (quantize/dequantize + fp32 GEMM)";

std::string describe_gpu(const GpuInfo& gpu) {
  return fmt::format("GPU {} {} ({})", gpu.index, gpu.name, gpu.architecture());
}

std::string join(const std::vector<std::string>& parts) {
  std::string joined;
  for (const std::string& part : parts) {
    joined += (joined.empty() ? "" : ", ") + part;
  }
  return joined;
}

Verdict judge(const DeviceInfo& info) {
  if (!info.built_with_cuda) {
    return {kExitOk, "no_cuda", fmt::format("built without CUDA; {}", kCpuEmulation)};
  }
  if (info.gpus.empty()) return {kExitOk, "no_gpu", fmt::format("no GPU found; {}", kCpuEmulation)};
  std::vector<std::string> with_fp8;
  std::vector<std::string> without_fp8;
  for (const GpuInfo& gpu : info.gpus) {
    (gpu.has_fp8_gemm() ? with_fp8 : without_fp8).push_back(describe_gpu(gpu));
  }
  if (!with_fp8.empty()) {
    return {kExitOk, "ok", fmt::format("FP8 GEMMs available on {}", join(with_fp8))};
  }
  return {kExitProblemFound, "no_fp8_gpu",
          fmt::format("no GPU supports FP8 GEMMs (compute capability 8.9 or newer needed): {}",
                      join(without_fp8))};
}

std::string library_text(const LibraryVersion& library) {
  return library.found() ? fmt::format("{} ({})", library.version, library.soname) : "not found";
}

double gibibytes(uint64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0);
}

void print_text(const DeviceInfo& info, const FamilyChoice& choice, const Verdict& verdict) {
  const auto line = [](std::string_view key, const std::string& value) {
    fmt::print("{:<16}{}\n", fmt::format("{}:", key), value);
  };
  line("version", FP8TRAIN_VERSION);
  if (info.built_with_cuda) {
    line("build", "with CUDA");
    line("CUDA runtime", info.cuda_runtime_version);
    line("CUDA driver",
         info.cuda_driver_version.empty() ? "not installed" : info.cuda_driver_version);
    line("GPUs", std::to_string(info.gpus.size()));
  } else {
    line("build", "built without CUDA: the CPU path is used");
    line("GPUs", "not queried (built without CUDA)");
  }
  for (const GpuInfo& gpu : info.gpus) {
    fmt::print("  GPU {}: {}, {}, {:.1f} GiB, {} SMs, FP8 GEMMs: {}\n", gpu.index, gpu.name,
               gpu.architecture(), gibibytes(gpu.memory_bytes), gpu.sm_count,
               gpu.has_fp8_gemm() ? "yes" : "no (needs sm_89 or newer)");
  }
  line("cuBLASLt", library_text(info.libraries.cublaslt));
  line("cuDNN", library_text(info.libraries.cudnn));
  line("NCCL", library_text(info.libraries.nccl));
  line("launch", distributed::detect_launch().describe());
  line("FP8 family",
       fmt::format("{} (auto for {}): forward {}, backward {}", family_name(choice.family),
                   choice.architecture, format_name(choice.forward_format),
                   format_name(choice.backward_format)));
  fmt::print("{}: {}\n", verdict.exit_code == kExitOk ? "OK" : "PROBLEM", verdict.summary);
}

nlohmann::json library_json(const LibraryVersion& library) {
  if (!library.found()) return nullptr;
  return {{"version", library.version}, {"soname", library.soname}};
}

// Absent facts are null, so that a script can tell "unknown" from a value.
nlohmann::json text_or_null(const std::string& text) {
  return text.empty() ? nlohmann::json(nullptr) : nlohmann::json(text);
}

void print_json(const DeviceInfo& info, const FamilyChoice& choice, const Verdict& verdict) {
  const distributed::LaunchInfo launch = distributed::detect_launch();
  nlohmann::json gpus = nlohmann::json::array();
  bool fp8_gemm_available = false;
  for (const GpuInfo& gpu : info.gpus) {
    gpus.push_back({{"index", gpu.index},
                    {"name", gpu.name},
                    {"architecture", gpu.architecture()},
                    {"compute_capability", fmt::format("{}.{}", gpu.compute_capability_major,
                                                       gpu.compute_capability_minor)},
                    {"memory_bytes", gpu.memory_bytes},
                    {"sm_count", gpu.sm_count},
                    {"fp8_gemm", gpu.has_fp8_gemm()}});
    fp8_gemm_available = fp8_gemm_available || gpu.has_fp8_gemm();
  }
  const nlohmann::json report = {
      {"fp8train_version", FP8TRAIN_VERSION},
      {"built_with_cuda", info.built_with_cuda},
      {"cuda_runtime_version", text_or_null(info.cuda_runtime_version)},
      {"cuda_driver_version", text_or_null(info.cuda_driver_version)},
      {"gpu_count", info.gpus.size()},
      {"gpus", gpus},
      {"fp8_gemm_available", fp8_gemm_available},
      {"launch",
       {{"launcher", launch.launcher},
        {"rank", launch.rank},
        {"world_size", launch.world_size},
        {"local_rank", launch.local_rank}}},
      {"libraries",
       {{"cublaslt", library_json(info.libraries.cublaslt)},
        {"cudnn", library_json(info.libraries.cudnn)},
        {"nccl", library_json(info.libraries.nccl)}}},
      {"fp8_family",
       {{"architecture", choice.architecture},
        {"family", family_name(choice.family)},
        {"forward_format", format_name(choice.forward_format)},
        {"backward_format", format_name(choice.backward_format)}}},
      {"status", verdict.status},
      {"summary", verdict.summary},
      {"exit_code", verdict.exit_code},
  };
  fmt::print("{}\n", report.dump(2));
}

}  // namespace

int run_doctor(const DoctorOptions& options) {
  const DeviceInfo info = query_device_info();
  const FamilyChoice choice = choose_family(info);
  const Verdict verdict = judge(info);
  if (options.json) {
    print_json(info, choice, verdict);
  } else {
    print_text(info, choice, verdict);
  }
  return verdict.exit_code;
}

}  // namespace fp8t::cli
