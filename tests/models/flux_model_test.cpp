#include "models/flux_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "numerics/test_util.h"

namespace fp8t {
namespace {

using test::TestRng;
using Values = std::vector<double>;

FluxConfig tiny_config(bool guidance = false) {
  FluxConfig config = FluxConfig::preset("flux_tiny");
  config.guidance_embed = guidance;
  return config;
}

// Wide enough for the FP8 policy (min_dim 128), with a block between the first and the last.
FluxConfig fp8_config() {
  FluxConfig config = tiny_config();
  config.hidden_size = 128;
  config.axes_dim = {16, 24, 24};
  config.double_blocks = 2;
  return config;
}

// One micro-batch: 2 samples of a 2×4 latent grid (8 image tokens) and 3 text tokens.
struct Batch {
  static constexpr int64_t kSamples = 2, kRows = 2, kCols = 4, kTxtTokens = 3;
  static constexpr int64_t kImgTokens = kRows * kCols;
  std::vector<float> img, img_ids, txt, y, timesteps, guidance;

  FluxInputs inputs() const {
    return {img.data(), img_ids.data(),   txt.data(),
            y.data(),   timesteps.data(), guidance.empty() ? nullptr : guidance.data()};
  }
};

std::vector<float> uniform(TestRng& rng, int64_t n, double lo = -1.0, double hi = 1.0) {
  std::vector<float> values(static_cast<size_t>(n));
  for (float& value : values)
    value = static_cast<float>(rng.uniform(lo, hi));
  return values;
}

Batch random_batch(const FluxConfig& config, TestRng& rng) {
  Batch batch;
  const int64_t B = Batch::kSamples;
  batch.img = uniform(rng, B * Batch::kImgTokens * config.in_channels);
  for (int64_t row = 0; row < Batch::kRows; ++row) {
    for (int64_t col = 0; col < Batch::kCols; ++col)
      batch.img_ids.insert(batch.img_ids.end(), {0.0f, float(row), float(col)});
  }
  batch.txt = uniform(rng, B * Batch::kTxtTokens * config.context_in_dim);
  batch.y = uniform(rng, B * config.vec_in_dim);
  batch.timesteps = uniform(rng, B, 0.0, 1.0);
  if (config.guidance_embed) batch.guidance = uniform(rng, B, 1.0, 5.0);
  return batch;
}

FluxModel make_model(const FluxConfig& config, const FluxPrecision& precision) {
  return FluxModel(config, Batch::kSamples, Batch::kImgTokens, Batch::kTxtTokens, precision);
}

int64_t prediction_size(const FluxConfig& config) {
  return Batch::kSamples * Batch::kImgTokens * config.in_channels;
}

// Every weight and bias uniform in ±1/√in (modulation and final layer included, unlike the
// initialization, so that every gradient path carries signal) and norm scales around 1.
void randomize(FluxModel& model, TestRng& rng) {
  for (const FluxLinear& linear : flux_linears(model.config())) {
    const double bound = 1.0 / std::sqrt(double(linear.in_features));
    for (const char* part : {".weight", ".bias"}) {
      TensorView& view = model.parameters()[linear.name + part];
      const std::vector<float> values = uniform(rng, view.numel(), -bound, bound);
      std::copy(values.begin(), values.end(), view.data<float>());
    }
  }
  for (const FluxParam& param : flux_parameters(model.config())) {
    if (param.kind != FluxParamKind::NormScale) continue;
    const std::vector<float> values = uniform(rng, param.numel(), 0.5, 1.5);
    std::copy(values.begin(), values.end(), model.parameters()[param.name].data<float>());
  }
  model.weights_changed();
}

double norm(const Values& values) {
  double sum = 0.0;
  for (double value : values)
    sum += value * value;
  return std::sqrt(sum);
}

template <typename A, typename B>
double relative_error(const std::vector<A>& actual, const std::vector<B>& expected) {
  Values difference(expected.size()), reference(expected.begin(), expected.end());
  for (size_t i = 0; i < expected.size(); ++i)
    difference[i] = double(actual[i]) - double(expected[i]);
  return norm(difference) / norm(reference);
}

std::vector<float> values_of(const TensorView& view) {
  const float* data = view.data<float>();
  return std::vector<float>(data, data + view.numel());
}

// BFL flux1's Flux.forward written out directly, in double, from the parameters by name: the
// reference for the model's forward. Tensors are row-major Values with their sizes at hand.
class ReferenceFlux {
 public:
  ReferenceFlux(const FluxConfig& config, const FluxParameterSet& params)
      : config_(config), params_(params) {}

  Values forward(const Batch& in) const {
    const int64_t B = Batch::kSamples, Li = Batch::kImgTokens, Lt = Batch::kTxtTokens;
    Values vec = embedder("time_in", sinusoid(in.timesteps));
    if (config_.guidance_embed) add(vec, embedder("guidance_in", sinusoid(in.guidance)));
    add(vec, embedder("vector_in", Values(in.y.begin(), in.y.end())));
    const Values vec_act = silu(vec);
    Values img = linear(Values(in.img.begin(), in.img.end()), "img_in");
    Values txt = linear(Values(in.txt.begin(), in.txt.end()), "txt_in");
    Values ids(static_cast<size_t>(Lt * 3), 0.0);  // text ids are zero
    ids.insert(ids.end(), in.img_ids.begin(), in.img_ids.end());

    for (int block = 0; block < config_.double_blocks; ++block) {
      const std::string prefix = "double_blocks." + std::to_string(block) + ".";
      const Values img_mod = linear(vec_act, prefix + "img_mod.lin");
      const Values txt_mod = linear(vec_act, prefix + "txt_mod.lin");
      const Values img_qkv = linear(modulate(img, img_mod, 6, 0, 1), prefix + "img_attn.qkv");
      const Values txt_qkv = linear(modulate(txt, txt_mod, 6, 0, 1), prefix + "txt_attn.qkv");
      const auto part = [&](const Values& qkv, int index, const std::string& norm) {
        Values x = columns(qkv, 3 * hidden(), index * hidden(), hidden());
        return norm.empty() ? x : qk_norm(x, prefix + norm);
      };
      const Values q = concat(part(txt_qkv, 0, "txt_attn.norm.query_norm.scale"), Lt,
                              part(img_qkv, 0, "img_attn.norm.query_norm.scale"), Li);
      const Values k = concat(part(txt_qkv, 1, "txt_attn.norm.key_norm.scale"), Lt,
                              part(img_qkv, 1, "img_attn.norm.key_norm.scale"), Li);
      const Values v = concat(part(txt_qkv, 2, ""), Lt, part(img_qkv, 2, ""), Li);
      const Values attn = attention(q, k, v, ids);
      const auto [txt_attn, img_attn] = split(attn, Lt, Li);
      gated_add(img, linear(img_attn, prefix + "img_attn.proj"), img_mod, 6, 2);
      gated_add(txt, linear(txt_attn, prefix + "txt_attn.proj"), txt_mod, 6, 2);
      gated_add(img, mlp(modulate(img, img_mod, 6, 3, 4), prefix + "img_mlp"), img_mod, 6, 5);
      gated_add(txt, mlp(modulate(txt, txt_mod, 6, 3, 4), prefix + "txt_mlp"), txt_mod, 6, 5);
    }
    Values x = concat(txt, Lt, img, Li);
    const int64_t C = hidden(), M = config_.mlp_hidden();
    for (int block = 0; block < config_.single_blocks; ++block) {
      const std::string prefix = "single_blocks." + std::to_string(block) + ".";
      const Values mod = linear(vec_act, prefix + "modulation.lin");
      const Values projected = linear(modulate(x, mod, 3, 0, 1), prefix + "linear1");
      const Values q =
          qk_norm(columns(projected, 3 * C + M, 0, C), prefix + "norm.query_norm.scale");
      const Values k = qk_norm(columns(projected, 3 * C + M, C, C), prefix + "norm.key_norm.scale");
      const Values v = columns(projected, 3 * C + M, 2 * C, C);
      const Values attn = attention(q, k, v, ids);
      const Values mlp_act = gelu(columns(projected, 3 * C + M, 3 * C, M));
      Values linear2_in;
      for (int64_t row = 0; row < B * (Lt + Li); ++row) {
        linear2_in.insert(linear2_in.end(), attn.begin() + row * C, attn.begin() + (row + 1) * C);
        linear2_in.insert(linear2_in.end(), mlp_act.begin() + row * M,
                          mlp_act.begin() + (row + 1) * M);
      }
      gated_add(x, linear(linear2_in, prefix + "linear2"), mod, 3, 2);
    }
    img = split(x, Lt, Li).second;
    const Values final_mod = linear(vec_act, "final_layer.adaLN_modulation.1");
    return linear(modulate(img, final_mod, 2, 0, 1), "final_layer.linear");
  }

 private:
  int64_t hidden() const { return config_.hidden_size; }

  static void add(Values& x, const Values& y) {
    for (size_t i = 0; i < x.size(); ++i)
      x[i] += y[i];
  }

  // x [rows, in] → x·Wᵀ + b [rows, out]
  Values linear(const Values& x, const std::string& name) const {
    const TensorView& weight = params_[name + ".weight"];
    const float* w = weight.data<float>();
    const float* b = params_[name + ".bias"].data<float>();
    const int64_t out = weight.dim(0), in = weight.dim(1), rows = int64_t(x.size()) / in;
    Values y(static_cast<size_t>(rows * out));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < out; ++o) {
        double sum = b[o];
        for (int64_t i = 0; i < in; ++i)
          sum += x[r * in + i] * w[o * in + i];
        y[r * out + o] = sum;
      }
    }
    return y;
  }

  static Values silu(Values x) {
    for (double& value : x)
      value = value / (1.0 + std::exp(-value));
    return x;
  }

  static Values gelu(Values x) {
    for (double& value : x) {
      value = 0.5 * value *
              (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) *
                               (value + 0.044715 * value * value * value)));
    }
    return x;
  }

  Values embedder(const std::string& name, const Values& input) const {
    return linear(silu(linear(input, name + ".in_layer")), name + ".out_layer");
  }
  Values mlp(const Values& x, const std::string& name) const {
    return linear(gelu(linear(x, name + ".0")), name + ".2");
  }

  // [cos(1000 t f_i) ..., sin(1000 t f_i) ...] with f_i = 10000^(-i / 128)
  Values sinusoid(const std::vector<float>& t) const {
    const int64_t half = config_.timestep_dim() / 2;
    Values out;
    for (float time : t) {
      Values row(static_cast<size_t>(2 * half));
      for (int64_t i = 0; i < half; ++i) {
        const double angle =
            1000.0 * time * std::exp(-std::log(10000.0) * double(i) / double(half));
        row[i] = std::cos(angle);
        row[half + i] = std::sin(angle);
      }
      out.insert(out.end(), row.begin(), row.end());
    }
    return out;
  }

  // LN(x)·(1 + scale) + shift, LN without affine (eps 1e-6); shift and scale are chunks of a
  // modulation output mod [B, chunks·C].
  Values modulate(const Values& x, const Values& mod, int chunks, int shift, int scale) const {
    const int64_t C = hidden(), rows = int64_t(x.size()) / C;
    const int64_t tokens = rows / Batch::kSamples;
    Values out(x.size());
    for (int64_t r = 0; r < rows; ++r) {
      const double* row = x.data() + r * C;
      double mean = 0.0, variance = 0.0;
      for (int64_t c = 0; c < C; ++c)
        mean += row[c] / double(C);
      for (int64_t c = 0; c < C; ++c)
        variance += (row[c] - mean) * (row[c] - mean) / double(C);
      const double* m = mod.data() + (r / tokens) * chunks * C;
      for (int64_t c = 0; c < C; ++c) {
        const double normed = (row[c] - mean) / std::sqrt(variance + 1e-6);
        out[r * C + c] = normed * (1.0 + m[scale * C + c]) + m[shift * C + c];
      }
    }
    return out;
  }

  void gated_add(Values& x, const Values& branch, const Values& mod, int chunks, int gate) const {
    const int64_t C = hidden(), tokens = int64_t(x.size()) / C / Batch::kSamples;
    for (size_t i = 0; i < x.size(); ++i) {
      const int64_t b = int64_t(i) / C / tokens, c = int64_t(i) % C;
      x[i] += mod[(b * chunks + gate) * C + c] * branch[i];
    }
  }

  static Values columns(const Values& x, int64_t width, int64_t first, int64_t count) {
    Values out;
    for (size_t row = 0; row < x.size() / size_t(width); ++row) {
      const auto begin = x.begin() + int64_t(row) * width + first;
      out.insert(out.end(), begin, begin + count);
    }
    return out;
  }

  // [B, La, ·] and [B, Lb, ·] → [B, La + Lb, ·]
  static Values concat(const Values& a, int64_t a_tokens, const Values& b, int64_t b_tokens) {
    const int64_t width = int64_t(a.size()) / (Batch::kSamples * a_tokens);
    Values out;
    for (int64_t s = 0; s < Batch::kSamples; ++s) {
      out.insert(out.end(), a.begin() + s * a_tokens * width,
                 a.begin() + (s + 1) * a_tokens * width);
      out.insert(out.end(), b.begin() + s * b_tokens * width,
                 b.begin() + (s + 1) * b_tokens * width);
    }
    return out;
  }

  static std::pair<Values, Values> split(const Values& x, int64_t a_tokens, int64_t b_tokens) {
    const int64_t width = int64_t(x.size()) / (Batch::kSamples * (a_tokens + b_tokens));
    Values a, b;
    for (int64_t s = 0; s < Batch::kSamples; ++s) {
      const auto sample = x.begin() + s * (a_tokens + b_tokens) * width;
      a.insert(a.end(), sample, sample + a_tokens * width);
      b.insert(b.end(), sample + a_tokens * width, sample + (a_tokens + b_tokens) * width);
    }
    return {a, b};
  }

  // Per head: x / √(mean(x²) + 1e-6) · scale
  Values qk_norm(Values x, const std::string& scale_name) const {
    const float* scale = params_[scale_name].data<float>();
    const int64_t D = config_.head_dim();
    for (size_t head = 0; head < x.size() / size_t(D); ++head) {
      double* row = x.data() + head * size_t(D);
      double mean_square = 0.0;
      for (int64_t i = 0; i < D; ++i)
        mean_square += row[i] * row[i] / double(D);
      for (int64_t i = 0; i < D; ++i)
        row[i] = row[i] / std::sqrt(mean_square + 1e-6) * scale[i];
    }
    return x;
  }

  // Turns the pairs (x[2i], x[2i+1]) of each head by id_axis · θ^(-2j/d_axis), j counting the
  // pairs within each axis of width d_axis.
  Values rope(Values x, const Values& ids) const {
    const int64_t C = hidden(), D = config_.head_dim(), L = int64_t(ids.size()) / 3;
    for (size_t row = 0; row < x.size() / size_t(C); ++row) {
      const int64_t token = int64_t(row) % L;
      for (int64_t h = 0; h < config_.num_heads; ++h) {
        double* head = x.data() + int64_t(row) * C + h * D;
        int64_t pair = 0;
        for (int axis = 0; axis < 3; ++axis) {
          const int width = config_.axes_dim[static_cast<size_t>(axis)];
          for (int j = 0; j < width / 2; ++j, ++pair) {
            const double angle =
                ids[token * 3 + axis] * std::pow(config_.rope_theta, -2.0 * j / width);
            const double x0 = head[2 * pair], x1 = head[2 * pair + 1];
            head[2 * pair] = x0 * std::cos(angle) - x1 * std::sin(angle);
            head[2 * pair + 1] = x0 * std::sin(angle) + x1 * std::cos(angle);
          }
        }
      }
    }
    return x;
  }

  // softmax(q kᵀ / √D) v per sample and head, no mask, after RoPE on q and k.
  Values attention(const Values& q_in, const Values& k_in, const Values& v,
                   const Values& ids) const {
    const Values q = rope(q_in, ids), k = rope(k_in, ids);
    const int64_t C = hidden(), D = config_.head_dim(), L = int64_t(ids.size()) / 3;
    Values out(q.size(), 0.0);
    for (int64_t s = 0; s < Batch::kSamples; ++s) {
      for (int64_t h = 0; h < config_.num_heads; ++h) {
        for (int64_t t = 0; t < L; ++t) {
          Values scores(static_cast<size_t>(L));
          for (int64_t j = 0; j < L; ++j) {
            for (int64_t i = 0; i < D; ++i)
              scores[j] += q[(s * L + t) * C + h * D + i] * k[(s * L + j) * C + h * D + i];
            scores[j] /= std::sqrt(double(D));
          }
          const double top = *std::max_element(scores.begin(), scores.end());
          double total = 0.0;
          for (double& score : scores)
            total += (score = std::exp(score - top));
          for (int64_t j = 0; j < L; ++j) {
            for (int64_t i = 0; i < D; ++i)
              out[(s * L + t) * C + h * D + i] +=
                  scores[j] / total * v[(s * L + j) * C + h * D + i];
          }
        }
      }
    }
    return out;
  }

  const FluxConfig& config_;
  const FluxParameterSet& params_;
};

TEST(FluxModel, ParametersAreTheBflTable) {
  for (const bool guidance : {false, true}) {
    const FluxConfig config = tiny_config(guidance);
    FluxModel model = make_model(config, FluxPrecision::fp32_reference());
    const std::vector<FluxParam> expected = flux_parameters(config);
    ASSERT_EQ(model.parameters().specs().size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_EQ(model.parameters().specs()[i].name, expected[i].name);
      for (FluxParameterSet* set : {&model.parameters(), &model.gradients()}) {
        const TensorView& view = (*set)[expected[i].name];
        ASSERT_EQ(size_t(view.rank()), expected[i].shape.size()) << expected[i].name;
        for (int axis = 0; axis < view.rank(); ++axis)
          EXPECT_EQ(view.dim(axis), expected[i].shape[size_t(axis)]) << expected[i].name;
      }
    }
    EXPECT_THROW(model.parameters()["img_in.scale"], Error);
    // One linear per weight, each with its bias.
    size_t weights = 0;
    for (const FluxParam& param : expected)
      weights += param.name.ends_with(".weight");
    const std::vector<FluxLinear> linears = flux_linears(config);
    EXPECT_EQ(linears.size(), weights);
    for (const FluxLinear& linear : linears) {
      EXPECT_EQ(model.parameters()[linear.name + ".bias"].numel(), linear.out_features);
      EXPECT_EQ(model.parameters()[linear.name + ".weight"].numel(),
                linear.in_features * linear.out_features);
    }
  }
}

// Zero modulation and final layer (MODELS.md), norm scales 1, nn.Linear's U(±1/√in) elsewhere;
// so the initialized model predicts exactly zero.
TEST(FluxModel, InitializationZeroesModulationAndFinalLayer) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const FluxConfig config = tiny_config(true);
  FluxModel model = make_model(config, FluxPrecision::fp32_reference());
  model.init_weights(7);
  for (const FluxLinear& linear : flux_linears(config)) {
    const bool zero =
        linear.kind == FluxParamKind::Modulation || linear.kind == FluxParamKind::Final;
    const float bound = static_cast<float>(1.0 / std::sqrt(double(linear.in_features)));
    for (const char* part : {".weight", ".bias"}) {
      const std::vector<float> values = values_of(model.parameters()[linear.name + part]);
      const auto [low, high] = std::minmax_element(values.begin(), values.end());
      if (zero) {
        EXPECT_EQ(*low, 0.0f) << linear.name << part;
        EXPECT_EQ(*high, 0.0f) << linear.name << part;
      } else {
        EXPECT_GE(*low, -bound) << linear.name << part;
        EXPECT_LE(*high, bound) << linear.name << part;
        // Drawn over the whole range, not a narrower one.
        EXPECT_GT(*high - *low, (values.size() > 100 ? 1.9f : 0.5f) * bound) << linear.name << part;
      }
    }
  }
  for (const FluxParam& param : flux_parameters(config)) {
    if (param.kind != FluxParamKind::NormScale) continue;
    for (float value : values_of(model.parameters()[param.name]))
      EXPECT_EQ(value, 1.0f) << param.name;
  }

  FluxModel same = make_model(config, FluxPrecision::fp32_reference());
  same.init_weights(7);
  FluxModel other = make_model(config, FluxPrecision::fp32_reference());
  other.init_weights(8);
  EXPECT_EQ(values_of(same.parameters()["double_blocks.0.img_attn.qkv.weight"]),
            values_of(model.parameters()["double_blocks.0.img_attn.qkv.weight"]));
  EXPECT_NE(values_of(other.parameters()["double_blocks.0.img_attn.qkv.weight"]),
            values_of(model.parameters()["double_blocks.0.img_attn.qkv.weight"]));

  const Batch batch = random_batch(config, rng);
  std::vector<float> prediction(static_cast<size_t>(prediction_size(config)), 1.0f);
  model.forward(batch.inputs(), prediction.data());
  for (float value : prediction)
    ASSERT_EQ(value, 0.0f);
}

// A sample's prediction is a function of its own inputs: another sample's σ, guidance, text or
// latents leave it alone, bit for bit.
TEST(FluxModel, SamplesDoNotMix) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const FluxConfig config = tiny_config(true);
  FluxModel model = make_model(config, FluxPrecision::fp32_reference());
  randomize(model, rng);
  const Batch batch = random_batch(config, rng);
  const int64_t per_sample = Batch::kImgTokens * config.in_channels;
  std::vector<float> want(static_cast<size_t>(prediction_size(config)));
  model.forward(batch.inputs(), want.data());
  Batch other = batch;
  other.timesteps[1] = 1.0f - other.timesteps[1];
  other.guidance[1] += 1.0f;
  for (int64_t i = 0; i < per_sample; ++i)
    other.img[size_t(per_sample + i)] *= -1.0f;
  for (size_t i = other.txt.size() / 2; i < other.txt.size(); ++i)
    other.txt[i] *= -1.0f;
  std::vector<float> got(want.size());
  model.forward(other.inputs(), got.data());
  EXPECT_TRUE(std::equal(want.begin(), want.begin() + per_sample, got.begin()));
  EXPECT_FALSE(std::equal(want.begin() + per_sample, want.end(), got.begin() + per_sample));
}

// Each run of kInitRunValues values comes from its own generator, seeded as documented, whatever
// thread drew it; a run does not repeat another's values.
TEST(FluxModel, InitializationDrawsEachRunFromItsOwnGenerator) {
  FluxConfig config = tiny_config();
  config.hidden_size = 1024;  // img_mlp.0.weight: 4096 × 1024, four runs
  config.num_heads = 32;
  config.validate();
  Arena arena("parameters", FluxParameterSet::planned_bytes(config, DType::F32));
  FluxParameterSet parameters(arena, config, DType::F32);
  constexpr uint64_t kSeed = 0x1234'5678'9abc'def0;
  init_flux_weights(parameters, config, kSeed);

  const std::string name = "double_blocks.0.img_mlp.0.weight";
  const auto place = std::ranges::find_if(
      parameters.specs(), [&](const FluxParam& param) { return param.name == name; });
  ASSERT_NE(place, parameters.specs().end());
  const auto tensor = static_cast<uint32_t>(place - parameters.specs().begin());
  const std::vector<float> values = values_of(parameters[name]);
  const int64_t runs = std::ssize(values) / kInitRunValues;
  ASSERT_EQ(runs, 4);
  const float bound = 1.0f / std::sqrt(1024.0f);
  std::vector<float> expected(static_cast<size_t>(kInitRunValues));
  for (uint32_t run = 0; run < runs; ++run) {
    std::seed_seq seeds{static_cast<uint32_t>(kSeed), static_cast<uint32_t>(kSeed >> 32), tensor,
                        run};
    std::mt19937_64 generator(seeds);
    std::uniform_real_distribution<float> uniform(-bound, bound);
    for (float& value : expected)
      value = uniform(generator);
    const auto drawn = values.begin() + run * kInitRunValues;
    EXPECT_TRUE(std::equal(expected.begin(), expected.end(), drawn)) << "run " << run;
    if (run > 0) {
      EXPECT_FALSE(std::equal(expected.begin(), expected.end(), values.begin()));
    }
  }
}

// The model against the reference written out in double, with random weights, with and without
// the guidance embedder. fp32 against double (with the sinusoid's arguments up to 1000 in fp32,
// as BFL computes them) came within 4e-6 relative in 30 seeded runs; the bound is 3e-5.
TEST(FluxModel, ForwardMatchesTheReference) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const bool guidance : {false, true}) {
    SCOPED_TRACE(guidance ? "guidance" : "no guidance");
    FluxConfig config = tiny_config(guidance);
    config.double_blocks = 2;  // the second block reads the first one's output
    config.single_blocks = 2;
    FluxModel model = make_model(config, FluxPrecision::fp32_reference());
    randomize(model, rng);
    const Batch batch = random_batch(config, rng);
    std::vector<float> prediction(static_cast<size_t>(prediction_size(config)));
    model.forward(batch.inputs(), prediction.data());
    const Values expected = ReferenceFlux(config, model.parameters()).forward(batch);
    EXPECT_LT(relative_error(prediction, expected), 3e-5);
  }
}

TEST(FluxModel, GuidanceIsGivenExactlyWithTheGuidanceEmbedder) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const bool guidance : {false, true}) {
    const FluxConfig config = tiny_config(guidance);
    FluxModel model = make_model(config, FluxPrecision::fp32_reference());
    Batch batch = random_batch(config, rng);
    batch.guidance = guidance ? std::vector<float>{} : std::vector<float>{3.5f, 3.5f};
    std::vector<float> prediction(static_cast<size_t>(prediction_size(config)));
    EXPECT_THROW(model.forward(batch.inputs(), prediction.data()), Error) << guidance;
  }
}

// loss = Σ prediction · weights, accumulated in double.
template <typename Prediction>
double weighted_loss(const Prediction& prediction, const std::vector<float>& weights) {
  double loss = 0.0;
  for (size_t i = 0; i < weights.size(); ++i)
    loss += double(prediction[i]) * weights[i];
  return loss;
}

double weighted_loss(FluxModel& model, const Batch& batch, const std::vector<float>& weights) {
  std::vector<float> prediction(weights.size());
  model.forward(batch.inputs(), prediction.data());
  return weighted_loss(prediction, weights);
}

// The model's backward against central differences of the loss on a sample of entries of every
// parameter tensor, with random weights. The differences are taken on the double reference
// (which the forward matches, above) at the model's fp32 parameters: the fp32 forward's
// rounding (near 1e-6 of the loss) would drown the small gradients of the text stream, which
// reaches the image's prediction only through attention. In double a step of 1e-3 leaves a
// truncation error near 1e-7; what remains is the fp32 rounding of the backward, up to 3e-4 of
// the small gradients that sum cancelling terms (the modulation weights), in 40 seeded runs.
// Each tensor's sample is compared as a vector: ‖analytic − numeric‖ ≤ 2e-3·‖numeric‖.
class FluxGradients : public ::testing::TestWithParam<bool> {};

TEST_P(FluxGradients, MatchFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const FluxConfig config = tiny_config(GetParam());
  FluxModel model = make_model(config, FluxPrecision::fp32_reference());
  randomize(model, rng);
  const Batch batch = random_batch(config, rng);
  const std::vector<float> weights = uniform(rng, prediction_size(config));
  weighted_loss(model, batch, weights);
  model.zero_gradients();
  model.backward(weights.data());

  const ReferenceFlux reference(config, model.parameters());
  const auto reference_loss = [&] { return weighted_loss(reference.forward(batch), weights); };
  constexpr int kProbes = 4;
  constexpr float kStep = 1e-3f;
  for (const FluxParam& param : flux_parameters(config)) {
    float* values = model.parameters()[param.name].data<float>();
    const float* gradient = model.gradients()[param.name].data<float>();
    std::set<int64_t> probes;
    while (probes.size() < size_t(std::min<int64_t>(kProbes, param.numel())))
      probes.insert(rng.uniform_int(0, int(param.numel() - 1)));
    Values analytic, numeric;
    for (int64_t i : probes) {
      const float saved = values[i];
      values[i] = saved + kStep;
      const float up_at = values[i];  // the step as fp32 represents it
      const double up = reference_loss();
      values[i] = saved - kStep;
      const float down_at = values[i];
      const double down = reference_loss();
      values[i] = saved;
      analytic.push_back(gradient[i]);
      numeric.push_back((up - down) / (double(up_at) - double(down_at)));
    }
    ASSERT_GT(norm(numeric), 0.0) << param.name << ": no gradient reaches it";
    EXPECT_LT(relative_error(analytic, numeric), 2e-3) << param.name;
  }
}

INSTANTIATE_TEST_SUITE_P(FluxModel, FluxGradients, ::testing::Bool(),
                         [](const auto& test) { return test.param ? "Guidance" : "NoGuidance"; });

TEST(FluxModel, BackwardAccumulates) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const FluxConfig config = tiny_config();
  FluxModel model = make_model(config, FluxPrecision::fp32_reference());
  randomize(model, rng);
  const Batch batch = random_batch(config, rng);
  const std::vector<float> weights = uniform(rng, prediction_size(config));
  weighted_loss(model, batch, weights);
  model.zero_gradients();
  model.backward(weights.data());
  std::vector<std::vector<float>> once;
  for (const FluxParam& param : flux_parameters(config))
    once.push_back(values_of(model.gradients()[param.name]));
  model.backward(weights.data());
  size_t index = 0;
  for (const FluxParam& param : flux_parameters(config)) {
    std::vector<float> doubled = once[index++];
    for (float& value : doubled)
      value *= 2.0f;
    EXPECT_LT(relative_error(values_of(model.gradients()[param.name]), doubled), 1e-6)
        << param.name;
  }
}

FluxPrecision hybrid(ScalingRecipe recipe) {
  FluxPrecision precision;
  precision.fp8.mode = Fp8Mode::Hybrid;
  precision.fp8.recipe = recipe;
  precision.policy = precision_options(precision.fp8);
  precision.other_linears = ops::LinearOperands::Bf16;
  return precision;
}

bool is_block_linear(const std::string& name) {
  for (const char* suffix : {"_attn.qkv", "_attn.proj", "_mlp.0", "_mlp.2", ".linear1", ".linear2"})
    if (name.ends_with(suffix)) return true;
  return false;
}

TEST(FluxModel, Fp8PolicyTakesTheBlockLinears) {
  const PrecisionOptions options = hybrid(ScalingRecipe::Tensorwise).policy;
  // Every block linear of the 128-wide model, none of the others.
  for (const FluxLinearPrecision& decision : decide_flux_precision(fp8_config(), options)) {
    EXPECT_EQ(decision.fp8, is_block_linear(decision.linear.name)) << decision.linear.name;
    if (decision.linear.kind == FluxParamKind::Modulation) {
      EXPECT_EQ(decision.reason, "modulation stays in BF16") << decision.linear.name;
    }
  }
  // flux_tiny's 64-wide linears are under min_dim.
  for (const FluxLinearPrecision& decision : decide_flux_precision(tiny_config(), options)) {
    EXPECT_FALSE(decision.fp8) << decision.linear.name;
    if (is_block_linear(decision.linear.name)) {
      EXPECT_EQ(decision.reason, "dims < 128") << decision.linear.name;
    }
  }
  // First and last blocks in BF16: of double 0, double 1 and single 0 (block 2), only the
  // middle one stays FP8.
  PrecisionOptions edges = options;
  edges.first_last_layers_bf16 = true;
  for (const FluxLinearPrecision& decision : decide_flux_precision(fp8_config(), edges)) {
    if (!is_block_linear(decision.linear.name)) continue;
    EXPECT_EQ(decision.fp8, decision.linear.block == 1) << decision.linear.name;
    if (!decision.fp8) {
      EXPECT_EQ(decision.reason, "first/last layers in BF16") << decision.linear.name;
    }
  }
  for (const FluxLinearPrecision& decision :
       decide_flux_precision(fp8_config(), FluxPrecision::fp32_reference().policy)) {
    EXPECT_EQ(decision.reason, "fp8: none") << decision.linear.name;
  }
}

// The same weights and inputs through FP8 linears (hybrid, tensorwise; the other linears on
// bf16 operands) and through fp32: the prediction and the gradients (all of them, as one
// vector) agree to FP8 precision. Over 15 seeded runs the errors stayed under 0.7 % and 1.8 %.
TEST(FluxModel, Fp8TracksTheFp32Model) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const FluxConfig config = fp8_config();
  FluxModel reference = make_model(config, FluxPrecision::fp32_reference());
  FluxModel model = make_model(config, hybrid(ScalingRecipe::Tensorwise));
  int fp8_linears = 0;
  for (const FluxLinearPrecision& decision : model.linear_precision())
    fp8_linears += decision.fp8;
  EXPECT_EQ(fp8_linears, 2 * 2 * 4 + 2);  // 2 double blocks × 2 streams × 4, linear1 and 2

  randomize(reference, rng);
  for (const FluxParam& param : flux_parameters(config)) {
    std::memcpy(model.parameters()[param.name].raw(), reference.parameters()[param.name].raw(),
                model.parameters()[param.name].bytes());
  }
  model.weights_changed();
  const Batch batch = random_batch(config, rng);
  std::vector<float> expected(static_cast<size_t>(prediction_size(config)));
  std::vector<float> prediction(expected.size());
  reference.forward(batch.inputs(), expected.data());
  model.forward(batch.inputs(), prediction.data());
  const double error = relative_error(prediction, expected);
  EXPECT_LT(error, 0.05);
  EXPECT_GT(error, 0.0);  // the FP8 path really ran

  const std::vector<float> weights = uniform(rng, prediction_size(config));
  reference.zero_gradients();
  reference.backward(weights.data());
  model.zero_gradients();
  model.backward(weights.data());
  std::vector<float> fp8_gradient, fp32_gradient;
  for (const FluxParam& param : flux_parameters(config)) {
    const std::vector<float> fp8 = values_of(model.gradients()[param.name]);
    const std::vector<float> fp32 = values_of(reference.gradients()[param.name]);
    fp8_gradient.insert(fp8_gradient.end(), fp8.begin(), fp8.end());
    fp32_gradient.insert(fp32_gradient.end(), fp32.begin(), fp32.end());
  }
  EXPECT_LT(relative_error(fp8_gradient, fp32_gradient), 0.1);
}

TEST(FluxModel, DelayedScalingStateOfEveryFp8Linear) {
  FluxModel model = make_model(fp8_config(), hybrid(ScalingRecipe::Delayed));
  std::set<std::string> names;
  for (const auto& [name, scaling] : model.delayed_scalings()) {
    ASSERT_NE(scaling, nullptr);
    names.insert(name);
  }
  EXPECT_EQ(names.size(), 3u * (2 * 2 * 4 + 2));
  EXPECT_TRUE(names.contains("double_blocks.1.txt_attn.qkv.input"));
  EXPECT_TRUE(names.contains("single_blocks.0.linear2.grad_output"));
  EXPECT_TRUE(
      make_model(fp8_config(), hybrid(ScalingRecipe::Tensorwise)).delayed_scalings().empty());
}

}  // namespace
}  // namespace fp8t
