#include "io/png.h"

#include <png.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "test_files.h"

namespace fp8t::io {
namespace {

struct ReadPicture {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> rgb;
};

// libpng's own reader, as an image viewer would read the file.
ReadPicture read_png(const std::filesystem::path& path) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  EXPECT_NE(png_image_begin_read_from_file(&image, path.c_str()), 0) << image.message;
  image.format = PNG_FORMAT_RGB;
  ReadPicture picture{int(image.width), int(image.height),
                      std::vector<uint8_t>(PNG_IMAGE_SIZE(image))};
  EXPECT_NE(png_image_finish_read(&image, nullptr, picture.rgb.data(), 0, nullptr), 0)
      << image.message;
  return picture;
}

TEST(Png, RoundTripsThroughLibpng) {
  const test::TempFolder folder;
  constexpr int kWidth = 5, kHeight = 3;  // rows of 15 bytes: no padding to hide behind
  std::vector<uint8_t> rgb(kWidth * kHeight * 3);
  for (size_t i = 0; i < rgb.size(); ++i)
    rgb[i] = static_cast<uint8_t>(i * 37 % 256);
  write_png(folder / "picture.png", kWidth, kHeight, rgb);
  const ReadPicture read = read_png(folder / "picture.png");
  EXPECT_EQ(read.width, kWidth);
  EXPECT_EQ(read.height, kHeight);
  EXPECT_EQ(read.rgb, rgb);
}

TEST(Png, RejectsAMismatchedBuffer) {
  const test::TempFolder folder;
  const std::vector<uint8_t> rgb(10);
  EXPECT_TRUE(test::Contains(test::error_message([&] { write_png(folder / "bad.png", 2, 2, rgb); }),
                             "bad.png: expected 2×2×3 bytes of RGB, found 10"));
  EXPECT_FALSE(std::filesystem::exists(folder / "bad.png"));
}

}  // namespace
}  // namespace fp8t::io
