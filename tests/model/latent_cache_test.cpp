// The latent cache's storage: float32 values come back exactly, BF16 values rounded to nearest
// even (PyTorch's rounding, checked on ties and against the neighbouring BF16 values), blocks and
// layers never overlap, and a BF16 block is half a float32 one.
#include "model/latent_cache.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

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

}  // namespace
}  // namespace tandem::model
