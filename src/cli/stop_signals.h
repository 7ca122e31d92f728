#pragma once
// SIGINT and SIGTERM for the long-running subcommands (engine, gateway, serve): blocked before
// any thread starts, so that only wait() sees them and the command shuts down in order.
#include <csignal>

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
  // For a child process, which should take them normally again.
  void unblock() const { pthread_sigmask(SIG_UNBLOCK, &set_, nullptr); }

 private:
  sigset_t set_;
};

}  // namespace tandem::cli
