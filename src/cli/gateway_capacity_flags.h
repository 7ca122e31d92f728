#pragma once
// The gateway's overload and capacity flags, as `tandem gateway` and `tandem serve` take them:
// one definition of each flag's name, help, default and bounds, so both commands read and bound
// it alike and write it into the same Topology field.
#include <cstddef>

#include <CLI/CLI.hpp>

#include "gateway/topology.h"

namespace tandem::cli {

// Each default is the Topology's own, so a command that leaves a flag out gets what its help says.
struct GatewayCapacityFlags {
  size_t max_queue = gateway::Topology{}.max_queue;              // --max-queue
  size_t max_connections = gateway::Topology{}.max_connections;  // --max-connections
  size_t max_connections_per_address =
      gateway::Topology{}.max_connections_per_address;             // --max-connections-per-address
  size_t max_unsent_bytes = gateway::Topology{}.max_unsent_bytes;  // --max-unsent-bytes
  size_t max_answer_bytes = gateway::Topology{}.max_answer_bytes;  // --max-answer-bytes
  int http_threads = gateway::Topology{}.io_threads;               // --http-threads
};

// Adds the flags to `cmd`; a value out of bounds is refused as the command line is read, naming
// the flag (before `tandem serve` writes a preset or starts an engine).
void add_gateway_capacity_flags(CLI::App& cmd, GatewayCapacityFlags& flags);

// Writes the flags into `t`: those given on `cmd` only where `t` has settings of its own (a
// --config file's), else every flag, given or by default.
void apply_gateway_capacity_flags(gateway::Topology& t, const GatewayCapacityFlags& flags,
                                  const CLI::App& cmd, bool only_given);

}  // namespace tandem::cli
