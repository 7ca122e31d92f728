#include "gateway/scheduling_thread.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <ctime>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include <boost/lockfree/queue.hpp>

namespace tandem::gateway {

class SchedulingThread::Impl {
 public:
  explicit Impl(std::chrono::microseconds tick) : tick_(tick), queue_(1024) {}

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
    wake();
    thread_.join();
  }

  void post(Task task) {
    // After stop only the final drain's own tasks still get in (it runs them too).
    if (stopped_.load() && !on_thread()) return;
    queue_.push(new Task(std::move(task)));
    // Only a parked loop needs the (system-call) wake-up; a busy one finds the task anyway.
    if (sleeping_.exchange(false)) wake();
  }

  void post_batched(Task task) {
    if (stopped_.load() && !on_thread()) return;
    queue_.push(new Task(std::move(task)));
    // While busy the loop parks for one tick at most and finds the task then.
    if (!busy_.load() && sleeping_.exchange(false)) wake();
  }

  void set_busy(bool busy) { busy_.store(busy); }

  TimerId at(Clock::time_point when, Task task) {
    const TimerId id{when, ++seq_};
    timers_.emplace(std::make_pair(when, id.seq), std::move(task));
    return id;
  }

  void cancel(TimerId id) {
    if (id.seq != 0) timers_.erase(std::make_pair(id.when, id.seq));
  }

  bool on_thread() const { return std::this_thread::get_id() == thread_id_.load(); }

 private:
  // A task that throws, posted or a timer's, is reported and dropped: the thread that owns every
  // decision must not die with it (an exception leaving it ends the process).
  static void run_reported(Task& task) {
    util::run_reported(task, "tandem gateway: a scheduling task");
  }

  // Runs everything queued.
  void drain() {
    Task* t = nullptr;
    while (queue_.pop(t)) {
      std::unique_ptr<Task> owned(t);
      run_reported(*owned);
    }
  }

  void loop() {
    // Set here, not from thread_ in start(): a task posted before start() runs before start()
    // has assigned thread_, and reading thread_ from this thread then would be a data race.
    thread_id_ = std::this_thread::get_id();
    while (running_.load()) {
      drain();
      const auto now = Clock::now();
      while (!timers_.empty() && timers_.begin()->first.first <= now) {
        // Moved out before erasing: the task may arm or cancel timers.
        Task task = std::move(timers_.begin()->second);
        timers_.erase(timers_.begin());
        run_reported(task);
      }
      // Announce the park, then look once more: a post() that pushed before this check is
      // seen here, one that pushes after it sees sleeping_ and wakes us (both seq_cst).
      sleeping_.store(true);
      if (!queue_.empty()) {
        sleeping_.store(false);
        continue;
      }
      auto until = timers_.empty() ? Clock::now() + std::chrono::milliseconds(200)
                                   : timers_.begin()->first.first;
      if (busy_.load()) until = std::min(until, Clock::now() + tick_);
      park(until);
      sleeping_.store(false);
    }
    stopped_ = true;
    drain();  // what was posted before stop still runs (it may complete requests)
    timers_.clear();
    thread_id_ = std::thread::id();  // ids of joined threads are reused by new ones
  }

  // A futex on a counter: wake() bumps it and wakes the loop; park() sleeps until the counter
  // moves or the deadline passes. (GCC 12's counting_semaphore::try_acquire_until polls with
  // sched_yield and growing sleeps instead of blocking, which costs CPU and delays wake-ups.)
  void wake() {
    wake_seq_.fetch_add(1);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_seq_), FUTEX_WAKE_PRIVATE, 1, nullptr,
            nullptr, 0);
  }
  void park(Clock::time_point until) {
    const uint32_t seen = wake_seq_.load();
    if (!queue_.empty() || !running_.load()) return;
    const auto left = until - Clock::now();
    if (left <= Clock::duration::zero()) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_seq_), FUTEX_WAIT_PRIVATE, seen, &ts,
            nullptr, 0);
  }

  const std::chrono::microseconds tick_;
  boost::lockfree::queue<Task*> queue_;
  std::atomic<uint32_t> wake_seq_{0};
  // Keyed by (time, arming sequence): equal times run in arming order, and a timer can be
  // found again to cancel it.
  std::map<std::pair<Clock::time_point, uint64_t>, Task> timers_;
  uint64_t seq_ = 0;
  std::atomic<bool> running_{false}, stopped_{false}, sleeping_{false}, busy_{false};
  std::atomic<std::thread::id> thread_id_{};  // the running loop's thread; none when not running
  std::thread thread_;
};

SchedulingThread::SchedulingThread(std::chrono::microseconds tick)
    : impl_(std::make_unique<Impl>(tick)) {}
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
void SchedulingThread::post_batched(Task task) {
  impl_->post_batched(std::move(task));
}
void SchedulingThread::set_busy(bool busy) {
  impl_->set_busy(busy);
}
SchedulingThread::TimerId SchedulingThread::at(Clock::time_point when, Task task) {
  return impl_->at(when, std::move(task));
}
void SchedulingThread::cancel(TimerId id) {
  impl_->cancel(id);
}
bool SchedulingThread::on_thread() const {
  return impl_->on_thread();
}

}  // namespace tandem::gateway
