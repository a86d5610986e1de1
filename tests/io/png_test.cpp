#include "io/png.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "io/png_reader.h"
#include "test_files.h"

namespace fp8t::io {
namespace {

using test::read_png;
using test::ReadPicture;

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
