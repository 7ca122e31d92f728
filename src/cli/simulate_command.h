#pragma once
#include <CLI/CLI.hpp>

namespace tandem::cli {

// `tandem simulate`: a workload through the gateway and simulated engines in virtual time
// (src/sim), reported as `tandem bench` reports a live run.
void add_simulate_command(CLI::App& app);

}  // namespace tandem::cli
