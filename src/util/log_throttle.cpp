#include "util/log_throttle.h"

namespace tandem {

std::optional<int64_t> LogThrottle::admit(Clock::time_point now) {
  std::lock_guard lock(mutex_);
  if (logged_ && now < next_) {
    ++held_back_;
    return std::nullopt;
  }
  logged_ = true;
  next_ = now + interval_;
  int64_t held = held_back_;
  held_back_ = 0;
  return held;
}

}  // namespace tandem
