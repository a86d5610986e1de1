// `fp8train tokenize`: text files to token shards, training the tokenizer when asked.
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/error.h"
#include "data/text_corpus.h"
#include "data/token_shard.h"
#include "tokenizer/bpe_tokenizer.h"

namespace fp8t::cli {

namespace {

// Writes `documents` as BOS-prefixed token streams into shards `prefix`_00000.tokens, ... of
// at most `shard_tokens` tokens each (a longer document gets a shard of its own).
void write_shards(const tokenizer::BpeTokenizer& bpe, const std::vector<std::string>& documents,
                  const std::filesystem::path& folder, const std::string& prefix,
                  int64_t shard_tokens) {
  std::vector<int32_t> tokens;
  uint64_t shard_documents = 0;
  int shard_index = 0;
  const auto flush = [&] {
    const std::filesystem::path path =
        folder / fmt::format("{}_{:05d}.tokens", prefix, shard_index++);
    data::write_token_shard(path, tokens, bpe.vocab_size(), bpe.bos_id());
    fmt::print("wrote {}: {} documents, {} tokens\n", path.string(), shard_documents,
               tokens.size());
    tokens.clear();
    shard_documents = 0;
  };
  for (const std::string& document : documents) {
    const std::vector<int32_t> ids = bpe.encode_document(document);
    if (!tokens.empty() && static_cast<int64_t>(tokens.size() + ids.size()) > shard_tokens) {
      flush();
    }
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    ++shard_documents;
  }
  if (!tokens.empty()) flush();
}

}  // namespace

int run_tokenize(const TokenizeOptions& options) {
  std::vector<std::string> train_documents;
  std::vector<std::string> val_documents;
  uint64_t bytes = 0;
  for (const std::string& input : options.inputs) {
    for (std::string& document : data::read_text_documents(input, options.separator)) {
      const uint64_t index = train_documents.size() + val_documents.size();
      bytes += document.size();
      (data::is_validation_document(index, static_cast<uint64_t>(options.val_every))
           ? val_documents
           : train_documents)
          .push_back(std::move(document));
    }
  }
  fmt::print("documents: {} from {} files, {:.2f} MB (train {}, val {})\n",
             train_documents.size() + val_documents.size(), options.inputs.size(),
             static_cast<double>(bytes) / 1e6, train_documents.size(), val_documents.size());
  FP8T_CHECK(!train_documents.empty(), "tokenize: the input files hold no training document");

  const std::filesystem::path tokenizer_path = options.tokenizer_path;
  const auto load_or_train = [&] {
    if (!options.train_tokenizer) return tokenizer::BpeTokenizer::load(tokenizer_path);
    const auto start = std::chrono::steady_clock::now();
    tokenizer::BpeTokenizer trained =
        tokenizer::BpeTokenizer::train(train_documents, options.vocab_size);
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    if (tokenizer_path.has_parent_path()) {
      std::filesystem::create_directories(tokenizer_path.parent_path());
    }
    trained.save(tokenizer_path);
    fmt::print("tokenizer: trained on the training documents in {:.1f} s, saved to {}\n",
               took.count(), tokenizer_path.string());
    return trained;
  };
  const tokenizer::BpeTokenizer bpe = load_or_train();
  fmt::print("tokenizer: vocab {} ({} mergeable + {} special), bos id {}\n", bpe.vocab_size(),
             bpe.mergeable_count(), bpe.special_tokens().size(), bpe.bos_id());

  const std::filesystem::path output = options.output_dir;
  std::filesystem::create_directories(output);
  write_shards(bpe, train_documents, output, "train", options.shard_tokens);
  write_shards(bpe, val_documents, output, "val", options.shard_tokens);
  return kExitOk;
}

}  // namespace fp8t::cli
