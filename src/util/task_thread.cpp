#include "util/task_thread.h"

#include <cstdio>
#include <exception>

namespace tandem::util {
namespace {

void run_guarded(InlineTask& task, const std::string& name) {
  try {
    task();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem: a task on thread '%s' failed: %s\n", name.c_str(), e.what());
  }
}

}  // namespace

TaskThread::TaskThread(std::string name) : name_(std::move(name)) {}

TaskThread::~TaskThread() {
  stop();
}

void TaskThread::start() {
  std::lock_guard lock(mutex_);
  if (alive_ || stopping_) return;
  alive_ = true;
  thread_ = std::thread([this] { run(); });
}

void TaskThread::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void TaskThread::post(InlineTask task) {
  {
    std::lock_guard lock(mutex_);
    if (alive_) {
      tasks_.push_back(std::move(task));
      wake_.notify_one();
      return;
    }
  }
  run_guarded(task, name_);  // no thread (not started, or stopped): run it here
}

void TaskThread::run() {
  for (;;) {
    std::deque<InlineTask> batch;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) {  // stopping, and everything posted has run
        alive_ = false;
        return;
      }
      batch.swap(tasks_);
    }
    // Each task goes (with what it captured: a request's place in /load, a reply) once it has
    // run, not with the rest of the batch.
    while (!batch.empty()) {
      InlineTask task = std::move(batch.front());
      batch.pop_front();
      run_guarded(task, name_);
    }
  }
}

}  // namespace tandem::util
