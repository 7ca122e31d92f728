#pragma once
// Inline AVX2 helpers shared by the AVX2 kernels (matvec_avx2.cpp, mla_attention.cpp): eight
// weights of any stored type widened to float32 lanes, and a horizontal sum. Functions that use
// them carry TANDEM_AVX2, so the rest of the binary still runs on CPUs without AVX2.
#include <immintrin.h>

#include <cstdint>

#define TANDEM_AVX2 __attribute__((target("avx2,fma")))

namespace tandem::kernels::avx2 {

TANDEM_AVX2 inline float sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

TANDEM_AVX2 inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
// BF16 -> float32 is exact: the 16 bits become the high half of the float.
TANDEM_AVX2 inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
TANDEM_AVX2 inline __m256 load8(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

}  // namespace tandem::kernels::avx2
