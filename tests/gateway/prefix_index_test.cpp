// The gateway's prefix index (gateway/prefix_index.h) and its KV-event consumers
// (gateway/kv_events_consumer.h): match depths, removal through engine hashes, media, clears,
// the eviction bound and several engines; vLLM's msgpack batches in the array_like and the map
// encodings; consumers against a scripted publisher (skipped seqs filled from replay, lost ones
// and publisher restarts clearing the engine) and against a real `tandem engine`.
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#ifndef MSGPACK_NO_BOOST
#define MSGPACK_NO_BOOST
#endif
#include <msgpack.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "api/block_hash.h"
#include "engine/engine_http.h"
#include "engine/engine_process.h"
#include "engine/kv/kv_events.h"
#include "gateway/gateway.h"
#include "gateway/kv_events_consumer.h"
#include "gateway/prefix_index.h"
#include "gateway/scripted_kv_publisher.h"
#include "text/oracle_support.h"
#include "util/error.h"
#include "util/hash.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;
using testing::ScriptedPublisher;

std::vector<int32_t> seq_tokens(int32_t first, size_t n) {
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = first + static_cast<int32_t>(i);
  return t;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<int32_t> slice(const std::vector<int32_t>& v, size_t from, size_t n) {
  return std::vector<int32_t>(v.begin() + static_cast<std::ptrdiff_t>(from),
                              v.begin() + static_cast<std::ptrdiff_t>(from + n));
}

// ---- the index ----

TEST(PrefixIndex, DepthFollowsTheChain) {
  PrefixIndex index;
  index.set_block_size(1, 4);
  const auto a = seq_tokens(100, 12);  // three blocks
  // Engine hashes unrelated to ours, as a vLLM engine's are.
  ASSERT_TRUE(index.add_blocks(1, std::vector<uint64_t>{901, 902, 903}, a, std::nullopt));
  EXPECT_EQ(index.num_blocks(1), 3);
  EXPECT_TRUE(index.holds(1, api::block_hashes(a, 4)[2]));
  EXPECT_FALSE(index.holds(2, api::block_hashes(a, 4)[2]));

  EXPECT_EQ(index.match_depth(1, a), 3);
  EXPECT_EQ(index.match_depth(1, concat(a, {1, 2, 3})), 3);  // a partial block never counts
  EXPECT_EQ(index.match_depth(1, concat(slice(a, 0, 8), seq_tokens(500, 4))), 2);
  EXPECT_EQ(index.match_depth(1, slice(a, 0, 7)), 1);
  EXPECT_EQ(index.match_depth(1, slice(a, 0, 3)), 0);
  EXPECT_TRUE(index.match(seq_tokens(7, 12)).empty());
  // Same tokens after another first block: different chain, no match.
  EXPECT_EQ(index.match_depth(1, concat(seq_tokens(0, 4), a)), 0);

  const auto m = index.match(a);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0].engine, 1);
  EXPECT_EQ(m[0].blocks, 3);
  EXPECT_EQ(m[0].tokens, 12);

  // A run that extends the chain names its parent by the engine's hash.
  const auto more = seq_tokens(300, 8);
  ASSERT_TRUE(index.add_blocks(1, std::vector<uint64_t>{904, 905}, more, 903));
  EXPECT_EQ(index.match_depth(1, concat(a, more)), 5);

  // An unknown parent: the run is unreachable for any prompt, so it is not stored.
  EXPECT_FALSE(index.add_blocks(1, std::vector<uint64_t>{906}, seq_tokens(0, 4), 12345));
  EXPECT_EQ(index.stats().orphan_stores, 1);
  // Tokens that do not fill the blocks: refused.
  EXPECT_FALSE(index.add_blocks(1, std::vector<uint64_t>{907}, seq_tokens(0, 5), std::nullopt));
  EXPECT_EQ(index.num_blocks(1), 5);
}

TEST(PrefixIndex, RemovalByEngineHashAndClear) {
  PrefixIndex index;
  index.set_block_size(1, 4);
  index.set_block_size(2, 4);
  const auto a = seq_tokens(100, 12);
  ASSERT_TRUE(index.add_blocks(1, std::vector<uint64_t>{11, 12, 13}, a, std::nullopt));
  ASSERT_TRUE(index.add_blocks(2, std::vector<uint64_t>{21, 22, 23}, a, std::nullopt));

  index.remove_blocks(1, std::vector<uint64_t>{12});  // the middle block
  EXPECT_EQ(index.num_blocks(1), 2);
  EXPECT_EQ(index.match_depth(1, a), 1);  // block 3 is held, but unreachable
  EXPECT_EQ(index.match_depth(2, a), 3);  // the other engine's copy is untouched
  index.remove_blocks(1, std::vector<uint64_t>{12, 777});
  EXPECT_EQ(index.stats().unknown_removals, 2);

  index.clear(1);
  EXPECT_EQ(index.num_blocks(1), 0);
  EXPECT_EQ(index.match_depth(1, a), 0);
  EXPECT_EQ(index.match_depth(2, a), 3);
  EXPECT_EQ(index.stats().blocks, 3);
  EXPECT_EQ(index.stats().entries, 3);
  index.remove_engine(2);
  EXPECT_EQ(index.stats().blocks, 0);
  EXPECT_EQ(index.stats().entries, 0);
  EXPECT_TRUE(index.match(a).empty());
}

TEST(PrefixIndex, BlockHeldUntilRemovedFromEveryMedium) {
  PrefixIndex index;
  index.set_block_size(1, 2);
  const auto a = seq_tokens(1, 2);
  // Our hash (a Tandem engine's): a lone first block under another may be salted, and matches
  // no unsalted prompt until the engine shows how it hashes (PrefixIndex.SaltedStoresMatchOnly...).
  const uint64_t h = api::block_hash(std::nullopt, a);
  ASSERT_TRUE(index.add_blocks(1, std::vector<uint64_t>{h}, a, std::nullopt, "GPU"));
  ASSERT_TRUE(index.add_blocks(1, std::vector<uint64_t>{h}, a, std::nullopt, "CPU"));
  ASSERT_TRUE(index.add_blocks(1, std::vector<uint64_t>{h}, a, std::nullopt, "GPU"));  // again
  EXPECT_EQ(index.num_blocks(1), 1);
  index.remove_blocks(1, std::vector<uint64_t>{h}, "GPU");
  EXPECT_EQ(index.match_depth(1, a), 1);  // still offloaded on CPU
  index.remove_blocks(1, std::vector<uint64_t>{h}, "CPU");
  EXPECT_EQ(index.match_depth(1, a), 0);
  EXPECT_EQ(index.stats().blocks, 0);
}

TEST(PrefixIndex, EnginesWithDifferentBlockSizes) {
  PrefixIndex index;
  index.set_block_size(1, 4);
  index.set_block_size(2, 4);
  index.set_block_size(3, 2);
  const auto a = seq_tokens(100, 12);
  ASSERT_TRUE(index.add_blocks(1, std::vector<uint64_t>{1, 2, 3}, a, std::nullopt));
  ASSERT_TRUE(index.add_blocks(2, std::vector<uint64_t>{1, 2}, slice(a, 0, 8), std::nullopt));
  ASSERT_TRUE(index.add_blocks(3, std::vector<uint64_t>{1, 2, 3}, slice(a, 0, 6), std::nullopt));
  const auto m = index.match(concat(a, seq_tokens(900, 5)));
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m[0].engine, 1);
  EXPECT_EQ(m[0].blocks, 3);
  EXPECT_EQ(m[0].tokens, 12);
  EXPECT_EQ(m[1].engine, 2);
  EXPECT_EQ(m[1].blocks, 2);
  EXPECT_EQ(m[1].tokens, 8);
  EXPECT_EQ(m[2].engine, 3);
  EXPECT_EQ(m[2].blocks, 3);
  EXPECT_EQ(m[2].tokens, 6);
  // Two engines share the first blocks' nodes: 3 distinct blocks of size 4, 3 of size 2.
  EXPECT_EQ(index.stats().blocks, 6);

  // A new block size drops what the engine held (its blocks would hash differently).
  index.set_block_size(1, 8);
  EXPECT_EQ(index.num_blocks(1), 0);
  EXPECT_EQ(index.match_depth(2, a), 2);
  EXPECT_THROW(index.set_block_size(1, 0), Error);
  EXPECT_THROW(PrefixIndex(0), Error);
}

// vLLM's cache_salt. A Tandem engine folds the salt into a sequence's first block hash and
// publishes its stores with those hashes but without the salt; the index must key them as a
// request with that salt hashes its prompt, not as the unsalted prefix of their tokens (which
// would steer unsalted requests, and requests with any salt, to blocks the engine keeps apart).
TEST(PrefixIndex, SaltedStoresMatchOnlyTheirSalt) {
  PrefixIndex index;
  for (const EngineKey e : {1, 2, 3, 4, 5}) index.set_block_size(e, 4);
  const auto a = seq_tokens(100, 12);
  const uint64_t salt = hash_bytes("tenant-a"), other = hash_bytes("tenant-b");
  // Engine 1 stores the prompt unsalted, engine 2 under the salt: each as a Tandem engine names
  // its blocks (api/block_hash.h, the salt in the first block).
  ASSERT_TRUE(index.add_blocks(1, api::block_hashes(a, 4), a, std::nullopt));
  ASSERT_TRUE(index.add_blocks(2, api::block_hashes(a, 4, salt), a, std::nullopt));
  EXPECT_EQ(index.match_depth(1, a), 3);
  EXPECT_EQ(index.match_depth(2, a), 0);  // without the fix: 3
  EXPECT_EQ(index.match_depth(2, a, salt), 3);
  EXPECT_EQ(index.match_depth(1, a, salt), 0);
  EXPECT_TRUE(index.match(a, other).empty());
  EXPECT_EQ(index.stats().blocks, 6);  // the same tokens, two prefixes

  // A salted run extending the salted chain (the engine names its parent): deeper with the salt.
  const auto more = seq_tokens(300, 4);
  const auto longer = concat(a, more);
  const auto longer_hashes = api::block_hashes(longer, 4, salt);
  ASSERT_TRUE(index.add_blocks(2, std::vector<uint64_t>{longer_hashes[3]}, more, longer_hashes[2]));
  EXPECT_EQ(index.match_depth(2, longer, salt), 4);
  EXPECT_EQ(index.match_depth(2, longer), 0);
  // And its removal goes through the engine's hash as any other.
  index.remove_blocks(2, std::vector<uint64_t>{longer_hashes[0]});
  EXPECT_EQ(index.match_depth(2, longer, salt), 0);

  // A lone salted first block tells nothing of how a new engine hashes (vLLM's hashes do not
  // look like ours either): keyed as the engine named it, it matches its salt alone.
  const auto first = slice(a, 0, 4);
  const uint64_t salted_first = api::block_hash(std::nullopt, first, salt);
  ASSERT_TRUE(index.add_blocks(3, std::vector<uint64_t>{salted_first}, first, std::nullopt));
  EXPECT_EQ(index.match_depth(3, a, salt), 1);
  EXPECT_EQ(index.match_depth(3, a), 0);  // without the fix: 1
  EXPECT_EQ(index.match_depth(3, a, other), 0);
  // Shown to hash as we do, the engine keeps it so.
  const auto c = seq_tokens(700, 4);
  ASSERT_TRUE(index.add_blocks(3, api::block_hashes(c, 4), c, std::nullopt));
  EXPECT_EQ(index.match_depth(3, a, salt), 1);
  EXPECT_EQ(index.match_depth(3, c), 1);

  // An engine with another hash function (vLLM's) whose first store is a lone first block: keyed
  // by its hash until a store shows the function is not ours, then by its tokens (unsalted).
  ASSERT_TRUE(index.add_blocks(5, std::vector<uint64_t>{51}, first, std::nullopt));
  EXPECT_EQ(index.match_depth(5, a), 0);
  ASSERT_TRUE(index.add_blocks(5, std::vector<uint64_t>{52}, slice(a, 4, 4), 51));
  EXPECT_EQ(index.match_depth(5, a), 2);
  EXPECT_EQ(index.match_depth(5, a, salt), 0);
  index.remove_blocks(5, std::vector<uint64_t>{51});  // its hash still names it
  EXPECT_EQ(index.match_depth(5, a), 0);
  // A clear forgets how an engine hashes (a restart may bring another).
  index.clear(5);
  ASSERT_TRUE(index.add_blocks(5, std::vector<uint64_t>{salted_first}, first, std::nullopt));
  EXPECT_EQ(index.match_depth(5, a, salt), 1);
  EXPECT_EQ(index.match_depth(5, a), 0);

  // An engine with another hash function (vLLM's): keyed by the unsalted tokens, so a salted
  // request does not match them (its salted stores carry extra_keys and are never indexed).
  ASSERT_TRUE(index.add_blocks(4, std::vector<uint64_t>{41, 42, 43}, a, std::nullopt));
  EXPECT_EQ(index.match_depth(4, a), 3);
  EXPECT_EQ(index.match_depth(4, a, salt), 0);
  // Once known, its lone first blocks are indexed (unsalted) too.
  ASSERT_TRUE(index.add_blocks(4, std::vector<uint64_t>{44}, c, std::nullopt));
  EXPECT_EQ(index.match_depth(4, c), 1);
}

// A store's token count is checked against its blocks without multiplying them: 8 blocks of
// 2^61 tokens made 2^64, which wrapped to 0 and matched an empty token list, and hashing the
// first block asked for a 2^63-byte buffer (std::length_error on the KV-event thread).
TEST(PrefixIndex, AStoreWhoseBlocksWouldOverflowItsTokenCountIsRefused) {
  PrefixIndex index;
  index.set_block_size(1, int64_t{1} << 61);
  EXPECT_FALSE(index.add_blocks(1, std::vector<uint64_t>(8, 5), {}, std::nullopt));
  index.set_block_size(2, int64_t{1} << 62);
  EXPECT_FALSE(index.add_blocks(2, std::vector<uint64_t>(4, 5), {}, std::nullopt));
  EXPECT_EQ(index.num_blocks(1) + index.num_blocks(2), 0);
  EXPECT_EQ(index.stats().entries, 0);
}

TEST(PrefixIndex, EvictsLeastRecentlyUsedWithinTheBound) {
  PrefixIndex index(4);
  index.set_block_size(1, 2);
  const auto a = seq_tokens(100, 6), b = seq_tokens(200, 6), c = seq_tokens(300, 2);
  ASSERT_TRUE(index.add_blocks(1, std::vector<uint64_t>{1, 2, 3}, a, std::nullopt));
  ASSERT_TRUE(index.add_blocks(1, std::vector<uint64_t>{4, 5, 6}, b, std::nullopt));
  // Chains are inserted deepest first, so a's tail went before its first block.
  EXPECT_EQ(index.stats().blocks, 4);
  EXPECT_EQ(index.stats().evicted, 2);
  EXPECT_EQ(index.match_depth(1, a), 1);
  EXPECT_EQ(index.match_depth(1, b), 3);
  // Matching b then a made a's block the newest and b's last block the oldest.
  EXPECT_EQ(index.match_depth(1, a), 1);
  ASSERT_TRUE(index.add_blocks(1, std::vector<uint64_t>{7}, c, std::nullopt));
  EXPECT_EQ(index.stats().blocks, 4);
  EXPECT_EQ(index.match_depth(1, b), 2);
  EXPECT_EQ(index.match_depth(1, a), 1);
  EXPECT_EQ(index.match_depth(1, c), 1);
  // Evicted blocks left the engine-hash map too: removing them is a no-op.
  index.remove_blocks(1, std::vector<uint64_t>{2, 3, 6});
  EXPECT_EQ(index.stats().unknown_removals, 3);
  EXPECT_EQ(index.stats().entries, 4);
  EXPECT_EQ(index.num_blocks(1), 4);
}

// ---- decoding ----

using Packer = msgpack::packer<msgpack::sbuffer>;

void str(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

std::string_view view(const msgpack::sbuffer& b) {
  return {b.data(), b.size()};
}

TEST(KvEventDecoding, ArrayLikeAsOurEnginePublishes) {
  engine::BlockStored stored;
  stored.block_hashes = {0xFFFFFFFFFFFFFFFEULL, 7};
  stored.parent_block_hash = 42;
  stored.token_ids = {1, 2, 300, 70000};
  stored.block_size = 2;
  stored.medium = "GPU";
  const std::string payload = engine::encode_kv_event_batch(
      {1700000000.25, {stored, engine::BlockRemoved{{7}, "GPU"}, engine::AllBlocksCleared{}}, 3});
  const KvEventBatchRecord batch = decode_kv_event_payload(payload);
  EXPECT_DOUBLE_EQ(batch.ts, 1700000000.25);
  EXPECT_EQ(batch.data_parallel_rank, 3);
  ASSERT_EQ(batch.events.size(), 3u);
  const KvEventRecord& s = batch.events[0];
  EXPECT_EQ(s.kind, KvEventRecord::Kind::kBlockStored);
  EXPECT_EQ(s.block_hashes, stored.block_hashes);
  EXPECT_EQ(s.parent_block_hash, 42u);
  EXPECT_EQ(s.token_ids, stored.token_ids);
  EXPECT_EQ(s.block_size, 2);
  EXPECT_EQ(s.medium, "GPU");
  EXPECT_TRUE(s.indexable);
  EXPECT_EQ(batch.events[1].kind, KvEventRecord::Kind::kBlockRemoved);
  EXPECT_EQ(batch.events[1].block_hashes, std::vector<uint64_t>{7});
  EXPECT_EQ(batch.events[1].medium, "GPU");
  EXPECT_EQ(batch.events[2].kind, KvEventRecord::Kind::kAllBlocksCleared);

  // Without a rank the batch has two elements.
  EXPECT_FALSE(decode_kv_event_payload(engine::encode_kv_event_batch({1.0, {}, {}}))
                   .data_parallel_rank.has_value());
}

// vLLM's newer array_like events with every field it has added, plus one it may add next.
TEST(KvEventDecoding, ArrayLikeWithLaterFields) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_array(4);  // [ts, events, rank, a future field]
  pk.pack_double(2.5);
  pk.pack_array(4);
  // BlockStored: tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name,
  // extra_keys, group_idx, kv_cache_spec_kind, sliding_window, future.
  pk.pack_array(13);
  str(pk, "BlockStored");
  pk.pack_array(1);
  pk.pack_int64(-2);  // a signed hash (SGLang)
  pk.pack_nil();
  pk.pack_array(2);
  pk.pack_int32(5);
  pk.pack_int32(6);
  pk.pack_int64(2);
  pk.pack_nil();
  str(pk, "GPU");
  pk.pack_nil();
  pk.pack_array(1);
  pk.pack_nil();  // extra_keys: none for the one block
  pk.pack_int64(0);
  str(pk, "full_attention");
  pk.pack_nil();
  pk.pack_true();
  // A sliding-window group's store: decoded, not indexable.
  pk.pack_array(10);
  str(pk, "BlockStored");
  pk.pack_array(1);
  pk.pack_uint64(9);
  pk.pack_nil();
  pk.pack_array(2);
  pk.pack_int32(5);
  pk.pack_int32(6);
  pk.pack_int64(2);
  pk.pack_nil();
  str(pk, "GPU");
  pk.pack_nil();
  pk.pack_nil();
  pk.pack_int64(1);
  // A salted store (extra_keys names the cache salt): not indexable.
  pk.pack_array(9);
  str(pk, "BlockStored");
  pk.pack_array(1);
  pk.pack_uint64(10);
  pk.pack_nil();
  pk.pack_array(2);
  pk.pack_int32(5);
  pk.pack_int32(6);
  pk.pack_int64(2);
  pk.pack_nil();
  str(pk, "GPU");
  pk.pack_nil();
  pk.pack_array(1);
  pk.pack_array(1);
  str(pk, "tenant-salt");
  // BlockRemoved with group_idx and a future field.
  pk.pack_array(5);
  str(pk, "BlockRemoved");
  pk.pack_array(1);
  pk.pack_int64(-2);
  str(pk, "GPU");
  pk.pack_int64(0);
  pk.pack_nil();
  pk.pack_int64(0);
  pk.pack_str(0);  // the future field

  const KvEventBatchRecord batch = decode_kv_event_payload(view(buf));
  EXPECT_DOUBLE_EQ(batch.ts, 2.5);
  EXPECT_EQ(batch.data_parallel_rank, 0);
  ASSERT_EQ(batch.events.size(), 4u);
  EXPECT_EQ(batch.events[0].block_hashes, std::vector<uint64_t>{0xFFFFFFFFFFFFFFFEULL});
  EXPECT_EQ(batch.events[0].token_ids, (std::vector<int32_t>{5, 6}));
  EXPECT_TRUE(batch.events[0].indexable);
  EXPECT_FALSE(batch.events[1].indexable);
  EXPECT_FALSE(batch.events[2].indexable);
  EXPECT_EQ(batch.events[3].kind, KvEventRecord::Kind::kBlockRemoved);
  EXPECT_EQ(batch.events[3].block_hashes, std::vector<uint64_t>{0xFFFFFFFFFFFFFFFEULL});
  EXPECT_TRUE(batch.events[3].indexable);

  PrefixIndex index;
  EXPECT_EQ(apply_kv_event_batch(index, 1, batch), 2);  // the store and the removal
  EXPECT_EQ(index.block_size(1), 2);                    // learnt from the event
  EXPECT_EQ(index.num_blocks(1), 0);
}

// Both levels as maps (vLLM's newest encoding), with unknown keys and an unknown event type,
// and hashes as raw 32-byte digests.
TEST(KvEventDecoding, MapEncoding) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  std::string digest(32, '\0');
  for (int i = 0; i < 32; ++i) digest[i] = static_cast<char>(i);
  const uint64_t folded = 0x18191a1b1c1d1e1fULL;  // the digest's last 8 bytes, big-endian
  pk.pack_map(4);
  str(pk, "events");
  pk.pack_array(4);
  pk.pack_map(8);
  str(pk, "type");
  str(pk, "BlockStored");
  str(pk, "token_ids");
  pk.pack_array(4);
  for (int t : {1, 2, 3, 4}) pk.pack_int32(t);
  str(pk, "block_hashes");
  pk.pack_array(2);
  pk.pack_bin(32);
  pk.pack_bin_body(digest.data(), 32);
  pk.pack_uint64(77);
  str(pk, "parent_block_hash");
  pk.pack_nil();
  str(pk, "block_size");
  pk.pack_int64(2);
  str(pk, "medium");
  str(pk, "GPU");
  str(pk, "group_idx");
  pk.pack_int64(0);
  str(pk, "something_new");
  pk.pack_map(0);
  pk.pack_map(2);
  str(pk, "type");
  str(pk, "BlockPinned");  // a type from the future: skipped
  str(pk, "block_hashes");
  pk.pack_array(0);
  pk.pack_map(3);
  str(pk, "medium");
  str(pk, "GPU");
  str(pk, "type");
  str(pk, "BlockRemoved");
  str(pk, "block_hashes");
  pk.pack_array(1);
  pk.pack_uint64(77);
  pk.pack_map(1);
  str(pk, "type");
  str(pk, "AllBlocksCleared");
  str(pk, "ts");
  pk.pack_double(3.75);
  str(pk, "data_parallel_rank");
  pk.pack_int64(1);
  str(pk, "extra");
  pk.pack_nil();

  const KvEventBatchRecord batch = decode_kv_event_payload(view(buf));
  EXPECT_DOUBLE_EQ(batch.ts, 3.75);
  EXPECT_EQ(batch.data_parallel_rank, 1);
  ASSERT_EQ(batch.events.size(), 3u);
  const KvEventRecord& s = batch.events[0];
  EXPECT_EQ(s.kind, KvEventRecord::Kind::kBlockStored);
  EXPECT_EQ(s.block_hashes, (std::vector<uint64_t>{folded, 77}));
  EXPECT_FALSE(s.parent_block_hash.has_value());
  EXPECT_EQ(s.token_ids, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(s.block_size, 2);
  EXPECT_EQ(s.medium, "GPU");
  EXPECT_TRUE(s.indexable);
  EXPECT_EQ(batch.events[1].kind, KvEventRecord::Kind::kBlockRemoved);
  EXPECT_EQ(batch.events[2].kind, KvEventRecord::Kind::kAllBlocksCleared);

  // Applied one event at a time: the store is indexed under our hash of the tokens.
  PrefixIndex index;
  KvEventBatchRecord first{batch.ts, {batch.events[0]}, {}};
  EXPECT_EQ(apply_kv_event_batch(index, 4, first), 1);
  EXPECT_EQ(index.match_depth(4, std::vector<int32_t>{1, 2, 3, 4}), 2);
  KvEventBatchRecord second{batch.ts, {batch.events[1]}, {}};
  apply_kv_event_batch(index, 4, second);  // removes the second block (engine hash 77)
  EXPECT_EQ(index.match_depth(4, std::vector<int32_t>{1, 2, 3, 4}), 1);
  apply_kv_event_batch(index, 4, batch);
  EXPECT_EQ(index.num_blocks(4), 0);  // ends with AllBlocksCleared
}

// The array batch with map events (vLLM releases between the two encodings).
TEST(KvEventDecoding, ArrayBatchOfMapEvents) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_array(2);
  pk.pack_double(1.0);
  pk.pack_array(1);
  pk.pack_map(3);
  str(pk, "type");
  str(pk, "BlockRemoved");
  str(pk, "block_hashes");
  pk.pack_array(2);
  pk.pack_uint64(1);
  pk.pack_uint64(2);
  str(pk, "medium");
  pk.pack_nil();
  const KvEventBatchRecord batch = decode_kv_event_payload(view(buf));
  ASSERT_EQ(batch.events.size(), 1u);
  EXPECT_EQ(batch.events[0].block_hashes, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(batch.events[0].medium, "");
}

TEST(KvEventDecoding, MalformedPayloadsThrow) {
  const auto message = [](std::string_view payload) {
    try {
      decode_kv_event_payload(payload);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("\xc1").find("not valid msgpack"), std::string::npos);
  EXPECT_NE(message("\x05").find("array or a map"), std::string::npos);
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_array(2);
  pk.pack_double(1.0);
  pk.pack_array(1);
  pk.pack_array(2);
  str(pk, "BlockStored");
  pk.pack_nil();  // block_hashes
  EXPECT_NE(message(view(buf)).find("'block_hashes'"), std::string::npos);
  msgpack::sbuffer no_events;
  Packer pk2(no_events);
  pk2.pack_array(1);
  pk2.pack_double(1.0);
  EXPECT_NE(message(view(no_events)).find("'events'"), std::string::npos);
}

// A BlockStored's block_size bounds the tokens each of its blocks hashes: one past any engine's
// (vLLM's are 16..a few thousand) is a broken or hostile publisher's, and its batch is skipped.
// 0 and less stay placeholders: decoded, not indexed.
TEST(KvEventDecoding, ABlockSizeAbove65536IsMalformed) {
  const auto store = [](int64_t block_size) {
    engine::BlockStored s;
    s.block_hashes = std::vector<uint64_t>(8, 5);
    s.block_size = block_size;
    return engine::encode_kv_event_batch({1.0, {s}, {}});
  };
  for (const int64_t bad : {int64_t{1} << 61, int64_t{1} << 62, int64_t{65537}}) {
    try {
      decode_kv_event_payload(store(bad));
      ADD_FAILURE() << "block_size " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'block_size'"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(decode_kv_event_payload(store(65536)).events.at(0).block_size, 65536);
  PrefixIndex index;
  for (const int64_t placeholder : {int64_t{0}, int64_t{-16}})
    EXPECT_EQ(apply_kv_event_batch(index, 1, decode_kv_event_payload(store(placeholder))), 0);
}

// What decodes is applied only when its tokens fill its blocks, whatever the record says: a
// wrapped product let 4 blocks of 2^62 tokens set that block size on the engine.
TEST(KvEventDecoding, AStoreWhoseTokensDoNotFillItsBlocksIsNotApplied) {
  PrefixIndex index;
  for (const auto& [blocks, block_size] :
       {std::pair{size_t{8}, int64_t{1} << 61}, std::pair{size_t{4}, int64_t{1} << 62}}) {
    KvEventRecord e;
    e.kind = KvEventRecord::Kind::kBlockStored;
    e.block_hashes = std::vector<uint64_t>(blocks, 5);
    e.block_size = block_size;
    EXPECT_EQ(apply_kv_event_batch(index, 1, {1.0, {e}, {}}), 0);
  }
  EXPECT_EQ(index.block_size(1), kDefaultKvBlockSize);
  EXPECT_EQ(index.num_blocks(1), 0);
}

// Found by fuzz/kv_events_fuzz.cpp: msgpack allocates a container's elements when it reads its
// count, so a few bytes claiming 2^32 entries asked for 128 GB (std::bad_alloc, or the memory).
// Counts beyond the payload's size and nesting beyond any batch's are malformed msgpack now.
TEST(KvEventDecoding, ContainerCountsBeyondThePayloadThrow) {
  for (const std::string_view payload :
       {std::string_view("\xdf\xff\xff\xff\xff", 5), std::string_view("\xdd\xff\xff\xff\xff", 5),
        std::string_view("\x92\xcb\x40\x00\x00\x00\x00\x00\x00\x00\xdd\x10\x00\x00\x00\x90", 16),
        std::string_view("\xc6\xff\xff\xff\xff", 5)}) {
    try {
      decode_kv_event_payload(payload);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not valid msgpack"), std::string::npos) << e.what();
    }
  }
  const std::string deep = std::string(64, '\x91') + '\xc0';
  EXPECT_THROW(decode_kv_event_payload(deep), Error);
}

// ---- consumers against a scripted publisher ----

// One stored block of 2 tokens [t, t+1] with engine hash `h` (unrelated to ours), chained.
std::string store_payload(uint64_t h, std::optional<uint64_t> parent, int32_t t) {
  engine::BlockStored s;
  s.block_hashes = {h};
  s.parent_block_hash = parent;
  s.token_ids = {t, t + 1};
  s.block_size = 2;
  return engine::encode_kv_event_batch({1.0, {s}, {}});
}

// A Tandem engine's hash of a first block [t, t+1]. A lone first block under another hash may be
// salted and is no unsalted prompt's until the engine shows how it hashes (prefix_index.h); these
// tests clear the engine, which forgets that.
uint64_t our_first(int32_t t) {
  return api::block_hash(std::nullopt, std::vector<int32_t>{t, t + 1});
}

std::string empty_payload() {
  return engine::encode_kv_event_batch({1.0, {}, {}});
}

KvEventsConsumerOptions options_for(const ScriptedPublisher& pub, EngineKey engine) {
  KvEventsConsumerOptions o;
  o.engine = engine;
  o.endpoint = pub.endpoint();
  o.replay_endpoint = pub.replay_endpoint();
  o.topic = "kv@";
  o.replay_timeout_ms = 5000;
  return o;
}

// Publishes empty batches until one arrives live, so later skips are seen as gaps on the live
// socket rather than lost to the subscription's start-up. Returns the next seq to publish.
uint64_t publish_until_live(ScriptedPublisher& pub, KvEventsConsumer& consumer, uint64_t seq) {
  for (int i = 0; i < 2000; ++i, ++seq) {
    pub.publish(seq, empty_payload());
    if (consumer.wait_for_seq(seq, 20)) {
      const auto s = consumer.stats();
      if (s.batches > s.replayed_batches) return seq + 1;
    }
  }
  ADD_FAILURE() << "no batch arrived live";
  return seq;
}

// The chain 0..n-1 of 2-token blocks the scripted stores describe: tokens [10k, 10k+1].
std::vector<int32_t> chain_tokens(int n) {
  std::vector<int32_t> t;
  for (int k = 0; k < n; ++k) {
    t.push_back(10 * k);
    t.push_back(10 * k + 1);
  }
  return t;
}

TEST(KvEventsConsumer, SkippedBatchIsFilledFromReplay) {
  ScriptedPublisher pub;
  PrefixIndex index;
  KvEventsConsumer consumer(index, options_for(pub, 3));
  uint64_t seq = publish_until_live(pub, consumer, 0);
  const auto before = consumer.stats();

  // Engine hashes 500+k; block k = [10k, 10k+1]. Batch seq+1 never reaches the live socket.
  pub.publish(seq, store_payload(500, std::nullopt, 0));
  pub.publish(seq + 1, store_payload(501, 500, 10), /*live=*/false);
  pub.publish(seq + 2, store_payload(502, 501, 20));
  ASSERT_TRUE(consumer.wait_for_seq(seq + 2, 10000));
  const auto after = consumer.stats();
  EXPECT_EQ(after.gaps, before.gaps + 1);
  EXPECT_GE(after.replayed_batches, before.replayed_batches + 1);
  EXPECT_EQ(after.unfilled_gaps, 0);
  EXPECT_EQ(after.malformed, 0);
  EXPECT_EQ(index.match_depth(3, chain_tokens(3)), 3);
  EXPECT_EQ(index.block_size(3), 2);
}

// Engines on IPv6 hosts: the engine's publisher binds tcp://[::1]:* and the gateway's consumer
// follows it, live and from replay (ZMQ sockets are IPv4-only unless told; binding [::1] failed
// with "No such device"). Skipped where this host has no IPv6 loopback.
TEST(KvEventsConsumer, FollowsAnEngineOnAnIpv6Address) {
  {
    zmq::context_t probe_context;
    zmq::socket_t probe(probe_context, zmq::socket_type::pub);
    probe.set(zmq::sockopt::ipv6, 1);
    try {
      probe.bind("tcp://[::1]:*");
    } catch (const zmq::error_t&) {
      GTEST_SKIP() << "no IPv6 loopback on this host";
    }
  }
  engine::ZmqKvEventPublisher pub(engine::KvEventsConfig::parse(
      R"({"enable_kv_cache_events": true, "endpoint": "tcp://[::1]:*",
          "replay_endpoint": "tcp://[::1]:*", "topic": "kv@"})"));
  ASSERT_TRUE(pub.endpoint().starts_with("tcp://[::1]:")) << pub.endpoint();
  PrefixIndex index;
  KvEventsConsumerOptions o;
  o.engine = 4;
  o.endpoint = pub.endpoint();
  o.replay_endpoint = pub.replay_endpoint();
  o.topic = "kv@";
  o.replay_timeout_ms = 5000;
  KvEventsConsumer consumer(index, o);
  engine::BlockStored first;
  first.block_hashes = {our_first(0)};
  first.token_ids = {0, 1};
  first.block_size = 2;
  pub.publish({1.0, {first}, {}});
  pub.flush();
  // Batch 0 arrives live or, when the subscription came up after it, from the replay socket.
  uint64_t seq = 0;
  while (!consumer.wait_for_seq(seq, 20) && seq < 2000) {
    pub.publish({1.0, {}, {}});
    pub.flush();
    ++seq;
  }
  ASSERT_LT(seq, 2000u) << "nothing arrived over IPv6";
  EXPECT_EQ(index.match_depth(4, std::vector<int32_t>{0, 1, 7}), 1);
}

// A batch past max_message_bytes is refused by ZMQ before it is buffered whole: it is never
// applied, and the consumer still stops cleanly. (ZMQ takes it as a protocol error and does not
// reconnect to that publisher: docs/gateway.md.)
TEST(KvEventsConsumer, AnOversizedBatchIsNeverApplied) {
  ScriptedPublisher pub;
  PrefixIndex index;
  KvEventsConsumerOptions options = options_for(pub, 3);
  options.max_message_bytes = 4096;
  options.replay_timeout_ms = 500;
  auto consumer = std::make_unique<KvEventsConsumer>(index, options);
  uint64_t seq = publish_until_live(pub, *consumer, 0);
  const auto before = consumer->stats();

  // 1,000 chained blocks: about 20 KB of msgpack, past the limit.
  engine::BlockStored big;
  for (int k = 0; k < 1000; ++k) {
    big.block_hashes.push_back(700 + uint64_t(k));
    big.token_ids.push_back(10 * k);
    big.token_ids.push_back(10 * k + 1);
  }
  big.block_size = 2;
  const std::string payload = engine::encode_kv_event_batch({1.0, {big}, {}});
  ASSERT_GT(payload.size(), 4096u);
  pub.publish(seq, payload);
  EXPECT_FALSE(consumer->wait_for_seq(seq, 1000));
  EXPECT_EQ(index.match_depth(3, chain_tokens(2)), 0);
  EXPECT_EQ(consumer->stats().batches, before.batches);
  consumer.reset();  // returns: the thread is not stuck on the refused message
}

// A batch that cannot be applied is counted and skipped, and the consumer goes on with the
// next: the one above (8 blocks of 2^61 tokens) ended the consumer's thread with an exception,
// which ended the gateway (std::terminate).
TEST(KvEventsConsumer, AMalformedBatchIsCountedAndTheNextOneApplied) {
  ScriptedPublisher pub;
  PrefixIndex index;
  KvEventsConsumer consumer(index, options_for(pub, 3));
  uint64_t seq = publish_until_live(pub, consumer, 0);
  const auto before = consumer.stats();

  engine::BlockStored hostile;
  hostile.block_hashes = std::vector<uint64_t>(8, 5);
  hostile.block_size = int64_t{1} << 61;
  pub.publish(seq, engine::encode_kv_event_batch({1.0, {hostile}, {}}));
  pub.publish(seq + 1, store_payload(our_first(0), std::nullopt, 0));
  ASSERT_TRUE(consumer.wait_for_seq(seq + 1, 10000));
  const auto after = consumer.stats();
  EXPECT_EQ(after.malformed, before.malformed + 1);
  EXPECT_EQ(after.batches, before.batches + 1);
  EXPECT_EQ(index.match_depth(3, chain_tokens(1)), 1);
  EXPECT_EQ(index.block_size(3), 2);
}

TEST(KvEventsConsumer, LateConsumerWarmsUpFromReplay) {
  ScriptedPublisher pub;
  for (uint64_t k = 0; k < 5; ++k) {
    pub.publish(k, store_payload(500 + k, k ? std::optional<uint64_t>(499 + k) : std::nullopt,
                                 static_cast<int32_t>(10 * k)));
  }
  PrefixIndex index;
  KvEventsConsumer consumer(index, options_for(pub, 1));
  ASSERT_TRUE(consumer.wait_for_seq(4, 10000));
  EXPECT_EQ(consumer.stats().replayed_batches, 5);
  EXPECT_EQ(index.match_depth(1, chain_tokens(5)), 5);

  // A restarted consumer (e.g. a restarted gateway) starts over from the replay buffer, after
  // clearing what the index held for its engine.
  consumer.stop();
  pub.publish(5, store_payload(505, 504, 50), /*live=*/false);
  KvEventsConsumer again(index, options_for(pub, 1));
  ASSERT_TRUE(again.wait_for_seq(5, 10000));
  EXPECT_EQ(again.stats().replayed_batches, 6);
  EXPECT_EQ(index.match_depth(1, chain_tokens(6)), 6);
}

TEST(KvEventsConsumer, LostBatchesClearTheEngine) {
  ScriptedPublisher pub;
  PrefixIndex index;
  KvEventsConsumer consumer(index, options_for(pub, 2));
  uint64_t seq = publish_until_live(pub, consumer, 0);
  pub.publish(seq, store_payload(our_first(0), std::nullopt, 0));
  ASSERT_TRUE(consumer.wait_for_seq(seq, 10000));
  EXPECT_EQ(index.match_depth(2, chain_tokens(1)), 1);

  // seq+1 is neither live nor in the replay buffer: whatever it said is unknown.
  pub.publish(seq + 1, store_payload(501, our_first(0), 10), /*live=*/false, /*keep=*/false);
  pub.forget_history();
  pub.publish(seq + 2, store_payload(our_first(100), std::nullopt, 100));
  ASSERT_TRUE(consumer.wait_for_seq(seq + 2, 10000));
  const auto s = consumer.stats();
  EXPECT_EQ(s.unfilled_gaps, 1);
  EXPECT_EQ(index.match_depth(2, chain_tokens(1)), 0);  // cleared
  EXPECT_EQ(index.match_depth(2, std::vector<int32_t>{100, 101}), 1);
}

TEST(KvEventsConsumer, PublisherRestartClearsTheEngine) {
  PrefixIndex index;
  ScriptedPublisher pub;
  KvEventsConsumer consumer(index, options_for(pub, 5));
  uint64_t seq = publish_until_live(pub, consumer, 0);
  pub.publish(seq, store_payload(our_first(0), std::nullopt, 0));
  ASSERT_TRUE(consumer.wait_for_seq(seq, 10000));
  ASSERT_EQ(index.match_depth(5, chain_tokens(1)), 1);

  // Seqs start again at 0 (a restarted engine at the same address): the old blocks are gone.
  pub.forget_history();
  pub.publish(0, store_payload(our_first(100), std::nullopt, 100));
  ASSERT_TRUE(testing::eventually([&] { return consumer.stats().restarts == 1; }));
  EXPECT_TRUE(testing::eventually([&] {
    return index.match_depth(5, std::vector<int32_t>{100, 101}) == 1;
  }));
  EXPECT_EQ(index.match_depth(5, chain_tokens(1)), 0);
}

// ---- against a real engine ----

struct EngineWithEvents {
  testing::EngineProcess process;
  std::string endpoint, replay;

  static std::vector<std::string> args() {
    const std::string config =
        R"({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",)"
        R"( "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv@engine"})";
    return {TANDEM_BINARY,
            "engine",
            "--model",
            "sim:tiny",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--block-size",
            "4",
            "--num-kv-blocks",
            "256",
            "--kv-events-config",
            config};
  }

  EngineWithEvents() : process(args()) {
    const auto endpoints = testing::read_kv_events_line(process);
    endpoint = endpoints.events;
    replay = endpoints.replay;
  }

  std::vector<int32_t> generate(const std::vector<int32_t>& prompt) {
    json body = {{"input_ids", prompt}, {"sampling_params", {{"max_new_tokens", 2}}}};
    auto resp = testing::post_json(process.port(), "/generate", body);
    EXPECT_EQ(resp.status, 200) << resp.body;
    return json::parse(resp.body)["output_ids"].get<std::vector<int32_t>>();
  }

  KvEventsConsumerOptions options(EngineKey key) const {
    KvEventsConsumerOptions o;
    o.engine = key;
    o.endpoint = endpoint;
    o.replay_endpoint = replay;
    o.topic = "kv@engine";
    return o;  // block size 16 until the events say 4
  }
};

TEST(PrefixIndexWithEngine, MatchDepthEqualsThePromptsBlocks) {
  EngineWithEvents engine;
  PrefixIndex index;
  KvEventsConsumer consumer(index, engine.options(7));

  const auto a = seq_tokens(100, 18);                         // 4 full blocks + 2 tokens
  const auto b = concat(slice(a, 0, 8), seq_tokens(600, 9));  // shares a's first 2 blocks
  const auto c = seq_tokens(900, 12);                         // 3 blocks
  engine.generate(a);
  ASSERT_TRUE(testing::eventually([&] { return index.match_depth(7, a) == 4; }))
      << "depth " << index.match_depth(7, a);
  EXPECT_EQ(index.block_size(7), 4);  // learnt from the events
  EXPECT_EQ(index.match_depth(7, b), 2);
  EXPECT_EQ(index.match_depth(7, c), 0);
  engine.generate(b);
  engine.generate(c);
  ASSERT_TRUE(testing::eventually(
      [&] { return index.match_depth(7, b) == 4 && index.match_depth(7, c) == 3; }));
  const auto m = index.match(a);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0].engine, 7);
  EXPECT_EQ(m[0].tokens, 16);
  EXPECT_EQ(consumer.stats().malformed, 0);
  EXPECT_EQ(consumer.stats().unfilled_gaps, 0);

  // A consumer started now, on its own index, learns the same from the replay buffer.
  PrefixIndex late_index;
  KvEventsConsumer late(late_index, engine.options(7));
  ASSERT_TRUE(testing::eventually([&] {
    return late_index.match_depth(7, a) == 4 && late_index.match_depth(7, b) == 4 &&
           late_index.match_depth(7, c) == 3;
  }));
  EXPECT_GT(late.stats().replayed_batches, 0);
  EXPECT_EQ(late_index.num_blocks(7), index.num_blocks(7));

  // Stopped, the first consumer misses a request; a new one catches up from replay.
  consumer.stop();
  const auto d = seq_tokens(1500, 8);
  engine.generate(d);
  KvEventsConsumer restarted(index, engine.options(7));
  ASSERT_TRUE(testing::eventually(
      [&] { return index.match_depth(7, d) == 2 && index.match_depth(7, a) == 4; }));
  EXPECT_EQ(index.num_blocks(7), late_index.num_blocks(7));
}

// A real engine's salted stores (cache_salt hashed by its API, folded into the first block by
// its KV cache) are found by a request with the same salt as the gateway hashes it, and by no
// other: the gateway's salt and hashes agree with the engine's.
TEST(PrefixIndexWithEngine, SaltedPromptsMatchOnlyTheirSalt) {
  EngineWithEvents engine;
  PrefixIndex index;
  KvEventsConsumer consumer(index, engine.options(7));
  auto complete = [&](const std::vector<int32_t>& prompt, std::optional<std::string> salt) {
    json body = {{"prompt", prompt}, {"max_tokens", 1}};
    if (salt) body["cache_salt"] = *salt;
    const auto r = testing::post_json(engine.process.port(), "/v1/completions", body);
    EXPECT_EQ(r.status, 200) << r.body;
  };
  const auto a = seq_tokens(100, 18);  // 4 full blocks + 2 tokens
  const uint64_t salt = hash_bytes("tenant-a");
  complete(a, "tenant-a");
  ASSERT_TRUE(testing::eventually([&] { return index.match_depth(7, a, salt) == 4; }))
      << "depth " << index.match_depth(7, a, salt);
  EXPECT_EQ(index.match_depth(7, a), 0);  // without the fix: 4
  EXPECT_EQ(index.match_depth(7, a, hash_bytes("tenant-b")), 0);
  // The same tokens unsalted: a prefix of their own, beside the salted one.
  complete(a, std::nullopt);
  ASSERT_TRUE(testing::eventually([&] { return index.match_depth(7, a) == 4; }));
  EXPECT_EQ(index.match_depth(7, a, salt), 4);
  EXPECT_EQ(index.num_blocks(7), 8);
}

// The index wired into the gateway: two engines publishing KV events behind a gateway that
// tokenizes and schedules by cache overlap. Engine b alone has a prompt cached (it was sent to
// b directly); its continuations through the gateway all go to b, where without the index the
// policy sees two idle, equal engines and takes the first. The admin view shows the blocks.
void follows_the_cached_prefix(const std::string& policy) {
  SCOPED_TRACE(policy);
  EngineWithEvents a, b;
  Topology t;
  t.host = "127.0.0.1";
  t.port = 0;
  t.mode = PdMode::kAggregated;
  t.policy = policy;
  t.admin_api_key = "admin";
  t.model = test::lenml_model("deepseek_v3").string();  // the sim engines' tokenizer
  for (auto* e : {&a, &b}) {
    Endpoint ep = parse_endpoint("127.0.0.1:" + std::to_string(e->process.port()));
    ep.name = e == &a ? "a" : "b";
    ep.kv_events = e->endpoint;
    ep.kv_events_replay = e->replay;
    t.decode.endpoints.push_back(ep);
  }
  Gateway gw(t, {});
  gw.start();
  net::Headers admin;
  admin.set("Authorization", "Bearer admin");
  auto blocks = [&] {
    std::map<std::string, int64_t> out;
    const json eps =
        json::parse(net::http_request("127.0.0.1", gw.port(), "GET", "/admin/endpoints", {}, admin)
                        .body)["endpoints"];
    for (const auto& e : eps) out[e["name"]] = e.value("prefix_blocks", int64_t{-1});
    return out;
  };
  EXPECT_EQ(blocks(), (std::map<std::string, int64_t>{{"a", 0}, {"b", 0}}));
  std::string base = "The gateway keeps a global index of every engine's cached blocks";
  // Long enough (~500 tokens) that the cached part saves more prefill time than the tandem
  // policy's near-tie margin (2 ms), within which it would spread instead.
  for (int i = 0; i < 50; ++i) base += " and routes each request where its prefix already is";
  const json warm = {{"prompt", base}, {"max_tokens", 2}, {"temperature", 0}};
  ASSERT_EQ(testing::post_json(b.process.port(), "/v1/completions", warm).status, 200);
  ASSERT_TRUE(testing::eventually([&] { return blocks().at("b") > 10; }))
      << "b's blocks did not reach the index";
  // And b's load report after that request (its steps learned, none running): a report taken
  // while the request ran would show b busy for a while longer, which the tandem policy counts.
  ASSERT_TRUE(testing::eventually([&] {
    const json eps =
        json::parse(net::http_request("127.0.0.1", gw.port(), "GET", "/admin/endpoints", {}, admin)
                        .body)["endpoints"];
    for (const auto& e : eps)
      if (e["name"] == "b" && e.contains("load") && e["load"]["batch_observations"] > 0 &&
          e["load"]["running"] == 0)
        return true;
    return false;
  }));
  for (int i = 0; i < 5; ++i) {
    const json body = {{"prompt", base + ", continuation number " + std::to_string(i)},
                       {"max_tokens", 2},
                       {"temperature", 0}};
    const auto r = testing::post_json(gw.port(), "/v1/completions", body);
    EXPECT_EQ(r.status, 200) << r.body;
  }
  auto sent_to = [&](const std::string& name) {
    return testing::metric(gw.port(), "tandem:gateway_endpoint_requests_total",
                           "endpoint=\"" + name + "\"");
  };
  EXPECT_EQ(sent_to("b"), 5);
  EXPECT_EQ(sent_to("a"), 0);
  EXPECT_EQ(blocks().at("a"), 0);
  gw.stop();
}

TEST(PrefixIndexWithGateway, PoliciesFollowTheCachedPrefix) {
  follows_the_cached_prefix("kv_router");
  follows_the_cached_prefix("tandem");
}

// cache_salt through the whole gateway: engine b holds a prompt cached under a salt. Requests
// with that salt follow it to b; the same prompt unsalted, or with another salt, cannot use it
// (b's cache keeps them apart) and goes to a, the first of two otherwise equal engines, where
// a gateway keying blocks by their tokens alone sent it to b.
TEST(PrefixIndexWithGateway, OnlyRequestsWithTheSaltFollowASaltedPrefix) {
  EngineWithEvents a, b;
  Topology t;
  t.host = "127.0.0.1";
  t.port = 0;
  t.mode = PdMode::kAggregated;
  t.policy = "kv_router";
  t.admin_api_key = "admin";
  t.model = test::lenml_model("deepseek_v3").string();
  for (auto* e : {&a, &b}) {
    Endpoint ep = parse_endpoint("127.0.0.1:" + std::to_string(e->process.port()));
    ep.name = e == &a ? "a" : "b";
    ep.kv_events = e->endpoint;
    ep.kv_events_replay = e->replay;
    t.decode.endpoints.push_back(ep);
  }
  Gateway gw(t, {});
  gw.start();
  net::Headers admin;
  admin.set("Authorization", "Bearer admin");
  auto b_blocks = [&] {
    const json eps =
        json::parse(net::http_request("127.0.0.1", gw.port(), "GET", "/admin/endpoints", {}, admin)
                        .body)["endpoints"];
    for (const auto& e : eps)
      if (e["name"] == "b") return e.value("prefix_blocks", int64_t{-1});
    return int64_t{-1};
  };
  std::string base = "Tenants that set a cache salt share cached prompts only among themselves";
  for (int i = 0; i < 50; ++i) base += " and the gateway routes each by the prefix it can use";
  auto body = [&](int i, std::optional<std::string> salt) {
    json j = {{"prompt", base + ", continuation number " + std::to_string(i)},
              {"max_tokens", 2},
              {"temperature", 0}};
    if (salt) j["cache_salt"] = *salt;
    return j;
  };
  const json warm = {{"prompt", base}, {"max_tokens", 2}, {"cache_salt", "tenant-b"}};
  ASSERT_EQ(testing::post_json(b.process.port(), "/v1/completions", warm).status, 200);
  ASSERT_TRUE(testing::eventually([&] { return b_blocks() > 10; }))
      << "b's blocks did not reach the index";
  // And b's load report after that request: one taken while it ran shows b busy, which the
  // policy counts against b whatever its cache.
  ASSERT_TRUE(testing::eventually([&] {
    const json eps =
        json::parse(net::http_request("127.0.0.1", gw.port(), "GET", "/admin/endpoints", {}, admin)
                        .body)["endpoints"];
    for (const auto& e : eps)
      if (e["name"] == "b" && e.contains("load") && e["load"]["batch_observations"] > 0 &&
          e["load"]["running"] == 0)
        return true;
    return false;
  }));
  auto sent_to = [&](const std::string& name) {
    return testing::metric(gw.port(), "tandem:gateway_endpoint_requests_total",
                           "endpoint=\"" + name + "\"");
  };
  // Unsalted first, then another tenant's: neither can use b's blocks.
  EXPECT_EQ(testing::post_json(gw.port(), "/v1/completions", body(0, std::nullopt)).status, 200);
  EXPECT_EQ(sent_to("a"), 1);  // without the fix: b
  EXPECT_EQ(testing::post_json(gw.port(), "/v1/completions", body(1, "tenant-c")).status, 200);
  EXPECT_EQ(sent_to("a"), 2);
  EXPECT_EQ(sent_to("b"), 0);
  // The salt's own requests follow it, though a now holds the same tokens (unsalted and salted
  // otherwise).
  for (int i = 2; i < 5; ++i) {
    const auto r = testing::post_json(gw.port(), "/v1/completions", body(i, "tenant-b"));
    EXPECT_EQ(r.status, 200) << r.body;
  }
  EXPECT_EQ(sent_to("b"), 3);
  EXPECT_EQ(sent_to("a"), 2);
  gw.stop();
}

}  // namespace
}  // namespace tandem::gateway
