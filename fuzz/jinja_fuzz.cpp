// Fuzzes the chat-template engine (text/chat_template.h: the Jinja lexer, parser and interpreter)
// on a template and its inputs. The input is the template source, then optionally a NUL byte and
// the render context as JSON (messages, tools, add_generation_prompt, ...); without one, or when
// it is not a JSON object, a two-message conversation is used. Parsing and rendering document
// tandem::Error for every template they refuse or cannot render; anything else escaping is a
// finding.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include <nlohmann/json.hpp>

#include "text/chat_template.h"
#include "util/error.h"

namespace {

const nlohmann::ordered_json& default_context() {
  static const nlohmann::ordered_json context = {
      {"messages",
       {{{"role", "system"}, {"content", "Be brief."}},
        {{"role", "user"}, {"content", "Hello <b>world</b> 1+1=?"}},
        {{"role", "assistant"},
         {"content", nullptr},
         {"tool_calls",
          {{{"type", "function"},
            {"function", {{"name", "add"}, {"arguments", "{\"a\": 1, \"b\": 1}"}}}}}}},
        {{"role", "tool"}, {"content", "2"}}}},
      {"tools",
       {{{"type", "function"},
         {"function",
          {{"name", "add"},
           {"parameters", {{"type", "object"}, {"properties", {{"a", {{"type", "number"}}}}}}}}}}}},
      {"add_generation_prompt", true},
      {"bos_token", "<s>"},
      {"eos_token", "</s>"}};
  return context;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* begin = reinterpret_cast<const char*>(data);
  const auto* nul = static_cast<const char*>(std::memchr(begin, 0, size));
  const std::string source(begin, nul ? nul : begin + size);
  nlohmann::ordered_json context;
  if (nul) {
    context = nlohmann::ordered_json::parse(nul + 1, begin + size, nullptr, false);
    if (!context.is_object()) context = default_context();
  } else {
    context = default_context();
  }
  try {
    const tandem::text::ChatTemplate chat_template(source);
    (void)chat_template.render(context);
  } catch (const tandem::Error&) {
  }
  return 0;
}
