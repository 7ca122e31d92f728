#include "model/model_folder.h"

#include "util/error.h"

namespace tandem::model {
namespace {

namespace fs = std::filesystem;

void copy_regular_file(const fs::path& from, const fs::path& to, const std::string& command) {
  std::error_code ec;
  // Not a FIFO or a device: copying one would block or read forever (the loader refuses them).
  if (!fs::is_regular_file(from, ec))
    throw Error(command + ": " + from.string() + " is not a regular file");
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec) throw Error(command + ": cannot copy " + from.string() + ": " + ec.message());
}

}  // namespace

void copy_tokenizer_files(const fs::path& from, const fs::path& to, bool generation_config,
                          const std::string& command) {
  std::error_code ec;
  if (fs::equivalent(from, to, ec)) return;
  std::vector<std::string_view> names(text::Tokenizer::files().begin(),
                                      text::Tokenizer::files().end());
  if (generation_config) names.push_back("generation_config.json");
  for (const std::string_view name : names) {
    const fs::path source = from / name, target = to / name;
    // What `to` had under this name is an earlier model's: it goes, whatever `from` has.
    fs::remove_all(target, ec);
    if (ec) throw Error(command + ": cannot remove " + target.string() + ": " + ec.message());
    if (!fs::exists(source, ec)) continue;
    if (!fs::is_directory(source, ec)) {
      copy_regular_file(source, target, command);
      continue;
    }
    // A folder of templates (additional_chat_templates): its NAME.jinja, as the loader reads it.
    fs::create_directory(target, ec);
    if (ec) throw Error(command + ": cannot create " + target.string() + ": " + ec.message());
    for (const auto& entry : fs::directory_iterator(source))
      if (entry.path().extension() == ".jinja")
        copy_regular_file(entry.path(), target / entry.path().filename(), command);
  }
}

void check_tokenizer_fits(const text::Tokenizer& tokenizer, const std::string& tokenizer_dir,
                          int64_t vocab_size, const std::string& model_dir) {
  const auto ids = static_cast<int64_t>(tokenizer.vocab_size());
  if (ids <= vocab_size) return;
  throw Error("the tokenizer in " + tokenizer_dir + " has " + std::to_string(ids) +
              " token ids (up to " + std::to_string(ids - 1) + "), more than the vocab_size " +
              std::to_string(vocab_size) + " of the model in " + model_dir +
              " (config.json): the model has no embedding rows for the ids past it. Use the "
              "model's own tokenizer");
}

}  // namespace tandem::model
