#include "cli/engine_child.h"

#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "net/http_client.h"
#include "util/error.h"

namespace tandem::cli {
namespace {

std::string trimmed(std::string line) {
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
  return line;
}

std::string seconds(std::chrono::milliseconds d) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", static_cast<double>(d.count()) / 1000.0);
  return text;
}

}  // namespace

uint16_t engine_line_port(const std::string& line, const std::string& prefix) {
  const auto fail = [&] {
    return Error("cannot read a port after '" + prefix + "' in the engine's line '" +
                 trimmed(line) + "' (expected HOST:PORT or [IPV6]:PORT)");
  };
  const size_t at = line.find(prefix);
  if (at == std::string::npos) throw fail();
  const size_t begin = at + prefix.size();
  const size_t end = std::min(line.find_first_of(" \r\n", begin), line.size());
  const std::string address = line.substr(begin, end - begin);
  // The last ':' ends the host, bracketed or not: an IPv6 host's own colons come before it.
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size() ||
      address.size() - colon - 1 > 5)
    throw fail();
  long port = 0;
  for (char c : address.substr(colon + 1)) {
    if (c < '0' || c > '9') throw fail();
    port = port * 10 + (c - '0');
  }
  if (port < 1 || port > 65535) throw fail();
  return static_cast<uint16_t>(port);
}

EngineChild::EngineChild(Options options, Args args, const StopSignals& stop_signals)
    : options_(std::move(options)), args_(std::move(args)), stop_signals_(stop_signals) {
  start(Clock::now());
  try {
    while (state_ == State::kStarting) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(start_deadline_ - Clock::now());
      read_start(Clock::now(),
                 std::clamp(left, std::chrono::milliseconds(0), std::chrono::milliseconds(1000)));
    }
  } catch (const std::exception& e) {
    process_->signal(SIGKILL);  // one that hangs would not act on SIGTERM
    process_.reset();
    throw Error("serve: " + options_.name + " did not start: " + e.what());
  }
}

EngineChild::~EngineChild() = default;

pid_t EngineChild::pid() const {
  return process_ ? process_->pid() : -1;
}

void EngineChild::start(Clock::time_point now) {
  const pid_t parent = ::getpid();
  process_ = std::make_unique<ChildProcess>(options_.program, args_(ports_), [this, parent] {
    stop_signals_.unblock();
    // A group of its own: a terminal's Ctrl-C signals serve's whole group, and an engine stopped
    // with it would leave the gateway's drain nothing to finish the requests in flight on. serve
    // stops its engines itself, after the drain. Its stderr is still serve's terminal, where a
    // background group's writes would stop it (SIGTTOU) under `stty tostop`: ignored, they go on.
    ::setpgid(0, 0);
    ::signal(SIGTTOU, SIG_IGN);
    // The engine ends with serve however serve ends (a stop signal while it starts, a crash):
    // an orphaned engine would hold its ports and memory with nobody to stop it.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) std::_Exit(1);  // serve was already gone
  });
  state_ = State::kStarting;
  seen_ = {};
  role_seen_ = false;
  start_deadline_ = now + options_.start_timeout;
}

void EngineChild::read_start(Clock::time_point now, std::chrono::milliseconds wait) {
  for (auto l = process_->poll_line(wait); l; l = process_->poll_line()) {
    if (l->empty())
      throw Error("its output ended before it named its ports (see its messages above)");
    if (l->find("listening on http://") != std::string::npos) {
      seen_.http = engine_line_port(*l, "listening on http://");
    } else if (l->find("KV transfer on ") != std::string::npos) {
      seen_.kv_transfer = engine_line_port(*l, "KV transfer on ");
    }
    if (auto ev = l->find("KV events on "); ev != std::string::npos) {
      const auto replay = l->find("(replay ");
      seen_.events = l->substr(ev + 13, l->find(' ', ev + 13) - ev - 13);
      if (replay != std::string::npos)
        seen_.events_replay = l->substr(replay + 8, l->find(')', replay) - replay - 8);
    }
    if (l->find("role ") != std::string::npos) role_seen_ = true;
    if (role_seen_ && (!options_.kv_events || !seen_.events.empty())) {  // every port known
      ports_ = seen_;
      state_ = State::kRunning;
      started_at_ = now;
      next_probe_at_ = now + options_.probe_interval;
      unanswered_since_.reset();
      unanswered_probes_ = 0;
      return;
    }
  }
  if (now >= start_deadline_)
    throw Error("it named no ports within " + seconds(options_.start_timeout) +
                " (--engine-start-timeout)");
}

void EngineChild::back_off(Clock::time_point now, const std::string& why) {
  const pid_t pid = process_->pid();
  process_->signal(SIGKILL);  // reaped at once: SIGKILL ends a hung or stopped process too
  process_.reset();
  const auto delay = backoff_.next_delay(std::chrono::milliseconds(0), quick_deaths_);
  // Its own error is above (a port another process took since: `--port P: ... is in use`); the
  // operator needs to know that serve waits for those very ports, and how often it looks.
  std::fprintf(stderr, "tandem serve: %s (pid %d) did not restart (%s); %s\n", where().c_str(),
               static_cast<int>(pid), why.c_str(), retry_text(delay).c_str());
  state_ = State::kBackingOff;
  restart_at_ = now + delay;
}

void EngineChild::watch_health(Clock::time_point now) {
  if (options_.hang_timeout <= std::chrono::milliseconds(0) || !options_.probe) return;
  if (!probe_.valid() && now >= next_probe_at_) {
    next_probe_at_ = now + options_.probe_interval;
    try {
      probe_ = options_.probe(ports_);
      probe_started_at_ = now;
    } catch (const std::exception& e) {  // no thread for it (std::system_error): skipped
      std::fprintf(stderr, "tandem serve: %s: cannot probe its /health now (%s)\n", where().c_str(),
                   e.what());
      return;
    }
  }
  if (!probe_.valid() || probe_.wait_for(std::chrono::seconds(0)) != std::future_status::ready)
    return;
  bool answered = false;
  try {
    answered = probe_.get();
  } catch (const std::exception&) {  // a probe that could not ask: unanswered
  }
  if (answered) {
    unanswered_since_.reset();
    unanswered_probes_ = 0;
    return;
  }
  // Measured from a probe's start, not from the last answer: serve itself stopped (Ctrl-Z) for a
  // while must not find its engines hung once it goes on.
  if (!unanswered_since_) unanswered_since_ = probe_started_at_;
  ++unanswered_probes_;
  const auto silent =
      std::chrono::duration_cast<std::chrono::milliseconds>(now - *unanswered_since_);
  // One slow answer is no hang, however late serve read it: a second probe must fail too.
  if (silent < options_.hang_timeout || unanswered_probes_ < 2) return;
  const pid_t pid = process_->pid();
  process_->signal(SIGKILL);  // a hung or stopped engine would not act on SIGTERM
  process_.reset();           // reaped at once
  const auto ran = std::chrono::duration_cast<std::chrono::milliseconds>(now - started_at_);
  const auto delay = backoff_.next_delay(ran, quick_deaths_);
  std::fprintf(stderr,
               "tandem serve: %s (pid %d) is hung: its /health has not answered for %s "
               "(--engine-hang-seconds: %s); killed it (SIGKILL), restarting it in %s\n",
               where().c_str(), static_cast<int>(pid), seconds(silent).c_str(),
               seconds(options_.hang_timeout).c_str(), seconds(delay).c_str());
  state_ = State::kBackingOff;
  restart_at_ = now + delay;
}

std::string EngineChild::ports_text() const {
  std::string text = "HTTP " + std::to_string(ports_.http);
  if (ports_.kv_transfer != 0) text += ", KV transfer " + std::to_string(ports_.kv_transfer);
  if (!ports_.events.empty()) text += ", KV events " + ports_.events;
  return text;
}

std::string EngineChild::retry_text(std::chrono::milliseconds delay) const {
  return "trying again on its ports (" + ports_text() + ") in " + seconds(delay) + ", then every " +
         seconds(backoff_.max) + " at most while it fails";
}

std::string EngineChild::where() const {
  return options_.name + " on port " + std::to_string(ports_.http);
}

void EngineChild::supervise(Clock::time_point now) {
  switch (state_) {
    case State::kRunning: {
      const pid_t pid = process_->pid();
      const std::optional<int> status = process_->exited();  // reaps it: no zombie
      if (!status) {
        watch_health(now);
        return;
      }
      probe_ = {};  // one to a dead engine ends at once (refused or closed)
      const auto ran = std::chrono::duration_cast<std::chrono::milliseconds>(now - started_at_);
      const auto delay = backoff_.next_delay(ran, quick_deaths_);
      std::fprintf(stderr, "tandem serve: %s (pid %d) %s %d; restarting it in %s\n",
                   where().c_str(), static_cast<int>(pid),
                   *status > 128 ? "was killed by signal" : "exited with status",
                   *status > 128 ? *status - 128 : *status, seconds(delay).c_str());
      process_.reset();
      state_ = State::kBackingOff;
      restart_at_ = now + delay;
      return;
    }
    case State::kBackingOff:
      if (now < restart_at_) return;
      try {
        start(now);
      } catch (const std::exception& e) {  // no process: fork failed
        const auto delay = backoff_.next_delay(std::chrono::milliseconds(0), quick_deaths_);
        std::fprintf(stderr, "tandem serve: %s did not restart (%s); %s\n", where().c_str(),
                     e.what(), retry_text(delay).c_str());
        restart_at_ = now + delay;
        return;
      }
      std::printf("tandem serve: %s restarting (pid %d)\n", where().c_str(),
                  static_cast<int>(pid()));
      std::fflush(stdout);
      [[fallthrough]];  // it may have named its ports already
    case State::kStarting:
      try {
        read_start(now, std::chrono::milliseconds(0));
      } catch (const std::exception& e) {
        back_off(now, e.what());
        return;
      }
      if (state_ == State::kRunning) {
        std::printf("tandem serve: %s restarted (pid %d)\n", where().c_str(),
                    static_cast<int>(pid()));
        std::fflush(stdout);
      }
      return;
  }
}

void EngineChild::terminate() {
  if (process_) process_->signal(state_ == State::kStarting ? SIGKILL : SIGTERM);
}

void EngineChild::wait_until(Clock::time_point deadline) {
  if (!process_) return;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  // terminate() signalled it: a second SIGTERM would tell a draining engine to cut its requests.
  process_->wait_or_kill(std::max(left, std::chrono::milliseconds(0)));
}

bool EngineChild::ended() {
  return !process_ || process_->exited().has_value();
}

EngineChild::HealthProbe engine_health_probe(std::string host, std::chrono::milliseconds wait) {
  return [host = std::move(host), wait](const EnginePorts& ports) {
    return std::async(std::launch::async, [host, port = ports.http, wait] {
      const auto started = std::chrono::steady_clock::now();
      try {
        net::http_request(host, port, "GET", "/health", {}, {}, wait);
        return true;  // any status: a busy, draining or failed engine answers, a hung one does not
      } catch (const std::exception&) {
        // A timeout ends it after `wait` (each step of the request has that bound); a peer that
        // closes, resets or refuses the connection ends it at once, which a stopped or frozen
        // process does not do. Half the wait tells them apart with room on both sides.
        return std::chrono::steady_clock::now() - started < wait / 2;
      }
    });
  };
}

std::chrono::milliseconds engine_stop_grace(std::chrono::milliseconds engine_drain) {
  // After its drain an engine closes its connections and ends its scheduler and KV transfer.
  constexpr std::chrono::milliseconds kAfterDrain{10'000};
  return std::max(ChildProcess::kStopGrace, engine_drain + kAfterDrain);
}

void stop_engines(std::span<const std::unique_ptr<EngineChild>> engines,
                  std::chrono::milliseconds grace, const StopSignals& signals, const char* who,
                  std::chrono::milliseconds cut_grace) {
  for (const auto& e : engines) e->terminate();  // all at once, then wait for each
  auto deadline = EngineChild::Clock::now() + grace;
  bool cut = false;
  for (const auto& e : engines) {
    // Polled in short steps: an engine that ended is seen soon, and so is another stop signal.
    while (!cut && !e->ended() && EngineChild::Clock::now() < deadline) {
      if (const auto again = signals.wait_for(std::chrono::milliseconds(50))) {
        std::fprintf(stderr, "%s: signal %d: the engines' requests left are cut\n", who, *again);
        std::fflush(stderr);
        for (const auto& other : engines) other->terminate();
        cut = true;
        // The drain the long grace waited for is over: an engine that does not end now is hung.
        deadline = std::min(deadline, EngineChild::Clock::now() + cut_grace);
      }
    }
    e->wait_until(deadline);
  }
}

}  // namespace tandem::cli
