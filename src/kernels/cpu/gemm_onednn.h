#pragma once
// Matrix products over many tokens through oneDNN (Debian's libdnnl): BF16 weights run on its
// AVX-512 BF16 kernels with activations rounded to BF16, float32 weights on its float32 kernels.
// Primitives are created once per shape and cached.
#include <cstdint>

#include "kernels/cpu/ops.h"

namespace tandem::kernels {

// y[n, rows] = x[n, cols] W^T. Returns false for weight types oneDNN is not used for (INT8).
bool onednn_matmul(const Matrix& w, const float* x, int64_t n, float* y);

// acc[n, rows] = xq[n, cols] (u8) W^T (INT8 weights, unscaled), exact int32 sums: oneDNN's VNNI
// integer GEMM. Returns false when oneDNN has no kernel for it on this CPU.
bool onednn_matmul_u8s8(const Matrix& w, const uint8_t* xq, int64_t n, int32_t* acc);

}  // namespace tandem::kernels
