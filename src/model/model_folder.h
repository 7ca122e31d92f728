#pragma once
// The files of a model folder beside config.json and the weights: the tokenizer's files, which
// the writers of model folders (tandem quantize, make-model --tokenizer) copy, and the check that
// a tokenizer fits a model's vocabulary.
#include <cstdint>
#include <filesystem>
#include <string>

#include "text/tokenizer.h"

namespace tandem::model {

// Makes `to` hold the tokenizer of `from`: every file and folder text::Tokenizer::from_dir reads
// (tokenizer.json, tokenizer_config.json, chat templates), and generation_config.json when
// `generation_config`, copied from `from` where it has them and removed from `to` where it does
// not, so nothing of a model written there earlier (a chat template, say) stays. Symbolic links
// in `from` are followed. Nothing happens when `from` and `to` are the same folder. Throws
// tandem::Error starting with `command` and naming the file.
void copy_tokenizer_files(const std::filesystem::path& from, const std::filesystem::path& to,
                          bool generation_config, const std::string& command);

// Refuses a tokenizer with ids the model has no embedding rows for (ids >= vocab_size): throws
// tandem::Error naming both folders (`tokenizer_dir`, `model_dir`: how the user named them) and
// both sizes. A vocabulary padded past the tokenizer's ids (config vocab_size larger, as
// DeepSeek's and Qwen's are) is what real checkpoints have, and is accepted.
void check_tokenizer_fits(const text::Tokenizer& tokenizer, const std::string& tokenizer_dir,
                          int64_t vocab_size, const std::string& model_dir);

}  // namespace tandem::model
