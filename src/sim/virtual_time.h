#pragma once
// Seconds on the simulator's virtual clock (gateway::VirtualExecutor), and the one queue model the
// simulator uses for request bodies: a sender or receiver that handles bodies one after another
// at a rate (the clients' sending thread, an engine's HTTP thread).
#include <algorithm>
#include <chrono>
#include <cstddef>

#include "gateway/seams.h"

namespace tandem::sim {

using VirtualClock = gateway::Executor::Clock;

inline VirtualClock::duration duration_of(double seconds) {
  return std::chrono::duration_cast<VirtualClock::duration>(std::chrono::duration<double>(seconds));
}
// The time point `seconds` after the clock's epoch, and back.
inline VirtualClock::time_point time_at(double seconds) {
  return VirtualClock::time_point(duration_of(seconds));
}
inline double seconds_of(VirtualClock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// Bodies handled in order at `bytes_per_s` (0: at once): when one of `bytes` that arrives `now`
// is through, after those before it.
class BodyLine {
 public:
  explicit BodyLine(double bytes_per_s) : bytes_per_s_(bytes_per_s) {}
  VirtualClock::time_point done_at(VirtualClock::time_point now, size_t bytes) {
    if (bytes_per_s_ > 0 && bytes > 0)
      free_ = std::max(free_, now) + duration_of(double(bytes) / bytes_per_s_);
    return std::max(free_, now);
  }

 private:
  double bytes_per_s_;
  VirtualClock::time_point free_{};
};

}  // namespace tandem::sim
