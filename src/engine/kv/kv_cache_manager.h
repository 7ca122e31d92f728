#pragma once
// The engine's paged KV-cache block manager with automatic prefix caching.
//
// It hands out ids of the fixed-size blocks of model::LatentCache (it manages ids, never memory)
// and remembers which full blocks hold which token prefix, so a new request whose prompt starts
// like an earlier one reuses those blocks instead of recomputing them. Modelled on vLLM v1's
// KVCacheManager/BlockPool:
//   - every block has a reference count (the number of requests holding it: in their block tables,
//     or as the cached copy of a block of theirs that stayed private, see below);
//   - unreferenced blocks sit in a free queue in LRU order: blocks that hold a cached full block
//     go to the tail when freed (a request's blocks in reverse order, so a sequence's last blocks
//     are evicted before its first ones), blocks with nothing cached go to the head;
//   - allocation takes blocks from the head; taking a cached block evicts it (a BlockRemoved event
//     is recorded when it was the last cached block with its hash);
//   - a prefix maps to at most one block. A request that computed a block already cached (two
//     requests computing the same block at the same time, a request recomputing a hit's last
//     block, see recompute_last_hit_block, or scoring a cached prompt) registers it in one of two
//     ways. If another request holds the cached block, that block stays the cached one and the
//     new copy stays private; the request's next blocks follow the cached one, so it holds a
//     reference on it until freed and releases it behind them: the cached block outlives the
//     blocks that follow it, and holding it costs no free block. If nobody holds it, the new copy
//     takes over its cache entry (entry number included, so what followed it still does) and the
//     old block is free and uncached: registering never takes a free block the scheduler did not
//     count, and the request goes on caching what it computes next.
//   - a block is cached only after a cached block (or as a first block), so every cached block is
//     findable: its predecessors are cached too, since a block is never evicted before its
//     followers (they are released and queued before it).
//
// Blocks are found by api/block_hash.h's chained XXH3-64 over token ids (with an optional
// per-request cache salt folded into the first block), but a hash is only where to look: its seed
// is public, so a client can craft prompts whose blocks collide with another user's. A cached
// block keeps its tokens, its salt (a first block) and the cache entry of the block its KV was
// computed after, and a lookup takes it only when all three are this request's (vLLM answered the
// same threat, CVE-2025-25183, by hashing with SHA-256; the gateway computes these hashes too, so
// Tandem keeps the hash and checks the contents). Blocks whose hashes collide are cached under one
// hash, up to kMaxBlocksPerHash (more stay private); KV events name a hash when its first block is
// cached and when its last leaves.
//
// Typical scheduler use per step:
//   new request:  hit = find_cached_prefix(prompt); allocate(id, hit.num_tokens + n, hit)
//   running one:  allocate(id, num_computed + n)        (false: preempt someone, retry)
//   after the step: cache_full_blocks(id, tokens whose KV is now computed)
//   finished:     free(id)
//   end of step:  publisher.publish({now, take_events()})
//
// Not thread-safe by design: the scheduler thread owns it.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <absl/container/flat_hash_map.h>

#include "api/block_hash.h"
#include "engine/kv/kv_events.h"

namespace tandem::engine {

// The cached blocks found for a new request's tokens; pass it to allocate() for that request.
struct PrefixHit {
  std::vector<int32_t> blocks;   // cached blocks holding the prefix, in order
  std::vector<uint64_t> hashes;  // their block hashes
  int64_t num_tokens = 0;        // tokens they hold: blocks.size() * block_size
  // The cache entry of its last block (0 when none). An entry number always names the same tokens
  // after the same parent entry (it may move to another block holding them: a recomputed block
  // takes it over), and a block evicted and cached again gets a new one, so allocate() tells a
  // stale hit from one whose blocks were cached again for other tokens with the same hashes.
  uint64_t last_block_entry = 0;
  // Length of the sequence looked up, for the hit-rate statistics; 0: allocate() does not count
  // the lookup (the scheduler's re-admission of a preempted sequence, as vLLM keeps those out).
  int64_t num_query_tokens = 0;
  // The request's salt, which its blocks are hashed with: a first allocation without a lookup
  // must carry it too, or its blocks are cached for every tenant.
  std::optional<uint64_t> cache_salt;

  // No cached prefix (a sequence that computes its whole prompt), its blocks salted with `salt`.
  static PrefixHit none(std::optional<uint64_t> salt) {
    PrefixHit hit;
    hit.cache_salt = salt;
    return hit;
  }
};

// Cumulative counters, as vLLM's prefix_cache_queries / prefix_cache_hits (in tokens).
struct PrefixCacheStats {
  int64_t requests = 0;  // new requests allocated with a prefix lookup
  int64_t queries = 0;   // tokens looked up
  int64_t hits = 0;      // tokens found cached
  int64_t evicted_blocks = 0;
};

struct KvCacheOptions {
  bool enable_events = false;  // record KvEvents for take_events()
  std::string medium = "CPU";  // the `medium` field of the events
  // The executor drafts with an MTP module: a prefix hit leaves its last block to be recomputed.
  // The MTP layer's cache entry at a position depends on the token after it, and the one at the
  // hit's last position was computed with the next token of whichever request cached the block
  // (no block hash covers that token); recomputed in this request's own block, it is this
  // request's (vLLM does the same for EAGLE). That block then takes the cache entry over when no
  // other request holds the cached copy, so a later hit may read, at a middle block's last
  // position, the MTP entry of another continuation: fewer drafts accepted, never wrong output
  // (verification decides). Every lookup follows it: admission, a decode leg's (whose prefill
  // engine then sends that block), and the load the engine reports.
  bool recompute_last_hit_block = false;
  // The block hash: api::block_hash, which KV events carry and the gateway computes too. Only
  // tests put another here, to forge collisions.
  using BlockHashFunction = uint64_t (*)(std::optional<uint64_t> parent,
                                         std::span<const int32_t> block_tokens,
                                         std::optional<uint64_t> salt);
  BlockHashFunction block_hash = &api::block_hash;
};

class KvCacheManager {
 public:
  // Manages block ids [0, num_blocks). Throws tandem::Error when num_blocks < 1, block_size < 1 or
  // num_blocks does not fit an int32 block id.
  KvCacheManager(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching,
                 KvCacheOptions options = {});

  // The longest run of cached full blocks that starts `tokens`. Never covers the whole sequence:
  // at least its last token is left to compute so the model produces logits (and, with
  // recompute_last_hit_block, its last full block). Changes nothing;
  // the hit is valid until the next allocate/free/reset call. Empty when caching is off.
  PrefixHit find_cached_prefix(std::span<const int32_t> tokens,
                               std::optional<uint64_t> cache_salt = std::nullopt) const;

  // Grows the request's block table to cover its first `num_tokens` tokens (already computed
  // ones included). The first call for a request creates it and takes the blocks of `hit`
  // (referencing them; ones in the free queue leave it) and counts the lookup in the statistics;
  // later calls must pass no hit. Returns false, changing nothing, when there are not enough free
  // blocks. Throws tandem::Error on misuse (a stale hit: one of its blocks left the cache since
  // the lookup, even if cached again; a hit for a known request; a negative size).
  bool allocate(const std::string& request_id, int64_t num_tokens, const PrefixHit& hit = {});
  // The free blocks that allocate(request_id, num_tokens, hit) would take (new blocks, and the
  // hit's cached blocks that nobody references): it succeeds when this is at most
  // num_free_blocks(). Changes nothing; does not validate the hit.
  int64_t num_blocks_to_allocate(const std::string& request_id, int64_t num_tokens,
                                 const PrefixHit& hit = {}) const;

  // Registers the request's full blocks that are now computed: `tokens` are all its tokens whose
  // KV is in the cache, from the start (the same prefix as in earlier calls). A block whose prefix
  // is cached already stays private and the request references the cached one when another
  // request holds that; else the block takes over the cached one's entry, which returns to the
  // free queue's head uncached. Never takes a free block. Records one BlockStored per run of
  // consecutive blocks that cache a hash no cached block had. No-op when caching is off. Throws
  // tandem::Error for an unknown request or more tokens than the block table covers.
  void cache_full_blocks(const std::string& request_id, std::span<const int32_t> tokens);

  // Rolls a request back to its first `num_tokens` tokens (speculative decoding: the KV of
  // rejected draft tokens): blocks of its table past those covering them are released as free()
  // releases them. Registered (prefix-cached) blocks are never dropped; asking to is an error, as
  // is an unknown request. No-op when the table covers no more.
  void truncate(const std::string& request_id, int64_t num_tokens);

  // Drops the request's references (its table's, last to first, each cached copy of a private
  // block right after that block); blocks nobody else references return to the free queue, and
  // cached ones stay findable until evicted. Unknown ids are ignored (free is idempotent).
  void free(const std::string& request_id);

  // Throws tandem::Error for an unknown request.
  const std::vector<int32_t>& block_table(const std::string& request_id) const;
  bool has_request(const std::string& request_id) const;

  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  int64_t block_size() const { return block_size_; }
  bool prefix_caching_enabled() const { return enable_prefix_caching_; }
  int64_t num_free_blocks() const { return num_free_; }  // evictable cached blocks included
  double usage() const;                                  // 1 - free / total, in [0, 1]
  int64_t num_cached_blocks() const { return num_cached_; }
  const PrefixCacheStats& prefix_cache_stats() const { return stats_; }

  // Forgets every cached hash (blocks in use stay allocated, but become private to their
  // requests, as do the blocks that requests which registered some compute later: the entries
  // their KV follows are gone) and records AllBlocksCleared.
  void reset_prefix_cache();

  // The events recorded since the last call, oldest first.
  std::vector<KvEvent> take_events();

  // Inspection for tests and debugging.
  int32_t ref_count(int32_t block) const;
  std::optional<uint64_t> cached_hash(int32_t block) const;
  // Checks every internal invariant (O(blocks + table entries)); throws tandem::Error naming the
  // first one broken.
  void check_invariants() const;

 private:
  // The cache entry a sequence's first block follows.
  static constexpr uint64_t kNoParentEntry = 0;
  // The cached blocks a hash may hold. Honest hashes (64-bit) practically never collide; crafted
  // collisions beyond this stay private instead of making lookups and evictions walk a long list.
  static constexpr int64_t kMaxBlocksPerHash = 4;

  struct Block {
    int32_t ref = 0;
    bool in_free = false;
    int32_t prev = -1, next = -1;  // free-queue links
    // The prefix cache's entry for the block, meaningful when cached(); its tokens are at
    // cached_tokens_[block * block_size_].
    uint64_t entry = 0;                      // a number never given to another entry; 0: not cached
    uint64_t parent_entry = kNoParentEntry;  // the entry of the block its KV was computed after
    std::optional<uint64_t> salt;            // a first block's cache salt
    uint64_t hash = 0;
    int32_t next_same_hash = -1;  // the next cached block with the same hash (other tokens)

    bool cached() const { return entry != 0; }
  };
  struct Request {
    std::vector<int32_t> blocks;
    std::vector<uint64_t> hashes;  // hashes of its full computed blocks, as far as computed
    size_t num_registered = 0;     // leading blocks already considered for caching
    std::optional<uint64_t> cache_salt;
    // The entry of the cached block holding its block num_registered - 1 (its own, or the copy
    // cached first), and that block: what the next block it registers was computed after.
    uint64_t last_entry = kNoParentEntry;
    int32_t last_block = -1;
    // The cached blocks it references because its own copy at that table index stayed private
    // (index, block), in index order: its later blocks follow them, so they must outlive those.
    // Each was held by another request when it was registered (see cache_full_blocks).
    std::vector<std::pair<size_t, int32_t>> cached_copies;
    // It registers no more blocks: what they would follow is not cached (reset_prefix_cache() came
    // after it registered blocks, or its block's hash held kMaxBlocksPerHash blocks).
    bool lost_its_prefix = false;
  };

  void push_front(int32_t b);
  void push_back(int32_t b);
  void unlink(int32_t b);
  int32_t pop_front();
  void release(int32_t b);  // drops one table's reference
  void record(KvEvent event);

  uint64_t hash_block(size_t index, uint64_t parent_hash, std::span<const int32_t> block_tokens,
                      std::optional<uint64_t> salt) const;
  // The cached block with this hash that holds `block_tokens` after the block of `parent_entry`
  // (with `salt` when it is a first block), or -1.
  int32_t find_block(uint64_t hash, uint64_t parent_entry, std::span<const int32_t> block_tokens,
                     const std::optional<uint64_t>& salt) const;
  std::span<const int32_t> cached_tokens(int32_t b) const;
  // Makes block b the cache entry numbered `entry` for these contents (a new number, or the one
  // of a block that held them and was uncached); true when no other block had its hash.
  bool cache_block(int32_t b, uint64_t entry, uint64_t hash, uint64_t parent_entry,
                   std::span<const int32_t> block_tokens, std::optional<uint64_t> salt);
  // True when the hash holds kMaxBlocksPerHash cached blocks.
  bool hash_is_full(uint64_t hash) const;
  // Forgets block b's entry; true when no other block has its hash now.
  bool uncache_block(int32_t b);

  int64_t block_size_;
  bool enable_prefix_caching_;
  KvCacheOptions options_;
  std::vector<Block> blocks_;
  int32_t head_ = -1, tail_ = -1;
  int64_t num_free_ = 0;
  // Block hash -> the first cached block with it (more through Block::next_same_hash).
  absl::flat_hash_map<uint64_t, int32_t> cached_;
  int64_t num_cached_ = 0;
  uint64_t last_entry_ = 0;  // the entry numbers given so far
  // The tokens of cached blocks, block_size_ per block id; grown to the highest id cached, as a
  // simulated engine may have far more blocks than it ever fills.
  std::vector<int32_t> cached_tokens_;
  std::unordered_map<std::string, Request> requests_;
  std::vector<KvEvent> events_;
  PrefixCacheStats stats_;
};

}  // namespace tandem::engine
