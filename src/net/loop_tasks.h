#pragma once
// Work and timers on one of a server's io threads: for a component that keeps its state on an io
// thread instead of a thread of its own. With one io thread, a proxy whose decisions run there
// (the gateway's dispatcher) serves a request on a single thread, as an nginx worker does: no
// hand-off, no wake-up of another thread, and its upstream calls start on the same loop.
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "util/inline_task.h"

namespace tandem::net {

class HttpServer;

class LoopTasks {
 public:
  using Task = util::InlineTask;
  using Clock = std::chrono::steady_clock;

  // Runs on `server`'s io thread `loop` (0 .. threads-1). The server must outlive this and be
  // stopped before it is destroyed (or never started).
  LoopTasks(HttpServer& server, size_t loop = 0);
  ~LoopTasks();
  LoopTasks(const LoopTasks&) = delete;
  LoopTasks& operator=(const LoopTasks&) = delete;

  // Any thread: runs `task` on the loop, in posting order, after the loop's current events (tasks
  // posted from the loop itself run at the end of its iteration: they batch). Dropped once the
  // server stopped.
  void post(Task task);
  // Loop thread: runs `task` at `when` (millisecond resolution, never early). Returns an id for
  // cancel() with the same `when`; fired or cancelled timers are ignored.
  uint64_t at(Clock::time_point when, Task task);
  void cancel(Clock::time_point when, uint64_t id);
  bool in_loop() const;

 private:
  class Impl;
  std::shared_ptr<Impl> impl_;
};

// Returns once each of `server`'s io threads 0 .. threads-1 has run a task posted now, then one
// posted after that: the handlers running now have returned, and what they wrote went to the
// sockets in their thread's next iteration. For a stop that lets answers out before it closes
// the connections. The server must be running (a stopped one runs no task: this would wait for
// ever).
void pass_io_threads(HttpServer& server, size_t threads);

}  // namespace tandem::net
