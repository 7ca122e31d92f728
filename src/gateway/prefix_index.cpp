#include "gateway/prefix_index.h"

#include <algorithm>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include <absl/container/flat_hash_map.h>
#include <absl/container/inlined_vector.h>

#include "api/block_hash.h"
#include "util/error.h"

namespace tandem::gateway {
namespace {

struct Engine;

// One engine hash under which an engine holds a block.
struct Holder {
  Engine* engine;
  uint64_t engine_hash;
};

struct Node {
  absl::InlinedVector<Holder, 2> holders;  // usually one per engine holding the block
  std::list<uint64_t>::iterator where;     // position in the LRU list
};

struct Entry {
  uint64_t block;     // our chain hash
  uint8_t media = 0;  // one bit per medium the engine reported the block on
};

// Whether an engine's block hashes are api/block_hash.h's (a Tandem engine's) or another
// function's (vLLM's, SGLang's), as its stores showed (see PrefixIndex::add_blocks).
enum class Hashing : uint8_t { kUnknown, kOurs, kForeign };

// A lone first block stored while the engine's hashing was unknown.
struct Pending {
  uint64_t engine_hash;
  std::vector<int32_t> tokens;
};

// Lone first blocks remembered per engine until its hashing is known; beyond, they keep the
// engine's hash as their key (a lost hit at worst). An engine shows its hashing with its first
// multi-block or extending store, so a few suffice.
constexpr size_t kMaxPending = 1024;

struct Engine {
  EngineKey key = 0;
  int64_t block_size = kDefaultKvBlockSize;
  Hashing hashing = Hashing::kUnknown;
  std::vector<Pending> pending;
  absl::flat_hash_map<uint64_t, Entry> by_engine_hash;
  int64_t distinct = 0;  // distinct blocks held
  int64_t depth = 0;     // scratch for match()
};

// What a store says about its engine's hash function. A block whose whole input is known, one
// with a parent (the previous block's engine hash) or an unsalted first block, hashes to the
// engine's hash under ours if and only if the engine uses ours. A first block that does not is
// either salted (its salt is not in the event) or another function's: it tells nothing.
Hashing hashing_shown_by(std::span<const uint64_t> engine_hashes,
                         std::span<const int32_t> token_ids, std::optional<uint64_t> parent,
                         size_t block_size) {
  for (size_t i = 0; i < engine_hashes.size(); ++i) {
    const std::optional<uint64_t> previous = i == 0 ? parent : engine_hashes[i - 1];
    const uint64_t ours = api::block_hash(previous, token_ids.subspan(i * block_size, block_size));
    if (ours == engine_hashes[i]) return Hashing::kOurs;
    if (previous) return Hashing::kForeign;
  }
  return Hashing::kUnknown;
}

bool holds_other(const Node& node, const Engine* engine, size_t skip) {
  for (size_t i = 0; i < node.holders.size(); ++i) {
    if (i != skip && node.holders[i].engine == engine) return true;
  }
  return false;
}

}  // namespace

struct PrefixIndex::Impl {
  size_t max_blocks;
  mutable std::mutex mutex;
  absl::flat_hash_map<uint64_t, Node> nodes;
  std::list<uint64_t> lru;                        // front: most recently used
  std::unordered_map<EngineKey, Engine> engines;  // node-based: Holder keeps Engine*
  std::vector<std::string> media;                 // interned medium names, bit = index (max 7)
  PrefixIndexStats stats;

  Engine& engine(EngineKey key) {
    auto [it, inserted] = engines.try_emplace(key);
    if (inserted) it->second.key = key;
    return it->second;
  }

  uint8_t medium_bit(std::string_view medium) {
    size_t i = 0;
    while (i < media.size() && media[i] != medium) ++i;
    if (i == media.size() && media.size() < 8) media.emplace_back(medium);
    return static_cast<uint8_t>(1u << std::min<size_t>(i, 7));
  }

  void touch(Node& node) { lru.splice(lru.begin(), lru, node.where); }

  void erase_node(absl::flat_hash_map<uint64_t, Node>::iterator it) {
    lru.erase(it->second.where);
    nodes.erase(it);
  }

  // Drops one (engine, engine hash) entry and its holder.
  void drop_entry(Engine& e, absl::flat_hash_map<uint64_t, Entry>::iterator entry) {
    const uint64_t engine_hash = entry->first;
    const auto node_it = nodes.find(entry->second.block);
    e.by_engine_hash.erase(entry);
    --stats.entries;
    if (node_it == nodes.end()) return;
    Node& node = node_it->second;
    for (size_t i = 0; i < node.holders.size(); ++i) {
      if (node.holders[i].engine != &e || node.holders[i].engine_hash != engine_hash) continue;
      if (!holds_other(node, &e, i)) --e.distinct;
      node.holders.erase(node.holders.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
    if (node.holders.empty()) erase_node(node_it);
  }

  void evict_lru() {
    const auto it = nodes.find(lru.back());
    Node& node = it->second;
    for (size_t i = 0; i < node.holders.size(); ++i) {
      Engine* e = node.holders[i].engine;
      e->by_engine_hash.erase(node.holders[i].engine_hash);
      bool counted_before = false;
      for (size_t k = 0; k < i; ++k) counted_before |= node.holders[k].engine == e;
      if (!counted_before) --e->distinct;
    }
    stats.entries -= static_cast<int64_t>(node.holders.size());
    ++stats.evicted;
    erase_node(it);
  }

  void insert(Engine& e, uint64_t block, uint64_t engine_hash, uint8_t bit) {
    if (const auto entry = e.by_engine_hash.find(engine_hash); entry != e.by_engine_hash.end()) {
      if (entry->second.block == block) {
        entry->second.media |= bit;
        if (const auto n = nodes.find(block); n != nodes.end()) touch(n->second);
        return;
      }
      drop_entry(e, entry);  // the engine reused a hash for other tokens: the newest wins
    }
    auto node_it = nodes.find(block);
    if (node_it == nodes.end()) {
      if (nodes.size() >= max_blocks) evict_lru();
      lru.push_front(block);
      node_it = nodes.emplace(block, Node{{}, lru.begin()}).first;
    } else {
      touch(node_it->second);
    }
    Node& node = node_it->second;
    if (!holds_other(node, &e, node.holders.size())) ++e.distinct;
    node.holders.push_back({&e, engine_hash});
    e.by_engine_hash.emplace(engine_hash, Entry{block, bit});
    ++stats.entries;
  }

  void clear(Engine& e) {
    // Erasing one entry leaves the others' iterators valid (and begin() of a flat map is a scan).
    for (auto it = e.by_engine_hash.begin(); it != e.by_engine_hash.end();) drop_entry(e, it++);
    // What publishes there after a restart may be another engine: it shows its hashing again.
    e.hashing = Hashing::kUnknown;
    e.pending.clear();
  }

  // The engine showed how it hashes. Its lone first blocks were keyed by its own hashes, right
  // for ours (salted or not); another function's are keyed by their tokens instead.
  void learn(Engine& e, Hashing hashing) {
    e.hashing = hashing;
    std::vector<Pending> pending = std::move(e.pending);
    e.pending.clear();
    if (hashing != Hashing::kForeign) return;
    for (const Pending& p : pending) {
      const auto entry = e.by_engine_hash.find(p.engine_hash);
      if (entry == e.by_engine_hash.end() || entry->second.block != p.engine_hash) continue;
      const uint8_t media = entry->second.media;
      drop_entry(e, entry);
      insert(e, api::block_hash(std::nullopt, p.tokens), p.engine_hash, media);
    }
  }
};

PrefixIndex::PrefixIndex(size_t max_blocks) : impl_(std::make_unique<Impl>()) {
  if (max_blocks < 1) throw Error("prefix index: max_blocks must be >= 1");
  impl_->max_blocks = max_blocks;
  impl_->nodes.reserve(std::min<size_t>(max_blocks, 1 << 16));
}

PrefixIndex::~PrefixIndex() = default;

void PrefixIndex::set_block_size(EngineKey engine, int64_t block_size) {
  if (block_size < 1) {
    throw Error("prefix index: block size of engine " + std::to_string(engine) +
                " must be >= 1, got " + std::to_string(block_size));
  }
  std::lock_guard lock(impl_->mutex);
  Engine& e = impl_->engine(engine);
  if (e.block_size == block_size) return;
  impl_->clear(e);
  e.block_size = block_size;
}

int64_t PrefixIndex::block_size(EngineKey engine) const {
  std::lock_guard lock(impl_->mutex);
  const auto it = impl_->engines.find(engine);
  return it == impl_->engines.end() ? kDefaultKvBlockSize : it->second.block_size;
}

bool PrefixIndex::add_blocks(EngineKey engine, std::span<const uint64_t> engine_hashes,
                             std::span<const int32_t> token_ids, std::optional<uint64_t> parent,
                             std::string_view medium) {
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  Engine& e = s.engine(engine);
  const auto bs = static_cast<size_t>(e.block_size);
  if (!tokens_fill_blocks(token_ids.size(), engine_hashes.size(), e.block_size)) return false;
  // Before the parent is looked up: an orphan shows the engine's hashing as well as any store.
  if (e.hashing == Hashing::kUnknown && !engine_hashes.empty()) {
    const Hashing shown = hashing_shown_by(engine_hashes, token_ids, parent, bs);
    if (shown != Hashing::kUnknown) s.learn(e, shown);
  }
  std::optional<uint64_t> chain;  // our hash of the block before the next one
  if (parent) {
    const auto it = e.by_engine_hash.find(*parent);
    if (it == e.by_engine_hash.end()) {
      ++s.stats.orphan_stores;
      return false;
    }
    chain = it->second.block;
  }
  const std::optional<uint64_t> parent_block = chain;
  std::vector<uint64_t> ours(engine_hashes.begin(), engine_hashes.end());
  // An engine hashing as we do names a salted block by the hash a request with the same salt
  // computes: its hashes are our keys. Another engine's are re-hashed from the tokens (unsalted:
  // its salted stores carry extra_keys and were not indexed). While the engine's hashing is
  // unknown (a lone first block not hashing as ours unsalted: salted, or another function's), its
  // hash is the key too: right if salted, else a key no prompt hashes to, fixed by learn(). Keyed
  // by its tokens it would stand for the unsalted prefix, which a salted block is not.
  if (e.hashing == Hashing::kForeign) {
    for (size_t i = 0; i < ours.size(); ++i) {
      chain = api::block_hash(chain, token_ids.subspan(i * bs, bs));
      ours[i] = *chain;
    }
  } else if (e.hashing == Hashing::kUnknown && !ours.empty() && e.pending.size() < kMaxPending) {
    e.pending.push_back({engine_hashes[0], {token_ids.begin(), token_ids.end()}});
  }
  const uint8_t bit = s.medium_bit(medium);
  // Deepest first, then the parent: eviction takes a chain's tail before its prefix.
  for (size_t i = ours.size(); i-- > 0;) s.insert(e, ours[i], engine_hashes[i], bit);
  if (parent_block) {
    if (const auto n = s.nodes.find(*parent_block); n != s.nodes.end()) s.touch(n->second);
  }
  return true;
}

void PrefixIndex::remove_blocks(EngineKey engine, std::span<const uint64_t> engine_hashes,
                                std::string_view medium) {
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  const auto e = s.engines.find(engine);
  if (e == s.engines.end()) {
    s.stats.unknown_removals += static_cast<int64_t>(engine_hashes.size());
    return;
  }
  const uint8_t bit = s.medium_bit(medium);
  for (const uint64_t h : engine_hashes) {
    const auto entry = e->second.by_engine_hash.find(h);
    if (entry == e->second.by_engine_hash.end()) {
      ++s.stats.unknown_removals;
      continue;
    }
    entry->second.media &= static_cast<uint8_t>(~bit);
    if (entry->second.media == 0) s.drop_entry(e->second, entry);
  }
}

void PrefixIndex::clear(EngineKey engine) {
  std::lock_guard lock(impl_->mutex);
  const auto e = impl_->engines.find(engine);
  if (e != impl_->engines.end()) impl_->clear(e->second);
}

void PrefixIndex::remove_engine(EngineKey engine) {
  std::lock_guard lock(impl_->mutex);
  const auto e = impl_->engines.find(engine);
  if (e == impl_->engines.end()) return;
  impl_->clear(e->second);
  impl_->engines.erase(e);
}

std::vector<PrefixMatch> PrefixIndex::match(std::span<const int32_t> token_ids,
                                            std::optional<uint64_t> salt) {
  Impl& s = *impl_;
  std::vector<int64_t> sizes;
  {
    std::lock_guard lock(s.mutex);
    for (const auto& [key, e] : s.engines) {
      if (e.distinct > 0 && std::find(sizes.begin(), sizes.end(), e.block_size) == sizes.end()) {
        sizes.push_back(e.block_size);
      }
    }
  }
  // Hash outside the lock: the consumers keep applying events meanwhile.
  std::vector<std::vector<uint64_t>> hashes;
  hashes.reserve(sizes.size());
  for (const int64_t bs : sizes) hashes.push_back(api::block_hashes(token_ids, bs, salt));

  std::vector<PrefixMatch> out;
  std::vector<Node*> walked;
  std::lock_guard lock(s.mutex);
  for (size_t g = 0; g < sizes.size(); ++g) {
    const int64_t bs = sizes[g];
    for (auto& [key, e] : s.engines) e.depth = 0;
    walked.clear();
    for (size_t i = 0; i < hashes[g].size(); ++i) {
      const auto it = s.nodes.find(hashes[g][i]);
      if (it == s.nodes.end()) break;
      const auto depth = static_cast<int64_t>(i);
      bool advanced = false;
      for (const Holder& h : it->second.holders) {
        if (h.engine->block_size == bs && h.engine->depth == depth) {
          h.engine->depth = depth + 1;
          advanced = true;
        }
      }
      if (!advanced) break;
      walked.push_back(&it->second);
    }
    // Deepest first, so the prompt's first block ends up the most recently used.
    for (auto n = walked.rbegin(); n != walked.rend(); ++n) s.touch(**n);
    for (const auto& [key, e] : s.engines) {
      if (e.block_size == bs && e.depth > 0) out.push_back({key, e.depth, e.depth * bs});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const PrefixMatch& a, const PrefixMatch& b) { return a.engine < b.engine; });
  return out;
}

int64_t PrefixIndex::match_depth(EngineKey engine, std::span<const int32_t> token_ids,
                                 std::optional<uint64_t> salt) {
  for (const PrefixMatch& m : match(token_ids, salt)) {
    if (m.engine == engine) return m.blocks;
  }
  return 0;
}

bool PrefixIndex::holds(EngineKey engine, uint64_t block_hash) const {
  std::lock_guard lock(impl_->mutex);
  const auto it = impl_->nodes.find(block_hash);
  if (it == impl_->nodes.end()) return false;
  for (const Holder& h : it->second.holders) {
    if (h.engine->key == engine) return true;
  }
  return false;
}

int64_t PrefixIndex::num_blocks(EngineKey engine) const {
  std::lock_guard lock(impl_->mutex);
  const auto it = impl_->engines.find(engine);
  return it == impl_->engines.end() ? 0 : it->second.distinct;
}

PrefixIndexStats PrefixIndex::stats() const {
  std::lock_guard lock(impl_->mutex);
  PrefixIndexStats out = impl_->stats;
  out.blocks = static_cast<int64_t>(impl_->nodes.size());
  return out;
}

}  // namespace tandem::gateway
