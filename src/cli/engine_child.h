#pragma once
// One `tandem engine` child of `tandem serve`: started on any free ports, which it reads from the
// engine's first lines, and restarted on the same ports (with back-off) when it dies, so that the
// gateway, which knows it by those ports, readmits it once its health probes pass.
//
// A restart never blocks serve: supervise() starts the engine and reads its lines as they come,
// tick by tick, so that serve keeps acting on stop signals and supervising its other engines while
// a restarted engine loads (minutes for a real model), and an engine that hangs before naming its
// ports is killed at its start deadline and tried again after the back-off.
//
// A running engine that hangs (stopped with SIGSTOP, or frozen: its HTTP server does not answer)
// does not die, and the gateway only ejects it: its /health is probed, and one that has not
// answered for the hang timeout is killed (SIGKILL) and restarted as a dead one is, so that a
// frozen engine comes back. An engine whose io thread answers while its scheduler is stuck is not
// seen as hung.
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <span>
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

// The port of the address that follows `prefix` in an engine's line: "HOST:PORT" or
// "[V6HOST]:PORT" up to the next space, e.g. 44879 in "listening on http://[::1]:44879 (model
// ...)". Also reads an unbracketed IPv6 host (the port follows the last ':'). Throws
// tandem::Error quoting the line when there is no port there.
uint16_t engine_line_port(const std::string& line, const std::string& prefix);

class EngineChild {
 public:
  using Clock = std::chrono::steady_clock;
  // The engine's command line (argv[0] included) for these ports.
  using Args = std::function<std::vector<std::string>(const EnginePorts&)>;
  // Whether the engine's /health answered, with any status (a busy or draining engine answers on
  // its io thread): ready once the probe knows, which bounds its own wait. serve asks over HTTP
  // on a thread of its own, so that supervise() does not wait on a hung engine; tests answer.
  using HealthProbe = std::function<std::future<bool>(const EnginePorts&)>;

  enum class State {
    kStarting,    // its process runs; its ports are not all named yet
    kRunning,     // it named its ports
    kBackingOff,  // it died (or did not start); restarted at restart_at_
  };

  struct Options {
    std::string name;        // how the log calls it ("decode engine")
    bool kv_events = false;  // it publishes KV events: it names their endpoints too
    // From the start to the last port named; past it the engine is killed (and, restarting,
    // tried again after the back-off).
    std::chrono::milliseconds start_timeout = std::chrono::minutes(30);
    std::string program = "/proc/self/exe";  // this `tandem`; tests run fake engines
    // A running engine whose /health has gone unanswered this long (from the first unanswered
    // probe's start to a later one's failure: two probes at least, so that one slow answer never
    // kills) is hung: killed and restarted. 0: never probed. Each probe's own wait should be at
    // most half of it, and probe_interval a third, for the second probe to end within it.
    std::chrono::milliseconds hang_timeout{0};
    std::chrono::milliseconds probe_interval = std::chrono::seconds(5);  // between probes' starts
    HealthProbe probe;
  };

  // Starts the engine and waits until it names its ports (a stop signal meanwhile is serve's
  // StopWhileStarting's to act on); throws tandem::Error if it does not start in time.
  EngineChild(Options options, Args args, const StopSignals& stop_signals);
  ~EngineChild();  // waits for the engine to end

  const EnginePorts& ports() const { return ports_; }
  State state() const { return state_; }
  pid_t pid() const;  // -1 while backing off
  // Never blocks (but to reap an engine killed at its start deadline): reaps the engine if it
  // died (logging why, on standard error), starts it again on the same ports once its back-off
  // delay has passed (a line on standard output says so, with the new pid), reads what a
  // starting engine printed, and kills one whose start deadline has passed. Probes a running
  // engine's /health (Options::hang_timeout) and kills one that is hung, logging why, to restart
  // it after the back-off.
  void supervise(Clock::time_point now);
  // Ends the engine; the destructor waits. A running one gets SIGTERM and shuts down in order; a
  // starting one SIGKILL: it has nothing to shut down yet (on SIGTERM it would exit at once),
  // and one that hangs or is stopped (SIGSTOP) would never act on SIGTERM, holding serve.
  void terminate();
  // Waits for the engine to end until `deadline` (sending nothing: terminate() has), then kills
  // it (SIGKILL): one that does not act on SIGTERM (stopped, frozen, hung) must not hold serve's
  // shutdown. One deadline for every engine: N hung engines cost one grace period, not N.
  void wait_until(Clock::time_point deadline);
  // Whether the engine has ended (reaped; none runs while backing off), without waiting.
  bool ended();

 private:
  void start(Clock::time_point now);
  // Reads the lines a starting engine printed so far (waiting at most `wait` for the first);
  // kRunning once every port is named. Throws tandem::Error when it cannot start: its output
  // ended, a line could not be read, its deadline passed.
  void read_start(Clock::time_point now, std::chrono::milliseconds wait);
  // Kills a starting engine that failed (SIGKILL, reaped) and schedules its next try.
  void back_off(Clock::time_point now, const std::string& why);
  // Starts a health probe when one is due, reads a finished one, and kills (SIGKILL) a running
  // engine hung for the hang timeout, to restart after the back-off.
  void watch_health(Clock::time_point now);
  std::string where() const;
  std::string ports_text() const;  // "HTTP 8000, KV transfer 8998": those a restart takes again
  // "trying again on its ports (...) in 2.0 s, then every 30.0 s at most while it fails"
  std::string retry_text(std::chrono::milliseconds delay) const;

  const Options options_;
  const Args args_;
  const StopSignals& stop_signals_;
  const RestartBackoff backoff_;
  State state_ = State::kStarting;
  std::unique_ptr<ChildProcess> process_;  // null while backing off
  EnginePorts ports_;
  EnginePorts seen_;  // what a starting engine named so far
  bool role_seen_ = false;
  Clock::time_point started_at_{};      // kRunning since
  Clock::time_point start_deadline_{};  // kStarting until
  Clock::time_point restart_at_{};      // kBackingOff until
  int quick_deaths_ = 0;
  std::future<bool> probe_;  // the health probe under way; invalid when none is
  Clock::time_point probe_started_at_{}, next_probe_at_{};
  // When the first probe that went unanswered started, since the last one that was answered, and
  // how many have gone unanswered since.
  std::optional<Clock::time_point> unanswered_since_;
  int unanswered_probes_ = 0;
};

// serve's health probe: GET /health on the engine's HTTP port at `host`, on a thread of its own,
// waiting at most `wait`. Only a probe that timed out (no answer, or a connect that never
// completes) is unanswered: any HTTP status, and a peer that closes, resets or refuses the
// connection (an engine at its --max-connections cap closes a new one at once) within half the
// wait, is a process that acts, not a hung one. Throws std::system_error when there is no thread
// for it.
EngineChild::HealthProbe engine_health_probe(std::string host, std::chrono::milliseconds wait);

// How long serve's engines have to stop once signalled before they are killed: ChildProcess's
// grace, or the drain they were given (--engine-arg=--shutdown-timeout N) and a margin for what
// an engine does after its drain, when that is longer: an engine killed mid-drain cuts the
// requests its drain was there to finish.
std::chrono::milliseconds engine_stop_grace(std::chrono::milliseconds engine_drain);

// Stops `engines` together: each gets terminate() at once, then they have `grace` to end before
// those left are killed. A stop signal meanwhile (a second Ctrl-C) sends each its second SIGTERM,
// an engine's order to cut its drain now, as a second signal ends the gateways' drain; said on
// standard error as `who`. Those left then have at most `cut_grace` (an engine's grace without a
// drain) before they are killed, however long `grace` was.
void stop_engines(std::span<const std::unique_ptr<EngineChild>> engines,
                  std::chrono::milliseconds grace, const StopSignals& signals, const char* who,
                  std::chrono::milliseconds cut_grace = ChildProcess::kStopGrace);

}  // namespace tandem::cli
