#include "data/token_shard.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "test_files.h"

namespace fp8t::data {
namespace {

namespace fs = std::filesystem;
using test::Contains;

class ShardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }

  // Random tokens below vocab_size; about one in `document_length` is BOS, and the first is.
  std::vector<int32_t> random_tokens(size_t count, int64_t vocab_size, int32_t bos_id,
                                     size_t document_length = 20) {
    std::vector<int32_t> tokens(count);
    for (size_t i = 0; i < count; ++i) {
      tokens[i] = i == 0 || rng_() % document_length == 0
                      ? bos_id
                      : static_cast<int32_t>(rng_() % static_cast<uint64_t>(vocab_size));
    }
    return tokens;
  }

  std::string read_bytes(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  fs::path write_bytes(const std::string& bytes, const std::string& name) {
    const fs::path path = folder_ / name;
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }

  static std::string open_error(const fs::path& path) {
    return test::error_message([&] { TokenShard::open(path); });
  }

  test::TempFolder folder_;
  std::mt19937_64 rng_;
  uint64_t seed_ = 0;
};

TEST_F(ShardTest, RoundTripsBothWidths) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  struct Case {
    int64_t vocab_size;
    int32_t bos_id;
    uint32_t width;
  };
  for (const Case& c : {Case{65536, 65535, 2}, Case{4096, 4087, 2}, Case{65537, 65536, 4},
                        Case{200000, 199990, 4}}) {
    const std::vector<int32_t> tokens =
        random_tokens(10000 + rng_() % 1000, c.vocab_size, c.bos_id);
    const fs::path path = folder_ / fmt::format("shard_{}.tokens", c.vocab_size);
    write_token_shard(path, tokens, c.vocab_size, c.bos_id);
    EXPECT_EQ(fs::file_size(path), kTokenShardHeaderBytes + tokens.size() * c.width);

    const TokenShard shard = TokenShard::open(path);
    EXPECT_EQ(shard.tokens(), tokens);
    EXPECT_EQ(shard.header().token_width, c.width);
    EXPECT_EQ(shard.vocab_size(), c.vocab_size);
    EXPECT_EQ(shard.bos_id(), c.bos_id);
    EXPECT_EQ(shard.header().token_count, tokens.size());
    EXPECT_EQ(shard.header().document_count,
              static_cast<uint64_t>(std::count(tokens.begin(), tokens.end(), c.bos_id)));
    EXPECT_EQ(read_token_shard_header(path).document_count, shard.header().document_count);
  }
  // An empty shard is valid.
  write_token_shard(folder_ / "empty.tokens", {}, 100, 0);
  EXPECT_TRUE(TokenShard::open(folder_ / "empty.tokens").tokens().empty());
}

TEST_F(ShardTest, HeaderBytesAreAsDocumented) {
  write_token_shard(folder_ / "small.tokens", std::vector<int32_t>{7, 1, 2, 7, 3}, 300, 7);
  const std::string bytes = read_bytes(folder_ / "small.tokens");
  ASSERT_EQ(bytes.size(), 64u + 5 * 2);
  const auto u32 = [&bytes](size_t offset) {
    uint32_t value = 0;
    std::memcpy(&value, bytes.data() + offset, 4);
    return value;
  };
  EXPECT_EQ(bytes.substr(0, 8), std::string("FP8TOKS\0", 8));
  EXPECT_EQ(u32(8), 1u);     // version
  EXPECT_EQ(u32(12), 2u);    // width
  EXPECT_EQ(u32(16), 300u);  // vocab_size
  EXPECT_EQ(u32(20), 7u);    // bos_id
  EXPECT_EQ(u32(24), 5u);    // token count, low half
  EXPECT_EQ(u32(32), 2u);    // documents, low half
  EXPECT_EQ(bytes.substr(40, 24), std::string(24, '\0'));
  EXPECT_EQ(bytes.substr(64, 4), std::string("\x07\x00\x01\x00", 4));
}

TEST_F(ShardTest, WriteRejectsTokensOutsideTheVocabulary) {
  EXPECT_THROW(write_token_shard(folder_ / "a.tokens", std::vector<int32_t>{0, 300}, 300, 0),
               Error);
  EXPECT_THROW(write_token_shard(folder_ / "b.tokens", std::vector<int32_t>{0, -1}, 300, 0), Error);
  EXPECT_THROW(write_token_shard(folder_ / "c.tokens", std::vector<int32_t>{0}, 300, 300), Error);
  EXPECT_FALSE(fs::exists(folder_ / "a.tokens"));
}

TEST_F(ShardTest, ReportsEachBadShard) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  const std::vector<int32_t> tokens = random_tokens(1000, 5000, 4999);
  write_token_shard(folder_ / "good.tokens", tokens, 5000, 4999);
  const std::string good = read_bytes(folder_ / "good.tokens");

  EXPECT_TRUE(
      Contains(open_error(folder_ / "missing.tokens"), "missing.tokens: no such token shard"));
  EXPECT_TRUE(
      Contains(open_error(write_bytes(good.substr(0, 10), "short.tokens")),
               "short.tokens: not a token shard: 10 bytes, shorter than the 64-byte header"));
  // Bytes overwritten: the header's fields, the reserved bytes, a token.
  const size_t position = 1 + rng_() % 999;
  struct Corruption {
    std::string name;
    size_t offset;
    std::string replacement;
    std::string message;
  };
  const std::vector<Corruption> corruptions = {
      {"magic", 0, "X", "magic.tokens: not a token shard: wrong magic"},
      {"version", 8, "\x02",
       "version.tokens: unsupported token shard version 2; this build reads version 1"},
      {"width", 12, "\x03", "width.tokens: unsupported token width 3 bytes"},
      {"mismatch", 12, "\x04", "token width 4 bytes does not match vocab_size 5000 (expected 2)"},
      {"documents", 32, std::string(1, static_cast<char>(good[32] + 1)),
       "documents.tokens: the header says"},
      {"reserved", 50, "\x01", "reserved.tokens: reserved header bytes 40..63 are not zero"},
      {"range", 64 + 2 * position, "\x88\x13",  // 0x1388 = 5000
       fmt::format("range.tokens: token 5000 at position {} is not below vocab_size 5000",
                   position)},
  };
  for (const Corruption& corruption : corruptions) {
    std::string bytes = good;
    bytes.replace(corruption.offset, corruption.replacement.size(), corruption.replacement);
    EXPECT_TRUE(
        Contains(open_error(write_bytes(bytes, corruption.name + ".tokens")), corruption.message));
  }
  EXPECT_TRUE(Contains(open_error(write_bytes(good.substr(0, good.size() - 1), "truncated.tokens")),
                       "truncated.tokens: the header says 1000 tokens (2000 bytes of 2-byte "
                       "tokens), the file has 1999 bytes after the header (truncated)"));
  EXPECT_TRUE(Contains(open_error(write_bytes(good + "xy", "trailing.tokens")),
                       "the file has 2002 bytes after the header (trailing bytes)"));
}

}  // namespace
}  // namespace fp8t::data
