#pragma once
// A fixed set of event loops, each with its own thread once started: the io threads of a server,
// or the one thread of a standalone AsyncHttpClient. Internal to src/net.
#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "net/event_loop.h"

namespace tandem::net::detail {

class LoopGroup {
 public:
  // The loops exist from here on (work can be posted); threads start with start().
  explicit LoopGroup(size_t loops);
  ~LoopGroup();  // stop_and_join()
  LoopGroup(const LoopGroup&) = delete;
  LoopGroup& operator=(const LoopGroup&) = delete;

  size_t size() const { return loops_.size(); }
  EventLoop& at(size_t i) { return *loops_[i]; }
  // The index of the loop running on the calling thread if it is one of these, else of the next
  // one in turn: a call started on an io thread stays on that thread.
  size_t pick();

  // One thread per loop. `log` reports exceptions that escaped a callback (the loop goes on).
  void start(std::function<void(const std::string&)> log);
  bool running() const { return running_.load(); }
  // Stops every loop after what was posted before, and joins the threads. Idempotent.
  void stop_and_join();

 private:
  std::vector<std::unique_ptr<EventLoop>> loops_;
  std::vector<std::thread> threads_;
  std::atomic<size_t> next_{0};
  std::atomic<bool> running_{false};
};

}  // namespace tandem::net::detail
