#pragma once
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

namespace tandem::cli {

// `tandem make-model`: write a deterministic random-weight checkpoint in the Hugging Face layout.
void add_model_commands(CLI::App& app);

// A tokenizer scripts/install-deps.sh installs with the test oracles ("deepseek_v3", "qwen3"):
// what make-model ships by default (Qwen3's with the Qwen3 presets) and what simulated engines
// use unless given --tokenizer. Found in the checkout kCheckoutVariable names when set, else in
// the checkout above the binary, else above the current folder; throws tandem::Error naming the
// file looked for and where.
std::filesystem::path default_tokenizer(const std::string& family = "deepseek_v3");
// The environment variable naming the checkout whose default tokenizers tandem uses: a build
// folder outside the clone has none above its binary (the tests set it to their source folder).
inline constexpr const char* kCheckoutVariable = "TANDEM_CHECKOUT";

// The checkpoint of a make-model preset (seed 0, BF16) in the user's cache
// ($XDG_CACHE_HOME or ~/.cache, then tandem/models/PRESET), written on first use: what
// `tandem serve` runs when given a preset name instead of a folder.
std::filesystem::path preset_model_folder(const std::string& preset);
// Where preset_model_folder has or will have that checkpoint; nothing is written.
std::filesystem::path preset_model_path(const std::string& preset);

// Throws tandem::Error naming `flag` when `folder` is no folder, in the words `generate --model`
// uses (CLI::ExistingDirectory's): a reader of the files in it would blame one of them instead
// ("no tokenizer.json in /nonexistent").
void check_model_folder(const std::string& flag, const std::string& folder);

}  // namespace tandem::cli
