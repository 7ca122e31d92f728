#pragma once
// A child process whose standard output is read line by line (Tandem's commands print their
// ports there), stopped with SIGTERM (SIGKILL after a grace period) and waited for when
// destroyed. Used by `tandem serve` for its
// engines and by the tests for every process they start.
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace tandem {

class ChildProcess {
 public:
  // Runs `program` with `argv` (argv[0] included). `in_child` runs in the child just before exec
  // (keep it to async-signal-safe calls, e.g. restoring a signal mask). Throws tandem::Error if
  // the process cannot be created.
  ChildProcess(const std::string& program, const std::vector<std::string>& argv,
               const std::function<void()>& in_child = {});
  ~ChildProcess();  // stop()
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // The next line the child printed, newline included; empty at the end of its output.
  std::string read_line();
  // The same without blocking past `wait`: nullopt while no whole line has come (the child may
  // print it later), for a supervisor that must not stop at a child that hangs.
  std::optional<std::string> poll_line(std::chrono::milliseconds wait = {});
  void signal(int sig);  // no-op once stopped
  // The exit status (as stop() reports it) once the child has ended, without waiting; nullopt
  // while it runs. Reaps it: later calls and stop() return the same status.
  std::optional<int> exited();
  pid_t pid() const { return pid_; }
  // SIGTERM, then waits at most `grace` before SIGKILL (a stopped, frozen or hung child would
  // otherwise hold its parent's shutdown forever); returns the exit status (128 + signal when
  // killed by one). Idempotent.
  int stop(std::chrono::milliseconds grace = kStopGrace);
  // stop() without its SIGTERM, for a caller that has signalled the child itself: a second
  // SIGTERM is, to a server draining after the first, the order to cut the drain short.
  int wait_or_kill(std::chrono::milliseconds grace);
  static constexpr std::chrono::milliseconds kStopGrace{30'000};

 private:
  // Reads what the pipe holds into buffer_, waiting at most `wait` (negative: as long as it
  // takes) for something to come; returns false when nothing came.
  bool fill(std::chrono::milliseconds wait);
  void close_output();

  pid_t pid_ = -1;
  int out_ = -1;        // the read end of the child's standard output; -1 once it ended
  std::string buffer_;  // read from out_, not yet returned as lines
  int status_ = -1;
};

}  // namespace tandem
