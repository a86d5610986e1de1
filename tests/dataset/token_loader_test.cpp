#include "data/token_loader.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/text_corpus.h"
#include "data/token_shard.h"
#include "test_files.h"
#include "tokenizer/bpe_tokenizer.h"

namespace fp8t::data {
namespace {

namespace fs = std::filesystem;
using test::Contains;
using test::error_message;

constexpr int32_t kBos = 0;
constexpr int64_t kVocab = 1 << 20;  // document k's tokens are kTokenBase * k + 1, + 2, ...
constexpr int32_t kTokenBase = 1000;

class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }

  // `shards` shards of random-length documents; document k is BOS then kTokenBase * k + 1,
  // + 2, ..., so every token names its document. Lengths run from 2 to max_length.
  std::vector<fs::path> write_shards(size_t shards, size_t documents_per_shard, size_t max_length) {
    std::vector<fs::path> paths;
    for (size_t s = 0; s < shards; ++s) {
      std::vector<int32_t> tokens;
      for (size_t d = 0; d < documents_per_shard; ++d) {
        const size_t length = 2 + rng_() % (max_length - 1);
        tokens.push_back(kBos);
        for (size_t i = 1; i < length; ++i)
          tokens.push_back(static_cast<int32_t>(kTokenBase * document_count_ + i));
        lengths_[document_count_++] = length;
      }
      paths.push_back(folder_ / fmt::format("shard_{}.tokens", s));
      write_token_shard(paths.back(), tokens, kVocab, kBos);
    }
    return paths;
  }

  test::TempFolder folder_;
  std::mt19937_64 rng_;
  uint64_t seed_ = 0;
  size_t document_count_ = 0;
  std::map<size_t, size_t> lengths_;  // document -> tokens, BOS included
};

// Each row (inputs plus the last target) as T + 1 tokens.
std::vector<std::vector<int32_t>> rows_of(const TokenBatch& batch, int64_t sequence) {
  std::vector<std::vector<int32_t>> rows;
  const auto t = static_cast<size_t>(sequence);
  for (size_t r = 0; r < batch.inputs.size() / t; ++r) {
    std::vector<int32_t> row(batch.inputs.begin() + r * t, batch.inputs.begin() + (r + 1) * t);
    row.push_back(batch.targets[(r + 1) * t - 1]);
    rows.push_back(std::move(row));
  }
  return rows;
}

std::vector<std::vector<int32_t>> take_rows(TokenLoader& loader, size_t batches, int64_t sequence) {
  std::vector<std::vector<int32_t>> rows;
  for (size_t b = 0; b < batches; ++b) {
    for (std::vector<int32_t>& row : rows_of(loader.next_batch(), sequence))
      rows.push_back(std::move(row));
  }
  return rows;
}

TEST_F(LoaderTest, PacksWholeDocumentsThenACroppedOne) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  const int64_t sequence = 24;
  const std::vector<fs::path> shards = write_shards(3, 40, 40);  // some longer than a row
  TokenLoader loader(shards, {.batch = 4, .sequence = sequence, .seed = seed_});
  EXPECT_EQ(loader.documents_per_epoch(), 120u);

  // The documents in stream order as rows begin them; kUnknown for a row that ends with a lone
  // BOS (its document has no token left to name it).
  constexpr size_t kUnknown = SIZE_MAX;
  std::vector<size_t> starts;
  while (loader.position().epoch == 0) {
    const TokenBatch batch = loader.next_batch();
    for (size_t i = 0; i < batch.inputs.size(); ++i) {
      if (i % sequence != 0) {
        ASSERT_EQ(batch.targets[i - 1], batch.inputs[i]) << "not a shift";
      }
    }
    for (const std::vector<int32_t>& row : rows_of(batch, sequence)) {
      ASSERT_EQ(row.front(), kBos) << "a row must start at a document";
      for (size_t i = 0; i < row.size();) {
        ASSERT_EQ(row[i], kBos);
        if (i + 1 == row.size()) {
          starts.push_back(kUnknown);
          break;
        }
        const size_t document = static_cast<size_t>(row[i + 1]) / kTokenBase;
        const size_t length = lengths_.at(document);
        const size_t present = std::min(length, row.size() - i);
        for (size_t k = 1; k < present; ++k)
          ASSERT_EQ(row[i + k], static_cast<int32_t>(kTokenBase * document + k));
        starts.push_back(document);
        i += present;
      }
    }
  }
  // Epoch 0 began every document once (the last row may reach into epoch 1).
  ASSERT_GE(starts.size(), 120u);
  std::set<size_t> first_epoch(starts.begin(), starts.begin() + 120);
  const auto unknown =
      static_cast<size_t>(std::count(starts.begin(), starts.begin() + 120, kUnknown));
  first_epoch.erase(kUnknown);
  EXPECT_EQ(first_epoch.size() + unknown, 120u);
  EXPECT_LT(*first_epoch.rbegin(), 120u);
}

TEST_F(LoaderTest, SameSeedSameBatchesOtherSeedOthers) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  const std::vector<fs::path> shards = write_shards(4, 25, 30);
  const TokenLoaderOptions options{.batch = 3, .sequence = 16, .seed = seed_};
  TokenLoader a(shards, options);
  TokenLoader b(shards, options);
  TokenLoaderOptions other = options;
  other.seed = seed_ + 1;
  TokenLoader c(shards, other);
  const auto rows_a = take_rows(a, 30, 16);
  EXPECT_EQ(rows_a, take_rows(b, 30, 16));
  EXPECT_NE(rows_a, take_rows(c, 30, 16));
}

TEST_F(LoaderTest, RanksPartitionTheRows) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  const std::vector<fs::path> shards = write_shards(3, 30, 30);
  TokenLoader single(shards, {.batch = 2, .sequence = 20, .seed = seed_});
  TokenLoader rank0(shards,
                    {.batch = 2, .sequence = 20, .rank = 0, .world_size = 2, .seed = seed_});
  TokenLoader rank1(shards,
                    {.batch = 2, .sequence = 20, .rank = 1, .world_size = 2, .seed = seed_});
  const auto all = take_rows(single, 40, 20);
  const auto even = take_rows(rank0, 20, 20);
  const auto odd = take_rows(rank1, 20, 20);
  ASSERT_EQ(all.size(), even.size() + odd.size());
  for (size_t i = 0; i < all.size(); ++i)
    ASSERT_EQ(all[i], i % 2 == 0 ? even[i / 2] : odd[i / 2]) << "row " << i;
  EXPECT_EQ(rank0.position(), rank1.position());
}

TEST_F(LoaderTest, SeekResumesExactlyAcrossEpochs) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  const std::vector<fs::path> shards = write_shards(3, 10, 25);
  const TokenLoaderOptions options{
      .batch = 2, .sequence = 12, .rank = 1, .world_size = 2, .seed = seed_};
  TokenLoader reference(shards, options);
  std::vector<DataPosition> positions;
  std::vector<std::vector<std::vector<int32_t>>> batches;
  for (int b = 0; b < 60; ++b) {
    positions.push_back(reference.position());
    batches.push_back(rows_of(reference.next_batch(), 12));
  }
  ASSERT_GE(reference.position().epoch, 3u) << "the test must cross epoch boundaries";
  bool crossed = false;
  for (size_t k = 0; k + 5 < batches.size(); ++k) {
    crossed = crossed || (k > 0 && positions[k].epoch != positions[k - 1].epoch);
    // Through JSON, as a checkpoint stores it.
    const nlohmann::json saved = positions[k];
    TokenLoader resumed(shards, options);
    resumed.seek(saved.get<DataPosition>());
    for (size_t j = k; j < k + 5; ++j)
      ASSERT_EQ(rows_of(resumed.next_batch(), 12), batches[j]) << "resumed at batch " << k;
  }
  EXPECT_TRUE(crossed);
}

TEST_F(LoaderTest, ReportsBadShardSetsAndPositions) {
  const std::vector<fs::path> shards = write_shards(1, 5, 10);
  write_token_shard(folder_ / "other_vocab.tokens", std::vector<int32_t>{0, 5, 6}, 300, 0);
  const std::string mixed = error_message([&] {
    TokenLoader({shards[0], folder_ / "other_vocab.tokens"}, {});
  });
  EXPECT_TRUE(Contains(mixed, "other_vocab.tokens has vocab_size 300 and bos_id 0, but"));
  EXPECT_TRUE(Contains(mixed, "shard_0.tokens has vocab_size 1048576"));
  write_token_shard(folder_ / "no_bos.tokens", std::vector<int32_t>{5, 6, 7}, kVocab, kBos);
  EXPECT_TRUE(Contains(error_message([&] { TokenLoader({folder_ / "no_bos.tokens"}, {}); }),
                       "hold no document: no BOS token (0) at all"));
  EXPECT_THROW(TokenLoader({}, {}), Error);
  EXPECT_THROW(TokenLoader(shards, {.rank = 2, .world_size = 2}), Error);

  TokenLoader loader(shards, {.seed = 7});
  DataPosition position = loader.position();
  position.seed = 8;
  EXPECT_THROW(loader.seek(position), Error);
  position = loader.position();
  position.document_cursor = 5;
  EXPECT_THROW(loader.seek(position), Error);
  EXPECT_THROW(nlohmann::json({{"epoch", 1}}).get<DataPosition>(), Error);
}

// --- the built-in corpus ---

class TextCorpusTest : public LoaderTest {
 protected:
  void write_file(const std::string& name, const std::string& text) {
    std::ofstream(folder_ / "fortunes" / name, std::ios::binary) << text;
  }
};

TEST_F(TextCorpusTest, ReadsQuotesInFileOrderAndSkipsIndexesAndArt) {
  fs::create_directories(folder_ / "fortunes" / "off");
  write_file("b_quotes", "Second file.\n%\n\tIndented, with\ntwo lines.  \n%\n%\nlast\n");
  write_file("a_quotes", "First _\bquote.\n%\n_\bb_\bo_\bl_\bd words\n%\n");
  write_file("a_quotes.dat", std::string("\x00\x00\x00\x02junk", 8));
  fs::create_symlink(folder_ / "fortunes" / "a_quotes", folder_ / "fortunes" / "a_quotes.u8");
  write_file("ascii-art", "  /\\_/\\\n ( o.o )\n%\n");
  write_file("off/rude", "not read\n%\n");
  EXPECT_EQ(read_fortune_documents(folder_ / "fortunes"),
            (std::vector<std::string>{"First quote.", "bold words", "Second file.",
                                      "\tIndented, with\ntwo lines.", "last"}));
  const std::string absent = error_message([&] { read_fortune_documents(folder_ / "absent"); });
  EXPECT_TRUE(Contains(absent, "absent: no fortunes directory"));
  EXPECT_TRUE(Contains(absent, "apt-get install fortunes"));
}

TEST_F(TextCorpusTest, ReadsTheInstalledFortunes) {
  if (!fs::is_directory(kFortunesDirectory)) GTEST_SKIP() << "fortunes is not installed";
  const std::vector<std::string> documents = read_fortune_documents();
  EXPECT_GT(documents.size(), 10000u);
  size_t bytes = 0;
  for (const std::string& document : documents) {
    ASSERT_FALSE(document.empty());
    ASSERT_EQ(document.find('\b'), std::string::npos);
    bytes += document.size();
  }
  EXPECT_GT(bytes, 1'000'000u);
}

TEST_F(TextCorpusTest, PreparesOnceAndFeedsTheLoader) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  fs::create_directories(folder_ / "fortunes");
  std::vector<std::string> words(300);
  for (std::string& word : words) {
    for (size_t i = 0; i < 2 + rng_() % 7; ++i)
      word += static_cast<char>('a' + rng_() % 26);
  }
  std::string quotes;
  for (int q = 0; q < 200; ++q) {
    for (size_t w = 0; w < 3 + rng_() % 20; ++w)
      quotes += words[rng_() % words.size()] + (w % 7 == 6 ? "\n" : " ");
    quotes += "\n%\n";
  }
  write_file("songs", quotes);
  const BuiltinCorpusOptions options{
      .vocab_size = 300, .val_every = 10, .fortunes_directory = folder_ / "fortunes"};
  const fs::path cache = folder_ / "cache";
  const PreparedCorpus first = prepare_builtin_corpus(cache, options);
  EXPECT_FALSE(first.reused);
  EXPECT_EQ(first.val_documents, 20u);
  EXPECT_EQ(first.train_documents, 180u);
  const PreparedCorpus second = prepare_builtin_corpus(cache, options);
  EXPECT_TRUE(second.reused);
  EXPECT_EQ(second.train_tokens, first.train_tokens);
  EXPECT_EQ(second.vocab_size, first.vocab_size);

  const tokenizer::BpeTokenizer bpe = tokenizer::BpeTokenizer::load(first.tokenizer);
  EXPECT_EQ(bpe.vocab_size(), first.vocab_size);
  const TokenShard val = TokenShard::open(first.val_shard);
  EXPECT_EQ(val.bos_id(), bpe.bos_id());
  const std::vector<std::string> documents = read_fortune_documents(folder_ / "fortunes");
  std::string expected_val;
  for (size_t i = 9; i < documents.size(); i += 10)
    expected_val += "<|bos|>" + documents[i];
  EXPECT_EQ(bpe.decode(val.tokens()), expected_val);

  TokenLoader loader({first.train_shard}, {.batch = 2, .sequence = 32, .seed = seed_});
  EXPECT_EQ(loader.vocab_size(), bpe.vocab_size());
  const TokenBatch batch = loader.next_batch();
  EXPECT_EQ(batch.inputs[0], bpe.bos_id());
  EXPECT_EQ(batch.inputs[32], bpe.bos_id());

  // Another vocabulary size prepares again.
  BuiltinCorpusOptions larger = options;
  larger.vocab_size = 320;
  EXPECT_FALSE(prepare_builtin_corpus(cache, larger).reused);
  EXPECT_EQ(tokenizer::BpeTokenizer::load(first.tokenizer).vocab_size(), 320);
}

}  // namespace
}  // namespace fp8t::data
