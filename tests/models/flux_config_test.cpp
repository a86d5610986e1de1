#include "models/flux_config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include "core/error.h"
#include "test_files.h"

namespace fp8t {
namespace {

const FluxParam& find(const std::vector<FluxParam>& params, const std::string& name) {
  const auto found = std::find_if(params.begin(), params.end(),
                                  [&](const FluxParam& param) { return param.name == name; });
  EXPECT_NE(found, params.end()) << name;
  return *found;
}

// MODELS.md and BENCHMARKS.md: flux_535m has 535.3M parameters; FLUX.1-dev (flux_12b) 11.9B.
TEST(FluxConfig, PresetsHaveTheReferenceParameterCounts) {
  EXPECT_EQ(flux_parameter_count(FluxConfig::preset("flux_535m")), 535'318'336);
  const int64_t twelve = flux_parameter_count(FluxConfig::preset("flux_12b"));
  EXPECT_GT(twelve, 11'800'000'000);
  EXPECT_LT(twelve, 12'000'000'000);
  EXPECT_EQ(flux_parameter_count(FluxConfig::preset("flux_tiny")), 250'128);
}

// The Black Forest Labs flux1 names and shapes, in the checkpoint's order.
TEST(FluxConfig, ParametersFollowTheBflNames) {
  const FluxConfig config = FluxConfig::preset("flux_12b");
  const std::vector<FluxParam> params = flux_parameters(config);
  EXPECT_EQ(params.front().name, "img_in.weight");
  EXPECT_EQ(params.front().shape, (std::vector<int64_t>{3072, 64}));
  EXPECT_EQ(params.back().name, "final_layer.adaLN_modulation.1.bias");
  EXPECT_EQ(find(params, "time_in.in_layer.weight").shape, (std::vector<int64_t>{3072, 256}));
  EXPECT_EQ(find(params, "guidance_in.out_layer.bias").shape, (std::vector<int64_t>{3072}));
  EXPECT_EQ(find(params, "vector_in.in_layer.weight").shape, (std::vector<int64_t>{3072, 768}));
  EXPECT_EQ(find(params, "txt_in.weight").shape, (std::vector<int64_t>{3072, 4096}));
  EXPECT_EQ(find(params, "double_blocks.18.img_mod.lin.weight").shape,
            (std::vector<int64_t>{6 * 3072, 3072}));
  EXPECT_EQ(find(params, "double_blocks.0.txt_attn.qkv.bias").shape,
            (std::vector<int64_t>{3 * 3072}));
  EXPECT_EQ(find(params, "double_blocks.3.img_attn.norm.query_norm.scale").shape,
            (std::vector<int64_t>{128}));
  EXPECT_EQ(find(params, "double_blocks.3.txt_attn.norm.key_norm.scale").kind,
            FluxParamKind::NormScale);
  EXPECT_EQ(find(params, "double_blocks.0.img_mlp.0.weight").shape,
            (std::vector<int64_t>{12288, 3072}));
  EXPECT_EQ(find(params, "double_blocks.0.txt_mlp.2.weight").shape,
            (std::vector<int64_t>{3072, 12288}));
  const FluxParam& linear1 = find(params, "single_blocks.37.linear1.weight");
  EXPECT_EQ(linear1.shape, (std::vector<int64_t>{3 * 3072 + 12288, 3072}));
  EXPECT_EQ(linear1.block, 19 + 37);  // double blocks count first
  EXPECT_EQ(find(params, "single_blocks.0.linear2.weight").shape,
            (std::vector<int64_t>{3072, 3072 + 12288}));
  EXPECT_EQ(find(params, "single_blocks.0.modulation.lin.weight").shape,
            (std::vector<int64_t>{3 * 3072, 3072}));
  EXPECT_EQ(find(params, "final_layer.linear.weight").shape, (std::vector<int64_t>{64, 3072}));
  EXPECT_EQ(find(params, "final_layer.adaLN_modulation.1.weight").kind, FluxParamKind::Modulation);

  std::set<std::string> names;
  for (const FluxParam& param : params) {
    EXPECT_TRUE(names.insert(param.name).second) << "twice: " << param.name;
    EXPECT_EQ(param.is_bias(), param.shape.size() == 1 && param.kind != FluxParamKind::NormScale)
        << param.name;
  }
  // Every linear weight has its bias, as in flux1 (qkv_bias true).
  EXPECT_EQ(params.size(), 2u + 3 * 4 + 2 + 19 * 2 * (5 * 2 + 2) + 38 * (3 * 2 + 2) + 2 * 2);
}

TEST(FluxConfig, GuidanceEmbedderOnlyWhenAsked) {
  const std::vector<FluxParam> params = flux_parameters(FluxConfig::preset("flux_535m"));
  EXPECT_FALSE(std::any_of(params.begin(), params.end(), [](const FluxParam& param) {
    return param.name.starts_with("guidance_in");
  }));
}

TEST(FluxConfig, InconsistentSettingsNameTheField) {
  FluxConfig config = FluxConfig::preset("flux_tiny");
  config.num_heads = 3;
  EXPECT_NE(test::error_message<ConfigError>([&] {
              config.validate();
            }).find("num_heads: must divide hidden_size (64), found 3"),
            std::string::npos);
  config = FluxConfig::preset("flux_tiny");
  config.axes_dim = {8, 8, 8};
  EXPECT_NE(test::error_message<ConfigError>([&] {
              config.validate();
            }).find("axes_dim: must sum to head_dim (32), found [8, 8, 8] (sum 24)"),
            std::string::npos);
  config = FluxConfig::preset("flux_tiny");
  config.double_blocks = 0;
  config.single_blocks = 0;
  EXPECT_NE(test::error_message<ConfigError>([&] { config.validate(); }).find("at least one block"),
            std::string::npos);
  EXPECT_NE(test::error_message<ConfigError>([] {
              FluxConfig::preset("flux_1b");
            }).find("unknown preset 'flux_1b'; known: flux_tiny, flux_small, flux_535m, flux_12b"),
            std::string::npos);
}

}  // namespace
}  // namespace fp8t
