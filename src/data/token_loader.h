// The training data loader: packs BOS-delimited documents from token shards into rows of
// T + 1 tokens and deals the rows to ranks.
//
// Order. Epoch e visits the shards in a permutation of the given list and, inside each shard,
// its documents in a permutation of their order in the file. Both are Fisher-Yates shuffles
// driven by std::mt19937_64 (fully specified by the standard, unlike std::shuffle): swap
// element i with element rng() % (i + 1), for i from n - 1 down to 1. The shard order is seeded
// with mix(seed, e, 0), the documents of the shard at list index s with mix(seed, e, s + 1),
// where mix(a, b, c) = splitmix64(splitmix64(splitmix64(a) ^ b) ^ c). Every epoch visits every
// document once; the stream of documents runs on from one epoch into the next.
//
// Packing. A document is a BOS token and the tokens up to the next BOS (or the end of the
// shard); tokens before a shard's first BOS belong to no document and are skipped. A row starts
// at a document start and takes documents whole, in order, while they fit; the first one that
// does not fit fills the rest of the row with its beginning and its remainder is dropped; the
// next row starts at the following document. A document longer than the row is cropped the
// same way. inputs = row[0..T), targets = row[1..T+1).
//
// Ranks. Rows are numbered globally; rank r keeps the rows whose number % world_size == r, so
// the ranks partition the stream that world_size 1 sees. After each batch the loader moves past
// the rest of that round of rows, so position() after k batches is the same on every rank.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "data/token_shard.h"

namespace fp8t::data {

struct TokenLoaderOptions {
  int64_t batch = 1;     // rows per batch on this rank (B)
  int64_t sequence = 1;  // tokens per row of inputs (T)
  int rank = 0;
  int world_size = 1;
  uint64_t seed = 0;
};

// Where the loader stands between batches: the next row starts at document `document_cursor`
// (in the epoch's document order) of shard `shard_cursor` (in the epoch's shard order).
struct DataPosition {
  uint64_t epoch = 0;
  uint64_t shard_cursor = 0;
  uint64_t document_cursor = 0;
  uint64_t rows_emitted = 0;  // global rows (all ranks) already produced
  uint64_t seed = 0;          // the loader's seed; seek() refuses a position from another seed

  bool operator==(const DataPosition&) const = default;
};

// JSON object with the five fields above, for checkpoints. from_json throws fp8t::Error naming
// a missing or non-integer field.
void to_json(nlohmann::json& json, const DataPosition& position);
void from_json(const nlohmann::json& json, DataPosition& position);

// inputs and targets are row-major B x T.
struct TokenBatch {
  std::vector<int32_t> inputs;
  std::vector<int32_t> targets;
};

class TokenLoader {
 public:
  // Reads every shard's header. Throws fp8t::Error for an empty list, bad options, a shard whose
  // vocab_size or bos_id differs from the first shard's (naming both files), or shards that hold
  // no document at all.
  TokenLoader(std::vector<std::filesystem::path> shard_paths, TokenLoaderOptions options);

  TokenBatch next_batch();

  DataPosition position() const;
  // Continues exactly where a loader with the same shards and seed stood at `position`.
  // Throws fp8t::Error for another seed or cursors outside the shards.
  void seek(const DataPosition& position);

  int64_t vocab_size() const { return vocab_size_; }
  int32_t bos_id() const { return bos_id_; }
  uint64_t documents_per_epoch() const { return documents_per_epoch_; }
  // Tokens in all shards (including any before a shard's first BOS, which are skipped).
  uint64_t tokens_per_epoch() const { return tokens_per_epoch_; }

 private:
  // Fills `row` (T + 1 tokens) from the cursor on, or only advances the cursor when `row` is
  // empty (a row of another rank).
  void pack_row(std::span<int32_t> row);
  // Moves the cursor to the next document, on into later shards and epochs.
  void advance_document();
  // Moves the cursor past shards without documents.
  void skip_empty_shards();
  void start_epoch(uint64_t epoch);
  // The current document's tokens; loads the shard when the cursor entered another one.
  std::span<const int32_t> current_document();

  std::vector<std::filesystem::path> shard_paths_;
  std::vector<uint64_t> shard_documents_;  // documents per shard (from the headers)
  TokenLoaderOptions options_;
  int64_t vocab_size_ = 0;
  int32_t bos_id_ = 0;
  uint64_t documents_per_epoch_ = 0;
  uint64_t tokens_per_epoch_ = 0;

  DataPosition cursor_;
  std::vector<size_t> shard_order_;  // this epoch's permutation of shard indices

  // The shard under the cursor, loaded on first use.
  struct LoadedShard {
    size_t index = 0;  // in shard_paths_
    TokenShard shard;
    std::vector<size_t> document_starts;   // in file order; the last ends at the shard's end
    std::vector<uint32_t> document_order;  // a permutation of document indices
    std::optional<uint64_t> order_epoch;   // the epoch document_order belongs to
  };
  std::optional<LoadedShard> loaded_;
};

}  // namespace fp8t::data
