// The FP8 precision policy: nanochat's filter at depth 24 (145 of 158 linears), the Primus
// first/last-layer option, lm_head, fp8 none, the blockwise shape rule, and the summary line.
#include "models/precision_policy.h"

#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"

namespace fp8t {
namespace {

int fp8_count(const std::vector<LinearPrecision>& decisions) {
  int count = 0;
  for (const LinearPrecision& decision : decisions)
    count += decision.fp8 ? 1 : 0;
  return count;
}

TEST(PrecisionPolicy, WeightTransposesByNameAndRecipe) {
  EXPECT_EQ(weight_transposes_named("kept", "--x"), ops::WeightTransposes::Kept);
  EXPECT_EQ(weight_transposes_named("in_backward", "--x"), ops::WeightTransposes::InBackward);
  try {
    weight_transposes_named("dropped", "--x");
    ADD_FAILURE() << "an unknown name was taken";
  } catch (const ConfigError& error) {
    EXPECT_STREQ(error.what(), "--x: unknown value 'dropped'; allowed: kept, in_backward");
  }
  for (ScalingRecipe recipe :
       {ScalingRecipe::Delayed, ScalingRecipe::Tensorwise, ScalingRecipe::Blockwise}) {
    EXPECT_NO_THROW(check_fp8_weight_transposes(ops::WeightTransposes::InBackward, recipe, "--x"))
        << recipe_name(recipe);
  }
  EXPECT_NO_THROW(
      check_fp8_weight_transposes(ops::WeightTransposes::Kept, ScalingRecipe::Mxfp8, "--x"));
  EXPECT_THROW(
      check_fp8_weight_transposes(ops::WeightTransposes::InBackward, ScalingRecipe::Mxfp8, "--x"),
      ConfigError);
}

TEST(PrecisionPolicy, Depth24DefaultsKeep145Of158InFp8) {
  const std::vector<LinearPrecision> decisions =
      decide_precision(GptConfig::from_depth(24), PrecisionOptions{});
  ASSERT_EQ(decisions.size(), 158u);
  EXPECT_EQ(fp8_count(decisions), 145);
  std::set<std::string> bf16;
  for (const LinearPrecision& decision : decisions) {
    if (decision.fp8) {
      EXPECT_TRUE(decision.reason.empty()) << decision.linear.name;
      continue;
    }
    bf16.insert(decision.linear.name);
    EXPECT_EQ(decision.reason, "dims < 128") << decision.linear.name;
  }
  std::set<std::string> expected = {"smear_gate"};
  for (int layer = 1; layer < 24; layer += 2)
    expected.insert("transformer.h." + std::to_string(layer) + ".attn.ve_gate");
  EXPECT_EQ(bf16, expected);
  EXPECT_EQ(precision_summary(decisions),
            "FP8: 145/158 linear layers; 13 kept in BF16 (12 × ve_gate: dims < 128; smear_gate: "
            "dims < 128)");
}

TEST(PrecisionPolicy, FirstLastLayersMoveExactlyThoseBlocksToBf16) {
  const GptConfig config = GptConfig::from_depth(24);
  const std::vector<LinearPrecision> defaults = decide_precision(config, PrecisionOptions{});
  PrecisionOptions options;
  options.first_last_layers_bf16 = true;
  options.num_layers_at_start_in_bf16 = 1;
  options.num_layers_at_end_in_bf16 = 2;
  const std::vector<LinearPrecision> decisions = decide_precision(config, options);
  ASSERT_EQ(decisions.size(), defaults.size());
  int moved = 0;
  for (size_t i = 0; i < decisions.size(); ++i) {
    const LinearPrecision& decision = decisions[i];
    const int layer = decision.linear.layer;
    if (defaults[i].fp8 && (layer == 0 || layer == 22 || layer == 23)) {
      EXPECT_FALSE(decision.fp8) << decision.linear.name;
      EXPECT_EQ(decision.reason, "first/last layers in BF16") << decision.linear.name;
      ++moved;
    } else {  // everything else as before, the ve_gate of layer 23 with its own reason
      EXPECT_EQ(decision.fp8, defaults[i].fp8) << decision.linear.name;
      EXPECT_EQ(decision.reason, defaults[i].reason) << decision.linear.name;
    }
  }
  EXPECT_EQ(moved, 18);  // 6 block linears in each of 3 layers
  EXPECT_EQ(fp8_count(decisions), 145 - 18);
  EXPECT_EQ(precision_summary(decisions),
            "FP8: 127/158 linear layers; 31 kept in BF16 (3 × c_q: first/last layers in BF16; "
            "3 × c_k: first/last layers in BF16; 3 × c_v: first/last layers in BF16; "
            "3 × attn.c_proj: first/last layers in BF16; 3 × c_fc: first/last layers in BF16; "
            "3 × mlp.c_proj: first/last layers in BF16; 12 × ve_gate: dims < 128; smear_gate: "
            "dims < 128)");
}

TEST(PrecisionPolicy, LmHeadFollowsItsOption) {
  const GptConfig config = GptConfig::from_depth(24);
  PrecisionOptions options;
  const auto lm_head = [&](const std::vector<LinearPrecision>& decisions) {
    for (const LinearPrecision& decision : decisions) {
      if (decision.linear.kind == ParamKind::LmHead) return decision;
    }
    return LinearPrecision{};
  };
  EXPECT_TRUE(lm_head(decide_precision(config, options)).fp8);
  options.lm_head_fp8 = false;
  const std::vector<LinearPrecision> decisions = decide_precision(config, options);
  EXPECT_FALSE(lm_head(decisions).fp8);
  EXPECT_EQ(lm_head(decisions).reason, "lm_head_fp8: false");
  EXPECT_EQ(fp8_count(decisions), 144);
  EXPECT_EQ(precision_summary(decisions),
            "FP8: 144/158 linear layers; 14 kept in BF16 (12 × ve_gate: dims < 128; lm_head: "
            "lm_head_fp8: false; smear_gate: dims < 128)");
}

TEST(PrecisionPolicy, Bf16LinearsAreKeptByName) {
  const GptConfig config = GptConfig::from_depth(24);
  PrecisionOptions options;
  options.bf16_linears = {"transformer.h.7.mlp.c_fc", "lm_head"};
  const std::vector<LinearPrecision> decisions = decide_precision(config, options);
  for (const LinearPrecision& decision : decisions) {
    if (decision.linear.name == "transformer.h.7.mlp.c_fc" || decision.linear.name == "lm_head") {
      EXPECT_FALSE(decision.fp8) << decision.linear.name;
      EXPECT_EQ(decision.reason, "non-finite gradients (nan_remedy: bf16_layer)");
    }
  }
  EXPECT_EQ(fp8_count(decisions), 143);
}

TEST(PrecisionPolicy, Fp8NoneKeepsEverythingInBf16) {
  PrecisionOptions options;
  options.mode = Fp8Mode::None;
  const std::vector<LinearPrecision> decisions =
      decide_precision(GptConfig::from_depth(24), options);
  EXPECT_EQ(fp8_count(decisions), 0);
  for (const LinearPrecision& decision : decisions)
    EXPECT_EQ(decision.reason, "fp8: none") << decision.linear.name;
  EXPECT_EQ(precision_summary(decide_precision(GptConfig::from_depth(2), options)),
            "FP8: 0/15 linear layers; 15 kept in BF16 (2 × c_q: fp8: none; 2 × c_k: fp8: none; "
            "2 × c_v: fp8: none; 2 × attn.c_proj: fp8: none; 2 × c_fc: fp8: none; "
            "2 × mlp.c_proj: fp8: none; ve_gate: fp8: none; lm_head: fp8: none; smear_gate: fp8: "
            "none)");
  const Fp8Config config;  // fp8: hybrid, tensorwise
  EXPECT_EQ(precision_options(config).mode, Fp8Mode::Hybrid);
  EXPECT_EQ(precision_options(config).recipe, ScalingRecipe::Tensorwise);
}

TEST(PrecisionPolicy, BlockwiseKeepsDimsNotMultipleOf128InBf16) {
  GptConfig config;
  config.n_layer = 2;
  config.n_embd = 384;
  config.n_head = 3;
  config.n_kv_head = 3;
  config.vocab_size = 1000;
  config.pad_vocab_to = 16;  // lm_head 384 -> 1008: a multiple of 16, not of 128
  config.validate();
  PrecisionOptions options;
  options.recipe = ScalingRecipe::Tensorwise;
  EXPECT_EQ(precision_summary(decide_precision(config, options)),
            "FP8: 13/15 linear layers; 2 kept in BF16 (ve_gate: dims < 128; smear_gate: dims < "
            "128)");
  options.recipe = ScalingRecipe::Blockwise;
  const std::vector<LinearPrecision> decisions = decide_precision(config, options);
  for (const LinearPrecision& decision : decisions) {
    if (decision.linear.kind == ParamKind::LmHead) {
      EXPECT_FALSE(decision.fp8);
      EXPECT_EQ(decision.reason, "blockwise needs dims divisible by 128");
    } else if (decision.linear.kind == ParamKind::BlockLinear) {
      EXPECT_TRUE(decision.fp8) << decision.linear.name;  // 384 and 1536
    }
  }
  EXPECT_EQ(precision_summary(decisions),
            "FP8: 12/15 linear layers; 3 kept in BF16 (ve_gate: dims < 128; lm_head: blockwise "
            "needs dims divisible by 128; smear_gate: dims < 128)");

  config.n_embd = 192;  // every block linear now has a dimension of 192
  const std::vector<LinearPrecision> narrow = decide_precision(config, options);
  EXPECT_EQ(fp8_count(narrow), 0);
  for (const LinearPrecision& decision : narrow) {
    if (decision.linear.kind == ParamKind::BlockLinear) {
      EXPECT_EQ(decision.reason, "blockwise needs dims divisible by 128") << decision.linear.name;
    }
  }
}

TEST(PrecisionPolicy, SizeFilterAndGatesOnCustomLinears) {
  const std::vector<LinearSpec> linears = {
      {"proj", 256, 200, ParamKind::BlockLinear, 0},  // 200 is not a multiple of 16
      {"small", 96, 96, ParamKind::BlockLinear, 0},
      {"big_gate", 256, 256, ParamKind::Gate, 0},
      {"fine", 256, 512, ParamKind::BlockLinear, 0},
  };
  PrecisionOptions options;
  std::vector<LinearPrecision> decisions = decide_precision(linears, 1, options);
  EXPECT_EQ(decisions[0].reason, "dims not divisible by 16");
  EXPECT_EQ(decisions[1].reason, "dims < 128");
  EXPECT_EQ(decisions[2].reason, "gates stay in BF16");
  EXPECT_TRUE(decisions[3].fp8);
  options.min_dim = 64;
  options.require_divisible_by = 8;
  decisions = decide_precision(linears, 1, options);
  EXPECT_TRUE(decisions[0].fp8);
  EXPECT_TRUE(decisions[1].fp8);
  EXPECT_FALSE(decisions[2].fp8);
  EXPECT_EQ(precision_summary(decisions),
            "FP8: 3/4 linear layers; 1 kept in BF16 (big_gate: gates stay in BF16)");
  options.mode = Fp8Mode::E4M3;
  EXPECT_EQ(precision_summary(decide_precision({linears[3]}, 1, options)),
            "FP8: 1/1 linear layers; none kept in BF16");
  options.require_divisible_by = 0;
  EXPECT_THROW(decide_precision(linears, 1, options), Error);
}

}  // namespace
}  // namespace fp8t
