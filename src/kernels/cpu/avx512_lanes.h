#pragma once
// The lane mask of a 16-float AVX-512 vector when `left` elements remain: all 16 when at least
// 16 do, none when none do. One definition for the AVX-512 kernels.
#include <immintrin.h>

#include <cstdint>

namespace tandem::kernels::avx512 {

inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}

}  // namespace tandem::kernels::avx512
