#include "data/token_loader.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace fp8t::data {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t stream_seed(uint64_t seed, uint64_t epoch, uint64_t stream) {
  return splitmix64(splitmix64(splitmix64(seed) ^ epoch) ^ stream);
}

// Fisher-Yates with a specified generator, so every platform gets the same order.
template <typename T>
void shuffle(std::vector<T>& items, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = items.size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(rng() % i);
    std::swap(items[i - 1], items[j]);
  }
}

constexpr const char* kPositionFields[] = {"epoch", "shard_cursor", "document_cursor",
                                           "rows_emitted", "seed"};

}  // namespace

void to_json(nlohmann::json& json, const DataPosition& position) {
  json = {{"epoch", position.epoch},
          {"shard_cursor", position.shard_cursor},
          {"document_cursor", position.document_cursor},
          {"rows_emitted", position.rows_emitted},
          {"seed", position.seed}};
}

void from_json(const nlohmann::json& json, DataPosition& position) {
  for (const char* field : kPositionFields) {
    if (!json.is_object() || !json.contains(field) || !json[field].is_number_unsigned()) {
      throw Error(fmt::format("data position: expected a non-negative integer \"{}\" in {}", field,
                              json.dump()));
    }
  }
  position.epoch = json["epoch"].get<uint64_t>();
  position.shard_cursor = json["shard_cursor"].get<uint64_t>();
  position.document_cursor = json["document_cursor"].get<uint64_t>();
  position.rows_emitted = json["rows_emitted"].get<uint64_t>();
  position.seed = json["seed"].get<uint64_t>();
}

TokenLoader::TokenLoader(std::vector<std::filesystem::path> shard_paths, TokenLoaderOptions options)
    : shard_paths_(std::move(shard_paths)), options_(options) {
  FP8T_CHECK(!shard_paths_.empty(), "token loader: no shards given");
  FP8T_CHECK(options_.batch >= 1 && options_.sequence >= 1,
             "token loader: batch and sequence must be at least 1, found batch {} sequence {}",
             options_.batch, options_.sequence);
  FP8T_CHECK(options_.world_size >= 1 && options_.rank >= 0 && options_.rank < options_.world_size,
             "token loader: rank {} is not in [0, world_size {})", options_.rank,
             options_.world_size);

  const TokenShardHeader first = read_token_shard_header(shard_paths_.front());
  vocab_size_ = first.vocab_size;
  bos_id_ = static_cast<int32_t>(first.bos_id);
  for (const std::filesystem::path& path : shard_paths_) {
    const TokenShardHeader header = read_token_shard_header(path);
    if (header.vocab_size != first.vocab_size || header.bos_id != first.bos_id) {
      throw Error(fmt::format(
          "token loader: {} has vocab_size {} and bos_id {}, but {} has vocab_size {} and bos_id "
          "{}; all shards must come from one tokenizer",
          path.string(), header.vocab_size, header.bos_id, shard_paths_.front().string(),
          first.vocab_size, first.bos_id));
    }
    FP8T_CHECK(header.document_count <= std::numeric_limits<uint32_t>::max(),
               "token loader: {} has {} documents; at most 2^32 - 1 per shard are supported",
               path.string(), header.document_count);
    shard_documents_.push_back(header.document_count);
    documents_per_epoch_ += header.document_count;
    tokens_per_epoch_ += header.token_count;
  }
  if (documents_per_epoch_ == 0) {
    throw Error(
        fmt::format("token loader: the {} shards (first {}) hold no document: no BOS "
                    "token ({}) at all",
                    shard_paths_.size(), shard_paths_.front().string(), bos_id_));
  }
  cursor_.seed = options_.seed;
  start_epoch(0);
  skip_empty_shards();
}

void TokenLoader::start_epoch(uint64_t epoch) {
  cursor_.epoch = epoch;
  cursor_.shard_cursor = 0;
  cursor_.document_cursor = 0;
  shard_order_.resize(shard_paths_.size());
  std::iota(shard_order_.begin(), shard_order_.end(), size_t{0});
  shuffle(shard_order_, stream_seed(options_.seed, epoch, 0));
}

void TokenLoader::skip_empty_shards() {
  while (shard_documents_[shard_order_[cursor_.shard_cursor]] == 0) {
    if (++cursor_.shard_cursor == shard_paths_.size()) start_epoch(cursor_.epoch + 1);
  }
}

void TokenLoader::advance_document() {
  ++cursor_.document_cursor;
  if (cursor_.document_cursor < shard_documents_[shard_order_[cursor_.shard_cursor]]) return;
  cursor_.document_cursor = 0;
  if (++cursor_.shard_cursor == shard_paths_.size()) start_epoch(cursor_.epoch + 1);
  skip_empty_shards();
}

std::span<const int32_t> TokenLoader::current_document() {
  const size_t index = shard_order_[cursor_.shard_cursor];
  if (!loaded_ || loaded_->index != index) {
    TokenShard shard = TokenShard::open(shard_paths_[index]);
    // The header was read when the loader was made; the file may have changed since.
    FP8T_CHECK(shard.header().document_count == shard_documents_[index] &&
                   shard.vocab_size() == vocab_size_ && shard.bos_id() == bos_id_,
               "token loader: {} changed while the loader was running",
               shard_paths_[index].string());
    std::vector<size_t> document_starts;
    for (size_t i = 0; i < shard.tokens().size(); ++i) {
      if (shard.tokens()[i] == bos_id_) document_starts.push_back(i);
    }
    loaded_.emplace(LoadedShard{index, std::move(shard), std::move(document_starts), {}, {}});
  }
  if (!loaded_->order_epoch || *loaded_->order_epoch != cursor_.epoch) {
    std::vector<uint32_t>& order = loaded_->document_order;
    order.resize(loaded_->document_starts.size());
    std::iota(order.begin(), order.end(), uint32_t{0});
    shuffle(order, stream_seed(options_.seed, cursor_.epoch, index + 1));
    loaded_->order_epoch = cursor_.epoch;
  }
  const std::vector<int32_t>& tokens = loaded_->shard.tokens();
  const uint32_t document = loaded_->document_order[cursor_.document_cursor];
  const size_t begin = loaded_->document_starts[document];
  const size_t end = document + 1 < loaded_->document_starts.size()
                         ? loaded_->document_starts[document + 1]
                         : tokens.size();
  return std::span<const int32_t>(tokens).subspan(begin, end - begin);
}

void TokenLoader::pack_row(std::span<int32_t> row) {
  const auto row_tokens = static_cast<size_t>(options_.sequence + 1);
  for (size_t filled = 0; filled < row_tokens;) {
    const std::span<const int32_t> document = current_document();
    const size_t taken = std::min(document.size(), row_tokens - filled);
    if (!row.empty()) std::copy_n(document.begin(), taken, row.begin() + filled);
    filled += taken;
    advance_document();
  }
  ++cursor_.rows_emitted;
}

TokenBatch TokenLoader::next_batch() {
  const auto batch = static_cast<size_t>(options_.batch);
  const auto sequence = static_cast<size_t>(options_.sequence);
  const auto world = static_cast<uint64_t>(options_.world_size);
  const auto rank = static_cast<uint64_t>(options_.rank);
  TokenBatch result{std::vector<int32_t>(batch * sequence), std::vector<int32_t>(batch * sequence)};
  std::vector<int32_t> row(sequence + 1);
  for (size_t b = 0; b < batch; ++b) {
    while (cursor_.rows_emitted % world != rank)
      pack_row({});
    pack_row(row);
    std::copy_n(row.begin(), sequence, result.inputs.begin() + b * sequence);
    std::copy_n(row.begin() + 1, sequence, result.targets.begin() + b * sequence);
  }
  while (cursor_.rows_emitted % world != 0)
    pack_row({});
  return result;
}

DataPosition TokenLoader::position() const {
  return cursor_;
}

void TokenLoader::seek(const DataPosition& position) {
  FP8T_CHECK(position.seed == options_.seed,
             "token loader: the position was saved with seed {}, this loader has seed {}",
             position.seed, options_.seed);
  FP8T_CHECK(position.shard_cursor < shard_paths_.size(),
             "token loader: the position's shard_cursor {} is not below the {} shards",
             position.shard_cursor, shard_paths_.size());
  start_epoch(position.epoch);
  const uint64_t documents = shard_documents_[shard_order_[position.shard_cursor]];
  FP8T_CHECK(position.document_cursor < documents,
             "token loader: the position's document_cursor {} is not below the {} documents of "
             "{} (were the shards changed?)",
             position.document_cursor, documents,
             shard_paths_[shard_order_[position.shard_cursor]].string());
  cursor_ = position;
}

}  // namespace fp8t::data
