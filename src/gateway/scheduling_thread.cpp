#include "gateway/scheduling_thread.h"

#include <atomic>
#include <queue>
#include <semaphore>
#include <thread>
#include <vector>

#include <boost/lockfree/queue.hpp>

namespace tandem::gateway {

class SchedulingThread::Impl {
 public:
  Impl() : queue_(1024) {}

  ~Impl() {
    stop();
    Task* t = nullptr;
    while (queue_.pop(t)) delete t;
  }

  void start() {
    running_ = true;
    thread_ = std::thread([this] { loop(); });
  }

  void stop() {
    if (!thread_.joinable()) return;
    running_ = false;
    wake_.release();
    thread_.join();
  }

  void post(Task task) {
    if (stopped_.load()) return;
    queue_.push(new Task(std::move(task)));
    // Only a parked loop needs the (system-call) wake-up; a busy one finds the task anyway.
    if (sleeping_.exchange(false)) wake_.release();
  }

  void at(Clock::time_point when, Task task) { timers_.push({when, seq_++, std::move(task)}); }

  bool on_thread() const { return std::this_thread::get_id() == thread_id_.load(); }

 private:
  struct Timer {
    Clock::time_point when;
    uint64_t seq;  // equal times run in arming order
    Task task;
    bool operator>(const Timer& o) const { return when != o.when ? when > o.when : seq > o.seq; }
  };

  void drain() {
    Task* t = nullptr;
    while (queue_.pop(t)) {
      std::unique_ptr<Task> owned(t);
      (*owned)();
    }
  }

  void loop() {
    // Set here, not from thread_ in start(): a task posted before start() runs before start()
    // has assigned thread_, and reading thread_ from this thread then would be a data race.
    thread_id_ = std::this_thread::get_id();
    while (running_.load()) {
      drain();
      const auto now = Clock::now();
      while (!timers_.empty() && timers_.top().when <= now) {
        // Copy out before pop: the task may arm new timers.
        Task task = std::move(const_cast<Timer&>(timers_.top()).task);
        timers_.pop();
        task();
      }
      // Announce the park, then look once more: a post() that pushed before this check is
      // seen here, one that pushes after it sees sleeping_ and wakes us (both seq_cst).
      sleeping_.store(true);
      if (!queue_.empty()) {
        sleeping_.store(false);
        continue;
      }
      if (timers_.empty())
        (void)wake_.try_acquire_for(std::chrono::milliseconds(200));
      else
        (void)wake_.try_acquire_until(timers_.top().when);
      sleeping_.store(false);
    }
    stopped_ = true;
    drain();  // what was posted before stop still runs (it may complete requests)
    timers_ = {};
    thread_id_ = std::thread::id();  // ids of joined threads are reused by new ones
  }

  boost::lockfree::queue<Task*> queue_;
  // A release per post; the loop drains everything per acquire, so extra counts only cause a
  // spare wake-up. The maximum is far above any realistic backlog.
  std::counting_semaphore<1 << 30> wake_{0};
  std::priority_queue<Timer, std::vector<Timer>, std::greater<>> timers_;
  uint64_t seq_ = 0;
  std::atomic<bool> running_{false}, stopped_{false}, sleeping_{false};
  std::atomic<std::thread::id> thread_id_{};  // the running loop's thread; none when not running
  std::thread thread_;
};

SchedulingThread::SchedulingThread() : impl_(std::make_unique<Impl>()) {}
SchedulingThread::~SchedulingThread() = default;
void SchedulingThread::start() {
  impl_->start();
}
void SchedulingThread::stop() {
  impl_->stop();
}
void SchedulingThread::post(Task task) {
  impl_->post(std::move(task));
}
void SchedulingThread::at(Clock::time_point when, Task task) {
  impl_->at(when, std::move(task));
}
bool SchedulingThread::on_thread() const {
  return impl_->on_thread();
}

}  // namespace tandem::gateway
