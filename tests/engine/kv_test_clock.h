#pragma once
// A clock for KvTransferConfig::now that moves only when a test moves it. It counts its reads, so
// that a test can wait until an agent has looked at the time since it moved it (its reaper looks
// about every 50 ms) instead of sleeping.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>

#include "util/bounded_wait.h"

namespace tandem::engine {

class KvTestClock {
 public:
  using Clock = std::chrono::steady_clock;

  // An hour ahead of the real clock: a real connection given a deadline from this one ends at its
  // own I/O timeout, never at that deadline, within a test.
  KvTestClock() : now_(Clock::now() + std::chrono::hours(1)) {}

  // For KvTransferConfig::now; the clock must outlive the agents that read it.
  std::function<Clock::time_point()> seam() {
    return [this] { return read(); };
  }
  Clock::time_point read() {
    std::lock_guard lock(mutex_);
    ++reads_;
    read_.notify_all();
    return now_;
  }
  // The time, not counted as a read.
  Clock::time_point peek() const {
    std::lock_guard lock(mutex_);
    return now_;
  }
  void advance(Clock::duration d) {
    std::lock_guard lock(mutex_);
    now_ += d;
  }
  void set(Clock::time_point t) {
    std::lock_guard lock(mutex_);
    now_ = t;
  }
  uint64_t reads() const {
    std::lock_guard lock(mutex_);
    return reads_;
  }
  // Waits until the clock was read `n` times after reads() returned `since`; false when the hang
  // guard ran out.
  bool wait_reads(uint64_t since, uint64_t n) {
    std::unique_lock lock(mutex_);
    return read_.wait_for(lock, testing::kHangGuard, [&] { return reads_ >= since + n; });
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable read_;
  Clock::time_point now_;
  uint64_t reads_ = 0;
};

}  // namespace tandem::engine
