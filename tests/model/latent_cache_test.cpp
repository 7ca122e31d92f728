// The latent cache's storage: float32 values come back exactly, BF16 values rounded to nearest
// even (PyTorch's rounding, checked on ties and against the neighbouring BF16 values), blocks and
// layers never overlap, and a BF16 block is half a float32 one.
#include "model/latent_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/executor/cpu_executor.h"
#include "util/error.h"
#include "util/error_of.h"

namespace tandem::model {
namespace {

LatentCacheShape shape_of(LatentType type) {
  return {3, 4, 16, 8, type};
}

float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(LatentCache, Float32ValuesComeBackExactly) {
  LatentCache cache(shape_of(LatentType::kF32), 5);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> in(24), out(24);
  for (auto& x : in) x = normal(rng);
  cache.store(4, 2, 3, in.data());
  cache.load(4, 2, 3, 0, 24, out.data());
  EXPECT_EQ(in, out);
  cache.load(4, 2, 3, 16, 8, out.data());
  EXPECT_TRUE(std::equal(in.begin() + 16, in.end(), out.begin()));
}

TEST(LatentCache, Bfloat16ValuesAreRoundedToNearestEven) {
  LatentCache cache(shape_of(LatentType::kBF16), 2);
  std::vector<float> in(24), out(24);
  // Exactly halfway between two BF16 values: ties go to the even one (last mantissa bit 0).
  in[0] = from_bits(0x3F808000);   // between 0x3F80 (even) and 0x3F81
  in[1] = from_bits(0x3F818000);   // between 0x3F81 and 0x3F82 (even)
  in[2] = from_bits(0x3F808001);   // just above halfway: up
  in[3] = -from_bits(0x3F807FFF);  // just below halfway: down (magnitude)
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  for (size_t i = 4; i < in.size(); ++i) in[i] = normal(rng);
  cache.store(1, 0, 2, in.data());
  cache.load(1, 0, 2, 0, 24, out.data());
  EXPECT_EQ(out[0], from_bits(0x3F800000));
  EXPECT_EQ(out[1], from_bits(0x3F820000));
  EXPECT_EQ(out[2], from_bits(0x3F810000));
  EXPECT_EQ(out[3], -from_bits(0x3F800000));
  for (size_t i = 4; i < in.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &out[i], 4);
    EXPECT_EQ(bits & 0xFFFF, 0u) << "value " << i << " is not a BF16 value";
    // No BF16 value is closer: the neighbours are one BF16 ulp away on either side.
    const float ulp = from_bits(bits + 0x10000) - out[i];
    EXPECT_LE(std::abs(in[i] - out[i]), std::abs(ulp) / 2) << "value " << i;
  }
}

TEST(LatentCache, BlocksAndLayersDoNotOverlap) {
  for (auto type : {LatentType::kF32, LatentType::kBF16}) {
    const auto shape = shape_of(type);
    LatentCache cache(shape, 3);
    std::vector<float> out(24);
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t l = 0; l < 3; ++l)
        for (int64_t s = 0; s < 4; ++s) {
          std::vector<float> v(24, static_cast<float>(b * 100 + l * 10 + s));
          cache.store(b, l, s, v.data());
        }
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t l = 0; l < 3; ++l)
        for (int64_t s = 0; s < 4; ++s) {
          cache.load(b, l, s, 0, 24, out.data());
          EXPECT_EQ(out, std::vector<float>(24, static_cast<float>(b * 100 + l * 10 + s)));
        }
    EXPECT_EQ(cache.block_layer(1, 0) - cache.block_layer(0, 0), shape.block_bytes());
    EXPECT_EQ(cache.block_layer(0, 1) - cache.block_layer(0, 0), 4 * shape.entry_bytes());
  }
  EXPECT_EQ(shape_of(LatentType::kBF16).block_bytes() * 2,
            shape_of(LatentType::kF32).block_bytes());
}

// The cache's size from --kv-cache-gb / --num-kv-blocks. Every refusal happens before any memory
// is taken and names the flag: an oversized cache used to start (sparse pages) and die once
// filled, or end in a bare std::bad_alloc.
TEST(KvCacheSizing, ACacheBeyondTheMachinesMemoryIsRefusedNamingTheFlagAndBothSizes) {
  using ::testing::HasSubstr;
  // DeepSeek-V3's cache: 61 layers of 512 + 64 BF16 values a token, 1,124,352 bytes a block.
  const LatentCacheShape shape{61, 16, 512, 64, LatentType::kBF16};
  const int64_t limit = engine::kv_cache_memory_limit();
  ASSERT_GT(limit, 0);
  engine::CpuExecutorOptions o;
  o.kv_cache_bytes = 100000 * double(1ull << 30);
  const int64_t blocks = (int64_t{100000} << 30) / shape.block_bytes();
  const std::string by_budget = testing::error_of([&] { engine::kv_blocks_for(shape, o); });
  EXPECT_THAT(by_budget, HasSubstr("--kv-cache-gb 100000: a KV cache of " + std::to_string(blocks) +
                                   " blocks needs 100000.0 GiB (" +
                                   std::to_string(blocks * shape.block_bytes()) +
                                   " bytes), more than this machine's "));
  EXPECT_THAT(by_budget, HasSubstr(std::to_string(limit) + " bytes) of physical memory"));

  o.num_blocks = limit / shape.block_bytes() + 1;
  EXPECT_THAT(testing::error_of([&] { engine::kv_blocks_for(shape, o); }),
              HasSubstr("--num-kv-blocks " + std::to_string(o.num_blocks) + ": a KV cache of"));
  // What fits is granted, in whole blocks.
  o.num_blocks = limit / shape.block_bytes();
  EXPECT_EQ(engine::kv_blocks_for(shape, o), o.num_blocks);
  o.num_blocks = 0;
  o.kv_cache_bytes = 64 << 20;
  EXPECT_EQ(engine::kv_blocks_for(shape, o), (64 << 20) / shape.block_bytes());
}

TEST(KvCacheSizing, CountsBeyondInt32BlockIdsAndSizesBeyondInt64AreRefusedNamingTheFlag) {
  using ::testing::HasSubstr;
  engine::CpuExecutorOptions o;
  o.num_blocks = 3000000000;
  EXPECT_THAT(testing::error_of([&] { engine::kv_blocks_for(shape_of(LatentType::kBF16), o); }),
              HasSubstr("--num-kv-blocks 3000000000: the KV cache would hold 3000000000 blocks; "
                        "at most 2147483647"));
  o.num_blocks = 0;
  o.kv_cache_bytes = 1e10 * double(1ull << 30);
  EXPECT_THAT(testing::error_of([&] { engine::kv_blocks_for(shape_of(LatentType::kBF16), o); }),
              HasSubstr("--kv-cache-gb 1e+10: the KV cache would hold more than 2^31-1 blocks"));
  o.kv_cache_bytes = 100;
  EXPECT_THAT(testing::error_of([&] { engine::kv_blocks_for(shape_of(LatentType::kBF16), o); }),
              HasSubstr("--kv-cache-gb 9.31323e-08: the KV cache budget holds no block of 576 "
                        "bytes"));
  // 2^54 bytes a block: 1024 blocks are 2^64 bytes.
  const LatentCacheShape huge{int64_t{1} << 20, 4096, (int64_t{1} << 20) - 64, 64,
                              LatentType::kF32};
  o.num_blocks = 1024;
  EXPECT_THAT(testing::error_of([&] { engine::kv_blocks_for(huge, o); }),
              HasSubstr("--num-kv-blocks 1024: 1024 KV blocks of 18014398509481984 bytes "
                        "overflow a 64-bit size"));
  EXPECT_THAT(testing::error_of([&] { LatentCache cache(huge, 1024); }),
              HasSubstr("latent cache: 1024 blocks of 18014398509481984 bytes overflow"));
}

}  // namespace
// The limits that bind the process are its own cgroup's and every ancestor's, as
// /proc/self/cgroup names them, for either cgroup version (v1 only under "memory").
TEST(KvCacheSizing, TheCgroupLimitsReadAreTheProcessCgroupsAndItsAncestors) {
  EXPECT_EQ(engine::cgroup_memory_limit_files("0::/system.slice/tandem.service\n"),
            (std::vector<std::string>{"/sys/fs/cgroup/system.slice/tandem.service/memory.max",
                                      "/sys/fs/cgroup/system.slice/memory.max",
                                      "/sys/fs/cgroup/memory.max"}));
  EXPECT_EQ(engine::cgroup_memory_limit_files("0::/\n"),
            (std::vector<std::string>{"/sys/fs/cgroup/memory.max"}));
  EXPECT_EQ(engine::cgroup_memory_limit_files("9:pids:/\n4:memory:/box/1\n1:cpu,cpuacct:/\n"),
            (std::vector<std::string>{"/sys/fs/cgroup/memory/box/1/memory.limit_in_bytes",
                                      "/sys/fs/cgroup/memory/box/memory.limit_in_bytes",
                                      "/sys/fs/cgroup/memory/memory.limit_in_bytes"}));
  EXPECT_EQ(engine::cgroup_memory_limit_files("5:cpu,memory:/x\n"),
            (std::vector<std::string>{"/sys/fs/cgroup/memory/x/memory.limit_in_bytes",
                                      "/sys/fs/cgroup/memory/memory.limit_in_bytes"}));
  EXPECT_TRUE(engine::cgroup_memory_limit_files("garbage\n3:memoryx:/y\n").empty());
}

}  // namespace tandem::model
