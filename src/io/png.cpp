#include "io/png.h"

#include <png.h>

#include <string>

#include <fmt/format.h>

#include "core/error.h"
#include "io/files.h"

namespace fp8t::io {

std::string encode_png(int width, int height, std::span<const uint8_t> rgb,
                       std::string_view what) {
  FP8T_CHECK(width > 0 && height > 0 && rgb.size() == size_t(width) * size_t(height) * 3,
             "{}: expected {}×{}×3 bytes of RGB, found {}", what, width, height, rgb.size());
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(width);
  image.height = static_cast<png_uint_32>(height);
  image.format = PNG_FORMAT_RGB;
  // A first call measures.
  png_alloc_size_t bytes = 0;
  const png_int_32 row_stride = width * 3;
  std::string encoded;
  bool done =
      png_image_write_to_memory(&image, nullptr, &bytes, 0, rgb.data(), row_stride, nullptr) != 0;
  if (done) {
    encoded.resize(bytes);
    done = png_image_write_to_memory(&image, encoded.data(), &bytes, 0, rgb.data(), row_stride,
                                     nullptr) != 0;
  }
  if (!done) {
    const std::string reason = image.message;
    png_image_free(&image);
    throw Error(fmt::format("{}: cannot encode the PNG: {}", what, reason));
  }
  encoded.resize(bytes);
  return encoded;
}

void write_png(const std::filesystem::path& path, int width, int height,
               std::span<const uint8_t> rgb) {
  write_file_atomically(path, encode_png(width, height, rgb, path.string()));
}

}  // namespace fp8t::io
