#include "data/token_shard.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "io/files.h"

namespace fp8t::data {

// Tokens are copied between memory and file without byte swapping.
static_assert(std::endian::native == std::endian::little);

namespace {

using HeaderBytes = std::array<unsigned char, kTokenShardHeaderBytes>;

constexpr size_t kVersionOffset = 8;
constexpr size_t kWidthOffset = 12;
constexpr size_t kVocabOffset = 16;
constexpr size_t kBosOffset = 20;
constexpr size_t kTokenCountOffset = 24;
constexpr size_t kDocumentCountOffset = 32;
constexpr size_t kReservedOffset = 40;

template <typename T>
void store(HeaderBytes& bytes, size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
}

template <typename T>
T load(const HeaderBytes& bytes, size_t offset) {
  T value;
  std::memcpy(&value, bytes.data() + offset, sizeof(T));
  return value;
}

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& message) {
  throw Error(fmt::format("{}: {}", path.string(), message));
}

// Opens `path` and reads its header; `file_size` receives the size in bytes.
TokenShardHeader read_header(const std::filesystem::path& path, std::ifstream& in,
                             uint64_t& file_size) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) fail(path, "no such token shard");
  file_size = std::filesystem::file_size(path, error);
  if (error) fail(path, fmt::format("cannot read its size: {}", error.message()));
  in.open(path, std::ios::binary);
  if (!in) fail(path, "cannot open the token shard");
  if (file_size < kTokenShardHeaderBytes) {
    fail(path, fmt::format("not a token shard: {} bytes, shorter than the {}-byte header",
                           file_size, kTokenShardHeaderBytes));
  }
  HeaderBytes bytes{};
  in.read(reinterpret_cast<char*>(bytes.data()), bytes.size());
  if (!in) fail(path, "cannot read the token shard header");

  const std::string_view magic(reinterpret_cast<const char*>(bytes.data()), 8);
  if (magic != kTokenShardMagic) {
    fail(path, fmt::format("not a token shard: wrong magic (expected \"FP8TOKS\\0\", found "
                           "bytes {:02x})",
                           fmt::join(bytes.begin(), bytes.begin() + 8, " ")));
  }
  TokenShardHeader header;
  header.version = load<uint32_t>(bytes, kVersionOffset);
  header.token_width = load<uint32_t>(bytes, kWidthOffset);
  header.vocab_size = load<uint32_t>(bytes, kVocabOffset);
  header.bos_id = load<uint32_t>(bytes, kBosOffset);
  header.token_count = load<uint64_t>(bytes, kTokenCountOffset);
  header.document_count = load<uint64_t>(bytes, kDocumentCountOffset);
  if (header.version != kTokenShardVersion) {
    fail(path, fmt::format("unsupported token shard version {}; this build reads version {}",
                           header.version, kTokenShardVersion));
  }
  if (header.vocab_size == 0 ||
      header.vocab_size > static_cast<uint32_t>(std::numeric_limits<int32_t>::max())) {
    fail(path, fmt::format("vocab_size {} is outside [1, 2^31)", header.vocab_size));
  }
  if (header.token_width != 2 && header.token_width != 4) {
    fail(path,
         fmt::format("unsupported token width {} bytes (expected 2 or 4)", header.token_width));
  }
  if (header.token_width != token_width_for(header.vocab_size)) {
    fail(path,
         fmt::format("token width {} bytes does not match vocab_size {} (expected {})",
                     header.token_width, header.vocab_size, token_width_for(header.vocab_size)));
  }
  if (header.bos_id >= header.vocab_size) {
    fail(path,
         fmt::format("bos_id {} is not below vocab_size {}", header.bos_id, header.vocab_size));
  }
  if (std::any_of(bytes.begin() + kReservedOffset, bytes.end(),
                  [](unsigned char b) { return b; })) {
    fail(path, fmt::format("reserved header bytes {}..{} are not zero", kReservedOffset,
                           kTokenShardHeaderBytes - 1));
  }
  const uint64_t data_bytes = file_size - kTokenShardHeaderBytes;
  const uint64_t max_count = std::numeric_limits<uint64_t>::max() / header.token_width;
  if (header.token_count > max_count || header.token_count * header.token_width != data_bytes) {
    fail(path,
         fmt::format("the header says {} tokens ({} bytes of {}-byte tokens), the file has "
                     "{} bytes after the header ({})",
                     header.token_count,
                     header.token_count > max_count
                         ? std::string("more than 2^64")
                         : std::to_string(header.token_count * header.token_width),
                     header.token_width, data_bytes,
                     data_bytes < header.token_count * header.token_width ? "truncated"
                                                                          : "trailing bytes"));
  }
  if (header.document_count > header.token_count) {
    fail(path, fmt::format("document count {} exceeds the token count {}", header.document_count,
                           header.token_count));
  }
  return header;
}

template <typename Stored>
std::vector<int32_t> read_tokens(const std::filesystem::path& path, std::ifstream& in,
                                 uint64_t count) {
  std::vector<Stored> stored(count);
  in.read(reinterpret_cast<char*>(stored.data()),
          static_cast<std::streamsize>(count * sizeof(Stored)));
  if (!in) fail(path, fmt::format("cannot read its {} tokens", count));
  return std::vector<int32_t>(stored.begin(), stored.end());
}

}  // namespace

uint32_t token_width_for(int64_t vocab_size) {
  return vocab_size <= 65536 ? 2 : 4;
}

void write_token_shard(const std::filesystem::path& path, std::span<const int32_t> tokens,
                       int64_t vocab_size, int32_t bos_id) {
  if (vocab_size < 1 || vocab_size > std::numeric_limits<int32_t>::max()) {
    fail(path, fmt::format("vocab_size {} is outside [1, 2^31)", vocab_size));
  }
  if (bos_id < 0 || bos_id >= vocab_size) {
    fail(path, fmt::format("bos_id {} is not in [0, vocab_size {})", bos_id, vocab_size));
  }
  uint64_t documents = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_size) {
      fail(path, fmt::format("token {} at position {} is not in [0, vocab_size {})", tokens[i], i,
                             vocab_size));
    }
    documents += tokens[i] == bos_id ? 1 : 0;
  }

  const uint32_t width = token_width_for(vocab_size);
  HeaderBytes header{};
  std::memcpy(header.data(), kTokenShardMagic.data(), kTokenShardMagic.size());
  store<uint32_t>(header, kVersionOffset, kTokenShardVersion);
  store<uint32_t>(header, kWidthOffset, width);
  store<uint32_t>(header, kVocabOffset, static_cast<uint32_t>(vocab_size));
  store<uint32_t>(header, kBosOffset, static_cast<uint32_t>(bos_id));
  store<uint64_t>(header, kTokenCountOffset, tokens.size());
  store<uint64_t>(header, kDocumentCountOffset, documents);

  std::vector<uint16_t> narrow;
  std::span<const std::byte> token_bytes = std::as_bytes(tokens);
  if (width == 2) {
    narrow.assign(tokens.begin(), tokens.end());  // every token is below 65536: checked above
    token_bytes = std::as_bytes(std::span<const uint16_t>(narrow));
  }
  const std::array<std::span<const std::byte>, 2> pieces = {
      std::as_bytes(std::span<const unsigned char>(header)), token_bytes};
  io::write_file_atomically(path, pieces);
}

TokenShardHeader read_token_shard_header(const std::filesystem::path& path) {
  std::ifstream in;
  uint64_t file_size = 0;
  return read_header(path, in, file_size);
}

TokenShard::TokenShard(std::filesystem::path path, TokenShardHeader header,
                       std::vector<int32_t> tokens)
    : path_(std::move(path)), header_(header), tokens_(std::move(tokens)) {}

TokenShard TokenShard::open(const std::filesystem::path& path) {
  std::ifstream in;
  uint64_t file_size = 0;
  const TokenShardHeader header = read_header(path, in, file_size);
  std::vector<int32_t> tokens = header.token_width == 2
                                    ? read_tokens<uint16_t>(path, in, header.token_count)
                                    : read_tokens<uint32_t>(path, in, header.token_count);
  uint64_t documents = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    // A uint32 token above 2^31 reads back negative: out of range as well.
    if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= header.vocab_size) {
      fail(path, fmt::format("token {} at position {} is not below vocab_size {}",
                             static_cast<uint32_t>(tokens[i]), i, header.vocab_size));
    }
    documents += static_cast<uint32_t>(tokens[i]) == header.bos_id ? 1 : 0;
  }
  if (documents != header.document_count) {
    fail(path, fmt::format("the header says {} documents, the tokens hold {} BOS ({}) tokens",
                           header.document_count, documents, header.bos_id));
  }
  return TokenShard(path, header, std::move(tokens));
}

}  // namespace fp8t::data
