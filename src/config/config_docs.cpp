// docs/configuration.md, generated from the key table so that the docs and the parser agree.
#include <algorithm>
#include <string>

#include <fmt/format.h>

#include "config/config_keys.h"
#include "config/train_config.h"

namespace fp8t {

namespace {

constexpr std::string_view kIntroduction = R"(# Configuration

<!-- Generated from the key table in src/config/config_keys.cpp by scripts/gen_config_docs.sh
     (fp8train config --markdown). Edit the table, not this file: a test fails when they differ. -->

A training run takes its settings from a YAML file and from the command line. `fp8train config`
prints the result, every key with its value, as YAML:

```
fp8train config --config configs/d20_fp8.yaml --device-batch-size=16 --run=d20-fp8
```

A training run prints the same and saves it as `config.yaml` in its run folder
(`output_dir/run`); `--config` reads that file back to the same configuration.
`fp8train config --markdown` prints this page.

## Files

Keys may be written flat at the top level, as Primus and Megatron do, or inside the section
mappings `run:`, `model:`, `data:`, `training:`, `optimizer:`, `schedule:`, `fp8:` and
`flux:`; the two forms mix. `run`, `model`, `fp8` and `optimizer` are keys as well as sections:
a scalar (`fp8: hybrid`) is the key, a mapping is the section. A key inside the wrong section
is an error. Every key is optional; a key given twice in one file is an error.

The key `model` picks the GPT (default) or a Flux preset. The tables' `models` column says which
models a key applies to; giving a key of the other model is an error. Where the models'
defaults differ, the table gives both: Flux takes Primus' AdamW settings (see
[`model`](#model)).

```yaml
base: d20.yaml          # d20.yaml first, then the keys below
run: d20-fp8
fp8:
  fp8: hybrid
  fp8_recipe: tensorwise
micro_batch_size: 16
```

`base: FILE`, relative to the file that names it, loads another file first, whose keys this
file overrides; a base may have a base of its own, and a cycle is an error.

Presets in `configs/`: `tiny.yaml` (the CPU demo: depth 4, 300 steps on the built-in corpus),
`d12.yaml`, `d20.yaml`, `d24.yaml` (nanochat's models and settings, BF16) and `d12_fp8.yaml`,
`d20_fp8.yaml`, `d24_fp8.yaml` (the same with `fp8: hybrid`, `fp8_recipe: tensorwise`, as
nanochat's `--fp8`); `flux_tiny.yaml` (Flux on the built-in shapes pictures, on the CPU).

## Command line

Every key can be set on the command line; settings apply in this order, later ones winning:
the defaults, the `base:` files, the `--config` file, then the command line from left to right.

| form | example |
|---|---|
| `--key=value` | `--micro_batch_size=4` |
| `--key value` | `--micro-batch-size 4` (dashes and underscores are the same) |
| `--flag` | a boolean key alone is `true`: `--first-last-layers-bf16`; `--flag=false` turns it off |
| `--fp8` | alone, `hybrid` (nanochat's `--fp8`); other values need `=`: `--fp8=e4m3` |
| `--config FILE` | the YAML file, read before every override wherever it stands |

nanochat's flag names work too:

| nanochat flag | key |
|---|---|
)";

constexpr std::string_view kCommandLineNotes = R"(
`--total-batch-size` counts tokens: it sets `global_batch_size` to the tokens divided by
`sequence_len` (after every other override), and a remainder is an error. nanochat's `--run`,
`--depth`, `--aspect-ratio`, `--head-dim`, `--window-pattern`, `--embedding-lr`,
`--unembedding-lr`, `--scalar-lr`, `--weight-decay`, `--final-lr-frac`, `--resume-from-step`,
`--save-every`, `--eval-every`, `--fp8` and `--fp8-recipe` are keys of the same name.
nanochat's `-1 = auto` values are not: `--num-iterations` and `--total-batch-size` must be given
as numbers, and `--target-param-data-ratio` and `--target-flops` are not supported
(`train_iters` is always explicit). nanochat's `--fp8-recipe=rowwise` is not implemented.

## Errors

A configuration error stops the program with exit code 2 and one line naming the file and the
line (or the command-line flag), the key, and what is allowed:

```
fp8train: error: run.yaml:2: fp8_recipe: unknown value 'blockwise2'; allowed: delayed, tensorwise, blockwise, mxfp8
fp8train: error: run.yaml:3: micro_batch_sise: unknown key; did you mean 'micro_batch_size'?
fp8train: error: run.yaml:5: lr: belongs in the optimizer section, not in model
fp8train: error: run.yaml:2: depth: expected an integer in [1, 1000], found 'deep'
fp8train: error: run.yaml:2: fp8_amax_history_len: must be at least 1, found 0
fp8train: error: run.yaml:1: base: cannot read 'nothere.yaml': No such file or directory
fp8train: error: command line: --lr: expected a finite number > 0, found 'x'
fp8train: error: run.yaml:4: global_batch_size: must be a multiple of micro_batch_size × data-parallel replicas (32 × 1 = 32), found 48
fp8train: error: run.yaml: fp8_power_of_2_scales: mxfp8 scales are E8M0 powers of two; false is not possible
fp8train: error: flux.yaml:3: depth: applies to the GPT only, not to model flux_tiny
fp8train: error: nothere.yaml: cannot read the config file: No such file or directory
fp8train: error: broken.yaml:2:2: invalid YAML: end of sequence flow not found
```

A check of several keys together names the place that set the key at fault; a key left at its
default is named with the top-level file.

## Keys
)";

// "`a`" for a key name, linked to its details when it has them.
std::string key_cell(const ConfigKey& key) {
  if (key.details.empty()) return fmt::format("`{}`", key.name);
  return fmt::format("[`{}`](#{})", key.name, key.name);
}

// The default of a key; both models' where they differ.
std::string default_cell(const ConfigKey& key) {
  const TrainConfig gpt = TrainConfig::defaults_for(kGptModel);
  const TrainConfig flux = TrainConfig::defaults_for(kFluxPresets[0]);
  // `model` picks which defaults apply; its own is the GPT.
  if (key.models == ModelScope::All && key.name != "model" && key.get(gpt) != key.get(flux)) {
    return fmt::format("`{}`; flux: `{}`", key.get(gpt), key.get(flux));
  }
  return fmt::format("`{}`", key.get(key.models == ModelScope::Flux ? flux : gpt));
}

}  // namespace

std::string configuration_markdown() {
  std::string text(kIntroduction);
  for (const FlagAlias& alias : flag_aliases()) {
    std::string flag(alias.flag);
    std::replace(flag.begin(), flag.end(), '_', '-');
    text += fmt::format("| `--{}` | `{}`{} |\n", flag, alias.key,
                        alias.in_tokens ? " (given in tokens)" : "");
  }
  text += kCommandLineNotes;
  for (ConfigSection section : kConfigSections) {
    text += fmt::format("\n### Section `{}`\n\n{}\n\n", section_name(section),
                        section_summary(section));
    text += "| key | models | type | default | allowed | meaning |\n|---|---|---|---|---|---|\n";
    for (const ConfigKey& key : config_keys()) {
      if (key.section != section) continue;
      text += fmt::format("| {} | {} | {} | {} | {} | {} |\n", key_cell(key),
                          model_scope_name(key.models), value_type_name(key.type),
                          default_cell(key), key.expected, key.meaning);
    }
  }
  text += "\n## Key details\n";
  for (const ConfigKey& key : config_keys()) {
    if (!key.details.empty()) text += fmt::format("\n### `{}`\n\n{}\n", key.name, key.details);
  }
  return text;
}

}  // namespace fp8t
