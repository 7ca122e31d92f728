#include "text/bpe.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <queue>

#include "text/byte_level.h"
#include "util/error.h"
#include "util/hash.h"
#include "util/json_fields.h"

namespace tandem::text {
namespace {

constexpr uint32_t kNoRank = std::numeric_limits<uint32_t>::max();
// Real vocabularies have up to a few hundred thousand entries; larger ids mean a broken file.
constexpr int64_t kMaxVocabulary = int64_t{1} << 24;

uint64_t pair_key(TokenId a, TokenId b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

size_t table_size_for(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  return cap;
}

std::atomic<uint64_t> next_cache_owner{1};

// Results of recent pieces, per thread. Direct-mapped: a slot holds one piece; a collision just
// overwrites. Keyed by the owning model too, so several tokenizers in one process never mix.
struct WordCache {
  static constexpr size_t kSlots = 1 << 14;
  static constexpr size_t kMaxPiece = 64;
  struct Slot {
    uint64_t owner = 0;
    uint64_t hash = 0;
    std::string piece;
    std::vector<TokenId> ids;
  };
  std::vector<Slot> slots{kSlots};
};

WordCache& word_cache() {
  thread_local WordCache cache;
  return cache;
}

}  // namespace

// Open addressing over (pair key -> rank, merged id); merges are looked up several times per
// byte, so this table is the hot spot of encoding.
struct Bpe::PairTable {
  struct Entry {
    uint64_t key;
    uint32_t rank;
    TokenId merged;
  };
  std::vector<Entry> entries;
  size_t mask = 0;

  explicit PairTable(size_t n) : entries(table_size_for(n), Entry{~0ULL, kNoRank, -1}) {
    mask = entries.size() - 1;
  }
  // A pair listed twice keeps its last rank: HF collects merges into a map, later ones overwrite.
  void insert(uint64_t key, uint32_t rank, TokenId merged) {
    for (size_t i = hash_u64(key) & mask;; i = (i + 1) & mask) {
      if (entries[i].key == key || entries[i].rank == kNoRank) {
        entries[i] = Entry{key, rank, merged};
        return;
      }
    }
  }
  const Entry* find(uint64_t key) const {
    for (size_t i = hash_u64(key) & mask;; i = (i + 1) & mask) {
      const Entry& e = entries[i];
      if (e.key == key) return &e;
      if (e.rank == kNoRank) return nullptr;
    }
  }
};

struct Bpe::WordTable {
  struct Entry {
    uint64_t hash = 0;
    TokenId id = -1;
    uint32_t offset = 0, length = 0;
  };
  std::string bytes;  // all keys, concatenated
  std::vector<Entry> entries;
  size_t mask = 0;

  explicit WordTable(size_t n) : entries(table_size_for(n)) { mask = entries.size() - 1; }
  std::string_view key(const Entry& e) const { return {bytes.data() + e.offset, e.length}; }
  bool insert(std::string_view k, TokenId id) {
    uint64_t h = hash_bytes(k);
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      Entry& e = entries[i];
      if (e.id < 0) {
        e = Entry{h, id, static_cast<uint32_t>(bytes.size()), static_cast<uint32_t>(k.size())};
        bytes.append(k);
        return true;
      }
      if (e.hash == h && key(e) == k) return false;
    }
  }
  std::optional<TokenId> find(std::string_view k) const {
    uint64_t h = hash_bytes(k);
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      const Entry& e = entries[i];
      if (e.id < 0) return std::nullopt;
      if (e.hash == h && key(e) == k) return e.id;
    }
  }
};

Bpe::Bpe(const nlohmann::json& model, const std::string& origin, size_t added_tokens) {
  auto fail = [&](const std::string& what) { throw Error(origin + ": model: " + what); };
  if (!model.is_object()) fail("expected an object");
  // tokenizers reads these with serde: an Option takes null, a bool or a String does not.
  constexpr auto kNull = Fields::Null::kWrongType;
  auto f = Fields::lenient(model, origin, "model");
  if (const auto type = f.string_or("type", "BPE", kNull); type != "BPE")
    fail("model type '" + type + "' is not supported (only byte-level BPE is)");
  if (f.optional_number("dropout").value_or(0) != 0)
    fail("BPE dropout is not supported (encoding must be deterministic)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!f.optional_string(key).value_or("").empty())
      fail(std::string(key) + " is not supported with byte-level BPE");
  }
  if (f.boolean_or("byte_fallback", false, kNull)) fail("byte_fallback is not supported");
  ignore_merges_ = f.boolean_or("ignore_merges", false, kNull);
  fuse_unk_ = f.boolean_or("fuse_unk", false, kNull);

  const auto vocab_it = model.find("vocab");
  if (vocab_it == model.end() || !vocab_it->is_object()) fail("'vocab' must be an object");
  const auto& vocab = *vocab_it;
  // Every table indexed by id (here and in the tokenizer) is as long as the largest id, so a few
  // entries with huge ids would cost gigabytes: ids may leave holes, but not many more holes than
  // there are tokens. Real vocabularies are dense (holes, if any, filled by added tokens); the
  // slack keeps small hand-written ones with gaps loadable.
  constexpr int64_t kIdSlack = 1 << 16;
  const int64_t max_sparse_id =
      2 * (static_cast<int64_t>(vocab.size()) + static_cast<int64_t>(added_tokens)) + kIdSlack;
  int64_t largest = -1;
  std::string largest_token;
  for (const auto& [token, id_json] : vocab.items()) {
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 ||
        id_json.get<int64_t>() >= kMaxVocabulary)
      fail("vocab entry '" + token + "' has an invalid id (ids are 0 to " +
           std::to_string(kMaxVocabulary - 1) + ")");
    if (id_json.get<int64_t>() > largest) {
      largest = id_json.get<int64_t>();
      largest_token = token;
    }
  }
  if (largest > max_sparse_id)
    fail("vocab entry '" + largest_token + "' has id " + std::to_string(largest) + ", but the " +
         std::to_string(vocab.size()) + " entries and " + std::to_string(added_tokens) +
         " added tokens allow ids up to " + std::to_string(max_sparse_id) + " (2 x tokens + " +
         std::to_string(kIdSlack) + "); ids must be nearly dense");
  tokens_.resize(static_cast<size_t>(largest + 1));
  vocab_ = std::make_unique<WordTable>(vocab.size());
  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  for (const auto& [token, id_json] : vocab.items()) {
    auto id = id_json.get<TokenId>();
    tokens_[id] = token;
    // Tokens outside the byte alphabet cannot be produced from bytes; they stay addressable by
    // id only (HF behaves the same: BPE never reaches them).
    if (auto raw = byte_level::to_bytes(token)) {
      vocab_->insert(*raw, id);
      if (raw->size() == 1) byte_ids_[static_cast<unsigned char>((*raw)[0])] = id;
    }
  }
  if (const auto unk = f.optional_string("unk_token")) {
    if (!vocab.contains(*unk)) fail("unk_token '" + *unk + "' is not in the vocabulary");
    unk_ = vocab[*unk].get<TokenId>();
  }

  const auto merges_it = model.find("merges");
  if (merges_it == model.end() || !merges_it->is_array()) fail("'merges' must be an array");
  merges_ = std::make_unique<PairTable>(merges_it->size());
  uint32_t rank = 0;
  for (const auto& m : *merges_it) {
    std::string left, right;
    if (m.is_string()) {
      const auto& s = m.get_ref<const std::string&>();
      auto space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        fail("merge #" + std::to_string(rank) + " '" + s +
             "' is not two tokens separated by a space");
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      fail("merge #" + std::to_string(rank) + " must be \"a b\" or [\"a\", \"b\"]");
    }
    auto find_id = [&](const std::string& tok) {
      auto it = vocab.find(tok);
      if (it == vocab.end())
        fail("merge #" + std::to_string(rank) + " uses '" + tok +
             "', which is not in the vocabulary");
      return it->get<TokenId>();
    };
    TokenId a = find_id(left), b = find_id(right), merged = find_id(left + right);
    merges_->insert(pair_key(a, b), rank, merged);
    ++rank;
  }
  cache_owner_ = next_cache_owner.fetch_add(1);
}

Bpe::~Bpe() = default;

// Repeatedly merges the lowest-ranked adjacent pair, leftmost first on ties. For short pieces a
// scan beats a heap; merge_long gives the same result in O(n log n).
void Bpe::merge_short(std::vector<TokenId>& ids) const {
  while (ids.size() > 1) {
    uint32_t best = kNoRank;
    size_t at = 0;
    TokenId merged = -1;
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      const auto* e = merges_->find(pair_key(ids[i], ids[i + 1]));
      if (e && e->rank < best) {
        best = e->rank;
        at = i;
        merged = e->merged;
      }
    }
    if (best == kNoRank) return;
    ids[at] = merged;
    ids.erase(ids.begin() + static_cast<ptrdiff_t>(at) + 1);
  }
}

void Bpe::merge_long(std::vector<TokenId>& ids) const {
  const size_t n = ids.size();
  std::vector<size_t> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = i - 1;  // wraps for i == 0; never read there
    next[i] = i + 1;
  }
  struct Candidate {
    uint32_t rank;
    size_t pos;
    TokenId left, right, merged;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](size_t i) {
    if (i >= n || next[i] >= n) return;
    if (const auto* e = merges_->find(pair_key(ids[i], ids[next[i]])))
      heap.push(Candidate{e->rank, i, ids[i], ids[next[i]], e->merged});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    Candidate c = heap.top();
    heap.pop();
    // Skip candidates made stale by an earlier merge of either symbol.
    if (!alive[c.pos] || next[c.pos] >= n || ids[c.pos] != c.left || ids[next[c.pos]] != c.right)
      continue;
    size_t right = next[c.pos];
    ids[c.pos] = c.merged;
    alive[right] = false;
    next[c.pos] = next[right];
    if (next[right] < n) prev[next[right]] = c.pos;
    if (c.pos > 0) push(prev[c.pos]);
    push(c.pos);
  }
  size_t w = 0;
  for (size_t i = 0; i < n; ++i)
    if (alive[i]) ids[w++] = ids[i];
  ids.resize(w);
}

void Bpe::encode_uncached(std::string_view bytes, std::vector<TokenId>& out) const {
  if (ignore_merges_) {
    if (auto id = vocab_->find(bytes)) {
      out.push_back(*id);
      return;
    }
  }
  thread_local std::vector<TokenId> ids;
  ids.clear();
  bool last_was_unk = false;
  for (unsigned char b : bytes) {
    TokenId id = byte_ids_[b];
    if (id >= 0) {
      ids.push_back(id);
      last_was_unk = false;
    } else if (unk_ && !(fuse_unk_ && last_was_unk)) {
      ids.push_back(*unk_);
      last_was_unk = true;
    }
  }
  if (ids.size() <= 64) {
    merge_short(ids);
  } else {
    merge_long(ids);
  }
  out.insert(out.end(), ids.begin(), ids.end());
}

void Bpe::encode_piece(std::string_view bytes, std::vector<TokenId>& out) const {
  if (bytes.empty()) return;
  if (bytes.size() > WordCache::kMaxPiece) {
    encode_uncached(bytes, out);
    return;
  }
  uint64_t h = hash_bytes(bytes, cache_owner_);
  auto& s = word_cache().slots[h & (WordCache::kSlots - 1)];
  if (s.owner == cache_owner_ && s.hash == h && s.piece == bytes) {
    out.insert(out.end(), s.ids.begin(), s.ids.end());
    return;
  }
  size_t start = out.size();
  encode_uncached(bytes, out);
  s.owner = cache_owner_;
  s.hash = h;
  s.piece.assign(bytes);
  s.ids.assign(out.begin() + static_cast<ptrdiff_t>(start), out.end());
}

}  // namespace tandem::text
