#include "kernels/cpu/ops.h"

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/gemm_onednn.h"
#include "kernels/cpu/matvec_avx2.h"
#include "kernels/cpu/matvec_avx512.h"
#include "kernels/cpu/packed_matvec_avx512.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

namespace tandem::kernels {
namespace {

// From this many tokens on, a product is compute-bound and goes to oneDNN.
constexpr int64_t kGemmMinTokens = 4;
// INT8 products go to oneDNN's integer GEMM, and BF16/INT8 products without a native GEMM are
// widened to float32 panels, only when enough tokens share the cost (below 32 tokens the AVX2
// row blocks, which read each weight once, are faster than widening: 2x at a decode batch of 16).
constexpr int64_t kInt8GemmMinTokens = 16;
// Packed BF16 products below this many tokens run the packed row kernels (six tokens per pass
// over a row block), not oneDNN: as fast from 256 tokens on, and 5-15% faster on the 24-160-token
// shapes of a prompt's MoE experts (one expert per thread, weights streamed from DRAM) and of
// batched decode.
constexpr int64_t kPackedRowsMaxTokens = 256;
constexpr int64_t kWidenMinTokens = 32;
// Threads claim the row blocks of a streamed product a few at a time (OpenMP's dynamic schedule),
// not in one static half each: on a VM one vCPU often runs slower than the other for a while,
// and a static split then waits for the slow half, where claimed blocks let the faster thread
// take more (batch-1 decode was faster so in 8 of 9 alternating pairs of runs on this VM). Four
// blocks of 64 rows keep the claims few.
constexpr int kRowBlocksPerClaim = 4;

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define TANDEM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TANDEM_CLONES
#endif

// Several independent accumulators keep the FMA pipes busy and let the compiler vectorise.
TANDEM_CLONES float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) acc[k] += a[i + k] * b[i + k];
  float s = 0;
  for (int k = 0; k < 16; ++k) s += acc[k];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Sum of squares in double precision, eight independent accumulators (a single chain of double
// additions made rmsnorm latency-bound).
TANDEM_CLONES double sum_squares(const float* x, int64_t n) {
  double acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += static_cast<double>(x[i + k]) * x[i + k];
  double s = 0;
  for (int k = 0; k < 8; ++k) s += acc[k];
  for (; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

TANDEM_CLONES float dot_bf16(const uint16_t* w, const float* x, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int k = 0; k < 16; ++k) {
      uint32_t bits = static_cast<uint32_t>(w[i + k]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      acc[k] += f * x[i + k];
    }
  }
  float s = 0;
  for (int k = 0; k < 16; ++k) s += acc[k];
  for (; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(w[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    s += f * x[i];
  }
  return s;
}

TANDEM_CLONES float dot_i8(const int8_t* w, const float* x, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) acc[k] += static_cast<float>(w[i + k]) * x[i + k];
  float s = 0;
  for (int k = 0; k < 16; ++k) s += acc[k];
  for (; i < n; ++i) s += static_cast<float>(w[i]) * x[i];
  return s;
}

// What the portable kernels need of each weight type: its element size, one row's dot product
// with x, and one row widened to float32. One table instead of a switch in each kernel.
struct WeightTypeKernels {
  WeightType type;
  size_t bytes;
  float (*row_dot)(const Matrix& w, int64_t r, const float* x);
  void (*row)(const Matrix& w, int64_t r, float* out);
};

template <typename T>
const T* row_of(const Matrix& w, int64_t r) {
  return static_cast<const T*>(w.data) + r * w.cols;
}

constexpr WeightTypeKernels kWeightTypes[] = {
    {WeightType::kF32, 4,
     [](const Matrix& w, int64_t r, const float* x) {
       return dot_f32(row_of<float>(w, r), x, w.cols);
     },
     [](const Matrix& w, int64_t r, float* out) { std::copy_n(row_of<float>(w, r), w.cols, out); }},
    {WeightType::kBF16, 2,
     [](const Matrix& w, int64_t r, const float* x) {
       return dot_bf16(row_of<uint16_t>(w, r), x, w.cols);
     },
     [](const Matrix& w, int64_t r, float* out) {
       const uint16_t* row = row_of<uint16_t>(w, r);
       for (int64_t c = 0; c < w.cols; ++c) out[c] = bf16_to_f32(row[c]);
     }},
    {WeightType::kI8, 1,
     [](const Matrix& w, int64_t r, const float* x) {
       return dot_i8(row_of<int8_t>(w, r), x, w.cols) * w.row_scales[r];
     },
     [](const Matrix& w, int64_t r, float* out) {
       const int8_t* row = row_of<int8_t>(w, r);
       const float scale = w.row_scales[r];
       for (int64_t c = 0; c < w.cols; ++c) out[c] = row[c] * scale;
     }},
};

const WeightTypeKernels& kernels_of(WeightType t) {
  return kWeightTypes[static_cast<size_t>(t)];
}
static_assert(static_cast<size_t>(WeightType::kF32) == 0 &&
                  static_cast<size_t>(WeightType::kBF16) == 1 &&
                  static_cast<size_t>(WeightType::kI8) == 2,
              "kWeightTypes is indexed by WeightType");

float row_dot(const Matrix& w, int64_t r, const float* x) {
  return kernels_of(w.type).row_dot(w, r, x);
}

// y[t * ldy + i] = W[first + i, :] . x[t] for i < rows, t < n, on the AVX2 kernels (INT8 rows
// scaled).
void dot_rows_avx2(const Matrix& w, int64_t first, int64_t rows, const float* x, int64_t n,
                   float* y, int64_t ldy) {
  const bool one = !batch_invariant();  // batch-invariant: one token sums as several do
  if (w.type == WeightType::kBF16) {
    avx2::dot_rows_block_bf16(static_cast<const uint16_t*>(w.data) + first * w.cols, rows, w.cols,
                              x, n, y, ldy, one);
  } else if (w.type == WeightType::kI8) {
    avx2::dot_rows_block_i8(static_cast<const int8_t*>(w.data) + first * w.cols, rows, w.cols, x, n,
                            y, ldy, one);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < rows; ++i) y[t * ldy + i] *= w.row_scales[first + i];
  } else {
    avx2::dot_rows_block_f32(static_cast<const float*>(w.data) + first * w.cols, rows, w.cols, x, n,
                             y, ldy, one);
  }
}

// out[i] = W[r, :] . x[i] for i < m (m <= 4): the weight row is streamed once for all of them.
// `fast`: AVX-512 is there; else AVX2 when it is (the row streamed once for all m tokens too),
// else the portable loops, one pass over the row per token.
void row_dots(const Matrix& w, int64_t r, const float* x, int64_t m, float* out, bool fast) {
  if (!fast && avx2::available()) {
    dot_rows_avx2(w, r, 1, x, m, out, 1);
  } else if (!fast) {
    for (int64_t i = 0; i < m; ++i) out[i] = row_dot(w, r, x + i * w.cols);
  } else if (w.type == WeightType::kBF16) {
    avx512::dot_rows_bf16(static_cast<const uint16_t*>(w.data) + r * w.cols, x, w.cols, m, out);
  } else if (w.type == WeightType::kI8) {
    avx512::dot_rows_i8(static_cast<const int8_t*>(w.data) + r * w.cols, x, w.cols, m, out);
    for (int64_t i = 0; i < m; ++i) out[i] *= w.row_scales[r];
  } else {
    avx512::dot_rows_f32(static_cast<const float*>(w.data) + r * w.cols, x, w.cols, m, out);
  }
}

// An INT8 product's output from its exact sum of W_i8[r, :] times the activations stored as
// q + 128: the offset removed (with the row's sum), then the row's and the token's scales.
inline float int8_output(const Matrix& w, int64_t r, int32_t sum, float x_scale) {
  return static_cast<float>(sum - 128 * w.row_sums[r]) * w.row_scales[r] * x_scale;
}

// INT8 weights times activations quantised per token: integer products (VNNI), then one scale
// per row and token. Few tokens stream each weight row once for up to four of them; many go
// to oneDNN's integer GEMM.
void matmul_int8_vnni(const Matrix& w, const float* x, int64_t n, float* y, bool try_gemm = true) {
  const bool gemm = try_gemm && n >= kInt8GemmMinTokens;
  const int64_t stride = gemm ? w.cols : (w.cols + 63) / 64 * 64;
  thread_local std::vector<uint8_t> xq;
  thread_local std::vector<float> xs;
  thread_local std::vector<int32_t> acc;
  xq.resize(static_cast<size_t>(n * stride));
  xs.resize(static_cast<size_t>(n));
  uint8_t* xqp = xq.data();
  float* xsp = xs.data();
#pragma omp parallel for schedule(static) if (n * w.cols > (1 << 16))
  for (int64_t t = 0; t < n; ++t)
    avx512::quantize_u8_rows(x + t * w.cols, w.cols, 1, stride, xqp + t * stride, xsp + t);
  if (gemm) {
    acc.resize(static_cast<size_t>(n * w.rows));
    if (onednn_matmul_u8s8(w, xqp, n, acc.data())) {
      const int32_t* a = acc.data();
#pragma omp parallel for schedule(static) if (n * w.rows > (1 << 15))
      for (int64_t t = 0; t < n; ++t)
        for (int64_t r = 0; r < w.rows; ++r)
          y[t * w.rows + r] = int8_output(w, r, a[t * w.rows + r], xsp[t]);
      return;
    }
    // No oneDNN kernel: quantise again with the padded stride the row kernel expects.
    matmul_int8_vnni(w, x, n, y, /*try_gemm=*/false);
    return;
  }
  const auto* base = static_cast<const int8_t*>(w.data);
#pragma omp parallel for schedule(static) if (w.rows * w.cols > (1 << 15))
  for (int64_t r = 0; r < w.rows; ++r) {
    for (int64_t t = 0; t < n; t += 4) {
      const int64_t m = std::min<int64_t>(4, n - t);
      int32_t out[4];
      avx512::dot_rows_i8_vnni(base + r * w.cols, xqp + t * stride, w.cols, stride, m, out);
      for (int64_t i = 0; i < m; ++i)
        y[(t + i) * w.rows + r] = int8_output(w, r, out[i], xsp[t + i]);
    }
  }
}

// x [n, w.cols] rounded to BF16 in rows of the packed copy's padded width (zeros past cols), as
// the BF16 decode kernels take it; a per-thread buffer.
const uint16_t* packed_bf16_activations(const Matrix& w, const float* x, int64_t n) {
  const int64_t stride = w.packed->layout.cols_padded;
  thread_local std::vector<uint16_t> xb;
  xb.resize(static_cast<size_t>(n * stride));
  avx512::to_bf16_rows(x, w.cols, n, stride, xb.data());
  return xb.data();
}

// BF16 activations in rows of the packed copy's padded width (the rows of `x` themselves where
// that is their width) times packed BF16 weights; threads take row blocks.
void packed_rows_bf16_parallel(const Matrix& w, const uint16_t* xb, int64_t n, float* y) {
  const PackedLayout& l = w.packed->layout;
#pragma omp parallel for schedule(dynamic, kRowBlocksPerClaim) if (w.rows * w.cols > (1 << 15))
  for (int64_t b = 0; b < l.blocks(); ++b)
    avx512::packed_rows_bf16(*w.packed, b, 1, xb, l.cols_padded, n, y + b * l.kBlockRows, w.rows);
}

// Whether a product of n tokens on w runs the packed BF16 row kernels.
bool takes_packed_bf16_rows(const Matrix& w, int64_t n) {
  return w.packed && w.type == WeightType::kBF16 && n < kPackedRowsMaxTokens &&
         !batch_invariant() && avx512::has_bf16_dot();
}

// Few tokens on packed weights (the row kernels over the one packed copy; BF16 up to a few
// hundred): BF16 rows with activations rounded to BF16, INT8 rows with activations quantised per
// token, as the GEMMs on the same copy do. Threads take row blocks.
void matmul_packed_rows(const Matrix& w, const float* x, int64_t n, float* y) {
  const PackedLayout& l = w.packed->layout;
  const int64_t stride = l.cols_padded;
  const bool parallel = w.rows * w.cols > (1 << 15);
  if (w.type == WeightType::kBF16) {
    packed_rows_bf16_parallel(w, packed_bf16_activations(w, x, n), n, y);
    return;
  }
  thread_local std::vector<uint8_t> xq;
  thread_local std::vector<float> xs;
  thread_local std::vector<int32_t> acc;
  xq.resize(static_cast<size_t>(n * stride));
  xs.resize(static_cast<size_t>(n));
  acc.resize(static_cast<size_t>(n * w.rows));
  avx512::quantize_u8_rows(x, w.cols, n, stride, xq.data(), xs.data());
  const uint8_t* xqp = xq.data();
  int32_t* a = acc.data();
#pragma omp parallel for schedule(dynamic, kRowBlocksPerClaim) if (parallel)
  for (int64_t b = 0; b < l.blocks(); ++b)
    avx512::packed_rows_i8(*w.packed, b, 1, xqp, stride, n, a + b * l.kBlockRows, w.rows);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < w.rows; ++r)
      y[t * w.rows + r] = int8_output(w, r, a[t * w.rows + r], xs[t]);
}

// The portable product behind gemm_bf16 and gemm_f32 where oneDNN has no kernel.
template <typename T, typename Widen>
void gemm_loops(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
                bool b_transposed, float* c, int64_t ldc, Widen widen) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float s = 0;
      for (int64_t p = 0; p < k; ++p)
        s += widen(a[i * lda + p]) * widen(b_transposed ? b[j * ldb + p] : b[p * ldb + j]);
      c[i * ldc + j] = s;
    }
}

// BF16 or INT8 weights where oneDNN has no GEMM for them (CPUs without AVX-512 BF16 or VNNI):
// panels of rows widened to float32 (exactly; INT8 rows scaled) and multiplied by oneDNN's
// float32 GEMM, which runs near the FMA peak where the row kernels reach about a fifth of it.
// Activations stay float32, as on the row kernels (INT8 rows get them quantised to integers by
// matmul_int8_on_float_kernels). A panel (about 4 MB) stays in L2/L3 while the
// GEMM reads it; widening costs about 1/n of the product's work.
bool matmul_widened(const Matrix& w, const float* x, int64_t n, float* y) {
  const int64_t panel_rows = std::clamp<int64_t>((4 << 20) / (w.cols * 4), 16, w.rows);
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(panel_rows * w.cols));
  float* pp = panel.data();
  for (int64_t r0 = 0; r0 < w.rows; r0 += panel_rows) {
    const int64_t rows = std::min(panel_rows, w.rows - r0);
#pragma omp parallel for schedule(static) if (rows * w.cols > (1 << 16))
    for (int64_t r = 0; r < rows; ++r) matrix_row(w, r0 + r, pp + r * w.cols);
    if (!onednn_gemm(false, n, rows, w.cols, x, w.cols, pp, w.cols, /*b_transposed=*/true, y + r0,
                     w.rows))
      return false;
  }
  return true;
}

}  // namespace

void set_int8_row_sums(Matrix& w) {
  w.row_sums.assign(static_cast<size_t>(w.rows), 0);
  const auto* base = static_cast<const int8_t*>(w.data);
#pragma omp parallel for schedule(static) if (w.rows * w.cols > (1 << 16))
  for (int64_t r = 0; r < w.rows; ++r) {
    int32_t s = 0;
    for (int64_t c = 0; c < w.cols; ++c) s += base[r * w.cols + c];
    w.row_sums[r] = s;
  }
}

size_t Matrix::bytes() const {
  return static_cast<size_t>(rows * cols) * kernels_of(type).bytes;
}

namespace {
std::atomic<bool> g_batch_invariant{false};
}  // namespace

void set_batch_invariant(bool on) {
  g_batch_invariant.store(on, std::memory_order_relaxed);
}

bool batch_invariant() {
  return g_batch_invariant.load(std::memory_order_relaxed);
}

namespace {

// INT8 weights where the VNNI kernels do not run (no VNNI, or no row sums): the same W8A8 product
// they compute, so a model gives the same logits on every CPU. The activations are quantised per
// token as quantize_u8_rows does (scale max|x| / 127, round to nearest, clamp to +-127) and kept
// as float32 integers; the float kernels multiply them by the INT8 rows (each product exact, the
// sums exact up to 2^24; the widened GEMM's rows carry their scale already, so there it is the
// W8A8 product to float32 rounding) and the row scales, then the token's scale is applied.
void matmul_int8_on_float_kernels(const Matrix& w, const float* x, int64_t n, float* y) {
  thread_local std::vector<float> xq;
  thread_local std::vector<float> xs;
  xq.resize(static_cast<size_t>(n * w.cols));
  xs.resize(static_cast<size_t>(n));
  float* xqp = xq.data();
  float* xsp = xs.data();
#pragma omp parallel for schedule(static) if (n * w.cols > (1 << 16))
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = x + t * w.cols;
    float amax = 0;
    for (int64_t c = 0; c < w.cols; ++c) amax = std::max(amax, std::abs(xt[c]));
    const float scale = amax > 0 ? amax / 127.0f : 1.0f, inv = 1.0f / scale;
    xsp[t] = scale;
    for (int64_t c = 0; c < w.cols; ++c)
      xqp[t * w.cols + c] = std::clamp(std::nearbyint(xt[c] * inv), -127.0f, 127.0f);
  }
  if (batch_invariant() || n < kWidenMinTokens || !matmul_widened(w, xqp, n, y))
    matmul_f32_activations(w, xqp, n, y);
#pragma omp parallel for schedule(static) if (n * w.rows > (1 << 16))
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < w.rows; ++r) y[t * w.rows + r] *= xsp[t];
}

}  // namespace

void matmul(const Matrix& w, const float* x, int64_t n, float* y) {
  if (w.type == WeightType::kI8 && !(avx512::has_vnni() && !w.row_sums.empty())) {
    matmul_int8_on_float_kernels(w, x, n, y);
    return;
  }
  // INT8 products reaching here run on VNNI: integer sums, the same whatever the batch.
  if (batch_invariant() && w.type != WeightType::kI8) {
    matmul_f32_activations(w, x, n, y);
    return;
  }
  // Many tokens: compute-bound, oneDNN's GEMM. Few tokens: bandwidth-bound, stream each weight
  // row once and reuse it for up to six tokens. Packed BF16 weights up to a few hundred tokens:
  // the packed row kernels, which keep up with oneDNN there.
  if (takes_packed_bf16_rows(w, n)) {
    matmul_packed_rows(w, x, n, y);
    return;
  }
  if (n >= kGemmMinTokens && (w.type == WeightType::kF32 || w.type == WeightType::kBF16) &&
      onednn_matmul(w, x, n, y))
    return;
  if (w.packed && n < (w.type == WeightType::kI8 ? kInt8GemmMinTokens : kGemmMinTokens)) {
    matmul_packed_rows(w, x, n, y);
    return;
  }
  if (n <= 4 && w.type == WeightType::kBF16 && avx512::has_bf16_dot()) {
    // Few tokens, BF16 weights: round the activations to BF16 too (as the GEMM does) and use
    // vdpbf16ps, 32 multiply-adds per instruction, so each core keeps up with DRAM.
    const int64_t stride = (w.cols + 31) / 32 * 32;
    thread_local std::vector<uint16_t> xb;
    xb.resize(static_cast<size_t>(n * stride));
    avx512::to_bf16_rows(x, w.cols, n, stride, xb.data());
    const auto* base = static_cast<const uint16_t*>(w.data);
    const uint16_t* xbp = xb.data();
#pragma omp parallel for schedule(static) if (w.rows * w.cols > (1 << 15))
    for (int64_t r = 0; r < w.rows; ++r) {
      float out[4];
      avx512::dot_rows_bf16_dp(base + r * w.cols, xbp, w.cols, stride, n, out);
      for (int64_t i = 0; i < n; ++i) y[i * w.rows + r] = out[i];
    }
    return;
  }
  if (w.type == WeightType::kI8) {
    matmul_int8_vnni(w, x, n, y);
    return;
  }
  if (n >= kWidenMinTokens && w.type != WeightType::kF32 && matmul_widened(w, x, n, y)) return;
  matmul_f32_activations(w, x, n, y);
}

bool gemm_takes_bf16(const Matrix& w, int64_t n) {
  return !batch_invariant() && n >= kGemmMinTokens && w.type == WeightType::kBF16 &&
         onednn_has_bf16_matmul();
}

bool bf16_gemm_available() {
  return onednn_has_bf16_matmul();
}

void matmul_bf16(const Matrix& w, const uint16_t* x, int64_t n, float* y) {
  // The row kernels read x in place where its rows are as wide as the packed copy's (every model
  // matrix's); padded widths keep oneDNN's GEMM.
  if (gemm_takes_bf16(w, n) && takes_packed_bf16_rows(w, n) &&
      w.packed->layout.cols_padded == w.cols)
    return packed_rows_bf16_parallel(w, x, n, y);
  if (gemm_takes_bf16(w, n) && onednn_matmul_bf16(w, x, n, y)) return;
  // Widening is exact, and matmul rounds these values back to the same BF16 ones.
  thread_local std::vector<float> wide;
  wide.resize(static_cast<size_t>(n * w.cols));
  for (int64_t i = 0; i < n * w.cols; ++i) wide[i] = bf16_to_f32(x[i]);
  matmul(w, wide.data(), n, y);
}

void matmul_f32_activations(const Matrix& w, const float* x, int64_t n, float* y) {
  if (!batch_invariant() && n >= kGemmMinTokens && w.type == WeightType::kF32 &&
      onednn_matmul(w, x, n, y))
    return;
  const bool fast = avx512::available();
  if (!fast && avx2::available()) {
    // Chunks of rows per thread; within one, every weight is read once for all n tokens.
    constexpr int64_t kRowChunk = 48;
#pragma omp parallel for schedule(static) if (w.rows * w.cols > (1 << 15))
    for (int64_t r0 = 0; r0 < w.rows; r0 += kRowChunk)
      dot_rows_avx2(w, r0, std::min(kRowChunk, w.rows - r0), x, n, y + r0, w.rows);
    return;
  }
#pragma omp parallel for schedule(static) if (w.rows * w.cols > (1 << 15))
  for (int64_t r = 0; r < w.rows; ++r) {
    for (int64_t t = 0; t < n; t += 4) {
      const int64_t m = std::min<int64_t>(4, n - t);
      float out[4];
      row_dots(w, r, x + t * w.cols, m, out, fast);
      for (int64_t i = 0; i < m; ++i) y[(t + i) * w.rows + r] = out[i];
    }
  }
}

void matrix_row(const Matrix& w, int64_t r, float* out) {
  kernels_of(w.type).row(w, r, out);
}

void matvec_transposed(const Matrix& w, int64_t first, int64_t count, const float* x, float* y) {
  std::fill(y, y + w.cols, 0.0f);
  if (w.type == WeightType::kBF16 && avx512::available()) {
    const auto* base = static_cast<const uint16_t*>(w.data) + first * w.cols;
    avx512::axpy_rows_bf16(base, count, w.cols, x, y);
    return;
  }
  if (w.type == WeightType::kI8 && avx512::available()) {
    const auto* base = static_cast<const int8_t*>(w.data) + first * w.cols;
    for (int64_t r = 0; r < count; ++r)
      avx512::axpy_row_i8(x[r] * w.row_scales[first + r], base + r * w.cols, y, w.cols);
    return;
  }
  if (avx2::available()) {
    if (w.type == WeightType::kBF16) {
      avx2::axpy_rows_bf16(static_cast<const uint16_t*>(w.data) + first * w.cols, count, w.cols, x,
                           y);
    } else if (w.type == WeightType::kI8) {
      thread_local std::vector<float> scaled;
      scaled.resize(count);
      for (int64_t r = 0; r < count; ++r) scaled[r] = x[r] * w.row_scales[first + r];
      avx2::axpy_rows_i8(static_cast<const int8_t*>(w.data) + first * w.cols, count, w.cols,
                         scaled.data(), y);
    } else {
      avx2::axpy_rows_f32(static_cast<const float*>(w.data) + first * w.cols, count, w.cols, x, y);
    }
    return;
  }
  thread_local std::vector<float> row;
  row.resize(w.cols);
  for (int64_t r = 0; r < count; ++r) {
    matrix_row(w, first + r, row.data());
    axpy(x[r], row.data(), y, w.cols);
  }
}

void matvec_rows(const Matrix& w, int64_t first, int64_t count, const float* x, float* y) {
  const int64_t block = PackedLayout::kBlockRows;
  if (w.packed && w.type == WeightType::kBF16 && !batch_invariant() && first % block == 0 &&
      count % block == 0) {
    // Whole row blocks of the packed copy (absorbed attention's W_UV rows of a head): 64 outputs
    // at a time without a reduction per row; x rounded to BF16 as every BF16 product rounds it.
    avx512::packed_rows_bf16(*w.packed, first / block, count / block,
                             packed_bf16_activations(w, x, 1), w.packed->layout.cols_padded, 1, y,
                             count);
    return;
  }
  const bool fast = avx512::available();
  for (int64_t r = 0; r < count; ++r) row_dots(w, first + r, x, 1, y + r, fast);
}

void gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b,
               int64_t ldb, bool b_transposed, float* c, int64_t ldc) {
  if (onednn_gemm(true, m, n, k, a, lda, b, ldb, b_transposed, c, ldc)) return;
  gemm_loops(m, n, k, a, lda, b, ldb, b_transposed, c, ldc, bf16_to_f32);
}

void gemm_f32(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
              int64_t ldb, bool b_transposed, float* c, int64_t ldc) {
  if (onednn_gemm(false, m, n, k, a, lda, b, ldb, b_transposed, c, ldc)) return;
  gemm_loops(m, n, k, a, lda, b, ldb, b_transposed, c, ldc, [](float v) { return v; });
}

void rmsnorm(const float* x, const float* weight, int64_t n, int64_t dim, double eps, float* y) {
#pragma omp parallel for schedule(static) if (n * dim > (1 << 15))
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = x + t * dim;
    const double ss = sum_squares(xt, dim);
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
    for (int64_t i = 0; i < dim; ++i) y[t * dim + i] = xt[i] * inv * weight[i];
  }
}

void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  if (avx512::available()) {
    constexpr int64_t kChunk = 1 << 14;
#pragma omp parallel for schedule(static) if (n > (1 << 15))
    for (int64_t i = 0; i < n; i += kChunk)
      avx512::silu_mul(gate + i, up + i, std::min(kChunk, n - i), out + i);
    return;
  }
#pragma omp parallel for schedule(static) if (n > (1 << 15))
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void silu_mul_bf16(const float* gate, const float* up, int64_t n, uint16_t* out) {
  constexpr int64_t kChunk = 1 << 14;
  const bool fast = avx512::available();
#pragma omp parallel for schedule(static) if (n > (1 << 15))
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t m = std::min(kChunk, n - i);
    if (fast) {
      avx512::silu_mul_bf16(gate + i, up + i, m, out + i);
    } else {
      for (int64_t k = i; k < i + m; ++k)
        out[k] = f32_to_bf16(gate[k] / (1.0f + std::exp(-gate[k])) * up[k]);
    }
  }
}

void to_bf16(const float* x, int64_t n, uint16_t* out) {
  constexpr int64_t kChunk = 1 << 15;
  const bool fast = avx512::available();
  if (fast && n <= kChunk) return avx512::to_bf16(x, n, out);  // no parallel region for a row
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t m = std::min(kChunk, n - i);
    if (fast) {
      avx512::to_bf16(x + i, m, out + i);
    } else {
      for (int64_t k = i; k < i + m; ++k) out[k] = f32_to_bf16(x[k]);
    }
  }
}

void softmax_to_bf16(float* x, int64_t n, float scale, int64_t width, uint16_t* out) {
  if (avx512::available()) return avx512::softmax_to_bf16(x, n, scale, width, out);
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
  softmax(x, n);
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(x[i]);
  std::fill(out + n, out + width, uint16_t{0});
}

void softmax(float* x, int64_t n) {
  if (avx512::available()) return avx512::softmax(x, n);
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

float dot(const float* a, const float* b, int64_t n) {
  return dot_f32(a, b, n);
}

void axpy(float a, const float* x, float* y, int64_t n) {
  if (avx512::available()) return avx512::axpy(a, x, y, n);
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

int64_t argmax(const float* x, int64_t n) {
  // The maximum of each block, vectorised, then the first index holding the largest in the first
  // block that has it: one pass over the row (an LM head's 129K logits) and one block, where a
  // scalar search for the maximum's index would read half the row again, one float at a time.
  constexpr int64_t kBlock = 1024;
  auto block_max = [&](int64_t from, int64_t count) {
    if (avx2::available()) return avx2::max_value(x + from, count);
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t i = from; i < from + count; ++i)
      if (x[i] > top) top = x[i];
    return top;
  };
  float top = -std::numeric_limits<float>::infinity();
  int64_t top_block = 0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const float m = block_max(b, std::min(kBlock, n - b));
    if (m > top) top = m, top_block = b;
  }
  for (int64_t i = top_block; i < std::min(top_block + kBlock, n); ++i)
    if (x[i] == top) return i;
  return 0;
}

}  // namespace tandem::kernels
