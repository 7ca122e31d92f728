#include "net/loop_tasks.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <future>

#include "net/event_loop.h"
#include "net/http_server.h"
#include "net/loop_group.h"

namespace tandem::net {
namespace {

// A task that throws is reported and dropped: the loop's other tasks and timers go on (a throw
// left the rest of a batch to run again with the next one, and the due timers unarmed).
void run_reported(LoopTasks::Task& task) {
  util::run_reported(task, "tandem: a task on an io thread");
}

}  // namespace

// The posted tasks wait in a queue of their own; the loop is handed one wake-up Task per batch,
// so a burst of posts costs one hand-over to the loop.
class LoopTasks::Impl final : public detail::Task, public detail::Timer::Target {
 public:
  explicit Impl(detail::EventLoop& loop) : loop_(loop) {}
  ~Impl() override = default;

  void post(std::shared_ptr<Impl> self, LoopTasks::Task task) {
    bool hand_over;
    {
      std::lock_guard lock(mu_);
      // The loop is gone: nothing will run it. `task` goes when this returns, after the lock
      // (what it holds may post again).
      if (loop_gone_) return;
      queue_.push_back(std::move(task));
      hand_over = !posted_;
      posted_ = true;
    }
    if (hand_over && !loop_.post(std::move(self))) {
      std::vector<LoopTasks::Task> dropped;  // destroyed after the lock, for the same reason
      std::lock_guard lock(mu_);
      loop_gone_ = true;
      dropped.swap(queue_);
    }
  }

  // The loop runs the batch.
  void run(int) override {
    {
      std::lock_guard lock(mu_);
      running_.swap(queue_);
      posted_ = false;
    }
    for (auto& t : running_) run_reported(t);
    running_.clear();
  }

  uint64_t at(Clock::time_point when, LoopTasks::Task task) {
    if (!timer_) timer_ = std::make_unique<detail::Timer>(loop_, *this);
    const uint64_t id = ++seq_;
    timers_.emplace(std::make_pair(when, id), std::move(task));
    arm();
    return id;
  }

  void cancel(Clock::time_point when, uint64_t id) { timers_.erase(std::make_pair(when, id)); }

  void on_timer() override {
    const auto now = Clock::now();
    while (!timers_.empty() && timers_.begin()->first.first <= now) {
      // Moved out before it runs: it may arm or cancel timers.
      LoopTasks::Task task = std::move(timers_.begin()->second);
      timers_.erase(timers_.begin());
      run_reported(task);
    }
    arm();
  }

  bool in_loop() const { return loop_.in_loop_thread(); }

  void destroy_timer() { timer_.reset(); }

 private:
  void arm() {
    if (timers_.empty()) {
      timer_->disarm();
      return;
    }
    const auto left = timers_.begin()->first.first - Clock::now();
    // Rounded up: a timer never fires early.
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left);
    timer_->arm(std::max(ms, std::chrono::milliseconds(0)));
  }

  detail::EventLoop& loop_;
  std::mutex mu_;
  std::vector<LoopTasks::Task> queue_;  // under mu_
  bool posted_ = false;                 // under mu_: a wake-up is with the loop
  bool loop_gone_ = false;              // under mu_: the loop refused a wake-up (it stopped)
  std::vector<LoopTasks::Task> running_;
  // Loop thread only.
  std::unique_ptr<detail::Timer> timer_;
  std::map<std::pair<Clock::time_point, uint64_t>, LoopTasks::Task> timers_;
  uint64_t seq_ = 0;
};

LoopTasks::LoopTasks(HttpServer& server, size_t loop)
    : impl_(std::make_shared<Impl>(server.loops().at(loop))) {}

LoopTasks::~LoopTasks() {
  // The server is stopped (its loops joined) by now: the timer's slot can go from this thread.
  impl_->destroy_timer();
}

void LoopTasks::post(Task task) {
  impl_->post(impl_, std::move(task));
}

uint64_t LoopTasks::at(Clock::time_point when, Task task) {
  return impl_->at(when, std::move(task));
}

void LoopTasks::cancel(Clock::time_point when, uint64_t id) {
  impl_->cancel(when, id);
}

bool LoopTasks::in_loop() const {
  return impl_->in_loop();
}

void pass_io_threads(HttpServer& server, size_t threads) {
  for (size_t i = 0; i < threads; ++i) {
    LoopTasks loop(server, i);
    for (int pass = 0; pass < 2; ++pass) {
      std::promise<void> ran;
      loop.post([&ran] { ran.set_value(); });
      ran.get_future().wait();
    }
  }
}

}  // namespace tandem::net
