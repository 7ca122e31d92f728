#pragma once
// Products of up to a few hundred tokens with packed weights (packed_weights.h): decode steps and
// the MoE experts of a prompt. Each row block is streamed front to back once for up to six tokens,
// their 64 outputs per token held in four vector registers each, no horizontal sums; more tokens
// pass over L2-sized column chunks of the block several times. BF16 weights take BF16 activations
// (vdpbf16ps, float32 sums), INT8 weights u8 activations (vpdpbusd, exact int32 sums), as the
// GEMMs on the same copy do. Callers check avx512::has_bf16_dot() / has_vnni() first.
#include <cstdint>

#include "kernels/cpu/packed_weights.h"

namespace tandem::kernels::avx512 {

// y[t * ldy + i] = sum_c W[r, c] * xb[t * stride + c] for t < n and the rows r = 64 *
// first_block + i of row blocks [first_block, first_block + blocks) that exist (r < rows). xb:
// BF16 rows of `stride` >= cols_padded elements, zero from cols on.
void packed_rows_bf16(const PackedWeights& w, int64_t first_block, int64_t blocks,
                      const uint16_t* xb, int64_t stride, int64_t n, float* y, int64_t ldy);

// acc[t * ldacc + i] = sum_c W[r, c] * xq[t * stride + c], rows as above (INT8 weights, unscaled;
// xq holds q + 128 as quantize_u8_rows writes it, `stride` >= cols_padded, padded with 128), exact.
void packed_rows_i8(const PackedWeights& w, int64_t first_block, int64_t blocks, const uint8_t* xq,
                    int64_t stride, int64_t n, int32_t* acc, int64_t ldacc);

}  // namespace tandem::kernels::avx512
