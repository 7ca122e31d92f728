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

// The first `width` values (a multiple of 32) of rows vals[0..count) in pairs of positions:
// out[(j / 2) * 2 * width + 2 * c + j % 2] = vals[j][c], an odd count padded with zeros. This is
// the operand layout of vdpbf16ps for sums over positions.
void mla_pair_values(const uint16_t* const* vals, int64_t count, int64_t width, uint16_t* out);

// acc[r * width + c] += sum_j p[r * ldp + j] * vals[j][c] for r < rows, j < 2 * pairs, over values
// paired by mla_pair_values; p BF16 with zeros past the positions that count.
void mla_accumulate_bf16(const uint16_t* p, int64_t rows, int64_t ldp, const uint16_t* paired,
                         int64_t pairs, int64_t width, float* acc);

// The largest of s[0..n), -inf when n is 0.
float mla_row_max(const float* s, int64_t n);

// One row's probabilities against its running maximum m (exp2 domain): p[j] = BF16(2^(s[j] - m))
// for j < n (2^x below 2^-126 is 0, as the float32 path's exp2), p[j] = 0 for n <= j < padded;
// returns the sum of the rounded p[j] (what the weights add up to). Every p[j] comes from the
// same vector code whatever n is (batch-invariant numerics). m = -inf: all zeros.
float mla_probabilities_bf16(const float* s, int64_t n, float m, int64_t padded, uint16_t* p);

}  // namespace tandem::kernels::avx512
