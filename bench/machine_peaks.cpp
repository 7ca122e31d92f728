#include "machine_peaks.h"

// GCC 12 reports its own _mm512_undefined_* helpers as (maybe-)uninitialized at -O3.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace tandem::bench {
namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr long kIters = 100'000'000;

// Twelve independent accumulators cover the FMA latency on current x86 cores.
__attribute__((target("avx512f"))) float fma_loop(long iters) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(1.0f + i * 1e-3f);
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  for (long k = 0; k < iters; ++k)
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx512f,avx512bf16"))) float bf16_loop(long iters) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_setzero_ps();
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3400);
  for (long k = 0; k < iters; ++k)
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, y);
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  return _mm512_reduce_add_ps(s);
}

template <typename Loop>
double gflops(Loop loop, double flops_per_iter, int threads) {
  std::atomic<float> sink{0};
  const long iters = kIters / 4;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double t0 = now();
#pragma omp parallel num_threads(threads)
    { sink.store(sink.load() + loop(iters)); }
    best = std::max(best, flops_per_iter * iters * threads / (now() - t0) / 1e9);
  }
  return best;
}

__attribute__((target("avx512f"))) double read_gbs(const float* data, size_t n, int threads) {
  double best = 0;
  std::atomic<float> sink{0};
  for (int rep = 0; rep < 4; ++rep) {
    double t0 = now();
#pragma omp parallel num_threads(threads)
    {
      __m512 acc[8];
      for (auto& a : acc) a = _mm512_setzero_ps();
#pragma omp for schedule(static)
      for (size_t i = 0; i < n; i += 128)
        for (int k = 0; k < 8; ++k)
          acc[k] = _mm512_add_ps(acc[k], _mm512_load_ps(data + i + 16 * k));
      for (int k = 1; k < 8; ++k) acc[0] = _mm512_add_ps(acc[0], acc[k]);
      sink.store(sink.load() + _mm512_reduce_add_ps(acc[0]));
    }
    best = std::max(best, n * sizeof(float) / (now() - t0) / 1e9);
  }
  return best;
}

}  // namespace

double measure_dram_gbs() {
  if (!__builtin_cpu_supports("avx512f")) return 0;
  const size_t n = size_t{1} << 28;  // 1 GiB of floats
  auto* data = static_cast<float*>(std::aligned_alloc(64, n * sizeof(float)));
  std::memset(data, 1, n * sizeof(float));
  const double gbs = read_gbs(data, n, omp_get_max_threads());
  std::free(data);
  return gbs;
}

MachinePeaks measure_peaks() {
  MachinePeaks p;
  p.threads = omp_get_max_threads();
  if (!__builtin_cpu_supports("avx512f")) return p;
  p.fp32_gflops = gflops(fma_loop, 12 * 16 * 2, p.threads);
  if (__builtin_cpu_supports("avx512bf16"))
    p.bf16_gflops = gflops(bf16_loop, 12 * 32 * 2, p.threads);
  const size_t n = size_t{1} << 28;  // 1 GiB of floats
  auto* data = static_cast<float*>(std::aligned_alloc(64, n * sizeof(float)));
  std::memset(data, 1, n * sizeof(float));
  p.dram_gbs_1 = read_gbs(data, n, 1);
  p.dram_gbs_all = read_gbs(data, n, p.threads);
  std::free(data);
  return p;
}

}  // namespace tandem::bench
