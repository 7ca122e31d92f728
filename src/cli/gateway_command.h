#pragma once
#include <CLI/CLI.hpp>

#include "gateway/topology.h"

namespace tandem::cli {

// `tandem gateway`: one OpenAI endpoint in front of prefill and decode engines.
void add_gateway_command(CLI::App& app);

// The port a gateway listens on by default (`tandem gateway`, `tandem serve`), and so the one
// `tandem bench` measures by default: a `serve` and then a `bench` find each other.
constexpr int kDefaultGatewayPort = 8080;

// What the gateway does about engines that fail or hang, as `tandem gateway` and `tandem serve`
// take it: one definition of each flag, so both commands read and bound it alike.
struct GatewayFailureFlags {
  int prefill_retries = 2;        // --prefill-retries
  double upstream_timeout = 300;  // --upstream-timeout, seconds
};

// What a command does without --upstream-timeout, as its help says it: `tandem gateway` writes
// the flag's default into every bound; `tandem serve` keeps the topology's own, which end a
// stream that pauses 120 s.
enum class UpstreamTimeoutUnset { kFlagDefault, kTopologyDefaults };

void add_gateway_failure_flags(CLI::App& cmd, GatewayFailureFlags& flags,
                               UpstreamTimeoutUnset unset);

// Writes the flags into `t`: those given on `cmd` only where `t` has settings of its own (a
// --config file's, serve's), else every flag, given or by default.
void apply_gateway_failure_flags(gateway::Topology& t, const GatewayFailureFlags& flags,
                                 const CLI::App& cmd, bool only_given);

}  // namespace tandem::cli
