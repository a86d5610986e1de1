#include "data/flux_shapes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "test_files.h"

namespace fp8t::data {
namespace {

using test::Contains;
using test::error_message;

constexpr int64_t kScenes = 400;

// What one part of a caption ("a red circle on the left") says.
struct Described {
  std::string colour, kind, position;
};

std::vector<Described> parse_caption(const std::string& caption) {
  std::vector<Described> parts;
  std::istringstream words(caption);
  std::string a, colour, kind, preposition, the, position, and_word;
  while (words >> a >> colour >> kind >> preposition >> the >> position) {
    EXPECT_EQ(a, "a") << caption;
    EXPECT_EQ(the, "the") << caption;
    parts.push_back({colour, kind, position});
    if (!(words >> and_word)) break;
    EXPECT_EQ(and_word, "and") << caption;
  }
  return parts;
}

std::array<uint8_t, 3> colour_named(const std::string& name) {
  for (const NamedColour& colour : kFluxShapesColours) {
    if (colour.name == name) return colour.rgb;
  }
  ADD_FAILURE() << "no colour " << name;
  return {};
}

// The non-black pixels of one half (or all) of an image: their colours, bounding box and the
// widths of their top and bottom rows.
struct Blob {
  std::vector<std::array<uint8_t, 3>> colours;
  int min_x = std::numeric_limits<int>::max(), max_x = -1;
  int min_y = std::numeric_limits<int>::max(), max_y = -1;
  int top_width = 0, bottom_width = 0;

  double box_fill() const {
    return double(colours.size()) / double((max_x - min_x + 1) * (max_y - min_y + 1));
  }
  double centre_x() const { return (min_x + max_x + 1) / 2.0; }
  double centre_y() const { return (min_y + max_y + 1) / 2.0; }
};

Blob find_blob(const RgbImage& image, int x_begin, int x_end, int y_begin, int y_end) {
  Blob blob;
  std::vector<int> row_widths(size_t(image.height), 0);
  for (int y = y_begin; y < y_end; ++y) {
    for (int x = x_begin; x < x_end; ++x) {
      const uint8_t* p = image.pixels.data() + (size_t(y) * size_t(image.width) + size_t(x)) * 3;
      if (p[0] == 0 && p[1] == 0 && p[2] == 0) continue;
      blob.colours.push_back({p[0], p[1], p[2]});
      ++row_widths[size_t(y)];
      blob.min_x = std::min(blob.min_x, x);
      blob.max_x = std::max(blob.max_x, x);
      blob.min_y = std::min(blob.min_y, y);
      blob.max_y = std::max(blob.max_y, y);
    }
  }
  if (!blob.colours.empty()) {
    blob.top_width = row_widths[size_t(blob.min_y)];
    blob.bottom_width = row_widths[size_t(blob.max_y)];
  }
  return blob;
}

// The position whose region centre (header: left (4q, 8q) ...) is nearest to (x, y).
std::string nearest_position(double x, double y, int size) {
  const double q = size / 16.0;
  const double centres[][2] = {{4, 8}, {12, 8}, {8, 4}, {8, 12}, {8, 8}};
  size_t best = 0;
  double best_distance = std::numeric_limits<double>::max();
  for (size_t i = 0; i < std::size(centres); ++i) {
    const double distance = std::hypot(x - centres[i][0] * q, y - centres[i][1] * q);
    if (distance < best_distance) {
      best_distance = distance;
      best = i;
    }
  }
  return std::string(kFluxShapesPositions[best]);
}

TEST(FluxShapes, SamplesHaveTheConfiguredShapes) {
  FluxShapesOptions options;
  options.image_size = 48;
  options.text_tokens = 20;
  options.context_dim = 24;
  options.pooled_dim = 8;
  const FluxShapesDataset dataset(options);
  FluxSample sample;
  dataset.sample(3, sample);
  EXPECT_EQ(dataset.latent_numel(), 4 * 48 * 48);
  EXPECT_EQ(sample.latent.size(), size_t(4 * 48 * 48));
  EXPECT_EQ(sample.txt.size(), size_t(20 * 24));
  EXPECT_EQ(sample.pooled.size(), size_t(8));
  const RgbImage image = dataset.render(3);
  EXPECT_EQ(image.width, 48);
  EXPECT_EQ(image.height, 48);
  EXPECT_EQ(image.pixels.size(), size_t(48 * 48 * 3));
  EXPECT_EQ(dataset.empty_encodings().txt.size(), size_t(20 * 24));
  EXPECT_EQ(dataset.empty_encodings().pooled.size(), size_t(8));
  EXPECT_THROW(dataset.sample(-1, sample), Error);
}

TEST(FluxShapes, OptionsOutOfRangeAreRefusedByName) {
  const auto refusal = [](auto change) {
    FluxShapesOptions options;
    change(options);
    return error_message<ConfigError>([&] { FluxShapesDataset{options}; });
  };
  EXPECT_TRUE(Contains(refusal([](FluxShapesOptions& o) { o.image_size = 40; }),
                       "image_size: must be a positive multiple of 16, found 40"));
  EXPECT_TRUE(Contains(refusal([](FluxShapesOptions& o) { o.text_tokens = 11; }),
                       "text_tokens: must be at least 12 (the longest caption), found 11"));
  EXPECT_TRUE(Contains(refusal([](FluxShapesOptions& o) { o.context_dim = 0; }), "context_dim"));
  EXPECT_TRUE(Contains(refusal([](FluxShapesOptions& o) { o.pooled_dim = 0; }), "pooled_dim"));
}

TEST(FluxShapes, TheSameSeedAndIndexGiveTheSameSample) {
  FluxShapesOptions options;
  options.seed = 1234567890123ull;
  const FluxShapesDataset first(options), second(options);
  FluxSample a, b;
  for (int64_t index : {int64_t{0}, int64_t{17}, int64_t{1} << 40}) {
    first.sample(index, a);
    second.sample(index, b);
    EXPECT_EQ(a.latent, b.latent) << index;
    EXPECT_EQ(a.txt, b.txt) << index;
    EXPECT_EQ(a.pooled, b.pooled) << index;
    EXPECT_EQ(a.caption, b.caption) << index;
    EXPECT_EQ(first.render(index).pixels, second.render(index).pixels) << index;
  }
  // The images are pinned: the recipe (mt19937_64, seed_seq, g() % n) is fully specified, so a
  // change to it shows up here.
  const FluxShapesDataset seed_zero{FluxShapesOptions{}};
  seed_zero.sample(0, a);
  EXPECT_EQ(a.caption, "a yellow triangle on the left");
  seed_zero.sample(5, a);
  EXPECT_EQ(a.caption, "a red triangle on the left and a yellow circle on the right");
}

TEST(FluxShapes, IndicesAndSeedsGiveDifferentSamples) {
  const FluxShapesDataset dataset{FluxShapesOptions{}};
  FluxShapesOptions other_seed;
  other_seed.seed = 1;
  const FluxShapesDataset other(other_seed);
  std::set<std::string> images;  // pixels as bytes
  int differ_from_other_seed = 0;
  for (int64_t index = 0; index < kScenes; ++index) {
    const RgbImage image = dataset.render(index);
    images.emplace(image.pixels.begin(), image.pixels.end());
    if (image.pixels != other.render(index).pixels) ++differ_from_other_seed;
  }
  // Thousands of single-shape scenes and millions of pairs: a few repeats at most.
  EXPECT_GE(images.size(), size_t(kScenes - 5));
  EXPECT_GE(differ_from_other_seed, kScenes - 5);
}

TEST(FluxShapes, ScenesCoverEveryColourKindPositionAndCount) {
  const FluxShapesDataset dataset{FluxShapesOptions{}};
  std::set<std::string> colours, kinds, positions;
  int pairs = 0;
  FluxSample sample;
  for (int64_t index = 0; index < kScenes; ++index) {
    dataset.sample(index, sample);
    const std::vector<Described> parts = parse_caption(sample.caption);
    ASSERT_TRUE(parts.size() == 1 || parts.size() == 2) << sample.caption;
    if (parts.size() == 2) ++pairs;
    for (const Described& part : parts) {
      colours.insert(part.colour);
      kinds.insert(part.kind);
      positions.insert(part.position);
    }
  }
  EXPECT_EQ(colours.size(), std::size(kFluxShapesColours));
  EXPECT_EQ(kinds.size(), std::size(kFluxShapesKinds));
  EXPECT_EQ(positions.size(), std::size(kFluxShapesPositions));
  EXPECT_NEAR(double(pairs) / kScenes, 0.5, 0.1);
}

// The caption says what is drawn: in each shape's region (the whole image, or the half of a
// left/right or top/bottom pair) every non-black pixel has the named colour, the centre of their
// bounding box is nearest to the named position's centre, and the kind shows: a square fills its
// box, a circle's top and bottom rows are alike and it fills about π/4 of the box, a triangle's
// base row is several times wider than its apex row.
TEST(FluxShapes, CaptionsDescribeThePicture) {
  for (int size : {32, 64}) {
    FluxShapesOptions options;
    options.image_size = size;
    const FluxShapesDataset dataset(options);
    FluxSample sample;
    for (int64_t index = 0; index < kScenes; ++index) {
      dataset.sample(index, sample);
      const RgbImage image = dataset.render(index);
      const std::vector<Described> parts = parse_caption(sample.caption);
      for (size_t part = 0; part < parts.size(); ++part) {
        const Described& said = parts[part];
        const bool horizontal_pair = parts.size() == 2 && parts[0].position == "left";
        const bool vertical_pair = parts.size() == 2 && parts[0].position == "top";
        const int half = size / 2, second = part == 1 ? 1 : 0;
        const Blob blob = find_blob(image, horizontal_pair ? second * half : 0,
                                    horizontal_pair ? (second + 1) * half : size,
                                    vertical_pair ? second * half : 0,
                                    vertical_pair ? (second + 1) * half : size);
        SCOPED_TRACE(::testing::Message() << "size " << size << ", index " << index << ": "
                                          << sample.caption << ", part " << part);
        ASSERT_FALSE(blob.colours.empty());
        const std::array<uint8_t, 3> named = colour_named(said.colour);
        EXPECT_TRUE(std::all_of(blob.colours.begin(), blob.colours.end(),
                                [&](const auto& rgb) { return rgb == named; }));
        EXPECT_EQ(nearest_position(blob.centre_x(), blob.centre_y(), size), said.position);
        if (said.kind == "square") {
          EXPECT_EQ(blob.box_fill(), 1.0);
        } else if (said.kind == "circle") {
          EXPECT_EQ(blob.top_width, blob.bottom_width);
          EXPECT_NEAR(blob.box_fill(), 0.785, 0.05);
        } else {
          EXPECT_EQ(said.kind, "triangle");
          EXPECT_GE(blob.bottom_width, 3 * blob.top_width);
          EXPECT_NEAR(blob.box_fill(), 0.5, 0.1);
        }
      }
    }
  }
}

TEST(FluxShapes, LatentsDecodeToThePixelsExactly) {
  const FluxShapesDataset dataset{FluxShapesOptions{}};
  FluxSample sample;
  constexpr size_t kPlane = 32 * 32;
  for (int64_t index = 0; index < 50; ++index) {
    dataset.sample(index, sample);
    const RgbImage image = dataset.render(index);
    EXPECT_EQ(dataset.decode(sample.latent).pixels, image.pixels) << index;
    EXPECT_EQ(dataset.encode(image), sample.latent) << index;
    for (size_t i = 0; i < kPlane; ++i) {
      const uint8_t* rgb = image.pixels.data() + 3 * i;
      const double luma = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2];
      ASSERT_NEAR(sample.latent[3 * kPlane + i], luma / 127.5 - 1.0, 1e-6) << index << " " << i;
      ASSERT_NEAR(sample.latent[i], rgb[0] / 127.5 - 1.0, 1e-6) << index << " " << i;
    }
  }
  // Every byte survives the round trip; values beyond [-1, 1] (a model's sample) clamp and NaN
  // decodes to black.
  RgbImage ramp{32, 32, std::vector<uint8_t>(kPlane * 3)};
  for (size_t i = 0; i < ramp.pixels.size(); ++i)
    ramp.pixels[i] = static_cast<uint8_t>(i % 256);
  EXPECT_EQ(dataset.decode(dataset.encode(ramp)).pixels, ramp.pixels);
  std::vector<float> wild(size_t(dataset.latent_numel()), 0.0f);
  wild[0] = 3.0f;
  wild[1] = -3.0f;
  wild[2] = std::numeric_limits<float>::quiet_NaN();
  const RgbImage clamped = dataset.decode(wild);
  EXPECT_EQ(clamped.pixels[0], 255);
  EXPECT_EQ(clamped.pixels[3], 0);
  EXPECT_EQ(clamped.pixels[6], 0);
  EXPECT_EQ(clamped.pixels[9], 128);  // 0 is (0 + 1) · 127.5 = 127.5, rounded away from zero
  EXPECT_THROW(dataset.decode(std::vector<float>(12)), Error);
}

TEST(FluxShapes, CaptionEncodingsAreFixedAndDistinct) {
  const FluxShapesDataset dataset{FluxShapesOptions{}};
  FluxShapesOptions other_seed;
  other_seed.seed = 99;
  const FluxShapesDataset other(other_seed);
  FluxSample sample;
  std::set<std::vector<float>> sequences;
  std::set<std::string> captions;
  for (int64_t index = 0; index < kScenes; ++index) {
    dataset.sample(index, sample);
    const CaptionEncoding encoding = other.encode_caption(sample.caption);
    ASSERT_EQ(sample.txt, encoding.txt) << sample.caption;  // a function of the caption alone
    ASSERT_EQ(sample.pooled, encoding.pooled) << sample.caption;
    captions.insert(sample.caption);
    sequences.insert(sample.txt);
    double sum_squares = 0.0;
    for (float value : sample.pooled)
      sum_squares += double(value) * value;
    EXPECT_NEAR(sum_squares / double(sample.pooled.size()), 1.0, 1e-5);
  }
  EXPECT_EQ(sequences.size(), captions.size());

  // Swapping what goes with what changes the sequence (positions), not the bag of words.
  const CaptionEncoding one =
      dataset.encode_caption("a red circle on the left and a blue square on the right");
  const CaptionEncoding swapped =
      dataset.encode_caption("a blue circle on the left and a red square on the right");
  EXPECT_NE(one.txt, swapped.txt);
  EXPECT_EQ(one.pooled, swapped.pooled);

  // The map is pinned too: a model trained on it keeps its meaning.
  EXPECT_FLOAT_EQ(one.txt[0], dataset.encode_caption("a").txt[0]);
  const CaptionEncoding red_circle = dataset.encode_caption("a red circle");
  EXPECT_FLOAT_EQ(red_circle.txt[0], -0.489886165f);
  EXPECT_FLOAT_EQ(red_circle.txt[2 * 32 + 5], 0.0104141487f);
  EXPECT_FLOAT_EQ(red_circle.pooled[3], 0.38675189f);

  // The empty caption: pad tokens only, the same as encoding "", unlike any caption.
  const CaptionEncoding& empty = dataset.empty_encodings();
  EXPECT_EQ(empty.txt, dataset.encode_caption("").txt);
  EXPECT_EQ(empty.pooled, dataset.encode_caption("").pooled);
  EXPECT_EQ(empty.txt, other.empty_encodings().txt);
  EXPECT_EQ(sequences.count(empty.txt), 0u);
  // Past the words, a caption's tokens are the empty caption's.
  const CaptionEncoding short_caption = dataset.encode_caption("a red circle in the centre");
  const size_t width = 32;
  EXPECT_TRUE(std::equal(short_caption.txt.begin() + 6 * width, short_caption.txt.end(),
                         empty.txt.begin() + 6 * width));
  EXPECT_FALSE(
      std::equal(short_caption.txt.begin(), short_caption.txt.begin() + width, empty.txt.begin()));
}

TEST(FluxShapes, CaptionsWithUnknownWordsOrTooManyWordsAreRefused) {
  const FluxShapesDataset dataset{FluxShapesOptions{}};
  EXPECT_TRUE(Contains(error_message([&] { dataset.encode_caption("a purple circle"); }),
                       "caption 'a purple circle': unknown word 'purple'; known: a, and,"));
  const std::string seventeen_words(
      "a red circle on the left and a red circle on the left and a red circle");
  EXPECT_TRUE(Contains(error_message([&] { dataset.encode_caption(seventeen_words); }),
                       "expected at most 16 words (text_tokens), found 17"));
}

}  // namespace
}  // namespace fp8t::data
