#include "data/text_corpus.h"

#include <algorithm>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/token_shard.h"
#include "io/files.h"
#include "tokenizer/bpe_tokenizer.h"

namespace fp8t::data {

namespace {

constexpr std::string_view kManifestFormat = "fp8train-builtin-corpus";
constexpr int kManifestVersion = 1;

// Files of the package that are not prose.
const std::set<std::string, std::less<>> kSkippedFortuneFiles = {"ascii-art"};

bool is_fortune_file(const std::filesystem::directory_entry& entry) {
  const std::filesystem::path& path = entry.path();
  const std::string name = path.filename().string();
  return entry.is_regular_file() && !entry.is_symlink() && !name.starts_with(".") &&
         path.extension() != ".dat" && path.extension() != ".u8" &&
         !kSkippedFortuneFiles.contains(name);
}

// Drops overstrike pairs (a character, then a backspace) and trailing whitespace.
std::string clean_quote(std::string_view quote) {
  std::string text;
  for (size_t i = 0; i < quote.size(); ++i) {
    if (i + 1 < quote.size() && quote[i + 1] == '\b') {
      ++i;
      continue;
    }
    if (quote[i] != '\b') text.push_back(quote[i]);
  }
  while (!text.empty() && std::string_view(" \t\r\n").find(text.back()) != std::string_view::npos)
    text.pop_back();
  return text;
}

// FNV-1a over the documents, each followed by a 0 byte: identifies the source text.
uint64_t corpus_hash(const std::vector<std::string>& documents) {
  uint64_t hash = 0xcbf29ce484222325ull;
  const auto mix = [&hash](unsigned char byte) { hash = (hash ^ byte) * 0x100000001b3ull; };
  for (const std::string& document : documents) {
    for (const char c : document)
      mix(static_cast<unsigned char>(c));
    mix(0);
  }
  return hash;
}

}  // namespace

std::vector<std::string> read_text_documents(const std::filesystem::path& path,
                                             std::string_view separator_line) {
  std::string text = io::read_file(path);
  std::vector<std::string> documents;
  if (separator_line.empty()) {
    if (!text.empty()) documents.push_back(std::move(text));
    return documents;
  }
  std::string document;
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = std::min(text.find('\n', begin), text.size());
    const std::string_view line(text.data() + begin, end - begin);
    if (line == separator_line) {
      if (!document.empty()) documents.push_back(std::move(document));
      document.clear();
    } else {
      document.append(text, begin, std::min(end + 1, text.size()) - begin);
    }
    begin = end + 1;
  }
  if (!document.empty()) documents.push_back(std::move(document));
  return documents;
}

std::vector<std::string> read_fortune_documents(const std::filesystem::path& directory) {
  std::error_code error;
  if (!std::filesystem::is_directory(directory, error)) {
    throw Error(
        fmt::format("{}: no fortunes directory; the built-in English corpus comes from "
                    "the Debian package fortunes: apt-get install fortunes (or run "
                    "scripts/setup.sh)",
                    directory.string()));
  }
  std::vector<std::filesystem::path> files;
  for (const std::filesystem::directory_entry& entry :
       std::filesystem::directory_iterator(directory)) {
    if (is_fortune_file(entry)) files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());

  std::vector<std::string> documents;
  for (const std::filesystem::path& file : files) {
    for (const std::string& quote : read_text_documents(file, "%")) {
      if (std::string document = clean_quote(quote); !document.empty()) {
        documents.push_back(std::move(document));
      }
    }
  }
  if (documents.empty()) {
    throw Error(
        fmt::format("{}: holds no fortune quotes ({} files read); apt-get install "
                    "fortunes installs the built-in English corpus",
                    directory.string(), files.size()));
  }
  return documents;
}

PreparedCorpus prepare_builtin_corpus(const std::filesystem::path& cache_dir,
                                      const BuiltinCorpusOptions& options) {
  FP8T_CHECK(options.val_every >= 2,
             "built-in corpus: val_every must be at least 2 (a validation document every N), "
             "found {}",
             options.val_every);
  const std::vector<std::string> documents = read_fortune_documents(options.fortunes_directory);

  PreparedCorpus corpus;
  corpus.tokenizer = cache_dir / "tokenizer.tiktoken";
  corpus.train_shard = cache_dir / "train_00000.tokens";
  corpus.val_shard = cache_dir / "val_00000.tokens";
  const std::filesystem::path manifest_path = cache_dir / "manifest.json";
  const nlohmann::ordered_json source = {
      {"format", kManifestFormat},
      {"version", kManifestVersion},
      {"fortunes_directory", options.fortunes_directory.string()},
      {"documents", documents.size()},
      {"text_fnv1a64", fmt::format("{:016x}", corpus_hash(documents))},
      {"requested_vocab_size", options.vocab_size},
      {"val_every", options.val_every}};

  // Reuse the cache when its manifest describes this very source and these options.
  std::error_code error;
  if (std::filesystem::is_regular_file(manifest_path, error)) {
    const nlohmann::ordered_json manifest =
        nlohmann::ordered_json::parse(io::read_file(manifest_path), nullptr, false);
    const bool same_source =
        manifest.is_object() &&
        std::all_of(source.items().begin(), source.items().end(), [&manifest](const auto& item) {
          return manifest.contains(item.key()) && manifest[item.key()] == item.value();
        });
    const std::filesystem::path files[] = {corpus.tokenizer,
                                           tokenizer::special_tokens_path(corpus.tokenizer),
                                           corpus.train_shard, corpus.val_shard};
    if (same_source && std::all_of(std::begin(files), std::end(files), [](const auto& path) {
          std::error_code missing;
          return std::filesystem::is_regular_file(path, missing);
        })) {
      const TokenShardHeader train = read_token_shard_header(corpus.train_shard);
      const TokenShardHeader val = read_token_shard_header(corpus.val_shard);
      corpus.vocab_size = static_cast<int>(train.vocab_size);
      corpus.train_documents = train.document_count;
      corpus.val_documents = val.document_count;
      corpus.train_tokens = train.token_count;
      corpus.val_tokens = val.token_count;
      corpus.reused = true;
      return corpus;
    }
  }

  std::vector<std::string> train_documents;
  std::vector<std::string> val_documents;
  for (size_t i = 0; i < documents.size(); ++i) {
    (is_validation_document(i, static_cast<uint64_t>(options.val_every)) ? val_documents
                                                                         : train_documents)
        .push_back(documents[i]);
  }
  const tokenizer::BpeTokenizer bpe =
      tokenizer::BpeTokenizer::train(train_documents, options.vocab_size);
  std::filesystem::create_directories(cache_dir, error);
  if (error) {
    throw Error(fmt::format("{}: cannot create the corpus cache folder: {}", cache_dir.string(),
                            error.message()));
  }
  bpe.save(corpus.tokenizer);
  const auto write_split = [&bpe](const std::filesystem::path& path,
                                  const std::vector<std::string>& split) {
    std::vector<int32_t> tokens;
    for (const std::string& document : split) {
      const std::vector<int32_t> ids = bpe.encode_document(document);
      tokens.insert(tokens.end(), ids.begin(), ids.end());
    }
    write_token_shard(path, tokens, bpe.vocab_size(), bpe.bos_id());
    return static_cast<uint64_t>(tokens.size());
  };
  corpus.train_tokens = write_split(corpus.train_shard, train_documents);
  corpus.val_tokens = write_split(corpus.val_shard, val_documents);
  corpus.vocab_size = bpe.vocab_size();
  corpus.train_documents = train_documents.size();
  corpus.val_documents = val_documents.size();

  nlohmann::ordered_json manifest = source;
  manifest["vocab_size"] = corpus.vocab_size;
  manifest["train_tokens"] = corpus.train_tokens;
  manifest["val_tokens"] = corpus.val_tokens;
  io::write_file_atomically(manifest_path, manifest.dump(2) + "\n");
  return corpus;
}

}  // namespace fp8t::data
