// The one table of configuration keys. The YAML loader, the command-line overrides, the
// resolved-config writer, the fp8 key reader of numerics/scaling.h and the generator of
// docs/configuration.md all go through it, so names, types, ranges, defaults and messages agree.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "config/train_config.h"

namespace fp8t {

enum class ConfigSection : uint8_t { Run, Model, Data, Training, Optimizer, Schedule, Fp8, Flux };

inline constexpr ConfigSection kConfigSections[] = {
    ConfigSection::Run,       ConfigSection::Model,    ConfigSection::Data, ConfigSection::Training,
    ConfigSection::Optimizer, ConfigSection::Schedule, ConfigSection::Fp8,  ConfigSection::Flux};

std::string_view section_name(ConfigSection section);
// One line for the docs: what the section is about.
std::string_view section_summary(ConfigSection section);

// List: YAML's flow form ("[a, b]", as the writer writes it) or "a,b"; "[]" is empty.
enum class ValueType : uint8_t { Integer, Number, Boolean, String, Choice, List };

std::string_view value_type_name(ValueType type);

// Which models a key applies to. Giving a key of another model is an error, and the resolved
// config.yaml leaves such keys out.
enum class ModelScope : uint8_t { All, Gpt, Flux };

// "all", "gpt", "flux": the docs' column.
std::string_view model_scope_name(ModelScope scope);

struct ConfigKey {
  std::string_view name;
  ConfigSection section;
  ValueType type;
  // What a value must be, completing "expected ...": "an integer >= 1", "one of none, e4m3,
  // hybrid", "true or false". Messages and the docs' "allowed" column use it.
  std::string expected;
  std::string_view meaning;  // one or two sentences for the docs' table
  std::string_view details;  // markdown paragraphs for the docs; empty for most keys
  // What `--key` alone means on the command line ("true" for booleans, "hybrid" for --fp8);
  // empty when the flag needs a value.
  std::string_view bare_flag_value;
  // Parses `text` into the config; returns what is wrong with it (without the key's name), or
  // nothing.
  std::function<std::optional<std::string>(TrainConfig&, std::string_view text)> set;
  // The value as the YAML writer writes it; of TrainConfig::defaults_for(model), the docs'
  // default.
  std::function<std::string(const TrainConfig&)> get;
  ModelScope models = ModelScope::All;

  bool applies_to(const TrainConfig& config) const;
};

// Every key, in the order of the docs and the writer (by section).
std::span<const ConfigKey> config_keys();
const ConfigKey* find_config_key(std::string_view name);

// nanochat's command-line names for keys that have another name here.
struct FlagAlias {
  std::string_view flag;  // with underscores, as keys are matched
  std::string_view key;
  // The flag counts tokens where the key counts sequences: key = value / sequence_len.
  bool in_tokens = false;
};
std::span<const FlagAlias> flag_aliases();

// A whole decimal integer with an optional sign, or nothing.
std::optional<int64_t> parse_integer(std::string_view text);

// What to tell someone who wrote `name`, which is not a key: "did you mean 'lr'?", the key a
// nanochat name stands for, or how a nanochat feature is done here. Empty when nothing fits.
std::string unknown_key_advice(std::string_view name);

}  // namespace fp8t
