#pragma once
// Chat templates: an interpreter for the subset of Jinja2 that Hugging Face chat templates use,
// rendering exactly as transformers' apply_chat_template does with Python's Jinja2
// (trim_blocks, lstrip_blocks, loop controls, raise_exception, tojson, strftime_now).
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/jinja/content_format.h"

namespace tandem::text {

using jinja::ContentFormat;

// One of a model's chat templates. A model folder may bring several by name (a list in
// tokenizer_config.json's `chat_template`, additional_chat_templates/NAME.jinja): "default" is
// the one for plain chat and "tool_use" the one for requests with tools.
struct NamedChatTemplate {
  std::string name;
  std::string source;
};

// The template a request renders with, as transformers' get_chat_template picks it when the
// caller names none: "tool_use" when the request has tools and the model has one, else
// "default". Where transformers refuses (no "default"), a model with a single template uses that
// one. nullptr when nothing applies: several templates and none of them "default".
const NamedChatTemplate* pick_chat_template(const std::vector<NamedChatTemplate>& templates,
                                            bool with_tools);

class ChatTemplate {
 public:
  // Parses the template. A construct outside the supported subset or a syntax error throws
  // tandem::Error naming the template line.
  explicit ChatTemplate(const std::string& source);
  // A model's templates (Tokenizer::chat_templates()). Those a request can select are parsed now
  // (an error names the template); the others are never used. render() picks one per context
  // with pick_chat_template; `tools` in the context, unless null, means the request has tools.
  explicit ChatTemplate(const std::vector<NamedChatTemplate>& templates);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  // Renders with the given variables (messages, tools, add_generation_prompt, bos_token,
  // eos_token and any extra keyword arguments). Ordered JSON keeps the caller's key order, as
  // Python dicts do, which `tojson` and `items()` expose. Runtime errors (including
  // raise_exception, and a model whose templates offer none for the request) throw tandem::Error.
  std::string render(const nlohmann::ordered_json& context) const;

  // The shape of `content` the template render() would pick expects (jinja/content_format.h):
  // a request's messages are given to it that way. kString when no template applies.
  ContentFormat content_format(bool with_tools) const;
  // Whether that template tells a null content from an empty one (jinja::tests_content_for_none).
  bool tests_content_for_none(bool with_tools) const;
  // Whether that template adds a tool call's arguments to a string
  // (jinja::concatenates_tool_arguments).
  bool concatenates_tool_arguments(bool with_tools) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::text
