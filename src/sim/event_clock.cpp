#include "sim/event_clock.h"

#include <algorithm>

namespace tandem::sim {

gateway::Executor::TimerId EventClock::arm(Clock::time_point when, int lane, Task task) {
  const Key key{when, lane, ++seq_};
  timers_.emplace(key, std::move(task));
  key_of_.emplace(seq_, key);
  if (lane == 0) scheduled_.insert(key);
  return TimerId{when, seq_};
}

void EventClock::cancel(TimerId id) {
  auto it = key_of_.find(id.seq);
  if (it == key_of_.end()) return;
  scheduled_.erase(it->second);
  timers_.erase(it->second);
  key_of_.erase(it);
}

void EventClock::run_ready() {
  while (!tasks_.empty()) {
    // Moved out before running: the task may post more.
    Task task = std::move(tasks_.begin()->second);
    tasks_.erase(tasks_.begin());
    task();
  }
}

void EventClock::advance_to(Clock::time_point when) {
  run_ready();
  while (!timers_.empty() && std::get<0>(timers_.begin()->first) <= when) {
    const Key key = timers_.begin()->first;
    now_ = std::max(now_, std::get<0>(key));
    Task task = std::move(timers_.begin()->second);
    timers_.erase(timers_.begin());
    key_of_.erase(std::get<2>(key));
    scheduled_.erase(key);
    task();
    run_ready();
  }
  now_ = std::max(now_, when);
  run_ready();
}

bool EventClock::next_timer(Clock::time_point* when) const {
  if (timers_.empty()) return false;
  *when = std::get<0>(timers_.begin()->first);
  return true;
}

bool EventClock::next_scheduled(Clock::time_point* when) const {
  if (scheduled_.empty()) return false;
  *when = std::get<0>(*scheduled_.begin());
  return true;
}

std::vector<gateway::Executor::Clock::duration> EventClock::pattern() const {
  std::vector<Clock::duration> out;
  for (const auto& [key, task] : timers_)
    if (std::get<1>(key) != 0) out.push_back(std::get<0>(key) - now_);
  return out;
}

std::vector<std::pair<gateway::Executor::Clock::duration, uint64_t>> EventClock::timers_from_now()
    const {
  std::vector<std::pair<Clock::duration, uint64_t>> out;
  for (const auto& [key, task] : timers_)
    if (std::get<1>(key) != 0) out.emplace_back(std::get<0>(key) - now_, std::get<2>(key));
  return out;
}

void EventClock::skip(Clock::duration span, uint64_t armed_after) {
  std::map<Key, Task> moved;
  for (auto it = timers_.begin(); it != timers_.end();) {
    if (std::get<1>(it->first) == 0 || std::get<2>(it->first) <= armed_after) {
      ++it;
      continue;
    }
    const auto& [when, lane, seq] = it->first;
    const Key key{when + span, lane, seq};
    key_of_[seq] = key;
    moved.emplace(key, std::move(it->second));
    it = timers_.erase(it);
  }
  timers_.merge(moved);
  now_ += span;
}

}  // namespace tandem::sim
