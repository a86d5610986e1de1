// GEMM selection settings: the config keys against FP8TRAIN_AUTOTUNE and FP8TRAIN_GEMM_BACKEND
// (precedence, blank values, unknown names, deterministic), the rule that only a candidate
// agreeing with the reference may win, and the tuning cache file (round trip, entries of other
// GPUs and library versions, files that are not caches).
#include "gemm/gemm_tuning.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "test_files.h"

namespace fp8t::gemm {
namespace {

using test::Contains;
using test::error_message;

// A fake environment: the variables of the map, every other one unset.
EnvironmentLookup environment(const std::map<std::string, std::string>& variables) {
  return [variables](const char* name) -> const char* {
    const auto found = variables.find(name);
    return found == variables.end() ? nullptr : found->second.c_str();
  };
}

// The keys' request, with no cache file.
GemmTuningRequest keys(bool autotune, std::string backend = "", bool deterministic = false) {
  return {.gemm_autotune = autotune,
          .gemm_backend = std::move(backend),
          .deterministic = deterministic,
          .gemm_tuning_cache = ""};
}

std::string all_notes(const GemmTuning& tuning) {
  std::string text;
  for (const std::string& note : tuning.notes)
    text += note + "\n";
  return text;
}

TEST(GemmTuningSettings, ConfigDecidesWithoutTheEnvironment) {
  const GemmTuning on = resolve_gemm_tuning(keys(true), environment({}));
  EXPECT_TRUE(on.autotune_bf16);
  EXPECT_TRUE(on.autotune_fp8);
  EXPECT_FALSE(on.pins.bf16.has_value());
  EXPECT_TRUE(Contains(all_notes(on), "GEMM autotuning: on for bf16 and fp8 (gemm_autotune)"));

  const GemmTuning off = resolve_gemm_tuning(keys(false), environment({}));
  EXPECT_FALSE(off.autotune_bf16);
  EXPECT_FALSE(off.autotune_fp8);
  EXPECT_TRUE(Contains(all_notes(off), "GEMM autotuning: off (gemm_autotune)"));
}

TEST(GemmTuningSettings, EnvironmentTakesPrecedenceOverTheConfig) {
  const GemmTuning off = resolve_gemm_tuning(keys(true), environment({{"FP8TRAIN_AUTOTUNE", "0"}}));
  EXPECT_FALSE(off.autotune_bf16);
  EXPECT_FALSE(off.autotune_fp8);
  EXPECT_TRUE(Contains(all_notes(off), "(FP8TRAIN_AUTOTUNE)"));

  const GemmTuning on =
      resolve_gemm_tuning(keys(false), environment({{"FP8TRAIN_AUTOTUNE", " 1 "}}));
  EXPECT_TRUE(on.autotune_bf16);
  EXPECT_TRUE(on.autotune_fp8);

  // The variable's pin replaces the key's: fp8 pinned by the key, bf16 by the variable.
  const GemmTuning pinned = resolve_gemm_tuning(
      keys(true, "fp8:cublaslt"), environment({{"FP8TRAIN_GEMM_BACKEND", "bf16:cublaslt"}}));
  EXPECT_TRUE(pinned.autotune_fp8);
  EXPECT_FALSE(pinned.autotune_bf16);
  EXPECT_FALSE(pinned.pins.fp8.has_value());
  EXPECT_EQ(pinned.pins.bf16, GemmBackend::Cublaslt);
  EXPECT_TRUE(Contains(all_notes(pinned),
                       "GEMM backend for bf16: cublaslt, pinned by FP8TRAIN_GEMM_BACKEND; "
                       "autotuning is off for bf16"));
}

TEST(GemmTuningSettings, EmptyOrBlankVariablesCountAsUnset) {
  for (const char* blank : {"", " ", "\t", " \n "}) {
    SCOPED_TRACE(::testing::Message() << "value '" << blank << "'");
    const GemmTuning tuning = resolve_gemm_tuning(
        keys(true, "fp8:cublaslt"),
        environment({{"FP8TRAIN_AUTOTUNE", blank}, {"FP8TRAIN_GEMM_BACKEND", blank}}));
    EXPECT_TRUE(tuning.autotune_bf16);
    EXPECT_FALSE(tuning.autotune_fp8);  // the key's pin stands
    EXPECT_EQ(tuning.pins.fp8, GemmBackend::Cublaslt);
    EXPECT_TRUE(Contains(all_notes(tuning), "pinned by gemm_backend"));
  }
  // A blank key pins nothing either.
  const GemmTuning blank_key = resolve_gemm_tuning(keys(true, "  "), environment({}));
  EXPECT_TRUE(blank_key.autotune_bf16);
  EXPECT_TRUE(blank_key.autotune_fp8);
}

TEST(GemmTuningSettings, PinningEveryPrecisionTurnsAutotuningOff) {
  const GemmTuning tuning = resolve_gemm_tuning(keys(true, "cublaslt"), environment({}));
  EXPECT_FALSE(tuning.autotune_bf16);
  EXPECT_FALSE(tuning.autotune_fp8);
  EXPECT_EQ(tuning.pins.bf16, GemmBackend::Cublaslt);
  EXPECT_EQ(tuning.pins.fp8, GemmBackend::Cublaslt);
  EXPECT_TRUE(Contains(all_notes(tuning), "autotuning is off for fp8"));
  EXPECT_TRUE(Contains(all_notes(tuning), "autotuning is off for bf16"));
}

TEST(GemmTuningSettings, DeterministicTurnsAutotuningOffAndSaysSo) {
  const GemmTuning tuning =
      resolve_gemm_tuning(keys(true, "", true), environment({{"FP8TRAIN_AUTOTUNE", "1"}}));
  EXPECT_FALSE(tuning.autotune_bf16);
  EXPECT_FALSE(tuning.autotune_fp8);
  EXPECT_TRUE(tuning.deterministic);
  EXPECT_TRUE(Contains(all_notes(tuning), "GEMM autotuning: off, because deterministic is true"));
  EXPECT_FALSE(resolve_gemm_tuning(keys(true), environment({})).deterministic);
}

// A pinned engine kernel still repeats its numbers under deterministic: the setting travels
// with the pins, for the kernel to sum its output in a fixed order.
TEST(GemmTuningSettings, DeterministicHoldsWithAPinnedBackend) {
  const GemmTuning tuning = resolve_gemm_tuning(keys(true, "fp8:fp8train", true), environment({}));
  EXPECT_EQ(tuning.pins.fp8, GemmBackend::Fp8train);
  EXPECT_TRUE(tuning.deterministic);
}

TEST(GemmTuningSettings, BadValuesAreErrorsNamingTheSourceAndTheChoices) {
  EXPECT_TRUE(
      Contains(error_message<ConfigError>([] {
                 resolve_gemm_tuning(keys(true), environment({{"FP8TRAIN_AUTOTUNE", "yes"}}));
               }),
               "FP8TRAIN_AUTOTUNE: expected 0 or 1, found 'yes'"));
  EXPECT_TRUE(Contains(
      error_message<ConfigError>([] {
        resolve_gemm_tuning(keys(true), environment({{"FP8TRAIN_GEMM_BACKEND", "cutlass"}}));
      }),
      "FP8TRAIN_GEMM_BACKEND: unknown GEMM backend 'cutlass' in 'cutlass'; "
      "expected one of: cublaslt, fp8train"));
  EXPECT_TRUE(Contains(
      error_message<ConfigError>([] { parse_gemm_backends("fp8:triton", "gemm_backend"); }),
      "gemm_backend: unknown GEMM backend 'triton' in 'fp8:triton'; expected one of: cublaslt, "
      "fp8train"));
  EXPECT_TRUE(Contains(
      error_message<ConfigError>([] { parse_gemm_backends("fp4:cublaslt", "gemm_backend"); }),
      "gemm_backend: unknown precision 'fp4' in 'fp4:cublaslt'; expected fp8 or bf16"));
  EXPECT_TRUE(Contains(
      error_message<ConfigError>([] { parse_gemm_backends("fp8:cublaslt,bf16", "gemm_backend"); }),
      "expected 'precision:backend' items"));
}

TEST(GemmTuningSettings, BackendListsParsePerPrecision) {
  const GemmBackendPins both = parse_gemm_backends(" cublaslt ", "key");
  EXPECT_EQ(both.bf16, GemmBackend::Cublaslt);
  EXPECT_EQ(both.fp8, GemmBackend::Cublaslt);
  const GemmBackendPins listed = parse_gemm_backends("fp8 : cublaslt , bf16:cublaslt", "key");
  EXPECT_EQ(listed.bf16, GemmBackend::Cublaslt);
  EXPECT_EQ(listed.fp8, GemmBackend::Cublaslt);
  const GemmBackendPins fp8_only = parse_gemm_backends("fp8:cublaslt", "key");
  EXPECT_FALSE(fp8_only.bf16.has_value());
  EXPECT_EQ(fp8_only.fp8, GemmBackend::Cublaslt);
  EXPECT_FALSE(parse_gemm_backends("", "key").fp8.has_value());
  const GemmBackendPins own = parse_gemm_backends("fp8:fp8train,bf16:cublaslt", "key");
  EXPECT_EQ(own.fp8, GemmBackend::Fp8train);
  EXPECT_EQ(own.bf16, GemmBackend::Cublaslt);
}

TEST(GemmTuningSettings, TheEnginesKernelIsPinnedForFp8Only) {
  for (const char* text : {"fp8train", "bf16:fp8train", "fp8:cublaslt,bf16:fp8train"}) {
    SCOPED_TRACE(text);
    EXPECT_TRUE(Contains(error_message<ConfigError>([&] { parse_gemm_backends(text, "key"); }),
                         "key: the GEMM backend fp8train serves FP8 GEMMs only"));
  }
  const GemmTuning tuning =
      resolve_gemm_tuning(keys(true), environment({{"FP8TRAIN_GEMM_BACKEND", "fp8:fp8train"}}));
  EXPECT_FALSE(tuning.autotune_fp8);
  EXPECT_TRUE(tuning.autotune_bf16);
  EXPECT_TRUE(Contains(all_notes(tuning),
                       "GEMM backend for fp8: fp8train, pinned by FP8TRAIN_GEMM_BACKEND; "
                       "autotuning is off for fp8"));
}

TEST(GemmCandidateSelection, OnlyACandidateThatAgreesMayWin) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // The fastest disagrees, the second fastest produced NaN, the third did not run: the fourth.
  const std::vector<CandidateTrial> trials = {
      {.ran = true, .relative_difference = 0.0, .ms = 4.0},
      {.ran = true, .relative_difference = 0.5, .ms = 1.0},
      {.ran = true, .relative_difference = nan, .ms = 1.5},
      {.ran = false, .relative_difference = 0.0, .ms = 0.0},
      {.ran = true, .relative_difference = 1e-3, .ms = 3.0}};
  EXPECT_EQ(fastest_agreeing(trials, 1e-2), 4);
  // A tighter tolerance leaves the reference alone.
  EXPECT_EQ(fastest_agreeing(trials, 1e-4), 0);
  // None ran: none wins.
  EXPECT_EQ(fastest_agreeing({{.ran = false}, {.ran = false}}, 1.0), -1);
}

const GemmTuningIdentity kH200{"NVIDIA H200", "sm_90", "13.1.0", "13.0", "0123456789abcdef"};

TunedGemm tuned(int candidate, double ms) {
  return {.candidate = candidate,
          .candidates = 8,
          .algorithm = "00ff" + std::to_string(candidate),
          .ms = ms,
          .heuristic_ms = ms + 0.25};
}

TEST(GemmTuningCacheFile, RoundTripsItsEntries) {
  const test::TempFolder folder;
  const std::string path = (folder / "nested" / "gemm_tuning.json").string();
  {
    GemmTuningCache cache(path, kH200);
    EXPECT_EQ(cache.size(), 0u);
    EXPECT_TRUE(cache.warnings().empty());
    cache.put("fp8 m=1", tuned(3, 0.5));
    cache.put("bf16 m=2", tuned(1, 1.25));
    cache.put("fp8 m=1", tuned(5, 0.375));  // a new winner replaces the old
  }
  const GemmTuningCache loaded(path, kH200);
  EXPECT_EQ(loaded.size(), 2u);
  ASSERT_NE(loaded.find("fp8 m=1"), nullptr);
  EXPECT_EQ(loaded.find("fp8 m=1")->candidate, 5);
  EXPECT_EQ(loaded.find("fp8 m=1")->algorithm, "00ff5");
  EXPECT_DOUBLE_EQ(loaded.find("fp8 m=1")->ms, 0.375);
  EXPECT_DOUBLE_EQ(loaded.find("fp8 m=1")->heuristic_ms, 0.625);
  ASSERT_NE(loaded.find("bf16 m=2"), nullptr);
  EXPECT_EQ(loaded.find("bf16 m=2")->candidates, 8);
  EXPECT_EQ(loaded.find("bf16 m=3"), nullptr);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(GemmTuningCacheFile, IgnoresAndKeepsOtherGpusVersionsAndEngineKernels) {
  const test::TempFolder folder;
  const std::string path = (folder / "gemm_tuning.json").string();
  GemmTuningIdentity other_gpu = kH200;
  other_gpu.gpu = "NVIDIA H100 80GB HBM3";
  GemmTuningIdentity other_library = kH200;
  other_library.cublaslt = "12.9.1";
  GemmTuningIdentity other_kernel = kH200;
  other_kernel.engine_kernel = "fedcba9876543210";
  GemmTuningCache(path, other_gpu).put("fp8 m=1", tuned(2, 1.0));
  GemmTuningCache(path, other_library).put("fp8 m=1", tuned(6, 1.0));
  GemmTuningCache(path, other_kernel).put("fp8 m=1", tuned(7, 1.0));

  GemmTuningCache ours(path, kH200);
  EXPECT_EQ(ours.find("fp8 m=1"), nullptr);
  EXPECT_EQ(ours.foreign_entries(), 3u);
  ours.put("fp8 m=1", tuned(4, 0.5));

  // Every identity's entry is still in the file, each read by its own.
  EXPECT_EQ(GemmTuningCache(path, other_gpu).find("fp8 m=1")->candidate, 2);
  EXPECT_EQ(GemmTuningCache(path, other_library).find("fp8 m=1")->candidate, 6);
  EXPECT_EQ(GemmTuningCache(path, other_kernel).find("fp8 m=1")->candidate, 7);
  EXPECT_EQ(GemmTuningCache(path, kH200).find("fp8 m=1")->candidate, 4);
  std::ifstream file(path);
  EXPECT_EQ(nlohmann::json::parse(file).at("entries").size(), 4u);
}

// A file written before the engine's kernel had a fingerprint: its entries name none, so they
// were timed against a kernel of unknown version and are not reused, but they stay in the file.
TEST(GemmTuningCacheFile, EntriesWithoutAnEngineKernelAreIgnoredAndKept) {
  const test::TempFolder folder;
  const std::string path = (folder / "gemm_tuning.json").string();
  std::ofstream(path) << R"({"format": "fp8train-gemm-tuning", "version": 1, "entries": [
      {"gpu": "NVIDIA H200", "architecture": "sm_90", "cublaslt": "13.1.0", "cuda_runtime": "13.0",
       "problem": "fp8 m=1", "candidate": 3, "candidates": 8, "algorithm": "00ff3", "ms": 1.0,
       "heuristic_ms": 1.5}]})";
  GemmTuningCache ours(path, kH200);
  EXPECT_TRUE(ours.warnings().empty());
  EXPECT_EQ(ours.find("fp8 m=1"), nullptr);
  EXPECT_EQ(ours.foreign_entries(), 1u);
  GemmTuningIdentity unversioned = kH200;
  unversioned.engine_kernel.clear();
  EXPECT_EQ(GemmTuningCache(path, unversioned).find("fp8 m=1")->candidate, 3);

  ours.put("fp8 m=1", tuned(4, 0.5));
  EXPECT_EQ(GemmTuningCache(path, kH200).find("fp8 m=1")->candidate, 4);
  EXPECT_EQ(GemmTuningCache(path, unversioned).find("fp8 m=1")->candidate, 3);
  std::ifstream file(path);
  const nlohmann::json entries = nlohmann::json::parse(file).at("entries");
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_FALSE(entries[0].contains("engine_kernel"));
  EXPECT_EQ(entries[1].at("engine_kernel"), kH200.engine_kernel);
}

TEST(GemmTuningCacheFile, AFileThatIsNotACacheIsIgnoredWithAWarningAndReplaced) {
  const test::TempFolder folder;
  for (const char* content : {"not json at all", R"({"format": "something else"})",
                              R"({"format": "fp8train-gemm-tuning", "version": 1,
                                  "entries": [{"gpu": "x"}]})"}) {
    SCOPED_TRACE(content);
    const std::string path = (folder / "gemm_tuning.json").string();
    std::ofstream(path) << content;
    GemmTuningCache cache(path, kH200);
    EXPECT_EQ(cache.size(), 0u);
    ASSERT_EQ(cache.warnings().size(), 1u);
    EXPECT_TRUE(Contains(cache.warnings()[0], path + ": not a GEMM tuning cache"));
    cache.put("fp8 m=1", tuned(1, 1.0));
    const GemmTuningCache replaced(path, kH200);
    EXPECT_TRUE(replaced.warnings().empty());
    EXPECT_EQ(replaced.size(), 1u);
  }
}

TEST(GemmTuningCacheFile, AnUnwritableFileIsAnErrorNamingIt) {
  const test::TempFolder folder;
  std::ofstream(folder / "a_file") << "x";
  const std::string path = (folder / "a_file" / "gemm_tuning.json").string();
  GemmTuningCache cache(path, kH200);
  EXPECT_TRUE(Contains(error_message([&] { cache.put("fp8 m=1", tuned(1, 1.0)); }), path));
}

}  // namespace
}  // namespace fp8t::gemm
