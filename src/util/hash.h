#pragma once
// The project's one hash function: XXH3-64. Block hashes, tokenizer tables and caches all use it,
// so a value hashed in the gateway equals the value hashed in an engine.
#include <cstdint>
#include <string_view>

#include <xxhash.h>

namespace tandem {

inline uint64_t hash_bytes(std::string_view bytes, uint64_t seed = 0) {
  return XXH3_64bits_withSeed(bytes.data(), bytes.size(), seed);
}

// Finaliser for integer keys (a bijective mix, so distinct keys never collide before masking).
inline uint64_t hash_u64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

}  // namespace tandem
