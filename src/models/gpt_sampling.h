// Text generation from a trained GPT on the CPU path: a short sample at the end of a run.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "models/gpt_config.h"
#include "models/gpt_memory.h"

namespace fp8t {

struct SamplingOptions {
  int tokens = 64;           // how many to generate
  double temperature = 0.8;  // 0: always the most likely token
  int top_k = 40;            // sample among the k most likely tokens; 0: all
  uint64_t seed = 0;
  int32_t stop_token = -1;  // generation ends after this token (e.g. BOS: a new document)
};

// Continues `prompt` (not empty) with the weights of `weights`, in fp32. Every new token runs
// the whole context again (there is no KV cache on the CPU path), which is fine for the short
// samples this is for. The context keeps the last sequence_len tokens. Returns the new tokens.
std::vector<int32_t> sample_tokens(const GptConfig& config, const ParameterSet& weights,
                                   std::span<const int32_t> prompt, const SamplingOptions& options);

}  // namespace fp8t
