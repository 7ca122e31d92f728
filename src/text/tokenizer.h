#pragma once
// The one tokenizer of Tandem: Hugging Face `tokenizer.json` (byte-level BPE as used by the
// DeepSeek-V3, Qwen2.5/Qwen3 and Llama-3 families) plus the BOS/EOS rules and chat template of
// `tokenizer_config.json`. Ids agree with Hugging Face tokenizers bit for bit; anything it does
// not support is an error naming the component, never a silent fallback.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "text/chat_template.h"

namespace tandem::text {

using TokenId = int32_t;

// transformers' clean_up_tokenization: " ." -> ".", " ?" -> "?", " !" -> "!", " ," -> ",",
// " ' " -> "'", " n't" -> "n't", " 'm" -> "'m", " 's" -> "'s", " 've" -> "'ve", " 're" -> "'re",
// each replacing every occurrence (Python's str.replace) in turn, in that order.
std::string clean_up_tokenization(std::string_view text);

class Tokenizer {
 public:
  // Loads DIR/tokenizer.json and, when present, DIR/tokenizer_config.json, and the chat templates
  // as transformers (>= 4.47) finds them: DIR/chat_template.jinja ("default") and
  // DIR/additional_chat_templates/NAME.jinja replace any `chat_template` of
  // tokenizer_config.json; without either, a processor's DIR/chat_template.json is the fallback.
  static Tokenizer from_dir(const std::filesystem::path& dir);
  // The names of the files and folders in DIR that from_dir reads: what a copy of a model's
  // tokenizer copies (tandem quantize, make-model --tokenizer).
  static std::span<const std::string_view> files();
  // config_json may be empty (no tokenizer_config.json). `origin` names the source in errors.
  // Chat templates come from the config's `chat_template` only.
  static Tokenizer from_json(std::string_view tokenizer_json, std::string_view config_json,
                             const std::string& origin);

  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  std::vector<TokenId> encode(std::string_view text, bool add_special_tokens) const;
  // Invalid UTF-8 produced by byte-level tokens becomes U+FFFD, as in Hugging Face tokenizers.
  // Generated text is this decode (IncrementalDetokenizer), never cleaned up, as in vLLM.
  std::string decode(std::span<const TokenId> ids, bool skip_special_tokens) const;
  // decode() as transformers' tokenizer.decode(ids) returns it: cleaned up by
  // clean_up_tokenization when tokenizer_config.json sets clean_up_tokenization_spaces (Llama 3
  // does). vLLM answers /detokenize and shows each logprob's token (decode([id])) with it.
  std::string decode_as_transformers(std::span<const TokenId> ids, bool skip_special_tokens) const;
  // tokenizer_config.json's clean_up_tokenization_spaces; false when absent or null, as in
  // transformers since 4.45.
  bool clean_up_tokenization_spaces() const;

  // The raw bytes a single token stands for when it is decoded on its own in a sequence
  // (no cleanup); the incremental detokenizer concatenates these.
  std::string token_bytes(TokenId id) const;

  std::optional<TokenId> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(TokenId id) const;
  bool is_special(TokenId id) const;
  size_t vocab_size() const;  // highest id + 1, added tokens included

  // From tokenizer_config.json; empty / nullopt when not given.
  const std::string& bos_token() const;
  const std::string& eos_token() const;
  std::optional<TokenId> bos_id() const;
  std::optional<TokenId> eos_id() const;
  // Every chat template the model has, by name (empty: none). A single template is "default".
  const std::vector<NamedChatTemplate>& chat_templates() const;
  // The one a request with or without tools renders with (pick_chat_template); empty when none.
  const std::string& chat_template(bool with_tools = false) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::text
