#include "machine_peaks.h"

// GCC 12 reports its own _mm512_undefined_* helpers as (maybe-)uninitialized at -O3.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <vector>

#include "util/huge_pages.h"

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

// The same on AVX2 + FMA (CPUs without AVX-512): 8 lanes.
__attribute__((target("avx2,fma"))) float fma_loop_avx2(long iters) {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(1.0f + i * 1e-3f);
  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  for (long k = 0; k < iters; ++k)
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], m, c);
  __m256 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
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

// Floats a thread claims at a time while reading (2 MB): claimed, not split in static halves,
// as the decode products claim row blocks, so that a vCPU slowed by its neighbours does not hold
// the measurement back. (On the development VM this still reads less than decode itself moves;
// docs/benchmarks.md, "The read benchmark under-reports here".)
constexpr size_t kReadClaim = size_t{1} << 19;

// Best of four timed passes of `pass` (one read of n floats by `threads` threads), in GB/s.
template <typename Pass>
double best_read_gbs(size_t n, Pass pass) {
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    const double t0 = now();
    pass();
    best = std::max(best, n * sizeof(float) / (now() - t0) / 1e9);
  }
  return best;
}

__attribute__((target("avx512f"))) double read_gbs(const float* data, size_t n, int threads) {
  std::atomic<float> sink{0};
  return best_read_gbs(n, [&]() __attribute__((target("avx512f"))) {
#pragma omp parallel num_threads(threads)
    {
      __m512 acc[8];
      for (auto& a : acc) a = _mm512_setzero_ps();
#pragma omp for schedule(dynamic, kReadClaim / 128)
      for (size_t i = 0; i < n; i += 128)
        for (int k = 0; k < 8; ++k)
          acc[k] = _mm512_add_ps(acc[k], _mm512_load_ps(data + i + 16 * k));
      for (int k = 1; k < 8; ++k) acc[0] = _mm512_add_ps(acc[0], acc[k]);
      sink.store(sink.load() + _mm512_reduce_add_ps(acc[0]));
}
}  // namespace
);
}  // namespace tandem::bench

__attribute__((target("avx2"))) double read_gbs_avx2(const float* data, size_t n, int threads) {
  std::atomic<float> sink{0};
  return best_read_gbs(n, [&]() __attribute__((target("avx2"))) {
#pragma omp parallel num_threads(threads)
    {
      __m256 acc[8];
      for (auto& a : acc) a = _mm256_setzero_ps();
#pragma omp for schedule(dynamic, kReadClaim / 64)
      for (size_t i = 0; i < n; i += 64)
        for (int k = 0; k < 8; ++k)
          acc[k] = _mm256_add_ps(acc[k], _mm256_load_ps(data + i + 8 * k));
      for (int k = 1; k < 8; ++k) acc[0] = _mm256_add_ps(acc[0], acc[k]);
      float out[8];
      _mm256_storeu_ps(out, acc[0]);
      sink.store(sink.load() + out[0]);
}
});
}

bool has_avx512() {
  return __builtin_cpu_supports("avx512f");
}

// All-threads (or one-thread) read bandwidth of 1 GiB with the widest loads the CPU has; 0 on a
// CPU with neither AVX-512 nor AVX2.
double dram_gbs(int threads) {
  if (!has_avx512() && !__builtin_cpu_supports("avx2")) return 0;
  const size_t n = size_t{1} << 28;  // 1 GiB of floats
  // On huge pages, as the packed weights it is compared with (4 KB pages read ~20% less here).
  // One buffer for the process, written once: a fresh mapping per measurement spent seconds in
  // page faults and, with the page cache full, got fewer huge pages than the weights had.
  static util::HugePageBuffer buffer = [&] {
    util::HugePageBuffer b(n * sizeof(float));
    std::memset(b.get(), 1, n * sizeof(float));
    return b;
  }();
  const auto* data = reinterpret_cast<const float*>(buffer.get());
  return has_avx512() ? read_gbs(data, n, threads) : read_gbs_avx2(data, n, threads);
}

}  // namespace

double measure_dram_gbs() {
  return dram_gbs(omp_get_max_threads());
}

MachinePeaks measure_peaks() {
  MachinePeaks p;
  p.threads = omp_get_max_threads();
  if (has_avx512()) {
    p.fp32_gflops = gflops(fma_loop, 12 * 16 * 2, p.threads);
    if (__builtin_cpu_supports("avx512bf16"))
      p.bf16_gflops = gflops(bf16_loop, 12 * 32 * 2, p.threads);
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    p.fp32_gflops = gflops(fma_loop_avx2, 12 * 8 * 2, p.threads);
  }
  p.dram_gbs_1 = dram_gbs(1);
  p.dram_gbs_all = dram_gbs(p.threads);
  return p;
}

}  // namespace tandem::bench
