#pragma once
#include <CLI/CLI.hpp>

namespace tandem::cli {

// `tandem engine`: a serving worker (OpenAI and tokens-in HTTP API) on the CPU model or a
// simulated executor.
void add_engine_command(CLI::App& app);

}  // namespace tandem::cli
