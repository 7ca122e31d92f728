#pragma once
// The event loop under Tandem's HTTP stack: one thread, Linux epoll, edge-triggered. Internal to
// src/net.
//
// Why its own loop and not Asio: a proxied request should cost about what it costs nginx, and
// the generic machinery (type-erased executors, per-operation handlers and deadline timers, an
// epoll_ctl per wait) cost several times that. Here
// - each socket is registered once, for input and output, edge-triggered, for its whole life;
//   an owner reads until a short read and writes until done, so no per-operation re-arming;
// - timeouts are a field in a per-loop table checked once per iteration (no syscall per arm);
//   re-arming a timer with a later deadline, the common case, is a store;
// - other threads hand work over through a briefly locked queue and one eventfd write per batch,
//   skipped while the loop is known to be awake;
// - work the loop's own thread produces for a connection (a relayed response) is deferred to the
//   end of the iteration, so it leaves in one write.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tandem::net::detail {

class EventLoop;

// Receives readiness events of one registered fd (EPOLLIN, EPOLLOUT, EPOLLRDHUP, EPOLLERR...).
class IoHandler {
 public:
  virtual void on_io(uint32_t events) = 0;

 protected:
  ~IoHandler() = default;
};

// Work handed to a loop from any thread. `op` says what to do, so one object can be posted for
// several purposes (start, cancel) without a closure per post.
class Task {
 public:
  virtual ~Task() = default;
  virtual void run(int op) = 0;
};

// Something to run once at the end of the current loop iteration (see EventLoop::defer).
class Deferred {
 public:
  virtual void run_deferred() = 0;

 protected:
  ~Deferred() = default;

 private:
  friend class EventLoop;
  bool queued_ = false;
};

// Something the loop destroys at the end of the iteration, once no event of this iteration can
// reach it any more (see EventLoop::retire).
class Retired {
 public:
  virtual ~Retired() = default;
};

// A deadline owned by a connection. Loop thread only. The target's on_timer runs on the loop
// when the deadline passes; it is not called after disarm() or destruction.
class Timer {
 public:
  class Target {
   public:
    virtual void on_timer() = 0;

   protected:
    ~Target() = default;
  };

  Timer(EventLoop& loop, Target& target);
  ~Timer();
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  void arm(std::chrono::milliseconds after);
  void disarm();
  bool armed() const;

 private:
  EventLoop& loop_;
  uint32_t slot_;
};

class EventLoop {
 public:
  EventLoop();
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Registers `fd` for its lifetime: edge-triggered input, output and peer half-close. Closing
  // the fd unregisters it; `handler` must stay valid until then (retire() it).
  void add(int fd, IoHandler* handler);
  // A listening socket shared by several loops: level-triggered input, EPOLLEXCLUSIVE so one
  // connection wakes one loop.
  void add_listener(int fd, IoHandler* handler);
  void remove(int fd);

  // Any thread. The task runs on the loop thread, in posting order. Returns false (and drops the
  // task) once the loop was stopped for good.
  bool post(std::shared_ptr<Task> task, int op = 0);
  bool post(std::function<void()> fn);  // for rare paths (stop, shutdown)

  // Loop thread. Runs `d` at the end of this iteration (once, however often it is deferred).
  void defer(Deferred* d);
  // Loop thread. Destroys `r` at the end of this iteration.
  void retire(std::unique_ptr<Retired> r);

  // Runs until stop(); on the calling thread, which becomes the loop thread.
  void run();
  // Where exceptions escaping a callback are reported (the loop carries on). Before run().
  void set_error_log(std::function<void(const std::string&)> log) { log_ = std::move(log); }
  // Any thread: run() returns after the current iteration. Tasks posted later are dropped.
  void stop();

  bool in_loop_thread() const { return current() == this; }
  // The loop running on this thread, or nullptr.
  static EventLoop* current();
  // The loop's clock (steady, milliseconds), read once per iteration.
  int64_t now_ms() const { return now_ms_; }

 private:
  friend class Timer;
  struct Posted {
    std::shared_ptr<Task> task;
    std::function<void()> fn;
    int op = 0;
  };
  struct TimerSlot {
    Timer::Target* target = nullptr;
    int64_t deadline = 0;        // 0: disarmed
    int64_t queued = INT64_MAX;  // earliest deadline with an entry in heap_
    uint32_t generation = 0;     // bumped when the slot is freed
  };
  struct HeapEntry {
    int64_t when;
    uint32_t slot;
    uint32_t generation;
  };

  uint32_t timer_create(Timer::Target* target);
  void timer_destroy(uint32_t slot);
  void timer_arm(uint32_t slot, int64_t deadline);
  void run_timers();
  int next_timeout_ms() const;
  void run_posted();
  void run_deferred();
  void wake();
  void update_clock();
  void report(const char* what) const;
  template <class F>
  void guarded(F&& f);

  int epoll_fd_ = -1;
  int wake_fd_ = -1;

  // Cross-thread queue. kAwake: the loop will look at the queue before it sleeps again;
  // kPolling: it may sleep in epoll_wait, a poster must write the eventfd; kWoken: someone did.
  enum : int { kAwake, kPolling, kWoken };
  std::atomic<int> state_{kAwake};
  std::mutex queue_mu_;
  std::vector<Posted> queue_;    // guarded by queue_mu_
  std::vector<Posted> running_;  // loop thread: the batch being run
  bool stopped_ = false;         // guarded by queue_mu_
  std::atomic<bool> stop_{false};

  std::vector<Deferred*> deferred_;
  std::vector<Deferred*> deferred_running_;
  std::vector<std::unique_ptr<Retired>> retired_;

  std::vector<TimerSlot> slots_;
  std::vector<uint32_t> free_slots_;
  std::vector<HeapEntry> heap_;  // min-heap on `when`

  int64_t now_ms_ = 0;
  std::function<void(const std::string&)> log_;
};

}  // namespace tandem::net::detail
