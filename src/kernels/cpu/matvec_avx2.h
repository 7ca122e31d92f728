#pragma once
// AVX2 + FMA dot products of one weight row with a few float32 activation vectors: the decode
// path on x86 CPUs without AVX-512 (matvec_avx512.h is the wider twin). Each weight row is read
// once for up to four tokens, so a decode batch streams the weights once per four sequences
// instead of once per sequence.
#include <cstdint>

namespace tandem::kernels::avx2 {

// AVX2 and FMA present.
bool available();

// out[t] = dot(row, x + t * cols) for t < n (n <= 4), row in BF16 / INT8 (unscaled) / float32;
// float32 products and sums (the same values as the portable loops up to summation order).
void dot_rows_bf16(const uint16_t* row, const float* x, int64_t cols, int64_t n, float* out);
void dot_rows_i8(const int8_t* row, const float* x, int64_t cols, int64_t n, float* out);
void dot_rows_f32(const float* row, const float* x, int64_t cols, int64_t n, float* out);

}  // namespace tandem::kernels::avx2
