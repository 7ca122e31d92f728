#pragma once
// An Executor (seams.h) on a virtual clock, for unit tests and the cluster simulator: nothing runs
// until the owner says so. Posted tasks run in posting order on run_ready(); timers fire in time
// order (equal times in arming order) as advance_to()/advance_by() move the clock. No threads: a
// task or timer may post and arm more, and they run in the same call when due.
#include <cstddef>
#include <map>
#include <utility>

#include "gateway/seams.h"
#include "util/inline_task.h"

namespace tandem::gateway {

class VirtualExecutor final : public Executor {
 public:
  explicit VirtualExecutor(Clock::time_point start = Clock::time_point(std::chrono::hours(1)));

  Clock::time_point now() const override { return now_; }
  // Virtual time read as Unix time (the default start is 1970-01-01 01:00), so that what a run
  // logs is the same on every replay and its time stamps are the run's own.
  int64_t unix_ms() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(now_.time_since_epoch()).count();
  }
  void post(Task task) override;
  void post_batched(Task task) override;
  void set_busy(bool busy) override { busy_ = busy; }
  TimerId at(Clock::time_point when, Task task) override;
  void cancel(TimerId id) override;

  // Runs posted tasks (and what they post) until none is left; returns how many ran.
  size_t run_ready();
  // Moves the clock to `when` (never backwards), firing every timer due on the way at its own
  // time, with the posted tasks after each; then runs what is posted.
  void advance_to(Clock::time_point when);
  void advance_by(Clock::duration d) { advance_to(now_ + d); }
  // The next timer's time, if any.
  bool next_timer(Clock::time_point* when) const;
  size_t pending_timers() const { return timers_.size(); }
  size_t pending_tasks() const { return tasks_.size(); }
  bool busy() const { return busy_; }

 private:
  Clock::time_point now_;
  std::map<size_t, Task> tasks_;  // by posting sequence
  size_t next_task_ = 0;
  std::map<std::pair<Clock::time_point, uint64_t>, Task> timers_;
  uint64_t seq_ = 0;
  bool busy_ = false;
};

}  // namespace tandem::gateway
