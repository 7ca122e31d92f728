#include "gateway/policies/queue_order.h"

#include <algorithm>
#include <numeric>

namespace tandem::gateway {

double queue_score(const QueuedRequest& r, std::chrono::steady_clock::time_point now,
                   int64_t max_prompt, std::chrono::nanoseconds max_wait, const QueueWeights& w) {
  const double length =
      max_prompt > 0 ? static_cast<double>(max_prompt - std::min(r.prompt_tokens, max_prompt)) /
                           static_cast<double>(max_prompt)
                     : 0.0;
  const auto norm = std::max(max_wait, w.min_wait_norm);
  const auto waited = std::max(now - r.arrived, std::chrono::steady_clock::duration::zero());
  const double wait = norm.count() > 0 ? std::chrono::duration<double>(waited).count() /
                                             std::chrono::duration<double>(norm).count()
                                       : 0.0;
  return w.length_weight * length + w.wait_weight * wait;
}

std::vector<size_t> order(std::span<const QueuedRequest> queue,
                          std::chrono::steady_clock::time_point now, const QueueWeights& w) {
  int64_t max_prompt = 0;
  std::chrono::nanoseconds max_wait{0};
  for (const auto& r : queue) {
    max_prompt = std::max(max_prompt, r.prompt_tokens);
    max_wait =
        std::max(max_wait, std::chrono::duration_cast<std::chrono::nanoseconds>(now - r.arrived));
  }
  struct Key {
    bool starving;
    int priority_class;
    double score;
  };
  std::vector<Key> keys(queue.size());
  for (size_t i = 0; i < queue.size(); ++i) {
    const auto& r = queue[i];
    const auto bound = r.starvation_after.count() > 0 ? r.starvation_after : w.starvation_after;
    keys[i] = {bound.count() > 0 && now - r.arrived >= bound, r.priority_class,
               queue_score(r, now, max_prompt, max_wait, w)};
  }
  std::vector<size_t> idx(queue.size());
  std::iota(idx.begin(), idx.end(), size_t{0});
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    const Key &ka = keys[a], &kb = keys[b];
    if (ka.starving != kb.starving) return ka.starving;
    if (!ka.starving) {
      if (ka.priority_class != kb.priority_class) return ka.priority_class < kb.priority_class;
      if (ka.score != kb.score) return ka.score > kb.score;
    }
    return queue[a].arrived < queue[b].arrived;  // starving: FIFO; else the earlier on a tie
  });
  return idx;
}

}  // namespace tandem::gateway
