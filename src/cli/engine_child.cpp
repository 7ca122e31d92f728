#include "cli/engine_child.h"

#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "util/error.h"

namespace tandem::cli {

EngineChild::EngineChild(std::string name, Args args, const StopSignals& stop_signals,
                         bool kv_events)
    : name_(std::move(name)),
      args_(std::move(args)),
      stop_signals_(stop_signals),
      kv_events_(kv_events) {
  start();
}

EngineChild::~EngineChild() = default;

pid_t EngineChild::pid() const {
  return process_ ? process_->pid() : -1;
}

void EngineChild::start() {
  const pid_t parent = ::getpid();
  auto process = std::make_unique<ChildProcess>("/proc/self/exe", args_(ports_), [this, parent] {
    stop_signals_.unblock();
    // The engine ends with serve however serve ends (a stop signal while it starts, a crash):
    // an orphaned engine would hold its ports and memory with nobody to stop it.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) std::_Exit(1);  // serve was already gone
  });
  EnginePorts seen;
  bool role_seen = false;
  for (std::string l = process->read_line(); !l.empty(); l = process->read_line()) {
    if (auto at = l.find("listening on http://"); at != std::string::npos) {
      seen.http = static_cast<uint16_t>(std::stoi(l.substr(l.find(':', at + 20) + 1)));
    } else if (auto kv = l.find("KV transfer on "); kv != std::string::npos) {
      seen.kv_transfer = static_cast<uint16_t>(std::stoi(l.substr(l.find(':', kv + 15) + 1)));
    }
    if (auto ev = l.find("KV events on "); ev != std::string::npos) {
      const auto replay = l.find("(replay ");
      seen.events = l.substr(ev + 13, l.find(' ', ev + 13) - ev - 13);
      if (replay != std::string::npos)
        seen.events_replay = l.substr(replay + 8, l.find(')', replay) - replay - 8);
    }
    if (l.find("role ") != std::string::npos) role_seen = true;
    if (role_seen && (!kv_events_ || !seen.events.empty())) {  // every port known
      ports_ = seen;
      process_ = std::move(process);
      started_at_ = Clock::now();
      return;
    }
  }
  throw Error("serve: " + name_ + " did not start (see its messages above)");
}

std::string EngineChild::where() const {
  return name_ + " on port " + std::to_string(ports_.http);
}

void EngineChild::supervise(Clock::time_point now) {
  if (process_) {
    const pid_t pid = process_->pid();
    const std::optional<int> status = process_->exited();  // reaps it: no zombie
    if (!status) return;
    const auto ran = std::chrono::duration_cast<std::chrono::milliseconds>(now - started_at_);
    const auto delay = backoff_.next_delay(ran, quick_deaths_);
    std::fprintf(stderr, "tandem serve: %s (pid %d) %s %d; restarting it in %.1f s\n",
                 where().c_str(), static_cast<int>(pid),
                 *status > 128 ? "was killed by signal" : "exited with status",
                 *status > 128 ? *status - 128 : *status, delay.count() / 1000.0);
    process_.reset();
    restart_at_ = now + delay;
    return;
  }
  if (now < restart_at_) return;
  try {
    start();
  } catch (const std::exception& e) {
    const auto delay = backoff_.next_delay(std::chrono::milliseconds(0), quick_deaths_);
    std::fprintf(stderr, "tandem serve: %s did not restart (%s); trying again in %.1f s\n",
                 where().c_str(), e.what(), delay.count() / 1000.0);
    restart_at_ = Clock::now() + delay;
    return;
  }
  std::printf("tandem serve: %s restarted (pid %d)\n", where().c_str(), static_cast<int>(pid()));
  std::fflush(stdout);
}

void EngineChild::terminate() {
  if (process_) process_->signal(SIGTERM);
}

}  // namespace tandem::cli
