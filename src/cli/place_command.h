#pragma once
#include <CLI/CLI.hpp>

namespace tandem::cli {

// `tandem place plan|show|simulate`: Omni Placement from the command line.
void add_place_command(CLI::App& app);

}  // namespace tandem::cli
