// The built-in Flux dataset: procedural pictures of one or two coloured shapes with captions
// that say what is where ("a red circle on the left and a blue square on the right"), so that a
// tiny Flux model can be seen to learn text-to-image without anything downloaded. Sample i is a
// function of (seed, i) alone; the dataset is unbounded.
//
// Pictures. image_size² RGB on black; S = image_size, q = S / 16. One shape (half the samples)
// sits at one of left (4q, 8q), right (12q, 8q), top (8q, 4q), bottom (8q, 12q), centre (8q, 8q)
// (x, y); two shapes sit left and right, or top and bottom. Each centre moves by up to ±q on both
// axes; each shape has a radius r of 2q .. 3q and fills the 2r × 2r box around its centre
// differently: a square fills it, a circle is inscribed, a triangle has its apex at the middle of
// the box's top and its base along the box's bottom. A pixel takes the colour of the shape that
// covers its centre; shapes never overlap. Colours: kFluxShapesColours. Draws, from
// std::mt19937_64 seeded with std::seed_seq{seed low, seed high, index low, index high} (32-bit
// halves), as g() % n: shape count, the pair's axis, or the single shape's position, then per
// shape colour, kind, x jitter, y jitter, radius.
//
// Latents (no VAE): [4, S, S] fp32, channels R, G, B and luma (0.299 R + 0.587 G + 0.114 B),
// each value v in [0, 255] mapped to v / 127.5 − 1 in [−1, 1]. Four channels at full resolution, so
// Flux's 2×2 packing gives (S/2)² tokens of 16 features (flux_tiny's in_channels). Lossless: decode
// reads R, G, B back (clamped to [−1, 1], rounded).
//
// Captions (no text encoder): every word of the vocabulary (kFluxShapesWords) and the pad word
// "<pad>" have a fixed vector v(word) of width context_dim, each component uniform in [−√3, √3)
// (variance 1) from std::mt19937_64 seeded with the word's 64-bit FNV-1a hash, as
// (g() >> 11) · 2^−53 scaled; position k likewise has p(k), seeded with the hash of
// "<position k>". The T5-like sequence [text_tokens, context_dim] has token k = (v(word_k) +
// p(k)) / √2, word_k = "<pad>" after the caption's words (the positions let a model tell "a red
// circle ... and a blue square" from "a blue circle ... and a red square", since Flux gives text
// tokens no RoPE positions). The CLIP-like pooled vector [pooled_dim] is P · m scaled to an RMS
// of 1, m the mean of v over the caption's words (v("<pad>") for the empty caption), P
// [pooled_dim, context_dim] fixed the same way (seed "<pooled projection>"). None of this
// depends on the dataset's seed.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fp8t::data {

inline constexpr int kFluxShapesLatentChannels = 4;  // R, G, B, luma

struct NamedColour {
  std::string_view name;
  std::array<uint8_t, 3> rgb;
};

inline constexpr NamedColour kFluxShapesColours[] = {{"red", {220, 40, 40}},
                                                     {"green", {40, 180, 60}},
                                                     {"blue", {50, 90, 230}},
                                                     {"yellow", {235, 205, 40}}};
inline constexpr std::string_view kFluxShapesKinds[] = {"circle", "square", "triangle"};
// Where a shape sits, with the words that say it.
inline constexpr std::string_view kFluxShapesPositions[] = {"left", "right", "top", "bottom",
                                                            "centre"};
inline constexpr std::string_view kFluxShapesPositionPhrases[] = {
    "on the left", "on the right", "at the top", "at the bottom", "in the centre"};
inline constexpr std::string_view kFluxShapesWords[] = {
    "a",      "and",    "on",  "at",    "in",   "the",    "left",   "right",  "top",
    "bottom", "centre", "red", "green", "blue", "yellow", "circle", "square", "triangle"};
inline constexpr int kFluxShapesLongestCaption = 12;  // words: two shapes, "on the left/right"

struct FluxShapesOptions {
  int image_size = 32;   // pixels per side; a multiple of 16
  int text_tokens = 16;  // L_txt; at least kFluxShapesLongestCaption
  int context_dim = 32;  // width of a text token: the model's context_in_dim (flux_tiny: 32)
  int pooled_dim = 16;   // width of the pooled vector: the model's vec_in_dim (flux_tiny: 16)
  uint64_t seed = 0;

  // Throws ConfigError naming the field when a value is out of range.
  void validate() const;
};

struct RgbImage {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> pixels;  // [height, width, 3]
};

struct CaptionEncoding {
  std::vector<float> txt;     // [text_tokens, context_dim]
  std::vector<float> pooled;  // [pooled_dim]
};

struct FluxSample {
  std::vector<float> latent;  // [4, image_size, image_size]
  std::vector<float> txt;     // [text_tokens, context_dim]
  std::vector<float> pooled;  // [pooled_dim]
  std::string caption;
};

class FluxShapesDataset {
 public:
  explicit FluxShapesDataset(const FluxShapesOptions& options);

  const FluxShapesOptions& options() const { return options_; }
  int64_t latent_numel() const;

  // Fills out with sample `index` (>= 0).
  void sample(int64_t index, FluxSample& out) const;
  RgbImage render(int64_t index) const;

  // The layout above, both ways. decode expects latent_numel() values.
  std::vector<float> encode(const RgbImage& image) const;
  RgbImage decode(std::span<const float> latent) const;

  // Words separated by single spaces, each from kFluxShapesWords, at most text_tokens of them;
  // throws fp8t::Error naming the first word that is not.
  CaptionEncoding encode_caption(std::string_view caption) const;
  // The empty caption's encodings, for classifier-free-guidance dropout and sampling.
  const CaptionEncoding& empty_encodings() const { return empty_; }

 private:
  FluxShapesOptions options_;
  std::vector<float> word_vectors_;      // [words + 1 (pad last), context_dim]
  std::vector<float> position_vectors_;  // [text_tokens, context_dim]
  std::vector<float> projection_;        // [pooled_dim, context_dim]
  CaptionEncoding empty_;

  CaptionEncoding encode_words(std::span<const int> words) const;
};

}  // namespace fp8t::data
