#pragma once
// The order in which the gateway offers its waiting requests to the prefill engines: Omni Proxy's
// weighted score of prompt length and waiting time, plus a starvation bound Omni Proxy describes
// but does not implement. A pure function of the queue, the time and the weights.
//
// Score of request i, over the requests waiting now (higher goes first):
//   length_i = (max_prompt - prompt_i) / max_prompt   (0 when max_prompt is 0)
//   wait_i   = (now - arrived_i) / max(max_wait, min_wait_norm)
//   score_i  = length_weight * length_i + wait_weight * wait_i
// where max_prompt and max_wait are the largest prompt and the longest wait in the queue, so both
// terms lie in [0, 1]: short prompts first, long waits catching up (Omni Proxy's defaults: 0.8,
// 0.2, 50 ms).
// Priority classes: requests of a lower class number go before those of a higher one; the score
// orders requests within a class (one class: the rule above alone).
// Starvation bound: a request that has waited its bound (its class's, else `starvation_after`) or
// longer goes before every request that has not waited its own, whatever the classes, and such
// requests go in arrival order. So once a request has waited its bound, no request that arrived
// after it is offered an engine before it: it is overtaken only during its first bound, by a
// higher class or a better score. (The caller may still start a later request first when this
// one's engines are all saturated and the other's are not; that is not overtaking for capacity.)
// Ties: earlier arrival, then the lower index.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace tandem::gateway {

struct QueueWeights {
  double length_weight = 0.8;
  double wait_weight = 0.2;
  std::chrono::nanoseconds min_wait_norm = std::chrono::milliseconds(50);
  // 0 disables the bound.
  std::chrono::nanoseconds starvation_after = std::chrono::seconds(2);
  bool operator==(const QueueWeights&) const = default;
};

struct QueuedRequest {
  int64_t prompt_tokens = 0;
  std::chrono::steady_clock::time_point arrived;
  int priority_class = 0;  // 0 goes first
  // Its class's starvation bound; 0: QueueWeights::starvation_after.
  std::chrono::nanoseconds starvation_after{0};
};

// Indices into `queue`, in the order to offer the requests.
std::vector<size_t> order(std::span<const QueuedRequest> queue,
                          std::chrono::steady_clock::time_point now, const QueueWeights& weights);

// The score above for one request, given the queue's max_prompt and max_wait (for tests and logs).
double queue_score(const QueuedRequest& request, std::chrono::steady_clock::time_point now,
                   int64_t max_prompt, std::chrono::nanoseconds max_wait,
                   const QueueWeights& weights);

}  // namespace tandem::gateway
