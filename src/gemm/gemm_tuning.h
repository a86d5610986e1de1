// Which GEMM implementation serves each precision, and whether the engine times the candidates
// of each problem and keeps the fastest (autotuning). The settings come from the config keys
// gemm_autotune, gemm_backend and deterministic, and from the environment variables
// FP8TRAIN_AUTOTUNE and FP8TRAIN_GEMM_BACKEND, which take precedence over the keys; an empty or
// blank variable counts as unset.
//
// Tuned choices persist in a cache file (GemmTuningCache) whose entries name the GPU model and
// the library versions they were measured with; entries of another GPU or version are ignored.
//
// This header stays within C++17 and without fmt: CUDA code includes it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fp8t::gemm {

// The implementations a GEMM can run on. cuBLASLt serves every GEMM: autotuning chooses among
// the algorithms its heuristic offers; pinned, a GEMM runs the heuristic's first choice.
// fp8train, the engine's own kernel (block_gemm_sm90.h), serves block-scaled FP8 GEMMs on
// sm_90a: autotuning times it as one more candidate; pinned (for fp8 only), every GEMM it
// serves runs on it and the others stay on cuBLASLt.
enum class GemmBackend : uint8_t { Cublaslt, Fp8train };

inline constexpr std::pair<std::string_view, GemmBackend> kGemmBackends[] = {
    {"cublaslt", GemmBackend::Cublaslt}, {"fp8train", GemmBackend::Fp8train}};

const char* gemm_backend_name(GemmBackend backend);
// "cublaslt, fp8train": the valid backend names, for messages.
std::string gemm_backend_names();

// The two families of GEMMs a backend can be pinned for.
enum class GemmPrecision : uint8_t { Bf16, Fp8 };
const char* gemm_precision_name(GemmPrecision precision);

struct GemmBackendPins {
  std::optional<GemmBackend> bf16, fp8;
  std::optional<GemmBackend> of(GemmPrecision precision) const {
    return precision == GemmPrecision::Fp8 ? fp8 : bf16;
  }
};

// Parses a backend choice: "cublaslt" (both precisions) or a list per precision
// ("fp8:fp8train,bf16:cublaslt", either part may be left out). Empty or blank text pins nothing.
// Throws fp8t::ConfigError naming `source` (the key or variable) and the valid names, also for
// fp8train pinned for bf16 (it has no BF16 GEMM).
GemmBackendPins parse_gemm_backends(std::string_view text, std::string_view source);

// What the config asks for (the keys of the same names).
struct GemmTuningRequest {
  bool gemm_autotune = true;
  std::string gemm_backend;  // as parse_gemm_backends; empty: none pinned
  bool deterministic = false;
  std::string gemm_tuning_cache;  // the cache file; empty: nothing persists
};

// The settings in force, and the log lines that say why.
struct GemmTuning {
  bool autotune_bf16 = false;
  bool autotune_fp8 = false;
  bool deterministic = false;  // every call of a problem gives the same bits
  GemmBackendPins pins;
  std::string cache_path;  // empty: tuned choices are not kept past the process
  std::vector<std::string> notes;

  bool autotune(GemmPrecision precision) const {
    return precision == GemmPrecision::Fp8 ? autotune_fp8 : autotune_bf16;
  }
  bool autotunes_any() const { return autotune_bf16 || autotune_fp8; }
};

// Reads an environment variable; null when it is not set.
using EnvironmentLookup = std::function<const char*(const char*)>;

// The request with the environment applied: FP8TRAIN_AUTOTUNE (0 or 1) replaces gemm_autotune,
// FP8TRAIN_GEMM_BACKEND replaces gemm_backend; a pinned backend turns autotuning off for its
// precision, and deterministic turns it off for both. Throws fp8t::ConfigError for a value
// that is neither (naming the variable or key and the value).
GemmTuning resolve_gemm_tuning(const GemmTuningRequest& request,
                               const EnvironmentLookup& environment);

// One candidate's trial: whether it ran, how far its result lies from the reference
// (‖out − ref‖/‖ref‖) and its median time.
struct CandidateTrial {
  bool ran = false;
  double relative_difference = 0.0;
  double ms = 0.0;
};

// The index of the fastest candidate that ran and agrees with the reference within
// `tolerance` (a NaN difference never agrees); -1 when none qualifies.
int fastest_agreeing(const std::vector<CandidateTrial>& trials, double tolerance);

// What a tuned choice is measured against: the GPU model, the library versions and the
// engine's own kernel, which is one of the candidates.
struct GemmTuningIdentity {
  std::string gpu;            // "NVIDIA H200"
  std::string architecture;   // "sm_90"
  std::string cublaslt;       // "13.1.0"
  std::string cuda_runtime;   // "13.0"
  std::string engine_kernel;  // block_gemm_sm90_fingerprint(); empty in files written before it
  bool operator==(const GemmTuningIdentity& other) const {
    return gpu == other.gpu && architecture == other.architecture && cublaslt == other.cublaslt &&
           cuda_runtime == other.cuda_runtime && engine_kernel == other.engine_kernel;
  }
};

// The winner of one problem: its index among the heuristic's candidates (of `candidates`
// asked for) and the algorithm's bytes in hex, to check that the heuristic still offers it.
struct TunedGemm {
  int candidate = 0;
  int candidates = 0;
  std::string algorithm;
  double ms = 0.0;            // the winner's median
  double heuristic_ms = 0.0;  // the heuristic's first choice's median
};

// The cache file: JSON, entries of every identity. Loading keeps this identity's entries;
// saving merges them into what the file holds then (another process may have added some) and
// replaces the file in one rename, so a crash never leaves half a file.
class GemmTuningCache {
 public:
  // Reads `path` when it exists. A file that is not a tuning cache is ignored with a warning
  // in warnings() (and replaced at the next save).
  GemmTuningCache(std::string path, GemmTuningIdentity identity);

  const TunedGemm* find(const std::string& problem) const;
  // Records a winner and saves the file. Throws fp8t::Error naming the file when it cannot be
  // written.
  void put(const std::string& problem, const TunedGemm& tuned);

  const std::string& path() const { return path_; }
  size_t size() const { return entries_.size(); }
  // Entries of other GPUs, library versions or engine kernels found in the file.
  size_t foreign_entries() const { return foreign_; }
  const std::vector<std::string>& warnings() const { return warnings_; }

 private:
  std::string path_;
  GemmTuningIdentity identity_;
  std::map<std::string, TunedGemm> entries_;
  size_t foreign_ = 0;
  std::vector<std::string> warnings_;
};

}  // namespace fp8t::gemm
