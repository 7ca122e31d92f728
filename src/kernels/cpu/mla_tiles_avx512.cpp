#include "kernels/cpu/mla_tiles_avx512.h"

// GCC 12 reports its own _mm512_undefined_* helpers (inside _mm512_reduce_add_ps) as
// (maybe-)uninitialized at -O3.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "kernels/cpu/avx512_lanes.h"
#include "kernels/cpu/exp2_polynomial.h"

namespace tandem::kernels::avx512 {
namespace {

// Columns per block of the paired values (mla_pair_values), what mla_accumulate_bf16 keeps in
// registers for a few rows at a time.
constexpr int64_t kPairedBlock = 64;

#define TANDEM_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// Lane pairs of a and b summed within each 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] per lane.
TANDEM_AVX512_BF16 inline __m512 pair_sums(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

// Four vectors' sums within each 128-bit lane: [a, b, c, d] per lane (from two pair_sums).
TANDEM_AVX512_BF16 inline __m512 quad_sums(__m512 ab, __m512 cd) {
  const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
  // Moved as pairs of floats (64-bit elements), added as floats.
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// The sums of all lanes of 16 vectors: lane i of the result is the sum of x_i.
TANDEM_AVX512_BF16 inline __m512 sum16(__m512 x0, __m512 x1, __m512 x2, __m512 x3, __m512 x4,
                                       __m512 x5, __m512 x6, __m512 x7, __m512 x8, __m512 x9,
                                       __m512 x10, __m512 x11, __m512 x12, __m512 x13, __m512 x14,
                                       __m512 x15) {
  const __m512 a = quad_sums(pair_sums(x0, x1), pair_sums(x2, x3));  // x0..x3, per 128-bit lane
  const __m512 b = quad_sums(pair_sums(x4, x5), pair_sums(x6, x7));
  const __m512 c = quad_sums(pair_sums(x8, x9), pair_sums(x10, x11));
  const __m512 d = quad_sums(pair_sums(x12, x13), pair_sums(x14, x15));
  // Then the four 128-bit lanes of each are added: lanes 0+1 and 2+3, then the two halves.
  const __m512 ab =
      _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  const __m512 cd =
      _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x88), _mm512_shuffle_f32x4(c, d, 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
}

// H query rows x J keys: every key vector loaded once feeds H products, every query vector J;
// 16 accumulators at 4 x 4.
template <int H, int J>
TANDEM_AVX512_BF16 void score_block(const uint16_t* q, int64_t d, const uint16_t* const* keys,
                                    float* s, int64_t lds) {
  __m512 acc[H][J];
#pragma GCC unroll 16
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) acc[h][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    __m512i k[J];
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) k[j] = _mm512_loadu_si512(keys[j] + c);
#pragma GCC unroll 16
    for (int h = 0; h < H; ++h) {
      const __m512i qv = _mm512_loadu_si512(q + h * d + c);
#pragma GCC unroll 16
      for (int j = 0; j < J; ++j)
        acc[h][j] = _mm512_dpbf16_ps(acc[h][j], (__m512bh)qv, (__m512bh)k[j]);
    }
  }
  if constexpr (H == 4 && J == 4) {
    // 16 sums at once: 45 shuffles and adds instead of 16 separate reductions (about 150).
    const __m512 out = sum16(acc[0][0], acc[0][1], acc[0][2], acc[0][3], acc[1][0], acc[1][1],
                             acc[1][2], acc[1][3], acc[2][0], acc[2][1], acc[2][2], acc[2][3],
                             acc[3][0], acc[3][1], acc[3][2], acc[3][3]);
    _mm_storeu_ps(s, _mm512_extractf32x4_ps(out, 0));
    _mm_storeu_ps(s + lds, _mm512_extractf32x4_ps(out, 1));
    _mm_storeu_ps(s + 2 * lds, _mm512_extractf32x4_ps(out, 2));
    _mm_storeu_ps(s + 3 * lds, _mm512_extractf32x4_ps(out, 3));
  } else {
#pragma GCC unroll 16
    for (int h = 0; h < H; ++h)
#pragma GCC unroll 16
      for (int j = 0; j < J; ++j) s[h * lds + j] = _mm512_reduce_add_ps(acc[h][j]);
  }
}

using ScoreBlock = void (*)(const uint16_t*, int64_t, const uint16_t* const*, float*, int64_t);

// r[0..16) rows of 16 32-bit words -> r[c] = column c (row i in word i).
TANDEM_AVX512_BF16 inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // b[4g + k], 128-bit lane L: column 4L + k of rows 4g..4g+3.
#pragma GCC unroll 16
  for (int g = 0; g < 16; g += 4) {
    b[g] = _mm512_unpacklo_epi64(a[g], a[g + 2]);
    b[g + 1] = _mm512_unpackhi_epi64(a[g], a[g + 2]);
    b[g + 2] = _mm512_unpacklo_epi64(a[g + 1], a[g + 3]);
    b[g + 3] = _mm512_unpackhi_epi64(a[g + 1], a[g + 3]);
  }
  // Then lane L of the four row groups side by side: column 4L + k.
#pragma GCC unroll 16
  for (int k = 0; k < 4; ++k) {
    const __m512i y0 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xEE);
    const __m512i y2 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x44);
    const __m512i y3 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(y0, y2, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(y0, y2, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(y1, y3, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(y1, y3, 0xDD);
  }
}

// H rows x V * 16 positions of scores over transposed keys (24 accumulators at 6 x 4).
template <int H, int V>
TANDEM_AVX512_BF16 void transposed_score_block(const uint16_t* q, int64_t d,
                                               const uint16_t* transposed, int64_t padded,
                                               int64_t j0, float* s, int64_t lds) {
  __m512 acc[H][V];
#pragma GCC unroll 16
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) acc[h][v] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 2) {
    const uint16_t* column = transposed + c * padded + 2 * j0;
    __m512i k[V];
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) k[v] = _mm512_loadu_si512(column + 32 * v);
#pragma GCC unroll 16
    for (int h = 0; h < H; ++h) {
      int32_t pair;
      std::memcpy(&pair, q + h * d + c, 4);
      const __m512i w = _mm512_set1_epi32(pair);
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v)
        acc[h][v] = _mm512_dpbf16_ps(acc[h][v], (__m512bh)k[v], (__m512bh)w);
    }
  }
#pragma GCC unroll 16
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(s + h * lds + j0 + 16 * v, acc[h][v]);
}

using TransposedScoreBlock = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t,
                                      float*, int64_t);

// H rows x V * 16 columns of the weighted sum held in registers over all pairs of positions
// (24 accumulators at 6 x 4, four value vectors, one broadcast pair of probabilities).
template <int H, int V>
TANDEM_AVX512_BF16 void accumulate_block(const uint16_t* p, int64_t row_stride, int64_t pair_stride,
                                         const uint16_t* paired, int64_t pairs, int64_t width,
                                         int64_t c0, float* acc) {
  __m512 a[H][V];
#pragma GCC unroll 16
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) a[h][v] = _mm512_loadu_ps(acc + h * width + c0 + 16 * v);
  // The column block's pairs lie together (mla_pair_values), 32 * V values each.
  const uint16_t* block = paired + c0 * 2 * pairs;
  for (int64_t j = 0; j < pairs; ++j) {
    const uint16_t* row = block + j * 32 * V;
    __m512i x[V];
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) x[v] = _mm512_loadu_si512(row + 32 * v);
#pragma GCC unroll 16
    for (int h = 0; h < H; ++h) {
      int32_t both;
      std::memcpy(&both, p + h * row_stride + j * pair_stride, 4);
      const __m512i w = _mm512_set1_epi32(both);
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) a[h][v] = _mm512_dpbf16_ps(a[h][v], (__m512bh)x[v], (__m512bh)w);
    }
  }
#pragma GCC unroll 16
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + h * width + c0 + 16 * v, a[h][v]);
}

// 2^x for 16 lanes, 0 below 2^-126 (see exp2_polynomial.h).
TANDEM_AVX512_BF16 inline __m512 exp2_16(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-126.0f)), _mm512_set1_ps(127.0f));
  const __m512 i = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, i);
  __m512 p = _mm512_set1_ps(kExp2Polynomial[0]);
#pragma GCC unroll 8
  for (int k = 1; k < 7; ++k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Polynomial[k]));
  const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(i), 23);
  return _mm512_maskz_mov_ps(normal,
                             _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e)));
}

using AccumulateBlock = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t,
                                 int64_t, int64_t, float*);

// P positions x 16 heads of lane scores: 16 pairs of query columns (one per head and lane) in
// registers, each multiplied by a broadcast pair of every key's values; P independent sums.
// Also brings rows ahead[0..n_ahead) into L2, one cache line of each per 32 columns (a row of
// d BF16 values has d / 32 lines): spread over the block's products, not in bursts that fill
// the core's miss buffers.
template <int P>
TANDEM_AVX512_BF16 void lane_score_block(const uint16_t* qt, int64_t d, const uint16_t* const* keys,
                                         float* s, const uint16_t* const* ahead, int64_t n_ahead) {
  __m512 acc[P];
#pragma GCC unroll 16
  for (int j = 0; j < P; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    for (int64_t a = 0; a < n_ahead; ++a)
      _mm_prefetch(reinterpret_cast<const char*>(ahead[a] + c), _MM_HINT_T1);
    __m512i q[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) q[i] = _mm512_loadu_si512(qt + (c / 2 + i) * 32);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < P; ++j) {
        // The key pair as vdpbf16ps's broadcast memory operand (GCC would load it into a
        // register with a separate broadcast first).
        asm("vdpbf16ps %[k]%{1to16%}, %[q], %[acc]"
            : [acc] "+v"(acc[j])
            : [q] "v"(q[i]), [k] "m"(*reinterpret_cast<const int32_t*>(keys[j] + c + 2 * i)));
      }
  }
#pragma GCC unroll 16
  for (int j = 0; j < P; ++j) _mm512_storeu_ps(s + j * 16, acc[j]);
}

using LaneScoreBlock = void (*)(const uint16_t*, int64_t, const uint16_t* const*, float*,
                                const uint16_t* const*, int64_t);

constexpr int kLaneScorePositions = 8;

}  // namespace

TANDEM_AVX512_BF16 void mla_scores_bf16(const uint16_t* q, int64_t rows, int64_t d,
                                        const uint16_t* const* keys, int64_t count, float* s,
                                        int64_t lds, const RowPrefetch& ahead) {
  static constexpr ScoreBlock kBlocks[4][4] = {
      {score_block<1, 1>, score_block<1, 2>, score_block<1, 3>, score_block<1, 4>},
      {score_block<2, 1>, score_block<2, 2>, score_block<2, 3>, score_block<2, 4>},
      {score_block<3, 1>, score_block<3, 2>, score_block<3, 3>, score_block<3, 4>},
      {score_block<4, 1>, score_block<4, 2>, score_block<4, 3>, score_block<4, 4>}};
  // Up to 16 query rows (18 KB at d = 576) and four keys stay in L1 together: each key block is
  // read from L2 once per 16 rows, not once per 4.
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t r1 = std::min<int64_t>(r0 + 16, rows);
    for (int64_t j = 0; j < count; j += 4) {
      const int64_t n = std::min<int64_t>(4, count - j);
      if (r0 == 0) ahead.issue(j / 4, (count + 3) / 4);
      for (int64_t r = r0; r < r1; r += 4) {
        const int64_t h = std::min<int64_t>(4, r1 - r);
        kBlocks[h - 1][n - 1](q + r * d, d, keys + j, s + r * lds + j, lds);
      }
    }
  }
}

void RowPrefetch::issue(int64_t part, int64_t parts) const {
  for (int64_t r = count * part / parts; r < count * (part + 1) / parts; ++r)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[r]) + b, _MM_HINT_T1);
}

TANDEM_AVX512_BF16 int64_t mla_transpose_keys(const uint16_t* const* keys, int64_t count, int64_t d,
                                              uint16_t* out) {
  const int64_t padded = (count + 15) / 16 * 16;
  for (int64_t j0 = 0; j0 < padded; j0 += 16)
    for (int64_t c = 0; c < d; c += 32) {
      __m512i r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        r[i] = j0 + i < count ? _mm512_loadu_si512(keys[j0 + i] + c) : _mm512_setzero_si512();
      transpose16(r);
      // Word i of r[w]: columns c + 2w, c + 2w + 1 of position j0 + i.
#pragma GCC unroll 16
      for (int w = 0; w < 16; ++w) _mm512_storeu_si512(out + (c + 2 * w) * padded + 2 * j0, r[w]);
    }
  return padded;
}

TANDEM_AVX512_BF16 void mla_scores_bf16_transposed(const uint16_t* q, int64_t rows, int64_t d,
                                                   const uint16_t* transposed, int64_t padded,
                                                   float* s, int64_t lds,
                                                   const RowPrefetch& ahead) {
  static constexpr TransposedScoreBlock kBlocks[6][4] = {
      {transposed_score_block<1, 1>, transposed_score_block<1, 2>, transposed_score_block<1, 3>,
       transposed_score_block<1, 4>},
      {transposed_score_block<2, 1>, transposed_score_block<2, 2>, transposed_score_block<2, 3>,
       transposed_score_block<2, 4>},
      {transposed_score_block<3, 1>, transposed_score_block<3, 2>, transposed_score_block<3, 3>,
       transposed_score_block<3, 4>},
      {transposed_score_block<4, 1>, transposed_score_block<4, 2>, transposed_score_block<4, 3>,
       transposed_score_block<4, 4>},
      {transposed_score_block<5, 1>, transposed_score_block<5, 2>, transposed_score_block<5, 3>,
       transposed_score_block<5, 4>},
      {transposed_score_block<6, 1>, transposed_score_block<6, 2>, transposed_score_block<6, 3>,
       transposed_score_block<6, 4>}};
  for (int64_t j0 = 0; j0 < padded; j0 += 64) {
    const int64_t v = std::min<int64_t>(64, padded - j0) / 16;
    for (int64_t r = 0; r < rows; r += 6) {
      const int64_t h = std::min<int64_t>(6, rows - r);
      if (j0 == 0) ahead.issue(r / 6, (rows + 5) / 6);
      kBlocks[h - 1][v - 1](q + r * d, d, transposed, padded, j0, s + r * lds, lds);
    }
  }
}

TANDEM_AVX512_BF16 void mla_transpose_query16(const uint16_t* q, int64_t d, uint16_t* out) {
  for (int64_t c = 0; c < d; c += 32) {
    __m512i r[16];
#pragma GCC unroll 16
    for (int h = 0; h < 16; ++h) r[h] = _mm512_loadu_si512(q + h * d + c);
    transpose16(r);
    // Word h of r[w]: columns c + 2w, c + 2w + 1 of head h.
#pragma GCC unroll 16
    for (int w = 0; w < 16; ++w) _mm512_storeu_si512(out + (c / 2 + w) * 32, r[w]);
  }
}

TANDEM_AVX512_BF16 void mla_scores_bf16_lanes(const uint16_t* qt, int64_t d,
                                              const uint16_t* const* keys, int64_t count, float* s,
                                              const RowPrefetch& ahead) {
  static constexpr LaneScoreBlock kBlocks[kLaneScorePositions] = {
      lane_score_block<1>, lane_score_block<2>, lane_score_block<3>, lane_score_block<4>,
      lane_score_block<5>, lane_score_block<6>, lane_score_block<7>, lane_score_block<8>};
  const int64_t blocks = (count + kLaneScorePositions - 1) / kLaneScorePositions;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j = b * kLaneScorePositions;
    const int64_t n = std::min<int64_t>(kLaneScorePositions, count - j);
    const int64_t first = ahead.count * b / blocks, last = ahead.count * (b + 1) / blocks;
    kBlocks[n - 1](qt, d, keys + j, s + j * 16, ahead.rows + first, last - first);
  }
}

TANDEM_AVX512_BF16 void mla_lane_max(const float* s, int64_t n, float* top) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; ++j) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j * 16));
  _mm512_storeu_ps(top, m);
}

TANDEM_AVX512_BF16 void mla_probabilities_bf16_lanes(const float* s, int64_t n, const float* m,
                                                     int64_t padded, uint16_t* p, float* sums) {
  // Word h of a pair: head h's probabilities of the two positions (from the low 16 words of
  // each operand).
  alignas(64) uint16_t index[32];
  for (int i = 0; i < 32; ++i) index[i] = static_cast<uint16_t>(i / 2 + (i % 2 ? 32 : 0));
  const __m512i interleave = _mm512_load_si512(index);
  const __m512 top = _mm512_loadu_ps(m);
  // One position's rounded probabilities (BF16 in 16 words) and their float32 values.
  const auto probabilities = [&](int64_t j, __m512& sum) TANDEM_AVX512_BF16 {
    if (j >= n) return _mm256_setzero_si256();
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + j * 16), top);
    // As in mla_probabilities_bf16: vcvtneps2bf16 rounds like f32_to_bf16 on [2^-126, 1].
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(exp2_16(x));
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    return b;
  };
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < padded; j += 2) {
    const __m256i even = probabilities(j, sum);
    const __m256i odd = probabilities(j + 1, sum);
    _mm512_storeu_si512(p + (j / 2) * 32,
                        _mm512_permutex2var_epi16(_mm512_castsi256_si512(even), interleave,
                                                  _mm512_castsi256_si512(odd)));
  }
  _mm512_storeu_ps(sums, _mm512_add_ps(_mm512_loadu_ps(sums), sum));
}

TANDEM_AVX512_BF16 void mla_pair_values(const uint16_t* const* vals, int64_t count, int64_t width,
                                        uint16_t* out) {
  // Within 128-bit lanes (one cycle each, where a permutation across the whole vector costs
  // several): the low and the high four columns of each group of eight, interleaved.
  const int64_t pairs = (count + 1) / 2;
  for (int64_t c0 = 0; c0 < width; c0 += kPairedBlock) {
    const int64_t block = std::min(kPairedBlock, width - c0);
    uint16_t* dst = out + c0 * 2 * pairs;
    for (int64_t j = 0; j < count; j += 2, dst += 2 * block) {
      const uint16_t* a = vals[j];
      const uint16_t* b = j + 1 < count ? vals[j + 1] : nullptr;
      for (int64_t c = 0; c < block; c += 32) {
        const __m512i va = _mm512_loadu_si512(a + c0 + c);
        const __m512i vb = b ? _mm512_loadu_si512(b + c0 + c) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + 2 * c, _mm512_unpacklo_epi16(va, vb));
        _mm512_storeu_si512(dst + 2 * c + 32, _mm512_unpackhi_epi16(va, vb));
      }
    }
  }
}

TANDEM_AVX512_BF16 void mla_unpermute_columns(float* acc, int64_t rows, int64_t width) {
  // natural[k] = x[i] where mla_paired_column(i) = k.
  alignas(64) int32_t from[32];
  for (int i = 0; i < 32; ++i) from[mla_paired_column(i)] = i;
  const __m512i lo = _mm512_load_si512(from), hi = _mm512_load_si512(from + 16);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; c += 32) {
      float* x = acc + r * width + c;
      const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
      _mm512_storeu_ps(x, _mm512_permutex2var_ps(a, lo, b));
      _mm512_storeu_ps(x + 16, _mm512_permutex2var_ps(a, hi, b));
    }
}

TANDEM_AVX512_BF16 void mla_accumulate_bf16(const uint16_t* p, int64_t rows, int64_t row_stride,
                                            int64_t pair_stride, const uint16_t* paired,
                                            int64_t pairs, int64_t width, float* acc) {
  static constexpr AccumulateBlock kBlocks[6][2] = {
      {accumulate_block<1, 2>, accumulate_block<1, 4>},
      {accumulate_block<2, 2>, accumulate_block<2, 4>},
      {accumulate_block<3, 2>, accumulate_block<3, 4>},
      {accumulate_block<4, 2>, accumulate_block<4, 4>},
      {accumulate_block<5, 2>, accumulate_block<5, 4>},
      {accumulate_block<6, 2>, accumulate_block<6, 4>}};
  // Columns outside, rows inside: a column block of the paired values (contiguous, so that it
  // does not crowd a few L1 sets as rows 2 KB apart would) stays in L1 for every row.
  for (int64_t c = 0; c < width; c += kPairedBlock) {
    const int64_t v = std::min(kPairedBlock, width - c) / 32;  // 1: 32 columns, 2: 64
    for (int64_t r = 0; r < rows; r += 6) {
      const int64_t h = std::min<int64_t>(6, rows - r);
      kBlocks[h - 1][v - 1](p + r * row_stride, row_stride, pair_stride, paired, pairs, width, c,
                            acc + r * width);
    }
  }
}

TANDEM_AVX512_BF16 float mla_row_max(const float* s, int64_t n) {
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = none;
  for (int64_t j = 0; j < n; j += 16)
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(none, lanes(n - j), s + j));
  return _mm512_reduce_max_ps(top);
}

TANDEM_AVX512_BF16 float mla_probabilities_bf16(const float* s, int64_t n, float m, int64_t padded,
                                                uint16_t* p) {
  if (m == -std::numeric_limits<float>::infinity()) {
    std::fill_n(p, padded, uint16_t{0});
    return 0.0f;
  }
  const __m512 top = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < padded; j += 16) {
    const __mmask16 in = lanes(n - j), out = lanes(padded - j);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(in, s + j), top);
    // Probabilities lie in [2^-126, 1]: vcvtneps2bf16 rounds them to nearest even like
    // f32_to_bf16 (it only differs on subnormals and NaNs).
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(in, exp2_16(x)));
    _mm256_mask_storeu_epi16(p + j, out, b);
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
  }
  return _mm512_reduce_add_ps(sum);
}

}  // namespace tandem::kernels::avx512
