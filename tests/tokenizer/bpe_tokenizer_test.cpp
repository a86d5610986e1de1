#include "tokenizer/bpe_tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "test_files.h"

namespace fp8t::tokenizer {
namespace {

namespace fs = std::filesystem;
using test::Contains;
using test::error_message;

// English-like prose: sentences of common words with punctuation, numbers and line breaks.
std::vector<std::string> english_documents(std::mt19937_64& rng, size_t count) {
  static const std::vector<std::string> words = {
      "the",    "of",      "and",    "to",      "in",     "that",   "it",     "was",   "he",
      "for",    "on",      "are",    "with",    "as",     "his",    "they",   "at",    "be",
      "this",   "have",    "from",   "one",     "had",    "by",     "word",   "but",   "not",
      "what",   "all",     "were",   "we",      "when",   "your",   "can",    "said",  "there",
      "use",    "each",    "which",  "she",     "do",     "how",    "their",  "if",    "will",
      "up",     "other",   "about",  "out",     "many",   "then",   "them",   "these", "so",
      "some",   "her",     "would",  "make",    "like",   "him",    "into",   "time",  "has",
      "look",   "two",     "more",   "write",   "go",     "see",    "number", "no",    "way",
      "could",  "people",  "my",     "than",    "first",  "water",  "been",   "call",  "who",
      "people", "machine", "learns", "quickly", "reason", "wisdom", "don't",  "it's",  "we'll"};
  static const std::vector<std::string> endings = {".", ",", "!", "?", ";", ":", "..."};
  std::vector<std::string> documents;
  for (size_t d = 0; d < count; ++d) {
    std::string text;
    const size_t sentences = 1 + rng() % 5;
    for (size_t s = 0; s < sentences; ++s) {
      const size_t length = 3 + rng() % 12;
      for (size_t w = 0; w < length; ++w) {
        std::string word = words[rng() % words.size()];
        if (w == 0) word[0] = static_cast<char>(std::toupper(word[0]));
        if (w > 0) text += ' ';
        text += rng() % 20 == 0 ? std::to_string(rng() % 100000) : word;
      }
      text += endings[rng() % endings.size()];
      text += rng() % 4 == 0 ? "\n" : " ";
    }
    documents.push_back(std::move(text));
  }
  return documents;
}

std::string random_bytes(std::mt19937_64& rng, size_t size) {
  std::string bytes(size, '\0');
  for (char& byte : bytes)
    byte = static_cast<char>(rng() & 0xff);
  return bytes;
}

// Valid UTF-8 of random code points from all four encoded lengths (no surrogates).
std::string random_utf8(std::mt19937_64& rng, size_t code_points) {
  std::string text;
  for (size_t i = 0; i < code_points; ++i) {
    const uint32_t ranges[][2] = {
        {0x20, 0x7e}, {0xa0, 0x7ff}, {0x800, 0xd7ff}, {0x10000, 0x10ffff}};
    const auto& range = ranges[rng() % 4];
    const auto c = static_cast<uint32_t>(range[0] + rng() % (range[1] - range[0] + 1));
    if (c < 0x80) {
      text += static_cast<char>(c);
    } else if (c < 0x800) {
      text += static_cast<char>(0xc0 | (c >> 6));
      text += static_cast<char>(0x80 | (c & 0x3f));
    } else if (c < 0x10000) {
      text += static_cast<char>(0xe0 | (c >> 12));
      text += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
      text += static_cast<char>(0x80 | (c & 0x3f));
    } else {
      text += static_cast<char>(0xf0 | (c >> 18));
      text += static_cast<char>(0x80 | ((c >> 12) & 0x3f));
      text += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
      text += static_cast<char>(0x80 | (c & 0x3f));
    }
  }
  return text;
}

std::string joined(const std::vector<std::string>& documents) {
  std::string text;
  for (const std::string& document : documents)
    text += document + "\n";
  return text;
}

class BpeTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }

  // A tokenizer saved in folder_/name with one line of its ranks file replaced.
  fs::path saved_with_line(const BpeTokenizer& bpe, const std::string& name, size_t line_index,
                           const std::string& replacement) {
    const fs::path path = folder_ / name;
    bpe.save(path);
    std::ifstream in(path);
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);)
      lines.push_back(line);
    lines.at(line_index) = replacement;
    std::ofstream out(path, std::ios::trunc);
    for (const std::string& line : lines)
      out << line << '\n';
    return path;
  }

  static std::string load_error(const fs::path& path) {
    return error_message([&] { BpeTokenizer::load(path); });
  }

  test::TempFolder folder_;
  std::mt19937_64 rng_;
  uint64_t seed_ = 0;
};

std::vector<std::string> as_strings(const std::vector<std::string_view>& views) {
  return {views.begin(), views.end()};
}

TEST(PreSplit, MatchesHandCheckedExamples) {
  using Chunks = std::vector<std::string>;
  EXPECT_EQ(as_strings(pre_split("Hello world's 123456")),
            (Chunks{"Hello", " world", "'s", " ", "12", "34", "56"}));
  EXPECT_EQ(as_strings(pre_split("I'm  fine!\n")), (Chunks{"I", "'m", " ", " fine", "!\n"}));
  EXPECT_EQ(as_strings(pre_split("Caf\u00e9 \u00fcber 3.14")),
            (Chunks{"Caf\u00e9", " \u00fcber", " ", "3", ".", "14"}));
  EXPECT_EQ(as_strings(pre_split("WE'LL go\n\n  now")),
            (Chunks{"WE", "'LL", " go", "\n\n", " ", " now"}));
  // Invalid UTF-8 matches nothing; the bytes between matches form chunks of their own.
  EXPECT_EQ(as_strings(pre_split("ab\xff\xfe"
                                 "cd")),
            (Chunks{"ab", "\xff\xfe", "cd"}));
  EXPECT_TRUE(pre_split("").empty());
}

TEST_F(BpeTokenizerTest, RoundTripsRandomBytesUtf8AndEnglish) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  const BpeTokenizer bpe = BpeTokenizer::train(english_documents(rng_, 300), 600);
  const std::vector<std::string> texts = {
      random_bytes(rng_, 5000),       random_utf8(rng_, 3000),  joined(english_documents(rng_, 50)),
      std::string(200000, ' ') + "x", std::string(100000, 'a'), std::string(1, '\0')};
  for (const std::string& text : texts) {
    std::string chunks;
    for (const std::string_view chunk : pre_split(text))
      chunks += chunk;
    EXPECT_EQ(chunks, text);
    const std::vector<int32_t> ids = bpe.encode(text);
    EXPECT_EQ(bpe.decode(ids), text);
    for (const int32_t id : ids)
      ASSERT_TRUE(id >= 0 && id < bpe.mergeable_count()) << id;
  }
}

TEST_F(BpeTokenizerTest, MergesShortenEnglish) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  const std::vector<std::string> training = english_documents(rng_, 2000);
  const BpeTokenizer bpe = BpeTokenizer::train(training, 700);
  ASSERT_EQ(bpe.vocab_size(), 700);
  for (int byte = 0; byte < 256; ++byte)
    EXPECT_EQ(bpe.token_bytes(byte), std::string(1, static_cast<char>(byte)));
  // Each merge joins two earlier tokens, so tokens grow no faster than one per rank.
  for (int32_t id = 256; id < bpe.mergeable_count(); ++id)
    EXPECT_GE(bpe.token_bytes(id).size(), 2u);
  const std::string fresh = joined(english_documents(rng_, 200));
  const size_t tokens = bpe.encode(fresh).size();
  EXPECT_LT(tokens * 3, fresh.size()) << tokens << " tokens for " << fresh.size() << " bytes";
  // Common words of the training text became single tokens.
  EXPECT_EQ(bpe.encode(" the").size(), 1u);
  EXPECT_EQ(bpe.encode(" people").size(), 1u);
}

TEST(BpeTraining, MergesTheMostFrequentPairAndBreaksTiesByTheSmallerPair) {
  // "aaab" x2: (a,a) occurs 4 times, (a,b) twice: "aa" first, then ("aa", a) twice and (a, b)
  // twice tie; the smaller pair, (97, 98) < (256, 97), wins.
  BpeTokenizer bpe = BpeTokenizer::train(std::vector<std::string>{"aaab aaab"}, 258, {});
  EXPECT_EQ(bpe.token_bytes(256), "aa");
  EXPECT_EQ(bpe.token_bytes(257), "ab");
  // "ab cd": three pairs of count 1; (' ', 'c') = (32, 99) is the smallest, then (a, b), then
  // (" c", d).
  bpe = BpeTokenizer::train(std::vector<std::string>{"ab cd"}, 259, {});
  EXPECT_EQ(bpe.token_bytes(256), " c");
  EXPECT_EQ(bpe.token_bytes(257), "ab");
  EXPECT_EQ(bpe.token_bytes(258), " cd");
  EXPECT_EQ(bpe.encode("ab cd"), (std::vector<int32_t>{257, 258}));
}

TEST_F(BpeTokenizerTest, TrainingIsDeterministicAndIgnoresDocumentOrder) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  std::vector<std::string> documents = english_documents(rng_, 500);
  const BpeTokenizer first = BpeTokenizer::train(documents, 700);
  std::shuffle(documents.begin(), documents.end(), rng_);
  const BpeTokenizer second = BpeTokenizer::train(documents, 700);
  ASSERT_EQ(first.mergeable_count(), second.mergeable_count());
  for (int32_t id = 0; id < first.mergeable_count(); ++id)
    ASSERT_EQ(first.token_bytes(id), second.token_bytes(id)) << "rank " << id;
}

TEST_F(BpeTokenizerTest, SpecialTokensTakeTheLastIds) {
  const BpeTokenizer bpe = BpeTokenizer::train(english_documents(rng_, 100), 400);
  const std::vector<std::string> specials = nanochat_special_tokens();
  ASSERT_EQ(specials.size(), 9u);
  EXPECT_EQ(bpe.vocab_size(), 400);
  EXPECT_EQ(bpe.mergeable_count(), 391);
  EXPECT_EQ(bpe.bos_id(), 391);
  EXPECT_EQ(bpe.special_token_id("<|output_end|>"), 399);
  EXPECT_EQ(bpe.decode(std::vector<int32_t>{bpe.bos_id()}), "<|bos|>");
  // Ordinary encoding does not recognize special token names.
  const std::vector<int32_t> ids = bpe.encode("<|bos|>");
  EXPECT_GT(ids.size(), 1u);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), bpe.bos_id()), 0);
  const std::vector<int32_t> document = bpe.encode_document("Hi there");
  EXPECT_EQ(document.front(), bpe.bos_id());
  EXPECT_EQ(bpe.decode(std::span(document).subspan(1)), "Hi there");
  EXPECT_TRUE(Contains(error_message([&] { bpe.special_token_id("<|eot|>"); }),
                       "no special token '<|eot|>'"));
  EXPECT_THROW(bpe.decode(std::vector<int32_t>{400}), Error);
}

TEST_F(BpeTokenizerTest, RejectsBadTrainingArguments) {
  const std::vector<std::string> texts = {"some text"};
  EXPECT_THROW(BpeTokenizer::train(texts, 264), Error);  // 264 - 9 specials < 256
  EXPECT_NO_THROW(BpeTokenizer::train(texts, 265));
  EXPECT_THROW(BpeTokenizer::train(texts, 300, {"<|a|>", "<|a|>"}), Error);
  EXPECT_THROW(BpeTokenizer::train(texts, 300, {""}), Error);
  // A corpus that runs out of pairs stops early: "ab" has one pair.
  EXPECT_EQ(BpeTokenizer::train(std::vector<std::string>{"ab"}, 300, {"<|bos|>"}).vocab_size(),
            258);
}

TEST_F(BpeTokenizerTest, SavedTokenizerLoadsAndEncodesIdentically) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  const BpeTokenizer trained = BpeTokenizer::train(english_documents(rng_, 800), 900);
  const fs::path path = folder_ / "tokenizer.tiktoken";
  trained.save(path);
  EXPECT_TRUE(fs::exists(special_tokens_path(path)));
  {
    std::ifstream in(path);
    std::string line;
    std::getline(in, line);
    EXPECT_EQ(line, "AA== 0");  // tiktoken format: base64 of byte 0, rank 0
  }
  const BpeTokenizer loaded = BpeTokenizer::load(path);
  EXPECT_EQ(loaded.vocab_size(), trained.vocab_size());
  EXPECT_EQ(loaded.special_tokens(), trained.special_tokens());
  EXPECT_EQ(loaded.bos_id(), trained.bos_id());
  for (const std::string& text :
       {joined(english_documents(rng_, 100)), random_bytes(rng_, 2000), random_utf8(rng_, 1000)}) {
    EXPECT_EQ(loaded.encode(text), trained.encode(text));
  }
}

TEST_F(BpeTokenizerTest, ReportsBadTokenizerFiles) {
  const BpeTokenizer bpe = BpeTokenizer::train(english_documents(rng_, 50), 300);
  EXPECT_TRUE(Contains(load_error(folder_ / "absent.tiktoken"), "absent.tiktoken: no such file"));

  fs::path path = saved_with_line(bpe, "base64.tiktoken", 3, "A*== 3");
  EXPECT_TRUE(Contains(load_error(path), "base64.tiktoken:4: 'A*==' is not valid base64"));
  path = saved_with_line(bpe, "gap.tiktoken", 10, "Cg== 11");
  EXPECT_TRUE(Contains(load_error(path), "gap.tiktoken:11: expected rank 10"));
  EXPECT_TRUE(Contains(load_error(path), "found 11"));
  path = saved_with_line(bpe, "duplicate.tiktoken", 270, "QQ== 270");  // "A", rank 65
  EXPECT_TRUE(Contains(load_error(path),
                       "duplicate.tiktoken:271: token 'QQ==' repeats the token "
                       "of line 66"));
  path = saved_with_line(bpe, "format.tiktoken", 5, "BQ==");
  EXPECT_TRUE(Contains(load_error(path), "format.tiktoken:6: expected 'BASE64 RANK'"));

  path = folder_ / "nosidecar.tiktoken";
  bpe.save(path);
  fs::remove(special_tokens_path(path));
  EXPECT_TRUE(Contains(load_error(path), "nosidecar.tiktoken.special_tokens.json: no such file"));

  path = folder_ / "shifted.tiktoken";
  bpe.save(path);
  const nlohmann::json shifted = {{"format", "fp8train-bpe-special-tokens"},
                                  {"version", 1},
                                  {"pattern", kSplitPattern},
                                  {"special_tokens", {{{"name", "<|bos|>"}, {"id", 5}}}}};
  std::ofstream(special_tokens_path(path), std::ios::trunc) << shifted.dump();
  EXPECT_TRUE(Contains(load_error(path), "special token '<|bos|>' has id 5, expected 291"));
  std::ofstream(special_tokens_path(path), std::ios::trunc) << "{\"format\": ";
  EXPECT_TRUE(Contains(load_error(path), "shifted.tiktoken.special_tokens.json: not valid JSON"));

  path = saved_with_line(bpe, "nobyte.tiktoken", 65, "AQID 65");  // "A" replaced by 01 02 03
  EXPECT_TRUE(Contains(load_error(path), "nobyte.tiktoken: byte 0x41 has no token"));
}

// Members of another type escaped as nlohmann's type_error, and printing a deeply nested entry
// (dump() recurses once per level) overflowed the stack.
TEST_F(BpeTokenizerTest, ReportsMalformedSidecars) {
  const BpeTokenizer bpe = BpeTokenizer::train(english_documents(rng_, 50), 300);
  const fs::path path = folder_ / "sidecar.tiktoken";
  bpe.save(path);
  const nlohmann::json valid = {{"format", "fp8train-bpe-special-tokens"},
                                {"version", 1},
                                {"pattern", kSplitPattern},
                                {"special_tokens", nlohmann::json::array()}};
  const auto error_with = [&](const std::string& key, const std::string& value) {
    nlohmann::json sidecar = valid;
    sidecar[key] = nlohmann::json::parse(value);
    std::ofstream(special_tokens_path(path), std::ios::trunc) << sidecar.dump();
    return load_error(path);
  };
  EXPECT_TRUE(Contains(error_with("format", "5"),
                       "expected a JSON object with \"format\": \"fp8train-bpe-special-tokens\""));
  EXPECT_TRUE(Contains(error_with("version", "\"1\""),
                       "unsupported version \"1\"; this build reads version 1"));
  EXPECT_TRUE(Contains(error_with("pattern", "[1]"), "its split pattern differs"));
  EXPECT_TRUE(Contains(error_with("special_tokens", "{}"), "\"special_tokens\" is not an array"));

  const std::string nested = std::string(100000, '[') + std::string(100000, ']');
  std::ofstream(special_tokens_path(path), std::ios::trunc)
      << R"({"format": "fp8train-bpe-special-tokens", "special_tokens": )" << nested << "}";
  EXPECT_TRUE(Contains(load_error(path),
                       "sidecar.tiktoken.special_tokens.json: expected JSON nested at most 16 "
                       "levels deep, found deeper"));
}

}  // namespace
}  // namespace fp8t::tokenizer
