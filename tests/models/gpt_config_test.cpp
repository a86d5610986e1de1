#include "models/gpt_config.h"

#include <gtest/gtest.h>

#include <map>

#include "core/error.h"

namespace fp8t {
namespace {

int64_t total_params(const GptConfig& config) {
  int64_t total = 0;
  for (const ParamSpec& param : gpt_parameters(config))
    total += param.numel();
  return total;
}

TEST(GptConfig, SizingFromDepth) {
  const GptConfig d20 = GptConfig::from_depth(20);
  EXPECT_EQ(d20.n_embd, 1280);
  EXPECT_EQ(d20.n_head, 10);
  const GptConfig d24 = GptConfig::from_depth(24);
  EXPECT_EQ(d24.n_embd, 1536);
  EXPECT_EQ(d24.n_head, 12);
  EXPECT_EQ(d24.head_dim(), 128);
  EXPECT_EQ(d24.padded_vocab(), 32768);
  EXPECT_EQ(GptConfig::from_depth(3).n_embd, 256);  // 192 rounds up to a multiple of 128
}

TEST(GptConfig, ParameterCountsMatchNanochat) {
  // MODELS.md: d24 1.384B (wte 50.3M, value embeddings 604M, lm_head 50.3M, blocks 679M);
  // d20 897M.
  const GptConfig d24 = GptConfig::from_depth(24);
  std::map<ParamKind, int64_t> by_kind;
  for (const ParamSpec& param : gpt_parameters(d24))
    by_kind[param.kind] += param.numel();
  EXPECT_EQ(by_kind[ParamKind::LmHead], 32768 * 1536);
  EXPECT_EQ(by_kind[ParamKind::Embedding], 32768 * 1536 + 12 * 32768 * 1536);
  EXPECT_EQ(by_kind[ParamKind::BlockLinear], 24 * (4 * 1536 * 1536 + 2 * 4 * 1536 * 1536));
  EXPECT_NEAR(double(total_params(d24)), 1.384e9, 0.0005e9);
  EXPECT_NEAR(double(total_params(GptConfig::from_depth(20))), 0.897e9, 0.0005e9);
}

TEST(GptConfig, NamesFollowTheStateDict) {
  const GptConfig config = GptConfig::from_depth(4);
  std::vector<std::string> names;
  for (const ParamSpec& param : gpt_parameters(config))
    names.push_back(param.name);
  EXPECT_EQ(names.front(), "transformer.wte.weight");
  EXPECT_NE(std::find(names.begin(), names.end(), "transformer.h.3.attn.ve_gate.weight"),
            names.end());
  EXPECT_EQ(std::find(names.begin(), names.end(), "transformer.h.2.attn.ve_gate.weight"),
            names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "value_embeds.1.weight"), names.end());
  EXPECT_EQ(std::find(names.begin(), names.end(), "value_embeds.0.weight"), names.end());
  for (const char* name : {"lm_head.weight", "resid_lambdas", "x0_lambdas", "smear_gate.weight",
                           "smear_lambda", "backout_lambda", "transformer.h.0.mlp.c_fc.weight",
                           "transformer.h.0.attn.c_proj.weight"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
}

TEST(GptConfig, WindowsTileThePatternAndEndLong) {
  GptConfig config = GptConfig::from_depth(6);
  config.window_pattern = "SSSL";
  const std::vector<int> expected = {512, 512, 512, 2048, 512, 2048};
  for (int layer = 0; layer < 6; ++layer)
    EXPECT_EQ(config.window(layer), expected[layer]) << layer;
  config.sequence_len = 1000;  // short window: ceil(250 / 128) * 128
  EXPECT_EQ(config.window(0), 256);
  config.sequence_len = 513;  // ceil(513 / 4) = 129, so two tiles of 128, as nanochat
  EXPECT_EQ(config.window(0), 256);
  config.short_window = 5;
  EXPECT_EQ(config.window(0), 5);
  EXPECT_EQ(config.window(5), 513);
}

TEST(GptConfig, FlopsPerTokenMatchesTheBenchmarkWorkload) {
  GptConfig d24 = GptConfig::from_depth(24);
  d24.window_pattern.assign(1, 'L');  // all full (assign: GCC 12 warns falsely on = "L")
  EXPECT_NEAR(gpt_flops_per_token(d24), 5.285e9, 0.0005e9);  // BENCHMARKS.md W-GPT24
}

TEST(GptConfig, LinearsAreTheMatmulParameters) {
  const GptConfig d24 = GptConfig::from_depth(24);
  EXPECT_EQ(gpt_linears(d24).size(), 158u);  // 24 x 6 block linears, 12 ve gates, smear, lm_head
}

TEST(GptConfig, ValidateNamesTheField) {
  GptConfig config = GptConfig::from_depth(2);
  config.window_pattern = "SXL";
  EXPECT_THROW(config.validate(), ConfigError);
  try {
    config.validate();
  } catch (const ConfigError& error) {
    EXPECT_NE(std::string(error.what()).find("window_pattern"), std::string::npos);
  }
  config = GptConfig::from_depth(2);
  config.n_kv_head = 3;
  EXPECT_THROW(config.validate(), ConfigError);
  EXPECT_NO_THROW(GptConfig::from_depth(24).validate());
  EXPECT_THROW(GptConfig::from_depth(0), ConfigError);
}

}  // namespace
}  // namespace fp8t
