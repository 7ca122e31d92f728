// The absorbed MLA decode kernel against a double-precision reference (scores, softmax and the
// weighted sum in FP64 over the very values the cache stores), for both rescale paths, the AVX2
// microkernels and the portable loops, float32 and BF16 caches, and contexts that cross page,
// tile (64) and split-K chunk (512) boundaries with partial pages and causally masked draft rows.
//
// Bound: every output element is within 1e-5 x max|value| of the reference. Float32 scores over
// 576-wide rows carry relative errors near 1e-6, the exp2 polynomial 1.3e-7, the sums of up to a
// few thousand probabilities another 1e-6; the largest error seen is 2.6e-6 (the portable loops,
// which sum sequentially) and 8e-7 (AVX2), so the bound leaves a factor of four.
//
// BF16 products (BF16 caches on CPUs with AVX-512 BF16): the kernel rounds the scaled queries to
// BF16, which the reference does too (that rounding is part of what the kernel computes), and the
// probabilities, which it does not. The output is then a weighted mean of the values with every
// weight off by a relative 2^-9 at most (the sum of the weights uses the same rounded values):
// |out - reference| <= 2^-9 x 2 max|value| / (1 - 2^-9) < 4e-3 x max|value|; the largest error
// seen is 1.2e-3 (four query tokens at DeepSeek's widths).
#include "kernels/cpu/mla_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/matvec_avx512.h"

namespace tandem::kernels {
namespace {

constexpr double kBound = 1e-5;
constexpr double kBoundBf16 = 4e-3;
constexpr float kLog2e = 1.4426950408889634f;

struct Case {
  int64_t heads, latent, rope, block_size, s_q, context;
  LatentType type;
};

std::string name_of(const Case& c) {
  std::ostringstream name;
  name << "h" << c.heads << "_l" << c.latent << "_r" << c.rope << "_b" << c.block_size << "_q"
       << c.s_q << "_ctx" << c.context << (c.type == LatentType::kBF16 ? "_bf16" : "_f32");
  return name.str();
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << name_of(c);
}

// A paged cache for one sequence whose pages sit in shuffled order in a pool, as a block table
// would place them; each stored value is also kept as a double for the reference.
struct PagedCache {
  std::vector<float> pool_f32;
  std::vector<uint16_t> pool_bf16;
  std::vector<const void*> pages;
  std::vector<double> values;  // [context, entry], what the cache holds, widened
};

PagedCache make_cache(const Case& c, int64_t entry, std::mt19937& rng,
                      const std::function<double(int64_t, int64_t)>& value) {
  PagedCache cache;
  const int64_t pages = (c.context + c.block_size - 1) / c.block_size;
  const int64_t page_values = c.block_size * entry;
  std::vector<int64_t> slot(pages + 3);
  std::iota(slot.begin(), slot.end(), 0);
  std::shuffle(slot.begin(), slot.end(), rng);
  if (c.type == LatentType::kBF16)
    cache.pool_bf16.assign(slot.size() * page_values, 0x7FC0);  // NaN where nothing is cached
  else
    cache.pool_f32.assign(slot.size() * page_values, std::nanf(""));
  cache.values.resize(c.context * entry);
  for (int64_t p = 0; p < c.context; ++p)
    for (int64_t e = 0; e < entry; ++e) {
      const int64_t at = slot[p / c.block_size] * page_values + (p % c.block_size) * entry + e;
      const auto v = static_cast<float>(value(p, e));
      if (c.type == LatentType::kBF16) {
        cache.pool_bf16[at] = f32_to_bf16(v);
        cache.values[p * entry + e] = bf16_to_f32(cache.pool_bf16[at]);
      } else {
        cache.pool_f32[at] = v;
        cache.values[p * entry + e] = v;
      }
    }
  for (int64_t i = 0; i < pages; ++i) {
    if (c.type == LatentType::kBF16)
      cache.pages.push_back(cache.pool_bf16.data() + slot[i] * page_values);
    else
      cache.pages.push_back(cache.pool_f32.data() + slot[i] * page_values);
  }
  return cache;
}

// FP64 attention of every (query, head) row over its visible positions. With `bf16_queries`, the
// queries as the BF16 kernels multiply them: scaled into the exp2 domain and rounded to BF16.
std::vector<double> reference(const Case& c, float scale, const std::vector<float>& q,
                              const PagedCache& cache, bool bf16_queries = false) {
  const int64_t entry = c.latent + c.rope, rows = c.s_q * c.heads;
  std::vector<double> out(rows * c.latent, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t visible = c.context - c.s_q + r / c.heads + 1;
    std::vector<double> s(visible);
    for (int64_t p = 0; p < visible; ++p) {
      double dot = 0;
      for (int64_t e = 0; e < entry; ++e) {
        const double qe = bf16_queries
                              ? bf16_to_f32(f32_to_bf16(q[r * entry + e] * (scale * kLog2e)))
                              : static_cast<double>(q[r * entry + e]);
        dot += qe * cache.values[p * entry + e];
      }
      s[p] = bf16_queries ? dot * std::log(2.0) : dot * scale;
    }
    const double top = *std::max_element(s.begin(), s.end());
    double total = 0;
    for (auto& x : s) total += (x = std::exp(x - top));
    for (int64_t p = 0; p < visible; ++p)
      for (int64_t e = 0; e < c.latent; ++e)
        out[r * c.latent + e] += s[p] / total * cache.values[p * entry + e];
  }
  return out;
}

// Largest |kernel - reference| relative to the largest |value| in the cache.
double relative_error(const std::vector<float>& got, const std::vector<double>& want,
                      const PagedCache& cache) {
  double vmax = 0, err = 0;
  for (double v : cache.values) vmax = std::max(vmax, std::abs(v));
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    err = std::max(err, std::abs(got[i] - want[i]));
  }
  return err / vmax;
}

struct Variant {
  MlaRescale rescale;
  bool simd, bf16_dot;
  const char* name;
};
constexpr Variant kVariants[] = {{MlaRescale::kMultiply, true, false, "multiply/avx2"},
                                 {MlaRescale::kAmla, true, false, "amla/avx2"},
                                 {MlaRescale::kMultiply, false, false, "multiply/portable"},
                                 {MlaRescale::kAmla, false, false, "amla/portable"},
                                 {MlaRescale::kMultiply, true, true, "multiply/bf16"},
                                 {MlaRescale::kAmla, true, true, "amla/bf16"}};

// Whether the variant runs the BF16 products on this case (a BF16 cache of widths they take, on a
// CPU with AVX-512 BF16); elsewhere it is the float32 variant again.
bool runs_bf16_products(const Case& c, const Variant& v) {
  return v.bf16_dot && c.type == LatentType::kBF16 && avx512::has_bf16_dot() &&
         c.latent % 32 == 0 && c.rope % 32 == 0;
}

// Runs every variant on one case and checks each against the reference.
void expect_matches_reference(const Case& c, float scale, const std::vector<float>& q,
                              const PagedCache& cache) {
  const auto want = reference(c, scale, q, cache);
  const auto want_bf16 = reference(c, scale, q, cache, /*bf16_queries=*/true);
  const MlaShape shape{c.heads, c.latent, c.rope, c.block_size, scale, c.type};
  for (const auto& v : kVariants) {
    std::vector<float> out(c.s_q * c.heads * c.latent, std::nanf(""));
    const MlaSequence seq{q.data(), c.s_q, c.context, cache.pages.data(), out.data()};
    MlaOptions options{v.rescale, v.simd};
    options.bf16_dot = v.bf16_dot;
    mla_decode(shape, std::span(&seq, 1), options);
    if (runs_bf16_products(c, v))
      EXPECT_LE(relative_error(out, want_bf16, cache), kBoundBf16) << v.name;
    else
      EXPECT_LE(relative_error(out, want, cache), kBound) << v.name;
  }
}

class MlaDecodeTest : public ::testing::TestWithParam<Case> {};

TEST_P(MlaDecodeTest, MatchesTheDoublePrecisionReference) {
  const Case c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(c.context * 131 + c.heads * 7 + c.s_q));
  std::normal_distribution<double> normal(0.0, 1.0);
  const int64_t entry = c.latent + c.rope;
  const auto cache = make_cache(c, entry, rng, [&](int64_t, int64_t) { return normal(rng); });
  std::vector<float> q(c.s_q * c.heads * entry);
  for (auto& x : q) x = static_cast<float>(normal(rng));
  // Scores with a spread of several units, as trained models give.
  const float scale = 3.0f / static_cast<float>(std::sqrt(entry));
  expect_matches_reference(c, scale, q, cache);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (auto type : {LatentType::kF32, LatentType::kBF16}) {
    // DeepSeek's widths, one and four query tokens, across page, tile and chunk boundaries.
    for (int64_t context : {1, 15, 16, 17, 64, 65, 200, 513, 1500})
      out.push_back({16, 512, 64, 16, 1, context, type});
    for (int64_t context : {4, 63, 130, 1100}) out.push_back({16, 512, 64, 16, 4, context, type});
    // Odd head counts and pages that do not divide the tile: every microkernel remainder.
    for (int64_t heads : {1, 3, 5, 7}) out.push_back({heads, 64, 16, 5, 2, 77, type});
    // Widths the BF16 products take (multiples of 32) with odd head counts and odd tile lengths.
    for (int64_t heads : {5, 7}) out.push_back({heads, 96, 32, 5, 3, 71, type});
    out.push_back({11, 40, 8, 7, 3, 600, type});
    // From 32 heads the BF16 path transposes the keys for the scores: DeepSeek-V3's 128 heads
    // with partial tiles, and odd head counts with every row and position remainder.
    out.push_back({128, 512, 64, 16, 1, 200, type});
    out.push_back({128, 512, 64, 16, 2, 77, type});
    // 32 and 64 heads take the lanes in groups of 16 (of one query token each).
    out.push_back({32, 512, 64, 16, 3, 200, type});
    out.push_back({64, 512, 64, 16, 2, 130, type});
    for (int64_t heads : {37, 41}) out.push_back({heads, 96, 32, 5, 3, 71, type});
  }
  // Widths the AVX2 kernels do not take (not multiples of 8): the portable loops run for all.
  out.push_back({4, 20, 6, 4, 1, 33, LatentType::kF32});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, MlaDecodeTest, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return name_of(info.param); });

// Keys whose scores climb by about 3 per position (in the exp2 domain): every tile raises every
// row's maximum, so the rescale runs on every tile, by shifts of up to a few hundred powers of two
// (AMLA's guard flushes those accumulators to zero: their true weight is below 2^-126).
TEST(MlaDecode, ScoresThatRiseAcrossTilesRescaleOnEveryTile) {
  const Case c{4, 64, 16, 16, 1, 300, LatentType::kF32};
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  const int64_t entry = c.latent + c.rope;
  const auto cache = make_cache(c, entry, rng, [&](int64_t p, int64_t e) {
    return e == 0 ? 0.05 * static_cast<double>(p) : 0.1 * normal(rng);
  });
  std::vector<float> q(c.heads * entry, 0.0f);
  for (int64_t h = 0; h < c.heads; ++h) q[h * entry] = 30.0f + 10.0f * static_cast<float>(h);
  expect_matches_reference(c, 1.0f, q, cache);
}

// One position far above the rest (a 1000-unit gap) in the middle of the context: the earlier
// positions' weights underflow, and neither path produces infinities or NaNs from it.
TEST(MlaDecode, AHugeScoreGapUnderflowsCleanly) {
  const Case c{2, 64, 16, 16, 1, 700, LatentType::kBF16};
  std::mt19937 rng(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  const int64_t entry = c.latent + c.rope;
  const auto cache = make_cache(c, entry, rng, [&](int64_t p, int64_t e) {
    return e == 0 ? (p == 650 ? 1000.0 : 0.0) : normal(rng);
  });
  std::vector<float> q(c.heads * entry, 0.0f);
  q[0] = 1.0f;
  q[entry] = -1.0f;  // the second head sees the gap the other way round
  expect_matches_reference(c, 1.0f, q, cache);
}

// Several sequences of different lengths in one call (the decode batch), each its own result.
TEST(MlaDecode, ABatchEqualsItsSequencesOneByOne) {
  const MlaShape shape{16, 512, 64, 16, 0.07f, LatentType::kBF16};
  std::mt19937 rng(3);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<Case> cs;
  for (int64_t context : {5, 900, 64, 1300})
    cs.push_back({16, 512, 64, 16, 1, context, shape.type});
  std::vector<PagedCache> caches;
  std::vector<std::vector<float>> qs, alone, batched;
  std::vector<MlaSequence> seqs;
  for (const auto& c : cs) {
    caches.push_back(
        make_cache(c, shape.entry(), rng, [&](int64_t, int64_t) { return normal(rng); }));
    qs.emplace_back(c.heads * shape.entry());
    for (auto& x : qs.back()) x = static_cast<float>(normal(rng));
    alone.emplace_back(c.heads * c.latent);
    batched.emplace_back(c.heads * c.latent);
  }
  for (size_t i = 0; i < cs.size(); ++i) {
    const MlaSequence one{qs[i].data(), 1, cs[i].context, caches[i].pages.data(), alone[i].data()};
    mla_decode(shape, std::span(&one, 1));
    seqs.push_back({qs[i].data(), 1, cs[i].context, caches[i].pages.data(), batched[i].data()});
  }
  mla_decode(shape, seqs);
  for (size_t i = 0; i < cs.size(); ++i) EXPECT_EQ(alone[i], batched[i]) << "sequence " << i;
}

// Batch-invariant numerics: with chunks at fixed positions, a query's output has the same bits
// whether it is a decode step's only query (context ending at it) or one of a prefill chunk's
// (context running past it, later positions masked), at any offset among the step's queries.
// Every BF16 score layout: rows of positions (4 heads), heads in lanes (16, and 32 in two groups)
// and transposed keys (48).
TEST(MlaDecode, FixedChunksGiveAQueryTheSameBitsWhateverItsStep) {
  for (const auto& [type, heads] :
       {std::pair{LatentType::kBF16, int64_t{4}}, std::pair{LatentType::kBF16, int64_t{16}},
        std::pair{LatentType::kBF16, int64_t{32}}, std::pair{LatentType::kBF16, int64_t{48}},
        std::pair{LatentType::kF32, int64_t{4}}}) {
    const MlaShape shape{heads, 64, 32, 16, 0.1f, type};
    std::mt19937 rng(11);
    std::normal_distribution<double> normal(0.0, 1.0);
    const Case full{heads, 64, 32, 16, 1, 1400, type};
    const auto cache =
        make_cache(full, shape.entry(), rng, [&](int64_t, int64_t) { return normal(rng); });
    const int64_t position = 1100;  // past the first fixed chunk
    std::vector<float> q(shape.heads * shape.entry());
    for (auto& x : q) x = static_cast<float>(normal(rng));
    MlaOptions options;
    options.fixed_chunks = true;
    std::vector<float> alone(shape.heads * shape.latent);
    const MlaSequence one{q.data(), 1, position + 1, cache.pages.data(), alone.data()};
    mla_decode(shape, std::span(&one, 1), options);
    for (const int64_t s_q : {2, 7, 40}) {
      for (const int64_t at : {int64_t{0}, s_q / 2, s_q - 1}) {
        // s_q queries at positions context - s_q .. context - 1, ours at index `at`.
        const int64_t context = position - at + s_q;
        std::vector<float> qs(s_q * shape.heads * shape.entry());
        for (auto& x : qs) x = static_cast<float>(normal(rng));
        std::copy(q.begin(), q.end(), qs.begin() + at * shape.heads * shape.entry());
        std::vector<float> out(s_q * shape.heads * shape.latent);
        const MlaSequence many{qs.data(), s_q, context, cache.pages.data(), out.data()};
        mla_decode(shape, std::span(&many, 1), options);
        const std::vector<float> mine(out.begin() + at * shape.heads * shape.latent,
                                      out.begin() + (at + 1) * shape.heads * shape.latent);
        EXPECT_EQ(mine, alone) << "s_q " << s_q << " at " << at << " heads " << heads
                               << (type == LatentType::kBF16 ? " bf16" : " f32");
      }
    }
  }
}

}  // namespace
}  // namespace tandem::kernels
