// KvCacheManager: allocation, prefix hits, LRU eviction, events, and a randomized property test
// that drives it through long random sequences of scheduler operations and checks its state
// against an independent model after every one.
#include "engine/kv/kv_cache_manager.h"

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <gtest/gtest.h>

#include "api/block_hash.h"
#include "util/error.h"

namespace tandem::engine {
namespace {

std::vector<int32_t> iota_tokens(int32_t first, size_t n) {
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = first + static_cast<int32_t>(i);
  return t;
}

KvCacheOptions with_events() {
  return KvCacheOptions{.enable_events = true, .medium = "CPU"};
}

KvCacheOptions with_mtp(KvCacheOptions options, bool mtp) {
  options.recompute_last_hit_block = mtp;
  return options;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Runs a request through prefill: lookup, allocate, compute everything, register.
PrefixHit admit_and_compute(KvCacheManager& m, const std::string& id,
                            const std::vector<int32_t>& tokens) {
  PrefixHit hit = m.find_cached_prefix(tokens);
  EXPECT_TRUE(m.allocate(id, static_cast<int64_t>(tokens.size()), hit));
  m.cache_full_blocks(id, tokens);
  return hit;
}

TEST(KvCacheManagerTest, AllocateGrowAndFree) {
  KvCacheManager m(10, 4, true);
  EXPECT_EQ(m.num_free_blocks(), 10);
  EXPECT_DOUBLE_EQ(m.usage(), 0.0);
  ASSERT_TRUE(m.allocate("a", 9));
  EXPECT_EQ(m.block_table("a").size(), 3u);
  EXPECT_EQ(m.num_free_blocks(), 7);
  EXPECT_DOUBLE_EQ(m.usage(), 0.3);
  ASSERT_TRUE(m.allocate("a", 12));  // still fits in three blocks
  EXPECT_EQ(m.block_table("a").size(), 3u);
  ASSERT_TRUE(m.allocate("a", 13));
  EXPECT_EQ(m.block_table("a").size(), 4u);
  ASSERT_TRUE(m.allocate("a", 5));  // never shrinks
  EXPECT_EQ(m.block_table("a").size(), 4u);
  for (const int32_t b : m.block_table("a")) EXPECT_EQ(m.ref_count(b), 1);
  ASSERT_TRUE(m.allocate("empty", 0));
  EXPECT_TRUE(m.block_table("empty").empty());
  m.check_invariants();
  m.free("a");
  m.free("a");  // idempotent
  m.free("empty");
  EXPECT_FALSE(m.has_request("a"));
  EXPECT_EQ(m.num_free_blocks(), 10);
  EXPECT_THROW(m.block_table("a"), Error);
  m.check_invariants();
}

TEST(KvCacheManagerTest, TruncateReleasesTheBlocksOfRejectedTokensOnly) {
  KvCacheManager m(10, 4, true, with_events());
  const auto tokens = iota_tokens(100, 8);
  admit_and_compute(m, "a", tokens);    // two full blocks, registered
  ASSERT_TRUE(m.allocate("a", 8 + 6));  // drafts: two more blocks
  const int32_t third = m.block_table("a")[2];
  m.truncate("a", 9);  // one draft accepted: the third block stays, the fourth goes
  ASSERT_EQ(m.block_table("a").size(), 3u);
  EXPECT_EQ(m.block_table("a")[2], third);
  EXPECT_EQ(m.num_free_blocks(), 7);
  m.truncate("a", 12);  // covers no fewer blocks: nothing changes
  EXPECT_EQ(m.block_table("a").size(), 3u);
  EXPECT_THROW(m.truncate("a", 4), Error);  // would drop a registered block
  EXPECT_THROW(m.truncate("nobody", 0), Error);
  EXPECT_EQ(m.num_cached_blocks(), 2);  // no hash for anything past the verified tokens
  m.check_invariants();
  // A released block is handed out first (it held nothing reusable).
  ASSERT_TRUE(m.allocate("b", 1));
  m.check_invariants();
}

TEST(KvCacheManagerTest, FailedAllocationChangesNothing) {
  KvCacheManager m(4, 4, true, with_events());
  admit_and_compute(m, "a", iota_tokens(1, 8));  // two cached blocks
  m.free("a");
  m.take_events();
  ASSERT_TRUE(m.allocate("b", 4));
  // Needs 4 blocks, only 3 free (2 of them cached): refused with no eviction.
  EXPECT_FALSE(m.allocate("c", 16));
  EXPECT_FALSE(m.has_request("c"));
  EXPECT_FALSE(m.allocate("b", 20));
  EXPECT_EQ(m.block_table("b").size(), 1u);
  EXPECT_EQ(m.num_free_blocks(), 3);
  EXPECT_EQ(m.num_cached_blocks(), 2);
  EXPECT_TRUE(m.take_events().empty());
  // A hit whose blocks sit in the free queue counts them as taken.
  const auto tokens = iota_tokens(1, 9);
  const PrefixHit hit = m.find_cached_prefix(tokens);
  ASSERT_EQ(hit.blocks.size(), 2u);
  EXPECT_FALSE(m.allocate("d", 4 * 4, hit));  // 2 hit + 2 new > 3 free
  EXPECT_FALSE(m.has_request("d"));
  EXPECT_EQ(m.prefix_cache_stats().requests, 1);  // only "a" so far
  EXPECT_TRUE(m.allocate("d", 3 * 4, hit));       // 2 hit + 1 new
  EXPECT_EQ(m.num_free_blocks(), 0);
  m.check_invariants();
}

// num_blocks_to_allocate says what allocate() would take from the free queue (new blocks and a
// hit's unreferenced cached ones), so the scheduler can tell whether freeing some blocks would
// let a request in before it frees them; a hit with num_query_tokens 0 is not counted as a
// lookup (a preempted sequence readmitted).
TEST(KvCacheManagerTest, BlocksToAllocateAndUncountedLookups) {
  KvCacheManager m(4, 4, true);
  admit_and_compute(m, "a", iota_tokens(1, 8));  // two cached blocks
  m.free("a");
  ASSERT_TRUE(m.allocate("b", 4));
  EXPECT_EQ(m.num_blocks_to_allocate("b", 4), 0);
  EXPECT_EQ(m.num_blocks_to_allocate("b", 5), 1);
  EXPECT_EQ(m.num_blocks_to_allocate("b", 20), 4);
  EXPECT_EQ(m.num_blocks_to_allocate("c", 16), 4);
  PrefixHit hit = m.find_cached_prefix(iota_tokens(1, 9));
  ASSERT_EQ(hit.blocks.size(), 2u);
  EXPECT_EQ(m.num_blocks_to_allocate("d", 16, hit), 4);  // 2 hit blocks in the free queue + 2
  EXPECT_EQ(m.num_blocks_to_allocate("d", 12, hit), 3);
  EXPECT_FALSE(m.allocate("d", 16, hit));
  hit.num_query_tokens = 0;
  const PrefixCacheStats before = m.prefix_cache_stats();
  ASSERT_TRUE(m.allocate("d", 12, hit));
  EXPECT_EQ(m.prefix_cache_stats().requests, before.requests);
  EXPECT_EQ(m.prefix_cache_stats().queries, before.queries);
  EXPECT_EQ(m.prefix_cache_stats().hits, before.hits);
  // Referenced hit blocks are not taken from the free queue.
  const PrefixHit shared = m.find_cached_prefix(iota_tokens(1, 9));
  EXPECT_EQ(m.num_blocks_to_allocate("e", 9, shared), 1);
  EXPECT_EQ(m.num_blocks_to_allocate("e", 8, shared), 0);
  m.check_invariants();
}

TEST(KvCacheManagerTest, PrefixHitSharesBlocksAndLeavesLastToken) {
  KvCacheManager m(16, 4, true, with_events());
  const auto prompt = iota_tokens(100, 12);
  admit_and_compute(m, "a", prompt);
  const auto events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  const auto& stored = std::get<BlockStored>(events[0]);
  EXPECT_EQ(stored.block_hashes, api::block_hashes(prompt, 4));
  EXPECT_FALSE(stored.parent_block_hash);
  EXPECT_EQ(stored.token_ids, prompt);
  EXPECT_EQ(stored.block_size, 4);
  EXPECT_EQ(stored.medium, "CPU");

  // The same 12 tokens: only 2 blocks are reused, so the model still computes the last token.
  PrefixHit hit = m.find_cached_prefix(prompt);
  EXPECT_EQ(hit.num_tokens, 8);
  EXPECT_EQ(hit.blocks,
            std::vector<int32_t>(m.block_table("a").begin(), m.block_table("a").begin() + 2));
  // One more token: all three blocks.
  auto longer = prompt;
  longer.push_back(7);
  hit = m.find_cached_prefix(longer);
  ASSERT_EQ(hit.num_tokens, 12);
  ASSERT_TRUE(m.allocate("b", 13, hit));
  const auto& table_b = m.block_table("b");
  ASSERT_EQ(table_b.size(), 4u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(table_b[i], m.block_table("a")[i]);
    EXPECT_EQ(m.ref_count(table_b[i]), 2);
  }
  EXPECT_EQ(m.ref_count(table_b[3]), 1);
  EXPECT_EQ(m.num_free_blocks(), 16 - 4);
  EXPECT_EQ(m.prefix_cache_stats().requests, 2);
  EXPECT_EQ(m.prefix_cache_stats().queries, 12 + 13);
  EXPECT_EQ(m.prefix_cache_stats().hits, 12);

  // b's cached blocks stay put when a is freed, and its own full block chains from a's.
  m.free("a");
  for (int i = 0; i < 3; ++i) EXPECT_EQ(m.ref_count(table_b[i]), 1);
  EXPECT_EQ(m.num_free_blocks(), 16 - 4);
  longer.insert(longer.end(), {8, 9, 10});
  ASSERT_TRUE(m.allocate("b", 16));
  m.cache_full_blocks("b", longer);
  const auto more = m.take_events();
  ASSERT_EQ(more.size(), 1u);
  const auto& stored_b = std::get<BlockStored>(more[0]);
  EXPECT_EQ(stored_b.parent_block_hash, api::block_hashes(prompt, 4).back());
  EXPECT_EQ(stored_b.block_hashes, std::vector<uint64_t>{api::block_hashes(longer, 4)[3]});
  EXPECT_EQ(stored_b.token_ids, std::vector<int32_t>(longer.begin() + 12, longer.end()));
  // Filling every other block cannot take b's blocks.
  ASSERT_TRUE(m.allocate("c", 12 * 4));
  EXPECT_FALSE(m.allocate("d", 1));
  std::set<int32_t> c_blocks(m.block_table("c").begin(), m.block_table("c").end());
  for (const int32_t b : table_b) EXPECT_EQ(c_blocks.count(b), 0u);
  m.check_invariants();
}

// With MTP drafts every lookup leaves the hit's last block to recompute (its MTP-layer entry at
// the last position was computed with another request's next token): a 3-block hit gives 2, a
// 1-block hit none, and the blocks it gives are the cached ones.
TEST(KvCacheManagerTest, WithMtpDraftsAHitLeavesItsLastBlock) {
  KvCacheManager m(16, 4, true, {.recompute_last_hit_block = true});
  const auto prompt = iota_tokens(100, 12);
  admit_and_compute(m, "a", prompt);
  auto longer = prompt;
  longer.push_back(7);
  const PrefixHit hit = m.find_cached_prefix(longer);
  EXPECT_EQ(hit.num_tokens, 8);
  EXPECT_EQ(hit.blocks,
            std::vector<int32_t>(m.block_table("a").begin(), m.block_table("a").begin() + 2));
  const std::vector<uint64_t> hashes = api::block_hashes(prompt, 4);
  EXPECT_EQ(hit.hashes, std::vector<uint64_t>(hashes.begin(), hashes.begin() + 2));
  EXPECT_EQ(m.find_cached_prefix(iota_tokens(100, 5)).num_tokens, 0);
  // Without drafts, the whole run of cached blocks.
  KvCacheManager plain(16, 4, true);
  admit_and_compute(plain, "a", prompt);
  EXPECT_EQ(plain.find_cached_prefix(longer).num_tokens, 12);
  m.check_invariants();
}

// Multi-turn chats under MTP: a request that hit a system prompt S recomputes S's last block
// privately; nobody else holding the cached one, its copy takes over that cache entry, and the
// blocks it caches next follow it. Freed, the request queues that block behind its own later
// blocks, so memory pressure evicts its followers before it, and its next turn still hits them
// (before d37c697, the cached block aged in the free queue with the first chat's blocks, was
// evicted first, and the followers were never hit again, even after a third chat cached S's last
// block anew).
TEST(KvCacheManagerTest, WithMtpTheBlocksAfterARecomputedBlockStayFindable) {
  KvCacheManager m(12, 4, true, {.recompute_last_hit_block = true});
  const auto system = iota_tokens(1000, 8);  // two blocks: s0, s1
  const auto chat = [&](int32_t first_user_token, size_t user_tokens) {
    auto tokens = system;
    const auto user = iota_tokens(first_user_token, user_tokens);
    tokens.insert(tokens.end(), user.begin(), user.end());
    return tokens;
  };
  admit_and_compute(m, "r1", chat(100, 9));
  const int32_t s1 = m.block_table("r1")[1];
  m.free("r1");
  const auto r2 = chat(200, 9);
  EXPECT_EQ(admit_and_compute(m, "r2", r2).num_tokens, 4);  // s0; s1 is recomputed
  EXPECT_NE(m.block_table("r2")[1], s1);
  EXPECT_TRUE(m.cached_hash(m.block_table("r2")[1]));  // s1's entry, taken over
  EXPECT_FALSE(m.cached_hash(s1));
  m.free("r2");
  // Memory pressure: as many blocks as it takes to evict the first chat's blocks and one more.
  ASSERT_TRUE(m.allocate("x", 9 * 4));
  m.free("x");
  admit_and_compute(m, "r3", chat(300, 9));
  const int32_t r3_s1 = m.block_table("r3")[1];  // takes s1's entry over in turn
  m.free("r3");
  // r2's next turn: its prompt, an answer and a new question.
  auto r2_next = r2;
  const auto more = iota_tokens(400, 8);
  r2_next.insert(r2_next.end(), more.begin(), more.end());
  const PrefixHit hit = m.find_cached_prefix(r2_next);
  EXPECT_EQ(hit.num_tokens, 8);  // s0, s1 (and u2a, left to recompute); u2b was evicted
  ASSERT_EQ(hit.blocks.size(), 2u);
  EXPECT_EQ(hit.blocks[1], r3_s1);
  m.check_invariants();
}

// A sequence that scores its prompt (prompt_logprobs: no prefix hit, every block computed) over a
// prompt already cached holds no cached copy beside its own blocks: holding them took every free
// block, so its allocation failed at 48 of 60 tokens, and preempted and readmitted as it was, it
// never finished (before 0d3f875). Its blocks take the cached ones' entries over instead (nobody
// holds those), so the prompt stays cached whole.
TEST(KvCacheManagerTest, AScoringSequenceOverACachedPromptHoldsNoCopiesBesideItsOwnBlocks) {
  KvCacheManager m(20, 4, true, {.recompute_last_hit_block = true});
  const auto prompt = iota_tokens(1000, 60);
  admit_and_compute(m, "a", prompt);
  m.free("a");
  for (int round = 0; round < 2; ++round) {  // the second: as readmitted after a preemption
    const std::string id = "b" + std::to_string(round);
    for (int64_t done = 8; done <= 60; done += 8) {
      ASSERT_TRUE(done == 8 ? m.allocate(id, done, PrefixHit::none(std::nullopt))
                            : m.allocate(id, done))
          << "at " << done << " tokens";
      m.cache_full_blocks(id, std::span<const int32_t>(prompt).first(done));
      m.check_invariants();
    }
    ASSERT_TRUE(m.allocate(id, 60));
    m.cache_full_blocks(id, prompt);
    EXPECT_EQ(m.block_table(id).size(), 15u);
    EXPECT_EQ(m.num_free_blocks(), 5);
    m.free(id);
  }
  // The whole prompt is found: its 14 full blocks before the last token, less the block an MTP
  // hit recomputes (before, the scorers cached nothing, and their allocations evicted all but
  // a0..a4 of a's blocks: 16 tokens).
  EXPECT_EQ(m.find_cached_prefix(prompt).num_tokens, 52);
  m.check_invariants();
}

// A sequence that scores its prompt computes the blocks already cached too; where nobody holds
// the cached block, its own copy takes over that block's cache entry, so the blocks it computes
// after the cached prefix are cached as well (before, it cached none of them: the next identical
// request found 16 of the 40 tokens), and registering takes no free block.
TEST(KvCacheManagerTest, AScoringSequenceOverACachedPrefixCachesTheBlocksAfterIt) {
  KvCacheManager m(32, 4, true, with_events());
  const auto system = iota_tokens(1000, 16);
  admit_and_compute(m, "a", concat(system, {1}));
  m.free("a");
  m.take_events();
  const auto prompt = concat(system, iota_tokens(2000, 24));
  ASSERT_TRUE(m.allocate("scorer", 40, PrefixHit::none(std::nullopt)));
  const int64_t free_before = m.num_free_blocks();
  m.cache_full_blocks("scorer", prompt);
  EXPECT_EQ(m.num_free_blocks(), free_before);
  m.check_invariants();
  // Each hash is in the cache once; the events announce only the six new ones.
  EXPECT_EQ(m.num_cached_blocks(), 10);
  const auto events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  const auto hashes = api::block_hashes(prompt, 4);
  EXPECT_EQ(std::get<BlockStored>(events[0]).block_hashes,
            std::vector<uint64_t>(hashes.begin() + 4, hashes.end()));
  m.free("scorer");
  EXPECT_EQ(m.find_cached_prefix(concat(prompt, {7})).num_tokens, 40);
  m.check_invariants();
}

// With MTP drafts a hit recomputes its last block privately. When nobody else holds the cached
// block, registering the recomputed one takes no free block (its copy takes over the cache entry
// and the old block is free, holding nothing): with 7 blocks, a 21-token request over a cached
// 20-token prompt has one block left to grow into. Before, it held the cached block beside its
// copy, took that last free block the scheduler had not counted, and was refused the next.
TEST(KvCacheManagerTest, WithMtpRegisteringTheRecomputedBlockTakesNoFreeBlock) {
  KvCacheManager m(7, 4, true, with_mtp(with_events(), true));
  const auto prompt = iota_tokens(100, 20);
  admit_and_compute(m, "a", prompt);
  const int32_t a4 = m.block_table("a")[4];
  m.free("a");
  m.take_events();
  const auto longer = concat(prompt, {7});
  const PrefixHit hit = m.find_cached_prefix(longer);
  ASSERT_EQ(hit.num_tokens, 16);
  ASSERT_TRUE(m.allocate("b", 21, hit));
  ASSERT_EQ(m.num_free_blocks(), 1);  // a4, cached
  m.cache_full_blocks("b", prompt);
  EXPECT_EQ(m.num_free_blocks(), 1);
  EXPECT_EQ(m.cached_hash(m.block_table("b")[4]), api::block_hashes(prompt, 4)[4]);
  EXPECT_FALSE(m.cached_hash(a4));
  EXPECT_TRUE(m.take_events().empty());  // the same hashes are cached
  m.check_invariants();
  EXPECT_TRUE(m.allocate("b", 25));  // decoding on: the free block is there
  m.check_invariants();
  m.free("b");
  // The whole prompt is found again (less the block an MTP hit recomputes).
  EXPECT_EQ(m.find_cached_prefix(concat(prompt, iota_tokens(500, 5))).num_tokens, 16);
  EXPECT_EQ(m.find_cached_prefix(concat(prompt, iota_tokens(500, 5))).last_block_entry,
            m.find_cached_prefix(longer).last_block_entry);
  m.check_invariants();
}

// A request registering in chunks: the cached block its next blocks follow cannot be evicted
// between two chunks (before, memory pressure evicted it and the next chunk's blocks were cached
// after it, unreachable, yet counted in num_cached_blocks and announced by BlockStored).
TEST(KvCacheManagerTest, NoBlockIsCachedAfterABlockThatLeftTheCache) {
  KvCacheManager m(12, 4, true, {.enable_events = true, .recompute_last_hit_block = true});
  const auto system = iota_tokens(1000, 8);
  auto r1 = system, r2 = system;
  for (int32_t t = 0; t < 9; ++t) r1.push_back(100 + t), r2.push_back(200 + t);
  admit_and_compute(m, "r1", r1);
  m.free("r1");
  const PrefixHit hit = m.find_cached_prefix(r2);
  ASSERT_EQ(hit.num_tokens, 4);
  ASSERT_TRUE(m.allocate("r2", 17, hit));
  m.cache_full_blocks("r2", std::span<const int32_t>(r2).first(8));  // s1: a private copy
  // Memory pressure takes every free block.
  ASSERT_TRUE(m.allocate("x", m.num_free_blocks() * 4));
  m.free("x");
  m.take_events();
  m.cache_full_blocks("r2", std::span<const int32_t>(r2).first(16));
  // s0, s1, u2a, u2b are cached and found (the last left to recompute); nothing else is cached.
  EXPECT_EQ(m.num_cached_blocks(), 4);
  EXPECT_EQ(m.find_cached_prefix(r2).num_tokens, 12);
  const auto events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  const auto hashes = api::block_hashes(r2, 4);
  EXPECT_EQ(std::get<BlockStored>(events[0]).parent_block_hash, hashes[1]);
  m.free("r2");
  EXPECT_EQ(m.num_free_blocks(), 12);
  m.check_invariants();
}

TEST(KvCacheManagerTest, EvictsUncachedFirstThenLruTailFirst) {
  KvCacheManager m(6, 2, true, with_events());
  // "a" computes 3 full blocks (cached) and 1 partial block; "b" one full block.
  const auto a = iota_tokens(1, 7);
  const auto b = iota_tokens(50, 2);
  ASSERT_TRUE(m.allocate("a", 7));
  m.cache_full_blocks("a", a);
  ASSERT_TRUE(m.allocate("b", 2));
  m.cache_full_blocks("b", b);
  const auto table_a = m.block_table("a");
  const auto table_b = m.block_table("b");
  m.take_events();
  m.free("a");  // a's tail block (partial, uncached) goes to the head; cached ones to the tail
  m.free("b");
  EXPECT_EQ(m.num_cached_blocks(), 4);
  const auto hashes_a = api::block_hashes(a, 2);

  // Free queue now: [5 (never used), a3 (uncached)] then a2, a1, a0, b0 in LRU order. The exact
  // head order of uncached blocks is not specified; what matters is they go before cached ones.
  ASSERT_TRUE(m.allocate("x", 4));  // 2 blocks: both uncached, no eviction
  EXPECT_TRUE(m.take_events().empty());
  EXPECT_EQ(m.num_cached_blocks(), 4);
  std::set<int32_t> x(m.block_table("x").begin(), m.block_table("x").end());
  EXPECT_TRUE(x.count(table_a[3]));

  ASSERT_TRUE(m.allocate("y", 4));  // 2 more: evicts a2 then a1 (a's tail before its head)
  EXPECT_EQ(m.block_table("y"), (std::vector<int32_t>{table_a[2], table_a[1]}));
  auto events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(std::get<BlockRemoved>(events[0]).block_hashes,
            (std::vector<uint64_t>{hashes_a[2], hashes_a[1]}));
  EXPECT_EQ(m.prefix_cache_stats().evicted_blocks, 2);

  // a0 is still findable (and b0): a hit takes a0 out of the free queue, so the next allocation
  // evicts b0 instead.
  PrefixHit hit = m.find_cached_prefix(a);
  ASSERT_EQ(hit.blocks, std::vector<int32_t>{table_a[0]});
  ASSERT_TRUE(m.allocate("z", 2, hit));
  EXPECT_EQ(m.ref_count(table_a[0]), 1);
  ASSERT_TRUE(m.allocate("w", 2));
  EXPECT_EQ(m.block_table("w"), std::vector<int32_t>{table_b[0]});
  events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(std::get<BlockRemoved>(events[0]).block_hashes, api::block_hashes(b, 2));
  EXPECT_EQ(m.num_free_blocks(), 0);
  m.check_invariants();
}

TEST(KvCacheManagerTest, ConcurrentDuplicateIsCachedOnce) {
  KvCacheManager m(8, 2, true, with_events());
  const auto t = iota_tokens(1, 5);
  ASSERT_TRUE(m.allocate("a", 5));
  ASSERT_TRUE(m.allocate("b", 5));  // same prompt, scheduled before "a" registered anything
  m.cache_full_blocks("a", t);
  m.cache_full_blocks("b", t);
  const auto events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(std::get<BlockStored>(events[0]).block_hashes, api::block_hashes(t, 2));
  EXPECT_EQ(m.num_cached_blocks(), 2);
  for (const int32_t b : m.block_table("b")) EXPECT_FALSE(m.cached_hash(b));
  // b's private copies go back to the head of the free queue and are reused first.
  const auto table_b = m.block_table("b");
  m.free("b");
  ASSERT_TRUE(m.allocate("c", 6));
  std::set<int32_t> c(m.block_table("c").begin(), m.block_table("c").end());
  for (const int32_t b : table_b) EXPECT_TRUE(c.count(b));
  EXPECT_EQ(m.num_cached_blocks(), 2);
  m.check_invariants();
}

TEST(KvCacheManagerTest, ResetSaltDisabledAndMisuse) {
  KvCacheManager m(8, 2, true, with_events());
  const auto t = iota_tokens(1, 5);
  admit_and_compute(m, "a", t);
  m.take_events();
  // A salt isolates: the same tokens with a salt find nothing, and vice versa.
  EXPECT_EQ(m.find_cached_prefix(t, 9).num_tokens, 0);
  PrefixHit salted = m.find_cached_prefix(t, 9);
  ASSERT_TRUE(m.allocate("s", 5, salted));
  m.cache_full_blocks("s", t);
  auto events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(std::get<BlockStored>(events[0]).block_hashes, api::block_hashes(t, 2, 9));
  EXPECT_EQ(m.find_cached_prefix(t, 9).num_tokens, 4);
  EXPECT_EQ(m.find_cached_prefix(t, 8).num_tokens, 0);

  // A hit goes stale when the cache changes under it.
  const PrefixHit hit = m.find_cached_prefix(t);
  ASSERT_EQ(hit.num_tokens, 4);
  EXPECT_THROW(m.allocate("a", 5, hit), Error);  // "a" already has its blocks
  m.reset_prefix_cache();
  EXPECT_THROW(m.allocate("b", 5, hit), Error);
  EXPECT_FALSE(m.has_request("b"));
  events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<AllBlocksCleared>(events[0]));
  EXPECT_EQ(m.num_cached_blocks(), 0);
  EXPECT_EQ(m.find_cached_prefix(t).num_tokens, 0);
  m.check_invariants();

  EXPECT_THROW(m.allocate("a", -1), Error);
  EXPECT_THROW(m.cache_full_blocks("a", iota_tokens(1, 7)), Error);  // more than its blocks
  EXPECT_THROW(m.cache_full_blocks("nobody", t), Error);
  EXPECT_THROW(KvCacheManager(0, 4, true), Error);
  EXPECT_THROW(KvCacheManager(4, 0, true), Error);

  KvCacheManager off(8, 2, false, with_events());
  admit_and_compute(off, "a", t);
  off.free("a");
  EXPECT_EQ(off.find_cached_prefix(t).num_tokens, 0);
  EXPECT_EQ(off.num_cached_blocks(), 0);
  EXPECT_TRUE(off.take_events().empty());
  EXPECT_EQ(off.prefix_cache_stats().queries, 0);

  KvCacheManager quiet(8, 2, true);  // events off
  admit_and_compute(quiet, "a", t);
  EXPECT_EQ(quiet.num_cached_blocks(), 2);
  EXPECT_TRUE(quiet.take_events().empty());
}

// ---- forged hash collisions: a hit is the tokens a block holds, never its hash alone ----

// Block hashes as weak as a hostile client could wish: every sequence's first block hashes to 7
// whatever its tokens and salt; later blocks chain from that with the real function.
uint64_t first_blocks_collide(std::optional<uint64_t> parent, std::span<const int32_t> tokens,
                              std::optional<uint64_t>) {
  return parent ? api::block_hash(parent, tokens) : 7;
}

// Every block hashes to 7.
uint64_t all_blocks_collide(std::optional<uint64_t>, std::span<const int32_t>,
                            std::optional<uint64_t>) {
  return 7;
}

KvCacheOptions with_hash(KvCacheOptions::BlockHashFunction hash) {
  KvCacheOptions options = with_events();
  options.block_hash = hash;
  return options;
}

TEST(KvCacheManagerTest, AForgedCollisionIsAMissAndBothPrefixesStayCached) {
  KvCacheManager m(16, 4, true, with_hash(first_blocks_collide));
  const auto a = iota_tokens(1, 9);    // blocks [1..4] [5..8], then 9
  const auto b = iota_tokens(101, 9);  // first block hashes as a's does, other tokens
  admit_and_compute(m, "a", a);
  const std::vector<int32_t> a_blocks(m.block_table("a").begin(), m.block_table("a").begin() + 2);

  const PrefixHit forged = m.find_cached_prefix(b);
  EXPECT_EQ(forged.num_tokens, 0);
  EXPECT_TRUE(forged.blocks.empty());
  ASSERT_TRUE(m.allocate("b", 9, forged));
  m.cache_full_blocks("b", b);
  for (const int32_t block : m.block_table("b")) {
    EXPECT_EQ(std::count(a_blocks.begin(), a_blocks.end(), block), 0) << "b reuses a's KV";
  }
  EXPECT_EQ(m.prefix_cache_stats().hits, 0);  // the colliding lookup counts as no hit
  EXPECT_EQ(m.prefix_cache_stats().queries, 18);

  // Each prompt finds its own blocks, though their first blocks share a hash; a salt the forged
  // hash ignores finds neither.
  EXPECT_EQ(m.find_cached_prefix(a).blocks, a_blocks);
  EXPECT_EQ(m.find_cached_prefix(b).blocks,
            std::vector<int32_t>(m.block_table("b").begin(), m.block_table("b").begin() + 2));
  EXPECT_EQ(m.find_cached_prefix(a, 5).num_tokens, 0);
  EXPECT_EQ(m.num_cached_blocks(), 4);
  m.check_invariants();
}

// A block holding the right tokens is still no hit after a different block with the same hash:
// its KV was computed attending to its own predecessor's tokens.
TEST(KvCacheManagerTest, ABlockIsReusedOnlyAfterTheBlockItWasComputedAfter) {
  KvCacheManager m(16, 4, true, with_hash(first_blocks_collide));
  const auto x = iota_tokens(1, 4), y = iota_tokens(101, 4), t = iota_tokens(201, 4);
  admit_and_compute(m, "a", concat(x, {9}));             // caches x alone
  admit_and_compute(m, "v", concat(concat(y, t), {9}));  // caches y, then t after y
  const int32_t x_block = m.block_table("a")[0];
  const PrefixHit hit = m.find_cached_prefix(concat(concat(x, t), {9}));
  EXPECT_EQ(hit.blocks, std::vector<int32_t>{x_block});  // x, but not v's t (computed after y)
  EXPECT_EQ(hit.num_tokens, 4);
  EXPECT_EQ(m.find_cached_prefix(concat(concat(y, t), {9})).num_tokens, 8);
  m.check_invariants();
}

// Every block hashing alike: lookups walk them all and match tokens and predecessor; evicting one
// of them, or reusing its id for other tokens, never hands its hash's other holders' KV out; the
// events name the hash once, stored while any block holds it.
TEST(KvCacheManagerTest, CollidingBlocksSurviveEvictionAndIdReuse) {
  KvCacheManager m(4, 2, true, with_hash(all_blocks_collide));
  const std::vector<int32_t> a{1, 2, 3}, b{5, 6, 7, 8, 9};
  admit_and_compute(m, "a", a);  // one full block cached: a0
  const int32_t a0 = m.block_table("a")[0];
  m.free("a");
  EXPECT_EQ(m.find_cached_prefix(std::vector<int32_t>{3, 4, 1}).num_tokens, 0);
  admit_and_compute(m, "b", b);  // b0, b1: both hash 7 like a0
  const std::vector<int32_t> b_blocks(m.block_table("b").begin(), m.block_table("b").begin() + 2);
  EXPECT_EQ(m.num_cached_blocks(), 3);
  EXPECT_EQ(m.find_cached_prefix(a).blocks, std::vector<int32_t>{a0});
  EXPECT_EQ(m.find_cached_prefix(b).blocks, b_blocks);
  // a0's tokens, then b1's tokens: b1 was computed after b0, not a0.
  EXPECT_EQ(m.find_cached_prefix(std::vector<int32_t>{1, 2, 7, 8, 1}).blocks,
            std::vector<int32_t>{a0});
  EXPECT_EQ(m.find_cached_prefix(std::vector<int32_t>{1, 2, 1, 2, 1}).blocks,
            std::vector<int32_t>{a0});  // nor a0 after itself
  auto events = m.take_events();
  ASSERT_EQ(events.size(), 1u);  // a0 stored hash 7; b's blocks hold no new hash
  EXPECT_EQ(std::get<BlockStored>(events[0]).block_hashes, std::vector<uint64_t>{7});

  // Evict everything but one block, then reuse a0's id for other tokens with the same hash.
  m.free("b");
  ASSERT_TRUE(m.allocate("c", 6));  // 3 blocks: the partial one, then a0, then b1
  EXPECT_EQ(m.num_cached_blocks(), 1);
  EXPECT_TRUE(m.take_events().empty());  // b0 still holds hash 7
  EXPECT_EQ(m.find_cached_prefix(a).num_tokens, 0);
  EXPECT_EQ(m.find_cached_prefix(b).blocks, std::vector<int32_t>{b_blocks[0]});
  const std::vector<int32_t> c{1, 9, 9, 9, 9, 9};
  m.cache_full_blocks("c", c);
  EXPECT_EQ(m.find_cached_prefix(a).num_tokens, 0);  // whichever id a0 had, [1, 2] is gone
  EXPECT_EQ(m.find_cached_prefix(concat(c, {1})).num_tokens, 6);
  m.free("c");
  ASSERT_TRUE(m.allocate("d", 8));  // evicts all four
  events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(std::get<BlockRemoved>(events[0]).block_hashes, std::vector<uint64_t>{7});
  EXPECT_EQ(m.num_cached_blocks(), 0);
  m.check_invariants();
}

// A hit kept while the cache changes (looked up, allocated later) is refused once one of its
// blocks was evicted and its id cached again for other tokens under the same hash: as a first
// block (same hash, no predecessor), or after the hit's own first block (same hash, same
// predecessor). Before, allocate() checked only the hash and the predecessor's entry, and handed
// out the other prompt's KV as this prompt's.
TEST(KvCacheManagerTest, AStaleHitIsRefusedAfterItsBlockIsCachedAgainForOtherTokens) {
  const std::vector<int32_t> a{1, 2, 3, 4, 9};  // a0 = [1, 2], a1 = [3, 4]; all hash to 7
  {
    KvCacheManager m(2, 2, true, with_hash(all_blocks_collide));
    admit_and_compute(m, "a", std::vector<int32_t>{1, 2, 9});
    const int32_t a0 = m.block_table("a")[0];
    m.free("a");
    const PrefixHit stale = m.find_cached_prefix(std::vector<int32_t>{1, 2, 9});
    ASSERT_EQ(stale.blocks, std::vector<int32_t>{a0});
    ASSERT_TRUE(m.allocate("x", 1));                        // takes the uncached block
    admit_and_compute(m, "b", std::vector<int32_t>{5, 6});  // evicts a0, caches [5, 6] in its id
    ASSERT_EQ(m.block_table("b")[0], a0);
    m.free("b");
    m.free("x");  // room for the late request: only staleness can refuse it
    EXPECT_THROW(m.allocate("late", 3, stale), Error);
    EXPECT_FALSE(m.has_request("late"));
    m.check_invariants();
  }
  {
    KvCacheManager m(3, 2, true, with_hash(all_blocks_collide));
    admit_and_compute(m, "a", a);
    const int32_t a0 = m.block_table("a")[0], a1 = m.block_table("a")[1];
    m.free("a");
    const PrefixHit stale = m.find_cached_prefix(a);
    ASSERT_EQ(stale.blocks, (std::vector<int32_t>{a0, a1}));
    ASSERT_TRUE(m.allocate("x", 1));  // takes the uncached block
    // [1, 2] hits a0; [5, 6] is computed after it into a1's id, evicting a1.
    const std::vector<int32_t> c{1, 2, 5, 6};
    const PrefixHit hit = m.find_cached_prefix(concat(c, {9}));
    ASSERT_EQ(hit.blocks, std::vector<int32_t>{a0});
    ASSERT_TRUE(m.allocate("c", 4, hit));
    ASSERT_EQ(m.block_table("c")[1], a1);
    m.cache_full_blocks("c", c);
    m.free("c");
    m.free("x");
    EXPECT_THROW(m.allocate("late", 5, stale), Error);
    EXPECT_FALSE(m.has_request("late"));
    EXPECT_EQ(m.find_cached_prefix(a).blocks, std::vector<int32_t>{a0});  // looked up anew
    m.check_invariants();
  }
}

// ---- randomized property test ----

struct ModelRequest {
  std::vector<int32_t> tokens;  // prompt, then generated tokens
  int64_t prompt_len = 0;
  int64_t computed = 0;   // tokens whose KV is written
  int64_t scheduled = 0;  // tokens allocated beyond `computed`, computed at the next step
  std::optional<uint64_t> salt;
  size_t registered = 0;               // leading full blocks offered to the cache
  bool lost_its_prefix = false;        // a reset came after it registered blocks
  std::vector<int32_t> cached_copies;  // the cached blocks its private copies stand for
};

// Hashes of a sequence's full blocks with `hash` (api::block_hashes with another function).
std::vector<uint64_t> hashes_with(KvCacheOptions::BlockHashFunction hash,
                                  std::span<const int32_t> tokens, int64_t bs,
                                  std::optional<uint64_t> salt) {
  std::vector<uint64_t> out;
  for (size_t i = 0; i + static_cast<size_t>(bs) <= tokens.size(); i += static_cast<size_t>(bs)) {
    const auto block = tokens.subspan(i, static_cast<size_t>(bs));
    out.push_back(out.empty() ? hash(std::nullopt, block, salt) : hash(out.back(), block, {}));
  }
  return out;
}

// The real hash cut to 3 bits: most blocks collide with others.
uint64_t three_bit_hash(std::optional<uint64_t> parent, std::span<const int32_t> tokens,
                        std::optional<uint64_t> salt) {
  return api::block_hash(parent, tokens, parent ? std::nullopt : salt) & 7;
}

// A crafted collision cannot make a hash's blocks a long list for lookups and evictions to walk:
// a hash holds 4 cached blocks at most; a 5th block with it stays private (and what its request
// computes after it too), and is a miss.
TEST(KvCacheManagerTest, AHashHoldsAtMostFourCachedBlocks) {
  KvCacheManager m(32, 2, true, with_hash(all_blocks_collide));
  for (int32_t p = 0; p < 6; ++p) {
    const std::vector<int32_t> prompt{10 * p, 10 * p + 1, 10 * p + 2, 10 * p + 3, 10 * p + 4};
    admit_and_compute(m, "p" + std::to_string(p), prompt);
    m.free("p" + std::to_string(p));
    m.check_invariants();
  }
  EXPECT_EQ(m.num_cached_blocks(), 4);
  EXPECT_EQ(m.find_cached_prefix(std::vector<int32_t>{0, 1, 2, 3, 4}).num_tokens, 4);
  EXPECT_EQ(m.find_cached_prefix(std::vector<int32_t>{50, 51, 52, 53, 54}).num_tokens, 0);
}

// The cached blocks one hash may hold (KvCacheManager's bound on crafted collisions).
constexpr int64_t kMaxBlocksPerHash = 4;

class PropertyRun {
 public:
  // With another `hash` than api::block_hash the cache is checked against what its blocks hold
  // (the real hash of their prefix), not against their hashes.
  // With `mtp`, recompute_last_hit_block is on.
  PropertyRun(int64_t num_blocks, int64_t block_size, uint64_t seed,
              KvCacheOptions::BlockHashFunction hash = &api::block_hash, bool mtp = false)
      : m_(num_blocks, block_size, true, with_mtp(with_hash(hash), mtp)),
        hash_(hash),
        mtp_(mtp),
        bs_(block_size),
        rng_(seed) {
    // A few shared prefixes make hits, duplicates and evictions common.
    for (int p = 0; p < 4; ++p) {
      std::vector<int32_t> base(static_cast<size_t>(block_size) * 6);
      for (auto& t : base) t = static_cast<int32_t>(rng_() % 50);
      bases_.push_back(base);
    }
  }

  void run(int steps) {
    for (int step = 0; step < steps; ++step) {
      const int op = static_cast<int>(rng_() % 100);
      if (op < 30)
        add_request();
      else if (op < 80)
        step_request();
      else if (op < 99)
        free_request();
      else
        reset();
      check();
    }
    for (const auto& [id, r] : model_) m_.free(id);
    model_.clear();
    check();
    EXPECT_EQ(m_.num_free_blocks(), m_.num_blocks());
  }

 private:
  std::string pick() {
    auto it = model_.begin();
    std::advance(it, static_cast<long>(rng_() % model_.size()));
    return it->first;
  }

  // How many of the model's requests hold `b` (in their tables or as a cached copy).
  int64_t holders(int32_t b) const {
    int64_t n = 0;
    for (const auto& [id, r] : model_) {
      n += std::ranges::count(m_.block_table(id), b);
      n += std::ranges::count(r.cached_copies, b);
    }
    return n;
  }

  void add_request() {
    ModelRequest r;
    const auto& base = bases_[rng_() % bases_.size()];
    const size_t shared = rng_() % (base.size() + 1);
    r.tokens.assign(base.begin(), base.begin() + static_cast<long>(shared));
    const size_t extra = 1 + rng_() % static_cast<size_t>(3 * bs_);
    for (size_t i = 0; i < extra; ++i) r.tokens.push_back(static_cast<int32_t>(rng_() % 50));
    if (rng_() % 8 == 0) r.salt = rng_() % 2;
    r.prompt_len = static_cast<int64_t>(r.tokens.size());

    const PrefixHit hit = m_.find_cached_prefix(r.tokens, r.salt);
    // The hit is a run of cached blocks holding exactly this prefix, maximal, never everything.
    const auto expected = api::block_hashes(r.tokens, bs_, r.salt);
    const auto expected_keys = hashes_with(hash_, r.tokens, bs_, r.salt);
    EXPECT_LT(hit.num_tokens, r.prompt_len);
    EXPECT_EQ(hit.num_tokens, static_cast<int64_t>(hit.blocks.size()) * bs_);
    for (size_t i = 0; i < hit.blocks.size(); ++i) {
      EXPECT_EQ(m_.cached_hash(hit.blocks[i]), expected_keys[i]);
      const auto c = content_.find(hit.blocks[i]);
      EXPECT_TRUE(c != content_.end() && c->second == expected[i])
          << "hit block holds other tokens";
    }
    // Maximal: the hit stops where no cached block holds the next prefix (with MTP, the one
    // after: the block it stops at, if cached, is left to recompute).
    const size_t limit = static_cast<size_t>((r.prompt_len - 1) / bs_);
    const size_t next = hit.blocks.size() + (mtp_ ? 1 : 0);
    if (next < limit) {
      const int32_t b = cached_block_holding(expected[next]);
      EXPECT_LT(b, 0) << "the hit stops before cached block " << b;
    }
    if (mtp_ && !hit.blocks.empty()) {
      EXPECT_GE(cached_block_holding(expected[hit.blocks.size()]), 0)
          << "an MTP hit left a block to recompute that is not cached";
    }

    const int64_t chunk =
        1 + static_cast<int64_t>(rng_() % static_cast<uint64_t>(r.prompt_len - hit.num_tokens));
    const std::string id = "r" + std::to_string(next_id_++);
    const int64_t free_before = m_.num_free_blocks();
    if (!m_.allocate(id, hit.num_tokens + chunk, hit)) {
      EXPECT_FALSE(m_.has_request(id));
      EXPECT_EQ(m_.num_free_blocks(), free_before);
      return;
    }
    ++requests_;
    queries_ += r.prompt_len;
    hits_ += hit.num_tokens;
    r.computed = hit.num_tokens;
    r.scheduled = chunk;
    r.registered = hit.blocks.size();
    const auto& table = m_.block_table(id);
    EXPECT_EQ(static_cast<int64_t>(table.size()), (hit.num_tokens + chunk + bs_ - 1) / bs_);
    EXPECT_TRUE(std::equal(hit.blocks.begin(), hit.blocks.end(), table.begin()));
    for (size_t i = hit.blocks.size(); i < table.size(); ++i) forget(table[i]);
    model_.emplace(id, std::move(r));
  }

  // One engine step for one request: compute what was scheduled, register, schedule more.
  void step_request() {
    if (model_.empty()) return;
    const std::string id = pick();
    ModelRequest& r = model_.at(id);
    r.computed += r.scheduled;
    r.scheduled = 0;
    const std::span<const int32_t> done(r.tokens.data(), static_cast<size_t>(r.computed));
    const int64_t free_before = m_.num_free_blocks();
    m_.cache_full_blocks(id, done);
    EXPECT_EQ(m_.num_free_blocks(), free_before) << "registering took a free block";
    // Model of what the blocks now hold.
    const auto hashes = api::block_hashes(done, bs_, r.salt);
    const auto keys = hashes_with(hash_, done, bs_, r.salt);
    const auto& table = m_.block_table(id);
    for (size_t i = 0; i < hashes.size(); ++i) {
      content_[table[i]] = hashes[i];
      key_[hashes[i]] = keys[i];
    }
    // A newly registered block is cached (a copy nobody held gave it its entry), or left private
    // because another request holds the cached copy, which this one now holds too (costing no
    // free block); or (colliding hashes only) its hash holds as many blocks as it may, and the
    // request caches nothing more. Registering takes no free block.
    for (size_t i = r.registered; i < hashes.size() && !r.lost_its_prefix; ++i) {
      if (m_.cached_hash(table[i])) continue;
      const int32_t copy = cached_block_holding(hashes[i]);
      if (copy >= 0) {
        EXPECT_GT(holders(copy), 0)
            << "block " << table[i] << " is private beside " << copy << ", which nobody held";
        r.cached_copies.push_back(copy);
      } else {
        EXPECT_NE(hash_, &api::block_hash) << "block " << table[i] << " is private, uncopied";
        EXPECT_EQ(blocks_with_hash(keys[i]), kMaxBlocksPerHash)
            << "block " << table[i] << " stayed private though its hash had room";
        r.lost_its_prefix = true;
      }
    }
    r.registered = std::max(r.registered, hashes.size());

    if (r.computed == static_cast<int64_t>(r.tokens.size())) {
      r.tokens.push_back(static_cast<int32_t>(rng_() % 50));  // decode: one sampled token
    }
    const int64_t remaining = static_cast<int64_t>(r.tokens.size()) - r.computed;
    const int64_t chunk = 1 + static_cast<int64_t>(rng_() % static_cast<uint64_t>(remaining));
    const size_t old_size = table.size();
    if (m_.allocate(id, r.computed + chunk)) {
      r.scheduled = chunk;
      const auto& grown = m_.block_table(id);
      for (size_t i = old_size; i < grown.size(); ++i) forget(grown[i]);
    } else {
      EXPECT_EQ(m_.block_table(id).size(), old_size);
      m_.free(id);  // preempted, as the scheduler would when out of blocks
      model_.erase(id);
    }
  }

  // How many cached blocks have `hash` (as the manager hashes, colliding or not).
  int64_t blocks_with_hash(uint64_t hash) const {
    int64_t n = 0;
    for (int32_t b = 0; b < m_.num_blocks(); ++b) n += m_.cached_hash(b) == hash;
    return n;
  }

  void forget(int32_t block) { content_.erase(block); }  // handed out again: what it held is gone

  // The cached block holding the prefix whose real hash is `prefix`, or -1.
  int32_t cached_block_holding(uint64_t prefix) const {
    for (int32_t b = 0; b < m_.num_blocks(); ++b) {
      const auto c = content_.find(b);
      if (m_.cached_hash(b) && c != content_.end() && c->second == prefix) return b;
    }
    return -1;
  }

  void free_request() {
    if (model_.empty()) return;
    const std::string id = pick();
    m_.free(id);
    model_.erase(id);
  }

  void reset() {
    m_.reset_prefix_cache();
    for (auto& [id, r] : model_) r.lost_its_prefix = r.lost_its_prefix || r.registered > 0;
  }

  void apply_events() {
    for (const KvEvent& event : m_.take_events()) {
      if (const auto* s = std::get_if<BlockStored>(&event)) {
        ASSERT_EQ(s->token_ids.size(), s->block_hashes.size() * static_cast<size_t>(bs_));
        ASSERT_EQ(s->block_size, bs_);
        std::optional<uint64_t> parent = s->parent_block_hash;
        for (size_t i = 0; i < s->block_hashes.size(); ++i) {
          const std::span<const int32_t> block(s->token_ids.data() + i * bs_,
                                               static_cast<size_t>(bs_));
          // The first block of a salted sequence cannot be recomputed without the salt.
          if (parent) {
            EXPECT_EQ(hash_(parent, block, std::nullopt), s->block_hashes[i]);
          }
          parent = s->block_hashes[i];
          EXPECT_TRUE(replayed_.insert(s->block_hashes[i]).second) << "stored twice";
        }
      } else if (const auto* r = std::get_if<BlockRemoved>(&event)) {
        for (const uint64_t h : r->block_hashes) {
          EXPECT_EQ(replayed_.erase(h), 1u) << "removed a hash that was not stored";
        }
      } else {
        replayed_.clear();
      }
    }
  }

  void check() {
    ASSERT_NO_THROW(m_.check_invariants());
    apply_events();
    // Reference counts and free count from the block tables alone.
    std::unordered_map<int32_t, int32_t> refs;
    for (const auto& [id, r] : model_) {
      const auto& table = m_.block_table(id);
      EXPECT_EQ(static_cast<int64_t>(table.size()), (r.computed + r.scheduled + bs_ - 1) / bs_);
      std::unordered_set<int32_t> distinct(table.begin(), table.end());
      EXPECT_EQ(distinct.size(), table.size());
      for (const int32_t b : table) ++refs[b];
      for (const int32_t b : r.cached_copies) ++refs[b];
    }
    // A hash may be in several blocks whose hashes collide; a prefix is in one at most.
    std::unordered_set<uint64_t> prefixes;
    std::unordered_map<uint64_t, int64_t> cached;  // hash -> its cached blocks
    int64_t num_cached = 0;
    for (int32_t b = 0; b < m_.num_blocks(); ++b) {
      const auto it = refs.find(b);
      EXPECT_EQ(m_.ref_count(b), it == refs.end() ? 0 : it->second) << "block " << b;
      if (const auto h = m_.cached_hash(b)) {
        ++cached[*h];
        ++num_cached;
        const auto c = content_.find(b);
        ASSERT_TRUE(c != content_.end()) << "cached block " << b << " holds nothing known";
        EXPECT_EQ(key_.at(c->second), *h) << "cached block " << b << " holds other tokens";
        EXPECT_TRUE(prefixes.insert(c->second).second)
            << "a second cached block holds " << b << "'s prefix";
      }
    }
    EXPECT_EQ(m_.num_free_blocks() + static_cast<int64_t>(refs.size()), m_.num_blocks());
    std::unordered_set<uint64_t> hashes;
    for (const auto& [h, n] : cached) {
      hashes.insert(h);
      EXPECT_LE(n, kMaxBlocksPerHash) << "hash " << h << " holds " << n << " cached blocks";
    }
    EXPECT_EQ(hashes, replayed_) << "events replayed differ from the cache";
    EXPECT_EQ(m_.num_cached_blocks(), num_cached);
    EXPECT_EQ(m_.prefix_cache_stats().requests, requests_);
    EXPECT_EQ(m_.prefix_cache_stats().queries, queries_);
    EXPECT_EQ(m_.prefix_cache_stats().hits, hits_);
    EXPECT_GE(m_.usage(), 0.0);
    EXPECT_LE(m_.usage(), 1.0);
  }

  KvCacheManager m_;
  KvCacheOptions::BlockHashFunction hash_;
  bool mtp_;
  int64_t bs_;
  std::mt19937_64 rng_;
  std::vector<std::vector<int32_t>> bases_;
  std::map<std::string, ModelRequest> model_;
  std::unordered_map<int32_t, uint64_t> content_;  // block -> real hash of the prefix it holds
  std::unordered_map<uint64_t, uint64_t> key_;     // real hash of a prefix -> hash_'s
  std::unordered_set<uint64_t> replayed_;          // cache contents rebuilt from events
  int next_id_ = 0;
  int64_t requests_ = 0, queries_ = 0, hits_ = 0;
};

TEST(KvCacheManagerTest, RandomizedOperationsKeepInvariants) {
  for (const auto& [blocks, bs, seed] : std::vector<std::tuple<int64_t, int64_t, uint64_t>>{
           {24, 2, 1}, {40, 4, 2}, {64, 3, 3}, {16, 1, 4}, {48, 16, 5}}) {
    SCOPED_TRACE("blocks " + std::to_string(blocks) + " block_size " + std::to_string(bs));
    PropertyRun run(blocks, bs, seed);
    run.run(3000);
    if (::testing::Test::HasFailure()) break;
  }
}

// The same with a hash that collides all the time: every hit still holds exactly its prefix.
TEST(KvCacheManagerTest, RandomizedOperationsWithCollidingHashesHitOnlyTheirOwnTokens) {
  for (const auto& [blocks, bs, seed] : std::vector<std::tuple<int64_t, int64_t, uint64_t>>{
           {24, 2, 11}, {40, 4, 12}, {64, 3, 13}, {16, 1, 14}, {48, 16, 15}}) {
    SCOPED_TRACE("blocks " + std::to_string(blocks) + " block_size " + std::to_string(bs));
    PropertyRun run(blocks, bs, seed, three_bit_hash);
    run.run(3000);
    if (::testing::Test::HasFailure()) break;
  }
}

// The same with MTP drafts, whose every hit leaves a private copy of its last block: the blocks
// a request caches after such a copy are hit as long as they are cached.
TEST(KvCacheManagerTest, RandomizedOperationsWithMtpDraftsHitEveryCachedPrefix) {
  for (const auto& [blocks, bs, seed] : std::vector<std::tuple<int64_t, int64_t, uint64_t>>{
           {24, 2, 21}, {40, 4, 22}, {64, 3, 23}, {16, 1, 24}, {48, 16, 25}}) {
    for (const bool colliding : {false, true}) {
      SCOPED_TRACE("blocks " + std::to_string(blocks) + " block_size " + std::to_string(bs) +
                   (colliding ? " colliding" : ""));
      PropertyRun run(blocks, bs, seed, colliding ? three_bit_hash : &api::block_hash, true);
      run.run(3000);
      if (::testing::Test::HasFailure()) return;
    }
  }
}

}  // namespace
}  // namespace tandem::engine
