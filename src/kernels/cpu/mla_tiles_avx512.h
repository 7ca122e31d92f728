#pragma once
// The tile products of the MLA decode kernel (mla_attention.h) on AVX-512 BF16, for BF16 latent
// caches: scores and the weighted sum take the cached rows as they are (no widening to float32)
// and multiply BF16 pairs with vdpbf16ps into float32 sums, twice the float32 FMA rate. Queries
// and probabilities are rounded to BF16 for it. Callers check avx512::has_bf16_dot() first.
#include <cstdint>

namespace tandem::kernels::avx512 {

// Cached rows to bring into L2 while a tile is computed. The score functions issue them a few
// rows at a time between their blocks: a whole tile's prefetches in one burst (over a thousand
// cache lines) stall on the core's miss buffers and hide less of the memory latency.
struct RowPrefetch {
  const uint16_t* const* rows = nullptr;
  int64_t count = 0;
  int64_t bytes = 0;  // per row
  // Rows [count * part / parts, count * (part + 1) / parts).
  void issue(int64_t part, int64_t parts) const;
};

// s[r * lds + j] = dot(q[r, :d], keys[j][:d]) for r < rows, j < count; q [rows, d] and the keys
// BF16, d a multiple of 32.
void mla_scores_bf16(const uint16_t* q, int64_t rows, int64_t d, const uint16_t* const* keys,
                     int64_t count, float* s, int64_t lds, const RowPrefetch& ahead = {});

// Keys [count][d] (count <= 64, d a multiple of 32) as pairs of columns by position, for scores
// without horizontal sums: out[(c / 2) * 2 * padded + 2 * j + c % 2] = keys[j][c], zeros for
// count <= j < padded; returns padded (count rounded up to 16).
int64_t mla_transpose_keys(const uint16_t* const* keys, int64_t count, int64_t d, uint16_t* out);

// s[r * lds + j] = dot(q[r, :d], keys[j][:d]) for r < rows, j < padded, over keys transposed by
// mla_transpose_keys: one broadcast pair of query values feeds 16 positions per product, so no
// score needs a horizontal sum. Faster than mla_scores_bf16 when many rows share the keys.
void mla_scores_bf16_transposed(const uint16_t* q, int64_t rows, int64_t d,
                                const uint16_t* transposed, int64_t padded, float* s, int64_t lds,
                                const RowPrefetch& ahead = {});

// Heads per group of the lane layout: a query token's 16 heads, one per float32 lane.
constexpr int64_t kMlaLaneHeads = 16;

// One query token's 16 heads [16][d] (BF16) in pairs of columns by head, the operand of
// mla_scores_bf16_lanes: out[(c / 2) * 32 + 2 * h + c % 2] = q[h * d + c]; d a multiple of 32.
void mla_transpose_query16(const uint16_t* q, int64_t d, uint16_t* out);

// Scores of 16 heads, one per lane: s[j * 16 + h] = dot(q[h, :d], keys[j][:d]) for j < count,
// over a query transposed by mla_transpose_query16. Each product multiplies a broadcast pair of
// a key's values into all 16 heads, so no score needs a sum across a vector (which costs 16% of
// the work at 16 heads the other way) and the keys need no transposing.
void mla_scores_bf16_lanes(const uint16_t* qt, int64_t d, const uint16_t* const* keys,
                           int64_t count, float* s, const RowPrefetch& ahead = {});

// top[h] = the largest of s[j * 16 + h] for j < n; -inf when n is 0.
void mla_lane_max(const float* s, int64_t n, float* top);

// The probabilities of 16 heads from lane scores s[j * 16 + h] against each head's running
// maximum m[h] (exp2 domain; finite where n > 0), as mla_probabilities_bf16 computes them, in
// pairs of positions by head: p[(j / 2) * 32 + 2 * h + j % 2] = BF16(2^(s[j * 16 + h] - m[h]))
// for j < n, zeros for n <= j < padded (even). sums[h] += the sum of head h's rounded p.
void mla_probabilities_bf16_lanes(const float* s, int64_t n, const float* m, int64_t padded,
                                  uint16_t* p, float* sums);

// Where the paired values put column c of a group of 32 (mla_pair_values): the accumulators of
// mla_accumulate_bf16 hold the columns in this order until mla_unpermute_columns.
constexpr int mla_paired_column(int i) {
  return i < 16 ? 8 * (i / 4) + i % 4 : 8 * ((i - 16) / 4) + 4 + i % 4;
}

// The first `width` values (a multiple of 32) of rows vals[0..count) in pairs of positions, by
// blocks of 64 columns (the last may have 32): block b, of w columns from c0 = 64 b, holds
// out[c0 * 2 * pairs + (j / 2) * 2 * w + 2 * (c - c0) + j % 2] = vals[j][c'], pairs =
// ceil(count / 2), an odd count padded with zeros, where c' = the 32-column group of c plus
// mla_paired_column(c % 32): the columns are permuted within groups of 32 (an interleave within
// 128-bit lanes is cheaper than one in order). This is the operand layout of vdpbf16ps for sums
// over positions, a block's pairs contiguous for mla_accumulate_bf16.
void mla_pair_values(const uint16_t* const* vals, int64_t count, int64_t width, uint16_t* out);

// Sums accumulated over paired values back into column order: acc[r * width + c] for r < rows.
void mla_unpermute_columns(float* acc, int64_t rows, int64_t width);

// acc[r * width + c] += sum_j p_r(j) * vals[j][c] for r < rows, j < 2 * pairs, over values paired
// by mla_pair_values. p_r(j) is BF16, the pair for positions j, j + 1 (j even) at
// p[r * row_stride + (j / 2) * pair_stride]: row_stride = ldp and pair_stride = 2 for rows of
// positions, 2 and 32 for mla_probabilities_bf16_lanes; zeros past the positions that count.
void mla_accumulate_bf16(const uint16_t* p, int64_t rows, int64_t row_stride, int64_t pair_stride,
                         const uint16_t* paired, int64_t pairs, int64_t width, float* acc);

// The largest of s[0..n), -inf when n is 0.
float mla_row_max(const float* s, int64_t n);

// One row's probabilities against its running maximum m (exp2 domain): p[j] = BF16(2^(s[j] - m))
// for j < n (2^x below 2^-126 is 0, as the float32 path's exp2), p[j] = 0 for n <= j < padded;
// returns the sum of the rounded p[j] (what the weights add up to). Every p[j] comes from the
// same vector code whatever n is (batch-invariant numerics). m = -inf: all zeros.
float mla_probabilities_bf16(const float* s, int64_t n, float m, int64_t padded, uint16_t* p);

}  // namespace tandem::kernels::avx512
