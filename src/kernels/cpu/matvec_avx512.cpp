#include "kernels/cpu/matvec_avx512.h"

// GCC 12 reports its own _mm512_undefined_* helpers as maybe-uninitialized at -O3.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kernels/cpu/avx512_lanes.h"
#include "kernels/cpu/bf16.h"

// glibc's AVX-512 expf for 16 lanes (libmvec); math.h declares it only under -ffast-math.
extern "C" __m512 _ZGVeN16v_expf(__m512 x);

namespace tandem::kernels::avx512 {
namespace {

#define TANDEM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

// 16 floats -> BF16, rounding to nearest even exactly as f32_to_bf16 (NaN stays NaN, denormals
// are kept: vcvtneps2bf16 would flush them).
TANDEM_AVX512 inline __m256i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

// Up to 4 activation vectors share each weight load; two accumulators per vector hide latency.
template <typename Load16>
TANDEM_AVX512 inline void dot_rows(Load16 load, const float* x, int64_t cols, int64_t n,
                                   float* out) {
  __m512 acc[4][2];
  for (int t = 0; t < 4; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= cols; c += 32) {
    const __m512 w0 = load(c), w1 = load(c + 16);
    for (int t = 0; t < n; ++t) {
      acc[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * cols + c), acc[t][0]);
      acc[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + t * cols + c + 16), acc[t][1]);
    }
  }
  for (; c + 16 <= cols; c += 16) {
    const __m512 w0 = load(c);
    for (int t = 0; t < n; ++t)
      acc[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * cols + c), acc[t][0]);
  }
  const __mmask16 tail = lanes(cols - c);
  const __m512 wt = c < cols ? load(c) : _mm512_setzero_ps();  // load() masks past `cols`
  for (int t = 0; t < n; ++t) {
    if (c < cols)
      acc[t][0] = _mm512_fmadd_ps(wt, _mm512_maskz_loadu_ps(tail, x + t * cols + c), acc[t][0]);
    out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]));
  }
}

}  // namespace

bool available() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
}

TANDEM_AVX512 void dot_rows_bf16(const uint16_t* row, const float* x, int64_t cols, int64_t n,
                                 float* out) {
  auto load = [&](int64_t c) TANDEM_AVX512 {
    const __mmask16 m = lanes(cols - c);
    __m256i h = _mm256_maskz_loadu_epi16(m, row + c);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  };
  dot_rows(load, x, cols, n, out);
}

TANDEM_AVX512 void dot_rows_i8(const int8_t* row, const float* x, int64_t cols, int64_t n,
                               float* out) {
  auto load = [&](int64_t c) TANDEM_AVX512 {
    const __mmask16 m = lanes(cols - c);
    __m128i b = _mm_maskz_loadu_epi8(m, row + c);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  };
  dot_rows(load, x, cols, n, out);
}

TANDEM_AVX512 void dot_rows_f32(const float* row, const float* x, int64_t cols, int64_t n,
                                float* out) {
  auto load = [&](int64_t c) TANDEM_AVX512 {
    const __mmask16 m = lanes(cols - c);
    return _mm512_maskz_loadu_ps(m, row + c);
  };
  dot_rows(load, x, cols, n, out);
}

bool has_bf16_dot() {
  static const bool ok = available() && __builtin_cpu_supports("avx512bf16");
  return ok;
}

void to_bf16_rows(const float* x, int64_t cols, int64_t n, int64_t stride, uint16_t* out) {
  for (int64_t t = 0; t < n; ++t) {
    to_bf16(x + t * cols, cols, out + t * stride);
    std::fill(out + t * stride + cols, out + (t + 1) * stride, uint16_t{0});
  }
}

TANDEM_AVX512 void to_bf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    _mm256_mask_storeu_epi16(out + i, m, round_bf16(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) void dot_rows_bf16_dp(
    const uint16_t* row, const uint16_t* xb, int64_t cols, int64_t stride, int64_t n, float* out) {
  __m512 acc[4][2];
  for (int t = 0; t < 4; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 64 <= cols; c += 64) {
    const __m512i w0 = _mm512_loadu_si512(row + c), w1 = _mm512_loadu_si512(row + c + 32);
    for (int t = 0; t < n; ++t) {
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], (__m512bh)w0,
                                   (__m512bh)_mm512_loadu_si512(xb + t * stride + c));
      acc[t][1] = _mm512_dpbf16_ps(acc[t][1], (__m512bh)w1,
                                   (__m512bh)_mm512_loadu_si512(xb + t * stride + c + 32));
    }
  }
  for (; c < cols; c += 32) {  // the activations are zero past `cols`, the row is masked
    const int64_t left = cols - c;
    const __mmask32 m = left >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << left) - 1);
    const __m512i w = _mm512_maskz_loadu_epi16(m, row + c);
    for (int t = 0; t < n; ++t)
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], (__m512bh)w,
                                   (__m512bh)_mm512_loadu_si512(xb + t * stride + c));
  }
  for (int t = 0; t < n; ++t) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]));
}

bool has_vnni() {
  static const bool ok = available() && __builtin_cpu_supports("avx512vnni");
  return ok;
}

TANDEM_AVX512 void quantize_u8_rows(const float* x, int64_t cols, int64_t n, int64_t stride,
                                    uint8_t* out, float* scales) {
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = x + t * cols;
    __m512 mx = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xt + c)));
    float amax = _mm512_reduce_max_ps(mx);
    for (; c < cols; ++c) amax = std::max(amax, std::abs(xt[c]));
    const float scale = amax > 0 ? amax / 127.0f : 1.0f;
    scales[t] = scale;
    const __m512 inv = _mm512_set1_ps(1.0f / scale);
    uint8_t* o = out + t * stride;
    c = 0;
    for (; c + 16 <= cols; c += 16) {
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xt + c), inv));  // nearest
      q = _mm512_add_epi32(
          _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127)),
          _mm512_set1_epi32(128));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + c), _mm512_cvtepi32_epi8(q));
    }
    for (; c < cols; ++c) {
      const int q = static_cast<int>(std::nearbyint(xt[c] / scale));
      o[c] = static_cast<uint8_t>(std::clamp(q, -127, 127) + 128);
    }
    for (; c < stride; ++c) o[c] = 128;
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))) void dot_rows_i8_vnni(
    const int8_t* row, const uint8_t* xq, int64_t cols, int64_t stride, int64_t n, int32_t* out) {
  __m512i acc[4][2];
  for (int t = 0; t < 4; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_si512();
  int64_t c = 0;
  for (; c + 128 <= cols; c += 128) {
    const __m512i w0 = _mm512_loadu_si512(row + c), w1 = _mm512_loadu_si512(row + c + 64);
    for (int t = 0; t < n; ++t) {
      acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], _mm512_loadu_si512(xq + t * stride + c), w0);
      acc[t][1] = _mm512_dpbusd_epi32(acc[t][1], _mm512_loadu_si512(xq + t * stride + c + 64), w1);
    }
  }
  for (; c < cols; c += 64) {  // the row is masked; the activations are padded to `stride`
    const int64_t left = cols - c;
    const __mmask64 m = left >= 64 ? ~0ull : ((1ull << left) - 1);
    const __m512i w = _mm512_maskz_loadu_epi8(m, row + c);
    for (int t = 0; t < n; ++t)
      acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], _mm512_loadu_si512(xq + t * stride + c), w);
  }
  for (int t = 0; t < n; ++t)
    out[t] = _mm512_reduce_add_epi32(_mm512_add_epi32(acc[t][0], acc[t][1]));
}

// silu(gate) * up on the lanes of `m`.
TANDEM_AVX512 inline __m512 silu_mul_lanes(const float* gate, const float* up, __mmask16 m) {
  const __m512 g = _mm512_maskz_loadu_ps(m, gate);
  const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  return _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, up));
}

TANDEM_AVX512 void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    _mm512_mask_storeu_ps(out + i, m, silu_mul_lanes(gate + i, up + i, m));
  }
}

TANDEM_AVX512 void silu_mul_bf16(const float* gate, const float* up, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    _mm256_mask_storeu_epi16(out + i, m, round_bf16(silu_mul_lanes(gate + i, up + i, m)));
  }
}

TANDEM_AVX512 void softmax(float* x, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16)
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(n - i), x + i));
  const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), vmax));
    _mm512_mask_storeu_ps(x + i, m, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv));
  }
}

TANDEM_AVX512 void softmax_to_bf16(float* x, int64_t n, float scale, int64_t width, uint16_t* out) {
  // Three passes instead of five: the scale goes into the exponent (scale > 0 keeps the maximum
  // where it was), and normalising, rounding and the zero tail are one pass.
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16)
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(n - i), x + i));
  const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), vscale = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 e =
        _ZGVeN16v_expf(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), vmax), vscale));
    _mm512_mask_storeu_ps(x + i, m, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    _mm256_mask_storeu_epi16(out + i, m,
                             round_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv)));
  }
  std::fill(out + n, out + width, uint16_t{0});
}

TANDEM_AVX512 void axpy(float a, const float* x, float* y, int64_t n) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    _mm512_mask_storeu_ps(
        y + i, m,
        _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

TANDEM_AVX512 void axpy_row_bf16(float a, const uint16_t* row, float* y, int64_t cols) {
  const __m512 va = _mm512_set1_ps(a);
  int64_t c = 0;
  for (; c + 16 <= cols; c += 16) {
    __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c))), 16));
    _mm512_storeu_ps(y + c, _mm512_fmadd_ps(va, w, _mm512_loadu_ps(y + c)));
  }
  for (; c < cols; ++c) {
    uint32_t bits = static_cast<uint32_t>(row[c]) << 16;
    float w;
    __builtin_memcpy(&w, &bits, 4);
    y[c] += a * w;
  }
}

TANDEM_AVX512 void axpy_rows_bf16(const uint16_t* rows, int64_t count, int64_t cols, const float* x,
                                  float* y) {
  constexpr int kVectors = 16;  // 256 columns of y in registers
  int64_t c0 = 0;
  for (; c0 + 16 * kVectors <= cols; c0 += 16 * kVectors) {
    __m512 acc[kVectors];
#pragma GCC unroll 16
    for (int v = 0; v < kVectors; ++v) acc[v] = _mm512_setzero_ps();
    for (int64_t r = 0; r < count; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r]);
      const uint16_t* row = rows + r * cols + c0;
#pragma GCC unroll 16
      for (int v = 0; v < kVectors; ++v) {
        const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * v))),
            16));
        acc[v] = _mm512_fmadd_ps(xr, w, acc[v]);
      }
    }
#pragma GCC unroll 16
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(y + c0 + 16 * v, acc[v]);
  }
  if (c0 == cols) return;
  std::fill(y + c0, y + cols, 0.0f);
  for (int64_t r = 0; r < count; ++r) axpy_row_bf16(x[r], rows + r * cols + c0, y + c0, cols - c0);
}

TANDEM_AVX512 void axpy_row_i8(float a, const int8_t* row, float* y, int64_t cols) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 m = lanes(cols - c);
    __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, row + c)));
    _mm512_mask_storeu_ps(y + c, m, _mm512_fmadd_ps(va, w, _mm512_maskz_loadu_ps(m, y + c)));
  }
}

}  // namespace tandem::kernels::avx512
