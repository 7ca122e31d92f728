#pragma once
#include <filesystem>

#include <CLI/CLI.hpp>

namespace tandem::cli {

// `tandem make-model`: write a deterministic random-weight checkpoint in the Hugging Face layout.
void add_model_commands(CLI::App& app);

// The DeepSeek-V3 tokenizer that scripts/install-deps.sh installs with the test oracles: what
// make-model ships by default and what simulated engines use unless given --tokenizer.
std::filesystem::path default_tokenizer();

}  // namespace tandem::cli
