#pragma once
// Seconds on the simulator's virtual clock (gateway::VirtualExecutor), and the one queue model the
// simulator uses for request bodies: a sender or receiver that handles bodies one after another
// at a rate (the clients' sending thread, an engine's HTTP thread).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "gateway/seams.h"
#include "util/error.h"

namespace tandem::sim {

using VirtualClock = gateway::Executor::Clock;

// The clock counts int64 nanoseconds (~292 years); a time past this bound (or not a number)
// would overflow the cast to something arbitrary, e.g. a fault meant for 1e10 s firing at 0.
// Inputs are bounded well below it (bench::kMaxArrivalSeconds), so sums of them fit too.
inline constexpr double kMaxVirtualSeconds = 4e9;

// Throws tandem::Error for a NaN or a magnitude above kMaxVirtualSeconds.
inline VirtualClock::duration duration_of(double seconds) {
  if (!(std::abs(seconds) <= kMaxVirtualSeconds))
    throw Error("virtual time: " + std::to_string(seconds) + " s is not a time the simulator " +
                "can count (at most " + std::to_string(int64_t(kMaxVirtualSeconds)) + " s)");
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
