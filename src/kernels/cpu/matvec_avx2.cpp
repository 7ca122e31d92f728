#include "kernels/cpu/matvec_avx2.h"

#include <immintrin.h>

#include <cstring>

namespace tandem::kernels::avx2 {
namespace {

#define TANDEM_AVX2 __attribute__((target("avx2,fma")))

TANDEM_AVX2 inline float sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// N (1..4) activation vectors share each weight load; two accumulators per vector hide the FMA
// latency. N is a template parameter so the accumulators stay in registers. `load(c)` widens 8
// weights at column c to float32; `scalar(c)` one weight.
template <int N, typename Load8, typename Scalar>
TANDEM_AVX2 inline void dot_rows_n(Load8 load, Scalar scalar, const float* x, int64_t cols,
                                   float* out) {
  __m256 acc[N][2];
  for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= cols; c += 16) {
    const __m256 w0 = load(c), w1 = load(c + 8);
    for (int t = 0; t < N; ++t) {
      acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * cols + c), acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * cols + c + 8), acc[t][1]);
    }
  }
  for (; c + 8 <= cols; c += 8) {
    const __m256 w0 = load(c);
    for (int t = 0; t < N; ++t)
      acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * cols + c), acc[t][0]);
  }
  for (int t = 0; t < N; ++t) {
    float s = sum8(_mm256_add_ps(acc[t][0], acc[t][1]));
    for (int64_t k = c; k < cols; ++k) s += scalar(k) * x[t * cols + k];
    out[t] = s;
  }
}

template <typename Load8, typename Scalar>
TANDEM_AVX2 inline void dot_rows(Load8 load, Scalar scalar, const float* x, int64_t cols, int64_t n,
                                 float* out) {
  switch (n) {
    case 1:
      return dot_rows_n<1>(load, scalar, x, cols, out);
    case 2:
      return dot_rows_n<2>(load, scalar, x, cols, out);
    case 3:
      return dot_rows_n<3>(load, scalar, x, cols, out);
    default:
      return dot_rows_n<4>(load, scalar, x, cols, out);
  }
}

}  // namespace

bool available() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

TANDEM_AVX2 void dot_rows_bf16(const uint16_t* row, const float* x, int64_t cols, int64_t n,
                               float* out) {
  dot_rows(
      [row](int64_t c) TANDEM_AVX2 {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      },
      [row](int64_t c) {
        const uint32_t bits = static_cast<uint32_t>(row[c]) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
      },
      x, cols, n, out);
}

TANDEM_AVX2 void dot_rows_i8(const int8_t* row, const float* x, int64_t cols, int64_t n,
                             float* out) {
  dot_rows(
      [row](int64_t c) TANDEM_AVX2 {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      },
      [row](int64_t c) { return static_cast<float>(row[c]); }, x, cols, n, out);
}

TANDEM_AVX2 void dot_rows_f32(const float* row, const float* x, int64_t cols, int64_t n,
                              float* out) {
  dot_rows([row](int64_t c) TANDEM_AVX2 { return _mm256_loadu_ps(row + c); },
           [row](int64_t c) { return row[c]; }, x, cols, n, out);
}

}  // namespace tandem::kernels::avx2
