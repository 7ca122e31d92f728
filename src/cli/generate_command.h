#pragma once
#include <CLI/CLI.hpp>

namespace tandem::cli {

// `tandem generate`: run the CPU model on one prompt and stream the text.
void add_generate_command(CLI::App& app);

}  // namespace tandem::cli
