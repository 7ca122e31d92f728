#pragma once
// The gateway's three seams: where its scheduling code meets time, the engines and the client.
// The running gateway plugs in its scheduling thread (scheduling_thread.h), the HTTP client and
// the server's exchanges (http_seams.h); unit tests and a virtual-time simulator plug in a
// virtual clock (virtual_executor.h) and fakes, and drive the same dispatcher, relay and health
// code with no socket, thread or sleep.
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "net/async_http_client.h"
#include "net/reply.h"
#include "util/inline_task.h"

namespace tandem::gateway {

// The thread every scheduling decision runs on, and its clock. post()/post_batched() and now()
// may be called from any thread; at(), cancel() and set_busy() only from the executor's own.
class Executor {
 public:
  using Task = util::InlineTask;  // closures up to 64 bytes are posted without a heap allocation
  using Clock = std::chrono::steady_clock;
  // A timer armed by at(), for cancel().
  struct TimerId {
    Clock::time_point when{};
    uint64_t seq = 0;  // 0: none
  };

  virtual ~Executor() = default;
  virtual Clock::time_point now() const = 0;
  // Runs `task` on the executor, in posting order per producer (post and post_batched share one
  // queue). post_batched may wait for the next tick while the executor is busy (set_busy).
  virtual void post(Task task) = 0;
  virtual void post_batched(Task task) = 0;
  virtual void set_busy(bool busy) = 0;
  // Runs `task` at `when` (or soon after).
  virtual TimerId at(Clock::time_point when, Task task) = 0;
  // Drops a timer that has not fired yet, and its task. Ids of fired or cancelled timers are
  // ignored.
  virtual void cancel(TimerId id) = 0;

  int64_t now_ns() const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(now().time_since_epoch()).count();
  }
  // The time logs and answers carry (Unix milliseconds): the system clock's, except where the
  // executor keeps its own time (a virtual clock's runs are then logged in that time).
  virtual int64_t unix_ms() const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};

// The engines, as the gateway calls them: one HTTP call per leg, probe or poll. Callbacks may run
// on any thread (the client's io threads) but one at a time per call; on_done always comes once
// for a started call, also after cancel(). Thread-safe.
class Upstream {
 public:
  using CallId = uint64_t;
  virtual ~Upstream() = default;
  virtual CallId start(net::AsyncHttpRequest request, net::AsyncHttpHandlers handlers) = 0;
  virtual void cancel(CallId id) = 0;  // unknown or finished ids are ignored
};

// The client's side of one request: what the gateway answers it (net/reply.h).
using ClientReply = net::Reply;

}  // namespace tandem::gateway
