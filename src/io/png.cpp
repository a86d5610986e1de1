#include "io/png.h"

#include <png.h>

#include <cstddef>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "io/files.h"

namespace fp8t::io {

void write_png(const std::filesystem::path& path, int width, int height,
               std::span<const uint8_t> rgb) {
  FP8T_CHECK(width > 0 && height > 0 && rgb.size() == size_t(width) * size_t(height) * 3,
             "{}: expected {}×{}×3 bytes of RGB, found {}", path.string(), width, height,
             rgb.size());
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(width);
  image.height = static_cast<png_uint_32>(height);
  image.format = PNG_FORMAT_RGB;
  // Encoded in memory, so that the file itself is written atomically: a first call measures.
  png_alloc_size_t bytes = 0;
  const png_int_32 row_stride = width * 3;
  std::vector<std::byte> encoded;
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
    throw Error(fmt::format("{}: cannot encode the PNG: {}", path.string(), reason));
  }
  encoded.resize(bytes);
  const std::span<const std::byte> pieces[] = {encoded};
  write_file_atomically(path, pieces);
}

}  // namespace fp8t::io
