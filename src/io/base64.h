// Base64 (RFC 4648, the standard alphabet, padded): tiktoken vocabularies store tokens in it,
// and HTML reports embed their PNG pictures in it.
#pragma once

#include <string>
#include <string_view>

namespace fp8t::io {

std::string base64_encode(std::string_view bytes);
// Strict decoding: a multiple of 4 characters, padding only at the end, no other characters.
// False (bytes then undefined) for text that breaks those rules.
bool base64_decode(std::string_view text, std::string& bytes);

}  // namespace fp8t::io
