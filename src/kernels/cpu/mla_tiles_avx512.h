#pragma once
// The tile products of the MLA decode kernel (mla_attention.h) on AVX-512 BF16, for BF16 latent
// caches: scores and the weighted sum take the cached rows as they are (no widening to float32)
// and multiply BF16 pairs with vdpbf16ps into float32 sums, twice the float32 FMA rate. Queries
// and probabilities are rounded to BF16 for it. Callers check avx512::has_bf16_dot() first.
#include <cstdint>

namespace tandem::kernels::avx512 {

// s[r * lds + j] = dot(q[r, :d], keys[j][:d]) for r < rows, j < count; q [rows, d] and the keys
// BF16, d a multiple of 32.
void mla_scores_bf16(const uint16_t* q, int64_t rows, int64_t d, const uint16_t* const* keys,
                     int64_t count, float* s, int64_t lds);

// The first `width` values (a multiple of 32) of rows vals[0..count) in pairs of positions:
// out[(j / 2) * 2 * width + 2 * c + j % 2] = vals[j][c], an odd count padded with zeros. This is
// the operand layout of vdpbf16ps for sums over positions.
void mla_pair_values(const uint16_t* const* vals, int64_t count, int64_t width, uint16_t* out);

// acc[r * width + c] += sum_j p[r * ldp + j] * vals[j][c] for r < rows, j < 2 * pairs, over values
// paired by mla_pair_values; p BF16 with zeros past the positions that count.
void mla_accumulate_bf16(const uint16_t* p, int64_t rows, int64_t ldp, const uint16_t* paired,
                         int64_t pairs, int64_t width, float* acc);

}  // namespace tandem::kernels::avx512
