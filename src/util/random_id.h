#pragma once
// Random identifiers (request ids, bootstrap rooms, tool-call ids): unpredictable (OpenSSL's
// generator) unless a simulation seeded this thread.
#include <cstdint>
#include <string>

namespace tandem {

// A random 64-bit number: from OpenSSL's generator, or from this thread's seeded generator.
uint64_t random_u64();
// `words` random 64-bit numbers as lowercase hex, 16 characters each.
std::string random_hex(int words = 1);
// From now on this thread's numbers come from a generator started at `seed`. For a virtual-time
// simulation, which runs the gateway on one thread: an id's digits are bytes a simulated body takes
// time to send, so a run repeats byte for byte only if its ids do.
void seed_random_ids(uint64_t seed);

}  // namespace tandem
