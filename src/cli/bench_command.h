#pragma once
#include <CLI/CLI.hpp>

namespace tandem::cli {

// `tandem bench`: load generator and trace replayer (src/bench) against any OpenAI server.
void add_bench_command(CLI::App& app);

}  // namespace tandem::cli
