#include "kernels/cpu/mla_attention.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/avx2_lanes.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/exp2_polynomial.h"
#include "kernels/cpu/matvec_avx2.h"
#include "kernels/cpu/matvec_avx512.h"
#include "kernels/cpu/mla_tiles_avx512.h"

namespace tandem::kernels {
namespace {

// Positions per tile: the scores of a tile (rows x kTile floats) and the rows' pointers stay in
// L1/L2 while its keys are read once for the scores and once more for the weighted sum.
constexpr int64_t kTile = 64;
// Contexts are split across threads in chunks of at least this many positions: below it, the
// merge and the extra partial sums cost more than the parallelism gives.
constexpr int64_t kMinChunk = 512;
// BF16 path: tiles ahead whose rows are prefetched, and the head count from which the keys are
// transposed for the scores (64 shuffles per 16 x 32 values, once per tile) rather than each
// score summed across its vector (45 operations per 16 scores, once per head and position).
constexpr int64_t kPrefetchTiles = 2;
constexpr int64_t kTransposedScoreHeads = 32;
// At 16, 32 or 64 heads (DeepSeek-V2-Lite; V3's 128 over 8, 4 or 2 ranks) each group of 16 heads
// of a query token takes the lanes of one vector (mla_scores_bf16_lanes): no sums across vectors,
// keys read as they are. Measured at 16K positions, 2 threads, % of the BF16 peak, transposed
// keys against lanes: 32 heads 39-45 / 55-58 (one query token), 51 / 64-67 (two), 53-63 / 65-69
// (four); 64 heads 35-52 / 63-66, 53-59 / 65-67, 67-72 / 66-69; 128 heads 48-62 / 62-68,
// 69-72 / 67-69, 76-85 / 68-76. The choice depends on the head count alone, not on the query
// tokens, so that a query's result has the same bits in any step (the two paths sum a row's
// probabilities in different orders).
constexpr bool lane_layout(int64_t heads) {
  return heads % avx512::kMlaLaneHeads == 0 && heads <= 4 * avx512::kMlaLaneHeads;
}
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The three tile operations, in a portable and an AVX2 version. Tiles are float32: a BF16 tile
// is widened once (tile_rows) and then read by every head and query row, for the scores and again
// for the weighted sum, instead of being widened on each of those reads.
struct TileKernels {
  // s[r, j] = dot(q[r, :d], keys[j][:d]) for r < rows, j < count; s has row stride lds.
  void (*scores)(const float* q, int64_t rows, int64_t d, const float* const* keys, int64_t count,
                 float* s, int64_t lds);
  // acc[r, :width] += sum_j p[r, j] vals[j][:width].
  void (*accumulate)(const float* p, int64_t rows, int64_t ldp, const float* const* vals,
                     int64_t count, int64_t width, float* acc);
  // x[i] = 2^x[i] (0 for -inf) for i < n.
  void (*exp2)(float* x, int64_t n);
  // out[i] = BF16 x[i] as float32 for i < n (exact).
  void (*widen)(const uint16_t* x, int64_t n, float* out);
};

void scores_portable(const float* q, int64_t rows, int64_t d, const float* const* keys,
                     int64_t count, float* s, int64_t lds) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < count; ++j) {
      float sum = 0;
      for (int64_t c = 0; c < d; ++c) sum += q[r * d + c] * keys[j][c];
      s[r * lds + j] = sum;
    }
}

void accumulate_portable(const float* p, int64_t rows, int64_t ldp, const float* const* vals,
                         int64_t count, int64_t width, float* acc) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < count; ++j) {
      const float w = p[r * ldp + j];
      if (w == 0.0f) continue;
      for (int64_t c = 0; c < width; ++c) acc[r * width + c] += w * vals[j][c];
    }
}

void widen_portable(const uint16_t* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(x[i]);
}

void exp2_portable(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp2(x[i]);
}

using avx2::sum8;

// H query rows x J keys of scores: every key vector loaded once feeds H products, every query
// vector J; H * J accumulators plus J keys and one query fill the 16 registers at 4 x 3.
template <int H, int J>
TANDEM_AVX2 void score_block(const float* q, int64_t d, const float* const* keys, float* s,
                             int64_t lds) {
  __m256 acc[H][J];
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < J; ++j) acc[h][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    __m256 k[J];
    for (int j = 0; j < J; ++j) k[j] = _mm256_loadu_ps(keys[j] + c);
    for (int h = 0; h < H; ++h) {
      const __m256 qv = _mm256_loadu_ps(q + h * d + c);
      for (int j = 0; j < J; ++j) acc[h][j] = _mm256_fmadd_ps(qv, k[j], acc[h][j]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < J; ++j) s[h * lds + j] = sum8(acc[h][j]);
}

using ScoreBlock = void (*)(const float*, int64_t, const float* const*, float*, int64_t);

TANDEM_AVX2 void scores_avx2(const float* q, int64_t rows, int64_t d, const float* const* keys,
                             int64_t count, float* s, int64_t lds) {
  static constexpr ScoreBlock kBlocks[4][3] = {
      {score_block<1, 1>, score_block<1, 2>, score_block<1, 3>},
      {score_block<2, 1>, score_block<2, 2>, score_block<2, 3>},
      {score_block<3, 1>, score_block<3, 2>, score_block<3, 3>},
      {score_block<4, 1>, score_block<4, 2>, score_block<4, 3>}};
  for (int64_t r = 0; r < rows; r += 4) {
    const int64_t h = std::min<int64_t>(4, rows - r);
    for (int64_t j = 0; j < count; j += 3) {
      const int64_t n = std::min<int64_t>(3, count - j);
      kBlocks[h - 1][n - 1](q + r * d, d, keys + j, s + r * lds + j, lds);
    }
  }
}

// H rows x 16 columns of the weighted sum, held in registers over the tile's positions: each
// value vector loaded once feeds H rows (12 accumulators at H = 6, two values, one broadcast;
// the unroll pragmas keep GCC from spilling them to the stack).
template <int H, int V>
TANDEM_AVX2 void accumulate_block(const float* p, int64_t ldp, const float* const* vals,
                                  int64_t count, int64_t c0, float* acc, int64_t lda) {
  __m256 a[H][V];
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) a[h][v] = _mm256_loadu_ps(acc + h * lda + c0 + 8 * v);
  for (int64_t j = 0; j < count; ++j) {
    __m256 x[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) x[v] = _mm256_loadu_ps(vals[j] + c0 + 8 * v);
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) {
      const __m256 w = _mm256_broadcast_ss(p + h * ldp + j);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) a[h][v] = _mm256_fmadd_ps(w, x[v], a[h][v]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc + h * lda + c0 + 8 * v, a[h][v]);
}

using AccumulateBlock = void (*)(const float*, int64_t, const float* const*, int64_t, int64_t,
                                 float*, int64_t);

TANDEM_AVX2 void accumulate_avx2(const float* p, int64_t rows, int64_t ldp,
                                 const float* const* vals, int64_t count, int64_t width,
                                 float* acc) {
  static constexpr AccumulateBlock kBlocks[6][2] = {
      {accumulate_block<1, 1>, accumulate_block<1, 2>},
      {accumulate_block<2, 1>, accumulate_block<2, 2>},
      {accumulate_block<3, 1>, accumulate_block<3, 2>},
      {accumulate_block<4, 1>, accumulate_block<4, 2>},
      {accumulate_block<5, 1>, accumulate_block<5, 2>},
      {accumulate_block<6, 1>, accumulate_block<6, 2>}};
  // Columns outside, rows inside: the tile's 16 value columns stay in L1 for every row.
  for (int64_t c = 0; c < width; c += 16) {
    const int64_t v = std::min<int64_t>(16, width - c) / 8;
    for (int64_t r = 0; r < rows; r += 6) {
      const int64_t h = std::min<int64_t>(6, rows - r);
      kBlocks[h - 1][v - 1](p + r * ldp, ldp, vals, count, c, acc + r * width, width);
    }
  }
}

// 2^x: x = i + f with i an integer and |f| <= 1/2; 2^f from kExp2Polynomial, 2^i added to the
// exponent bits.
// x < -126 (and -inf) gives 0, where float32 would leave the normal range.
TANDEM_AVX2 inline __m256 exp2_8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(127.0f));
  const __m256 i = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, i);
  __m256 p = _mm256_set1_ps(kExp2Polynomial[0]);
#pragma GCC unroll 8
  for (int k = 1; k < 7; ++k) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Polynomial[k]));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(i), 23);
  const __m256 r = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
  return _mm256_andnot_ps(tiny, r);
}

TANDEM_AVX2 void exp2_avx2(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp2_8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) x[i] = x[i] < -126.0f ? 0.0f : std::exp2(x[i]);
}

// n a multiple of 8 (tile_kernels checks the widths).
TANDEM_AVX2 void widen_avx2(const uint16_t* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 8) {
    _mm256_storeu_ps(out + i, avx2::load8(x + i));
  }
}

TileKernels tile_kernels(const MlaShape& shape, bool simd) {
  if (simd && avx2::available() && shape.latent % 8 == 0 && shape.rope % 8 == 0)
    return {scores_avx2, accumulate_avx2, exp2_avx2, widen_avx2};
  return {scores_portable, accumulate_portable, exp2_portable, widen_portable};
}

// Pointers to the n cached rows from position t0 on, as float32: the cache's own rows when it is
// float32, else rows widened into `widened`.
template <typename T>
void tile_rows(const MlaShape& shape, const TileKernels& k, const T* const* pages, int64_t t0,
               int64_t n, std::vector<float>& widened, const float** rows) {
  const int64_t d = shape.entry();
  for (int64_t j = 0; j < n; ++j) {
    const T* row = pages[(t0 + j) / shape.block_size] + ((t0 + j) % shape.block_size) * d;
    if constexpr (std::is_same_v<T, float>) {
      rows[j] = row;
    } else {
      float* out = widened.data() + j * d;
      k.widen(row, d, out);
      rows[j] = out;
    }
  }
}

void multiply(float* acc, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) acc[i] *= factor;
}

// acc[i] *= 2^-shift (shift > 0) by subtracting shift from the exponent field. Values that would
// leave the normal range become (signed) zero; infinities and NaNs stay as they are.
void shift_exponent(float* acc, int64_t n, int32_t shift) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, acc + i, 4);
    const int32_t exponent = static_cast<int32_t>((bits >> 23) & 0xFF);
    if (exponent == 0xFF) continue;
    bits = exponent > shift ? bits - (static_cast<uint32_t>(shift) << 23) : bits & 0x80000000u;
    std::memcpy(acc + i, &bits, 4);
  }
}

// Raises a row's running maximum m to a tile's largest score `top` (exp2 domain), rescaling its
// sum l and accumulator acc[width] to it, by the chosen path.
void raise_maximum(MlaRescale rescale, float top, int64_t width, float& m, float& l, float* acc) {
  if (top <= m) return;
  if (rescale == MlaRescale::kMultiply) {
    if (m != kNegInf) {
      const float factor = std::exp2(m - top);
      multiply(acc, width, factor);
      l *= factor;
    }
    m = top;
  } else if (m == kNegInf) {
    m = std::ceil(top);  // AMLA keeps the maximum an integer
  } else if (top - m > 254.0f) {
    // Every float32 weight so far would underflow: what the guard would leave, without a shift
    // count that may not fit an int.
    std::fill_n(acc, width, 0.0f);
    l = 0.0f;
    m = std::ceil(top);
  } else {
    const auto shift = static_cast<int32_t>(std::ceil(top - m));
    shift_exponent(acc, width, shift);
    l = std::ldexp(l, -shift);
    m += static_cast<float>(shift);
  }
}

// Causal: query token i of a sequence sees positions < context - s_q + i + 1; of the n positions
// from t0, how many row r (query token x head) sees.
int64_t visible_positions(const MlaShape& shape, const MlaSequence& seq, int64_t r, int64_t t0,
                          int64_t n) {
  const int64_t limit = seq.context - seq.s_q + r / shape.heads + 1;
  return std::clamp<int64_t>(limit - t0, 0, n);
}

// One tile's bookkeeping of the online softmax for every row (query token x head): masks what the
// row may not see, raises its running maximum m (rescaling acc and l to it), and leaves the
// scores relative to it in s (exp2 domain), ready for exp2.
void rebase_tile(const MlaShape& shape, const MlaSequence& seq, int64_t t0, int64_t n,
                 MlaRescale rescale, float* s, float* m, float* l, float* acc) {
  const int64_t rows = seq.s_q * shape.heads, width = shape.latent;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * kTile;
    const int64_t visible = visible_positions(shape, seq, r, t0, n);
    std::fill(row + visible, row + n, kNegInf);
    const float top = visible > 0 ? *std::max_element(row, row + visible) : kNegInf;
    raise_maximum(rescale, top, width, m[r], l[r], acc + r * width);
    if (m[r] == kNegInf) continue;  // nothing visible yet: the row stays -inf, p = 0
    for (int64_t j = 0; j < visible; ++j) row[j] -= m[r];
  }
}

// Whole vectors even past n (rows are kTile wide; what lies there is never read): every
// probability then comes from the same exp2, however long the tile, so a query's weights do not
// depend on where its step's context ends (batch-invariant numerics).
void exp2_tile(const TileKernels& k, int64_t rows, int64_t n, float* s) {
  const int64_t vector_n = std::min(kTile, (n + 7) / 8 * 8);
  for (int64_t r = 0; r < rows; ++r) k.exp2(s + r * kTile, vector_n);
}

// The unnormalised partial result of positions [begin, end) of a sequence: per row (query token
// x head) its running maximum m (exp2 domain), the sum l of its probabilities and acc = sum p v.
template <typename T>
void attend_chunk(const MlaShape& shape, const MlaSequence& seq, int64_t begin, int64_t end,
                  const TileKernels& k, MlaRescale rescale, float* m, float* l, float* acc) {
  const int64_t rows = seq.s_q * shape.heads, d = shape.entry(), width = shape.latent;
  // Queries scaled once so that scores come out in the exp2 domain.
  thread_local std::vector<float> q, s, widened;
  thread_local std::vector<const float*> pos;
  q.resize(rows * d);
  s.resize(rows * kTile);
  pos.resize(kTile);
  if constexpr (!std::is_same_v<T, float>) widened.resize(kTile * d);
  const float qscale = shape.scale * kLog2e;
  for (int64_t i = 0; i < rows * d; ++i) q[i] = seq.q[i] * qscale;
  std::fill_n(m, rows, kNegInf);
  std::fill_n(l, rows, 0.0f);
  std::fill_n(acc, rows * width, 0.0f);
  const auto* pages = reinterpret_cast<const T* const*>(seq.pages);

  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t n = std::min(kTile, end - t0);
    tile_rows(shape, k, pages, t0, n, widened, pos.data());
    k.scores(q.data(), rows, d, pos.data(), n, s.data(), kTile);
    rebase_tile(shape, seq, t0, n, rescale, s.data(), m, l, acc);
    exp2_tile(k, rows, n, s.data());
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += s[r * kTile + j];
      l[r] += sum;
    }
    k.accumulate(s.data(), rows, kTile, pos.data(), n, width, acc);
  }
}

// The first 64-byte boundary of v resized to hold n values from there.
uint16_t* aligned64(std::vector<uint16_t>& v, int64_t n) {
  v.resize(n + 32);
  const auto address = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((64 - address % 64) % 64) / 2;
}

// attend_chunk for a BF16 cache with BF16 products (AVX-512 BF16): the cached rows are read as
// they are, queries and probabilities rounded to BF16 (l sums the rounded probabilities, so the
// weights still add up to one), float32 sums.
void attend_chunk_bf16(const MlaShape& shape, const MlaSequence& seq, int64_t begin, int64_t end,
                       MlaRescale rescale, float* m, float* l, float* acc) {
  const int64_t rows = seq.s_q * shape.heads, d = shape.entry(), width = shape.latent;
  thread_local std::vector<float> q, s;
  thread_local std::vector<uint16_t> qb, lane_q, pb, paired, transposed;
  thread_local std::vector<const uint16_t*> pos, ahead;
  ahead.resize(kPrefetchTiles * kTile);
  q.resize(rows * d);
  uint16_t* qa = aligned64(qb, rows * d);
  uint16_t* keys = aligned64(transposed, kTile * d);
  s.resize(rows * kTile);
  pb.resize(rows * kTile);
  paired.resize(kTile * width);
  pos.resize(kTile);
  const float qscale = shape.scale * kLog2e;
  for (int64_t i = 0; i < rows * d; ++i) q[i] = seq.q[i] * qscale;
  avx512::to_bf16(q.data(), rows * d, qa);
  const bool lanes = lane_layout(shape.heads);
  if (lanes) {  // each group of 16 heads transposed once for the whole chunk
    uint16_t* qt = aligned64(lane_q, rows * d);
    for (int64_t g = 0; g < rows / avx512::kMlaLaneHeads; ++g)
      avx512::mla_transpose_query16(qa + g * avx512::kMlaLaneHeads * d, d,
                                    qt + g * avx512::kMlaLaneHeads * d);
    qa = qt;
  }
  std::fill_n(m, rows, kNegInf);
  std::fill_n(l, rows, 0.0f);
  std::fill_n(acc, rows * width, 0.0f);
  const auto* pages = reinterpret_cast<const uint16_t* const*>(seq.pages);

  const auto row_at = [&](int64_t t) {
    return pages[t / shape.block_size] + (t % shape.block_size) * d;
  };
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t n = std::min(kTile, end - t0), even = (n + 1) / 2 * 2;
    for (int64_t j = 0; j < n; ++j) pos[j] = row_at(t0 + j);
    // The rows kPrefetchTiles tiles ahead into L2 (a row is only 18 cache lines, too short a
    // stream for the hardware prefetcher: the scores stalled on it), issued by the score
    // functions a few rows at a time; the first tile issues the tiles before that as well.
    const int64_t ahead_end = std::min(t0 + (kPrefetchTiles + 1) * kTile, end);
    const int64_t ahead_begin = t0 == begin ? std::min(t0 + kTile, end) : ahead_end - kTile;
    for (int64_t t = ahead_begin; t < ahead_end; ++t) ahead[t - ahead_begin] = row_at(t);
    const avx512::RowPrefetch prefetch{ahead.data(), std::max<int64_t>(ahead_end - ahead_begin, 0),
                                       d * 2};
    if (lanes) {
      // The paths below pair the values after their scores: the transposed one measured slower
      // with them paired first (128 heads: 67% against 74% of the peak).
      avx512::mla_pair_values(pos.data(), n, width, paired.data());
      // Per group of 16 heads (of one query token): their scores [position][head],
      // probabilities in pairs of positions by head, and the weighted sum.
      constexpr int64_t kLane = avx512::kMlaLaneHeads;
      for (int64_t g = 0; g < rows / kLane; ++g) {
        const int64_t r0 = g * kLane;
        float* sg = s.data() + r0 * kTile;
        avx512::mla_scores_bf16_lanes(qa + r0 * d, d, pos.data(), n, sg,
                                      g == 0 ? prefetch : avx512::RowPrefetch{});
        const int64_t visible = visible_positions(shape, seq, r0, t0, n);
        float top[kLane];
        avx512::mla_lane_max(sg, visible, top);
        for (int64_t h = 0; h < kLane; ++h)
          raise_maximum(rescale, top[h], width, m[r0 + h], l[r0 + h], acc + (r0 + h) * width);
        uint16_t* pg = pb.data() + r0 * kTile;
        avx512::mla_probabilities_bf16_lanes(sg, visible, m + r0, even, pg, l + r0);
        // Per group (its sums still in L1 from the rescale): one call for all groups, reading
        // each block of values once, measured slower (128 heads: 47-50% against 62-65%).
        avx512::mla_accumulate_bf16(pg, kLane, 2, 2 * kLane, paired.data(), even / 2, width,
                                    acc + r0 * width);
      }
      continue;  // with the next tile
    }
    if (shape.heads >= kTransposedScoreHeads) {
      const int64_t padded = avx512::mla_transpose_keys(pos.data(), n, d, keys);
      avx512::mla_scores_bf16_transposed(qa, rows, d, keys, padded, s.data(), kTile, prefetch);
    } else {
      avx512::mla_scores_bf16(qa, rows, d, pos.data(), n, s.data(), kTile, prefetch);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = s.data() + r * kTile;
      const int64_t visible = visible_positions(shape, seq, r, t0, n);
      raise_maximum(rescale, avx512::mla_row_max(row, visible), width, m[r], l[r], acc + r * width);
      l[r] += avx512::mla_probabilities_bf16(row, visible, m[r], even, pb.data() + r * kTile);
    }
    avx512::mla_pair_values(pos.data(), n, width, paired.data());
    avx512::mla_accumulate_bf16(pb.data(), rows, kTile, 2, paired.data(), even / 2, width, acc);
  }
  avx512::mla_unpermute_columns(acc, rows, width);
}

template <typename T>
void decode(const MlaShape& shape, std::span<const MlaSequence> sequences,
            const MlaOptions& options) {
  const TileKernels k = tile_kernels(shape, options.simd);
  const int64_t width = shape.latent, threads = omp_get_max_threads();
  const bool bf16_dot = std::is_same_v<T, uint16_t> && options.simd && options.bf16_dot &&
                        avx512::has_bf16_dot() && shape.latent % 32 == 0 && shape.rope % 32 == 0;
  struct Chunk {
    size_t sequence;
    int64_t begin, end, offset;  // offset: first row of the chunk's partial sums
  };
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_chunk;
  int64_t total_rows = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const auto& seq = sequences[i];
    first_chunk.push_back(static_cast<int64_t>(chunks.size()));
    const int64_t pieces =
        std::clamp<int64_t>((seq.context + kMinChunk - 1) / kMinChunk, 1, threads);
    // Chunk boundaries on tile boundaries, so every chunk but the last has whole tiles.
    const int64_t tiles = (seq.context + kTile - 1) / kTile;
    const int64_t per = options.fixed_chunks ? (kMinChunk + kTile - 1) / kTile * kTile
                                             : (tiles + pieces - 1) / pieces * kTile;
    for (int64_t b = 0; b < seq.context; b += per) {
      chunks.push_back({i, b, std::min(b + per, seq.context), total_rows});
      total_rows += seq.s_q * shape.heads;
    }
  }
  first_chunk.push_back(static_cast<int64_t>(chunks.size()));
  std::vector<float> m(total_rows), l(total_rows), acc(total_rows * width);
#pragma omp parallel for schedule(dynamic, 1) if (chunks.size() > 1)
  for (size_t c = 0; c < chunks.size(); ++c) {
    const Chunk& ch = chunks[c];
    if (bf16_dot)
      attend_chunk_bf16(shape, sequences[ch.sequence], ch.begin, ch.end, options.rescale,
                        m.data() + ch.offset, l.data() + ch.offset, acc.data() + ch.offset * width);
    else
      attend_chunk<T>(shape, sequences[ch.sequence], ch.begin, ch.end, k, options.rescale,
                      m.data() + ch.offset, l.data() + ch.offset, acc.data() + ch.offset * width);
  }
  // Merge: every chunk's sums rescaled to the row's overall maximum, then normalised.
  for (size_t i = 0; i < sequences.size(); ++i) {
    const auto& seq = sequences[i];
    const int64_t rows = seq.s_q * shape.heads;
    for (int64_t r = 0; r < rows; ++r) {
      float top = kNegInf;
      for (int64_t c = first_chunk[i]; c < first_chunk[i + 1]; ++c)
        top = std::max(top, m[chunks[c].offset + r]);
      float* out = seq.out + r * width;
      std::fill_n(out, width, 0.0f);
      double total = 0;
      for (int64_t c = first_chunk[i]; c < first_chunk[i + 1]; ++c) {
        const int64_t row = chunks[c].offset + r;
        if (m[row] == kNegInf) continue;
        const float factor = std::exp2(m[row] - top);
        total += static_cast<double>(l[row]) * factor;
        const float* part = acc.data() + row * width;
        for (int64_t x = 0; x < width; ++x) out[x] += factor * part[x];
      }
      const auto inv = static_cast<float>(1.0 / total);
      for (int64_t x = 0; x < width; ++x) out[x] *= inv;
    }
  }
}

}  // namespace

void mla_decode(const MlaShape& shape, std::span<const MlaSequence> sequences,
                const MlaOptions& options) {
  if (shape.type == LatentType::kBF16)
    decode<uint16_t>(shape, sequences, options);
  else
    decode<float>(shape, sequences, options);
}

double mla_decode_flops(const MlaShape& shape, int64_t s_q, int64_t context) {
  return 2.0 * s_q * shape.heads * static_cast<double>(context) * (shape.entry() + shape.latent);
}

}  // namespace tandem::kernels
