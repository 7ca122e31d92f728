#include "gateway/access_log.h"

#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include "util/error.h"

namespace tandem::gateway {

struct AccessLog::Impl {
  std::FILE* file = nullptr;
  bool owns_file = false;
  std::mutex mutex;
  std::condition_variable wake;
  std::vector<nlohmann::json> queue;  // under `mutex`
  bool stopping = false;              // under `mutex`
  std::thread writer;

  void run() {
    std::vector<nlohmann::json> batch;
    std::string text;
    for (;;) {
      {
        std::unique_lock lock(mutex);
        wake.wait(lock, [this] { return stopping || !queue.empty(); });
        if (queue.empty()) return;  // stopping, and everything is written
        batch.swap(queue);
      }
      text.clear();
      for (const auto& line : batch)
        text += line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
      batch.clear();
      std::fwrite(text.data(), 1, text.size(), file);
      std::fflush(file);
    }
  }
};

AccessLog::AccessLog(const std::string& path) : impl_(std::make_unique<Impl>()) {
  if (path == "-") {
    impl_->file = stdout;
  } else {
    impl_->file = std::fopen(path.c_str(), "a");
    if (!impl_->file) throw Error("access log '" + path + "': cannot open for append");
    impl_->owns_file = true;
  }
  impl_->writer = std::thread([impl = impl_.get()] { impl->run(); });
}

AccessLog::~AccessLog() {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->wake.notify_one();
  impl_->writer.join();
  if (impl_->owns_file) std::fclose(impl_->file);
}

void AccessLog::add(nlohmann::json line) {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->queue.push_back(std::move(line));
  }
  impl_->wake.notify_one();
}

}  // namespace tandem::gateway
