#include "engine/expert_parallel/stall_watch.h"

namespace tandem::engine::ep {

bool StallWatch::stalled(uint32_t generation, Clock::time_point now) {
  if (timeout_ <= Clock::duration::zero()) return false;  // switched off
  if (!watching_ || generation != generation_) {
    watching_ = true;
    generation_ = generation;
    since_ = now;
  }
  return now - since_ >= timeout_;
}

std::vector<int> ranks_behind(std::span<const uint32_t> arrivals, int waiter) {
  std::vector<int> out;
  const uint32_t mine = arrivals[size_t(waiter)];
  for (size_t r = 0; r < arrivals.size(); ++r)
    // Counters wrap: compare by difference, as the barrier's generation is compared.
    if (int32_t(mine - arrivals[r]) > 0) out.push_back(int(r));
  return out;
}

}  // namespace tandem::engine::ep
