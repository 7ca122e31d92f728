// The absorbed MLA decode kernel alone: GFLOP/s as a percentage of the BF16 peak measured in the
// same run (the FP32 FMA peak on CPUs without AVX-512 BF16, where BF16 values are widened) and
// the cache read rate, for both rescale paths, at long contexts. Shapes: DeepSeek-V2-Lite's
// 16 heads (one sequence: memory-bound-ish, about 15 FLOP per cached byte in BF16) and
// DeepSeek-V3's 128 heads (compute-bound: 128 heads share every cached row), one query token
// and four (a token and three drafts).
// Usage: tandem-bench-mla [--contexts 4096,16384,32768] [--heads 16,128] [--queries 1,4]
//                         [--caches bf16,f32] [--repeats 5] [--layers 1] [--block-size 16]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/mla_attention.h"
#include "machine_peaks.h"

namespace {

using namespace tandem::kernels;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Median time of `repeats` passes of one sequence's attention over `layers` layers, each a call,
// divided by `layers`. The pool is laid out as the engine's latent cache is: each page of
// block_size positions holds those positions for every layer, so with more than one layer a
// layer's pages are not adjacent and a pass streams every layer's rows from memory, as a decode
// step does (one layer alone, repeated, may be served from the last-level cache).
double time_kernel(const MlaShape& shape, int64_t s_q, int64_t context, MlaRescale rescale,
                   int repeats, int64_t layers) {
  const int64_t pages = (context + shape.block_size - 1) / shape.block_size;
  const int64_t page_values = shape.block_size * shape.entry();
  const int64_t elements = pages * layers * page_values;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> pool_f32;
  std::vector<uint16_t> pool_bf16;
  if (shape.type == LatentType::kBF16) {
    pool_bf16.resize(elements);
    for (auto& x : pool_bf16) x = f32_to_bf16(normal(rng));
  } else {
    pool_f32.resize(elements);
    for (auto& x : pool_f32) x = normal(rng);
  }
  const size_t bytes_per_value = shape.type == LatentType::kBF16 ? 2 : 4;
  const char* base = shape.type == LatentType::kBF16
                         ? reinterpret_cast<const char*>(pool_bf16.data())
                         : reinterpret_cast<const char*>(pool_f32.data());
  std::vector<std::vector<const void*>> tables(layers, std::vector<const void*>(pages));
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t p = 0; p < pages; ++p)
      tables[l][p] = base + ((p * layers + l) * page_values) * bytes_per_value;
  std::vector<float> q(s_q * shape.heads * shape.entry()), out(s_q * shape.heads * shape.latent);
  for (auto& x : q) x = normal(rng);
  auto pass = [&] {
    for (int64_t l = 0; l < layers; ++l) {
      const MlaSequence seq{q.data(), s_q, context, tables[l].data(), out.data()};
      mla_decode(shape, std::span(&seq, 1), {rescale, true});
    }
  };
  std::vector<double> times;
  pass();  // warm-up
  for (int r = 0; r < repeats; ++r) {
    const double t0 = now();
    pass();
    times.push_back((now() - t0) / static_cast<double>(layers));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"MLA decode kernel: GFLOP/s vs the machine's measured peak"};
  std::vector<int64_t> contexts{4096, 16384, 32768};
  std::vector<int64_t> head_counts{16, 128}, query_counts{1, 4};
  std::vector<std::string> caches{"bf16", "f32"};
  int repeats = 5;
  int64_t layers = 1, block_size = 16;
  app.add_option("--contexts", contexts, "context lengths")->delimiter(',')->capture_default_str();
  app.add_option("--heads", head_counts, "attention heads")->delimiter(',')->capture_default_str();
  app.add_option("--queries", query_counts, "query tokens per sequence (s_q)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--caches", caches, "latent cache types")
      ->delimiter(',')
      ->check(CLI::IsMember({"bf16", "f32"}))
      ->capture_default_str();
  app.add_option("--repeats", repeats, "timed calls per figure (median)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--layers", layers,
                 "layers per pass, laid out as the engine's cache (figures are per layer)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--block-size", block_size, "cached positions per page")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const auto peaks = tandem::bench::measure_peaks();
  std::printf("machine: %d threads; %s peak %.0f GFLOP/s; DRAM read %.1f GB/s\n", peaks.threads,
              peaks.bf16_gflops > 0 ? "BF16" : "FP32 FMA (no AVX-512 BF16)", peaks.bf16_reference(),
              peaks.dram_gbs_all);
  std::printf("%-6s %-5s %4s %7s %-9s %9s %8s %7s %8s\n", "cache", "heads", "s_q", "context",
              "rescale", "ms", "GFLOP/s", "% peak", "GB/s");
  for (const auto& cache : caches)
    for (int64_t heads : head_counts)
      for (int64_t s_q : query_counts)
        for (int64_t context : contexts)
          for (auto rescale : {MlaRescale::kMultiply, MlaRescale::kAmla}) {
            const auto type = cache == "bf16" ? LatentType::kBF16 : LatentType::kF32;
            const MlaShape shape{heads, 512, 64, block_size, 0.1f, type};
            const double secs = time_kernel(shape, s_q, context, rescale, repeats, layers);
            const double gflops = mla_decode_flops(shape, s_q, context) / secs / 1e9;
            const double bytes =
                static_cast<double>(context) * shape.entry() * (type == LatentType::kBF16 ? 2 : 4);
            std::printf("%-6s %-5ld %4ld %7ld %-9s %9.3f %8.1f %6.1f%% %8.1f\n",
                        type == LatentType::kBF16 ? "bf16" : "f32", static_cast<long>(heads),
                        static_cast<long>(s_q), static_cast<long>(context),
                        rescale == MlaRescale::kAmla ? "amla" : "multiply", secs * 1e3, gflops,
                        100 * gflops / peaks.bf16_reference(), bytes / secs / 1e9);
          }
  return 0;
}
