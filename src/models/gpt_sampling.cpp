#include "models/gpt_sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "core/error.h"
#include "models/gpt_model.h"

namespace fp8t {

namespace {

// Index of the next token from one row of logits.
int32_t pick(std::span<const float> logits, const SamplingOptions& options,
             std::mt19937_64& generator) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const auto more_likely = [&](int32_t a, int32_t b) {
    return logits[size_t(a)] > logits[size_t(b)] ||
           (logits[size_t(a)] == logits[size_t(b)] && a < b);
  };
  if (options.temperature <= 0.0) {
    return *std::min_element(order.begin(), order.end(), more_likely);
  }
  const size_t keep =
      options.top_k > 0 ? std::min(order.size(), size_t(options.top_k)) : order.size();
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(),
                    more_likely);
  std::vector<double> weights(keep);
  const double top = logits[size_t(order[0])];
  for (size_t i = 0; i < keep; ++i) {
    weights[i] = std::exp((logits[size_t(order[i])] - top) / options.temperature);
  }
  // Inverse-CDF sampling with our own uniform draw, so samples agree across standard libraries.
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  double draw = std::generate_canonical<double, 53>(generator) * total;
  for (size_t i = 0; i < keep; ++i) {
    draw -= weights[i];
    if (draw < 0.0) return order[i];
  }
  return order[keep - 1];
}

}  // namespace

std::vector<int32_t> sample_tokens(const GptConfig& config, const ParameterSet& weights,
                                   std::span<const int32_t> prompt,
                                   const SamplingOptions& options) {
  FP8T_CHECK(!prompt.empty(), "sampling needs a prompt of at least one token");
  const int64_t context =
      std::min<int64_t>(config.sequence_len, int64_t(prompt.size()) + options.tokens);
  GptModel model(config, 1, context, GptPrecision::fp32_reference());
  for (const ParamSpec& spec : weights.specs()) {
    const TensorView& source = weights[spec.name];
    std::copy_n(source.data<float>(), source.numel(), model.parameters()[spec.name].data<float>());
  }
  model.weights_changed();

  std::vector<int32_t> tokens(prompt.begin(), prompt.end());
  std::vector<int32_t> generated;
  std::vector<int32_t> window(size_t(context), 0);
  const std::vector<int32_t> no_targets(size_t(context), -1);
  std::vector<float> logits(size_t(context) * size_t(config.vocab_size));
  std::mt19937_64 generator(options.seed);
  while (int64_t(generated.size()) < options.tokens) {
    // The last `context` tokens at the start of the window; the causal mask makes the padding
    // after them irrelevant to the row we read.
    const int64_t used = std::min<int64_t>(context, int64_t(tokens.size()));
    std::fill(window.begin(), window.end(), 0);
    std::copy(tokens.end() - used, tokens.end(), window.begin());
    model.forward(window.data(), no_targets.data());
    model.capped_logits(logits.data());
    const std::span<const float> row(logits.data() + size_t(used - 1) * size_t(config.vocab_size),
                                     size_t(config.vocab_size));
    const int32_t next = pick(row, options, generator);
    tokens.push_back(next);
    generated.push_back(next);
    if (next == options.stop_token) break;
  }
  return generated;
}

}  // namespace fp8t
