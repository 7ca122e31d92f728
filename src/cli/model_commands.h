#pragma once
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

namespace tandem::cli {

// `tandem make-model`: write a deterministic random-weight checkpoint in the Hugging Face layout.
void add_model_commands(CLI::App& app);

// The DeepSeek-V3 tokenizer that scripts/install-deps.sh installs with the test oracles: what
// make-model ships by default and what simulated engines use unless given --tokenizer.
std::filesystem::path default_tokenizer();

// The checkpoint of a make-model preset (seed 0, BF16) in the user's cache
// ($XDG_CACHE_HOME or ~/.cache, then tandem/models/PRESET), written on first use: what
// `tandem serve` runs when given a preset name instead of a folder.
std::filesystem::path preset_model_folder(const std::string& preset);

}  // namespace tandem::cli
