#pragma once
// AVX2 + FMA dot products of weight rows with float32 activation vectors: the decode and
// small-batch path on x86 CPUs without AVX-512 (matvec_avx512.h is the wider twin). Each weight
// is read from memory once for all the tokens of a step.
#include <cstdint>

namespace tandem::kernels::avx2 {

// AVX2 and FMA present.
bool available();

// y[t * ldy + r] = dot(w row r, x + t * cols) for r < rows, t < n: any number of tokens, each
// weight read from memory once (rows in blocks of three, tokens in blocks of four; one token:
// rows one by one, streamed with a prefetch). INT8 rows unscaled. A token's result for n >= 2 is
// the same whatever n is (one float32 accumulator per token and row); a single token sums in
// four partial accumulators (it differs from n >= 2 in rounding only), unless `one_row_kernel`
// is false: then it takes the blocked kernel too and its sums equal those of n >= 2 (batch-
// invariant numerics, ops.h).
void dot_rows_block_bf16(const uint16_t* w, int64_t rows, int64_t cols, const float* x, int64_t n,
                         float* y, int64_t ldy, bool one_row_kernel = true);
void dot_rows_block_i8(const int8_t* w, int64_t rows, int64_t cols, const float* x, int64_t n,
                       float* y, int64_t ldy, bool one_row_kernel = true);
void dot_rows_block_f32(const float* w, int64_t rows, int64_t cols, const float* x, int64_t n,
                        float* y, int64_t ldy, bool one_row_kernel = true);

// y[:cols] += sum_r a[r] * w[r, :] for r < rows (a transposed product; INT8 rows unscaled, so
// callers fold the row scales into a).
void axpy_rows_bf16(const uint16_t* w, int64_t rows, int64_t cols, const float* a, float* y);
void axpy_rows_i8(const int8_t* w, int64_t rows, int64_t cols, const float* a, float* y);
void axpy_rows_f32(const float* w, int64_t rows, int64_t cols, const float* a, float* y);

// The largest of x[0..n) (-inf for n = 0); NaNs are skipped.
float max_value(const float* x, int64_t n);

}  // namespace tandem::kernels::avx2
