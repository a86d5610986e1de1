// The golden files of tests/reference/gpt_reference.py: their paths and the GPT configuration
// their metadata records. gpt_tiny_golden has sliding windows (pattern SL, short window 5),
// gpt_tiny_golden_full has none (pattern L).
#pragma once

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
