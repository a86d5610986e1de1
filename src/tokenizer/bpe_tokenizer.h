// A byte-level BPE tokenizer in the style of GPT-4 (tiktoken) and nanochat (rustbpe).
//
// Text is first pre-split into chunks by a regular expression (nanochat's GPT-4-style pattern);
// merges never cross a chunk boundary. Every byte 0..255 is a token, so any byte string encodes
// and decode(encode(s)) == s. Token ids are tiktoken ranks: a mergeable token's id is its rank,
// and encoding merges, inside each chunk, the adjacent pair whose concatenation has the lowest
// rank first, as tiktoken does. Special tokens follow the mergeable tokens and count in the
// vocabulary size, as in nanochat.
//
// Files: `save(path)` writes `path` in the tiktoken text format (one line per mergeable token:
// base64 of its bytes, a space, its rank; ranks 0..n-1 in order) and a JSON sidecar
// `special_tokens_path(path)` holding the split pattern and the special tokens with their ids.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace fp8t::tokenizer {

// nanochat's SPLIT_PATTERN: GPT-4's, with numbers split into runs of at most two digits.
inline constexpr std::string_view kSplitPattern =
    R"('(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+)";

// The special token that starts every document (nanochat's name).
inline constexpr std::string_view kBosToken = "<|bos|>";

// nanochat's special tokens, in id order: <|bos|> and the chat-rendering tokens.
std::vector<std::string> nanochat_special_tokens();

// The chunks that BPE merges within. Invalid UTF-8 never matches the pattern (PCRE2 runs with
// PCRE2_MATCH_INVALID_UTF), so each run of bytes between matches becomes a chunk of its own; the
// chunks therefore always concatenate back to `text`. The views point into `text`.
std::vector<std::string_view> pre_split(std::string_view text);

class BpeTokenizer {
 public:
  // Learns merges on `texts` until the vocabulary (special tokens included) has `vocab_size`
  // tokens, or until no adjacent pair is left. Each step merges the pair with the highest count
  // over all chunks; ties go to the smaller pair (left id, then right id). A merge whose bytes
  // already form a token reuses that token. Throws when vocab_size leaves fewer than 256
  // mergeable tokens or a special token is empty or repeated.
  static BpeTokenizer train(std::span<const std::string> texts, int vocab_size,
                            std::vector<std::string> special_tokens = nanochat_special_tokens());

  // Reads `path` and its sidecar. Throws fp8t::Error naming the file (and line) for a missing
  // file, bad base64, a rank out of order, a repeated token, a missing single byte, a sidecar
  // that is not the expected JSON or whose ids do not follow the mergeable tokens.
  static BpeTokenizer load(const std::filesystem::path& path);
  // Writes `path` and its sidecar, each atomically.
  void save(const std::filesystem::path& path) const;

  // Ordinary text: special token names in it are encoded as plain text.
  std::vector<int32_t> encode(std::string_view text) const;
  // A document as the training data holds it: <|bos|>, then encode(text).
  std::vector<int32_t> encode_document(std::string_view text) const;
  // Concatenated token bytes; a special token decodes to its name. Throws for an id outside
  // the vocabulary.
  std::string decode(std::span<const int32_t> ids) const;

  int vocab_size() const { return mergeable_count() + static_cast<int>(special_tokens_.size()); }
  int mergeable_count() const { return static_cast<int>(token_bytes_.size()); }
  const std::vector<std::string>& special_tokens() const { return special_tokens_; }
  // Throws when the tokenizer has no such special token.
  int32_t special_token_id(std::string_view name) const;
  int32_t bos_id() const { return special_token_id(kBosToken); }
  // The bytes of a mergeable token (its rank is `id`).
  const std::string& token_bytes(int32_t id) const { return token_bytes_.at(id); }

 private:
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
  };
  using RankMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

  BpeTokenizer(std::vector<std::string> token_bytes, RankMap ranks,
               std::vector<std::string> special_tokens);
  // Appends the tokens of one pre-split chunk.
  void encode_chunk(std::string_view chunk, std::vector<int32_t>& ids) const;
  // The rank of a byte string, or -1 when it is not a token.
  int32_t rank_of(std::string_view bytes) const;

  std::vector<std::string> token_bytes_;     // by rank
  RankMap ranks_;                            // bytes -> rank
  std::vector<std::string> special_tokens_;  // special token i has id mergeable_count() + i
};

// The sidecar that save() writes beside `path`: `path` + ".special_tokens.json".
std::filesystem::path special_tokens_path(const std::filesystem::path& path);

}  // namespace fp8t::tokenizer
