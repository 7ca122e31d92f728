#pragma once
#include <CLI/CLI.hpp>

namespace tandem::cli {

// `tandem serve`: a gateway plus prefill and decode engines as child processes, one command.
void add_serve_command(CLI::App& app);

}  // namespace tandem::cli
