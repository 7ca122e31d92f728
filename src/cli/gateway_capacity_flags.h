#pragma once
// The gateway's overload and capacity flags, as `tandem gateway` and `tandem serve` take them:
// one definition of each flag's name, help, default and bounds, so both commands read and bound
// it alike and write it into the same Topology field.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

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
  int64_t max_body_time_ms = gateway::Topology{}.max_body_time.count();  // --max-body-time-ms
  std::vector<std::string> allowed_origins =
      gateway::Topology{}.allowed_origins;  // --allowed-origins
  // --max-queued-body-bytes
  size_t max_queued_body_bytes = gateway::Topology{}.max_queued_body_bytes;
};

// Adds the flags to `cmd`; a value out of bounds is refused as the command line is read, naming
// the flag (before `tandem serve` writes a preset or starts an engine).
void add_gateway_capacity_flags(CLI::App& cmd, GatewayCapacityFlags& flags);

// --max-connections as `tandem gateway`, `tandem serve` and `tandem engine` take it (one
// definition): its help, default 0 and bounds.
void add_max_connections_flag(CLI::App& cmd, size_t& max_connections);

// --allowed-origins as `tandem gateway`, `tandem serve` and `tandem engine` take it (one
// definition): net::parse_allowed_origins' forms, default "*"; an entry that is no origin is
// refused as the command line is read.
void add_allowed_origins_flag(CLI::App& cmd, std::vector<std::string>& origins);

// Writes the flags into `t`: those given on `cmd` only where `t` has settings of its own (a
// --config file's), else every flag, given or by default.
void apply_gateway_capacity_flags(gateway::Topology& t, const GatewayCapacityFlags& flags,
                                  const CLI::App& cmd, bool only_given);

// `t`, the settings of a whole stack, made into those of each of its `replicas` gateway replicas
// (`tandem serve --gateways`), which run in one process. Each takes its share of what bounds the
// stack: the engines' in-flight limits and the client connection cap (the stack's file
// descriptor limit is one; with max_connections 0 each takes its share of three quarters of
// `descriptor_limit`, nullopt where unknown or unlimited), a given one divided rounding up (so
// never to 0, which would mean the default), and the queue's byte bound (max_queued_body_bytes:
// the process's memory; 0, no bound, stays 0). max_queue and io_threads stay each replica's own,
// and max_connections_per_address whole: the replicas share one count of it
// (net::ConnectionsPerAddress).
void share_among_gateway_replicas(gateway::Topology& t, int replicas,
                                  std::optional<size_t> descriptor_limit);

}  // namespace tandem::cli
