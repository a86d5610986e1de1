#include "models/gpt_memory.h"

#include <gtest/gtest.h>

namespace fp8t {
namespace {

GptConfig tiny_config() {
  GptConfig config;
  config.n_layer = 3;
  config.n_embd = 64;
  config.n_head = 2;
  config.n_kv_head = 1;
  config.vocab_size = 100;
  config.sequence_len = 16;
  config.window_pattern = "SL";
  return config;
}

TEST(GptMemory, ArenasSizedByThePlanHoldEveryTensorExactly) {
  const GptConfig config = tiny_config();
  Arena params_arena("parameters", ParameterSet::planned_bytes(config, DType::F32));
  ParameterSet params(params_arena, config, DType::F32);
  EXPECT_EQ(params_arena.used(), params_arena.capacity());
  EXPECT_EQ(params["lm_head.weight"].dim(0), 128);                  // padded vocab
  EXPECT_EQ(params["transformer.h.0.attn.c_k.weight"].dim(0), 32);  // one kv head of 32
  EXPECT_THROW(params["transformer.h.9.mlp.c_fc.weight"], Error);

  Arena activations_arena("activations", GptActivations::planned_bytes(config, 2, 16, DType::F32));
  GptActivations activations(activations_arena, config, 2, 16, DType::F32);
  EXPECT_EQ(activations_arena.used(), activations_arena.capacity());
  EXPECT_EQ(activations.blocks.size(), 3u);
  EXPECT_EQ(activations.logits.dim(2), 128);
  // Value gates exist on the layers with a value embedding only (layers 0 and 2 of 3).
  EXPECT_EQ(activations.blocks[0].value_gate.numel(), 2 * 16 * 1);
  EXPECT_EQ(activations.blocks[1].value_gate.raw(), nullptr);
}

TEST(GptMemory, PlanCountsEveryCategory) {
  const GptConfig config = GptConfig::from_depth(24);
  const GptMemoryPlan plan = plan_gpt_memory(config, 1, 2048);
  int64_t params = 0;
  for (const ParamSpec& spec : gpt_parameters(config))
    params += spec.numel();
  // Alignment adds at most 256 bytes per tensor.
  EXPECT_GE(plan.parameters, size_t(params) * 4);
  EXPECT_LT(plan.parameters, size_t(params) * 4 + gpt_parameters(config).size() * 256);
  EXPECT_EQ(plan.gradients, plan.parameters);
  EXPECT_GT(plan.optimizer_state, plan.parameters);  // AdamW keeps two moments for 700M
  // The logits alone: 2048 x 32768 f32.
  EXPECT_GT(plan.activations, size_t(2048) * 32768 * 4);
  EXPECT_GT(plan.workspace, 0u);
  EXPECT_EQ(plan.total(), plan.parameters + plan.gradients + plan.optimizer_state +
                              plan.activations + plan.workspace);
}

}  // namespace
}  // namespace fp8t
