#include "gemm/gemm_tuning.h"

#include <filesystem>
#include <fstream>
#include <system_error>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/files.h"

namespace fp8t::gemm {

namespace fs = std::filesystem;

const char* gemm_backend_name(GemmBackend backend) {
  for (const auto& [name, value] : kGemmBackends) {
    if (value == backend) return name.data();
  }
  return "?";
}

std::string gemm_backend_names() {
  std::string names;
  for (const auto& [name, value] : kGemmBackends)
    names += fmt::format("{}{}", names.empty() ? "" : ", ", name);
  return names;
}

const char* gemm_precision_name(GemmPrecision precision) {
  return precision == GemmPrecision::Fp8 ? "fp8" : "bf16";
}

namespace {

std::string_view trimmed(std::string_view text) {
  const auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!text.empty() && blank(text.front()))
    text.remove_prefix(1);
  while (!text.empty() && blank(text.back()))
    text.remove_suffix(1);
  return text;
}

GemmBackend backend_named(std::string_view name, std::string_view text, std::string_view source) {
  for (const auto& [known, backend] : kGemmBackends) {
    if (known == name) return backend;
  }
  throw ConfigError(fmt::format("{}: unknown GEMM backend '{}' in '{}'; expected one of: {}",
                                source, name, text, gemm_backend_names()));
}

// The variable's value, or null when it is unset, empty or blank.
std::optional<std::string> variable(const EnvironmentLookup& environment, const char* name) {
  const char* value = environment ? environment(name) : nullptr;
  if (value == nullptr || trimmed(value).empty()) return std::nullopt;
  return std::string(trimmed(value));
}

}  // namespace

GemmBackendPins parse_gemm_backends(std::string_view text, std::string_view source) {
  GemmBackendPins pins;
  text = trimmed(text);
  if (text.empty()) return pins;
  const auto check_bf16 = [&](GemmBackend backend) {
    if (backend == GemmBackend::Fp8train) {
      throw ConfigError(
          fmt::format("{}: the GEMM backend fp8train serves FP8 GEMMs only, found '{}'; pin it as "
                      "fp8:fp8train",
                      source, text));
    }
    return backend;
  };
  if (text.find(':') == std::string_view::npos) {
    pins.bf16 = pins.fp8 = check_bf16(backend_named(text, text, source));
    return pins;
  }
  std::string_view rest = text;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view part = trimmed(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    const size_t colon = part.find(':');
    if (colon == std::string_view::npos) {
      throw ConfigError(fmt::format(
          "{}: expected 'precision:backend' items in '{}' (as in fp8:cublaslt), found '{}'", source,
          text, part));
    }
    const std::string_view precision = trimmed(part.substr(0, colon));
    const GemmBackend backend = backend_named(trimmed(part.substr(colon + 1)), text, source);
    if (precision == "fp8") {
      pins.fp8 = backend;
    } else if (precision == "bf16") {
      pins.bf16 = check_bf16(backend);
    } else {
      throw ConfigError(fmt::format("{}: unknown precision '{}' in '{}'; expected fp8 or bf16",
                                    source, precision, text));
    }
  }
  return pins;
}

GemmTuning resolve_gemm_tuning(const GemmTuningRequest& request,
                               const EnvironmentLookup& environment) {
  GemmTuning tuning;
  tuning.cache_path = request.gemm_tuning_cache;
  tuning.deterministic = request.deterministic;

  bool autotune = request.gemm_autotune;
  std::string autotune_source = "gemm_autotune";
  if (const auto value = variable(environment, "FP8TRAIN_AUTOTUNE")) {
    if (*value != "0" && *value != "1") {
      throw ConfigError(fmt::format("FP8TRAIN_AUTOTUNE: expected 0 or 1, found '{}'", *value));
    }
    autotune = *value == "1";
    autotune_source = "FP8TRAIN_AUTOTUNE";
  }
  std::string backend_source = "gemm_backend";
  std::string backend_text = request.gemm_backend;
  if (const auto value = variable(environment, "FP8TRAIN_GEMM_BACKEND")) {
    backend_text = *value;
    backend_source = "FP8TRAIN_GEMM_BACKEND";
  }
  tuning.pins = parse_gemm_backends(backend_text, backend_source);

  if (request.deterministic) {
    if (autotune) {
      tuning.notes.push_back(
          "GEMM autotuning: off, because deterministic is true (each GEMM runs the algorithm "
          "cuBLASLt's heuristic ranks first, the same in every run)");
    }
    autotune = false;
  }
  for (const GemmPrecision precision : {GemmPrecision::Bf16, GemmPrecision::Fp8}) {
    bool& on = precision == GemmPrecision::Fp8 ? tuning.autotune_fp8 : tuning.autotune_bf16;
    on = autotune;
    if (const std::optional<GemmBackend> pinned = tuning.pins.of(precision)) {
      tuning.notes.push_back(fmt::format(
          "GEMM backend for {}: {}, pinned by {}{}", gemm_precision_name(precision),
          gemm_backend_name(*pinned), backend_source,
          autotune ? fmt::format("; autotuning is off for {}", gemm_precision_name(precision))
                   : ""));
      on = false;
    }
  }
  if (tuning.autotunes_any()) {
    const bool both = tuning.autotune_bf16 && tuning.autotune_fp8;
    tuning.notes.push_back(fmt::format(
        "GEMM autotuning: on for {} ({}): each new GEMM problem times cuBLASLt's candidates "
        "(and, for block-scaled FP8, the engine's kernel) once and keeps the fastest that agrees "
        "with the heuristic's first choice{}",
        both                  ? "bf16 and fp8"
        : tuning.autotune_fp8 ? "fp8"
                              : "bf16",
        autotune_source,
        tuning.cache_path.empty() ? "" : fmt::format("; choices kept in {}", tuning.cache_path)));
  } else if (!request.deterministic && !autotune) {
    tuning.notes.push_back(
        fmt::format("GEMM autotuning: off ({}): each GEMM runs the algorithm cuBLASLt's "
                    "heuristic ranks first",
                    autotune_source));
  }
  return tuning;
}

int fastest_agreeing(const std::vector<CandidateTrial>& trials, double tolerance) {
  int best = -1;
  for (size_t i = 0; i < trials.size(); ++i) {
    const CandidateTrial& trial = trials[i];
    // Written so that a NaN difference fails the test.
    if (!trial.ran || !(trial.relative_difference <= tolerance)) continue;
    if (best < 0 || trial.ms < trials[static_cast<size_t>(best)].ms) best = static_cast<int>(i);
  }
  return best;
}

namespace {

constexpr std::string_view kCacheFormat = "fp8train-gemm-tuning";
constexpr int kCacheVersion = 1;

nlohmann::json identity_json(const GemmTuningIdentity& identity) {
  return {{"gpu", identity.gpu},
          {"architecture", identity.architecture},
          {"cublaslt", identity.cublaslt},
          {"cuda_runtime", identity.cuda_runtime},
          {"engine_kernel", identity.engine_kernel}};
}

// Entries written before the engine's kernel had a fingerprint have none: they match no kernel.
GemmTuningIdentity identity_of(const nlohmann::json& entry) {
  return {entry.at("gpu").get<std::string>(), entry.at("architecture").get<std::string>(),
          entry.at("cublaslt").get<std::string>(), entry.at("cuda_runtime").get<std::string>(),
          entry.value("engine_kernel", std::string())};
}

nlohmann::json entry_json(const GemmTuningIdentity& identity, const std::string& problem,
                          const TunedGemm& tuned) {
  nlohmann::json entry = identity_json(identity);
  entry["problem"] = problem;
  entry["candidate"] = tuned.candidate;
  entry["candidates"] = tuned.candidates;
  entry["algorithm"] = tuned.algorithm;
  entry["ms"] = tuned.ms;
  entry["heuristic_ms"] = tuned.heuristic_ms;
  return entry;
}

TunedGemm tuned_of(const nlohmann::json& entry) {
  return {.candidate = entry.at("candidate").get<int>(),
          .candidates = entry.at("candidates").get<int>(),
          .algorithm = entry.at("algorithm").get<std::string>(),
          .ms = entry.at("ms").get<double>(),
          .heuristic_ms = entry.at("heuristic_ms").get<double>()};
}

// The file's entries, or an error message when it is not a tuning cache. A missing file has
// none.
std::optional<std::string> read_entries(const std::string& path, nlohmann::json& entries) {
  entries = nlohmann::json::array();
  std::ifstream file(path);
  if (!file) return std::nullopt;
  try {
    const nlohmann::json document = nlohmann::json::parse(file);
    if (document.value("format", "") != kCacheFormat) {
      return fmt::format("expected \"format\": \"{}\"", kCacheFormat);
    }
    if (document.value("version", 0) != kCacheVersion) {
      return fmt::format("expected version {}, found {}", kCacheVersion,
                         document.value("version", 0));
    }
    entries = document.at("entries");
    if (!entries.is_array()) return std::string("expected \"entries\" to be a list");
    for (const nlohmann::json& entry : entries) {
      identity_of(entry);
      entry.at("problem").get<std::string>();
      tuned_of(entry);
    }
  } catch (const nlohmann::json::exception& error) {
    entries = nlohmann::json::array();
    return error.what();
  }
  return std::nullopt;
}

}  // namespace

GemmTuningCache::GemmTuningCache(std::string path, GemmTuningIdentity identity)
    : path_(std::move(path)), identity_(std::move(identity)) {
  nlohmann::json entries;
  if (const std::optional<std::string> problem = read_entries(path_, entries)) {
    warnings_.push_back(fmt::format(
        "{}: not a GEMM tuning cache ({}); ignoring it and tuning again, the file will be "
        "replaced",
        path_, *problem));
    return;
  }
  for (const nlohmann::json& entry : entries) {
    if (identity_of(entry) == identity_) {
      entries_[entry.at("problem").get<std::string>()] = tuned_of(entry);
    } else {
      ++foreign_;
    }
  }
}

const TunedGemm* GemmTuningCache::find(const std::string& problem) const {
  const auto found = entries_.find(problem);
  return found == entries_.end() ? nullptr : &found->second;
}

void GemmTuningCache::put(const std::string& problem, const TunedGemm& tuned) {
  entries_[problem] = tuned;
  // Keep what the file holds now (other GPUs, other processes' problems), ours replacing theirs.
  nlohmann::json on_disk;
  read_entries(path_, on_disk);
  nlohmann::json entries = nlohmann::json::array();
  for (const nlohmann::json& entry : on_disk) {
    const bool ours = identity_of(entry) == identity_ &&
                      entries_.count(entry.at("problem").get<std::string>()) > 0;
    if (!ours) entries.push_back(entry);
  }
  for (const auto& [key, value] : entries_)
    entries.push_back(entry_json(identity_, key, value));
  const nlohmann::json document = {
      {"format", kCacheFormat}, {"version", kCacheVersion}, {"entries", entries}};

  const fs::path target(path_);
  std::error_code error;
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), error);
  FP8T_CHECK(!error, "{}: cannot create the GEMM tuning cache's folder: {}", path_,
             error.message());
  io::write_file_atomically(target, document.dump(1) + "\n");
}

}  // namespace fp8t::gemm
