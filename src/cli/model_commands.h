#pragma once
#include <CLI/CLI.hpp>

namespace tandem::cli {

// `tandem make-model`: write a deterministic random-weight checkpoint in the Hugging Face layout.
void add_model_commands(CLI::App& app);

}  // namespace tandem::cli
