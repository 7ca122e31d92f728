#pragma once
// When is a rank of an expert-parallel engine stuck rather than slow? A rank that dies is seen at
// once (its process exits); one that is alive but makes no progress (stopped, frozen by its
// cgroup, deadlocked) would hold every step at the next exchange forever, and the engine would
// keep answering /health with 200 while every request hangs. The front watches the barrier it
// waits at: when the same barrier has not completed within the timeout, the ranks that have
// reached fewer barriers than the front are the stalled ones, and the engine fails with their
// names (as it does for a rank that died).
//
// Pure: the caller passes the time; a wait is named by the barrier's generation, which changes
// every time the barrier completes.
#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

namespace tandem::engine::ep {

class StallWatch {
 public:
  using Clock = std::chrono::steady_clock;
  explicit StallWatch(Clock::duration timeout) : timeout_(timeout) {}

  // Called while waiting at barrier `generation`; true once that same wait has lasted the
  // timeout (a completed barrier starts a new wait). Never with a timeout of zero.
  bool stalled(uint32_t generation, Clock::time_point now);
  Clock::duration timeout() const { return timeout_; }

 private:
  Clock::duration timeout_;
  bool watching_ = false;
  uint32_t generation_ = 0;
  Clock::time_point since_{};
};

// The ranks that reached fewer barriers than rank `waiter`, which is waiting at its latest one.
std::vector<int> ranks_behind(std::span<const uint32_t> arrivals, int waiter);

}  // namespace tandem::engine::ep
