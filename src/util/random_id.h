#pragma once
// Random identifiers (request ids, bootstrap rooms): not cryptographic, unique in practice.
#include <cstdint>
#include <string>

namespace tandem {

// A random 64-bit number from a per-thread generator seeded by std::random_device.
uint64_t random_u64();
// `words` random 64-bit numbers as lowercase hex, 16 characters each.
std::string random_hex(int words = 1);
// Restarts this thread's generator from `seed`. For a virtual-time simulation, which runs the
// gateway on one thread: an id's digits are bytes a simulated body takes time to send, so a run
// repeats byte for byte only if its ids do.
void seed_random_ids(uint64_t seed);

}  // namespace tandem
