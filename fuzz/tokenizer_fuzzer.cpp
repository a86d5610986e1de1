// The tokenizer's vocabulary loader: the input is a .tiktoken file, then a line "---", then its
// special-token sidecar (JSON). A tokenizer that loads must encode the input and decode it back.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "fuzz_input.h"
#include "tokenizer/bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using fp8t::tokenizer::BpeTokenizer;
  const std::string_view input = fp8t::fuzz::as_text(data, size);
  constexpr std::string_view kSeparator = "\n---\n";
  const size_t split = input.find(kSeparator);
  const std::string_view vocab = input.substr(0, split);
  const std::string_view sidecar =
      split == std::string_view::npos ? "" : input.substr(split + kSeparator.size());
  const std::filesystem::path path = fp8t::fuzz::scratch().write("vocab.tiktoken", vocab);
  fp8t::fuzz::scratch().write(fp8t::tokenizer::special_tokens_path(path).filename().string(),
                              sidecar);
  std::optional<BpeTokenizer> tokenizer;
  try {
    tokenizer = BpeTokenizer::load(path);
  } catch (const fp8t::Error&) {  // bad input, refused with a message
    return 0;
  }
  const std::vector<int32_t> ids = tokenizer->encode(input);
  if (tokenizer->decode(ids) != input) std::abort();
  return 0;
}
