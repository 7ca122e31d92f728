#pragma once
// One `tandem engine` child of `tandem serve`: started on any free ports, which it reads from the
// engine's first lines, and restarted on the same ports (with back-off) when it dies, so that the
// gateway, which knows it by those ports, readmits it once its health probes pass.
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cli/stop_signals.h"
#include "util/child_process.h"
#include "util/restart_backoff.h"

namespace tandem::cli {

// The ports of an engine; 0 or empty: any free one.
struct EnginePorts {
  uint16_t http = 0, kv_transfer = 0;
  std::string events, events_replay;  // KV event endpoints, e.g. tcp://127.0.0.1:5557
};

class EngineChild {
 public:
  using Clock = std::chrono::steady_clock;
  // The engine's command line (argv[0] included) for these ports.
  using Args = std::function<std::vector<std::string>(const EnginePorts&)>;

  // Starts the engine and waits until it names its ports; throws tandem::Error if it does not
  // start. `name` is how the log calls it ("decode engine"); `kv_events`: it publishes KV events.
  EngineChild(std::string name, Args args, const StopSignals& stop_signals, bool kv_events);
  ~EngineChild();

  const EnginePorts& ports() const { return ports_; }
  pid_t pid() const;
  // Does not block unless it restarts the engine: reaps it if it died (logging why, on standard
  // error) and, once its back-off delay has passed, starts it again on the same ports (a line on
  // standard output says so, with the new pid).
  void supervise(Clock::time_point now);
  // SIGTERM; the destructor waits.
  void terminate();

 private:
  void start();
  std::string where() const;

  const std::string name_;
  const Args args_;
  const StopSignals& stop_signals_;
  const bool kv_events_;
  const RestartBackoff backoff_;
  std::unique_ptr<ChildProcess> process_;  // null while it is dead, waiting for its restart
  EnginePorts ports_;
  Clock::time_point started_at_{};
  Clock::time_point restart_at_{};
  int quick_deaths_ = 0;
};

}  // namespace tandem::cli
