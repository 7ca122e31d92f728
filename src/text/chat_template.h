#pragma once
// Chat templates: an interpreter for the subset of Jinja2 that Hugging Face chat templates use,
// rendering exactly as transformers' apply_chat_template does with Python's Jinja2
// (trim_blocks, lstrip_blocks, loop controls, raise_exception, tojson, strftime_now).
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace tandem::text {

class ChatTemplate {
 public:
  // Parses the template. A construct outside the supported subset or a syntax error throws
  // tandem::Error naming the template line.
  explicit ChatTemplate(const std::string& source);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  // Renders with the given variables (messages, tools, add_generation_prompt, bos_token,
  // eos_token and any extra keyword arguments). Ordered JSON keeps the caller's key order, as
  // Python dicts do, which `tojson` and `items()` expose. Runtime errors (including
  // raise_exception) throw tandem::Error.
  std::string render(const nlohmann::ordered_json& context) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::text
