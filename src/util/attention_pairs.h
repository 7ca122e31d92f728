#pragma once
// Causal attention work of a prompt: computing positions [done, prompt) pairs each query with
// every key up to and including its own position, Σ_{i=done}^{prompt-1} (i + 1) pairs. Engines
// report their queued and executed prefill in these units and the gateway learns their cost,
// because long-prompt prefill time grows with them, not with the token count alone.
#include <algorithm>
#include <cstdint>

namespace tandem::util {

inline int64_t causal_pairs(int64_t done, int64_t prompt) {
  done = std::max<int64_t>(done, 0);
  if (prompt <= done) return 0;
  return (prompt * (prompt + 1) - done * (done + 1)) / 2;
}

}  // namespace tandem::util
