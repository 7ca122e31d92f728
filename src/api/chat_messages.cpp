#include "api/chat_messages.h"

#include <algorithm>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "api/body_fields.h"
#include "api/tool_calls.h"
#include "structured/ordered_json.h"
#include "util/error.h"
#include "util/utf8.h"

namespace tandem::api {
namespace {

using nlohmann::ordered_json;

// The texts of a content given as a list of parts. An assistant's refusal part
// ({"type": "refusal", "refusal": "..."}, which OpenAI's schema has for assistant messages) is
// its text, as vLLM's chat_utils reads it.
std::vector<std::string> text_parts(const ordered_json& parts, bool from_assistant) {
  std::vector<std::string> texts;
  for (const auto& part : parts) {
    // (json::value would throw a type_error, a 500, for a "type" that is not a string.)
    const bool text = part.is_object() && part.contains("type") && part["type"] == "text";
    const bool refusal =
        from_assistant && part.is_object() && part.contains("type") && part["type"] == "refusal";
    const char* key = refusal ? "refusal" : "text";
    if (!(text || refusal) || !part.contains(key) || !part[key].is_string())
      fail("messages", from_assistant ? "only text and refusal content parts are supported"
                                      : "only text content parts are supported");
    texts.push_back(part[key].get<std::string>());
  }
  return texts;
}

std::string joined(const std::vector<std::string>& texts) {
  std::string out;
  for (size_t i = 0; i < texts.size(); ++i) out += (i ? "\n" : "") + texts[i];
  return out;
}

ordered_json as_parts(const std::vector<std::string>& texts) {
  ordered_json parts = ordered_json::array();
  for (const auto& t : texts) parts.push_back({{"type", "text"}, {"text", t}});
  return parts;
}

// The member, or null when absent (a Pydantic field's None default).
ordered_json member(const ordered_json& o, const char* key) {
  const auto it = o.find(key);
  return it == o.end() ? ordered_json(nullptr) : *it;
}

std::string shown(const ordered_json& v) {
  return utf8::clip(v.dump(-1, ' ', false, ordered_json::error_handler_t::replace));
}

// Refuses what ChatCompletionToolsParam(**tool) refuses; `at` is "tools[i]".
void check_tool(const ordered_json& tool, const std::string& at) {
  if (!tool.is_object()) fail(at, "a tool must be an object, got " + shown(tool));
  if (const auto type = tool.find("type"); type != tool.end() && *type != "function")
    fail(at + ".type", "a tool's 'type' must be \"function\" (or absent), got " + shown(*type));
  const auto function = tool.find("function");
  if (function == tool.end() || !function->is_object())
    fail(at + ".function", "a tool needs a 'function' object, got " +
                               (function == tool.end() ? std::string("none") : shown(*function)));
  const ordered_json& f = *function;
  if (const auto name = f.find("name"); name == f.end() || !name->is_string())
    fail(at + ".function.name", "a function's 'name' must be a string, got " +
                                    (name == f.end() ? std::string("none") : shown(*name)));
  if (const ordered_json d = member(f, "description"); !d.is_null() && !d.is_string())
    fail(at + ".function.description",
         "a function's 'description' must be a string or null, got " + shown(d));
  if (const ordered_json p = member(f, "parameters"); !p.is_null() && !p.is_object())
    fail(at + ".function.parameters",
         "a function's 'parameters' must be a JSON Schema object or null, got " + shown(p));
}

// Appends from's members other than `declared` without the map's search by key (a linear search
// per insert): the sent object's keys are unique, and the declared ones are skipped.
void append_others(ordered_json& to, const ordered_json& from,
                   std::initializer_list<std::string_view> declared) {
  auto& members =
      static_cast<ordered_json::object_t::Container&>(to.get_ref<ordered_json::object_t&>());
  for (auto it = from.begin(); it != from.end(); ++it)
    if (std::find(declared.begin(), declared.end(), it.key()) == declared.end())
      members.emplace_back(it.key(), it.value());
}

// A call's arguments as vLLM gives them to a template that reads an object; `at` names them.
ordered_json arguments_object(const ordered_json& sent, const std::string& at) {
  if (sent.is_object()) return sent;
  if (!sent.is_string() || sent.get_ref<const std::string&>().empty())
    return ordered_json::object();
  const std::string& text = sent.get_ref<const std::string&>();
  try {
    ordered_json parsed = structured::parse_ordered(text);
    return parsed.is_object() ? parsed : ordered_json::object();
  } catch (const Error&) {
    // JSON too deep to read is refused; anything else that is no JSON is {} (vLLM's json.loads
    // fails on it too).
    if (nlohmann::json::accept(text))
      fail(at, "the arguments nest deeper than Tandem reads JSON (64 levels)");
    return ordered_json::object();
  }
}

// An assistant turn's tool calls as vLLM's _postprocess_messages gives them; `at` is
// "messages[i]".
void take_tool_calls(ordered_json& message, const std::string& at, ToolArguments arguments) {
  const auto calls = message.find("tool_calls");
  if (calls == message.end()) return;
  if (calls->is_null() || (calls->is_array() && calls->empty())) {
    message.erase(calls);
    return;
  }
  if (!calls->is_array())
    fail(at + ".tool_calls",
         "an assistant turn's 'tool_calls' must be a list, got " + shown(*calls));
  for (size_t j = 0; j < calls->size(); ++j) {
    ordered_json& call = (*calls)[j];
    const std::string call_at = at + ".tool_calls[" + std::to_string(j) + "]";
    if (!call.is_object()) fail(call_at, "a tool call must be an object, got " + shown(call));
    if (const auto type = call.find("type"); type != call.end() && *type != "function")
      fail(call_at + ".type",
           "a tool call's 'type' must be \"function\" (or absent), got " + shown(*type));
    const auto function = call.find("function");
    if (function == call.end() || !function->is_object())
      fail(call_at + ".function",
           "a tool call needs a 'function' object, got " +
               (function == call.end() ? std::string("none") : shown(*function)));
    if (arguments == ToolArguments::kText) continue;
    (*function)["arguments"] =
        arguments_object(member(*function, "arguments"), call_at + ".function.arguments");
  }
}

}  // namespace

ordered_json template_tools(const ordered_json& tools) {
  if (!tools.is_array()) fail("tools", "'tools' must be a list, got " + shown(tools));
  ordered_json out = ordered_json::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const ordered_json& tool = tools[i];
    check_tool(tool, "tools[" + std::to_string(i) + "]");
    const ordered_json& sent = tool["function"];
    ordered_json function = {{"name", sent["name"]},
                             {"description", member(sent, "description")},
                             {"parameters", member(sent, "parameters")}};
    append_others(function, sent, {"name", "description", "parameters"});
    ordered_json dumped = {{"type", "function"}, {"function", std::move(function)}};
    append_others(dumped, tool, {"type", "function"});
    out.push_back(std::move(dumped));
  }
  return out;
}

ordered_json template_messages(const ordered_json& messages, text::ContentFormat format,
                               NullContent null_content, ToolArguments arguments) {
  ordered_json out = ordered_json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const ordered_json& m = messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      fail("messages", "every message needs a string 'role'");
    ordered_json message = m;
    const auto at = m.find("content");
    const ordered_json* content = at == m.end() || at->is_null() ? nullptr : &*at;
    if (content && !content->is_string() && !content->is_array())
      fail("messages", "message content must be a string or a list of text parts");
    std::vector<std::string> texts;
    if (content && content->is_array()) texts = text_parts(*content, m["role"] == "assistant");
    if (content && content->is_string()) texts.push_back(content->get<std::string>());
    const bool parts = format == text::ContentFormat::kOpenAI && m["role"] != "tool";
    // Only an assistant turn: DeepSeek-V3's other branches concatenate content, so a null there
    // is an error in transformers, and "" under vLLM.
    if (!content && null_content == NullContent::kNone && m["role"] == "assistant")
      message["content"] = nullptr;
    else
      message["content"] = parts ? as_parts(texts) : ordered_json(joined(texts));
    // Templates read an earlier turn's reasoning as reasoning_content (Qwen3's); vLLM's answers
    // name it `reasoning`, and vLLM gives a turn's `reasoning` to the template under both names.
    if (const auto reasoning = m.find("reasoning");
        m["role"] == "assistant" && reasoning != m.end() && !reasoning->is_null())
      message["reasoning_content"] = *reasoning;
    if (m["role"] == "assistant")
      take_tool_calls(message, "messages[" + std::to_string(i) + "]", arguments);
    out.push_back(std::move(message));
  }
  return out;
}

ordered_json template_messages(const ordered_json& messages,
                               const text::ChatTemplate& chat_template, bool with_tools) {
  return template_messages(
      messages, chat_template.content_format(with_tools),
      chat_template.tests_content_for_none(with_tools) ? NullContent::kNone : NullContent::kNoText,
      chat_template.concatenates_tool_arguments(with_tools) ? ToolArguments::kText
                                                            : ToolArguments::kObject);
}

ToolCallFormat tool_call_markup(const text::Tokenizer& tokenizer) {
  const ToolCallFormat markup =
      tool_call_format_of(tokenizer, tokenizer.chat_template(/*with_tools=*/true));
  if (markup == ToolCallFormat::kNone)
    fail("tools",
         "this model's tokenizer has none of the tool-call markups Tandem reads (deepseek_v3, "
         "deepseek_v31, hermes): its tool calls could not be parsed");
  return markup;
}

void add_tool_description(ordered_json& messages, const ordered_json& tools,
                          const text::Tokenizer& tokenizer, ToolCallFormat markup,
                          text::ContentFormat format) {
  if (tokenizer.chat_template(/*with_tools=*/true).find("tools") != std::string::npos) return;
  size_t at = 0;
  while (at < messages.size() && messages[at].value("role", "") == "system") ++at;
  const ordered_json prompt =
      ordered_json::array({{{"role", "system"}, {"content", tool_prompt(markup, tools)}}});
  messages.insert(messages.begin() + static_cast<std::ptrdiff_t>(at),
                  template_messages(prompt, format)[0]);
}

}  // namespace tandem::api
