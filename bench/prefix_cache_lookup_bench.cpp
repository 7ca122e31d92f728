// The cost of a prefix-cache lookup per block: KvCacheManager::find_cached_prefix over a long
// prompt that is cached whole, in a cache that also holds other long prompts (so the hash map and
// the blocks are larger than the CPU caches hold for one prompt). A timing printout, not a test.
//
//   tandem-bench-prefix-lookup [--prompt-tokens 32768] [--block-size 16] [--other-prompts 15]
//                              [--repeats 200]
//
// Prints the lookup's ns per block and, for scale, the ns per block of hashing the prompt alone
// (api::block_hashes), which every lookup does first.
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "api/block_hash.h"
#include "engine/kv/kv_cache_manager.h"

namespace {

using Clock = std::chrono::steady_clock;

std::vector<int32_t> random_prompt(std::mt19937& rng, int64_t n) {
  std::uniform_int_distribution<int32_t> token(0, 129279);  // DeepSeek-V3's vocabulary
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = token(rng);
  return t;
}

double ns_since(Clock::time_point start) {
  return std::chrono::duration<double, std::nano>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t prompt_tokens = 32768, block_size = 16, other_prompts = 15, repeats = 200;
  CLI::App app{"prefix-cache lookup cost per block"};
  app.add_option("--prompt-tokens", prompt_tokens)->check(CLI::Range(2, 1 << 22));
  app.add_option("--block-size", block_size)->check(CLI::Range(1, 256));
  app.add_option("--other-prompts", other_prompts)->check(CLI::Range(0, 256));
  app.add_option("--repeats", repeats)->check(CLI::Range(1, 1000000));
  CLI11_PARSE(app, argc, argv);

  const int64_t blocks_per_prompt = prompt_tokens / block_size + 1;
  tandem::engine::KvCacheManager kv(blocks_per_prompt * (other_prompts + 1), block_size, true);
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t p = 0; p <= other_prompts; ++p) {
    prompts.push_back(random_prompt(rng, prompt_tokens));
    const std::string id = "p" + std::to_string(p);
    if (!kv.allocate(id, prompt_tokens)) return 1;
    kv.cache_full_blocks(id, prompts.back());
    kv.free(id);
  }
  // The prompt looked up: the last one cached, plus one token (a lookup leaves the last to
  // compute).
  std::vector<int32_t> query = prompts.back();
  query.push_back(1);

  const int64_t hit_blocks = static_cast<int64_t>(kv.find_cached_prefix(query).blocks.size());
  if (hit_blocks != prompt_tokens / block_size) {
    std::fprintf(stderr, "expected a hit of %lld blocks, got %lld\n",
                 static_cast<long long>(prompt_tokens / block_size),
                 static_cast<long long>(hit_blocks));
    return 1;
  }
  int64_t sink = 0;
  auto start = Clock::now();
  for (int64_t r = 0; r < repeats; ++r) sink += kv.find_cached_prefix(query).num_tokens;
  const double lookup_ns = ns_since(start) / static_cast<double>(repeats * hit_blocks);
  start = Clock::now();
  for (int64_t r = 0; r < repeats; ++r)
    sink += static_cast<int64_t>(tandem::api::block_hashes(query, block_size).size());
  const double hash_ns = ns_since(start) / static_cast<double>(repeats * hit_blocks);

  std::printf(
      "prompt %lld tokens, block size %lld, %lld cached blocks: lookup %.1f ns/block "
      "(hashing alone %.1f ns/block)  [%lld]\n",
      static_cast<long long>(prompt_tokens), static_cast<long long>(block_size),
      static_cast<long long>(kv.num_cached_blocks()), lookup_ns, hash_ns,
      static_cast<long long>(sink % 10));
  return 0;
}
