#include "config/config_keys.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <iterator>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace fp8t {

namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

template <typename Enum>
using Choices = std::span<const std::pair<std::string_view, Enum>>;

constexpr std::pair<std::string_view, DeviceChoice> kDevices[] = {
    {"auto", DeviceChoice::Auto}, {"cpu", DeviceChoice::Cpu}, {"cuda", DeviceChoice::Cuda}};
constexpr std::pair<std::string_view, ResumeChoice> kResumeChoices[] = {
    {"never", ResumeChoice::Never}, {"auto", ResumeChoice::Auto}};
constexpr std::pair<std::string_view, Tracker> kTrackers[] = {
    {"jsonl", Tracker::Jsonl}, {"tensorboard", Tracker::Tensorboard}, {"mlflow", Tracker::Mlflow}};
constexpr std::pair<std::string_view, NanRemedy> kNanRemedies[] = {
    {"lower_lr", NanRemedy::LowerLr},
    {"fp8_margin", NanRemedy::Fp8Margin},
    {"bf16_layer", NanRemedy::Bf16Layer}};
constexpr std::pair<std::string_view, OptimizerKind> kOptimizers[] = {
    {"muon", OptimizerKind::Muon}, {"adamw", OptimizerKind::AdamW}};
constexpr std::pair<std::string_view, optim::LrDecayStyle> kDecayStyles[] = {
    {"nanochat", optim::LrDecayStyle::Nanochat},
    {"cosine", optim::LrDecayStyle::Cosine},
    {"constant", optim::LrDecayStyle::Constant}};
constexpr std::pair<std::string_view, RecomputeGranularity> kRecomputeGranularities[] = {
    {"none", RecomputeGranularity::None},
    {"selective", RecomputeGranularity::Selective},
    {"full", RecomputeGranularity::Full}};
constexpr std::pair<std::string_view, RecomputeMethod> kRecomputeMethods[] = {
    {"uniform", RecomputeMethod::Uniform}, {"block", RecomputeMethod::Block}};
constexpr std::pair<std::string_view, SigmaSampler> kSigmaSamplers[] = {
    {kSigmaSamplerNames[0], SigmaSampler::LogitNormal},
    {kSigmaSamplerNames[1], SigmaSampler::Uniform},
    {kSigmaSamplerNames[2], SigmaSampler::Mode}};

template <typename Enum>
std::string_view name_in(Choices<Enum> choices, Enum value) {
  for (const auto& [name, candidate] : choices) {
    if (candidate == value) return name;
  }
  return "?";
}

template <typename Enum>
std::optional<Enum> value_in(Choices<Enum> choices, std::string_view name) {
  for (const auto& [candidate, value] : choices) {
    if (candidate == name) return value;
  }
  return std::nullopt;
}

template <typename Enum>
std::string names_of(Choices<Enum> choices) {
  std::string names;
  for (const auto& [name, value] : choices) {
    names += names.empty() ? "" : ", ";
    names += name;
  }
  return names;
}

// A value somebody may bring from another trainer, and what to do instead.
struct ValueAdvice {
  std::string_view value;
  std::string_view advice;
};

// The field of a config that an accessor such as [](auto& c) -> auto& { return c.model.depth; }
// reaches; one generic accessor serves the setter and the (const) getter.
template <typename Access>
using FieldOf = std::remove_cvref_t<std::invoke_result_t<Access, TrainConfig&>>;

std::optional<double> parse_number(std::string_view text) {
  std::string_view digits = text;
  const bool negative = digits.starts_with('-');
  if (digits.starts_with('+') || negative) digits.remove_prefix(1);
  // YAML's spellings of infinity and NaN, so that a range check can reject them by name.
  std::string lower(digits);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == ".inf") return negative ? -kInfinity : kInfinity;
  if (lower == ".nan") return std::nan("");
  double value = 0.0;
  const char* end = text.data() + text.size();
  const char* start = text.starts_with('+') ? text.data() + 1 : text.data();
  const auto [stop, error] = std::from_chars(start, end, value);
  if (text.empty() || error != std::errc{} || stop != end) return std::nullopt;
  return value;
}

std::optional<bool> parse_boolean(std::string_view text) {
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  // YAML 1.1's spellings, which yaml-cpp also accepts.
  if (lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower == "false" || lower == "no" || lower == "off") return false;
  return std::nullopt;
}

// A double-quoted YAML scalar that reads back as `text`. Control characters are escaped: a line
// break inside the quotes would read back as a space.
std::string yaml_quoted(std::string_view text) {
  std::string quoted = "\"";
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      quoted += fmt::format("\\x{:02x}", byte);
      continue;
    }
    if (c == '"' || c == '\\') quoted += '\\';
    quoted += c;
  }
  return quoted + "\"";
}

ConfigKey gpt_only(ConfigKey key) {
  key.models = ModelScope::Gpt;
  return key;
}

ConfigKey flux_only(ConfigKey key) {
  key.models = ModelScope::Flux;
  return key;
}

ConfigKey make_key(std::string_view name, ConfigSection section, ValueType type,
                   std::string expected, std::string_view meaning, std::string_view details) {
  ConfigKey key;
  key.name = name;
  key.section = section;
  key.type = type;
  key.expected = std::move(expected);
  key.meaning = meaning;
  key.details = details;
  return key;
}

constexpr int64_t kNoMax = std::numeric_limits<int64_t>::max();

struct IntegerRange {
  int64_t min;
  int64_t max = kNoMax;
};

template <typename Access>
ConfigKey integer_key(std::string_view name, ConfigSection section, Access access,
                      IntegerRange range, std::string_view meaning, std::string_view details = {}) {
  using Field = FieldOf<Access>;
  const bool bounded = range.max != kNoMax;
  // An int field cannot hold more than INT_MAX even when the key sets no maximum.
  const int64_t field_max =
      std::min<int64_t>(range.max, static_cast<int64_t>(std::numeric_limits<Field>::max()));
  std::string expected = bounded ? fmt::format("an integer in [{}, {}]", range.min, range.max)
                                 : fmt::format("an integer >= {}", range.min);
  ConfigKey key = make_key(name, section, ValueType::Integer, expected, meaning, details);
  key.set = [access, range, bounded, field_max, expected](
                TrainConfig& config, std::string_view text) -> std::optional<std::string> {
    const std::optional<int64_t> value = parse_integer(text);
    if (!value) return fmt::format("expected {}, found '{}'", expected, text);
    if (bounded && (*value < range.min || *value > range.max)) {
      return fmt::format("must be in [{}, {}], found {}", range.min, range.max, *value);
    }
    if (*value < range.min) return fmt::format("must be at least {}, found {}", range.min, *value);
    if (*value > field_max) return fmt::format("must be at most {}, found {}", field_max, *value);
    access(config) = static_cast<Field>(*value);
    return std::nullopt;
  };
  key.get = [access](const TrainConfig& config) { return fmt::format("{}", access(config)); };
  return key;
}

struct NumberRange {
  double min;
  bool min_excluded = false;
  double max = kInfinity;
  bool max_excluded = false;
};

template <typename Access>
ConfigKey number_key(std::string_view name, ConfigSection section, Access access, NumberRange range,
                     std::string_view meaning, std::string_view details = {}) {
  using Field = FieldOf<Access>;
  std::string expected =
      std::isinf(range.min) ? std::string("a finite number")
      : std::isinf(range.max)
          ? fmt::format("a finite number {} {}", range.min_excluded ? ">" : ">=", range.min)
          : fmt::format("a number in {}{}, {}{}", range.min_excluded ? '(' : '[', range.min,
                        range.max, range.max_excluded ? ')' : ']');
  ConfigKey key = make_key(name, section, ValueType::Number, expected, meaning, details);
  key.set = [access, range, expected](TrainConfig& config,
                                      std::string_view text) -> std::optional<std::string> {
    const std::optional<double> parsed = parse_number(text);
    if (!parsed) return fmt::format("expected {}, found '{}'", expected, text);
    const Field value = static_cast<Field>(*parsed);
    const bool above_min = range.min_excluded ? value > range.min : value >= range.min;
    const bool below_max = range.max_excluded ? value < range.max : value <= range.max;
    // NaN fails both comparisons; infinity fails the finiteness check.
    if (!std::isfinite(value) || !above_min || !below_max) {
      return fmt::format("must be {}, found {}", expected, value);
    }
    access(config) = value;
    return std::nullopt;
  };
  key.get = [access](const TrainConfig& config) { return fmt::format("{}", access(config)); };
  return key;
}

// `rejected_true`: why true is not possible yet; empty when it is.
template <typename Access>
ConfigKey boolean_key(std::string_view name, ConfigSection section, Access access,
                      std::string_view meaning, std::string_view details = {},
                      std::string_view rejected_true = {}) {
  ConfigKey key = make_key(name, section, ValueType::Boolean, "true or false", meaning, details);
  key.bare_flag_value = "true";
  key.set = [access, rejected_true](TrainConfig& config,
                                    std::string_view text) -> std::optional<std::string> {
    const std::optional<bool> value = parse_boolean(text);
    if (!value) return fmt::format("expected true or false, found '{}'", text);
    if (*value && !rejected_true.empty()) return std::string(rejected_true);
    access(config) = *value;
    return std::nullopt;
  };
  key.get = [access](const TrainConfig& config) {
    return std::string(access(config) ? "true" : "false");
  };
  return key;
}

// `check` returns what is wrong with a value, or nothing.
using StringCheck = std::optional<std::string> (*)(std::string_view);

template <typename Access>
ConfigKey string_key(std::string_view name, ConfigSection section, Access access,
                     std::string_view meaning, StringCheck check = nullptr) {
  ConfigKey key = make_key(name, section, ValueType::String, "a string", meaning, {});
  key.set = [access, check](TrainConfig& config,
                            std::string_view text) -> std::optional<std::string> {
    if (check != nullptr) {
      if (std::optional<std::string> problem = check(text)) return problem;
    }
    access(config) = std::string(text);
    return std::nullopt;
  };
  key.get = [access](const TrainConfig& config) { return yaml_quoted(access(config)); };
  return key;
}

template <typename Access, typename Enum>
ConfigKey choice_key(std::string_view name, ConfigSection section, Access access,
                     Choices<Enum> choices, std::string_view meaning, std::string_view details = {},
                     std::span<const ValueAdvice> advice = {}) {
  ConfigKey key = make_key(name, section, ValueType::Choice,
                           fmt::format("one of {}", names_of(choices)), meaning, details);
  key.set = [access, choices, advice](TrainConfig& config,
                                      std::string_view text) -> std::optional<std::string> {
    for (const auto& [choice, value] : choices) {
      if (choice == text) {
        access(config) = value;
        return std::nullopt;
      }
    }
    std::string message = fmt::format("unknown value '{}'; allowed: {}", text, names_of(choices));
    for (const ValueAdvice& entry : advice) {
      if (entry.value == text) message += fmt::format(" ({})", entry.advice);
    }
    return message;
  };
  key.get = [access, choices](const TrainConfig& config) {
    return std::string(name_in(choices, access(config)));
  };
  return key;
}

std::string_view trimmed(std::string_view text) {
  const size_t first = text.find_first_not_of(" \t");
  if (first == std::string_view::npos) return {};
  return text.substr(first, text.find_last_not_of(" \t") - first + 1);
}

// The items of a list value: "[a, b]" or "a,b"; "[]" and "" hold none.
std::vector<std::string_view> list_items(std::string_view text) {
  text = trimmed(text);
  if (text.starts_with('[') && text.ends_with(']')) text = trimmed(text.substr(1, text.size() - 2));
  std::vector<std::string_view> items;
  if (text.empty()) return items;
  for (size_t start = 0;;) {
    const size_t comma = text.find(',', start);
    items.push_back(trimmed(text.substr(start, comma - start)));
    if (comma == std::string_view::npos) return items;
    start = comma + 1;
  }
}

// A list of items: `parse` turns one into a value (nothing when it is not `item_expected`),
// `format` writes one back.
template <typename Access, typename Parse, typename Format>
ConfigKey list_key(std::string_view name, ConfigSection section, Access access,
                   std::string item_expected, Parse parse, Format format, std::string_view meaning,
                   std::string_view details = {}) {
  ConfigKey key = make_key(name, section, ValueType::List,
                           fmt::format("a list of {}", item_expected), meaning, details);
  key.set = [access, parse, item_expected](TrainConfig& config,
                                           std::string_view text) -> std::optional<std::string> {
    FieldOf<Access> values;
    for (std::string_view item : list_items(text)) {
      const auto value = parse(item);
      if (!value) return fmt::format("expected {}, found '{}'", item_expected, item);
      values.push_back(*value);
    }
    access(config) = std::move(values);
    return std::nullopt;
  };
  key.get = [access, format](const TrainConfig& config) {
    std::vector<std::string> items;
    for (const auto& value : access(config))
      items.push_back(format(value));
    return fmt::format("[{}]", fmt::join(items, ", "));
  };
  return key;
}

std::optional<std::string> check_run_name(std::string_view name) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string_view::npos) {
    return fmt::format("must name a folder (not empty, '.', '..', no '/'), found '{}'", name);
  }
  return std::nullopt;
}

std::optional<std::string> check_not_empty(std::string_view text) {
  if (text.empty()) return std::string("must not be empty");
  return std::nullopt;
}

std::vector<std::string_view> model_names() {
  std::vector<std::string_view> names = {kGptModel};
  names.insert(names.end(), std::begin(kFluxPresets), std::end(kFluxPresets));
  return names;
}

std::optional<std::string> check_window_pattern(std::string_view pattern) {
  if (pattern.empty() || pattern.find_first_not_of("SL") != std::string_view::npos) {
    return fmt::format("only the letters S and L are allowed, found '{}'", pattern);
  }
  return std::nullopt;
}

constexpr ValueAdvice kRecipeAdvice[] = {
    {"rowwise",
     "nanochat's rowwise, a scale per row, is not implemented; blockwise, a scale per 1x128 "
     "block, is the closest"}};
constexpr ValueAdvice kDeviceAdvice[] = {{"mps", "Apple GPUs are not supported; use cpu"}};

constexpr std::string_view kMultiHeadAttentionRefused =
    "true is not supported: FP8 between the attention block's operations is not implemented";

constexpr std::string_view kNanRemedyDetails =
    R"(What the NaN guard changes when, after `nan_restore_after` bad steps in a row, it restores
the run's last good checkpoint (the newest saved after a step that was applied); a list of:

- `lower_lr` (default): every learning rate times `nan_lr_factor` for the rest of the run;
- `fp8_margin`: `fp8_margin` + 1, so that delayed scaling leaves twice the headroom (needs
  `fp8_recipe: delayed`, the only recipe with a margin);
- `bf16_layer`: the layers of the first non-finite gradients of those bad steps (a block, or
  lm_head) keep their linears in BF16 (needs `fp8` other than `none`).

`[]`: restore only. Each restore applies the remedies again (the factors compound, another layer
may join BF16). The remedies in force are saved in each checkpoint's `trainer_state.json`, so a
resumed run keeps them. [training.md](training.md#bad-steps) describes the guard.)";

constexpr std::string_view kNanInjectDetails =
    R"(A testing aid, not for training runs: at each listed step (counting from 1, as the step
lines do) the engine writes a NaN into the gradient of `nan_inject_parameter` (a name of
`model.safetensors`, e.g. `transformer.h.1.mlp.c_fc.weight`) after the backward and the sum
over the ranks, so that the step is bad and the guard names that parameter. A step run again
after a restore is not injected again.)";

// Details of the fp8 keys, for the docs.

constexpr std::string_view kFp8Details =
    R"(Which tensors of a linear layer are FP8, and in which format.

- `none` (the default for training): BF16 training; the other fp8 keys are read and checked
  but have no effect (`fp8_dot_product_attention: true` is an error).
- `e4m3`: input, weight and grad_output in E4M3.
- `hybrid`: input and weight (the forward pass) in E4M3, grad_output (the backward pass) in
  E5M2, whose wider range suits gradients. nanochat's `--fp8` is this, and so is `--fp8` alone
  on the command line.

`fp8train check-numerics --config FILE` and `fp8train model` read the same fp8 keys; for
them, `fp8` defaults to `hybrid`.)";

constexpr std::string_view kRecipeDetails =
    R"(How scales are chosen (the exact rules are in [numerics.md](numerics.md)).

- `delayed`: one scale per tensor, from the amaxes of earlier steps (an amax history updated
  once per optimizer step). Uses `fp8_amax_history_len`, `fp8_amax_compute_algo`, `fp8_margin`.
- `tensorwise` (default): one scale per tensor, from that tensor's own amax ("current
  scaling"), as nanochat's default recipe. Uses `fp8_power_of_2_scales`, `fp8_amax_epsilon`.
- `blockwise`: one fp32 scale per 1×128 block (activations, gradients) or 128×128 tile
  (weights), each from its block's amax (DeepSeek-V3 style). Uses `fp8_power_of_2_scales`,
  `fp8_amax_epsilon`.
- `mxfp8`: one E8M0 (power of two) scale per 1×32 block. Hopper has no MX GEMM, so the recipe's
  GEMMs are emulated there; the numerics are identical.

nanochat's `rowwise` (a scale per row) is not implemented; `blockwise` is the closest.)";

constexpr std::string_view kHistoryDetails =
    R"(Delayed scaling only. How many steps of amax the history keeps; the scale comes from the
maximum over the history (or the latest entry, see `fp8_amax_compute_algo`). A step in which
the tensor did not run (amax 0) does not enter the history.)";

constexpr std::string_view kAmaxAlgoDetails =
    R"(Delayed scaling only. Which amax the scale is computed from:

- `max` (default): the maximum over the history (NaN entries skipped);
- `most_recent`: this step's amax.)";

constexpr std::string_view kMarginDetails =
    R"(Delayed scaling only. Headroom in powers of two: scale = (format max · 2^-margin) / amax, so a
margin of 1 leaves room for the amax to double before values saturate. `.nan`, `.inf` and
negative values are errors.)";

constexpr std::string_view kFamilyDetails = R"(Which family of 8-bit formats to use; all recipes.

- `auto` (default): from the device: OCP (`e4m3`, `e5m2`) on NVIDIA GPUs (`sm_XX`), AMD gfx950
  and the CPU; fnuz (`e4m3fnuz`, `e5m2fnuz`) on AMD gfx942.
- `ocp`: the OCP formats (E4M3 max 448, E5M2 max 57344).
- `fnuz`: AMD's fnuz formats (E4M3FNUZ max 240, E5M2FNUZ max 57344; one NaN, no negative zero).

`fp8train doctor` shows what `auto` resolves to on a machine.)";

constexpr std::string_view kPowerOf2Details =
    R"(Rounds each scale down to a power of two, so that scaling and unscaling are exact (only the
exponent changes). `auto` (default) takes the recipe's default: `true` for `blockwise`, `false`
for `tensorwise`. Used by `tensorwise` and `blockwise`. `mxfp8` scales are always powers of two
(E8M0), so `false` together with `fp8_recipe: mxfp8` is an error; `true` or `false` with
`fp8_recipe: delayed` is an error too, since delayed scaling takes its scale from the amax
history and never rounds it.)";

constexpr std::string_view kEpsilonDetails =
    R"(A floor for the amax in current scaling: an amax below it counts as the epsilon, which keeps a
near-zero tensor or block from getting an enormous scale. 0 means no floor. Used by
`tensorwise` and `blockwise` (per block); a non-zero value with `delayed` or `mxfp8` is an
error. With an epsilon above zero, an all-zero tensor gets scale max / epsilon (as in
Transformer Engine); with epsilon 0 it gets scale 1.)";

constexpr std::string_view kTrackerDetails =
    R"(`jsonl` writes metrics.jsonl (a line per step and the run's events) and, for FP8 runs,
fp8_health.jsonl; `fp8train compare`, `plot` and `convergence` read them. `tensorboard` writes
event files beside them (`tensorboard --logdir RUN_FOLDER`). `mlflow` logs to the MLflow tracking
server named by the environment variable `MLFLOW_TRACKING_URI` (http:// or https://): the run,
named after `run`, goes into `experiment`, with the resolved configuration as params, tags
(git commit, device, precision, FP8 recipe), the metrics of every step under TensorBoard's
names, a final summary, and the status FINISHED, KILLED (stopped by a signal) or FAILED. A
resumed run continues the same MLflow run (its id is kept in the checkpoints). The values are
sent from a thread of their own, so a slow or stopped server never holds training up; the log
says when the server stops answering and, at the end, what could not be delivered. A server
that cannot be reached at the start is an error before the first step. docs/tracking.md.)";

constexpr std::string_view kHealthDetails =
    R"(On a statistics step (every `fp8_health_every` steps) the cast kernels count, for each
FP8 linear and operand (input, weight, grad_output), the values that saturated at ±max and the
non-zero values that underflowed to zero, beside the tensor's amax and scale (per-tensor
recipes). The records go to RUN/fp8_health.jsonl and, with `tensorboard`, to the scalars
`fp8/<linear>/<operand>/{amax,scale,saturated_fraction,underflow_fraction}`. A tensor trips when
its saturated fraction exceeds `fp8_saturation_threshold`, its underflowed fraction
`fp8_underflow_threshold`, its amax is not finite, or (delayed scaling, whose scale lags
behind the amax) its amax grew more than `fp8_amax_jump_threshold` times since the last
statistics step; each trip is a
warning naming the linear, operand and numbers. With `fp8_auto_fallback: true` a linear with a
tripping tensor at `fp8_fallback_after` statistics steps in a row moves to BF16: the run saves a
checkpoint, rebuilds the model with that linear in BF16 and goes on; the decision and its
evidence are logged and kept in the checkpoints' trainer_state.json, so a resume keeps it. On
the GPU a statistics step casts each input in the linear instead of the norm before it (the
counting casts), which costs a little time on that step only.)";

constexpr std::string_view kWgradDetails =
    R"(The weight-gradient GEMM of each FP8 linear layer (dW = dYᵀ·X). `true`: in FP8, from the
quantized grad_output and input like the other two GEMMs. `false`: in BF16 (dY and X rounded
to bf16, fp32 accumulation), as Megatron's `--no-fp8-wgrad`; the forward and input-gradient
GEMMs stay FP8.)";

constexpr std::string_view kDotProductAttentionDetails =
    R"(Megatron's switch for FP8 in attention's two products (QKᵀ and PV) and their gradients, at
the quantization points of cuDNN's FP8 SDPA: Q, K, V, the probabilities P and the output O in
the forward format (E4M3); dO, the score gradient dS, dQ, dK and dV in the gradient format
(E5M2 with `fp8: hybrid`). Q, K, V and dO are scaled from their own amax, P from 1 (its
largest possible value), O from twice V's amax, and dS, dQ, dK, dV from 4 × the amax the
previous backward of the same attention measured (until a backward with a non-zero dO has
measured them, a backward first runs twice into scratch to measure);
`fp8_power_of_2_scales` and `fp8_amax_epsilon` apply ([numerics.md](numerics.md#fp8-attention)).
On the GPU, cuDNN's FP8 SDPA (on Hopper: head_dim 128 only, with an FP8 output); on the CPU, an
emulation with the same quantization points. Needs `fp8` other than `none`; off by default.)";

constexpr std::string_view kMultiHeadAttentionDetails =
    R"(Megatron's switch for FP8 across the whole attention block: the QKV projection hands its output
to attention in FP8, and attention hands its output to the output projection in FP8, without
BF16 round trips. Not implemented: only `false` is accepted; `true` is an error that says so.
`fp8_dot_product_attention` puts the attention products themselves in FP8.)";

constexpr std::string_view kWeightTransposesDetails =
    R"(The input-gradient GEMM of an FP8 linear reads the transposed FP8 weight Ŵᵗ (Hopper's FP8
GEMMs take both operands K-major). `kept`: each FP8 linear keeps Ŵᵗ beside Ŵ from its weight
cast, once per optimizer step. `in_backward`: it keeps Ŵ alone and transposes it into one
buffer shared by the linears just before its backward: the same bytes (a per-tensor cast is
elementwise, and a 128x128 tile's scale is its transpose's), one byte per FP8 weight less to
hold, one more pass over Ŵ per backward. The GPU path only (the CPU path's linears cast per
call); not with `fp8_recipe: mxfp8`, whose Ŵᵗ has blocks of its own. `fp8train model --preset
... --fp8-weight-transposes in_backward` plans a Flux model with it.)";

constexpr std::string_view kEdgeLayersDetails =
    R"(Primus's precision override: with `first_last_layers_bf16: true`, the linear layers of the
first `num_layers_at_start_in_bf16` and the last `num_layers_at_end_in_bf16` transformer
blocks stay in BF16 while the rest run in FP8. `fp8train model` shows which layers result.)";

constexpr std::string_view kLmHeadDetails =
    R"(nanochat's size filter (both dimensions at least 128 and divisible by 16) lets lm_head
through, so it runs in FP8 by default (at d24, 145 of 158 linears are FP8). `false` keeps it
in BF16, as torchtitan does by default. Gates (`ve_gate`, `smear_gate`) always stay in BF16.)";

constexpr std::string_view kModelDetails =
    R"(Which model to train.

- `gpt` (default): nanochat's GPT, sized by `depth` and the other keys of the model section.
- `flux_tiny`, `flux_small`, `flux_535m`, `flux_12b`: the Flux MMDiT presets
  ([flux.md](flux.md)). Flux trains on the GPU (`device: auto` finds one) or the CPU, on the
  built-in shapes data, which makes image tokens of 16 features: `flux_tiny`'s and
  `flux_small`'s (the same inputs, hidden 256 and 2 + 2 blocks, so that its block linears can
  run in FP8); the larger presets take 64 (a VAE's 16 channels) and train on precomputed
  shards (`flux_shards`). The keys marked `flux` in the tables apply, and Flux has defaults
  of its own: Primus' Flux 535M settings (AdamW, lr 1e-4 with cosine decay to 1e-5, weight
  decay 0.01, β (0.9, 0.999), clipping at 1.0), with 100 warmup steps (Primus warms up 1000 of
  much longer runs).

A key marked `gpt` given for a Flux model, or one marked `flux` given for the GPT, is an error;
the resolved `config.yaml` holds only the keys of its model.)";

constexpr std::string_view kSigmaSamplerDetails =
    R"(How each sample's noise level σ is drawn in training (SD3's samplers, as diffusers'
`compute_density_for_timestep_sampling`):

- `logit_normal` (default): σ = sigmoid(`logit_mean` + `logit_std` · n), n ~ N(0, 1);
- `uniform`: σ uniform in [0, 1);
- `mode`: σ = 1 − u − `mode_scale` · (cos²(πu/2) − 1 + u), u uniform, more weight near 0.5.

Then `sigma_shift` s moves it: σ' = s·σ / (1 + (s − 1)·σ).)";

std::vector<ConfigKey> build_keys() {
  using S = ConfigSection;
  std::vector<ConfigKey> keys;
  // run
  keys.push_back(string_key(
      "run", S::Run, [](auto& c) -> auto& { return c.run.name; },
      "Name of the run; its folder output_dir/run holds the checkpoints, the resolved "
      "config.yaml and the logs.",
      check_run_name));
  keys.push_back(string_key(
      "output_dir", S::Run, [](auto& c) -> auto& { return c.run.output_dir; },
      "Folder that holds the run folders.", check_not_empty));
  keys.push_back(integer_key(
      "resume_from_step", S::Run, [](auto& c) -> auto& { return c.run.resume_from_step; }, {-1},
      "Resume from the run folder's checkpoint of this step; -1: a fresh run."));
  keys.push_back(choice_key(
      "resume", S::Run, [](auto& c) -> auto& { return c.run.resume; },
      Choices<ResumeChoice>(kResumeChoices),
      "auto: continue from the run folder's newest checkpoint that loads (an older one when a "
      "newer cannot be read), or start fresh when it holds none, so that the same command "
      "continues a stopped, preempted or killed run; never: only resume_from_step resumes."));
  keys.push_back(boolean_key(
      "overwrite", S::Run, [](auto& c) -> auto& { return c.run.overwrite; },
      "A fresh run in a run folder that holds checkpoints deletes them and the run's logs "
      "(metrics.jsonl, fp8_health.jsonl, event files); false: that is an error."));
  keys.push_back(integer_key(
      "save_every", S::Run, [](auto& c) -> auto& { return c.run.save_every; }, {-1},
      "Save a checkpoint every N steps; -1 or 0: only at the end (the final checkpoint is always "
      "saved)."));
  keys.push_back(integer_key(
      "keep_checkpoints", S::Run, [](auto& c) -> auto& { return c.run.keep_checkpoints; }, {0},
      "Keep the run folder's newest N checkpoints, deleting older ones after each save; 0: keep "
      "every one."));
  keys.push_back(integer_key(
      "log_every", S::Run, [](auto& c) -> auto& { return c.run.log_every; }, {1},
      "Print the loss, throughput and MFU every N steps."));
  keys.push_back(list_key(
      "tracker", S::Run, [](auto& c) -> auto& { return c.run.tracker; },
      names_of(Choices<Tracker>(kTrackers)),
      [](std::string_view item) { return value_in(Choices<Tracker>(kTrackers), item); },
      [](Tracker tracker) { return std::string(name_in(Choices<Tracker>(kTrackers), tracker)); },
      "Where the metrics go: jsonl (metrics.jsonl, fp8_health.jsonl), tensorboard (event files "
      "in the run folder), mlflow (the server at MLFLOW_TRACKING_URI); several at once.",
      kTrackerDetails));
  keys.push_back(string_key(
      "experiment", S::Run, [](auto& c) -> auto& { return c.run.experiment; },
      "tracker mlflow: the experiment the run goes into, created when missing."));
  keys.push_back(boolean_key(
      "log_timers_to_tensorboard", S::Run,
      [](auto& c) -> auto& { return c.run.log_timers_to_tensorboard; },
      "Also each step's timers as scalars (timers/<name>_ms) and in metrics.jsonl (timers_ms): "
      "the step, validation and, on the GPU, the step's GEMMs, attention and quantization."));
  keys.push_back(gpt_only(integer_key(
      "sample_tokens", S::Run, [](auto& c) -> auto& { return c.run.sample_tokens; }, {0},
      "Tokens to generate from the trained model at the end; 0: no sample.")));
  keys.push_back(integer_key(
      "eval_every", S::Run, [](auto& c) -> auto& { return c.run.eval_every; }, {-1},
      "Evaluate the validation loss every N steps and at the end; -1 or 0: never."));
  keys.push_back(integer_key(
      "eval_iters", S::Run, [](auto& c) -> auto& { return c.run.eval_iters; }, {1},
      "Micro-batches (of micro_batch_size sequences) per evaluation."));
  keys.push_back(choice_key(
      "device", S::Run, [](auto& c) -> auto& { return c.run.device; },
      Choices<DeviceChoice>(kDevices),
      "Where to train: cuda (the GPU path), cpu (the reference path), auto: cuda when a GPU is "
      "present, else cpu.",
      {}, kDeviceAdvice));
  keys.push_back(boolean_key(
      "overlap_grad_reduce", S::Run, [](auto& c) -> auto& { return c.run.overlap_grad_reduce; },
      "Data parallelism on GPUs: sum each block's gradients over the ranks (NCCL) while the "
      "backward goes on; false: one sum after the backward (faster on one NVLink node, where "
      "the overlapped sums slow the backward's GEMMs more than they save). Only the GPT without "
      "tensor parallelism overlaps; elsewhere the run's start says that it sums after the "
      "backward, and why."));
  keys.push_back(boolean_key(
      "shard_optimizer_state", S::Run, [](auto& c) -> auto& { return c.run.shard_optimizer_state; },
      "Data parallelism: ZeRO-1. Each rank updates its share of the parameters (the GPT's Muon "
      "matrices split evenly, AdamW's tensors balanced by size) and sends the new values to the "
      "others; "
      "on the GPU path each rank keeps optimizer state for its share only. Checkpoints hold the "
      "whole state and resume on any number of ranks. No effect with one rank, nor on the GPU path "
      "with one tensor-parallel group (it shards over the groups); false: every rank runs the "
      "whole update and holds the whole state."));
  keys.push_back(integer_key(
      "tensor_model_parallel_size", S::Run,
      [](auto& c) -> auto& { return c.run.tensor_model_parallel_size; }, {1},
      "Tensor parallelism (Megatron's), CPU and GPU paths: groups of this many consecutive ranks "
      "split each block's heads (the query, key and value projections by output, the "
      "attention's output projection by input) and MLP hidden features (the first MLP linear "
      "by output, the second by input; Flux's single blocks: linear1 by output, linear2 by "
      "input; Flux's modulations by output, their chunks gathered), sum the partial outputs "
      "over the group, and see the same micro-batches; the groups are the data-parallel "
      "replicas. FP8 per-tensor scales of split tensors come from the group's largest amax. "
      "Must divide the ranks, the heads (GPT: query and kv heads) and the MLP's hidden "
      "features. On the GPU each rank keeps only its shares of the split weights, gradients and "
      "optimizer state (the GPT's Muon gathers a split matrix's shares to orthogonalize it "
      "whole), and only a Flux group's first rank keeps the host copies for checkpoints; on the "
      "CPU path they stay whole on every rank. 1: none."));
  keys.push_back(boolean_key(
      "sequence_parallel", S::Run, [](auto& c) -> auto& { return c.run.sequence_parallel; },
      "Sequence parallelism (Megatron's) within each tensor-parallel group (both models, on the "
      "CPU path and on the GPU): each rank keeps 1/tensor_model_parallel_size of a micro-batch's "
      "tokens outside the split linears (GPT: the residual stream, the norms, lm_head and the "
      "loss; Flux: of each "
      "sample's image and text tokens, the residual streams, the LayerNorms and modulated outputs, "
      "img_in, txt_in and the final layer), gathers the group's tokens before the column-parallel "
      "linears, and keeps its tokens of the summed row-parallel outputs. The same losses, less "
      "activation memory per rank. Needs tensor_model_parallel_size above 1, and it must divide "
      "micro_batch_size × sequence_len (GPT) or a sample's image tokens and its text tokens "
      "(Flux); on the GPU the gathers and sums are NCCL all-gathers and reduce-scatters, and a "
      "GPT rank's share of the tokens must be a multiple of 16."));
  keys.push_back(boolean_key(
      "gemm_autotune", S::Run, [](auto& c) -> auto& { return c.run.gemm_autotune; },
      "GPU path: the first GEMM of each new problem (sizes, types, scale modes, epilogue) runs "
      "cuBLASLt's candidate algorithms (up to 8 from its heuristic; for block-scaled FP8 also "
      "the engine's kernel) on its own operands, drops those whose result disagrees with the "
      "heuristic's first choice, times the rest and keeps the fastest; choices persist in "
      "gemm_tuning_cache. false: the heuristic's first choice. "
      "The environment variable FP8TRAIN_AUTOTUNE=0|1 takes precedence; a pinned gemm_backend "
      "or deterministic: true turns autotuning off."));
  keys.push_back(string_key(
      "gemm_backend", S::Run, [](auto& c) -> auto& { return c.run.gemm_backend; },
      "GPU path: pin the GEMM backend, for both precisions (cublaslt) or per precision "
      "(fp8:fp8train,bf16:cublaslt); a pinned precision runs the backend's default choice and "
      "is not autotuned. Backends: cublaslt (every GEMM), fp8train (fp8 only: the engine's "
      "block-scaled sm_90a kernel for the blockwise recipe's GEMMs, cuBLASLt for the rest). "
      "Empty: none pinned. The environment variable FP8TRAIN_GEMM_BACKEND takes precedence "
      "(empty or blank counts as unset)."));
  keys.push_back(string_key(
      "gemm_tuning_cache", S::Run, [](auto& c) -> auto& { return c.run.gemm_tuning_cache; },
      "The file where autotuned GEMM choices persist, per GPU model, library versions and "
      "version of the engine's own kernel (others' entries are kept and ignored); empty: "
      "gemm_tuning.json in the cache folder "
      "($FP8TRAIN_CACHE, else $XDG_CACHE_HOME/fp8train, else ~/.cache/fp8train)."));
  keys.push_back(boolean_key(
      "deterministic", S::Run, [](auto& c) -> auto& { return c.run.deterministic; },
      "GPU path: no GEMM autotuning, so every run picks the same algorithms (cuBLASLt's "
      "heuristic's first choice) and repeats its numbers; the log says so. The engine's "
      "block-scaled kernel, where gemm_backend pins it, then sums each output in a fixed order "
      "(no split K)."));
  keys.push_back(gpt_only(integer_key(
      "nan_restore_after", S::Run, [](auto& c) -> auto& { return c.run.nan_restore_after; }, {0},
      "After this many bad steps in a row (a non-finite loss or gradient norm: the update is "
      "skipped), restore the last good checkpoint and apply nan_remedy; 0: only skip.")));
  keys.push_back(gpt_only(integer_key(
      "nan_max_restores", S::Run, [](auto& c) -> auto& { return c.run.nan_max_restores; }, {0},
      "Restores per run; once they are spent, nan_restore_after bad steps in a row stop the run "
      "with an error.")));
  keys.push_back(gpt_only(list_key(
      "nan_remedy", S::Run, [](auto& c) -> auto& { return c.run.nan_remedy; },
      names_of(Choices<NanRemedy>(kNanRemedies)),
      [](std::string_view item) { return value_in(Choices<NanRemedy>(kNanRemedies), item); },
      [](NanRemedy remedy) {
        return std::string(name_in(Choices<NanRemedy>(kNanRemedies), remedy));
      },
      "What a restore changes besides going back: lower_lr, fp8_margin, bf16_layer; []: "
      "nothing.",
      kNanRemedyDetails)));
  keys.push_back(gpt_only(number_key(
      "nan_lr_factor", S::Run, [](auto& c) -> auto& { return c.run.nan_lr_factor; },
      {0, true, 1, true}, "lower_lr: what each restore multiplies every learning rate by.")));
  keys.push_back(gpt_only(list_key(
      "nan_inject_steps", S::Run, [](auto& c) -> auto& { return c.run.nan_inject_steps; },
      "integers >= 1",
      [](std::string_view item) -> std::optional<int64_t> {
        const std::optional<int64_t> step = parse_integer(item);
        return step && *step >= 1 ? step : std::nullopt;
      },
      [](int64_t step) { return fmt::format("{}", step); },
      "Testing aid: steps whose gradient of nan_inject_parameter gets a NaN; []: none.",
      kNanInjectDetails)));
  keys.push_back(gpt_only(string_key(
      "nan_inject_parameter", S::Run, [](auto& c) -> auto& { return c.run.nan_inject_parameter; },
      "Testing aid: the parameter whose gradient nan_inject_steps poison.")));
  keys.push_back(flux_only(integer_key(
      "sample_every", S::Run, [](auto& c) -> auto& { return c.run.sample_every; }, {0},
      "Write a grid of samples (run folder, samples/step_NNNNNN.png) every N steps; 0: only the "
      "one at the end. The training model samples it on its device, in its precision, in "
      "micro-batches of micro_batch_size.")));
  keys.push_back(flux_only(integer_key(
      "sample_steps", S::Run, [](auto& c) -> auto& { return c.run.sample_steps; }, {1, 10000},
      "Euler steps from σ = 1 to 0 per sample, on a schedule linear in σ shifted by "
      "sigma_shift.")));
  keys.push_back(flux_only(number_key(
      "sample_guidance", S::Run, [](auto& c) -> auto& { return c.run.sample_guidance; }, {0},
      "Classifier-free guidance g: v = v_empty + g·(v_prompt − v_empty); 1: the prompt's "
      "velocity alone. With the guidance embedder (flux_12b), the embedder's input instead.")));
  keys.push_back(flux_only(string_key(
      "sample_prompts", S::Run, [](auto& c) -> auto& { return c.run.sample_prompts; },
      "The grid's prompts, one row each, separated by ';', in the words of the built-in data's "
      "captions; empty: no grids.")));
  keys.push_back(flux_only(integer_key(
      "sample_images_per_prompt", S::Run,
      [](auto& c) -> auto& { return c.run.sample_images_per_prompt; }, {1, 64},
      "The grid's columns: one image per seed, seed, seed + 1, ... (the same noise in every "
      "row).")));
  // model
  ConfigKey model = make_key(
      "model", S::Model, ValueType::Choice,
      fmt::format("one of {}", fmt::join(model_names(), ", ")),
      "The GPT, or a Flux preset (flux_small: flux_tiny widened for FP8 linears).", kModelDetails);
  model.set = [](TrainConfig& config, std::string_view text) -> std::optional<std::string> {
    const std::vector<std::string_view> names = model_names();
    if (std::find(names.begin(), names.end(), text) == names.end()) {
      return fmt::format("unknown value '{}'; allowed: {}", text, fmt::join(names, ", "));
    }
    config.model.name = std::string(text);
    return std::nullopt;
  };
  model.get = [](const TrainConfig& config) { return config.model.name; };
  keys.push_back(std::move(model));
  keys.push_back(gpt_only(integer_key(
      "depth", S::Model, [](auto& c) -> auto& { return c.model.depth; }, {1, 1000},
      "Number of transformer blocks; the width follows from it (nanochat's one size knob).")));
  keys.push_back(gpt_only(integer_key(
      "aspect_ratio", S::Model, [](auto& c) -> auto& { return c.model.aspect_ratio; }, {1, 4096},
      "model_dim = depth × aspect_ratio, rounded up to a multiple of head_dim.")));
  keys.push_back(gpt_only(integer_key(
      "head_dim", S::Model, [](auto& c) -> auto& { return c.model.head_dim; }, {2, 1024},
      "Channels per attention head (even, for rotary); heads = model_dim / head_dim.")));
  keys.push_back(gpt_only(integer_key(
      "vocab_size", S::Model, [](auto& c) -> auto& { return c.model.vocab_size; }, {2, 1 << 24},
      "Vocabulary size before padding to a multiple of 64; the tokenizer's size.")));
  keys.push_back(gpt_only(integer_key(
      "sequence_len", S::Model, [](auto& c) -> auto& { return c.model.sequence_len; }, {2, 1 << 20},
      "Tokens per training sequence (the context length).")));
  keys.push_back(gpt_only(string_key(
      "window_pattern", S::Model, [](auto& c) -> auto& { return c.model.window_pattern; },
      "Attention windows tiled over the layers: L the full sequence, S a quarter of it (in "
      "tiles of 128); the last layer is always L.",
      check_window_pattern)));
  // data
  keys.push_back(gpt_only(string_key(
      "data_path", S::Data, [](auto& c) -> auto& { return c.data.data_path; },
      "Folder of token shards to train on; empty: the built-in corpus.")));
  keys.push_back(gpt_only(string_key(
      "tokenizer_path", S::Data, [](auto& c) -> auto& { return c.data.tokenizer_path; },
      "Tokenizer file; empty: the data source's default tokenizer.")));
  keys.push_back(flux_only(integer_key(
      "image_size", S::Data, [](auto& c) -> auto& { return c.data.image_size; }, {16, 4096},
      "Pixels per side of the built-in shapes pictures, a multiple of 16: (image_size / 2)² "
      "image tokens.")));
  keys.push_back(flux_only(string_key(
      "flux_shards", S::Data, [](auto& c) -> auto& { return c.data.flux_shards; },
      "Precomputed Flux shards to train on ([data.md](data.md#training-on-flux-shards)): a "
      "folder (its `*.safetensors` files) or a glob pattern such as "
      "`shards/train_*.safetensors`, relative to the working directory, read in path order; "
      "empty: the built-in shapes pictures.")));
  keys.push_back(flux_only(string_key(
      "flux_val_shards", S::Data, [](auto& c) -> auto& { return c.data.flux_val_shards; },
      "Held-out shards for validation, named as flux_shards; empty: validation reads the "
      "training shards' first samples, so its loss is not a held-out one.")));
  // training
  keys.push_back(integer_key(
      "micro_batch_size", S::Training, [](auto& c) -> auto& { return c.training.micro_batch_size; },
      {1, 1 << 20},
      "Sequences (Flux: pictures) per device in one forward/backward pass (nanochat's device "
      "batch size)."));
  keys.push_back(integer_key(
      "global_batch_size", S::Training,
      [](auto& c) -> auto& { return c.training.global_batch_size; }, {0},
      "Sequences (Flux: pictures) per optimizer step over all devices, a multiple of "
      "micro_batch_size × data-parallel replicas (the ranks, over tensor_model_parallel_size); "
      "gradients accumulate over the micro-batches in between. 0: micro_batch_size × "
      "replicas."));
  keys.push_back(integer_key(
      "train_iters", S::Training, [](auto& c) -> auto& { return c.training.train_iters; }, {1},
      "Optimizer steps to train for (nanochat derives its count from a data:param ratio; here "
      "it is explicit)."));
  keys.push_back(integer_key(
      "seed", S::Training, [](auto& c) -> auto& { return c.training.seed; }, {0},
      "Seed of the parameter initialization and the data order (Flux: also of the noise, σ and "
      "guidance dropout of each step, and of the sample grids)."));
  keys.push_back(choice_key(
      "recompute_granularity", S::Training,
      [](auto& c) -> auto& { return c.training.recompute.granularity; },
      Choices<RecomputeGranularity>(kRecomputeGranularities),
      "Activation recompute, to trade compute for activation memory ([model.md](model.md#"
      "activation-recompute)). none: the forward saves what the backward reads; selective: the "
      "outputs of cheap element-wise steps (relu² and GELU, the residual sums) are computed "
      "again in the backward, GEMM inputs and attention statistics stay saved; full: the blocks "
      "that recompute_method picks save only their input and run their forward again just "
      "before their backward. Losses and gradients are the same, bit for bit. On the GPU path "
      "the GPT's selective saves what none saves (its none never saves what selective leaves "
      "out); full does not combine with fp8_dot_product_attention there."));
  keys.push_back(choice_key(
      "recompute_method", S::Training, [](auto& c) -> auto& { return c.training.recompute.method; },
      Choices<RecomputeMethod>(kRecomputeMethods),
      "Which blocks recompute_granularity: full recomputes. uniform: every block, in groups of "
      "recompute_num_layers consecutive blocks (each group saves its first input and its last "
      "output, and holds one group's activations during its backward); block: only the first "
      "recompute_num_layers blocks, one at a time, the others save everything. Flux counts its "
      "double blocks first, then its single blocks; a group never spans both."));
  keys.push_back(integer_key(
      "recompute_num_layers", S::Training,
      [](auto& c) -> auto& { return c.training.recompute.num_layers; }, {1},
      "recompute_method: uniform: blocks per group; block: how many of the first blocks "
      "recompute (at most the model's blocks)."));
  // optimizer
  keys.push_back(choice_key(
      "optimizer", S::Optimizer, [](auto& c) -> auto& { return c.optimizer.kind; },
      Choices<OptimizerKind>(kOptimizers),
      "muon: nanochat's MuonAdamW (Muon for the block matrices; AdamW for embeddings, lm_head "
      "and scalars with nanochat's per-group betas); adamw: AdamW for every parameter (Flux: "
      "only adamw)."));
  keys.push_back(number_key(
      "lr", S::Optimizer, [](auto& c) -> auto& { return c.optimizer.lr; }, {0, true},
      "muon: the block matrices' learning rate (nanochat's --matrix-lr); adamw: every "
      "parameter's."));
  keys.push_back(gpt_only(number_key(
      "embedding_lr", S::Optimizer, [](auto& c) -> auto& { return c.optimizer.embedding_lr; },
      {0, true}, "muon: the embeddings' AdamW learning rate, as nanochat's --embedding-lr.")));
  keys.push_back(gpt_only(number_key(
      "unembedding_lr", S::Optimizer, [](auto& c) -> auto& { return c.optimizer.unembedding_lr; },
      {0, true}, "muon: lm_head's AdamW learning rate, as nanochat's --unembedding-lr.")));
  keys.push_back(gpt_only(number_key(
      "scalar_lr", S::Optimizer, [](auto& c) -> auto& { return c.optimizer.scalar_lr; }, {0, true},
      "muon: the residual scalars' learning rate, as nanochat's --scalar-lr.")));
  keys.push_back(number_key(
      "min_lr", S::Optimizer, [](auto& c) -> auto& { return c.optimizer.min_lr; }, {0},
      "cosine decay: the learning rate at the last step, at most lr; each group decays to the "
      "same fraction min_lr / lr of its rate."));
  keys.push_back(number_key(
      "weight_decay", S::Optimizer, [](auto& c) -> auto& { return c.optimizer.weight_decay; }, {0},
      "muon: the block matrices' cautious weight decay, as nanochat's --weight-decay: the value "
      "at nanochat's reference (d12, 2^19 tokens per step), scaled as nanochat scales it by "
      "sqrt(tokens per step / 2^19) x D_ref / D (D: 12 tokens per scaling parameter) and by a "
      "cosine over the run; adamw: AdamW's decoupled decay, as given, on the weight matrices "
      "(1-D parameters get none, Megatron's rule)."));
  keys.push_back(number_key(
      "adam_beta1", S::Optimizer, [](auto& c) -> auto& { return c.optimizer.adam_beta1; },
      {0, false, 1, true}, "adamw: β1 (muon keeps nanochat's per-group betas)."));
  keys.push_back(number_key(
      "adam_beta2", S::Optimizer, [](auto& c) -> auto& { return c.optimizer.adam_beta2; },
      {0, false, 1, true}, "adamw: β2."));
  keys.push_back(number_key(
      "adam_eps", S::Optimizer, [](auto& c) -> auto& { return c.optimizer.adam_eps; }, {0, true},
      "adamw: ε."));
  keys.push_back(number_key(
      "clip_grad", S::Optimizer, [](auto& c) -> auto& { return c.optimizer.clip_grad; }, {0},
      "Clip the global gradient norm to this value; 0: no clipping (as nanochat)."));
  // schedule
  keys.push_back(integer_key(
      "lr_warmup_iters", S::Schedule, [](auto& c) -> auto& { return c.schedule.lr_warmup_iters; },
      {0}, "Steps of linear warmup: the multiplier is (step + 1) / lr_warmup_iters."));
  keys.push_back(choice_key(
      "lr_decay_style", S::Schedule, [](auto& c) -> auto& { return c.schedule.lr_decay_style; },
      Choices<optim::LrDecayStyle>(kDecayStyles),
      "After warmup. nanochat: constant, then linear over the last lr_warmdown_ratio of the "
      "steps down to final_lr_frac; cosine: down to min_lr at the last step; constant: no "
      "decay."));
  keys.push_back(number_key(
      "lr_warmdown_ratio", S::Schedule,
      [](auto& c) -> auto& { return c.schedule.lr_warmdown_ratio; }, {0, false, 1},
      "nanochat decay: the fraction of the steps spent in the warmdown."));
  keys.push_back(number_key(
      "final_lr_frac", S::Schedule, [](auto& c) -> auto& { return c.schedule.final_lr_frac; },
      {0, false, 1}, "nanochat decay: the learning-rate multiplier at the last step."));
  // fp8
  ConfigKey mode = choice_key(
      "fp8", S::Fp8, [](auto& c) -> auto& { return c.fp8.scaling.mode; },
      Choices<Fp8Mode>(kFp8ModeNames),
      "Which tensors of the linear layers are FP8: none (BF16 training), e4m3, or hybrid (E4M3 "
      "forward, E5M2 gradients).",
      kFp8Details);
  mode.bare_flag_value = "hybrid";
  keys.push_back(std::move(mode));
  keys.push_back(choice_key(
      "fp8_recipe", S::Fp8, [](auto& c) -> auto& { return c.fp8.scaling.recipe; },
      Choices<ScalingRecipe>(kScalingRecipeNames), "How scales are chosen.", kRecipeDetails,
      kRecipeAdvice));
  keys.push_back(integer_key(
      "fp8_amax_history_len", S::Fp8,
      [](auto& c) -> auto& { return c.fp8.scaling.amax_history_len; }, {1},
      "delayed: steps of amax the history keeps.", kHistoryDetails));
  keys.push_back(choice_key(
      "fp8_amax_compute_algo", S::Fp8,
      [](auto& c) -> auto& { return c.fp8.scaling.amax_compute_algo; },
      Choices<AmaxComputeAlgo>(kAmaxComputeAlgoNames),
      "delayed: the amax of the scale, the history's maximum or the latest.", kAmaxAlgoDetails));
  keys.push_back(number_key(
      "fp8_margin", S::Fp8, [](auto& c) -> auto& { return c.fp8.scaling.margin; }, {0},
      "delayed: headroom in powers of two.", kMarginDetails));
  keys.push_back(choice_key(
      "fp8_dtype_family", S::Fp8, [](auto& c) -> auto& { return c.fp8.scaling.dtype_family; },
      Choices<FamilySetting>(kFamilySettingNames), "OCP or fnuz formats.", kFamilyDetails));
  ConfigKey power_of_2 =
      make_key("fp8_power_of_2_scales", S::Fp8, ValueType::Boolean,
               "true or false (or auto: the recipe's default)",
               "tensorwise, blockwise: round scales down to powers of two.", kPowerOf2Details);
  power_of_2.set = [](TrainConfig& config, std::string_view text) -> std::optional<std::string> {
    if (text == "auto") {
      config.fp8.scaling.power_of_2_scales.reset();
      return std::nullopt;
    }
    const std::optional<bool> value = parse_boolean(text);
    if (!value) {
      return fmt::format("expected true or false (or auto: the recipe's default), found '{}'",
                         text);
    }
    config.fp8.scaling.power_of_2_scales = *value;
    return std::nullopt;
  };
  power_of_2.get = [](const TrainConfig& config) {
    const std::optional<bool> value = config.fp8.scaling.power_of_2_scales;
    return std::string(!value ? "auto" : *value ? "true" : "false");
  };
  power_of_2.bare_flag_value = "true";
  keys.push_back(std::move(power_of_2));
  keys.push_back(number_key(
      "fp8_amax_epsilon", S::Fp8, [](auto& c) -> auto& { return c.fp8.scaling.amax_epsilon; }, {0},
      "tensorwise, blockwise: a floor for the amax.", kEpsilonDetails));
  keys.push_back(boolean_key(
      "fp8_wgrad", S::Fp8, [](auto& c) -> auto& { return c.fp8.wgrad; },
      "The weight-gradient GEMM in FP8; false: in BF16.", kWgradDetails));
  keys.push_back(choice_key(
      "fp8_weight_transposes", S::Fp8, [](auto& c) -> auto& { return c.fp8.weight_transposes; },
      Choices<ops::WeightTransposes>(ops::kWeightTransposesNames),
      "GPU: each FP8 linear keeps its transposed weight (kept), or makes it before its backward "
      "(in_backward: a byte per weight less).",
      kWeightTransposesDetails));
  keys.push_back(boolean_key(
      "fp8_dot_product_attention", S::Fp8,
      [](auto& c) -> auto& { return c.fp8.dot_product_attention; },
      "Attention's two products and their gradients on FP8 operands.",
      kDotProductAttentionDetails));
  keys.push_back(boolean_key(
      "fp8_multi_head_attention", S::Fp8,
      [](auto& c) -> auto& { return c.fp8.multi_head_attention; },
      "FP8 between the attention block's operations (not implemented: only false).",
      kMultiHeadAttentionDetails, kMultiHeadAttentionRefused));
  keys.push_back(gpt_only(boolean_key(
      "lm_head_fp8", S::Fp8, [](auto& c) -> auto& { return c.fp8.lm_head_fp8; },
      "lm_head in FP8 (nanochat); false: in BF16.", kLmHeadDetails)));
  keys.push_back(boolean_key(
      "first_last_layers_bf16", S::Fp8,
      [](auto& c) -> auto& { return c.fp8.first_last_layers_bf16; },
      "Keep the first and last blocks in BF16 (Primus).", kEdgeLayersDetails));
  keys.push_back(integer_key(
      "num_layers_at_start_in_bf16", S::Fp8,
      [](auto& c) -> auto& { return c.fp8.num_layers_at_start_in_bf16; }, {0, 1000},
      "With first_last_layers_bf16: blocks at the start kept in BF16."));
  keys.push_back(integer_key(
      "num_layers_at_end_in_bf16", S::Fp8,
      [](auto& c) -> auto& { return c.fp8.num_layers_at_end_in_bf16; }, {0, 1000},
      "With first_last_layers_bf16: blocks at the end kept in BF16."));
  keys.push_back(integer_key(
      "fp8_health_every", S::Fp8, [](auto& c) -> auto& { return c.fp8.health_every; }, {0},
      "FP8 runs: every N steps, each FP8 tensor's amax, scale and saturated and underflowed "
      "fractions into fp8_health.jsonl and TensorBoard, checked against the thresholds; 0: "
      "never.",
      kHealthDetails));
  keys.push_back(number_key(
      "fp8_saturation_threshold", S::Fp8,
      [](auto& c) -> auto& { return c.fp8.saturation_threshold; }, {0, false, 1},
      "Warn when more than this fraction of a tensor's values saturated at ±max."));
  keys.push_back(number_key(
      "fp8_underflow_threshold", S::Fp8, [](auto& c) -> auto& { return c.fp8.underflow_threshold; },
      {0, false, 1},
      "Warn when more than this fraction of a tensor's values (non-zero ones) underflowed to "
      "zero."));
  keys.push_back(number_key(
      "fp8_amax_jump_threshold", S::Fp8, [](auto& c) -> auto& { return c.fp8.amax_jump_threshold; },
      {1, true},
      "Delayed scaling: warn when a tensor's amax grew more than this factor since the last "
      "statistics step (its scale lags behind)."));
  keys.push_back(boolean_key(
      "fp8_auto_fallback", S::Fp8, [](auto& c) -> auto& { return c.fp8.auto_fallback; },
      "Move a linear whose tensors trip a threshold at fp8_fallback_after statistics steps in a "
      "row to BF16, for the rest of the run (resumes keep it).",
      kHealthDetails));
  keys.push_back(integer_key(
      "fp8_fallback_after", S::Fp8, [](auto& c) -> auto& { return c.fp8.fallback_after; }, {1},
      "fp8_auto_fallback: statistics steps in a row a linear must trip before it moves."));
  // flux
  keys.push_back(flux_only(choice_key(
      "sigma_sampler", S::Flux, [](auto& c) -> auto& { return c.flux.sigma.sampler; },
      Choices<SigmaSampler>(kSigmaSamplers), "How each sample's noise level σ is drawn.",
      kSigmaSamplerDetails)));
  keys.push_back(flux_only(number_key(
      "logit_mean", S::Flux, [](auto& c) -> auto& { return c.flux.sigma.logit_mean; },
      {-kInfinity, true}, "logit_normal: the mean of the normal before the sigmoid.")));
  keys.push_back(flux_only(number_key(
      "logit_std", S::Flux, [](auto& c) -> auto& { return c.flux.sigma.logit_std; }, {0},
      "logit_normal: its standard deviation.")));
  keys.push_back(flux_only(number_key(
      "mode_scale", S::Flux, [](auto& c) -> auto& { return c.flux.sigma.mode_scale; },
      {-1, false, 1.75, false},
      "mode: how much weight moves towards σ = 0.5 (SD3: 1.29); beyond 1.75 σ would leave "
      "[0, 1].")));
  keys.push_back(flux_only(number_key(
      "sigma_shift", S::Flux, [](auto& c) -> auto& { return c.flux.sigma.shift; }, {0, true},
      "Shift s of σ in training and sampling, σ' = s·σ / (1 + (s − 1)·σ); 1: none, > 1: more "
      "noise (SD3, FLUX at high resolution).")));
  keys.push_back(flux_only(number_key(
      "cfg_dropout", S::Flux, [](auto& c) -> auto& { return c.flux.cfg_dropout; }, {0, false, 1},
      "Probability that a training sample gets the empty caption's encodings, so that the "
      "model learns the unconditional velocity classifier-free guidance needs.")));
  keys.push_back(flux_only(number_key(
      "latent_scale", S::Flux, [](auto& c) -> auto& { return c.flux.latent_scale; }, {0, true},
      "x0 = latent_scale · (latent − latent_shift); FLUX.1's VAE: 0.3611. The built-in shapes "
      "latents already lie in [−1, 1]: 1.")));
  keys.push_back(flux_only(number_key(
      "latent_shift", S::Flux, [](auto& c) -> auto& { return c.flux.latent_shift; },
      {-kInfinity, true}, "FLUX.1's VAE: 0.1159; the built-in shapes latents: 0.")));
  return keys;
}

constexpr FlagAlias kAliases[] = {
    {"device_batch_size", "micro_batch_size"},
    {"total_batch_size", "global_batch_size", true},
    {"num_iterations", "train_iters"},
    {"max_seq_len", "sequence_len"},
    {"matrix_lr", "lr"},
    {"warmup_steps", "lr_warmup_iters"},
    {"warmdown_ratio", "lr_warmdown_ratio"},
    {"device_type", "device"},
};

// nanochat settings that are done differently here.
constexpr ValueAdvice kNameAdvice[] = {
    {"target_param_data_ratio",
     "nanochat's step count from a data:param ratio is not computed here; set train_iters"},
    {"target_flops",
     "nanochat's step count from a FLOP budget is not computed here; set "
     "train_iters"},
    {"eval_tokens", "evaluations are counted in micro-batches here: eval_iters"},
    {"model_tag", "the run folder is named by run"},
};

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j)
    row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitution = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitution});
    }
  }
  return row[b.size()];
}

}  // namespace

std::optional<int64_t> parse_integer(std::string_view text) {
  if (text.starts_with('+')) text.remove_prefix(1);
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || error != std::errc{} || stop != end) return std::nullopt;
  return value;
}

std::string_view section_name(ConfigSection section) {
  switch (section) {
    case ConfigSection::Run:
      return "run";
    case ConfigSection::Model:
      return "model";
    case ConfigSection::Data:
      return "data";
    case ConfigSection::Training:
      return "training";
    case ConfigSection::Optimizer:
      return "optimizer";
    case ConfigSection::Schedule:
      return "schedule";
    case ConfigSection::Fp8:
      return "fp8";
    case ConfigSection::Flux:
      return "flux";
  }
  return "?";
}

std::string_view section_summary(ConfigSection section) {
  switch (section) {
    case ConfigSection::Run:
      return "The run's name and folder, checkpoints, logging, evaluation, device.";
    case ConfigSection::Model:
      return "Which model: the nanochat GPT (and its shape) or a Flux preset.";
    case ConfigSection::Data:
      return "What to train on: token shards for the GPT; for Flux the built-in shapes pictures "
             "or precomputed shards.";
    case ConfigSection::Training:
      return "Batch sizes, length of training, seed.";
    case ConfigSection::Optimizer:
      return "Optimizer, learning rates, weight decay, clipping.";
    case ConfigSection::Schedule:
      return "The learning-rate schedule.";
    case ConfigSection::Fp8:
      return "FP8 training: format, scaling recipe, which layers (Primus/Megatron names).";
    case ConfigSection::Flux:
      return "Flux's rectified-flow objective: the noise levels, latent normalization, guidance "
             "dropout.";
  }
  return "?";
}

std::string_view value_type_name(ValueType type) {
  switch (type) {
    case ValueType::Integer:
      return "integer";
    case ValueType::Number:
      return "number";
    case ValueType::Boolean:
      return "bool";
    case ValueType::String:
      return "string";
    case ValueType::Choice:
      return "choice";
    case ValueType::List:
      return "list";
  }
  return "?";
}

std::string_view model_scope_name(ModelScope scope) {
  switch (scope) {
    case ModelScope::All:
      return "all";
    case ModelScope::Gpt:
      return "gpt";
    case ModelScope::Flux:
      return "flux";
  }
  return "?";
}

bool ConfigKey::applies_to(const TrainConfig& config) const {
  return models == ModelScope::All || (models == ModelScope::Flux) == config.is_flux();
}

std::span<const ConfigKey> config_keys() {
  static const std::vector<ConfigKey> keys = build_keys();
  return keys;
}

const ConfigKey* find_config_key(std::string_view name) {
  for (const ConfigKey& key : config_keys()) {
    if (key.name == name) return &key;
  }
  return nullptr;
}

std::span<const FlagAlias> flag_aliases() {
  return kAliases;
}

std::string unknown_key_advice(std::string_view name) {
  for (const FlagAlias& alias : kAliases) {
    if (alias.flag == name) {
      return fmt::format("did you mean '{}'? (nanochat's {}{})", alias.key, alias.flag,
                         alias.in_tokens ? ", in tokens" : "");
    }
  }
  for (const ValueAdvice& entry : kNameAdvice) {
    if (entry.value == name) return std::string(entry.advice);
  }
  // The closest key, when close enough to be a typo, or one that contains the name (a
  // shortened key).
  const size_t typo_distance = std::max<size_t>(2, name.size() / 3);
  const ConfigKey* best = nullptr;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const ConfigKey& key : config_keys()) {
    const size_t distance = edit_distance(name, key.name);
    const bool shortened = name.size() >= 4 && key.name.find(name) != std::string_view::npos;
    if ((distance <= typo_distance || shortened) && distance < best_distance) {
      best = &key;
      best_distance = distance;
    }
  }
  return best != nullptr ? fmt::format("did you mean '{}'?", best->name) : std::string();
}

}  // namespace fp8t
