#include "util/random_id.h"

#include <openssl/rand.h>

#include <array>
#include <optional>
#include <random>

#include "util/error.h"

namespace tandem {

namespace {

// Unseeded, numbers come from OpenSSL's generator, drawn a block at a time: a bootstrap room that
// can be predicted lets whoever reaches a decode engine join another request's room and read its
// prompt's KV, and a Mersenne Twister gives its future away after 312 outputs (request ids and
// tool-call ids are seen by every client).
struct Source {
  std::optional<std::mt19937_64> seeded;  // a simulation's repeatable ids
  std::array<uint64_t, 64> block{};
  size_t left = 0;
};

Source& source() {
  thread_local Source s;
  return s;
}

}  // namespace

uint64_t random_u64() {
  Source& s = source();
  if (s.seeded) return (*s.seeded)();
  if (s.left == 0) {
    if (RAND_bytes(reinterpret_cast<unsigned char*>(s.block.data()),
                   static_cast<int>(sizeof s.block)) != 1)
      throw Error("the system's random generator failed (OpenSSL RAND_bytes)");
    s.left = s.block.size();
  }
  return s.block[--s.left];
}

void seed_random_ids(uint64_t seed) {
  source().seeded.emplace(seed);
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
