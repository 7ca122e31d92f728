#pragma once
// AVX2 + FMA dot products of weight rows with float32 activation vectors: the decode and
// small-batch path on x86 CPUs without AVX-512 (matvec_avx512.h is the wider twin). Each weight
// is read from memory once for all the tokens of a step.
#include <cstdint>

namespace tandem::kernels::avx2 {

// AVX2 and FMA present.
bool available();

// y[t * ldy + r] = dot(w row r, x + t * cols) for r < rows, t < n: any number of tokens, each
// weight read from memory once (rows in blocks of three, tokens in blocks of four). INT8 rows
// unscaled. Each result is the same whatever n is (one float32 accumulator per token and row).
void dot_rows_block_bf16(const uint16_t* w, int64_t rows, int64_t cols, const float* x, int64_t n,
                         float* y, int64_t ldy);
void dot_rows_block_i8(const int8_t* w, int64_t rows, int64_t cols, const float* x, int64_t n,
                       float* y, int64_t ldy);
void dot_rows_block_f32(const float* w, int64_t rows, int64_t cols, const float* x, int64_t n,
                        float* y, int64_t ldy);

}  // namespace tandem::kernels::avx2
