// fp8train: the command-line entry point. The only place that turns errors into exit codes.
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "config/train_config.h"

namespace {

// The command line of each rank --nproc-per-node starts: this one without that option.
std::vector<std::string> without_nproc_per_node(int argc, char** argv) {
  std::vector<std::string> arguments;
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument == "--nproc-per-node") {
      ++i;  // and its value
    } else if (!argument.starts_with("--nproc-per-node=")) {
      arguments.push_back(argument);
    }
  }
  return arguments;
}

}  // namespace

int main(int argc, char** argv) {
  // Each line out as soon as it is printed, also into a pipe or a file (Slurm, nohup): a long
  // benchmark or tuning run shows its progress, and one that is killed keeps what it printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"fp8train: FP8 training engine", "fp8train"};
  app.set_version_flag("--version", "fp8train " FP8TRAIN_VERSION);
  // `train` and `bench gpt|flux` run data-parallel: N ranks on this node.
  int nproc_per_node = 0;
  const auto add_nproc_per_node = [&nproc_per_node](CLI::App* command) {
    command
        ->add_option("--nproc-per-node", nproc_per_node,
                     "Start N ranks of this command on this node (data parallel, one GPU each)")
        ->check(CLI::Range(1, 1024));
  };
  // `bench gpt|flux`: the ranks split into tensor-parallel groups of T.
  const auto add_tensor_parallel = [](CLI::App* command, int& tensor_parallel) {
    command
        ->add_option("--tensor-parallel", tensor_parallel,
                     "Ranks per tensor-parallel group (tensor_model_parallel_size); it must "
                     "divide the ranks, the groups being data-parallel replicas")
        ->capture_default_str()
        ->check(CLI::Range(1, 1024));
  };
  // The benchmarks' one rank of a group on one GPU, and their sequence parallelism.
  const auto add_rank_alone = [](CLI::App* command, bool& rank_alone, bool& sequence_parallel) {
    command->add_flag("--rank-alone", rank_alone,
                      "With --tensor-parallel T in one process: time the first rank of a group "
                      "alone on this GPU, its collectives within the group left out (its memory "
                      "and compute, not the communication; the loss is not the model's): "
                      "whether a rank fits before T GPUs are at hand");
    command->add_flag("--sequence-parallel", sequence_parallel,
                      "With --tensor-parallel T: sequence parallelism (sequence_parallel), each "
                      "rank keeping 1/T of the tokens outside the split linears");
  };
  app.require_subcommand(1);

  fp8t::cli::DoctorOptions doctor_options;
  CLI::App* doctor = app.add_subcommand(
      "doctor", "Report the GPUs, CUDA, cuBLASLt, cuDNN and NCCL versions and the FP8 formats");
  doctor->add_flag("--json", doctor_options.json, "Print the report as one JSON object");

  fp8t::cli::CheckNumericsOptions numerics_options;
  CLI::App* check_numerics = app.add_subcommand(
      "check-numerics", "Quantize random data with every FP8 recipe and check the errors");
  check_numerics->add_option("--config", numerics_options.config_path,
                             "YAML file whose fp8 keys configure the check (default: defaults)");
  check_numerics->add_option("--rows", numerics_options.rows, "Rows of the test tensor")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  check_numerics->add_option("--cols", numerics_options.cols, "Columns of the test tensor")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));

  // The Flux presets, as --preset takes them.
  const std::vector<std::string> flux_presets(std::begin(fp8t::kFluxPresets),
                                              std::end(fp8t::kFluxPresets));
  // --double-blocks and --single-blocks of a Flux preset.
  const auto add_block_options = [](CLI::App* command, fp8t::cli::FluxModelOptions& flux) {
    return std::vector<CLI::Option*>{
        command
            ->add_option("--double-blocks", flux.double_blocks,
                         "Double blocks instead of the preset's (e.g. fewer, to fit one GPU)")
            ->check(CLI::Range(0, 10000)),
        command
            ->add_option("--single-blocks", flux.single_blocks,
                         "Single blocks instead of the preset's")
            ->check(CLI::Range(0, 10000))};
  };

  fp8t::cli::ModelSummaryOptions model_options;
  CLI::App* model = app.add_subcommand(
      "model",
      "Print the GPT's (or with --preset a Flux model's) shape, parameters, FLOPs, FP8 layers and "
      "memory plan");
  CLI::Option* model_preset =
      model
          ->add_option("--preset", model_options.flux.preset,
                       "Flux preset: the Flux model and its GPU memory plan instead of the GPT")
          ->check(CLI::IsMember(flux_presets));
  const std::vector<CLI::Option*> gpt_only = {
      model->add_option("--depth", model_options.depth, "Number of layers (nanochat sizing)")
          ->capture_default_str()
          ->check(CLI::Range(1, 1000)),
      model->add_option("--vocab-size", model_options.vocab_size, "Vocabulary size before padding")
          ->capture_default_str()
          ->check(CLI::Range(1, 1 << 24)),
      model->add_option("--sequence-len", model_options.sequence_len, "Tokens per sequence")
          ->capture_default_str()
          ->check(CLI::Range(2, 1 << 20)),
      model
          ->add_option("--window-pattern", model_options.window_pattern,
                       "Attention windows tiled over layers: S short, L long")
          ->capture_default_str(),
      model->add_flag("!--no-lm-head-fp8", model_options.lm_head_fp8, "Keep lm_head in BF16")};
  for (CLI::Option* option : gpt_only)
    option->excludes(model_preset);
  model->add_flag("--sequence-parallel", model_options.sequence_parallel,
                  "With --tensor-parallel: the plan of a rank with sequence parallelism "
                  "(sequence_parallel; Flux: the CPU path's activations beside the GPU plan)");
  model
      ->add_option("--batch", model_options.batch,
                   "Sequences (GPT) or samples (Flux) per micro-batch, for the memory plan")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  model->add_option("--fp8", model_options.fp8, "none, e4m3 or hybrid")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "e4m3", "hybrid"}));
  model
      ->add_option("--fp8-recipe", model_options.fp8_recipe,
                   "delayed, tensorwise, blockwise or mxfp8")
      ->capture_default_str()
      ->check(CLI::IsMember({"delayed", "tensorwise", "blockwise", "mxfp8"}));
  model->add_flag("--first-last-layers-bf16", model_options.first_last_layers_bf16,
                  "Keep the first and last blocks in BF16");
  model
      ->add_option("--layers-at-start-in-bf16", model_options.layers_at_start_in_bf16,
                   "With --first-last-layers-bf16: blocks at the start")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  model
      ->add_option("--layers-at-end-in-bf16", model_options.layers_at_end_in_bf16,
                   "With --first-last-layers-bf16: blocks at the end")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  std::vector<CLI::Option*> flux_only = add_block_options(model, model_options.flux);
  flux_only.push_back(
      model->add_option("--img-tokens", model_options.img_tokens, "Flux: image tokens per sample")
          ->capture_default_str()
          ->check(CLI::Range(int64_t{1}, int64_t{1} << 20)));
  flux_only.push_back(
      model->add_option("--txt-tokens", model_options.txt_tokens, "Flux: text tokens per sample")
          ->capture_default_str()
          ->check(CLI::Range(int64_t{1}, int64_t{1} << 20)));
  flux_only.push_back(
      model
          ->add_option("--gpus", model_options.gpus,
                       "Flux: data-parallel GPU counts, a memory plan for each (e.g. 1,2,8)")
          ->delimiter(',')
          ->capture_default_str()
          ->check(CLI::Range(1, 1 << 16)));
  model
      ->add_option("--tensor-parallel", model_options.tensor_parallel,
                   "Ranks per tensor-parallel group (tensor_model_parallel_size): the plans are "
                   "one rank's (Flux: it divides each --gpus count)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  flux_only.push_back(
      model
          ->add_option("--fp8-weight-transposes", model_options.fp8_weight_transposes,
                       "Flux: the FP8 linears' transposed weights kept or made before each "
                       "backward (in_backward), for the plan (fp8_weight_transposes)")
          ->capture_default_str()
          ->check(CLI::IsMember({"kept", "in_backward"})));
  flux_only.push_back(model
                          ->add_option("--gpu-memory", model_options.gpu_memory_gib,
                                       "Flux: GiB one GPU holds (default: an H200's 139.8)")
                          ->check(CLI::PositiveNumber));
  for (CLI::Option* option : flux_only)
    option->needs(model_preset);

  fp8t::cli::BenchGptOptions bench_options;
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks on the GPU");
  bench->require_subcommand(1);
  CLI::App* bench_gpt = bench->add_subcommand(
      "gpt", "Time GPT training steps (default: W-GPT24, BF16 then FP8) and print a table");
  bench_gpt->add_option("--depth", bench_options.depth, "Number of layers (nanochat sizing)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  bench_gpt->add_option("--batch", bench_options.batch, "Sequences per micro-batch")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  bench_gpt->add_option("--sequence-len", bench_options.sequence_len, "Tokens per sequence")
      ->capture_default_str()
      ->check(CLI::Range(16, 1 << 20));
  bench_gpt->add_option("--vocab-size", bench_options.vocab_size, "Vocabulary size")
      ->capture_default_str()
      ->check(CLI::Range(64, 1 << 24));
  bench_gpt
      ->add_option("--window-pattern", bench_options.window_pattern,
                   "Attention windows tiled over layers: S short, L long")
      ->capture_default_str();
  // The options both benchmarks share.
  const auto add_run_options = [](CLI::App* command, std::vector<std::string>& precisions,
                                  std::vector<std::string>& recipes, std::string& formats,
                                  std::vector<std::string>& fp8_attention,
                                  fp8t::cli::BenchTiming& timing) {
    command->add_option("--precision", precisions, "bf16 and/or fp8, measured in the order given")
        ->delimiter(',')
        ->capture_default_str()
        ->check(CLI::IsMember({"bf16", "fp8"}));
    command
        ->add_option("--fp8-recipe", recipes,
                     "FP8 recipes to measure (delayed, tensorwise, blockwise; mxfp8 emulated)")
        ->delimiter(',')
        ->capture_default_str()
        ->check(CLI::IsMember({"delayed", "tensorwise", "blockwise", "mxfp8"}));
    command->add_option("--fp8", formats, "FP8 formats: hybrid or e4m3")
        ->capture_default_str()
        ->check(CLI::IsMember({"e4m3", "hybrid"}));
    command
        ->add_option("--fp8-attention", fp8_attention,
                     "FP8 runs without (off) and/or with (on) FP8 attention "
                     "(fp8_dot_product_attention), measured in the order given")
        ->delimiter(',')
        ->capture_default_str()
        ->check(CLI::IsMember({"off", "on"}));
    command->add_option("--warmup", timing.warmup, "Untimed steps first")
        ->capture_default_str()
        ->check(CLI::Range(0, 1000));
    command->add_option("--steps", timing.steps, "Timed steps (the median is reported)")
        ->capture_default_str()
        ->check(CLI::Range(1, 100000));
    command->add_flag("--phases", timing.phases,
                      "Then time as many steps again by kind of work (GEMMs, attention, "
                      "quantization, other)");
    command->add_option("--trace", timing.trace,
                        "A folder: each run then traces one more step, written there as a Chrome "
                        "trace (MODEL.RUN.trace.json), and prints where the GPU sat idle");
    command
        ->add_option("--gemm-autotune", timing.gemm_autotune,
                     "Measure each run with GEMM autotuning off and/or on, in the order given "
                     "(default: as training, on unless FP8TRAIN_AUTOTUNE=0)")
        ->delimiter(',')
        ->check(CLI::IsMember({"off", "on"}));
    command
        ->add_option("--recompute", timing.recompute,
                     "Measure each run without (none) and/or with activation recompute "
                     "(selective; full: every block its own group; docs/model.md), in the order "
                     "given")
        ->delimiter(',')
        ->check(CLI::IsMember({"none", "selective", "full"}));
    command
        ->add_option("--fp8-weight-transposes", timing.fp8_weight_transposes,
                     "Measure each FP8 run with its linears' transposed weights kept and/or made "
                     "before each backward (in_backward; fp8_weight_transposes), in the order "
                     "given (default: kept)")
        ->delimiter(',')
        ->check(CLI::IsMember({"kept", "in_backward"}));
    command
        ->add_option("--fp8-wgrad", timing.fp8_wgrad,
                     "Measure each FP8 run with its weight-gradient GEMMs in FP8 (on) and/or in "
                     "BF16 (off; fp8_wgrad: false), in the order given (default: on)")
        ->delimiter(',')
        ->check(CLI::IsMember({"on", "off"}));
  };
  add_run_options(bench_gpt, bench_options.precisions, bench_options.fp8_recipes, bench_options.fp8,
                  bench_options.fp8_attention, bench_options.timing);
  add_nproc_per_node(bench_gpt);
  add_tensor_parallel(bench_gpt, bench_options.tensor_parallel);
  add_rank_alone(bench_gpt, bench_options.rank_alone, bench_options.sequence_parallel);
  bench_gpt->add_flag("--overlap-grad-reduce", bench_options.overlap_grad_reduce,
                      "With several ranks: sum each block's gradients while the backward goes on "
                      "(not with --tensor-parallel above 1)");
  bench_gpt->add_flag("--shard-optimizer-state,!--no-shard-optimizer-state",
                      bench_options.shard_optimizer_state,
                      "With several ranks: ZeRO-1 (the default), each rank updates its share of "
                      "the parameters and broadcasts it; --no-shard-optimizer-state: every rank "
                      "runs the whole update");

  fp8t::cli::BenchFluxOptions bench_flux_options;
  CLI::App* bench_flux = bench->add_subcommand(
      "flux", "Time Flux training steps (default: W-FLUX535, BF16 then FP8) and print a table");
  bench_flux->add_option("--preset", bench_flux_options.model.preset, "Flux preset")
      ->capture_default_str()
      ->check(CLI::IsMember(flux_presets));
  add_block_options(bench_flux, bench_flux_options.model);
  bench_flux->add_option("--batch", bench_flux_options.batch, "Samples per micro-batch")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  bench_flux
      ->add_option("--img-tokens", bench_flux_options.img_tokens,
                   "Image tokens per sample (a square grid: 4096 for 1024² images)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  bench_flux->add_option("--txt-tokens", bench_flux_options.txt_tokens, "Text tokens per sample")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  add_run_options(bench_flux, bench_flux_options.precisions, bench_flux_options.fp8_recipes,
                  bench_flux_options.fp8, bench_flux_options.fp8_attention,
                  bench_flux_options.timing);
  add_nproc_per_node(bench_flux);
  add_tensor_parallel(bench_flux, bench_flux_options.tensor_parallel);
  add_rank_alone(bench_flux, bench_flux_options.rank_alone, bench_flux_options.sequence_parallel);
  bench_flux->add_flag("--shard-optimizer-state,!--no-shard-optimizer-state",
                       bench_flux_options.shard_optimizer_state,
                       "With several ranks: ZeRO-1 (the default), each rank updates its share of "
                       "the parameters and broadcasts it; --no-shard-optimizer-state: every rank "
                       "runs the whole update");

  fp8t::cli::ConfigOptions config_options;
  CLI::App* config =
      app.add_subcommand("config", "Print the resolved training configuration (every key) as YAML");
  config->add_option("--config", config_options.config_path, "YAML experiment file");
  config->add_flag("--markdown", config_options.markdown,
                   "Print the reference of every key (docs/configuration.md) instead");
  // Overrides (--key=value, nanochat's flags) go to the configuration's own parser.
  config->allow_extras();
  config->footer(
      "Other arguments override keys: --key=value, --key value, --flag "
      "(see docs/configuration.md).");

  CLI::App* train = app.add_subcommand(
      "train",
      "Train the GPT or a Flux model: a YAML experiment (--config FILE) and overrides of any key");
  train->allow_extras();  // every other argument goes to the configuration's parser
  add_nproc_per_node(train);
  train->footer(
      "Arguments: --config FILE, then overrides --key=value, --key value, --flag, and nanochat's "
      "flags (--depth=24 --fp8 --run=NAME --resume-from-step=N --device-batch-size=16). See "
      "docs/training.md and docs/configuration.md.");

  fp8t::cli::SampleOptions sample_options;
  CLI::App* sample =
      app.add_subcommand("sample", "Draw pictures from a Flux checkpoint into a PNG grid");
  sample
      ->add_option(
          "--checkpoint", sample_options.checkpoint,
          "Checkpoint folder, its model.safetensors, or a run folder (its last checkpoint)")
      ->required();
  sample->add_option("--config", sample_options.config_path,
                     "YAML configuration (default: the checkpoint's config.yaml)");
  sample->add_option("--prompt", sample_options.prompts,
                     "A row's prompt, in the built-in data's words; repeat for more rows "
                     "(default: sample_prompts)");
  sample->add_option("--steps", sample_options.steps, "Euler steps (default: sample_steps)")
      ->check(CLI::Range(1, 10000));
  sample
      ->add_option("--guidance", sample_options.guidance,
                   "Classifier-free guidance scale (default: sample_guidance)")
      ->check(CLI::NonNegativeNumber);
  sample->add_option("--seed", sample_options.seed,
                     "Seed of the first column's noise; column j uses seed + j (default: seed)");
  sample
      ->add_option("--images-per-prompt", sample_options.images_per_prompt,
                   "Columns of the grid (default: sample_images_per_prompt)")
      ->check(CLI::Range(int64_t{1}, int64_t{64}));
  sample->add_option("--output", sample_options.output, "The PNG file to write")
      ->capture_default_str();

  fp8t::cli::PlotOptions plot_options;
  CLI::App* plot = app.add_subcommand(
      "plot", "Draw runs' loss curves, and each relative to the first, side by side into a PNG");
  plot->add_option("--output", plot_options.output, "The PNG file to write")->required();
  plot->add_option("--metric", plot_options.metric, "The metrics.jsonl field to draw")
      ->capture_default_str()
      ->check(CLI::IsMember({"loss", "val_loss"}));
  plot->add_option("--smooth", plot_options.smooth,
                   "Moving average over this many logged values (1: none)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  plot->add_option("--title", plot_options.title,
                   "Title of the picture (default: the metric and the smoothing)");
  plot->add_option("runs", plot_options.run_folders,
                   "Run folders holding metrics.jsonl; the first is the reference")
      ->required();

  fp8t::cli::CompareOptions compare_options;
  CLI::App* compare = app.add_subcommand(
      "compare", "Compare runs against the first: a verdict per run and an HTML report of curves");
  compare
      ->add_option("runs", compare_options.run_folders,
                   "Run folders holding metrics.jsonl; the first is the reference (at most 8)")
      ->required()
      ->expected(2, 8);
  compare->add_option("--output", compare_options.output, "The HTML file to write")
      ->capture_default_str();
  // What decides a verdict, for compare and convergence.
  const auto add_verdict_options = [](CLI::App* command, double& tolerance, int& smooth) {
    command
        ->add_option("--tolerance", tolerance,
                     "Percent a run's smoothed loss may differ from the reference's")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    command->add_option("--smooth", smooth, "Moving average over this many logged values (1: none)")
        ->capture_default_str()
        ->check(CLI::Range(1, 1000000));
  };
  add_verdict_options(compare, compare_options.tolerance, compare_options.smooth);

  fp8t::cli::ConvergenceOptions convergence_options;
  CLI::App* convergence = app.add_subcommand(
      "convergence",
      "Train a configuration in BF16 and then as configured (FP8), and compare the two runs");
  convergence->allow_extras();  // the configuration's arguments, as `train` takes them
  convergence
      ->add_option("--steps", convergence_options.steps,
                   "Steps of each run (default: the configuration's train_iters)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  add_verdict_options(convergence, convergence_options.tolerance, convergence_options.smooth);
  convergence->footer(
      "Other arguments: --config FILE and overrides, as for train. Writes runs OUTPUT_DIR/RUN-bf16 "
      "and RUN-fp8 and the report OUTPUT_DIR/RUN-convergence.html (docs/cli.md).");

  fp8t::cli::TokenizeOptions tokenize_options;
  CLI::App* tokenize = app.add_subcommand(
      "tokenize", "Turn text files into token shards, training the BPE tokenizer when asked");
  tokenize
      ->add_option("--tokenizer", tokenize_options.tokenizer_path,
                   "tiktoken vocabulary to use, or to write with --train-tokenizer")
      ->required();
  CLI::Option* train_tokenizer = tokenize->add_flag(
      "--train-tokenizer", tokenize_options.train_tokenizer,
      "Train the tokenizer on the training documents and save it to --tokenizer");
  tokenize
      ->add_option("--vocab-size", tokenize_options.vocab_size,
                   "With --train-tokenizer: vocabulary size, special tokens included")
      ->capture_default_str()
      ->needs(train_tokenizer)
      ->check(CLI::Range(265, 1 << 24));
  tokenize->add_option("--output", tokenize_options.output_dir, "Folder for the shards")
      ->required();
  tokenize
      ->add_option("--val-every", tokenize_options.val_every,
                   "Every N-th document goes to the validation shards (0: none)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  tokenize
      ->add_option("--shard-tokens", tokenize_options.shard_tokens,
                   "Tokens per shard at most (a longer document gets a shard of its own)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  tokenize->add_option("--separator", tokenize_options.separator,
                       "A line that separates documents (e.g. %); default: one document per file");
  tokenize->add_option("files", tokenize_options.inputs, "Text files")->required();

  fp8t::cli::DataCheckOptions data_check_options;
  CLI::App* data = app.add_subcommand("data", "Training data tools");
  data->require_subcommand(1);
  CLI::App* data_check = data->add_subcommand(
      "check", "Validate precomputed Flux shards: layout, dtypes, shapes, model widths, values");
  data_check
      ->add_option("--model", data_check_options.model,
                   "Flux preset whose input widths the shards must match, or none")
      ->capture_default_str()
      ->check(CLI::IsMember({"flux_tiny", "flux_small", "flux_535m", "flux_12b", "none"}));
  data_check->add_option("shards", data_check_options.paths, "Flux shard files (.safetensors)")
      ->required();

  CLI::App* tune = app.add_subcommand(
      "tune",
      "Autotune the GEMMs of a training configuration on this GPU and save the winners in the "
      "tuning cache, so that training starts tuned");
  tune->allow_extras();  // the configuration's arguments, as `train` takes them
  tune->footer(
      "Arguments: --config FILE, then overrides --key=value (as for train). See docs/gemm.md.");

  fp8t::cli::CheckpointVerifyOptions checkpoint_verify_options;
  CLI::App* checkpoint = app.add_subcommand("checkpoint", "Checkpoint tools");
  checkpoint->require_subcommand(1);
  CLI::App* checkpoint_verify = checkpoint->add_subcommand(
      "verify", "Check checkpoints' files against their manifests (size and CRC-32)");
  checkpoint_verify
      ->add_option("paths", checkpoint_verify_options.paths,
                   "Checkpoint folders, or run folders (every checkpoint in them)")
      ->required();

  try {
    app.parse(argc, argv);
    if (*doctor) return fp8t::cli::run_doctor(doctor_options);
    if (*model) return fp8t::cli::run_model_summary(model_options);
    if (*tokenize) return fp8t::cli::run_tokenize(tokenize_options);
    if (nproc_per_node > 0) {
      if (*train) fp8t::load_train_config(train->remaining());  // an error once, not per rank
      return fp8t::cli::run_local_ranks(nproc_per_node, without_nproc_per_node(argc, argv));
    }
    if (*train) return fp8t::cli::run_train(train->remaining());
    if (*sample) return fp8t::cli::run_sample(sample_options);
    if (*plot) return fp8t::cli::run_plot(plot_options);
    if (*compare) return fp8t::cli::run_compare(compare_options);
    if (*convergence) {
      convergence_options.config_args = convergence->remaining();
      return fp8t::cli::run_convergence(convergence_options);
    }
    if (*bench_gpt) return fp8t::cli::run_bench_gpt(bench_options);
    if (*bench_flux) return fp8t::cli::run_bench_flux(bench_flux_options);
    if (*tune) return fp8t::cli::run_tune({.config_args = tune->remaining()});
    if (*data_check) return fp8t::cli::run_data_check(data_check_options);
    if (*checkpoint_verify) return fp8t::cli::run_checkpoint_verify(checkpoint_verify_options);
    if (*config) {
      config_options.overrides = config->remaining();
      return fp8t::cli::run_config(config_options);
    }
    return fp8t::cli::run_check_numerics(numerics_options);
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      return app.exit(error);  // --help, --version
    }
    std::cerr << "fp8train: error: " << error.what() << "\nRun with --help for more information.\n";
    return fp8t::cli::kExitError;
  } catch (const std::exception& error) {
    // fp8t::Error and ConfigError carry complete messages (file, key, allowed values); anything
    // else (bad_alloc, ...) is reported the same way rather than aborting.
    std::cerr << "fp8train: error: " << error.what() << '\n';
    return fp8t::cli::kExitError;
  }
}
