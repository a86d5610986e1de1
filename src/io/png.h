// PNG files: 8-bit RGB pictures (sample grids) through libpng's simplified API.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

namespace fp8t::io {

// A width × height picture, rgb holding [height, width, 3] bytes, as the bytes of a PNG file.
// Throws fp8t::Error naming `what` and libpng's reason.
std::string encode_png(int width, int height, std::span<const uint8_t> rgb, std::string_view what);

// Writes encode_png's bytes atomically (as write_file_atomically). Throws fp8t::Error naming the
// file and libpng's or the system's reason.
void write_png(const std::filesystem::path& path, int width, int height,
               std::span<const uint8_t> rgb);

}  // namespace fp8t::io
