#include "util/random_id.h"

#include <random>

namespace tandem {

namespace {

std::mt19937_64& generator() {
  thread_local std::mt19937_64 rng(std::random_device{}());
  return rng;
}

}  // namespace

uint64_t random_u64() {
  return generator()();
}

void seed_random_ids(uint64_t seed) {
  generator().seed(seed);
}

std::string random_hex(int words) {
  // By hand: snprintf's format parsing showed in the gateway's per-request profile.
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(static_cast<size_t>(words) * 16, '0');
  for (int i = 0; i < words; ++i) {
    uint64_t v = random_u64();
    for (int d = 15; d >= 0; --d, v >>= 4) out[static_cast<size_t>(i) * 16 + d] = kDigits[v & 15];
  }
  return out;
}

}  // namespace tandem
