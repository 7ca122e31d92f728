#pragma once
// Matrix products over many tokens through oneDNN (Debian's libdnnl): BF16 weights run on its
// AVX-512 BF16 kernels with activations rounded to BF16, float32 weights on its float32 kernels.
// Primitives are created once per shape and cached.
#include <cstdint>

#include "kernels/cpu/ops.h"

namespace tandem::kernels {

// y[n, rows] = x[n, cols] W^T. Returns false for weight types oneDNN is not used for (INT8).
bool onednn_matmul(const Matrix& w, const float* x, int64_t n, float* y);
// The same for activations already in BF16 (BF16 weights only).
bool onednn_matmul_bf16(const Matrix& w, const uint16_t* x, int64_t n, float* y);
// Whether oneDNN has a BF16 matrix product on this CPU (its 2.x releases need AVX-512; without it
// BF16 weights take the float32-activation loops, and no activation is rounded to BF16).
bool onednn_has_bf16_matmul();

// C[m, n] = A[m, k] B with float32 C, A and B both BF16 (`bf16`) or both float32: A row-major
// with row stride lda; B [k, n] row-major (ldb), or with `b_transposed` B^T [n, k] row-major;
// C row-major (ldc). Every size and stride is given at run time, so one primitive per
// combination of type and transposition serves all attention shapes. False without a kernel.
bool onednn_gemm(bool bf16, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
                 const void* b, int64_t ldb, bool b_transposed, float* c, int64_t ldc);

// acc[n, rows] = xq[n, cols] (u8) W^T (INT8 weights, unscaled), exact int32 sums: oneDNN's VNNI
// integer GEMM. Returns false when oneDNN has no kernel for it on this CPU.
bool onednn_matmul_u8s8(const Matrix& w, const uint8_t* xq, int64_t n, int32_t* acc);

}  // namespace tandem::kernels
