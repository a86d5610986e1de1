// The built-in English corpus: the quotes of the Debian package `fortunes`, tokenized into a
// train and a validation shard that are cached on disk.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace fp8t::data {

inline constexpr std::string_view kFortunesDirectory = "/usr/share/games/fortunes";

// The documents of a text file: the whole file when `separator_line` is empty, else the runs of
// lines between lines equal to `separator_line` (separator lines belong to no document; the
// other lines keep their newlines). Empty documents are dropped. Throws fp8t::Error naming the
// file when it is missing or unreadable.
std::vector<std::string> read_text_documents(const std::filesystem::path& path,
                                             std::string_view separator_line = {});

// One document per quote, in a fixed order: files sorted by name, quotes in file order.
// Read: every regular file of `directory` except the strfile indexes (*.dat), the *.u8 links
// (copies of the plain files) and `ascii-art` (pictures, not prose); subfolders (such as the
// offensive `off/`) are not read. Quotes are separated by lines holding only "%"; overstrike
// sequences (a character and a backspace, old-style bold or underline) are removed, trailing
// whitespace is trimmed and empty quotes are dropped. Throws fp8t::Error naming the directory
// (and `apt-get install fortunes`) when it is missing or holds no quotes.
std::vector<std::string> read_fortune_documents(
    const std::filesystem::path& directory = kFortunesDirectory);

// The train/validation split used here and by `fp8train tokenize`: with val_every N > 0, the
// N-th, 2N-th, ... documents (index % N == N - 1) go to validation; N == 0 keeps all for training.
inline bool is_validation_document(uint64_t index, uint64_t val_every) {
  return val_every > 0 && index % val_every == val_every - 1;
}

struct BuiltinCorpusOptions {
  int vocab_size = 4096;  // special tokens included, as BpeTokenizer::train counts it
  int val_every = 50;     // see is_validation_document()
  std::filesystem::path fortunes_directory = kFortunesDirectory;
};

struct PreparedCorpus {
  std::filesystem::path tokenizer;  // tiktoken ranks; the special-token sidecar lies beside it
  std::filesystem::path train_shard;
  std::filesystem::path val_shard;
  int vocab_size = 0;  // of the tokenizer (below the request when the corpus ran out of pairs)
  uint64_t train_documents = 0;
  uint64_t val_documents = 0;
  uint64_t train_tokens = 0;
  uint64_t val_tokens = 0;
  bool reused = false;  // true when the cache already held this corpus
};

// Makes `cache_dir` hold tokenizer.tiktoken (+ sidecar), train_00000.tokens, val_00000.tokens
// and manifest.json: the tokenizer is trained on the training documents, each document is
// stored as BOS + its tokens. The manifest is written last and records the source (directory,
// document count, a hash of the text) and the options; when it matches, the files are reused.
// Every file is written atomically.
PreparedCorpus prepare_builtin_corpus(const std::filesystem::path& cache_dir,
                                      const BuiltinCorpusOptions& options = {});

}  // namespace fp8t::data
