#pragma once
// At most one log line per interval for an event that strangers can repeat at will (refused
// connections, accept failures), so that a flood of them cannot flood the log. The lines that
// are held back are counted and the next line that goes out says how many.
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>

namespace tandem {

class LogThrottle {
 public:
  using Clock = std::chrono::steady_clock;

  explicit LogThrottle(Clock::duration interval) : interval_(interval) {}

  // Whether a line for an event at `now` goes out. If it does, the result is the number of
  // events held back since the last line; otherwise it is empty and the event is counted.
  // Thread-safe.
  std::optional<int64_t> admit(Clock::time_point now);

 private:
  const Clock::duration interval_;
  std::mutex mutex_;
  bool logged_ = false;
  Clock::time_point next_{};
  int64_t held_back_ = 0;
};

}  // namespace tandem
