#include "gateway/virtual_executor.h"

#include <algorithm>

namespace tandem::gateway {

VirtualExecutor::VirtualExecutor(Clock::time_point start) : now_(start) {}

void VirtualExecutor::post(Task task) {
  tasks_.emplace(next_task_++, std::move(task));
}

void VirtualExecutor::post_batched(Task task) {
  post(std::move(task));
}

Executor::TimerId VirtualExecutor::at(Clock::time_point when, Task task) {
  const TimerId id{when, ++seq_};
  timers_.emplace(std::make_pair(when, id.seq), std::move(task));
  return id;
}

void VirtualExecutor::cancel(TimerId id) {
  if (id.seq != 0) timers_.erase(std::make_pair(id.when, id.seq));
}

size_t VirtualExecutor::run_ready() {
  size_t ran = 0;
  while (!tasks_.empty()) {
    // Moved out before running: the task may post more.
    Task task = std::move(tasks_.begin()->second);
    tasks_.erase(tasks_.begin());
    task();
    ++ran;
  }
  return ran;
}

void VirtualExecutor::advance_to(Clock::time_point when) {
  run_ready();
  while (!timers_.empty() && timers_.begin()->first.first <= when) {
    now_ = std::max(now_, timers_.begin()->first.first);
    Task task = std::move(timers_.begin()->second);
    timers_.erase(timers_.begin());
    task();
    run_ready();
  }
  now_ = std::max(now_, when);
  run_ready();
}

bool VirtualExecutor::next_timer(Clock::time_point* when) const {
  if (timers_.empty()) return false;
  *when = timers_.begin()->first.first;
  return true;
}

}  // namespace tandem::gateway
