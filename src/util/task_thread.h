#pragma once
// One thread that runs posted tasks in the order they were posted. The engine renders response
// bytes on one, so its step loop hands an output over and goes on computing. Tasks posted after
// stop() (or to a thread never started) run on the posting thread at once: whoever still holds
// the thread (a callback of a request being aborted) is never left without its task run. A task
// is destroyed as soon as it has run, before the next one runs: what it captured goes with it.
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "util/inline_task.h"

namespace tandem::util {

class TaskThread {
 public:
  explicit TaskThread(std::string name = {});
  ~TaskThread();  // stop()
  TaskThread(const TaskThread&) = delete;
  TaskThread& operator=(const TaskThread&) = delete;

  void start();
  // Runs what was posted before it, then stops the thread. Idempotent.
  void stop();
  // Thread-safe. A task that throws is reported on standard error; the next one runs.
  void post(InlineTask task);

 private:
  void run();

  std::string name_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<InlineTask> tasks_;  // under mutex_
  bool alive_ = false;            // under mutex_: the thread will run what is posted
  bool stopping_ = false;         // under mutex_
  std::thread thread_;
};

}  // namespace tandem::util
