#include "cli/gateway_shutdown.h"

#include <cmath>
#include <cstdint>
#include <cstdio>

namespace tandem::cli {

CLI::Validator finite_seconds() {
  return CLI::Validator(
      [](const std::string& text) {
        double value = 0;
        if (CLI::detail::lexical_cast(text, value) && !std::isfinite(value))
          return "expected a finite number of seconds, got " + text;
        return std::string();
      },
      "FINITE");
}

void add_shutdown_timeout_flag(CLI::App& cmd, double& seconds) {
  cmd.add_option("--shutdown-timeout", seconds,
                 "seconds a stop (SIGTERM, SIGINT) lets the requests in flight finish before "
                 "those left are answered 503; a second signal ends it at once (0: no drain)")
      ->capture_default_str()
      ->check(finite_seconds())
      ->check(CLI::NonNegativeNumber)
      ->check(CLI::Range(0.0, 2147483.0));
}

std::chrono::milliseconds shutdown_drain(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(seconds * 1000)));
}

void stop_gateways(std::span<gateway::Gateway* const> gateways, std::chrono::milliseconds drain,
                   const StopSignals& signals, const char* who, int sig) {
  std::fprintf(stderr,
               "%s: stopping (signal %d): the requests in flight have %.3g s to finish; a second "
               "signal ends them now\n",
               who, sig, std::chrono::duration<double>(drain).count());
  gateway::stop_together(gateways, drain, [&](std::chrono::milliseconds wait) {
    const auto again = signals.wait_for(wait);
    if (again)
      std::fprintf(stderr, "%s: signal %d: the requests left are answered 503\n", who, *again);
    return again.has_value();
  });
}

}  // namespace tandem::cli
