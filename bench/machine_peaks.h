#pragma once
// Measured peaks of this machine, for reporting kernels as a percentage of what the hardware
// can do: FP32 FMA (AVX-512, else AVX2) and AVX-512 BF16 dot-product throughput, and DRAM read
// bandwidth (AVX-512 or AVX2 loads).
namespace tandem::bench {

struct MachinePeaks {
  double fp32_gflops = 0;  // all threads (AVX-512, else AVX2 + FMA)
  double bf16_gflops = 0;  // all threads (vdpbf16ps), 0 without AVX-512 BF16
  // What BF16 products can reach here: bf16_gflops, else the FP32 FMA peak (BF16 weights are
  // widened to FP32 and multiplied there).
  double bf16_reference() const { return bf16_gflops > 0 ? bf16_gflops : fp32_gflops; }
  double dram_gbs_1 = 0;    // one thread
  double dram_gbs_all = 0;  // all threads
  int threads = 0;
};

MachinePeaks measure_peaks();

// DRAM read bandwidth with all threads, measured now: memory-bound figures are compared with a
// measurement taken right before them, since a shared machine's bandwidth drifts.
double measure_dram_gbs();

}  // namespace tandem::bench
