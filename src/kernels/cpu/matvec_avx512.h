#pragma once
// AVX-512 dot products of one weight row with a few float32 activation vectors, for decode
// steps, where every weight byte is read once per step and memory bandwidth is the limit.
// Callers check has_avx512() first; the portable loops in ops.cpp serve other machines.
#include <cstdint>

namespace tandem::kernels::avx512 {

bool available();

// out[t] = dot(row, x + t * cols) for t < n (n <= 4), row in BF16 / INT8 (unscaled) / float32.
void dot_rows_bf16(const uint16_t* row, const float* x, int64_t cols, int64_t n, float* out);
void dot_rows_i8(const int8_t* row, const float* x, int64_t cols, int64_t n, float* out);
void dot_rows_f32(const float* row, const float* x, int64_t cols, int64_t n, float* out);

// AVX-512 BF16 (vdpbf16ps): 32 multiply-adds per instruction on BF16 pairs.
bool has_bf16_dot();
// x[n, cols] float32 -> BF16 rows of `stride` (>= cols rounded up to 32) elements, zero-padded.
void to_bf16_rows(const float* x, int64_t cols, int64_t n, int64_t stride, uint16_t* out);
// x[n] float32 -> BF16, bit-identical to f32_to_bf16 (bf16.h).
void to_bf16(const float* x, int64_t n, uint16_t* out);
// out[t] = dot(row, xb + t * stride) for t < n (n <= 4), both BF16, accumulated in float32.
void dot_rows_bf16_dp(const uint16_t* row, const uint16_t* xb, int64_t cols, int64_t stride,
                      int64_t n, float* out);

// AVX-512 VNNI (vpdpbusd): 64 multiply-adds of u8 x s8 per instruction, into int32.
bool has_vnni();
// x[n, cols] float32 -> per-token symmetric int8 (round to nearest, scale max|x|/127) stored as
// u8 = q + 128 in rows of `stride` (cols rounded up to 64) bytes, padded with 128 (zero).
void quantize_u8_rows(const float* x, int64_t cols, int64_t n, int64_t stride, uint8_t* out,
                      float* scales);
// out[t] = sum_c row[c] * xq[t * stride + c] for t < n (n <= 4), exact in int32.
void dot_rows_i8_vnni(const int8_t* row, const uint8_t* xq, int64_t cols, int64_t stride, int64_t n,
                      int32_t* out);

// out[i] = silu(gate[i]) * up[i] and the in-place softmax of x[n], with glibc's vectorised expf
// (libmvec, within a few ulp of expf).
void silu_mul(const float* gate, const float* up, int64_t n, float* out);
// The same product rounded to BF16 (the input of the next BF16 product).
void silu_mul_bf16(const float* gate, const float* up, int64_t n, uint16_t* out);
void softmax(float* x, int64_t n);
// softmax(scale * x[n]) rounded to BF16 into out, zeros in out[n, width); x is overwritten.
void softmax_to_bf16(float* x, int64_t n, float scale, int64_t width, uint16_t* out);
// y[n] += a * x[n]
void axpy(float a, const float* x, float* y, int64_t n);

// y[cols] += a * row, row in BF16: the building block of transposed products.
void axpy_row_bf16(float a, const uint16_t* row, float* y, int64_t cols);
// y[c] = sum_r x[r] * rows[r * cols + c] for c < cols, rows in BF16: the transposed product
// with y held in registers 256 columns at a time (no load and store of y per row).
void axpy_rows_bf16(const uint16_t* rows, int64_t count, int64_t cols, const float* x, float* y);
// y[cols] += a * row, row in INT8 (the caller folds the row scale into a).
void axpy_row_i8(float a, const int8_t* row, float* y, int64_t cols);

}  // namespace tandem::kernels::avx512
