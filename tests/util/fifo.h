#pragma once
// A FIFO for tests of code that must refuse one without blocking.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <stdexcept>
#include <thread>

namespace tandem::test {

// Makes a FIFO at `path`. While it lives, a thread keeps opening the FIFO for writing (without
// blocking) and closing it again: code that wrongly opens it for reading, which blocks until a
// writer comes, is let go and reads an empty file, so its test fails instead of hanging.
class Fifo {
 public:
  explicit Fifo(const std::filesystem::path& path) {
    if (::mkfifo(path.c_str(), 0600) != 0) throw std::runtime_error("mkfifo " + path.string());
    writer_ = std::thread([this, path] {
      while (!stop_) {
        const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        if (fd >= 0) ::close(fd);
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    });
  }
  ~Fifo() {
    stop_ = true;
    writer_.join();
  }
  Fifo(const Fifo&) = delete;
  Fifo& operator=(const Fifo&) = delete;

 private:
  std::atomic<bool> stop_{false};
  std::thread writer_;
};

}  // namespace tandem::test
