#pragma once
// Causal attention work of a prompt: computing positions [done, prompt) pairs each query with
// every key up to and including its own position, Σ_{i=done}^{prompt-1} (i + 1) pairs. Engines
// report their queued and executed prefill in these units and the gateway learns their cost,
// because long-prompt prefill time grows with them, not with the token count alone.
#include <algorithm>
#include <cstdint>

namespace tandem::api {

inline int64_t causal_pairs(int64_t done, int64_t prompt) {
  done = std::max<int64_t>(done, 0);
  if (prompt <= done) return 0;
  return (prompt * (prompt + 1) - done * (done + 1)) / 2;
}

// Prefill work: prompt tokens and their causal attention pairs.
struct PrefillWork {
  int64_t tokens = 0, pairs = 0;

  // Computing a prompt of `prompt` tokens whose first `done` are cached or computed already.
  static PrefillWork of_prompt(int64_t done, int64_t prompt) {
    done = std::clamp<int64_t>(done, 0, std::max<int64_t>(prompt, 0));
    return {prompt - done, causal_pairs(done, prompt)};
  }
  PrefillWork& operator+=(const PrefillWork& o) {
    tokens += o.tokens;
    pairs += o.pairs;
    return *this;
  }
  PrefillWork& operator-=(const PrefillWork& o) {
    tokens -= o.tokens;
    pairs -= o.pairs;
    return *this;
  }
  friend PrefillWork operator-(PrefillWork a, const PrefillWork& b) { return a -= b; }
};

}  // namespace tandem::api
