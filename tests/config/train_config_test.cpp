#include "config/train_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "config/config_keys.h"
#include "core/error.h"
#include "test_files.h"

namespace fp8t {
namespace {

namespace fs = std::filesystem;

// __FILE__ is absolute in CMake builds, so the fixtures and presets are found from any working
// directory.
const fs::path kFixtures = fs::path(__FILE__).parent_path();
const fs::path kSourceRoot = kFixtures.parent_path().parent_path();

std::string fixture(const std::string& name) {
  return (kFixtures / name).string();
}
std::string preset(const std::string& name) {
  return (kSourceRoot / "configs" / name).string();
}

TrainConfig load(std::vector<std::string> args) {
  return load_train_config(args);
}

// The message of the ConfigError that loading `args` raises.
std::string load_error(const std::vector<std::string>& args) {
  return test::error_message<ConfigError>([&] { load_train_config(args); });
}

std::string file_error(const std::string& name) {
  return load_error({"--config", fixture(name)});
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(TrainConfig, DefaultsAreNanochatsInBf16) {
  const TrainConfig config;
  EXPECT_NO_THROW(validate(config));
  EXPECT_EQ(config.fp8.scaling.mode, Fp8Mode::None);
  EXPECT_EQ(config.fp8.scaling.recipe, ScalingRecipe::Tensorwise);
  EXPECT_EQ(config.optimizer.kind, OptimizerKind::Muon);
  EXPECT_EQ(config.optimizer.lr, 0.02);
  EXPECT_EQ(config.schedule.lr_warmup_iters, 40);
  EXPECT_EQ(config.run_dir(), fs::path("runs") / "default");
  // With no arguments the loader gives the defaults.
  EXPECT_EQ(to_yaml(load({})), to_yaml(config));
}

TEST(TrainConfig, GptConfigFollowsNanochatSizing) {
  TrainConfig config;
  for (int depth : {3, 12, 20, 24}) {
    config.model.depth = depth;
    const GptConfig gpt = config.gpt_config();
    const GptConfig expected = GptConfig::from_depth(depth);
    EXPECT_EQ(gpt.n_layer, expected.n_layer);
    EXPECT_EQ(gpt.n_embd, expected.n_embd) << depth;
    EXPECT_EQ(gpt.n_head, expected.n_head) << depth;
    EXPECT_EQ(gpt.n_kv_head, expected.n_kv_head) << depth;
  }
  config.model.depth = 6;
  config.model.aspect_ratio = 48;  // 288, rounded up to 320 with heads of 64
  config.model.head_dim = 64;
  config.model.vocab_size = 4096;
  config.model.sequence_len = 512;
  config.model.window_pattern = "SL";
  const GptConfig gpt = config.gpt_config();
  EXPECT_EQ(gpt.n_embd, 320);
  EXPECT_EQ(gpt.n_head, 5);
  EXPECT_EQ(gpt.head_dim(), 64);
  EXPECT_EQ(gpt.vocab_size, 4096);
  EXPECT_EQ(gpt.sequence_len, 512);
  EXPECT_EQ(gpt.window_pattern, "SL");
}

TEST(TrainConfig, ConversionsCarryTheKeys) {
  TrainConfig config;
  config.fp8.scaling.mode = Fp8Mode::Hybrid;
  config.fp8.scaling.recipe = ScalingRecipe::Blockwise;
  config.fp8.lm_head_fp8 = false;
  config.fp8.first_last_layers_bf16 = true;
  config.fp8.num_layers_at_start_in_bf16 = 2;
  config.fp8.num_layers_at_end_in_bf16 = 3;
  const PrecisionOptions precision = config.precision_options();
  EXPECT_EQ(precision.mode, Fp8Mode::Hybrid);
  EXPECT_EQ(precision.recipe, ScalingRecipe::Blockwise);
  EXPECT_FALSE(precision.lm_head_fp8);
  EXPECT_TRUE(precision.first_last_layers_bf16);
  EXPECT_EQ(precision.num_layers_at_start_in_bf16, 2);
  EXPECT_EQ(precision.num_layers_at_end_in_bf16, 3);

  config.optimizer.lr = 0.004;
  config.optimizer.min_lr = 0.001;
  config.training.train_iters = 500;
  config.schedule.lr_decay_style = optim::LrDecayStyle::Cosine;
  const optim::LrSchedule schedule = config.lr_schedule();
  EXPECT_EQ(schedule.style, optim::LrDecayStyle::Cosine);
  EXPECT_EQ(schedule.total_iters, 500);
  EXPECT_EQ(schedule.warmup_iters, 40);
  EXPECT_DOUBLE_EQ(schedule.min_lr_frac, 0.25);
  EXPECT_DOUBLE_EQ(schedule.warmdown_ratio, 0.65);
  EXPECT_DOUBLE_EQ(schedule.final_lr_frac, 0.05);
}

TEST(TrainConfig, BatchSizesResolveWithTheWorldSize) {
  TrainConfig config;
  config.training.micro_batch_size = 16;
  EXPECT_EQ(config.global_batch_size(1), 16);  // 0: no accumulation
  EXPECT_EQ(config.global_batch_size(8), 128);
  EXPECT_EQ(config.grad_accum_steps(8), 1);
  config.training.global_batch_size = 256;
  EXPECT_EQ(config.grad_accum_steps(1), 16);
  EXPECT_EQ(config.grad_accum_steps(8), 2);
  EXPECT_NO_THROW(validate(config, 8));
  EXPECT_THROW(validate(config, 32), ConfigError);  // 16 x 32 = 512 does not divide 256
}

TEST(TrainConfig, PresetsLoad) {
  for (const auto& entry : fs::directory_iterator(kSourceRoot / "configs")) {
    if (entry.path().extension() != ".yaml") continue;
    EXPECT_NO_THROW(load({"--config", entry.path().string()})) << entry.path();
  }
  const TrainConfig tiny = load({"--config", preset("tiny.yaml")});
  EXPECT_EQ(tiny.gpt_config().n_embd, 256);
  EXPECT_EQ(tiny.model.vocab_size, 4096);
  EXPECT_EQ(tiny.model.sequence_len, 128);
  EXPECT_EQ(tiny.training.micro_batch_size, 8);
  EXPECT_EQ(tiny.training.train_iters, 200);
  EXPECT_EQ(tiny.schedule.lr_warmup_iters, 10);
  EXPECT_EQ(tiny.run.save_every, 100);
  EXPECT_EQ(tiny.run.sample_tokens, 48);
  EXPECT_EQ(tiny.data.data_path, "");
  EXPECT_EQ(tiny.fp8.scaling.mode, Fp8Mode::None);

  for (const char* depth : {"12", "20", "24"}) {
    const TrainConfig bf16 = load({"--config", preset(fmt::format("d{}.yaml", depth))});
    const TrainConfig fp8 = load({"--config", preset(fmt::format("d{}_fp8.yaml", depth))});
    EXPECT_EQ(bf16.model.depth, std::stoi(depth));
    EXPECT_EQ(bf16.global_batch_size(1) * bf16.model.sequence_len, 524288) << depth;
    EXPECT_EQ(bf16.fp8.scaling.mode, Fp8Mode::None);
    EXPECT_EQ(fp8.fp8.scaling.mode, Fp8Mode::Hybrid);
    EXPECT_EQ(fp8.fp8.scaling.recipe, ScalingRecipe::Tensorwise);
    EXPECT_EQ(fp8.run.name, fmt::format("d{}_fp8", depth));
    // Apart from the name and the fp8 mode, an FP8 preset is its base.
    TrainConfig same = fp8;
    same.run.name = bf16.run.name;
    same.fp8.scaling.mode = Fp8Mode::None;
    EXPECT_EQ(to_yaml(same), to_yaml(bf16)) << depth;
  }
  EXPECT_EQ(load({"--config", preset("d24.yaml")}).training.micro_batch_size, 16);
}

TEST(TrainConfig, FlatKeysAndSectionsMeanTheSame) {
  const TrainConfig flat = load({"--config", fixture("flat.yaml")});
  EXPECT_EQ(flat.model.depth, 6);
  EXPECT_EQ(flat.optimizer.kind, OptimizerKind::AdamW);
  EXPECT_EQ(flat.fp8.scaling.recipe, ScalingRecipe::Delayed);
  EXPECT_TRUE(flat.fp8.first_last_layers_bf16);
  EXPECT_EQ(to_yaml(flat), to_yaml(load({"--config", fixture("sectioned.yaml")})));
}

TEST(TrainConfig, BaseFileIsLoadedFirstRelativeToTheFile) {
  const TrainConfig child = load({"--config", fixture("child_of_tiny.yaml")});
  EXPECT_EQ(child.run.name, "tiny_child");
  EXPECT_EQ(child.optimizer.lr, 0.01);
  EXPECT_EQ(child.model.depth, 4);  // from configs/tiny.yaml
  EXPECT_EQ(child.training.train_iters, 200);
}

TEST(TrainConfig, FileErrorsNameFileLineAndKey) {
  struct Case {
    const char* file;
    std::string expected;  // after the fixture's path
  };
  const Case cases[] = {
      {"unknown_key.yaml", ":3: micro_batch_sise: unknown key; did you mean 'micro_batch_size'?"},
      {"wrong_section.yaml", ":4: lr: belongs in the optimizer section, not in model"},
      {"wrong_type.yaml", ":2: depth: expected an integer in [1, 1000], found 'deep'"},
      {"out_of_range.yaml", ":2: lr_warmdown_ratio: must be a number in [0, 1], found 1.5"},
      {"bad_enum.yaml", ":2: optimizer: unknown value 'sgd'; allowed: muon, adamw"},
      {"bad_base.yaml", fmt::format(":2: base: cannot read '{}': No such file or directory",
                                    fixture("nothere.yaml"))},
      {"bad_batch.yaml",
       ":3: global_batch_size: must be a multiple of micro_batch_size × data-parallel replicas (32 "
       "× 1 = 32), "
       "found 48"},
      {"section_scalar.yaml",
       ":1: training: expected a mapping of the training section's keys, found 'd12'"},
      {"given_twice.yaml", ":3: depth: given twice (also at line 1)"},
      {"fp8_multi_head_attention.yaml",
       ":2: fp8_multi_head_attention: true is not supported: FP8 between the attention block's "
       "operations is not implemented"},
      // A check of several keys names the key it refuses.
      {"fp8_attention_without_fp8.yaml",
       ":2: fp8_dot_product_attention: true needs fp8 other than none"},
      {"rowwise.yaml",
       ":1: fp8_recipe: unknown value 'rowwise'; allowed: delayed, tensorwise, blockwise, mxfp8 "
       "(nanochat's rowwise, a scale per row, is not implemented; blockwise, a scale per 1x128 "
       "block, is the closest)"},
      {"nanochat_key.yaml",
       ":1: device_batch_size: unknown key; did you mean 'micro_batch_size'? (nanochat's "
       "device_batch_size)"},
      // A check of several keys names the file.
      {"fp8_conflict.yaml",
       ": fp8_power_of_2_scales: mxfp8 scales are E8M0 powers of two; false is not possible"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(file_error(c.file), fixture(c.file) + c.expected);
  }
}

TEST(TrainConfig, Fp8DotProductAttentionParses) {
  const TrainConfig config = load({"--config", fixture("fp8_attention.yaml")});
  EXPECT_TRUE(config.fp8.dot_product_attention);
  EXPECT_EQ(config.fp8.scaling.mode, Fp8Mode::Hybrid);
  EXPECT_FALSE(TrainConfig{}.fp8.dot_product_attention);
  const YAML::Node written = YAML::Load(to_yaml(config));
  EXPECT_TRUE(written["fp8"]["fp8_dot_product_attention"].as<bool>());
}

TEST(TrainConfig, MissingFileAndCyclesAreErrors) {
  EXPECT_EQ(file_error("absent.yaml"),
            fixture("absent.yaml") + ": cannot read the config file: No such file or directory");
  const std::string cycle = file_error("cycle_a.yaml");
  EXPECT_EQ(cycle, fixture("cycle_b.yaml") + ":1: base: '" + fixture("cycle_a.yaml") +
                       "' is already being loaded: the bases form a cycle");
}

// A folder, as the config file or as a base, is refused before yaml-cpp reads it (which leaked
// its read buffer when reading the folder failed).
TEST(TrainConfig, FolderIsNotAConfigFile) {
  const test::TempFolder folder;
  fs::create_directory(folder / "sub");
  std::ofstream(folder / "child.yaml") << "base: sub\ndepth: 4\n";
  EXPECT_EQ(
      load_error({"--config", folder.path().string()}),
      folder.path().string() + ": cannot read the config file: expected a file, found a folder");
  EXPECT_EQ(load_error({"--config", (folder / "child.yaml").string()}),
            (folder / "child.yaml").string() + ":1: base: cannot read '" +
                (folder / "sub").string() + "': expected a file, found a folder");
}

// A base whose name the system cannot resolve (longer than a file name may be) is an error
// naming the key and the name, not a crash.
TEST(TrainConfig, BaseNameTooLongIsAnError) {
  const test::TempFolder folder;
  const std::string name(300, 'a');
  std::ofstream(folder / "child.yaml") << "base: " << name << "\ndepth: 4\n";
  EXPECT_EQ(load_error({"--config", (folder / "child.yaml").string()}),
            (folder / "child.yaml").string() + ":1: base: cannot read '" +
                (folder / name).string() + "': File name too long");
}

TEST(TrainConfig, OverridesInEveryForm) {
  const TrainConfig config =
      load({"--micro-batch-size=4", "--global_batch_size", "8", "--lr=0.01",
            "--first-last-layers-bf16", "--lm-head-fp8=false", "--fp8", "--run", "smoke",
            "--window-pattern=SL", "--fp8-power-of-2-scales=true", "--min_lr", "0"});
  EXPECT_EQ(config.training.micro_batch_size, 4);
  EXPECT_EQ(config.training.global_batch_size, 8);
  EXPECT_EQ(config.optimizer.lr, 0.01);
  EXPECT_TRUE(config.fp8.first_last_layers_bf16);
  EXPECT_FALSE(config.fp8.lm_head_fp8);
  EXPECT_EQ(config.fp8.scaling.mode, Fp8Mode::Hybrid);  // --fp8 alone, as nanochat's
  EXPECT_EQ(config.run.name, "smoke");
  EXPECT_EQ(config.model.window_pattern, "SL");
  EXPECT_EQ(config.fp8.scaling.power_of_2_scales, true);
  EXPECT_EQ(load({"--fp8=e4m3"}).fp8.scaling.mode, Fp8Mode::E4M3);
  EXPECT_EQ(load({"--fp8=none"}).fp8.scaling.mode, Fp8Mode::None);
  EXPECT_EQ(load({"--resume-from-step", "-1"}).run.resume_from_step, -1);  // a negative value
}

TEST(TrainConfig, NanGuardListsInEveryForm) {
  const TrainConfig defaults;
  EXPECT_EQ(defaults.run.nan_restore_after, 5);
  EXPECT_EQ(defaults.run.nan_remedy, std::vector<NanRemedy>{NanRemedy::LowerLr});
  EXPECT_TRUE(defaults.run.nan_inject_steps.empty());
  const TrainConfig listed =
      load({"--fp8", "--nan-remedy=[lower_lr, bf16_layer]", "--nan-inject-steps=5,6, 7",
            "--nan-inject-parameter=transformer.h.1.mlp.c_fc.weight"});
  EXPECT_EQ(listed.run.nan_remedy,
            (std::vector<NanRemedy>{NanRemedy::LowerLr, NanRemedy::Bf16Layer}));
  EXPECT_EQ(listed.run.nan_inject_steps, (std::vector<int64_t>{5, 6, 7}));
  EXPECT_TRUE(load({"--nan-remedy=[]"}).run.nan_remedy.empty());
  EXPECT_EQ(load({"--nan-remedy", "lower_lr"}).run.nan_remedy, defaults.run.nan_remedy);
  const YAML::Node written = YAML::Load(to_yaml(listed));
  EXPECT_EQ(written["run"]["nan_inject_steps"].as<std::vector<int64_t>>(),
            (std::vector<int64_t>{5, 6, 7}));
  EXPECT_EQ(written["run"]["nan_remedy"].as<std::vector<std::string>>(),
            (std::vector<std::string>{"lower_lr", "bf16_layer"}));

  const test::TempFolder folder;
  std::ofstream(folder / "guard.yaml") << "fp8: hybrid\nfp8_recipe: delayed\nrun:\n"
                                          "  nan_remedy: [fp8_margin, lower_lr]\n"
                                          "  nan_inject_steps: [3]\n"
                                          "  nan_inject_parameter: lm_head.weight\n";
  const TrainConfig file = load({"--config", (folder / "guard.yaml").string()});
  EXPECT_EQ(file.run.nan_remedy,
            (std::vector<NanRemedy>{NanRemedy::Fp8Margin, NanRemedy::LowerLr}));
  EXPECT_EQ(file.run.nan_inject_steps, std::vector<int64_t>{3});
  std::ofstream(folder / "nested.yaml") << "nan_inject_steps: [[3]]\n";
  EXPECT_EQ(load_error({"--config", (folder / "nested.yaml").string()}),
            (folder / "nested.yaml").string() +
                ":1: nan_inject_steps: expected a list of integers >= 1, found a list");
}

TEST(TrainConfig, NanGuardErrorsNameTheKey) {
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"--nan-remedy=[lower_lr, smaller_batch]"},
       "--nan-remedy: expected lower_lr, fp8_margin, bf16_layer, found 'smaller_batch'"},
      {{"--nan-inject-steps=[0]"}, "--nan-inject-steps: expected integers >= 1, found '0'"},
      {{"--nan-lr-factor=1"}, "--nan-lr-factor: must be a number in (0, 1), found 1"},
      {{"--nan-remedy=fp8_margin"},
       "--nan-remedy: fp8_margin needs fp8_recipe: delayed (the only recipe with a margin), "
       "found fp8: none"},
      {{"--fp8", "--nan-remedy=fp8_margin"},
       "--nan-remedy: fp8_margin needs fp8_recipe: delayed (the only recipe with a margin), "
       "found fp8_recipe: tensorwise"},
      {{"--nan-remedy=bf16_layer"},
       "--nan-remedy: bf16_layer needs fp8 other than none (with fp8: none every linear is "
       "BF16 already)"},
      {{"--depth=2", "--nan-inject-steps=3", "--nan-inject-parameter=transformer.h.2.mlp.c_fc"},
       "--nan-inject-parameter: nan_inject_steps need a parameter of this model (e.g. "
       "transformer.h.0.mlp.c_fc.weight), found 'transformer.h.2.mlp.c_fc'"},
  };
  for (const auto& [args, expected] : cases) {
    EXPECT_EQ(load_error(args), "command line: " + expected);
  }
  // A Flux model has no guard keys.
  EXPECT_THAT(load_error({"--model=flux_tiny", "--nan-restore-after=2"}),
              ::testing::HasSubstr("--nan-restore-after: applies to the GPT only"));
}

TEST(TrainConfig, TensorParallelSplitsTheBatchAmongReplicasAndNamesTheKey) {
  TrainConfig config;
  config.training.micro_batch_size = 16;
  config.run.tensor_model_parallel_size = 2;
  EXPECT_EQ(config.data_parallel_size(8), 4);
  EXPECT_EQ(config.global_batch_size(8), 64);  // 4 replicas, one micro-batch each
  config.training.global_batch_size = 128;
  EXPECT_EQ(config.grad_accum_steps(8), 2);
  EXPECT_EQ(config.data_parallel_size(1), 1);  // the job's ranks not known yet

  // The default depth-20 GPT has 10 heads of 128: 4 ranks cannot split them.
  EXPECT_EQ(load_error({"--tensor-model-parallel-size=4"}),
            "command line: --tensor-model-parallel-size: 4 must divide the model's query heads "
            "(10); expected one of its divisors");
  EXPECT_EQ(load({"--tensor-model-parallel-size=2"}).run.tensor_model_parallel_size, 2);
  EXPECT_THAT(
      load_error({"--tensor-model-parallel-size=2", "--fp8", "--fp8-dot-product-attention=true"}),
      ::testing::HasSubstr("--tensor-model-parallel-size: 2 does not run with "
                           "fp8_dot_product_attention: true"));
  // flux_tiny: 2 heads of 32, an MLP of 256.
  EXPECT_EQ(
      load({"--model=flux_tiny", "--tensor-model-parallel-size=2"}).run.tensor_model_parallel_size,
      2);
  EXPECT_EQ(load_error({"--model=flux_tiny", "--tensor-model-parallel-size=4"}),
            "command line: --tensor-model-parallel-size: 4 must divide the model's heads (2); "
            "expected one of its divisors");
}

TEST(TrainConfig, SequenceParallelNeedsATensorParallelGroupAndSplitTokens) {
  EXPECT_TRUE(
      load({"--tensor-model-parallel-size=2", "--sequence-parallel=true"}).run.sequence_parallel);
  EXPECT_EQ(load_error({"--sequence-parallel=true"}),
            "command line: --sequence-parallel: true needs tensor_model_parallel_size above 1 (it "
            "splits the tokens over a tensor-parallel group), found 1");
  EXPECT_TRUE(
      load({"--model=flux_tiny", "--tensor-model-parallel-size=2", "--sequence-parallel=true"})
          .run.sequence_parallel);
  EXPECT_EQ(load_error({"--model=flux_tiny", "--sequence-parallel=true"}),
            "command line: --sequence-parallel: true needs tensor_model_parallel_size above 1 (it "
            "splits the tokens over a tensor-parallel group), found 1");
  EXPECT_EQ(load_error({"--depth=2", "--head-dim=64", "--aspect-ratio=64",
                        "--tensor-model-parallel-size=2", "--sequence-parallel=true",
                        "--micro-batch-size=1", "--sequence-len=7"}),
            "command line: --sequence-parallel: the 7 tokens of a micro-batch (micro_batch_size 1 "
            "× sequence_len 7) do not split over tensor_model_parallel_size 2; expected a "
            "multiple of it");
}

TEST(TrainConfig, NanochatFlags) {
  const TrainConfig config = load({"--depth=24",
                                   "--fp8",
                                   "--run=d24",
                                   "--resume-from-step=100",
                                   "--device-batch-size=16",
                                   "--num-iterations=5000",
                                   "--matrix-lr=0.03",
                                   "--warmup-steps=10",
                                   "--warmdown-ratio=0.5",
                                   "--final-lr-frac=0.1",
                                   "--save-every=1000",
                                   "--eval-every=-1",
                                   "--fp8-recipe=tensorwise",
                                   "--device-type=cpu",
                                   "--embedding-lr=0.2",
                                   "--unembedding-lr=0.004",
                                   "--scalar-lr=0.4",
                                   "--weight-decay=0.1",
                                   "--aspect-ratio=64",
                                   "--head-dim=128"});
  EXPECT_EQ(config.model.depth, 24);
  EXPECT_EQ(config.fp8.scaling.mode, Fp8Mode::Hybrid);
  EXPECT_EQ(config.run.name, "d24");
  EXPECT_EQ(config.run.resume_from_step, 100);
  EXPECT_EQ(config.training.micro_batch_size, 16);
  EXPECT_EQ(config.training.train_iters, 5000);
  EXPECT_EQ(config.optimizer.lr, 0.03);
  EXPECT_EQ(config.schedule.lr_warmup_iters, 10);
  EXPECT_EQ(config.schedule.lr_warmdown_ratio, 0.5);
  EXPECT_EQ(config.schedule.final_lr_frac, 0.1);
  EXPECT_EQ(config.run.save_every, 1000);
  EXPECT_EQ(config.run.eval_every, -1);
  EXPECT_EQ(config.run.device, DeviceChoice::Cpu);
  EXPECT_EQ(config.optimizer.embedding_lr, 0.2);
  EXPECT_EQ(config.optimizer.unembedding_lr, 0.004);
  EXPECT_EQ(config.optimizer.scalar_lr, 0.4);
  EXPECT_EQ(config.optimizer.weight_decay, 0.1);

  // --total-batch-size counts tokens, converted with the final sequence length.
  const TrainConfig tokens =
      load({"--device-batch-size=8", "--total-batch-size=524288", "--max-seq-len=1024"});
  EXPECT_EQ(tokens.model.sequence_len, 1024);
  EXPECT_EQ(tokens.training.global_batch_size, 512);
  EXPECT_EQ(tokens.grad_accum_steps(1), 64);
}

TEST(TrainConfig, OverridesApplyAfterTheFileAndLaterOnesWin) {
  // --config is read first wherever it stands.
  const TrainConfig config =
      load({"--lr=0.05", "--config", preset("tiny.yaml"), "--depth=6", "--depth=8"});
  EXPECT_EQ(config.optimizer.lr, 0.05);
  EXPECT_EQ(config.model.depth, 8);
  EXPECT_EQ(config.training.train_iters, 200);  // from the file
  // Between the token and the sequence batch sizes, the later one wins too.
  EXPECT_EQ(load({"--total-batch-size=4096", "--global-batch-size=64"}).training.global_batch_size,
            64);
  EXPECT_EQ(load({"--micro-batch-size=2", "--global-batch-size=64", "--total-batch-size=4096"})
                .training.global_batch_size,
            2);
}

TEST(TrainConfig, CommandLineErrorsNameTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string expected;  // after "command line: "
  };
  const Case cases[] = {
      {{"--lr=x"}, "--lr: expected a finite number > 0, found 'x'"},
      {{"--matrix-lr", "-1"}, "--matrix-lr: must be a finite number > 0, found -1"},
      {{"--micro-batch-sise=4"},
       "--micro-batch-sise: unknown key; did you mean 'micro_batch_size'?"},
      {{"--target-param-data-ratio=8"},
       "--target-param-data-ratio: unknown key; nanochat's step count from a data:param ratio is "
       "not computed here; set train_iters"},
      {{"--depth"}, "--depth: expects a value: an integer in [1, 1000]"},
      {{"--fp8", "e4m3"},
       "'e4m3': expected --key=value, --key value or --flag (--fp8 takes a value only with '=': "
       "--fp8=e4m3)"},
      {{"--fp8-wgrad=maybe"}, "--fp8-wgrad: expected true or false, found 'maybe'"},
      {{"--config", "a.yaml", "--config=b.yaml"}, "--config: given twice ('a.yaml' and 'b.yaml')"},
      {{"--total-batch-size=1000"},
       "--total-batch-size: 1000 tokens is not a whole number of sequences of sequence_len 2048"},
      {{"--min-lr=0.5"}, "--min-lr: must be at most lr (0.02), found 0.5"},
      {{"--num-iterations=10", "--resume-from-step=20"},
       "--resume-from-step: must be at most train_iters (10), found 20"},
      {{"--resume=auto", "--resume-from-step=3"},
       "--resume-from-step: resume: auto picks the checkpoint itself; set one of the two, found "
       "resume_from_step 3"},
      {{"--resume=latest"}, "--resume: unknown value 'latest'; allowed: never, auto"},
      {{"--head-dim=63"}, "--head-dim: must be even (rotary), found 63"},
      {{"--fp8_dot_product_attention=true"},
       "--fp8_dot_product_attention: true needs fp8 other than none"},
      // A key at its default is named with the top-level source.
      {{"--config", preset("tiny.yaml"), "--global-batch-size=12"},
       "--global-batch-size: must be a multiple of micro_batch_size × data-parallel replicas (8 × "
       "1 = 8), found "
       "12"},
      {{"--fp8-recipe=delayed", "--fp8-amax-epsilon=0.5"},
       "fp8_amax_epsilon: applies to tensorwise and blockwise only, found 0.5 with fp8_recipe: "
       "delayed"},
      {{"--fp8-recipe=mxfp8", "--fp8-weight-transposes=in_backward"},
       "--fp8-weight-transposes: in_backward transposes Ŵ, but an mxfp8 Ŵᵗ has 1x32 blocks of its "
       "own; expected kept with fp8_recipe: mxfp8"},
      {{"--fp8-weight-transposes=dropped"},
       "--fp8-weight-transposes: unknown value 'dropped'; allowed: kept, in_backward"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(load_error(c.args), "command line: " + c.expected);
  }
}

TEST(TrainConfig, EveryKeyRoundTripsThroughYaml) {
  TrainConfig config;
  config.run.name = "round \"trip\"";
  config.run.output_dir = "/tmp/runs";
  config.run.save_every = 7;
  config.run.device = DeviceChoice::Cuda;
  config.run.resume = ResumeChoice::Auto;
  config.model.depth = 6;
  config.model.window_pattern = "SL";
  config.data.data_path = "data/shards";
  config.training.micro_batch_size = 4;
  config.training.global_batch_size = 12;
  config.training.seed = 1234567890123;
  config.optimizer.kind = OptimizerKind::AdamW;
  config.optimizer.lr = 3e-4;
  config.optimizer.min_lr = 1e-5;
  config.optimizer.adam_eps = 1e-10;
  config.schedule.lr_decay_style = optim::LrDecayStyle::Cosine;
  config.fp8.scaling.mode = Fp8Mode::E4M3;
  config.fp8.scaling.recipe = ScalingRecipe::Blockwise;
  config.fp8.scaling.power_of_2_scales = false;
  config.fp8.scaling.amax_epsilon = 1e-12f;
  config.fp8.scaling.dtype_family = FamilySetting::Fnuz;
  config.fp8.wgrad = false;
  config.fp8.weight_transposes = ops::WeightTransposes::InBackward;
  config.fp8.dot_product_attention = true;
  config.fp8.num_layers_at_end_in_bf16 = 2;
  config.run.nan_restore_after = 2;
  config.run.nan_remedy = {NanRemedy::Bf16Layer, NanRemedy::LowerLr};
  config.run.nan_inject_steps = {3, 5};
  config.run.nan_inject_parameter = "transformer.h.1.mlp.c_fc.weight";

  const test::TempFolder folder;
  const fs::path file = folder / "round_trip.yaml";
  save_train_config(config, file);
  const TrainConfig loaded = load({"--config", file.string()});
  EXPECT_EQ(to_yaml(loaded), to_yaml(config));
  EXPECT_EQ(loaded.run.name, config.run.name);
  EXPECT_EQ(loaded.training.seed, config.training.seed);
  EXPECT_EQ(loaded.optimizer.lr, config.optimizer.lr);
  EXPECT_EQ(loaded.fp8.scaling.amax_epsilon, config.fp8.scaling.amax_epsilon);
  EXPECT_EQ(loaded.fp8.scaling.power_of_2_scales, false);
  EXPECT_EQ(loaded.run.nan_remedy, config.run.nan_remedy);
  EXPECT_EQ(loaded.run.nan_inject_steps, config.run.nan_inject_steps);

  // Every key of the model is written, in its section; the other model's keys are not (nor a
  // section without any).
  const YAML::Node written = YAML::Load(to_yaml(config));
  for (const ConfigKey& key : config_keys()) {
    const YAML::Node section = written[std::string(section_name(key.section))];
    EXPECT_EQ(section && section[std::string(key.name)], key.models != ModelScope::Flux)
        << key.name;
  }
}

// Control characters in strings survive the resolved config.yaml (a line break inside the
// quotes read back as a space).
TEST(TrainConfig, ControlCharactersRoundTripThroughYaml) {
  TrainConfig config;
  config.run.name = "two\nlines";
  config.data.data_path = "tab\t, return\r, bell\x07, delete\x7f";
  const test::TempFolder folder;
  const fs::path file = folder / "control.yaml";
  save_train_config(config, file);
  const TrainConfig loaded = load({"--config", file.string()});
  EXPECT_EQ(loaded.run.name, config.run.name);
  EXPECT_EQ(loaded.data.data_path, config.data.data_path);
  EXPECT_EQ(to_yaml(loaded), to_yaml(config));
}

TEST(TrainConfig, FluxRoundTripsThroughYaml) {
  TrainConfig config = TrainConfig::defaults_for("flux_tiny");
  config.flux.sigma.sampler = SigmaSampler::Mode;
  config.flux.sigma.shift = 3.0;
  config.flux.latent_scale = 1.0;
  config.data.image_size = 48;
  config.run.sample_prompts = "a red circle on the left; a blue square at the top";
  config.optimizer.lr = 3e-4;
  const test::TempFolder folder;
  save_train_config(config, folder / "flux.yaml");
  const TrainConfig loaded = load({"--config", (folder / "flux.yaml").string()});
  EXPECT_EQ(to_yaml(loaded), to_yaml(config));
  EXPECT_EQ(loaded.flux.sigma.sampler, SigmaSampler::Mode);
  const YAML::Node written = YAML::Load(to_yaml(config));
  for (const ConfigKey& key : config_keys()) {
    const YAML::Node section = written[std::string(section_name(key.section))];
    EXPECT_EQ(section && section[std::string(key.name)], key.models != ModelScope::Gpt) << key.name;
  }
}

TEST(TrainConfig, FluxTakesPrimusDefaultsUnderEverySettingGiven) {
  // The model may come last: the keys given before it still win over its defaults.
  const TrainConfig config = load({"--lr=0.001", "--model=flux_tiny"});
  EXPECT_TRUE(config.is_flux());
  EXPECT_EQ(config.optimizer.kind, OptimizerKind::AdamW);
  EXPECT_EQ(config.optimizer.lr, 0.001);
  EXPECT_EQ(config.optimizer.min_lr, 1e-5);
  EXPECT_EQ(config.optimizer.weight_decay, 0.01);
  EXPECT_EQ(config.optimizer.adam_beta2, 0.999);
  EXPECT_EQ(config.optimizer.clip_grad, 1.0);
  EXPECT_EQ(config.schedule.lr_decay_style, optim::LrDecayStyle::Cosine);
  EXPECT_EQ(config.run.device, DeviceChoice::Auto);
  EXPECT_EQ(config.flux_config().hidden_size, 64);
  const TrainConfig preset_config = load({"--config", preset("flux_tiny.yaml")});
  EXPECT_EQ(preset_config.model.name, "flux_tiny");
  EXPECT_EQ(preset_config.flux.latent_scale, 1.0);
  EXPECT_EQ(preset_config.flux.latent_shift, 0.0);
}

TEST(TrainConfig, KeysOfTheOtherModelAreRefused) {
  EXPECT_EQ(load_error({"--model=flux_tiny", "--depth=20"}),
            "command line: --depth: applies to the GPT only, not to model flux_tiny");
  EXPECT_EQ(load_error({"--cfg-dropout=0.2"}),
            "command line: --cfg-dropout: applies to Flux only, not to model gpt");
  EXPECT_EQ(load_error({"--model=flux_tiny", "--total-batch-size=4096"}),
            "command line: --total-batch-size: counts the GPT's tokens; for flux_tiny set "
            "global_batch_size (pictures per step)");
  TrainConfig config;
  config.flux.cfg_dropout = 0.5;
  EXPECT_EQ(test::error_message<ConfigError>([&] { validate(config); }),
            "cfg_dropout: applies to Flux only, not to model gpt");
}

TEST(TrainConfig, FluxRunsOnTheCpuWithAdamWOnTheShapesData) {
  EXPECT_EQ(load_error({"--model=flux_tiny", "--optimizer=muon"}),
            "command line: --optimizer: Flux trains with adamw (Muon is set up for the GPT's "
            "parameters)");
  EXPECT_EQ(load_error({"--model=flux_535m"}),
            "command line: --model: flux_535m takes image tokens of 64 features, but the "
            "built-in shapes data makes 16 (4 channels in 2×2 patches); flux_tiny trains on it");
  EXPECT_EQ(load_error({"--model=flux_tiny", "--image-size=24"}),
            "command line: image_size: must be a positive multiple of 16, found 24");
  EXPECT_EQ(load_error({"--model=flux_tiny", "--mode-scale=2"}),
            "command line: --mode-scale: must be a number in [-1, 1.75], found 2");
  EXPECT_EQ(load_error({"--model=flux_2b"}),
            "command line: --model: unknown value 'flux_2b'; allowed: gpt, flux_tiny, flux_small, "
            "flux_535m, "
            "flux_12b");
}

TEST(TrainConfig, EveryKeyParsesItsOwnDefault) {
  const TrainConfig defaults;
  for (const ConfigKey& key : config_keys()) {
    TrainConfig config;
    // A list's setter reads the written flow form ("[a, b]") itself.
    const std::string text = key.type == ValueType::List
                                 ? key.get(defaults)
                                 : YAML::Load(key.get(defaults)).as<std::string>();
    EXPECT_EQ(key.set(config, text), std::nullopt) << key.name;
    EXPECT_EQ(key.get(config), key.get(defaults)) << key.name;
  }
}

TEST(TrainConfig, UnknownKeyAdvice) {
  EXPECT_EQ(unknown_key_advice("fp8_recipee"), "did you mean 'fp8_recipe'?");
  EXPECT_EQ(unknown_key_advice("warmup_iters"), "did you mean 'lr_warmup_iters'?");
  EXPECT_EQ(unknown_key_advice("max_seq_len"),
            "did you mean 'sequence_len'? (nanochat's "
            "max_seq_len)");
  EXPECT_EQ(unknown_key_advice("total_batch_size"),
            "did you mean 'global_batch_size'? (nanochat's total_batch_size, in tokens)");
  EXPECT_EQ(unknown_key_advice("zzzzzzzz"), "");
}

TEST(TrainConfig, Fp8ReaderSharesTheTable) {
  // The fp8 tools' reader: hybrid by default, fp8 keys flat or in the fp8 section, other keys
  // left alone.
  EXPECT_EQ(fp8_config_from_yaml(YAML::Load("lr: 0.1\nmodel: d12\n"), "x.yaml").mode,
            Fp8Mode::Hybrid);
  const Fp8Config sectioned = fp8_config_from_yaml(
      YAML::Load("model:\n  depth: 4\nfp8:\n  fp8: e4m3\n  fp8_recipe: delayed\n"), "x.yaml");
  EXPECT_EQ(sectioned.mode, Fp8Mode::E4M3);
  EXPECT_EQ(sectioned.recipe, ScalingRecipe::Delayed);
  const Fp8Config preset_fp8 = fp8_config_from_yaml(YAML::LoadFile(preset("d24_fp8.yaml")), "d24");
  EXPECT_EQ(preset_fp8.recipe, ScalingRecipe::Tensorwise);
  const std::string message = test::error_message<ConfigError>(
      [] { fp8_config_from_yaml(YAML::Load("depth: 4\nfp8_recipee: delayed\n"), "x.yaml"); });
  EXPECT_TRUE(message.starts_with(
      "x.yaml:2: fp8_recipee: unknown key; did you mean 'fp8_recipe'? fp8 keys are: fp8, "
      "fp8_recipe, "))
      << message;
}

TEST(TrainConfig, DocsMatchTheKeyTable) {
  const fs::path docs = kSourceRoot / "docs" / "configuration.md";
  EXPECT_TRUE(read_text(docs) == configuration_markdown())
      << docs << " is out of date with the key table: run scripts/gen_config_docs.sh";
}

}  // namespace
}  // namespace fp8t
