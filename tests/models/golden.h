// The golden files of tests/reference/gpt_reference.py and flux_reference.py: their paths, the
// GPT configuration their metadata records, and the error measure the tests compare with.
// gpt_tiny_golden has sliding windows (pattern SL, short window 5), gpt_tiny_golden_full has
// none (pattern L).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "io/safetensors.h"
#include "models/gpt_config.h"

namespace fp8t::testing {

// In tests/data of the source tree, or of $FP8T_TEST_DATA where the tests run away from it
// (a GPU machine that received the binaries and the data).
inline std::filesystem::path golden_path(const std::string& name = "gpt_tiny_golden") {
  const char* data = std::getenv("FP8T_TEST_DATA");
  const std::filesystem::path folder =
      data != nullptr && *data != '\0'
          ? std::filesystem::path(data)
          : std::filesystem::path(__FILE__).parent_path().parent_path() / "data";
  return folder / (name + ".safetensors");
}

// ‖out − ref‖ / ‖ref‖ over n values, in double.
inline double relative_error(const float* out, const float* ref, int64_t n) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff += (double(out[i]) - ref[i]) * (double(out[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

inline GptConfig golden_config(const io::SafetensorsFile& file) {
  const auto integer = [&](const char* key) { return std::stoi(file.metadata_value(key)); };
  GptConfig config;
  config.n_layer = integer("n_layer");
  config.n_embd = integer("n_embd");
  config.n_head = integer("n_head");
  config.n_kv_head = integer("n_kv_head");
  config.vocab_size = integer("vocab_size");
  config.sequence_len = integer("sequence_len");
  config.window_pattern = file.metadata_value("window_pattern");
  config.pad_vocab_to = integer("pad_vocab_to");
  config.short_window = integer("short_window");
  config.validate();
  return config;
}

}  // namespace fp8t::testing
