#pragma once
// The files of a model folder beside config.json and the weights: the tokenizer's files, which
// the writers of model folders (tandem quantize, make-model --tokenizer) copy.
#include <filesystem>
#include <string>

namespace tandem::model {

// Makes `to` hold the tokenizer of `from`: every file and folder text::Tokenizer::from_dir reads
// (tokenizer.json, tokenizer_config.json, chat templates), and generation_config.json when
// `generation_config`, copied from `from` where it has them and removed from `to` where it does
// not, so nothing of a model written there earlier (a chat template, say) stays. Symbolic links
// in `from` are followed. Nothing happens when `from` and `to` are the same folder. Throws
// tandem::Error starting with `command` and naming the file.
void copy_tokenizer_files(const std::filesystem::path& from, const std::filesystem::path& to,
                          bool generation_config, const std::string& command);

}  // namespace tandem::model
