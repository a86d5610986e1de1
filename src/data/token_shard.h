// Token shards: a stream of token ids in one binary file, documents delimited by BOS.
//
// Layout (every integer little-endian), a 64-byte header then the tokens:
//   offset  size  field
//        0     8  magic "FP8TOKS\0"
//        8     4  format version (1)
//       12     4  token width in bytes: 2 (uint16) when vocab_size <= 65536, else 4 (uint32)
//       16     4  vocab_size: every token is below it
//       20     4  bos_id: the token that starts each document
//       24     8  token count
//       32     8  document count (the number of bos_id tokens)
//       40    24  reserved, zero
//       64        token count x width bytes of tokens, nothing after them
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string_view>
#include <vector>

namespace fp8t::data {

inline constexpr std::string_view kTokenShardMagic{"FP8TOKS\0", 8};
inline constexpr uint32_t kTokenShardVersion = 1;
inline constexpr uint64_t kTokenShardHeaderBytes = 64;

// The width the format uses for a vocabulary: 2 bytes up to 65536 tokens, else 4.
uint32_t token_width_for(int64_t vocab_size);

struct TokenShardHeader {
  uint32_t version = kTokenShardVersion;
  uint32_t token_width = 2;
  uint32_t vocab_size = 0;
  uint32_t bos_id = 0;
  uint64_t token_count = 0;
  uint64_t document_count = 0;
};

// Writes a shard atomically (temporary file, fsync, rename). Throws fp8t::Error naming `path`
// when vocab_size is not in [1, 2^31), bos_id or a token is not below vocab_size, or the write
// fails.
void write_token_shard(const std::filesystem::path& path, std::span<const int32_t> tokens,
                       int64_t vocab_size, int32_t bos_id);

// Reads and checks the header and the file size only (no tokens). Throws fp8t::Error naming
// `path` for a missing file, a file shorter than the header, a wrong magic, an unsupported
// version or width, a width that does not fit vocab_size, nonzero reserved bytes, or a token
// count that disagrees with the file size (truncated file or trailing bytes).
TokenShardHeader read_token_shard_header(const std::filesystem::path& path);

// A whole shard in memory, checked: the header as above, every token below vocab_size and the
// document count equal to the number of BOS tokens.
class TokenShard {
 public:
  static TokenShard open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  const TokenShardHeader& header() const { return header_; }
  int64_t vocab_size() const { return header_.vocab_size; }
  int32_t bos_id() const { return static_cast<int32_t>(header_.bos_id); }
  const std::vector<int32_t>& tokens() const { return tokens_; }

 private:
  TokenShard(std::filesystem::path path, TokenShardHeader header, std::vector<int32_t> tokens);

  std::filesystem::path path_;
  TokenShardHeader header_;
  std::vector<int32_t> tokens_;
};

}  // namespace fp8t::data
