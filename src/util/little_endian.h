#pragma once
// Fixed-width little-endian integers in byte buffers (wire formats: KV transfer frames).
#include <cstddef>
#include <cstdint>

namespace tandem {

// Writes the low `n` bytes of `v`, least significant first.
inline void put_le(std::byte* p, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) p[i] = std::byte((v >> (8 * i)) & 0xff);
}

inline uint64_t get_le(const std::byte* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t(std::to_integer<uint8_t>(p[i])) << (8 * i);
  return v;
}

}  // namespace tandem
