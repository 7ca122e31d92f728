#pragma once
#include <CLI/CLI.hpp>

namespace tandem::cli {

// `tandem tokenize` and `tandem detokenize`.
void add_text_commands(CLI::App& app);

}  // namespace tandem::cli
