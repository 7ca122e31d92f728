#include "util/random_id.h"

#include <cstdio>
#include <random>

namespace tandem {

uint64_t random_u64() {
  thread_local std::mt19937_64 rng(std::random_device{}());
  return rng();
}

std::string random_hex(int words) {
  std::string out;
  for (int i = 0; i < words; ++i) {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(random_u64()));
    out += buf;
  }
  return out;
}

}  // namespace tandem
