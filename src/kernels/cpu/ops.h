#pragma once
// CPU kernels of the forward pass. Activations are float32; weights may be float32, bfloat16 or
// int8 with per-row scales. Hot loops are compiled for several instruction sets and chosen at
// run time (GCC target_clones), so one binary runs everywhere and uses AVX-512 where present.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/cpu/packed_weights.h"

namespace tandem::kernels {

enum class WeightType { kF32, kBF16, kI8 };

// A dense weight matrix W [rows, cols], row-major: y = W x. `data` may point into a mapped
// checkpoint or into `storage`; int8 weights carry one float scale per row.
struct Matrix {
  int64_t rows = 0, cols = 0;
  WeightType type = WeightType::kF32;
  const void* data = nullptr;
  std::vector<float> row_scales;  // kI8 only
  // kI8 only: the sum of each row's int8 values. The VNNI products take unsigned activations
  // (int8 + 128); this is what removes the offset again. Filled by set_int8_row_sums().
  std::vector<int32_t> row_sums;
  std::vector<uint8_t> storage;  // owned bytes when the weights were converted at load
  // Set by pack_for_gemm(): every product reads this copy instead of `data` (GEMMs and the
  // few-token decode kernels alike), so the plain rows are read only by row-range products
  // (absorbed attention) and the batch-invariant kernels, and need not stay resident otherwise.
  std::shared_ptr<const PackedWeights> packed;
  size_t bytes() const;
};

// A matrix over memory the caller owns, without scales or packing (activations used as an operand).
inline Matrix matrix_view(int64_t rows, int64_t cols, WeightType type, const void* data) {
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.type = type;
  m.data = data;
  return m;
}

// Computes row_sums of an INT8 matrix (once, at load).
void set_int8_row_sums(Matrix& w);

// Adds a copy of a BF16 or INT8 matrix in the blocked layout (packed_weights.h) of oneDNN's
// AVX-512 BF16 / VNNI GEMMs, which our row-block kernels (packed_matvec_avx512.h) read too. BF16
// products of fewer than 256 tokens (decode steps, an MoE expert's few dozen tokens of a prompt)
// and INT8 ones of few tokens stream each row block front to back for up to six tokens at a time,
// without the repacking oneDNN does on every call of a plain matrix (a quarter of the time at 48
// tokens); products of hundreds of tokens run oneDNN's exact-shape kernels on this copy in chunks
// of 256 tokens, faster than the runtime-shape gemm the plain matrix gets. The caller may then
// release the plain rows' memory (model::Weights drops their pages). Returns false, changing
// nothing, where oneDNN's kernels would not read this layout (CPUs without AVX-512 BF16 / VNNI).
// With an arena, the copy is carved from it (a loader's many matrices share huge pages);
// without, it gets a mapping of its own.
bool pack_for_gemm(Matrix& w, util::HugePageArena* arena = nullptr);

// Batch-invariant numerics (process-wide; off by default): every product below computes each
// token's row with the same kernel and the same reduction order whatever n is (the row kernels
// with float32 activations; never oneDNN's GEMMs, whose blocking and BF16 rounding depend on
// the shape), so a token's results do not depend on how many tokens share its step. INT8
// products on VNNI CPUs are exact integer sums either way. Slower for many tokens: the price of
// bit-identical outputs across batching, chunking, prefix-cache hits and KV transfers.
void set_batch_invariant(bool on);
bool batch_invariant();

// y[t, r] = sum_c W[r, c] * x[t, c] for t < n. x is [n, cols], y is [n, rows]. With many tokens
// and BF16 weights, activations are rounded to BF16 for the GEMM (where the CPU has BF16 GEMMs;
// elsewhere the weights are widened to float32 in panels and activations stay float32). With INT8
// weights (and a CPU with AVX-512 VNNI) activations are quantised per token to int8 (symmetric,
// scale max|x|/127), as W8A8 checkpoints are meant to run, and the products are exact integer dot
// products.
void matmul(const Matrix& w, const float* x, int64_t n, float* y);
// Whether matmul(w, x, n) rounds the activations to BF16 for a GEMM: then a caller with several
// products of the same activations can round them once (to_bf16) and call matmul_bf16.
bool gemm_takes_bf16(const Matrix& w, int64_t n);
// Whether this CPU has BF16 GEMM kernels (AVX-512 BF16); without them BF16 products widen to
// float32, and callers that choose an element type for their own products should pick float32.
bool bf16_gemm_available();
// matmul for activations already rounded to BF16 (x [n, cols]), with the same result. Weights
// other than BF16, or products oneDNN has no kernel for, widen x back to float32 first.
void matmul_bf16(const Matrix& w, const uint16_t* x, int64_t n, float* y);
// The same product with activations kept in float32 whatever n is: for the MoE router, whose
// top-k choice must not flip on activation rounding (DeepSeek computes it in float32 too).
void matmul_f32_activations(const Matrix& w, const float* x, int64_t n, float* y);
// Row r of W as float32 into out[cols].
void matrix_row(const Matrix& w, int64_t r, float* out);
// y[cols] = sum_r x[r] * W[first + r, :] for r < count: a transposed product over a row range.
void matvec_transposed(const Matrix& w, int64_t first, int64_t count, const float* x, float* y);
// y[count] = W[first .. first + count) x: a product over a row range. On packed BF16 weights and
// whole row blocks of 64 (outside batch-invariant numerics) x is rounded to BF16, as in matmul.
void matvec_rows(const Matrix& w, int64_t first, int64_t count, const float* x, float* y);

// C[m, n] = A[m, k] B, float32 sums: A row-major (row stride lda); B [k, n] row-major (ldb), or
// with b_transposed B^T [n, k] row-major (ldb); C row-major (ldc). The products of attention
// (scores Q K^T, outputs P V), in BF16 or in float32.
void gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b,
               int64_t ldb, bool b_transposed, float* c, int64_t ldc);
void gemm_f32(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
              int64_t ldb, bool b_transposed, float* c, int64_t ldc);

void rmsnorm(const float* x, const float* weight, int64_t n, int64_t dim, double eps, float* y);
// out[i] = silu(gate[i]) * up[i]
void silu_mul(const float* gate, const float* up, int64_t n, float* out);
// The same, rounded to BF16 (for matmul_bf16).
void silu_mul_bf16(const float* gate, const float* up, int64_t n, uint16_t* out);
// x[n] float32 -> BF16, rounding to nearest even (bf16.h's f32_to_bf16).
void to_bf16(const float* x, int64_t n, uint16_t* out);
// In-place softmax of x[n] (max-subtracted, float32).
void softmax(float* x, int64_t n);
// out[i] = softmax(scale * x)[i] rounded to BF16 for i < n, zero for n <= i < width (a causal
// row of attention probabilities). x is overwritten.
void softmax_to_bf16(float* x, int64_t n, float scale, int64_t width, uint16_t* out);
float dot(const float* a, const float* b, int64_t n);
// Index of the largest of x[0..n), the lowest on ties (as std::max_element); NaNs are never
// chosen unless every value is one (then 0). A vectorised maximum, then the first index holding
// it: a greedy token over a 129K-token vocabulary in tens of microseconds, not hundreds.
int64_t argmax(const float* x, int64_t n);
// y += a * x
void axpy(float a, const float* x, float* y, int64_t n);

}  // namespace tandem::kernels
