#pragma once
// Measured peaks of this machine, for reporting kernels as a percentage of what the hardware
// can do: AVX-512 FP32 FMA and BF16 dot-product throughput, and DRAM read bandwidth.
namespace tandem::bench {

struct MachinePeaks {
  double fp32_gflops = 0;   // all threads
  double bf16_gflops = 0;   // all threads (vdpbf16ps), 0 without AVX-512 BF16
  double dram_gbs_1 = 0;    // one thread
  double dram_gbs_all = 0;  // all threads
  int threads = 0;
};

MachinePeaks measure_peaks();

// DRAM read bandwidth with all threads, measured now: memory-bound figures are compared with a
// measurement taken right before them, since a shared machine's bandwidth drifts.
double measure_dram_gbs();

}  // namespace tandem::bench
