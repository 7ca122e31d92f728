#pragma once
// Starts `tandem engine|gateway|serve ... --port 0` as a child process for a test, reads the port
// from its "listening on http://HOST:PORT" line, and stops it (SIGTERM) when destroyed.
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <source_location>
#include <stdexcept>
#include <string>
#include <vector>

#include "util/bounded_wait.h"
#include "util/child_process.h"

namespace tandem::testing {

class EngineProcess {
 public:
  explicit EngineProcess(const std::vector<std::string>& args)
      : child_(args.at(0), without_drain(args)) {
    std::string output;
    for (auto l = line_within(kHangGuard); l; l = line_within(kHangGuard)) {
      if (l->empty()) throw std::runtime_error("engine did not start; output: " + output);
      output += *l;
      const auto at = l->find("listening on http://");
      if (at != std::string::npos) {
        port_ = static_cast<uint16_t>(std::stoi(l->substr(l->find(':', at + 20) + 1)));
        return;  // later lines (KV transfer, KV events) are read on demand
      }
    }
    throw std::runtime_error("engine did not start within " + std::to_string(kHangGuard.count()) +
                             " s; output: " + output);
  }

  uint16_t port() const { return port_; }
  pid_t pid() const { return child_.pid(); }
  // The next line the engine printed (empty at end of output). Throws, naming the caller's
  // line, when none comes within kHangGuard: the test fails instead of hanging on an engine gone
  // quiet. Throws rather than aborting as get_within does: unwinding stops the engine, where an
  // abort would leave it running.
  std::string next_line(const std::source_location& where = std::source_location::current()) {
    if (auto line = line_within(kHangGuard)) return *std::move(line);
    throw std::runtime_error(std::string(where.file_name()) + ":" + std::to_string(where.line()) +
                             ": the engine printed no line within " +
                             std::to_string(kHangGuard.count()) + " s");
  }
  // Kills the engine at once (SIGKILL), as a crashed node.
  void kill_now() {
    child_.signal(SIGKILL);
    child_.stop();
  }
  // Sends SIGTERM and returns the exit status.
  int stop() { return child_.stop(); }

 private:
  // An engine stops at once unless the test gives it a --shutdown-timeout: tests stop engines
  // with requests that would run for a while, and a drain (30 s by default) would meet
  // ChildProcess's 30 s kill (tests of the drain give their own).
  static std::vector<std::string> without_drain(std::vector<std::string> args) {
    if (args.size() < 2 || args[1] != "engine") return args;
    for (const auto& a : args)
      if (a.rfind("--shutdown-timeout", 0) == 0) return args;
    args.insert(args.end(), {"--shutdown-timeout", "0"});
    return args;
  }

  // The next line, or nullopt when no whole line came within `limit`.
  std::optional<std::string> line_within(std::chrono::seconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left <= std::chrono::milliseconds(0)) return std::nullopt;
      // poll_line returns early, with nothing, once part of a line came: wait again for the rest.
      if (auto line = child_.poll_line(left)) return line;
    }
  }

  ChildProcess child_;
  uint16_t port_ = 0;
};

// The ZMQ endpoints of an engine started with --kv-events-config, from the line it prints after
// "listening": "KV events on ENDPOINT (replay REPLAY)". Throws when there is none.
struct KvEventsEndpoints {
  std::string events, replay;
};
inline KvEventsEndpoints read_kv_events_line(
    EngineProcess& engine, const std::source_location& where = std::source_location::current()) {
  for (std::string line = engine.next_line(where); !line.empty(); line = engine.next_line(where)) {
    const auto on = line.find("KV events on "), replay_at = line.find("(replay ");
    if (on == std::string::npos || replay_at == std::string::npos) continue;
    return {line.substr(on + 13, line.find(' ', on + 13) - on - 13),
            line.substr(replay_at + 8, line.find(')', replay_at) - replay_at - 8)};
  }
  throw std::runtime_error("the engine printed no KV events line");
}

// An engine `tandem serve` started, from the line it prints for it after "listening":
// "tandem serve: ROLE engine http://HOST:PORT (pid ...".
struct ServeEngine {
  std::string role;     // "prefill" or "decode"
  std::string address;  // "HOST:PORT", the gateway's name for it
  uint16_t port = 0;
};
// The next `count` engine lines of `serve`. Throws on any other line.
inline std::vector<ServeEngine> read_serve_engines(
    EngineProcess& serve, int count,
    const std::source_location& where = std::source_location::current()) {
  std::vector<ServeEngine> engines;
  for (int i = 0; i < count; ++i) {
    const std::string line = serve.next_line(where);
    const auto at = line.find(" engine http://");
    if (at == std::string::npos) throw std::runtime_error("unexpected serve output: " + line);
    ServeEngine e;
    e.role = line.substr(line.rfind(' ', at - 1) + 1, at - line.rfind(' ', at - 1) - 1);
    e.address = line.substr(at + 15, line.find(' ', at + 15) - at - 15);
    e.port = static_cast<uint16_t>(std::stoi(e.address.substr(e.address.rfind(':') + 1)));
    engines.push_back(std::move(e));
  }
  return engines;
}

}  // namespace tandem::testing
