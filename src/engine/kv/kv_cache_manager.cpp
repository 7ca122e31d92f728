#include "engine/kv/kv_cache_manager.h"

#include <algorithm>
#include <limits>
#include <unordered_set>
#include <utility>

#include "api/block_hash.h"
#include "util/error.h"

namespace tandem::engine {
namespace {

std::string describe(int32_t block) {
  return "block " + std::to_string(block);
}

}  // namespace

KvCacheManager::KvCacheManager(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching,
                               KvCacheOptions options)
    : block_size_(block_size),
      enable_prefix_caching_(enable_prefix_caching),
      options_(std::move(options)) {
  if (num_blocks < 1 || num_blocks > std::numeric_limits<int32_t>::max()) {
    throw Error("KvCacheManager: num_blocks must be in [1, 2^31-1], got " +
                std::to_string(num_blocks));
  }
  if (block_size < 1) {
    throw Error("KvCacheManager: block_size must be at least 1, got " + std::to_string(block_size));
  }
  blocks_.resize(static_cast<size_t>(num_blocks));
  for (int32_t b = 0; b < static_cast<int32_t>(num_blocks); ++b) push_back(b);
}

// ---- free queue: an intrusive doubly linked list over blocks_, O(1) removal from the middle ----

void KvCacheManager::push_front(int32_t b) {
  Block& block = blocks_[b];
  block.prev = -1;
  block.next = head_;
  if (head_ >= 0) blocks_[head_].prev = b;
  head_ = b;
  if (tail_ < 0) tail_ = b;
  block.in_free = true;
  ++num_free_;
}

void KvCacheManager::push_back(int32_t b) {
  Block& block = blocks_[b];
  block.next = -1;
  block.prev = tail_;
  if (tail_ >= 0) blocks_[tail_].next = b;
  tail_ = b;
  if (head_ < 0) head_ = b;
  block.in_free = true;
  ++num_free_;
}

void KvCacheManager::unlink(int32_t b) {
  Block& block = blocks_[b];
  if (block.prev >= 0)
    blocks_[block.prev].next = block.next;
  else
    head_ = block.next;
  if (block.next >= 0)
    blocks_[block.next].prev = block.prev;
  else
    tail_ = block.prev;
  block.prev = block.next = -1;
  block.in_free = false;
  --num_free_;
}

int32_t KvCacheManager::pop_front() {
  const int32_t b = head_;
  unlink(b);
  return b;
}

void KvCacheManager::record(KvEvent event) {
  if (options_.enable_events) events_.push_back(std::move(event));
}

// ---- prefix cache entries: a hash finds candidates, their contents decide ----

uint64_t KvCacheManager::hash_block(size_t index, uint64_t parent_hash,
                                    std::span<const int32_t> block_tokens,
                                    std::optional<uint64_t> salt) const {
  return index == 0 ? options_.block_hash(std::nullopt, block_tokens, salt)
                    : options_.block_hash(parent_hash, block_tokens, std::nullopt);
}

std::span<const int32_t> KvCacheManager::cached_tokens(int32_t b) const {
  const size_t bs = static_cast<size_t>(block_size_);
  return std::span<const int32_t>(cached_tokens_).subspan(static_cast<size_t>(b) * bs, bs);
}

int32_t KvCacheManager::find_block(uint64_t hash, uint64_t parent_entry,
                                   std::span<const int32_t> block_tokens,
                                   const std::optional<uint64_t>& salt) const {
  const auto it = cached_.find(hash);
  if (it == cached_.end()) return -1;
  for (int32_t b = it->second; b >= 0; b = blocks_[b].next_same_hash) {
    const Block& block = blocks_[b];
    if (block.parent_entry == parent_entry && block.salt == salt &&
        std::ranges::equal(cached_tokens(b), block_tokens))
      return b;
  }
  return -1;
}

bool KvCacheManager::hash_is_full(uint64_t hash) const {
  const auto it = cached_.find(hash);
  int64_t blocks = 0;
  for (int32_t b = it == cached_.end() ? -1 : it->second; b >= 0; b = blocks_[b].next_same_hash)
    ++blocks;
  return blocks >= kMaxBlocksPerHash;
}

bool KvCacheManager::cache_block(int32_t b, uint64_t entry, uint64_t hash, uint64_t parent_entry,
                                 std::span<const int32_t> block_tokens,
                                 std::optional<uint64_t> salt) {
  Block& block = blocks_[b];
  block.entry = entry;
  block.parent_entry = parent_entry;
  block.salt = salt;
  block.hash = hash;
  const size_t end = (static_cast<size_t>(b) + 1) * static_cast<size_t>(block_size_);
  if (cached_tokens_.size() < end) cached_tokens_.resize(end);
  std::ranges::copy(block_tokens,
                    cached_tokens_.begin() + static_cast<ptrdiff_t>(end) - block_size_);
  ++num_cached_;
  const auto [it, first] = cached_.try_emplace(hash, b);
  block.next_same_hash = first ? -1 : std::exchange(blocks_[it->second].next_same_hash, b);
  return first;
}

bool KvCacheManager::uncache_block(int32_t b) {
  Block& block = blocks_[b];
  const auto it = cached_.find(block.hash);
  bool last = false;
  if (it->second == b) {
    last = block.next_same_hash < 0;
    if (last)
      cached_.erase(it);
    else
      it->second = block.next_same_hash;
  } else {
    int32_t before = it->second;
    while (blocks_[before].next_same_hash != b) before = blocks_[before].next_same_hash;
    blocks_[before].next_same_hash = block.next_same_hash;
  }
  block.entry = 0;
  block.next_same_hash = -1;
  --num_cached_;
  return last;
}

// ---- prefix cache ----

PrefixHit KvCacheManager::find_cached_prefix(std::span<const int32_t> tokens,
                                             std::optional<uint64_t> cache_salt) const {
  PrefixHit hit;
  hit.num_query_tokens = static_cast<int64_t>(tokens.size());
  hit.cache_salt = cache_salt;
  if (!enable_prefix_caching_ || tokens.empty()) return hit;
  // Leave the last token uncached: the model must run on at least one token to give logits.
  const size_t max_blocks = (tokens.size() - 1) / static_cast<size_t>(block_size_);
  const size_t bs = static_cast<size_t>(block_size_);
  uint64_t parent_entry = kNoParentEntry;
  for (size_t i = 0; i < max_blocks; ++i) {
    const auto block_tokens = tokens.subspan(i * bs, bs);
    const auto salt = i == 0 ? cache_salt : std::nullopt;
    const uint64_t h = hash_block(i, i == 0 ? 0 : hit.hashes.back(), block_tokens, salt);
    const int32_t b = find_block(h, parent_entry, block_tokens, salt);
    if (b < 0) break;  // nothing cached, or only other tokens whose hash collides: a miss
    hit.blocks.push_back(b);
    hit.hashes.push_back(h);
    parent_entry = blocks_[b].entry;
  }
  if (options_.recompute_last_hit_block && !hit.blocks.empty()) {
    hit.blocks.pop_back();
    hit.hashes.pop_back();
  }
  hit.num_tokens = static_cast<int64_t>(hit.blocks.size()) * block_size_;
  if (!hit.blocks.empty()) hit.last_block_entry = blocks_[hit.blocks.back()].entry;
  return hit;
}

bool KvCacheManager::allocate(const std::string& request_id, int64_t num_tokens,
                              const PrefixHit& hit) {
  if (num_tokens < 0) {
    throw Error("allocate: num_tokens must be >= 0 for request '" + request_id + "', got " +
                std::to_string(num_tokens));
  }
  const auto existing = requests_.find(request_id);
  const bool is_new = existing == requests_.end();
  if (!is_new && !hit.blocks.empty()) {
    throw Error("allocate: request '" + request_id +
                "' already has a block table; a prefix hit is only for its first allocation");
  }
  if (hit.blocks.size() != hit.hashes.size() ||
      hit.num_tokens != static_cast<int64_t>(hit.blocks.size()) * block_size_) {
    throw Error("allocate: malformed prefix hit for request '" + request_id + "'");
  }
  if (num_tokens < hit.num_tokens) {
    throw Error("allocate: request '" + request_id + "' asks for " + std::to_string(num_tokens) +
                " tokens, fewer than its " + std::to_string(hit.num_tokens) + " cached ones");
  }
  // The hit must still describe the cache: nothing may have evicted or reset in between. Its
  // blocks still chain, each after the entry before it, and its last block is the entry the
  // lookup found, so every one is (an entry always names the same tokens after the same parent,
  // whichever block holds it): a block evicted and cached again for other tokens whose hash
  // collides has a new entry.
  const auto stale = [&] {
    return Error("allocate: the prefix hit for request '" + request_id +
                 "' is stale (the cache changed after find_cached_prefix)");
  };
  int64_t hit_blocks_free = 0;
  uint64_t hit_entry = kNoParentEntry;
  for (size_t i = 0; i < hit.blocks.size(); ++i) {
    const int32_t b = hit.blocks[i];
    if (b < 0 || b >= num_blocks() || !blocks_[b].cached() || blocks_[b].hash != hit.hashes[i] ||
        blocks_[b].parent_entry != hit_entry) {
      throw stale();
    }
    hit_entry = blocks_[b].entry;
    if (blocks_[b].ref == 0) ++hit_blocks_free;
  }
  if (hit_entry != hit.last_block_entry) throw stale();

  const int64_t new_blocks = num_blocks_to_allocate(request_id, num_tokens, hit) - hit_blocks_free;
  if (new_blocks + hit_blocks_free > num_free_) return false;

  Request& request = is_new ? requests_[request_id] : existing->second;
  if (is_new) {
    request.cache_salt = hit.cache_salt;
    for (size_t i = 0; i < hit.blocks.size(); ++i) {
      const int32_t b = hit.blocks[i];
      if (blocks_[b].ref == 0) unlink(b);
      ++blocks_[b].ref;
      request.blocks.push_back(b);
    }
    request.hashes = hit.hashes;
    request.num_registered = hit.blocks.size();
    request.last_entry = hit_entry;
    if (!hit.blocks.empty()) request.last_block = hit.blocks.back();
    if (enable_prefix_caching_ && hit.num_query_tokens > 0) {
      ++stats_.requests;
      stats_.queries += hit.num_query_tokens;
      stats_.hits += hit.num_tokens;
    }
  }
  BlockRemoved removed{{}, options_.medium};
  for (int64_t i = 0; i < new_blocks; ++i) {
    const int32_t b = pop_front();
    Block& block = blocks_[b];
    if (block.cached()) {  // evict: the block is about to be overwritten
      if (uncache_block(b)) removed.block_hashes.push_back(block.hash);
      ++stats_.evicted_blocks;
    }
    block.ref = 1;
    request.blocks.push_back(b);
  }
  if (!removed.block_hashes.empty()) record(std::move(removed));
  return true;
}

int64_t KvCacheManager::num_blocks_to_allocate(const std::string& request_id, int64_t num_tokens,
                                               const PrefixHit& hit) const {
  const auto existing = requests_.find(request_id);
  int64_t have = 0, hit_blocks_free = 0;
  if (existing != requests_.end()) {
    have = static_cast<int64_t>(existing->second.blocks.size());
  } else {
    have = static_cast<int64_t>(hit.blocks.size());
    for (const int32_t b : hit.blocks)
      if (b >= 0 && b < num_blocks() && blocks_[b].ref == 0) ++hit_blocks_free;
  }
  const int64_t needed = (num_tokens + block_size_ - 1) / block_size_;
  return std::max<int64_t>(0, needed - have) + hit_blocks_free;
}

void KvCacheManager::cache_full_blocks(const std::string& request_id,
                                       std::span<const int32_t> tokens) {
  const auto it = requests_.find(request_id);
  if (it == requests_.end()) {
    throw Error("cache_full_blocks: unknown request '" + request_id + "'");
  }
  Request& request = it->second;
  const size_t bs = static_cast<size_t>(block_size_);
  if (tokens.size() > request.blocks.size() * bs) {
    throw Error("cache_full_blocks: request '" + request_id + "' has " +
                std::to_string(tokens.size()) + " computed tokens but blocks for only " +
                std::to_string(request.blocks.size() * bs));
  }
  if (!enable_prefix_caching_) return;
  const size_t full = tokens.size() / bs;
  if (full <= request.num_registered) return;
  for (size_t i = request.hashes.size(); i < full; ++i) {
    request.hashes.push_back(hash_block(i, i == 0 ? 0 : request.hashes[i - 1],
                                        tokens.subspan(i * bs, bs), request.cache_salt));
  }
  if (request.lost_its_prefix) {
    request.num_registered = full;
    return;
  }

  // One BlockStored per run of consecutive blocks that cache a hash no block had (a duplicate, or
  // a block whose hash collides with a cached one's, breaks the run, since an event's blocks must
  // chain from its parent hash).
  BlockStored run;
  const auto flush = [&] {
    if (!run.block_hashes.empty()) record(std::move(run));
    run = BlockStored{};
  };
  for (size_t i = request.num_registered; i < full; ++i) {
    const uint64_t h = request.hashes[i];
    const int32_t b = request.blocks[i];
    const auto block_tokens = tokens.subspan(i * bs, bs);
    const auto salt = i == 0 ? request.cache_salt : std::nullopt;
    const uint64_t parent_entry = request.last_entry;
    if (parent_entry != kNoParentEntry && blocks_[request.last_block].entry != parent_entry) {
      // What its blocks follow left the cache (the request holds it, so only a bug gets here):
      // blocks cached after it could never be found.
      request.lost_its_prefix = true;
      break;
    }
    if (const int32_t copy = find_block(h, parent_entry, block_tokens, salt); copy >= 0) {
      flush();  // no new hash: the run's next block would not chain from its last
      if (blocks_[copy].ref == 0) {
        // Nobody holds the cached block (the request recomputed a hit's last block for MTP, or
        // scores a cached prompt): ours takes over its entry (the same tokens after the same
        // entry), and it is free and holds nothing. Holding it instead would take a free block
        // the scheduler did not count (a scorer would hold its prompt's blocks twice).
        const uint64_t entry = blocks_[copy].entry;
        uncache_block(copy);
        unlink(copy);
        push_front(copy);
        cache_block(b, entry, h, parent_entry, block_tokens, salt);
        request.last_entry = entry;
        request.last_block = b;
        continue;
      }
      // Another request holds it (it computed this block at the same time): ours stays private
      // and the next block follows that one, which the request holds too so that it is not
      // evicted before them.
      ++blocks_[copy].ref;
      request.cached_copies.emplace_back(i, copy);
      request.last_entry = blocks_[copy].entry;
      request.last_block = copy;
      continue;
    }
    if (hash_is_full(h)) {
      // Colliding on purpose, most likely: kept out, so a lookup or eviction walks few blocks.
      // What the request computes after this block could never be found either.
      request.lost_its_prefix = true;
      break;
    }
    const bool new_hash = cache_block(b, ++last_entry_, h, parent_entry, block_tokens, salt);
    request.last_entry = blocks_[b].entry;
    request.last_block = b;
    if (!new_hash) {  // other tokens with this hash are cached: events have it already
      flush();
      continue;
    }
    if (run.block_hashes.empty()) {
      if (i > 0) run.parent_block_hash = request.hashes[i - 1];
      run.block_size = block_size_;
      run.medium = options_.medium;
    }
    run.block_hashes.push_back(h);
    run.token_ids.insert(run.token_ids.end(), block_tokens.begin(), block_tokens.end());
  }
  flush();
  request.num_registered = full;
}

void KvCacheManager::release(int32_t b) {
  Block& block = blocks_[b];
  if (--block.ref > 0) return;
  if (block.cached())
    push_back(b);
  else
    push_front(b);  // holds nothing reusable: hand it out first
}

void KvCacheManager::truncate(const std::string& request_id, int64_t num_tokens) {
  const auto it = requests_.find(request_id);
  if (it == requests_.end()) throw Error("truncate: unknown request '" + request_id + "'");
  Request& request = it->second;
  const auto keep =
      static_cast<size_t>(std::max<int64_t>(0, num_tokens + block_size_ - 1) / block_size_);
  if (keep >= request.blocks.size()) return;
  if (keep < request.num_registered || keep < request.hashes.size())
    throw Error("truncate: request '" + request_id + "' would lose registered blocks (keeps " +
                std::to_string(keep) + " of " + std::to_string(request.num_registered) + ")");
  while (request.blocks.size() > keep) {
    release(request.blocks.back());
    request.blocks.pop_back();
  }
}

void KvCacheManager::free(const std::string& request_id) {
  const auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  const std::vector<int32_t>& table = it->second.blocks;
  const auto& copies = it->second.cached_copies;
  // Reverse order, so that a sequence's tail is evicted before its head, and a cached copy right
  // after the private block it stands for: after the blocks that follow it, before those it
  // follows.
  auto copy = copies.rbegin();
  for (size_t i = table.size(); i-- > 0;) {
    release(table[i]);
    if (copy != copies.rend() && copy->first == i) release((copy++)->second);
  }
  requests_.erase(it);
}

void KvCacheManager::reset_prefix_cache() {
  for (Block& block : blocks_) {
    block.entry = 0;
    block.next_same_hash = -1;
  }
  cached_.clear();
  num_cached_ = 0;
  for (auto& [id, request] : requests_) {
    if (request.num_registered > 0) request.lost_its_prefix = true;
  }
  record(AllBlocksCleared{});
}

std::vector<KvEvent> KvCacheManager::take_events() {
  return std::exchange(events_, {});
}

const std::vector<int32_t>& KvCacheManager::block_table(const std::string& request_id) const {
  const auto it = requests_.find(request_id);
  if (it == requests_.end()) throw Error("block_table: unknown request '" + request_id + "'");
  return it->second.blocks;
}

bool KvCacheManager::has_request(const std::string& request_id) const {
  return requests_.count(request_id) != 0;
}

double KvCacheManager::usage() const {
  return 1.0 - static_cast<double>(num_free_) / static_cast<double>(blocks_.size());
}

int32_t KvCacheManager::ref_count(int32_t block) const {
  if (block < 0 || block >= num_blocks()) throw Error("ref_count: no " + describe(block));
  return blocks_[block].ref;
}

std::optional<uint64_t> KvCacheManager::cached_hash(int32_t block) const {
  if (block < 0 || block >= num_blocks()) throw Error("cached_hash: no " + describe(block));
  if (!blocks_[block].cached()) return std::nullopt;
  return blocks_[block].hash;
}

void KvCacheManager::check_invariants() const {
  const auto fail = [](const std::string& what) {
    throw Error("KvCacheManager invariant: " + what);
  };
  // Free queue: a well-linked list of exactly the unreferenced blocks.
  int64_t walked = 0;
  int32_t prev = -1;
  for (int32_t b = head_; b >= 0; b = blocks_[b].next) {
    if (++walked > num_blocks()) fail("free queue has a cycle");
    if (!blocks_[b].in_free) fail(describe(b) + " is in the free queue but not marked free");
    if (blocks_[b].prev != prev) fail(describe(b) + " has a wrong prev link");
    prev = b;
  }
  if (prev != tail_) fail("free queue tail is wrong");
  if (walked != num_free_) fail("free count differs from the free queue length");
  // Reference counts equal the number of block tables holding a block.
  std::vector<int32_t> refs(blocks_.size(), 0);
  for (const auto& [id, request] : requests_) {
    std::unordered_set<int32_t> seen;
    const auto hold = [&](int32_t b) {
      if (b < 0 || b >= num_blocks()) fail("request '" + id + "' holds " + describe(b));
      if (!seen.insert(b).second) fail("request '" + id + "' holds " + describe(b) + " twice");
      ++refs[b];
    };
    for (const int32_t b : request.blocks) hold(b);
    for (const auto& [index, b] : request.cached_copies) {
      if (index >= request.num_registered) fail("request '" + id + "' holds a copy it never met");
      hold(b);
    }
    if (request.num_registered > request.hashes.size() && enable_prefix_caching_) {
      fail("request '" + id + "' registered blocks without hashes");
    }
    if (request.hashes.size() > request.blocks.size()) {
      fail("request '" + id + "' has more hashes than blocks");
    }
  }
  std::unordered_set<uint64_t> entries;
  for (const Block& block : blocks_)
    if (block.cached() && !entries.insert(block.entry).second)
      fail("entry " + std::to_string(block.entry) + " is in two blocks");
  int64_t used = 0, cached = 0;
  for (int32_t b = 0; b < num_blocks(); ++b) {
    const Block& block = blocks_[b];
    if (block.ref != refs[b]) {
      fail(describe(b) + " has ref " + std::to_string(block.ref) + " but " +
           std::to_string(refs[b]) + " tables hold it");
    }
    if (block.in_free != (block.ref == 0)) fail(describe(b) + " is free iff unreferenced: broken");
    if (block.ref > 0) ++used;
    if (block.cached()) {
      ++cached;
      if (block.entry > last_entry_) fail(describe(b) + " has an entry number never given");
      // An entry follows one made before it; only a first block has a salt.
      if (block.parent_entry >= block.entry) fail(describe(b) + " follows a later entry");
      if (block.salt && block.parent_entry != kNoParentEntry)
        fail(describe(b) + " is salted but not a first block");
      // What it follows is still cached, so a lookup can reach it.
      if (block.parent_entry != kNoParentEntry && !entries.contains(block.parent_entry))
        fail(describe(b) + " follows a block that left the cache");
      if (cached_tokens_.size() < (static_cast<size_t>(b) + 1) * static_cast<size_t>(block_size_))
        fail(describe(b) + " is cached without its tokens");
    }
  }
  if (used + num_free_ != num_blocks()) fail("free + used blocks differ from the total");
  // Each hash's chain holds exactly the cached blocks with that hash, and no two of them hold
  // the same prefix (a prefix maps to at most one block).
  int64_t chained = 0;
  for (const auto& [hash, first] : cached_) {
    int64_t length = 0;
    for (int32_t b = first; b >= 0; b = blocks_[b].next_same_hash) {
      if (b >= num_blocks() || ++length > num_blocks())
        fail("the blocks of a hash are not a well-linked list");
      if (length > kMaxBlocksPerHash) fail("a hash holds more than kMaxBlocksPerHash blocks");
      const Block& block = blocks_[b];
      if (!block.cached() || block.hash != hash)
        fail(describe(b) + " is listed under a hash it does not hold");
      for (int32_t other = first; other != b; other = blocks_[other].next_same_hash) {
        if (blocks_[other].parent_entry == block.parent_entry &&
            blocks_[other].salt == block.salt &&
            std::ranges::equal(cached_tokens(other), cached_tokens(b)))
          fail(describe(b) + " and " + describe(other) + " hold the same prefix");
      }
    }
    chained += length;
  }
  if (chained != cached || cached != num_cached_)
    fail("cached blocks, blocks listed under their hashes and the count differ");
}

}  // namespace tandem::engine
