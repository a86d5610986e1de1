#include "tokenizer/bpe_tokenizer.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <limits>
#include <memory>
#include <queue>
#include <set>
#include <utility>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/base64.h"
#include "io/files.h"

namespace fp8t::tokenizer {

namespace {

constexpr int kByteTokens = 256;
constexpr std::string_view kSidecarFormat = "fp8train-bpe-special-tokens";
constexpr int kSidecarVersion = 1;
// The sidecar nests 3 levels (the object, special_tokens, an entry). Its messages print values
// with dump(), which recurses once per level: a deeply nested file would overflow the stack.
constexpr int kMaxSidecarDepth = 16;

std::string pcre2_message(int code) {
  std::array<PCRE2_UCHAR, 256> buffer{};
  pcre2_get_error_message(code, buffer.data(), buffer.size());
  return reinterpret_cast<const char*>(buffer.data());
}

// kSplitPattern, compiled once per process. The compiled code is immutable and shared by all
// threads; each match call brings its own match data.
class SplitRegex {
 public:
  SplitRegex() {
    int error = 0;
    PCRE2_SIZE error_offset = 0;
    // UCP: \s and \p{..} follow Unicode, as Python's `regex` module does for tiktoken.
    // MATCH_INVALID_UTF: invalid UTF-8 is never matched (rather than rejected), and the subject
    // is not re-validated on every call.
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kSplitPattern.data()), kSplitPattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &error_offset,
                          nullptr);
    if (code_ == nullptr) {
      throw Error(fmt::format("tokenizer: cannot compile the split pattern at offset {}: {}",
                              error_offset, pcre2_message(error)));
    }
    // Without JIT support (some platforms) the interpreter runs the same pattern, only slower.
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
  }
  ~SplitRegex() { pcre2_code_free(code_); }
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;

  // Calls on_chunk(view) for each chunk of `text`, in order; see pre_split().
  template <typename OnChunk>
  void for_each_chunk(std::string_view text, OnChunk&& on_chunk) const {
    const std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match(
        pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
    FP8T_CHECK(match != nullptr, "tokenizer: out of memory for PCRE2 match data");
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t offset = 0;
    while (offset < text.size()) {
      const int result = pcre2_match(code_, subject, text.size(), offset, 0, match.get(), nullptr);
      if (result == PCRE2_ERROR_NOMATCH) {
        on_chunk(text.substr(offset));
        return;
      }
      if (result < 0) {
        throw Error(fmt::format("tokenizer: pre-splitting failed at byte {}: {}", offset,
                                pcre2_message(result)));
      }
      const PCRE2_SIZE* bounds = pcre2_get_ovector_pointer(match.get());
      FP8T_CHECK(bounds[1] > bounds[0], "tokenizer: the split pattern matched an empty string");
      if (bounds[0] > offset) on_chunk(text.substr(offset, bounds[0] - offset));
      on_chunk(text.substr(bounds[0], bounds[1] - bounds[0]));
      offset = bounds[1];
    }
  }

 private:
  pcre2_code* code_ = nullptr;
};

const SplitRegex& split_regex() {
  static const SplitRegex regex;
  return regex;
}

void check_special_token_names(const std::vector<std::string>& names, const std::string& source) {
  std::set<std::string_view> seen;
  for (const std::string& name : names) {
    if (name.empty()) throw Error(fmt::format("{}: a special token name is empty", source));
    if (!seen.insert(name).second) {
      throw Error(fmt::format("{}: special token '{}' is given twice", source, name));
    }
  }
}

// --- training ---

using PairKey = uint64_t;

PairKey pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(left) << 32) | static_cast<uint32_t>(right);
}
int32_t pair_left(PairKey key) {
  return static_cast<int32_t>(key >> 32);
}
int32_t pair_right(PairKey key) {
  return static_cast<int32_t>(key & 0xffffffffu);
}

// A unique chunk of the training text and how often it occurs.
struct Word {
  std::vector<int32_t> ids;
  int64_t count = 0;
};

struct HeapEntry {
  int64_t count;
  PairKey pair;
};

// Heap order: the highest count on top; among equal counts the smaller pair (left id, then
// right id), which makes training independent of hash-map iteration order.
bool lower_priority(const HeapEntry& a, const HeapEntry& b) {
  if (a.count != b.count) return a.count < b.count;
  return a.pair > b.pair;
}

// Pair counts over all words, the words each pair may occur in, and a max-heap with lazy
// deletion: an entry whose count is stale is re-pushed with the current count when popped.
class PairStatistics {
 public:
  explicit PairStatistics(const std::vector<Word>& words) {
    for (uint32_t w = 0; w < words.size(); ++w) {
      const std::vector<int32_t>& ids = words[w].ids;
      for (size_t i = 0; i + 1 < ids.size(); ++i)
        add(pair_key(ids[i], ids[i + 1]), words[w].count, w);
    }
    for (const auto& [pair, count] : counts_)
      push(pair);
  }

  void add(PairKey pair, int64_t count, uint32_t word) {
    counts_[pair] += count;
    std::vector<uint32_t>& where = words_[pair];
    if (where.empty() || where.back() != word) where.push_back(word);
  }
  void remove(PairKey pair, int64_t count) { counts_[pair] -= count; }
  void push(PairKey pair) {
    heap_.push_back({counts_[pair], pair});
    std::push_heap(heap_.begin(), heap_.end(), lower_priority);
  }

  // The pair with the highest current count, or false when no pair occurs any more.
  bool pop_best(HeapEntry& best) {
    while (!heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end(), lower_priority);
      const HeapEntry top = heap_.back();
      heap_.pop_back();
      const int64_t current = counts_[top.pair];
      if (current == top.count && current > 0) {
        best = top;
        return true;
      }
      if (current > 0 && current != top.count) push(top.pair);
    }
    return false;
  }

  // The words that may hold `pair` (possibly stale); the list is handed over.
  std::vector<uint32_t> take_words(PairKey pair) {
    const auto found = words_.find(pair);
    if (found == words_.end()) return {};
    std::vector<uint32_t> result = std::move(found->second);
    words_.erase(found);
    return result;
  }

 private:
  std::unordered_map<PairKey, int64_t> counts_;
  std::unordered_map<PairKey, std::vector<uint32_t>> words_;
  std::vector<HeapEntry> heap_;
};

// Replaces each (left, right) in `ids`, left to right, by `merged`; false when none occurs.
bool merge_pair(std::vector<int32_t>& ids, int32_t left, int32_t right, int32_t merged) {
  size_t out = 0;
  bool changed = false;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i + 1 < ids.size() && ids[i] == left && ids[i + 1] == right) {
      ids[out++] = merged;
      ++i;
      changed = true;
    } else {
      ids[out++] = ids[i];
    }
  }
  ids.resize(out);
  return changed;
}

}  // namespace

std::vector<std::string> nanochat_special_tokens() {
  return {std::string(kBosToken), "<|user_start|>",    "<|user_end|>",
          "<|assistant_start|>",  "<|assistant_end|>", "<|python_start|>",
          "<|python_end|>",       "<|output_start|>",  "<|output_end|>"};
}

std::vector<std::string_view> pre_split(std::string_view text) {
  std::vector<std::string_view> chunks;
  split_regex().for_each_chunk(text,
                               [&chunks](std::string_view chunk) { chunks.push_back(chunk); });
  return chunks;
}

std::filesystem::path special_tokens_path(const std::filesystem::path& path) {
  std::filesystem::path sidecar = path;
  sidecar += ".special_tokens.json";
  return sidecar;
}

BpeTokenizer::BpeTokenizer(std::vector<std::string> token_bytes, RankMap ranks,
                           std::vector<std::string> special_tokens)
    : token_bytes_(std::move(token_bytes)),
      ranks_(std::move(ranks)),
      special_tokens_(std::move(special_tokens)) {}

BpeTokenizer BpeTokenizer::train(std::span<const std::string> texts, int vocab_size,
                                 std::vector<std::string> special_tokens) {
  check_special_token_names(special_tokens, "tokenizer training");
  const int mergeable_target = vocab_size - static_cast<int>(special_tokens.size());
  FP8T_CHECK(mergeable_target >= kByteTokens,
             "tokenizer training: vocab_size {} with {} special tokens leaves {} mergeable "
             "tokens; at least {} (one per byte) are needed",
             vocab_size, special_tokens.size(), mergeable_target, kByteTokens);

  // Merges never cross chunks, so each distinct chunk is trained on once, weighted by count.
  std::unordered_map<std::string_view, int64_t> chunk_counts;
  for (const std::string& text : texts) {
    split_regex().for_each_chunk(
        text, [&chunk_counts](std::string_view chunk) { ++chunk_counts[chunk]; });
  }
  std::vector<Word> words;
  words.reserve(chunk_counts.size());
  for (const auto& [chunk, count] : chunk_counts) {
    Word word{std::vector<int32_t>(chunk.size()), count};
    std::transform(chunk.begin(), chunk.end(), word.ids.begin(), [](char byte) {
      return static_cast<int32_t>(static_cast<unsigned char>(byte));
    });
    words.push_back(std::move(word));
  }

  std::vector<std::string> token_bytes;
  RankMap ranks;
  for (int byte = 0; byte < kByteTokens; ++byte) {
    token_bytes.emplace_back(1, static_cast<char>(byte));
    ranks.emplace(token_bytes.back(), byte);
  }

  PairStatistics pairs(words);
  std::vector<uint32_t> last_visit(words.size(), std::numeric_limits<uint32_t>::max());
  std::vector<PairKey> grown;
  HeapEntry best{};
  for (uint32_t step = 0;
       static_cast<int>(token_bytes.size()) < mergeable_target && pairs.pop_best(best); ++step) {
    const int32_t left = pair_left(best.pair);
    const int32_t right = pair_right(best.pair);
    std::string bytes = token_bytes[left] + token_bytes[right];
    const auto [found, is_new] = ranks.try_emplace(bytes, static_cast<int32_t>(token_bytes.size()));
    const int32_t merged = found->second;
    if (is_new) token_bytes.push_back(std::move(bytes));

    // Pairs of other tokens are the same before and after the merge, so only pairs holding
    // `left`, `right` or `merged` are recounted (`merged` can exist before when it is an older
    // token); only pairs with `merged` can grow.
    const auto touches = [&](int32_t a, int32_t b) {
      return a == left || a == right || a == merged || b == left || b == right || b == merged;
    };
    grown.clear();
    for (const uint32_t w : pairs.take_words(best.pair)) {
      if (last_visit[w] == step) continue;
      last_visit[w] = step;
      Word& word = words[w];
      std::vector<int32_t> before = word.ids;
      if (!merge_pair(word.ids, left, right, merged)) continue;
      for (size_t i = 0; i + 1 < before.size(); ++i) {
        if (touches(before[i], before[i + 1])) {
          pairs.remove(pair_key(before[i], before[i + 1]), word.count);
        }
      }
      for (size_t i = 0; i + 1 < word.ids.size(); ++i) {
        const int32_t a = word.ids[i];
        const int32_t b = word.ids[i + 1];
        if (!touches(a, b)) continue;
        pairs.add(pair_key(a, b), word.count, w);
        if (a == merged || b == merged) grown.push_back(pair_key(a, b));
      }
    }
    std::sort(grown.begin(), grown.end());
    grown.erase(std::unique(grown.begin(), grown.end()), grown.end());
    for (const PairKey pair : grown)
      pairs.push(pair);
  }
  return BpeTokenizer(std::move(token_bytes), std::move(ranks), std::move(special_tokens));
}

int32_t BpeTokenizer::rank_of(std::string_view bytes) const {
  const auto found = ranks_.find(bytes);
  return found == ranks_.end() ? -1 : found->second;
}

void BpeTokenizer::encode_chunk(std::string_view chunk, std::vector<int32_t>& ids) const {
  if (const int32_t whole = rank_of(chunk); whole >= 0) {
    ids.push_back(whole);
    return;
  }
  // tiktoken's rule: repeatedly join the adjacent pieces whose concatenation has the lowest
  // rank, the leftmost on ties. A min-heap of (rank, start) with lazy deletion keeps long chunks
  // (a run of 100k letters) at O(n log n) instead of tiktoken's O(n^2) rescans. Pieces are
  // named by their first byte; next[i] is the start of the following piece.
  constexpr int32_t kNone = -1;
  const size_t n = chunk.size();
  std::vector<size_t> next(n);
  std::vector<size_t> previous(n);
  std::vector<int32_t> joined_rank(n, kNone);  // rank of piece i joined with the next
  for (size_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    previous[i] = i - 1;  // wraps for i == 0; never read there
  }
  using Candidate = std::pair<int32_t, size_t>;  // (rank, start)
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> candidates;
  const auto update = [&](size_t piece) {
    joined_rank[piece] =
        next[piece] < n ? rank_of(chunk.substr(piece, next[next[piece]] - piece)) : kNone;
    if (joined_rank[piece] != kNone) candidates.emplace(joined_rank[piece], piece);
  };
  for (size_t i = 0; i < n; ++i)
    update(i);
  while (!candidates.empty()) {
    const auto [rank, piece] = candidates.top();
    candidates.pop();
    if (joined_rank[piece] != rank) continue;  // stale: the piece or its neighbour changed
    const size_t absorbed = next[piece];
    next[piece] = next[absorbed];
    if (next[piece] < n) previous[next[piece]] = piece;
    joined_rank[absorbed] = kNone;
    update(piece);
    if (piece > 0) update(previous[piece]);
  }
  for (size_t piece = 0; piece < n; piece = next[piece]) {
    ids.push_back(rank_of(chunk.substr(piece, next[piece] - piece)));
  }
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3);
  // Text repeats its words: each distinct multi-token chunk runs the merge loop once per call.
  std::unordered_map<std::string_view, std::pair<size_t, size_t>> cache;  // chunk -> ids range
  split_regex().for_each_chunk(text, [&](std::string_view chunk) {
    const auto [found, is_new] = cache.try_emplace(chunk, ids.size(), 0);
    if (!is_new) {
      const auto [begin, count] = found->second;
      for (size_t i = 0; i < count; ++i)
        ids.push_back(ids[begin + i]);
      return;
    }
    encode_chunk(chunk, ids);
    found->second.second = ids.size() - found->second.first;
  });
  return ids;
}

std::vector<int32_t> BpeTokenizer::encode_document(std::string_view text) const {
  std::vector<int32_t> ids = encode(text);
  ids.insert(ids.begin(), bos_id());
  return ids;
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  for (const int32_t id : ids) {
    FP8T_CHECK(id >= 0 && id < vocab_size(),
               "tokenizer: token id {} is outside the vocabulary [0, {})", id, vocab_size());
    text += id < mergeable_count() ? token_bytes_[id] : special_tokens_[id - mergeable_count()];
  }
  return text;
}

int32_t BpeTokenizer::special_token_id(std::string_view name) const {
  const auto found = std::find(special_tokens_.begin(), special_tokens_.end(), name);
  if (found == special_tokens_.end()) {
    throw Error(fmt::format("tokenizer: no special token '{}' (it has {})", name,
                            special_tokens_.empty()
                                ? std::string("none")
                                : fmt::format("{}", fmt::join(special_tokens_, ", "))));
  }
  return mergeable_count() + static_cast<int32_t>(found - special_tokens_.begin());
}

void BpeTokenizer::save(const std::filesystem::path& path) const {
  std::string ranks_text;
  for (size_t rank = 0; rank < token_bytes_.size(); ++rank) {
    ranks_text += fmt::format("{} {}\n", io::base64_encode(token_bytes_[rank]), rank);
  }
  nlohmann::ordered_json sidecar = {{"format", kSidecarFormat},
                                    {"version", kSidecarVersion},
                                    {"pattern", kSplitPattern},
                                    {"special_tokens", nlohmann::ordered_json::array()}};
  for (const std::string& name : special_tokens_) {
    sidecar["special_tokens"].push_back({{"name", name}, {"id", special_token_id(name)}});
  }
  // The sidecar first: load() checks its ids against the ranks, so a crash between the two
  // writes leaves a pair that fails to load rather than one that loads wrongly.
  io::write_file_atomically(special_tokens_path(path), sidecar.dump(2) + "\n");
  io::write_file_atomically(path, ranks_text);
}

BpeTokenizer BpeTokenizer::load(const std::filesystem::path& path) {
  const std::string text = io::read_file(path);
  std::vector<std::string> token_bytes;
  std::vector<size_t> line_of_rank;
  RankMap ranks;
  size_t line_number = 0;
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = std::min(text.find('\n', begin), text.size());
    std::string_view line(text.data() + begin, end - begin);
    begin = end + 1;
    ++line_number;
    if (line.ends_with('\r')) line.remove_suffix(1);  // CRLF, as tiktoken's split() accepts
    if (line.empty()) continue;                       // tiktoken skips blank lines too
    const auto fail = [&](const std::string& message) {
      throw Error(fmt::format("{}:{}: {}", path.string(), line_number, message));
    };
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos) {
      fail("expected 'BASE64 RANK', found '" + std::string(line.substr(0, 80)) + "'");
    }
    std::string bytes;
    if (!io::base64_decode(line.substr(0, space), bytes)) {
      fail(fmt::format("'{}' is not valid base64", line.substr(0, std::min<size_t>(space, 80))));
    }
    const std::string_view rank_text = line.substr(space + 1);
    int64_t rank = -1;
    const auto parsed =
        std::from_chars(rank_text.data(), rank_text.data() + rank_text.size(), rank);
    if (parsed.ec != std::errc() || parsed.ptr != rank_text.data() + rank_text.size()) {
      fail(fmt::format("rank '{}' is not an integer", rank_text));
    }
    if (rank != static_cast<int64_t>(token_bytes.size())) {
      fail(fmt::format("expected rank {} (ranks run 0, 1, 2, ... in order), found {}",
                       token_bytes.size(), rank));
    }
    const auto [found, is_new] = ranks.try_emplace(bytes, static_cast<int32_t>(rank));
    if (!is_new) {
      fail(fmt::format("token '{}' repeats the token of line {}", line.substr(0, space),
                       line_of_rank[found->second]));
    }
    token_bytes.push_back(std::move(bytes));
    line_of_rank.push_back(line_number);
  }
  for (int byte = 0; byte < kByteTokens; ++byte) {
    if (!ranks.contains(std::string(1, static_cast<char>(byte)))) {
      throw Error(
          fmt::format("{}: byte 0x{:02x} has no token ({} tokens; a byte-level "
                      "vocabulary needs all 256 single bytes)",
                      path.string(), byte, token_bytes.size()));
    }
  }

  const std::filesystem::path sidecar_path = special_tokens_path(path);
  const auto fail_sidecar = [&](const std::string& message) {
    throw Error(fmt::format("{}: {}", sidecar_path.string(), message));
  };
  nlohmann::json sidecar;
  try {
    sidecar = nlohmann::json::parse(
        io::read_file(sidecar_path),
        [&](int depth, nlohmann::json::parse_event_t, const nlohmann::json&) {
          if (depth > kMaxSidecarDepth) {
            fail_sidecar(fmt::format("expected JSON nested at most {} levels deep, found deeper",
                                     kMaxSidecarDepth));
          }
          return true;
        });
  } catch (const nlohmann::json::exception& e) {
    fail_sidecar(fmt::format("not valid JSON: {}", e.what()));
  }
  // find(), not value(): value() throws nlohmann's type_error for a member of another type.
  const auto member = [&sidecar](const char* key) {
    const auto found = sidecar.find(key);
    return found != sidecar.end() ? *found : nlohmann::json();
  };
  if (!sidecar.is_object() || member("format") != kSidecarFormat) {
    fail_sidecar(fmt::format("expected a JSON object with \"format\": \"{}\"", kSidecarFormat));
  }
  if (member("version") != kSidecarVersion) {
    fail_sidecar(fmt::format("unsupported version {}; this build reads version {}",
                             member("version").dump(), kSidecarVersion));
  }
  if (member("pattern") != kSplitPattern) {
    fail_sidecar("its split pattern differs from the one this build uses (nanochat's)");
  }
  const nlohmann::json entries = member("special_tokens");
  if (!entries.is_array()) fail_sidecar("\"special_tokens\" is not an array");
  std::vector<std::string> special_tokens;
  for (const nlohmann::json& entry : entries) {
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
        !entry.contains("id") || !entry["id"].is_number_integer()) {
      fail_sidecar("expected special tokens as {\"name\": string, \"id\": integer}, found " +
                   entry.dump());
    }
    const auto expected = static_cast<int64_t>(token_bytes.size() + special_tokens.size());
    const int64_t id = entry["id"].get<int64_t>();
    std::string name = entry["name"].get<std::string>();
    if (id != expected) {
      fail_sidecar(
          fmt::format("special token '{}' has id {}, expected {} (special tokens follow "
                      "the {} tokens of {})",
                      name, id, expected, token_bytes.size(), path.string()));
    }
    special_tokens.push_back(std::move(name));
  }
  check_special_token_names(special_tokens, sidecar_path.string());
  return BpeTokenizer(std::move(token_bytes), std::move(ranks), std::move(special_tokens));
}

}  // namespace fp8t::tokenizer
