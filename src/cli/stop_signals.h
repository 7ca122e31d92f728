#pragma once
// SIGINT and SIGTERM for the long-running subcommands (engine, gateway, serve): blocked before
// any thread starts, so that only wait() sees them and the command shuts down in order.
#include <chrono>
#include <csignal>
#include <ctime>
#include <optional>

namespace tandem::cli {

class StopSignals {
 public:
  StopSignals() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
  }
  // Blocks until one of them arrives; returns it.
  int wait() const {
    int sig = 0;
    sigwait(&set_, &sig);
    return sig;
  }
  // Waits at most `timeout` for one of them; returns it, or nullopt when none came.
  std::optional<int> wait_for(std::chrono::milliseconds timeout) const {
    const timespec ts{static_cast<time_t>(timeout.count() / 1000),
                      static_cast<long>(timeout.count() % 1000) * 1000000L};
    const int sig = sigtimedwait(&set_, nullptr, &ts);
    if (sig < 0) return std::nullopt;  // EAGAIN: the time passed (EINTR: another signal)
    return sig;
  }
  // For a child process, which should take them normally again.
  void unblock() const { pthread_sigmask(SIG_UNBLOCK, &set_, nullptr); }

 private:
  sigset_t set_;
};

}  // namespace tandem::cli
