#include "net/event_loop.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "util/error.h"

namespace tandem::net::detail {

namespace {

thread_local EventLoop* t_current = nullptr;

// The wake-up eventfd is registered with this tag instead of a handler.
IoHandler* const kWakeTag = nullptr;

// std::push_heap and friends build a max-heap; this order makes it a min-heap on `when`.
constexpr auto kLater = [](const auto& a, const auto& b) { return a.when > b.when; };

// Runs a callback; an exception escaping it is reported, not allowed to end the io thread.

int64_t steady_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Timer

Timer::Timer(EventLoop& loop, Target& target) : loop_(loop), slot_(loop.timer_create(&target)) {}

Timer::~Timer() {
  loop_.timer_destroy(slot_);
}

void Timer::arm(std::chrono::milliseconds after) {
  // Never 0, which means disarmed.
  loop_.timer_arm(slot_, std::max<int64_t>(1, loop_.now_ms() + after.count()));
}

void Timer::disarm() {
  loop_.timer_arm(slot_, 0);
}

bool Timer::armed() const {
  return loop_.slots_[slot_].deadline != 0;
}

// ---------------------------------------------------------------------------------------------
// EventLoop

EventLoop::EventLoop() {
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) throw Error(std::string("epoll_create1: ") + std::strerror(errno));
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    ::close(epoll_fd_);
    throw Error(std::string("eventfd: ") + std::strerror(errno));
  }
  // Edge-triggered and never read: every write is a new edge, and the counter cannot overflow
  // in practice (2^64 writes), so waking costs the poster one write and the loop nothing.
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLET;
  ev.data.ptr = kWakeTag;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  now_ms_ = steady_ms();
  heap_.reserve(64);
}

EventLoop::~EventLoop() {
  queue_.clear();
  running_.clear();
  retired_.clear();
  ::close(wake_fd_);
  ::close(epoll_fd_);
}

void EventLoop::add(int fd, IoHandler* handler) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
  ev.data.ptr = handler;
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    throw Error(std::string("epoll_ctl ADD: ") + std::strerror(errno));
  }
}

void EventLoop::add_listener(int fd, IoHandler* handler) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLEXCLUSIVE;
  ev.data.ptr = handler;
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    throw Error(std::string("epoll_ctl ADD (listener): ") + std::strerror(errno));
  }
}

void EventLoop::remove(int fd) {
  epoll_event ev{};
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, &ev);
}

bool EventLoop::post(std::shared_ptr<Task> task, int op) {
  {
    std::lock_guard lock(queue_mu_);
    if (stopped_) return false;
    queue_.push_back(Posted{std::move(task), {}, op});
  }
  wake();
  return true;
}

bool EventLoop::post(std::function<void()> fn) {
  {
    std::lock_guard lock(queue_mu_);
    if (stopped_) return false;
    queue_.push_back(Posted{nullptr, std::move(fn), 0});
  }
  wake();
  return true;
}

void EventLoop::wake() {
  // Only a loop that may be asleep needs the eventfd, and only once per sleep. The loop sets
  // kPolling before its last look at the queue (seq_cst on both sides), so either it sees our
  // item or we see kPolling.
  int expected = kPolling;
  if (state_.load() == kPolling && state_.compare_exchange_strong(expected, kWoken)) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof one);
  }
}

void EventLoop::stop() {
  {
    std::lock_guard lock(queue_mu_);
    stopped_ = true;
  }
  stop_.store(true);
  int expected = kPolling;
  if (state_.compare_exchange_strong(expected, kWoken)) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof one);
  }
}

EventLoop* EventLoop::current() {
  return t_current;
}

void EventLoop::defer(Deferred* d) {
  if (d->queued_) return;
  d->queued_ = true;
  deferred_.push_back(d);
}

void EventLoop::retire(std::unique_ptr<Retired> r) {
  retired_.push_back(std::move(r));
}

template <class F>
void EventLoop::guarded(F&& f) {
  // An exception escaping a callback is reported; it must not end the io thread.
  try {
    f();
  } catch (const std::exception& e) {
    report(e.what());
  } catch (...) {
    report("a non-standard exception");
  }
}

void EventLoop::report(const char* what) const {
  std::string message = std::string("io thread: a callback threw: ") + what;
  if (log_) {
    log_(message);
  } else {
    std::fprintf(stderr, "tandem net: %s\n", message.c_str());
  }
}

void EventLoop::update_clock() {
  now_ms_ = steady_ms();
}

void EventLoop::run() {
  t_current = this;
  constexpr int kMaxEvents = 128;
  epoll_event events[kMaxEvents];
  for (;;) {
    state_.store(kPolling);
    bool work_waiting = false;
    {
      std::lock_guard lock(queue_mu_);
      work_waiting = !queue_.empty();
    }
    int timeout = work_waiting || stop_.load() ? 0 : next_timeout_ms();
    int n = ::epoll_wait(epoll_fd_, events, kMaxEvents, timeout);
    state_.store(kAwake);
    update_clock();
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < n; ++i) {
      auto* handler = static_cast<IoHandler*>(events[i].data.ptr);
      if (handler != kWakeTag) guarded([&] { handler->on_io(events[i].events); });
    }
    run_posted();
    run_timers();
    run_deferred();
    retired_.clear();
    if (stop_.load()) {
      // What was posted before stop() still runs; nothing can be posted after it.
      run_posted();
      run_deferred();
      retired_.clear();
      break;
    }
  }
  t_current = nullptr;
}

void EventLoop::run_posted() {
  {
    std::lock_guard lock(queue_mu_);
    if (queue_.empty()) return;
    running_.swap(queue_);
  }
  // Both vectors keep their capacity: posting does not allocate in steady state.
  for (Posted& p : running_) {
    if (p.task) {
      guarded([&] { p.task->run(p.op); });
    } else if (p.fn) {
      guarded([&] { p.fn(); });
    }
  }
  running_.clear();
}

void EventLoop::run_deferred() {
  // Deferred work may defer more (a flush that completes a response starts the next request).
  while (!deferred_.empty()) {
    deferred_running_.swap(deferred_);
    for (Deferred* d : deferred_running_) {
      d->queued_ = false;
      guarded([&] { d->run_deferred(); });
    }
    deferred_running_.clear();
  }
}

// ---------------------------------------------------------------------------------------------
// Timers: slots with a deadline each, and a min-heap of (deadline, slot) entries. An entry is a
// promise to look at the slot then, not the deadline itself: re-arming later only stores the new
// deadline, and the expired entry re-queues it. A slot may have stale entries; they are skipped.

uint32_t EventLoop::timer_create(Timer::Target* target) {
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  }
  TimerSlot& s = slots_[slot];
  s.target = target;
  s.deadline = 0;
  s.queued = INT64_MAX;
  return slot;
}

void EventLoop::timer_destroy(uint32_t slot) {
  TimerSlot& s = slots_[slot];
  s.target = nullptr;
  s.deadline = 0;
  s.queued = INT64_MAX;
  ++s.generation;  // entries still in the heap no longer match
  free_slots_.push_back(slot);
}

void EventLoop::timer_arm(uint32_t slot, int64_t deadline) {
  TimerSlot& s = slots_[slot];
  s.deadline = deadline;
  if (deadline != 0 && deadline < s.queued) {
    s.queued = deadline;
    heap_.push_back(HeapEntry{deadline, slot, s.generation});
    std::push_heap(heap_.begin(), heap_.end(), kLater);
  }
}

void EventLoop::run_timers() {
  while (!heap_.empty() && heap_.front().when <= now_ms_) {
    std::pop_heap(heap_.begin(), heap_.end(), kLater);
    HeapEntry e = heap_.back();
    heap_.pop_back();
    TimerSlot& s = slots_[e.slot];
    if (e.generation != s.generation) continue;
    if (e.when == s.queued) s.queued = INT64_MAX;
    if (s.deadline == 0) continue;
    if (s.deadline <= now_ms_) {
      s.deadline = 0;
      // May re-arm, or create and destroy timers: `s` is not used after.
      guarded([&] { s.target->on_timer(); });
    } else if (s.deadline < s.queued) {
      s.queued = s.deadline;
      heap_.push_back(HeapEntry{s.deadline, e.slot, s.generation});
      std::push_heap(heap_.begin(), heap_.end(), kLater);
    }
  }
}

int EventLoop::next_timeout_ms() const {
  if (heap_.empty()) return -1;
  // The clock of this iteration, not a fresh reading: a deadline is at most one iteration late,
  // and a clock read per iteration is saved.
  int64_t wait = heap_.front().when - now_ms_;
  if (wait <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(wait, 1 << 30));
}

}  // namespace tandem::net::detail
