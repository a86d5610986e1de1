#include "config/train_config.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <ios>
#include <map>
#include <optional>
#include <span>
#include <system_error>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "config/config_keys.h"
#include "core/error.h"
#include "data/flux_shapes.h"
#include "gemm/gemm_tuning.h"
#include "models/tensor_parallel.h"

namespace fp8t {

TrainConfig TrainConfig::defaults_for(std::string_view model) {
  TrainConfig config;
  config.model.name = std::string(model);
  if (!config.is_flux()) return config;
  // Primus' Flux 535M settings (MODELS.md §2); its warmup of 1000 steps belongs to runs much
  // longer than the default train_iters.
  config.optimizer.kind = OptimizerKind::AdamW;
  config.optimizer.lr = 1e-4;
  config.optimizer.min_lr = 1e-5;
  config.optimizer.weight_decay = 0.01;
  config.optimizer.adam_beta1 = 0.9;
  config.optimizer.adam_beta2 = 0.999;
  config.optimizer.adam_eps = 1e-8;
  config.optimizer.clip_grad = 1.0;
  config.schedule.lr_decay_style = optim::LrDecayStyle::Cosine;
  config.schedule.lr_warmup_iters = 100;
  return config;
}

FluxConfig TrainConfig::flux_config() const {
  if (!is_flux()) throw ConfigError(fmt::format("model: {} is not a Flux preset", model.name));
  return FluxConfig::preset(model.name);
}

GptConfig TrainConfig::gpt_config() const {
  GptConfig config;
  config.n_layer = model.depth;
  const int width = model.depth * model.aspect_ratio;
  config.n_embd = (width + model.head_dim - 1) / model.head_dim * model.head_dim;
  config.n_head = config.n_embd / model.head_dim;
  config.n_kv_head = config.n_head;
  config.vocab_size = model.vocab_size;
  config.sequence_len = model.sequence_len;
  config.window_pattern = model.window_pattern;
  return config;
}

PrecisionOptions TrainConfig::precision_options() const {
  PrecisionOptions options = fp8t::precision_options(fp8.scaling);
  options.lm_head_fp8 = fp8.lm_head_fp8;
  options.first_last_layers_bf16 = fp8.first_last_layers_bf16;
  options.num_layers_at_start_in_bf16 = fp8.num_layers_at_start_in_bf16;
  options.num_layers_at_end_in_bf16 = fp8.num_layers_at_end_in_bf16;
  return options;
}

optim::OptimizerSettings TrainConfig::optimizer_settings() const {
  optim::OptimizerSettings settings;
  settings.kind = optimizer.kind;
  settings.matrix_lr = optimizer.lr;
  settings.embedding_lr = optimizer.embedding_lr;
  settings.unembedding_lr = optimizer.unembedding_lr;
  settings.scalar_lr = optimizer.scalar_lr;
  settings.weight_decay = optimizer.weight_decay;
  settings.adamw = {.lr = optimizer.lr,
                    .beta1 = optimizer.adam_beta1,
                    .beta2 = optimizer.adam_beta2,
                    .eps = optimizer.adam_eps,
                    .weight_decay = optimizer.weight_decay};
  return settings;
}

optim::LrSchedule TrainConfig::lr_schedule() const {
  optim::LrSchedule result;
  result.style = schedule.lr_decay_style;
  result.total_iters = training.train_iters;
  result.warmup_iters = schedule.lr_warmup_iters;
  result.warmdown_ratio = schedule.lr_warmdown_ratio;
  result.final_lr_frac = schedule.final_lr_frac;
  result.min_lr_frac = optimizer.min_lr / optimizer.lr;
  return result;
}

int64_t TrainConfig::global_batch_size(int world_size) const {
  const int64_t per_step = training.micro_batch_size * data_parallel_size(world_size);
  return training.global_batch_size == 0 ? per_step : training.global_batch_size;
}

int64_t TrainConfig::grad_accum_steps(int world_size) const {
  return global_batch_size(world_size) /
         (training.micro_batch_size * data_parallel_size(world_size));
}

namespace {

constexpr std::string_view kCommandLine = "command line";

// A configuration being assembled, with where each key got its value ("file:line: key" or
// "command line: --flag"), so that checks of the whole can point at the setting at fault.
struct ConfigBuilder {
  TrainConfig config;  // starts from the model's defaults
  std::map<std::string, std::string, std::less<>> origins;
  std::string source = "defaults";  // the top-level file, or the command line

  std::string origin(std::string_view key) const {
    const auto found = origins.find(key);
    return found != origins.end() ? found->second : fmt::format("{}: {}", source, key);
  }
};

// "file:line" of a node, or "file" when the node was not read from text.
std::string location(std::string_view file, const YAML::Node& node) {
  const YAML::Mark mark = node.Mark();
  if (mark.is_null() || mark.line < 0) return std::string(file);
  return fmt::format("{}:{}", file, mark.line + 1);
}

std::string_view node_kind(const YAML::Node& node) {
  if (node.IsSequence()) return "a list";
  if (node.IsMap()) return "a mapping";
  return "nothing";
}

// Sets `key` from a YAML value; `where` is "file:line: key".
void set_from_yaml(TrainConfig& config, const ConfigKey& key, const YAML::Node& value,
                   const std::string& where) {
  std::string text;
  const auto scalars = [](const YAML::Node& list) {
    return std::all_of(list.begin(), list.end(),
                       [](const YAML::Node& item) { return item.IsScalar(); });
  };
  if (value.IsScalar()) {
    text = value.Scalar();
  } else if (value.IsSequence() && key.type == ValueType::List && scalars(value)) {
    for (const YAML::Node& item : value)
      text += (text.empty() ? "" : ",") + item.Scalar();
  } else if (!(value.IsNull() && key.type == ValueType::String)) {  // `data_path:` is empty
    throw ConfigError(
        fmt::format("{}: expected {}, found {}", where, key.expected, node_kind(value)));
  }
  if (std::optional<std::string> problem = key.set(config, text)) {
    throw ConfigError(fmt::format("{}: {}", where, *problem));
  }
}

std::optional<ConfigSection> section_named(std::string_view name) {
  for (ConfigSection section : kConfigSections) {
    if (section_name(section) == name) return section;
  }
  return std::nullopt;
}

std::string key_name(const YAML::Node& key_node, std::string_view file) {
  if (!key_node.IsScalar()) {
    throw ConfigError(fmt::format("{}: expected a key name, found {}", location(file, key_node),
                                  node_kind(key_node)));
  }
  return key_node.Scalar();
}

// The entries of a mapping that set keys, with the section they sit in (none at the top level).
// A top-level entry named like a section is the section when its value is a mapping; `fp8` and
// `optimizer` are also keys, so a scalar there is the key (and for other sections an error).
struct KeyEntry {
  YAML::Node key;
  YAML::Node value;
  std::optional<ConfigSection> section;
};

std::vector<KeyEntry> key_entries(const YAML::Node& root, std::string_view file) {
  std::vector<KeyEntry> entries;
  for (const auto& entry : root) {
    const std::string name = key_name(entry.first, file);
    const std::optional<ConfigSection> section = section_named(name);
    if (section && entry.second.IsMap()) {
      for (const auto& inner : entry.second)
        entries.push_back({inner.first, inner.second, section});
    } else {
      entries.push_back({entry.first, entry.second, std::nullopt});
    }
  }
  return entries;
}

// Looks the entry's key up and checks its section; "file:line: key" prefixes the errors.
const ConfigKey& known_key(const KeyEntry& entry, std::string_view file, std::string_view advice) {
  const std::string name = key_name(entry.key, file);
  const std::string where = fmt::format("{}: {}", location(file, entry.key), name);
  const ConfigKey* key = find_config_key(name);
  if (key == nullptr && section_named(name) && !entry.section) {
    throw ConfigError(fmt::format("{}: expected a mapping of the {} section's keys, found {}",
                                  where, name,
                                  entry.value.IsScalar() ? "'" + entry.value.Scalar() + "'"
                                                         : std::string(node_kind(entry.value))));
  }
  if (key == nullptr) {
    throw ConfigError(
        fmt::format("{}: unknown key{}{}", where, advice.empty() ? "" : "; ", advice));
  }
  if (entry.section && key->section != *entry.section) {
    throw ConfigError(fmt::format("{}: belongs in the {} section, not in {}", where,
                                  section_name(key->section), section_name(*entry.section)));
  }
  return *key;
}

// yaml-cpp's errors, as configuration errors that name the file. `included_by` is "file:line:
// base" when the file is another's base.
YAML::Node read_yaml_file(const std::string& path, std::string_view included_by) {
  const auto cannot_read = [&](std::string_view reason) {
    if (included_by.empty()) {
      return ConfigError(fmt::format("{}: cannot read the config file: {}", path, reason));
    }
    return ConfigError(fmt::format("{}: cannot read '{}': {}", included_by, path, reason));
  };
  // A folder opens, and yaml-cpp leaks its read buffer when reading it then fails.
  std::error_code ignored;  // a path that cannot be examined fails below, with the reason
  if (std::filesystem::is_directory(path, ignored)) {
    throw cannot_read("expected a file, found a folder");
  }
  try {
    return YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    // yaml-cpp does not say why the file could not be opened; access() does.
    throw cannot_read(::access(path.c_str(), R_OK) != 0 ? std::strerror(errno)
                                                        : "cannot be opened");
  } catch (const std::ios_base::failure& error) {  // opened, but reading failed
    throw cannot_read(error.what());
  } catch (const YAML::Exception& error) {
    if (error.mark.is_null()) throw ConfigError(fmt::format("{}: {}", path, error.msg));
    throw ConfigError(fmt::format("{}:{}:{}: invalid YAML: {}", path, error.mark.line + 1,
                                  error.mark.column + 1, error.msg));
  }
}

constexpr std::string_view kBaseKey = "base";

// A config file's canonical path, to find a cycle of bases. A path the system cannot resolve
// (a name too long, say) is an error that begins with `what` and ends with the system's reason.
std::filesystem::path canonical_config_path(const std::string& path, std::string_view what) {
  std::error_code error;
  std::filesystem::path canonical = std::filesystem::weakly_canonical(path, error);
  if (error) throw ConfigError(fmt::format("{}: {}", what, error.message()));
  return canonical;
}

// Loads `path` into the builder: its base first, then its own keys. `chain` holds the files
// that include this one, to catch a cycle.
void load_file(ConfigBuilder& builder, const std::string& path, std::string_view included_by,
               std::vector<std::filesystem::path>& chain) {
  const YAML::Node root = read_yaml_file(path, included_by);
  if (!root || root.IsNull()) return;
  if (!root.IsMap()) {
    throw ConfigError(
        fmt::format("{}: expected a mapping of keys to values at the top level", path));
  }
  chain.push_back(
      canonical_config_path(path, fmt::format("{}: cannot read the config file", path)));
  for (const auto& entry : root) {
    if (key_name(entry.first, path) != kBaseKey) continue;
    const std::string where = fmt::format("{}: base", location(path, entry.first));
    if (!entry.second.IsScalar() || entry.second.Scalar().empty()) {
      throw ConfigError(
          fmt::format("{}: expected a file name, found {}", where, node_kind(entry.second)));
    }
    const std::string base = (std::filesystem::path(path).parent_path() / entry.second.Scalar())
                                 .lexically_normal()
                                 .string();
    const std::filesystem::path canonical =
        canonical_config_path(base, fmt::format("{}: cannot read '{}'", where, base));
    if (std::find(chain.begin(), chain.end(), canonical) != chain.end()) {
      throw ConfigError(
          fmt::format("{}: '{}' is already being loaded: the bases form a cycle", where, base));
    }
    load_file(builder, base, where, chain);
  }
  std::map<std::string, int64_t, std::less<>> lines;  // a key given twice in one file is an error
  for (const KeyEntry& entry : key_entries(root, path)) {
    if (!entry.section && key_name(entry.key, path) == kBaseKey) continue;
    const ConfigKey& key = known_key(entry, path, unknown_key_advice(entry.key.Scalar()));
    const std::string where = fmt::format("{}: {}", location(path, entry.key), key.name);
    const int64_t line = entry.key.Mark().line + 1;
    if (const auto [previous, inserted] = lines.emplace(key.name, line); !inserted) {
      throw ConfigError(fmt::format("{}: given twice (also at line {})", where, previous->second));
    }
    set_from_yaml(builder.config, key, entry.value, where);
    builder.origins[std::string(key.name)] = where;
  }
  chain.pop_back();
}

const FlagAlias* find_alias(std::string_view flag) {
  for (const FlagAlias& alias : flag_aliases()) {
    if (alias.flag == flag) return &alias;
  }
  return nullptr;
}

// Applies `--key=value`, `--key value` and `--flag` arguments in order; later ones win.
void apply_overrides(ConfigBuilder& builder, std::span<const std::string> args) {
  struct TokenBatch {
    int64_t tokens;
    std::string where;
  };
  std::optional<TokenBatch> token_batch;  // converted once sequence_len is final
  std::string previous_bare_flag;         // for the hint on `--fp8 e4m3`
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (!arg.starts_with("--") || arg.size() == 2) {
      std::string hint;
      if (!previous_bare_flag.empty()) {
        hint = fmt::format(" ({} takes a value only with '=': {}={})", previous_bare_flag,
                           previous_bare_flag, arg);
      }
      throw ConfigError(fmt::format("{}: '{}': expected --key=value, --key value or --flag{}",
                                    kCommandLine, arg, hint));
    }
    const size_t equals = arg.find('=');
    const std::string flag = arg.substr(0, equals);
    std::string name = flag.substr(2);
    std::replace(name.begin(), name.end(), '-', '_');
    const std::string where = fmt::format("{}: {}", kCommandLine, flag);
    const FlagAlias* alias = find_alias(name);
    const ConfigKey* key = find_config_key(alias != nullptr ? alias->key : name);
    if (key == nullptr) {
      const std::string advice = unknown_key_advice(name);
      throw ConfigError(
          fmt::format("{}: unknown key{}{}", where, advice.empty() ? "" : "; ", advice));
    }
    const bool in_tokens = alias != nullptr && alias->in_tokens;
    std::string value;
    previous_bare_flag.clear();
    if (equals != std::string::npos) {
      value = arg.substr(equals + 1);
    } else if (!key->bare_flag_value.empty() && !in_tokens) {
      value = key->bare_flag_value;
      previous_bare_flag = flag;
    } else if (i + 1 < args.size() && !args[i + 1].starts_with("--")) {
      value = args[++i];
    } else {
      throw ConfigError(fmt::format("{}: expects a value: {}", where, key->expected));
    }
    if (in_tokens) {
      const std::optional<int64_t> tokens = parse_integer(value);
      if (!tokens || *tokens < 1) {
        throw ConfigError(
            fmt::format("{}: expected a number of tokens >= 1, found '{}'", where, value));
      }
      token_batch = TokenBatch{*tokens, where};
      continue;
    }
    if (std::optional<std::string> problem = key->set(builder.config, value)) {
      throw ConfigError(fmt::format("{}: {}", where, *problem));
    }
    builder.origins[std::string(key->name)] = where;
    if (key->name == "global_batch_size") token_batch.reset();
  }
  if (token_batch) {
    if (builder.config.is_flux()) {
      throw ConfigError(
          fmt::format("{}: counts the GPT's tokens; for {} set global_batch_size "
                      "(pictures per step)",
                      token_batch->where, builder.config.model.name));
    }
    const int64_t sequence_len = builder.config.model.sequence_len;
    if (token_batch->tokens % sequence_len != 0) {
      throw ConfigError(
          fmt::format("{}: {} tokens is not a whole number of sequences of sequence_len {}",
                      token_batch->where, token_batch->tokens, sequence_len));
    }
    builder.config.training.global_batch_size = token_batch->tokens / sequence_len;
    builder.origins["global_batch_size"] = token_batch->where;
  }
}

// A key of another model is an error when it was given (`given`) or differs from its default.
void check_model_keys(const TrainConfig& config, const std::function<bool(std::string_view)>& given,
                      const std::function<std::string(std::string_view)>& origin) {
  const TrainConfig defaults = TrainConfig::defaults_for(config.model.name);
  for (const ConfigKey& key : config_keys()) {
    if (key.applies_to(config) || (!given(key.name) && key.get(config) == key.get(defaults))) {
      continue;
    }
    throw ConfigError(fmt::format("{}: applies to {} only, not to model {}", origin(key.name),
                                  key.models == ModelScope::Gpt ? "the GPT" : "Flux",
                                  config.model.name));
  }
}

// Training on the built-in shapes data: its image tokens and picture size.
void check_flux_shapes_data(const TrainConfig& config,
                            const std::function<std::string(std::string_view)>& origin,
                            std::string_view source) {
  const int64_t token_features = int64_t{data::kFluxShapesLatentChannels} * 4;
  if (config.flux_config().in_channels != token_features) {
    throw ConfigError(fmt::format(
        "{}: {} takes image tokens of {} features, but the built-in shapes data makes {} ({} "
        "channels in 2×2 patches); flux_tiny trains on it",
        origin("model"), config.model.name, config.flux_config().in_channels, token_features,
        data::kFluxShapesLatentChannels));
  }
  if (!config.data.flux_val_shards.empty()) {
    throw ConfigError(
        fmt::format("{}: validation shards go with training shards; flux_shards is "
                    "empty (the built-in shapes data has its own validation)",
                    origin("flux_val_shards")));
  }
  // The data's own checks name their fields; the source says where.
  try {
    data::FluxShapesOptions{.image_size = config.data.image_size}.validate();
  } catch (const ConfigError& error) {
    throw ConfigError(fmt::format("{}: {}", source, error.what()));
  }
}

// Training on shards: what only the built-in data can do is refused (the shards' own checks
// need the files, and come when training starts).
void check_flux_shards_data(const TrainConfig& config,
                            const std::function<std::string(std::string_view)>& origin) {
  if (!config.run.sample_prompts.empty()) {
    throw ConfigError(fmt::format(
        "{}: the sample grids need the built-in shapes data (prompts are encoded with its "
        "words), but flux_shards is set; expected \"\", found \"{}\"",
        origin("sample_prompts"), config.run.sample_prompts));
  }
  const int default_image_size = DataSection{}.image_size;
  if (config.data.image_size != default_image_size) {
    throw ConfigError(fmt::format(
        "{}: sizes the built-in shapes pictures; with flux_shards the shards' latents set the "
        "size (expected the default {}, found {})",
        origin("image_size"), default_image_size, config.data.image_size));
  }
}

// What Flux needs of the settings it shares with the GPT, and of its own.
void check_flux(const TrainConfig& config,
                const std::function<std::string(std::string_view)>& origin,
                std::string_view source) {
  if (config.optimizer.kind != OptimizerKind::AdamW) {
    throw ConfigError(
        fmt::format("{}: Flux trains with adamw (Muon is set up for the GPT's parameters)",
                    origin("optimizer")));
  }
  if (config.data.flux_shards.empty()) {
    check_flux_shapes_data(config, origin, source);
  } else {
    check_flux_shards_data(config, origin);
  }
  // The objective's own checks name their fields; the source says where.
  try {
    config.flux.validate();
  } catch (const ConfigError& error) {
    throw ConfigError(fmt::format("{}: {}", source, error.what()));
  }
}

// The NaN guard's remedies against the precision, and the injection's parameter.
void check_nan_guard(const TrainConfig& config,
                     const std::function<std::string(std::string_view)>& origin) {
  const std::vector<NanRemedy>& remedies = config.run.nan_remedy;
  const Fp8Config& fp8 = config.fp8.scaling;
  const auto has = [&](NanRemedy remedy) {
    return std::find(remedies.begin(), remedies.end(), remedy) != remedies.end();
  };
  if (has(NanRemedy::Fp8Margin) &&
      (fp8.mode == Fp8Mode::None || fp8.recipe != ScalingRecipe::Delayed)) {
    throw ConfigError(fmt::format(
        "{}: fp8_margin needs fp8_recipe: delayed (the only recipe with a margin), found {}",
        origin("nan_remedy"),
        fp8.mode == Fp8Mode::None ? std::string("fp8: none")
                                  : fmt::format("fp8_recipe: {}", recipe_name(fp8.recipe))));
  }
  if (has(NanRemedy::Bf16Layer) && fp8.mode == Fp8Mode::None) {
    throw ConfigError(fmt::format(
        "{}: bf16_layer needs fp8 other than none (with fp8: none every linear is BF16 already)",
        origin("nan_remedy")));
  }
  if (config.run.nan_inject_steps.empty()) return;
  const std::string& name = config.run.nan_inject_parameter;
  if (find_parameter(gpt_parameters(config.gpt_config()), name) == nullptr) {
    throw ConfigError(
        fmt::format("{}: nan_inject_steps need a parameter of this model (e.g. "
                    "transformer.h.0.mlp.c_fc.weight), found '{}'",
                    origin("nan_inject_parameter"), name));
  }
}

// Tensor parallelism splits the blocks evenly (the trainer checks the job's ranks: a
// configuration also serves one process, to sample or compare).
void check_tensor_parallel(const TrainConfig& config,
                           const std::function<std::string(std::string_view)>& origin) {
  const int size = config.run.tensor_model_parallel_size;
  if (config.run.sequence_parallel) {
    const std::string sequence = origin("sequence_parallel");
    try {
      // A Flux model's token counts come with its data: the model checks that they split.
      if (config.is_flux()) {
        check_sequence_parallel_group(size);
      } else {
        check_sequence_parallel(size, config.training.micro_batch_size, config.model.sequence_len);
      }
    } catch (const ConfigError& error) {  // its message names the key, without the origin
      std::string message = error.what();
      constexpr std::string_view kKey = "sequence_parallel: ";
      if (message.starts_with(kKey)) message.erase(0, kKey.size());
      throw ConfigError(fmt::format("{}: {}", sequence, message));
    }
  }
  if (size == 1) return;
  const std::string key = origin("tensor_model_parallel_size");
  if (config.fp8.dot_product_attention) {
    throw ConfigError(fmt::format(
        "{}: {} does not run with fp8_dot_product_attention: true (its scales would differ "
        "between the ranks' heads)",
        key, size));
  }
  try {
    if (config.is_flux()) {
      check_flux_tensor_parallel(config.flux_config(), size);
    } else {
      check_tensor_parallel(config.gpt_config(), size);
    }
  } catch (const ConfigError& error) {  // its message names the key, without the origin
    std::string message = error.what();
    constexpr std::string_view kKey = "tensor_model_parallel_size: ";
    if (message.starts_with(kKey)) message.erase(0, kKey.size());
    throw ConfigError(fmt::format("{}: {}", key, message));
  }
}

// The checks of validate(); `origin(key)` prefixes a message about that key, `source` one about
// several.
void check_whole(const TrainConfig& config, int world_size,
                 const std::function<std::string(std::string_view)>& origin,
                 std::string_view source) {
  FP8T_CHECK(world_size >= 1, "expected a world size >= 1, found {}", world_size);
  check_tensor_parallel(config, origin);
  const TrainingSection& training = config.training;
  const int replicas = config.data_parallel_size(world_size);
  const int64_t per_step = training.micro_batch_size * replicas;
  if (training.global_batch_size % per_step != 0) {
    throw ConfigError(fmt::format(
        "{}: must be a multiple of micro_batch_size × data-parallel replicas ({} × {} = {}), "
        "found {}",
        origin("global_batch_size"), training.micro_batch_size, replicas, per_step,
        training.global_batch_size));
  }
  if (config.run.resume_from_step >= 0 && config.run.resume == ResumeChoice::Auto) {
    throw ConfigError(
        fmt::format("{}: resume: auto picks the checkpoint itself; set one of the "
                    "two, found resume_from_step {}",
                    origin("resume_from_step"), config.run.resume_from_step));
  }
  if (config.run.resume_from_step > training.train_iters) {
    throw ConfigError(fmt::format("{}: must be at most train_iters ({}), found {}",
                                  origin("resume_from_step"), training.train_iters,
                                  config.run.resume_from_step));
  }
  gemm::parse_gemm_backends(config.run.gemm_backend, origin("gemm_backend"));
  if (config.optimizer.min_lr > config.optimizer.lr) {
    throw ConfigError(fmt::format("{}: must be at most lr ({}), found {}", origin("min_lr"),
                                  config.optimizer.lr, config.optimizer.min_lr));
  }
  if (config.is_flux()) {
    check_flux(config, origin, source);
  } else if (config.model.head_dim % 2 != 0) {
    throw ConfigError(fmt::format("{}: must be even (rotary), found {}", origin("head_dim"),
                                  config.model.head_dim));
  }
  // The GPT's and the schedule's own checks name their fields; the source says where.
  try {
    if (!config.is_flux()) config.gpt_config().validate();
    config.lr_schedule().validate();
  } catch (const ConfigError& error) {
    throw ConfigError(fmt::format("{}: {}", source, error.what()));
  }
  validate(config.fp8.scaling, source);
  if (!config.is_flux()) check_nan_guard(config, origin);
  check_fp8_weight_transposes(config.fp8.weight_transposes, config.fp8.scaling.recipe,
                              origin("fp8_weight_transposes"));
  if (config.fp8.dot_product_attention && config.fp8.scaling.mode == Fp8Mode::None) {
    throw ConfigError(
        fmt::format("{}: true needs fp8 other than none", origin("fp8_dot_product_attention")));
  }
}

// The defaults of `defaults`' model, then the file (with its bases), then the overrides.
ConfigBuilder assemble(const std::optional<std::string>& config_path,
                       const std::vector<std::string>& overrides, const TrainConfig& defaults) {
  ConfigBuilder builder;
  builder.config = defaults;
  if (config_path) {
    std::vector<std::filesystem::path> chain;
    load_file(builder, *config_path, {}, chain);
    builder.source = *config_path;
  } else if (!overrides.empty()) {
    builder.source = kCommandLine;
  }
  apply_overrides(builder, overrides);
  return builder;
}

}  // namespace

TrainConfig load_train_config(const std::vector<std::string>& args, int world_size) {
  std::optional<std::string> config_path;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    std::optional<std::string> path;
    if (args[i] == "--config") {
      if (i + 1 == args.size()) {
        throw ConfigError(fmt::format("{}: --config: expects a file name", kCommandLine));
      }
      path = args[++i];
    } else if (args[i].starts_with("--config=")) {
      path = args[i].substr(std::string_view("--config=").size());
    } else {
      overrides.push_back(args[i]);
      continue;
    }
    if (config_path) {
      throw ConfigError(fmt::format("{}: --config: given twice ('{}' and '{}')", kCommandLine,
                                    *config_path, *path));
    }
    config_path = path;
  }
  // The model is known once everything is read; a model with defaults of its own is read again
  // on top of them, so that every setting given wins over them wherever it stands.
  ConfigBuilder builder = assemble(config_path, overrides, TrainConfig{});
  if (builder.config.is_flux()) {
    builder =
        assemble(config_path, overrides, TrainConfig::defaults_for(builder.config.model.name));
  }
  const auto origin = [&](std::string_view key) { return builder.origin(key); };
  check_model_keys(
      builder.config, [&](std::string_view key) { return builder.origins.contains(key); }, origin);
  check_whole(builder.config, world_size, origin, builder.source);
  return builder.config;
}

void validate(const TrainConfig& config, int world_size) {
  const auto origin = [](std::string_view key) { return std::string(key); };
  check_model_keys(
      config, [](std::string_view) { return false; }, origin);
  check_whole(config, world_size, origin, "config");
}

std::string to_yaml(const TrainConfig& config) {
  std::string text =
      "# The resolved fp8train configuration: every key of its model. Load it with --config; "
      "docs/configuration.md\n# explains each.\n";
  for (ConfigSection section : kConfigSections) {
    std::string keys;
    for (const ConfigKey& key : config_keys()) {
      if (key.section == section && key.applies_to(config)) {
        keys += fmt::format("  {}: {}\n", key.name, key.get(config));
      }
    }
    // A section without keys of this model would read back as an empty mapping.
    if (!keys.empty()) text += fmt::format("{}:\n{}", section_name(section), keys);
  }
  return text;
}

void save_train_config(const TrainConfig& config, const std::filesystem::path& file) {
  std::ofstream out(file);
  out << to_yaml(config);
  out.close();
  if (!out) {
    throw Error(
        fmt::format("{}: cannot write the configuration: {}", file.string(), std::strerror(errno)));
  }
}

Fp8Config fp8_config_from_yaml(const YAML::Node& root, std::string_view source) {
  TrainConfig config;
  config.fp8.scaling = Fp8Config{};  // this reader's defaults: hybrid, as the fp8 tools check
  if (!root || root.IsNull()) return config.fp8.scaling;
  if (!root.IsMap()) {
    throw ConfigError(
        fmt::format("{}: expected a mapping of keys to values at the top level", source));
  }
  std::string fp8_keys;
  for (const ConfigKey& key : config_keys()) {
    if (key.name.starts_with("fp8"))
      fp8_keys += fmt::format("{}{}", fp8_keys.empty() ? "" : ", ", key.name);
  }
  for (const KeyEntry& entry : key_entries(root, source)) {
    const std::string name = key_name(entry.key, source);
    if (!entry.section && !name.starts_with("fp8")) continue;  // other owners' keys
    if (entry.section && entry.section != ConfigSection::Fp8) continue;
    // A typo's advice is a question ("did you mean 'fp8_recipe'?"); the list follows it.
    std::string advice = unknown_key_advice(name);
    advice += fmt::format("{}fp8 keys are: {}", advice.empty() ? "" : " ", fp8_keys);
    const ConfigKey& key = known_key(entry, source, advice);
    set_from_yaml(config, key, entry.value,
                  fmt::format("{}: {}", location(source, entry.key), name));
  }
  validate(config.fp8.scaling, source);
  return config.fp8.scaling;
}

}  // namespace fp8t
