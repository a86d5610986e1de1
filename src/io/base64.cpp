#include "io/base64.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace fp8t::io {

constexpr std::string_view kBase64Alphabet =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64_encode(std::string_view bytes) {
  std::string text;
  text.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const size_t n = std::min<size_t>(3, bytes.size() - i);
    uint32_t group = 0;
    for (size_t k = 0; k < 3; ++k) {
      const uint32_t byte = k < n ? static_cast<unsigned char>(bytes[i + k]) : 0u;
      group = (group << 8) | byte;
    }
    for (size_t k = 0; k < 4; ++k) {
      text.push_back(k <= n ? kBase64Alphabet[(group >> (18 - 6 * k)) & 63] : '=');
    }
  }
  return text;
}

bool base64_decode(std::string_view text, std::string& bytes) {
  if (text.empty() || text.size() % 4 != 0) return false;
  bytes.clear();
  for (size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    uint32_t group = 0;
    int padding = 0;
    for (size_t k = 0; k < 4; ++k) {
      const char c = text[i + k];
      uint32_t value = 0;
      if (c == '=') {
        if (!last || k < 2) return false;
        ++padding;
      } else {
        if (padding > 0) return false;
        const size_t found = kBase64Alphabet.find(c);
        if (found == std::string_view::npos) return false;
        value = static_cast<uint32_t>(found);
      }
      group = (group << 6) | value;
    }
    for (int k = 0; k < 3 - padding; ++k)
      bytes.push_back(static_cast<char>((group >> (16 - 8 * k)) & 0xff));
  }
  return true;
}
}  // namespace fp8t::io
