#pragma once
// The cluster simulator's executor: gateway::VirtualExecutor's order (posted tasks in posting
// order, timers in time order, equal times in arming order) plus two things a long run needs.
// Timers of the run's own schedule (arrivals, faults), armed with schedule(), come before other
// timers due at the same instant, as when they were all armed before the run started, so that
// they can be armed one at a time (a trace of 10^7 requests armed at once held 10^7 timers).
// And skip(): the clock moves on by a span and every timer but the schedule's moves with it,
// for an idle cluster whose only timers repeat (the gateway's probes and polls): those timers
// would have done nothing in the span but repeat themselves (cluster_simulation.cpp decides
// when; a trace's idle hours took minutes timer by timer).
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gateway/seams.h"

namespace tandem::sim {

class EventClock final : public gateway::Executor {
 public:
  // The start is VirtualExecutor's, so that a run's access log reads the same times.
  explicit EventClock(Clock::time_point start = Clock::time_point(std::chrono::hours(1)))
      : now_(start) {}

  Clock::time_point now() const override { return now_; }
  int64_t unix_ms() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(now_.time_since_epoch()).count();
  }
  void post(Task task) override { tasks_.emplace(next_task_++, std::move(task)); }
  void post_batched(Task task) override { post(std::move(task)); }
  void set_busy(bool) override {}
  TimerId at(Clock::time_point when, Task task) override { return arm(when, 1, std::move(task)); }
  // Ids are looked up by their sequence number: a skip moves a timer's time.
  void cancel(TimerId id) override;

  // A timer of the run's own schedule: before any other due at the same time; a skip leaves it.
  TimerId schedule(Clock::time_point when, Task task) { return arm(when, 0, std::move(task)); }

  // Runs posted tasks (and what they post) until none is left.
  void run_ready();
  // Moves the clock to `when`, firing every timer due on the way at its own time, with the
  // posted tasks after each.
  void advance_to(Clock::time_point when);
  bool next_timer(Clock::time_point* when) const;
  bool next_scheduled(Clock::time_point* when) const;  // the schedule's next timer
  size_t pending_tasks() const { return tasks_.size(); }
  // The times from now of the timers that are not the schedule's, in firing order: equal at two
  // times a period apart when they only repeat.
  std::vector<Clock::duration> pattern() const;
  // The same with each timer's sequence number: a timer armed later has a larger one, and
  // sequence() is the last armed. Tells the timers armed since a moment from those older.
  std::vector<std::pair<Clock::duration, uint64_t>> timers_from_now() const;
  uint64_t sequence() const { return seq_; }
  // Moves now and every timer not of the schedule armed after `armed_after` (0: every one) on by
  // `span`, none of them firing. The caller makes sure nothing lies between (no posted task, no
  // schedule timer and no timer left in place before the moved ones).
  void skip(Clock::duration span, uint64_t armed_after = 0);

 private:
  // Timers by (time, lane, sequence): lane 0 is the schedule's.
  using Key = std::tuple<Clock::time_point, int, uint64_t>;
  TimerId arm(Clock::time_point when, int lane, Task task);

  Clock::time_point now_;
  std::map<size_t, Task> tasks_;  // by posting sequence
  size_t next_task_ = 0;
  std::map<Key, Task> timers_;
  std::unordered_map<uint64_t, Key> key_of_;  // by sequence
  uint64_t seq_ = 0;
  std::set<Key> scheduled_;  // the lane-0 timers
};

}  // namespace tandem::sim
