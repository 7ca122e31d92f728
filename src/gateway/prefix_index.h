#pragma once
// The gateway's global prefix index: which engine holds which prefix-cache block, rebuilt from
// the engines' KV events (kv_events_consumer.h), so the scheduler can ask "how many leading
// blocks of this prompt does each engine already have?" in O(prompt blocks).
//
// Keys. A block is keyed by our chained hash (api/block_hash.h), salted as the engine salted
// it, so a request matches only blocks its own cache_salt lets it use. Engines differ in how
// they name blocks, and the index learns which kind each is from its stores (a block with a
// parent, or an unsalted first block, hashes to the engine's hash under our function only if
// the engine uses it):
//  - ours (a Tandem engine): the engine's hashes are our keys. Salted blocks are named by their
//    salted hashes, though the events carry no salt, so a request matches them only with the
//    same salt, and an unsalted request never does.
//  - foreign (vLLM, SGLang): their hashes depend on another algorithm and a per-process random
//    seed, so two replicas disagree about the same prefix; blocks are keyed by our unsalted hash
//    of the token ids the store carries (their salted stores name the salt in extra_keys and
//    are not indexed, kv_events_consumer.h).
//  - not yet known: a store of one lone first block that does not hash as ours unsalted is a
//    salted store of an engine using our hash, or another function's. It is keyed by the
//    engine's hash (right if salted; otherwise a key no prompt hashes to: a lost hit, never a
//    false one) and re-keyed by its tokens if the engine's next store that shows its kind (any
//    store of several blocks or with a parent) shows another function. A clear forgets the kind
//    (a restart may bring another engine).
// Each engine keeps a map from its own block hash to our key, so BlockRemoved events, which
// carry engine hashes only, can be applied, and a BlockStored's parent (an engine hash) leads to
// the chain hash its first block extends. A store whose parent the index does not know (never
// seen, or evicted here) is skipped: a prompt could only reach its blocks through that parent.
//
// Block sizes are per engine (default 16); match() hashes the prompt once per distinct size.
// A block may be held by an engine on several media (vLLM reports "GPU" and "CPU" tiers for the
// same hash); it counts as held until removed from every medium, so stores and removals are
// idempotent per (engine hash, medium).
//
// Memory bound: at most `max_blocks` distinct blocks (chain hashes). When a new block would
// exceed it, the least recently used block is evicted from every engine that holds it. "Used"
// means stored by an event or walked by match(); match() touches the blocks it walks deepest
// first, and a store inserts its blocks deepest first and then touches the parent, so a prefix
// is never older than the extensions stored or matched with it and eviction trims chains from
// their tails. Memory is O(max_blocks * engines holding each block).
//
// Thread safety: every method may be called from any thread; one mutex guards the index. The
// intended use is one writer per engine (its consumer thread, a few map operations per event)
// and the scheduling thread calling match(), which holds the lock for O(prompt blocks) hash-table
// lookups; the prompt is hashed before the lock is taken.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace tandem::gateway {

// The scheduler's endpoint id (policy.h's EndpointLoad::id).
using EngineKey = int;

inline constexpr int64_t kDefaultKvBlockSize = 16;

// Whether `tokens` token ids are exactly `blocks` full blocks of `block_size` (>= 1). Divides
// rather than multiplies: a publisher names the counts, and 8 blocks of 2^61 tokens wrap to 0.
inline bool tokens_fill_blocks(size_t tokens, size_t blocks, int64_t block_size) {
  const auto bs = static_cast<size_t>(block_size);
  return block_size >= 1 && tokens % bs == 0 && tokens / bs == blocks;
}

struct PrefixMatch {
  EngineKey engine = 0;
  int64_t blocks = 0;  // leading full blocks of the prompt the engine holds
  int64_t tokens = 0;  // blocks * the engine's block size: prompt tokens needing no recompute
};

struct PrefixIndexStats {
  int64_t blocks = 0;            // distinct blocks in the index
  int64_t entries = 0;           // (block, engine hash, engine) entries
  int64_t evicted = 0;           // blocks evicted for the memory bound, ever
  int64_t orphan_stores = 0;     // stored runs skipped because their parent was unknown
  int64_t unknown_removals = 0;  // removed engine hashes the index did not know
};

class PrefixIndex {
 public:
  // Throws tandem::Error when max_blocks < 1.
  explicit PrefixIndex(size_t max_blocks = 1 << 20);
  ~PrefixIndex();
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  // Registers an engine (or changes its block size, which drops what it held: its blocks would
  // hash differently). Engines are also registered on first use with kDefaultKvBlockSize.
  // Throws tandem::Error when block_size < 1.
  void set_block_size(EngineKey engine, int64_t block_size);
  // The engine's block size (kDefaultKvBlockSize when not registered).
  int64_t block_size(EngineKey engine) const;

  // The engine stored a run of consecutive full blocks: `engine_hashes[i]` names block i in the
  // engine's hashes, `token_ids` holds engine_hashes.size() * block_size ids in chain order, and
  // `parent` is the engine hash of the block before the first (nullopt: the run starts a
  // sequence). Returns false, changing nothing, when the parent is unknown or the token count
  // does not match (then the caller's block size is wrong). A lone first block of an engine whose
  // hashing is not yet known is keyed by the engine's hash (right if salted) and re-keyed by its
  // tokens if the engine turns out to hash otherwise.
  bool add_blocks(EngineKey engine, std::span<const uint64_t> engine_hashes,
                  std::span<const int32_t> token_ids, std::optional<uint64_t> parent,
                  std::string_view medium = "");
  // The engine evicted these blocks (engine hashes) from `medium`; unknown hashes are ignored.
  void remove_blocks(EngineKey engine, std::span<const uint64_t> engine_hashes,
                     std::string_view medium = "");
  // Every block of the engine is gone (AllBlocksCleared, restart, unrecoverable event gap).
  void clear(EngineKey engine);
  // Clears the engine and forgets its block size.
  void remove_engine(EngineKey engine);

  // For every engine holding at least the prompt's first full block: how many leading full
  // blocks of `token_ids` it holds, sorted by engine key. Engines absent from the result hold
  // none. `salt`: the request's cache salt as the engines fold it into the first block
  // (api::cache_salt_hash of its cache_salt); blocks stored under another salt, or none, do
  // not match.
  // O(prompt blocks) per distinct block size; marks the walked blocks as recently used.
  std::vector<PrefixMatch> match(std::span<const int32_t> token_ids,
                                 std::optional<uint64_t> salt = std::nullopt);
  // match() for one engine: its number of leading blocks held.
  int64_t match_depth(EngineKey engine, std::span<const int32_t> token_ids,
                      std::optional<uint64_t> salt = std::nullopt);

  // Whether the engine holds the block whose chain hash (ours) is `block_hash`.
  bool holds(EngineKey engine, uint64_t block_hash) const;
  // Number of distinct blocks the engine holds.
  int64_t num_blocks(EngineKey engine) const;
  PrefixIndexStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::gateway
