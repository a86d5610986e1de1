#include "data/flux_shapes.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <numbers>
#include <random>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"

namespace fp8t::data {

namespace {

// In the order of kFluxShapesPositions and kFluxShapesKinds.
enum Position : int { Left, Right, Top, Bottom, Centre };
enum Kind : int { Circle, Square, Triangle };

struct PlacedShape {
  int colour;    // index into kFluxShapesColours
  int kind;      // index into kFluxShapesKinds
  int position;  // index into kFluxShapesPositions
  int centre_x, centre_y, radius;
};

constexpr int kPadWord = static_cast<int>(std::size(kFluxShapesWords));

uint64_t fnv1a(std::string_view text) {
  uint64_t hash = 14695981039346656037ull;
  for (char c : text) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 1099511628211ull;
  }
  return hash;
}

// count components uniform in [−√3, √3) · scale, seeded by name (see the header).
void fill_fixed_vector(float* out, int64_t count, std::string_view name, double scale = 1.0) {
  std::mt19937_64 generator(fnv1a(name));
  for (int64_t i = 0; i < count; ++i) {
    const double u = static_cast<double>(generator() >> 11) * 0x1.0p-53;
    out[i] = static_cast<float>((2.0 * u - 1.0) * std::numbers::sqrt3 * scale);
  }
}

int word_index(std::string_view word) {
  for (int i = 0; i < kPadWord; ++i) {
    if (kFluxShapesWords[i] == word) return i;
  }
  return -1;
}

std::vector<PlacedShape> compose_scene(const FluxShapesOptions& options, int64_t index) {
  const auto index_bits = static_cast<uint64_t>(index);
  std::seed_seq seeds{static_cast<uint32_t>(options.seed),
                      static_cast<uint32_t>(options.seed >> 32), static_cast<uint32_t>(index_bits),
                      static_cast<uint32_t>(index_bits >> 32)};
  std::mt19937_64 generator(seeds);
  const auto draw = [&](int count) { return static_cast<int>(generator() % uint64_t(count)); };

  std::vector<int> positions;
  if (draw(2) == 0) {
    positions = {draw(static_cast<int>(std::size(kFluxShapesPositions)))};
  } else if (draw(2) == 0) {  // a pair on opposite sides never overlaps
    positions = {Left, Right};
  } else {
    positions = {Top, Bottom};
  }
  const int q = options.image_size / 16;
  constexpr int kRegionCentres[][2] = {{4, 8}, {12, 8}, {8, 4}, {8, 12}, {8, 8}};  // × q
  std::vector<PlacedShape> shapes;
  for (int position : positions) {
    PlacedShape shape{};
    shape.position = position;
    shape.colour = draw(static_cast<int>(std::size(kFluxShapesColours)));
    shape.kind = draw(static_cast<int>(std::size(kFluxShapesKinds)));
    shape.centre_x = kRegionCentres[position][0] * q + draw(2 * q + 1) - q;
    shape.centre_y = kRegionCentres[position][1] * q + draw(2 * q + 1) - q;
    shape.radius = 2 * q + draw(q + 1);
    shapes.push_back(shape);
  }
  return shapes;
}

// Whether the shape covers the point (x, y) (pixel centres are at half-integers).
bool covers(const PlacedShape& shape, double x, double y) {
  const double dx = x - shape.centre_x, dy = y - shape.centre_y, r = shape.radius;
  switch (shape.kind) {
    case Circle:
      return dx * dx + dy * dy < r * r;
    case Square:
      return std::fabs(dx) < r && std::fabs(dy) < r;
    case Triangle:  // apex at (0, −r), base from (−r, r) to (r, r)
      return dy < r && std::fabs(dx) < (dy + r) / 2;
  }
  return false;
}

RgbImage draw_scene(const std::vector<PlacedShape>& shapes, int size) {
  RgbImage image{size, size, std::vector<uint8_t>(size_t(size) * size_t(size) * 3, 0)};
  for (int y = 0; y < size; ++y) {
    for (int x = 0; x < size; ++x) {
      for (const PlacedShape& shape : shapes) {
        if (!covers(shape, x + 0.5, y + 0.5)) continue;
        const auto& rgb = kFluxShapesColours[size_t(shape.colour)].rgb;
        std::copy(rgb.begin(), rgb.end(), image.pixels.begin() + (ptrdiff_t(y) * size + x) * 3);
      }
    }
  }
  return image;
}

std::string describe(const std::vector<PlacedShape>& shapes) {
  std::vector<std::string> parts;
  for (const PlacedShape& shape : shapes) {
    parts.push_back(fmt::format("a {} {} {}", kFluxShapesColours[size_t(shape.colour)].name,
                                kFluxShapesKinds[size_t(shape.kind)],
                                kFluxShapesPositionPhrases[size_t(shape.position)]));
  }
  return fmt::format("{}", fmt::join(parts, " and "));
}

}  // namespace

void FluxShapesOptions::validate() const {
  const auto fail = [](const std::string& message) { throw ConfigError(message); };
  if (image_size < 16 || image_size % 16 != 0) {
    fail(fmt::format("image_size: must be a positive multiple of 16, found {}", image_size));
  }
  if (text_tokens < kFluxShapesLongestCaption) {
    fail(fmt::format("text_tokens: must be at least {} (the longest caption), found {}",
                     kFluxShapesLongestCaption, text_tokens));
  }
  if (context_dim < 1) fail(fmt::format("context_dim: must be at least 1, found {}", context_dim));
  if (pooled_dim < 1) fail(fmt::format("pooled_dim: must be at least 1, found {}", pooled_dim));
}

FluxShapesDataset::FluxShapesDataset(const FluxShapesOptions& options) : options_(options) {
  options_.validate();
  const int64_t width = options_.context_dim;
  word_vectors_.resize(size_t((kPadWord + 1) * width));
  for (int word = 0; word <= kPadWord; ++word) {
    fill_fixed_vector(word_vectors_.data() + word * width, width,
                      word == kPadWord ? std::string_view("<pad>") : kFluxShapesWords[word]);
  }
  position_vectors_.resize(size_t(options_.text_tokens * width));
  for (int k = 0; k < options_.text_tokens; ++k) {
    fill_fixed_vector(position_vectors_.data() + k * width, width, fmt::format("<position {}>", k));
  }
  // Entries of variance 1 / context_dim keep P · m at the scale of m.
  projection_.resize(size_t(options_.pooled_dim * width));
  fill_fixed_vector(projection_.data(), int64_t(projection_.size()), "<pooled projection>",
                    1.0 / std::sqrt(double(width)));
  empty_ = encode_words({});
}

int64_t FluxShapesDataset::latent_numel() const {
  return int64_t{kFluxShapesLatentChannels} * options_.image_size * options_.image_size;
}

void FluxShapesDataset::sample(int64_t index, FluxSample& out) const {
  FP8T_CHECK(index >= 0, "expected a sample index >= 0, found {}", index);
  const std::vector<PlacedShape> shapes = compose_scene(options_, index);
  out.latent = encode(draw_scene(shapes, options_.image_size));
  out.caption = describe(shapes);
  CaptionEncoding encoding = encode_caption(out.caption);
  out.txt = std::move(encoding.txt);
  out.pooled = std::move(encoding.pooled);
}

RgbImage FluxShapesDataset::render(int64_t index) const {
  FP8T_CHECK(index >= 0, "expected a sample index >= 0, found {}", index);
  return draw_scene(compose_scene(options_, index), options_.image_size);
}

std::vector<float> FluxShapesDataset::encode(const RgbImage& image) const {
  const int size = options_.image_size;
  FP8T_CHECK(image.width == size && image.height == size &&
                 image.pixels.size() == size_t(size) * size_t(size) * 3,
             "expected a {}×{} RGB image, found {}×{} with {} bytes", size, size, image.width,
             image.height, image.pixels.size());
  const size_t plane = size_t(size) * size_t(size);
  std::vector<float> latent(plane * kFluxShapesLatentChannels);
  const auto unit = [](double value) { return static_cast<float>(value / 127.5 - 1.0); };
  for (size_t i = 0; i < plane; ++i) {
    const uint8_t* rgb = image.pixels.data() + 3 * i;
    for (size_t c = 0; c < 3; ++c)
      latent[c * plane + i] = unit(rgb[c]);
    latent[3 * plane + i] = unit(0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]);
  }
  return latent;
}

RgbImage FluxShapesDataset::decode(std::span<const float> latent) const {
  FP8T_CHECK(int64_t(latent.size()) == latent_numel(), "expected a latent of {} values, found {}",
             latent_numel(), latent.size());
  const int size = options_.image_size;
  const size_t plane = size_t(size) * size_t(size);
  RgbImage image{size, size, std::vector<uint8_t>(plane * 3)};
  for (size_t i = 0; i < plane; ++i) {
    for (size_t c = 0; c < 3; ++c) {
      // fmin / fmax map NaN (a diverged sample) to black rather than to undefined behaviour.
      const double value = std::fmin(1.0, std::fmax(-1.0, double(latent[c * plane + i])));
      image.pixels[3 * i + c] = static_cast<uint8_t>(std::lround((value + 1.0) * 127.5));
    }
  }
  return image;
}

CaptionEncoding FluxShapesDataset::encode_caption(std::string_view caption) const {
  std::vector<int> words;
  for (size_t start = 0; start < caption.size();) {
    const size_t end = std::min(caption.find(' ', start), caption.size());
    const std::string_view word = caption.substr(start, end - start);
    const int index = word_index(word);
    // A user's prompt: the message names the word, not this line.
    if (index < 0) {
      throw Error(fmt::format("caption '{}': unknown word '{}'; known: {}", caption, word,
                              fmt::join(kFluxShapesWords, ", ")));
    }
    words.push_back(index);
    start = end + 1;
  }
  if (int64_t(words.size()) > options_.text_tokens) {
    throw Error(fmt::format("caption '{}': expected at most {} words (text_tokens), found {}",
                            caption, options_.text_tokens, words.size()));
  }
  return encode_words(words);
}

CaptionEncoding FluxShapesDataset::encode_words(std::span<const int> words) const {
  const int64_t width = options_.context_dim;
  const auto vector_of = [&](int word) { return word_vectors_.data() + word * width; };
  CaptionEncoding encoding;
  encoding.txt.resize(size_t(options_.text_tokens * width));
  for (int64_t k = 0; k < options_.text_tokens; ++k) {
    const float* word = vector_of(k < int64_t(words.size()) ? words[size_t(k)] : kPadWord);
    const float* position = position_vectors_.data() + k * width;
    for (int64_t i = 0; i < width; ++i) {
      encoding.txt[size_t(k * width + i)] =
          static_cast<float>((double(word[i]) + double(position[i])) / std::numbers::sqrt2);
    }
  }

  std::vector<double> mean(size_t(width), 0.0);
  const std::vector<int> pad_only{kPadWord};
  const std::span<const int> pooled_words = words.empty() ? std::span<const int>(pad_only) : words;
  for (int word : pooled_words) {
    for (int64_t i = 0; i < width; ++i)
      mean[size_t(i)] += vector_of(word)[i] / double(pooled_words.size());
  }
  std::vector<double> projected(size_t(options_.pooled_dim), 0.0);
  double sum_squares = 0.0;
  for (size_t row = 0; row < projected.size(); ++row) {
    for (int64_t i = 0; i < width; ++i)
      projected[row] += projection_[row * size_t(width) + size_t(i)] * mean[size_t(i)];
    sum_squares += projected[row] * projected[row];
  }
  const double rms = std::sqrt(sum_squares / double(projected.size()));
  encoding.pooled.resize(projected.size());
  for (size_t row = 0; row < projected.size(); ++row) {
    encoding.pooled[row] = static_cast<float>(rms > 0.0 ? projected[row] / rms : 0.0);
  }
  return encoding;
}

}  // namespace fp8t::data
