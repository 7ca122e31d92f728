#pragma once
// SIGINT and SIGTERM for the long-running subcommands (engine, gateway, serve): blocked before
// any thread starts, so that only wait() sees them and the command shuts down in order.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <optional>
#include <thread>

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

// While a command starts (a model loading for minutes, engines a stack waits for), a stop
// signal ends the process at once, exit status 128 + the signal: nothing runs yet that must shut
// down in order, and an operator's SIGTERM must not wait for the load to finish. Once this is
// destroyed, the command's own wait() takes the signals again (one that came just before stays
// pending for it).
class StopWhileStarting {
 public:
  StopWhileStarting(const StopSignals& signals, const char* who)
      : thread_([this, &signals, who] {
          // At least one look, also when the start is over before this thread first runs: a
          // signal that came during it ends the process as it would have then.
          for (;;) {
            const bool last = started_.load();
            const auto wait = last ? std::chrono::milliseconds(0) : std::chrono::milliseconds(100);
            if (const auto sig = signals.wait_for(wait)) {
              std::fprintf(stderr, "%s: stopping while starting (signal %d)\n", who, *sig);
              std::fflush(stderr);
              std::_Exit(128 + *sig);
            }
            if (last) return;
          }
        }) {}
  ~StopWhileStarting() {
    started_ = true;
    thread_.join();
  }
  StopWhileStarting(const StopWhileStarting&) = delete;
  StopWhileStarting& operator=(const StopWhileStarting&) = delete;

 private:
  std::atomic<bool> started_{false};
  std::thread thread_;
};

}  // namespace tandem::cli
