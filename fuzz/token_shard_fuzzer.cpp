// The token shard reader: the input is a .tokens file. A shard that opens must hold what its
// header says.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>

#include "core/error.h"
#include "data/token_shard.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path path =
      fp8t::fuzz::scratch().write("input.tokens", fp8t::fuzz::as_text(data, size));
  try {
    const fp8t::data::TokenShard shard = fp8t::data::TokenShard::open(path);
    const auto& tokens = shard.tokens();
    const bool in_vocab = std::all_of(tokens.begin(), tokens.end(), [&](int32_t token) {
      return token >= 0 && token < shard.vocab_size();
    });
    const auto documents =
        static_cast<uint64_t>(std::count(tokens.begin(), tokens.end(), shard.bos_id()));
    if (!in_vocab || tokens.size() != shard.header().token_count ||
        documents != shard.header().document_count) {
      std::abort();
    }
  } catch (const fp8t::Error&) {  // bad input, refused with a message
  }
  return 0;
}
