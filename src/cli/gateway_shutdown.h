#pragma once
// How the long-running commands stop: `tandem gateway` and `tandem serve` their gateways, `tandem
// engine` its API server, each with --shutdown-timeout and a drain that a second stop signal
// ends.
#include <chrono>
#include <functional>
#include <span>

#include <CLI/CLI.hpp>

#include "cli/stop_signals.h"
#include "gateway/gateway.h"

namespace tandem::cli {

// --shutdown-timeout SECONDS into `seconds` (whose value is the default shown).
void add_shutdown_timeout_flag(CLI::App& cmd, double& seconds);

// The drain --shutdown-timeout gives.
std::chrono::milliseconds shutdown_drain(double seconds);
// --shutdown-timeout's default, in seconds: the gateway's drain (Topology::shutdown_timeout).
double default_shutdown_timeout();

// After the stop signal `sig`: says so as `who`, then stops `gateways` together with `drain`,
// ending the drain at once when another stop signal comes.
void stop_gateways(std::span<gateway::Gateway* const> gateways, std::chrono::milliseconds drain,
                   const StopSignals& signals, const char* who, int sig);

// After the stop signal `sig`: says so as `who`, then runs `stop` (a drain of `drain` at most,
// then the connections close, cutting the requests left) on a thread of its own, calling
// `end_drain` at once when another stop signal comes. Returns once `stop` has.
void stop_draining(std::chrono::milliseconds drain, const StopSignals& signals, const char* who,
                   int sig, const std::function<void()>& stop,
                   const std::function<void()>& end_drain);

}  // namespace tandem::cli
