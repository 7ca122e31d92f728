#include "cli/gateway_shutdown.h"

#include <cstdint>
#include <cstdio>

#include "cli/number_checks.h"
#include "util/duration.h"
#include "util/interruptible.h"

namespace tandem::cli {
namespace {

void say_stopping(const char* who, int sig, std::chrono::milliseconds drain) {
  std::fprintf(stderr,
               "%s: stopping (signal %d): the requests in flight have %.3g s to finish; a second "
               "signal ends them now\n",
               who, sig, std::chrono::duration<double>(drain).count());
}

// Waits up to `wait` for another stop signal; says whether one came (and so as `who`, with
// what `then` happens to the requests left).
bool stopped_again(const StopSignals& signals, const char* who, const char* then,
                   std::chrono::milliseconds wait) {
  const auto again = signals.wait_for(wait);
  if (again) std::fprintf(stderr, "%s: signal %d: the requests left %s\n", who, *again, then);
  return again.has_value();
}

}  // namespace

void add_shutdown_timeout_flag(CLI::App& cmd, double& seconds) {
  check_seconds(cmd.add_option("--shutdown-timeout", seconds,
                               "seconds a stop (SIGTERM, SIGINT) lets the requests in flight "
                               "finish, new ones refused with 503, before those left end; a "
                               "second signal ends it at once (0: no drain)")
                    ->capture_default_str(),
                /*at_least_a_ms=*/false, 2147483.0);
}

std::chrono::milliseconds shutdown_drain(double seconds) {
  return milliseconds_of(seconds);
}

double default_shutdown_timeout() {
  return std::chrono::duration<double>(gateway::Topology{}.shutdown_timeout).count();
}

void stop_gateways(std::span<gateway::Gateway* const> gateways, std::chrono::milliseconds drain,
                   const StopSignals& signals, const char* who, int sig) {
  say_stopping(who, sig, drain);
  gateway::stop_together(gateways, drain, [&](std::chrono::milliseconds wait) {
    return stopped_again(signals, who, "are answered 503", wait);
  });
}

void stop_draining(std::chrono::milliseconds drain, const StopSignals& signals, const char* who,
                   int sig, const std::function<void()>& stop,
                   const std::function<void()>& end_drain) {
  say_stopping(who, sig, drain);
  // The connections close with the drain's end: the requests left are cut, as vLLM's are.
  util::run_interruptibly(
      stop,
      [&](std::chrono::milliseconds wait) { return stopped_again(signals, who, "are cut", wait); },
      end_drain);
}

}  // namespace tandem::cli
