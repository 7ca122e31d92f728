#include "net/loop_group.h"

namespace tandem::net::detail {

LoopGroup::LoopGroup(size_t loops) {
  for (size_t i = 0; i < loops; ++i) loops_.push_back(std::make_unique<EventLoop>());
}

LoopGroup::~LoopGroup() {
  stop_and_join();
}

size_t LoopGroup::pick() {
  if (EventLoop* current = EventLoop::current()) {
    for (size_t i = 0; i < loops_.size(); ++i) {
      if (loops_[i].get() == current) return i;
    }
  }
  return next_.fetch_add(1, std::memory_order_relaxed) % loops_.size();
}

void LoopGroup::start(std::function<void(const std::string&)> log) {
  running_ = true;
  for (auto& loop : loops_) {
    loop->set_error_log(log);
    threads_.emplace_back([l = loop.get()] { l->run(); });
  }
}

void LoopGroup::stop_and_join() {
  for (auto& loop : loops_) loop->stop();
  for (auto& t : threads_) t.join();
  threads_.clear();
  running_ = false;
}

}  // namespace tandem::net::detail
