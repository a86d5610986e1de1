// libpng's own reader, as an image viewer would read a file: what the PNG tests check the
// project's writer against.
#pragma once

#include <png.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <vector>

namespace fp8t::test {

struct ReadPicture {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> rgb;  // [height, width, 3]
};

inline ReadPicture read_png(const std::filesystem::path& path) {
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

}  // namespace fp8t::test
