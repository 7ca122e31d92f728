#pragma once
// The gateway's one scheduling thread: it owns every global decision and the state behind them
// (the endpoints, their load and health, the waiting queue), so that state needs no locks. Other
// threads (HTTP io threads, the upstream client thread) hand it work with post(), a lock-free
// multi-producer queue plus a semaphore wake-up: nothing on the request path takes a mutex to
// reach the scheduler. Timers (queue and phase timeouts, health probes) run on the same thread.
// This is the counterpart of Omni Proxy's master worker and its shared-memory state.
#include <chrono>
#include <cstdint>
#include <memory>

#include "gateway/seams.h"

namespace tandem::gateway {

// The running gateway's Executor (seams.h): a real thread on the steady clock.
class SchedulingThread final : public Executor {
 public:
  explicit SchedulingThread(std::chrono::microseconds tick = std::chrono::microseconds(250));
  ~SchedulingThread() override;  // stop()
  SchedulingThread(const SchedulingThread&) = delete;
  SchedulingThread& operator=(const SchedulingThread&) = delete;

  void start();
  // Runs the tasks already posted, drops pending timers, joins. Idempotent; not from the thread.
  void stop();

  // Any thread: runs `task` on the scheduling thread, in posting order per producer (post and
  // post_batched share one queue). Tasks posted after stop() are dropped.
  void post(Task task) override;
  // As post(), but while the thread is busy (set_busy) the task waits for the next tick instead
  // of waking the thread: under load the scheduler handles tasks in batches, one wake-up per
  // tick rather than per task (Omni Proxy schedules on a 1 ms timer the same way). When idle, it
  // wakes the thread at once like post().
  void post_batched(Task task) override;
  // Scheduling thread only: while busy, the thread wakes at least every `tick` and
  // post_batched() does not wake it.
  void set_busy(bool busy) override;
  // Scheduling thread only: runs `task` at `when` (or soon after).
  TimerId at(Clock::time_point when, Task task) override;
  // Scheduling thread only: drops a timer that has not fired yet, and its task (what it
  // captured is freed now). Per-request timeouts are cancelled when the request moves on, so
  // pending timers stay as few as the requests in flight rather than piling up for the whole
  // timeout at high request rates. Ids of fired or cancelled timers are ignored.
  void cancel(TimerId id) override;
  bool on_thread() const;
  Clock::time_point now() const override { return Clock::now(); }

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::gateway
