#include "api/chat_messages.h"

#include <string>
#include <utility>
#include <vector>

#include "api/body_fields.h"

namespace tandem::api {
namespace {

using nlohmann::ordered_json;

// The texts of a content given as a list of parts.
std::vector<std::string> text_parts(const ordered_json& parts) {
  std::vector<std::string> texts;
  for (const auto& part : parts) {
    // (json::value would throw a type_error, a 500, for a "type" that is not a string.)
    if (!part.is_object() || !part.contains("type") || part["type"] != "text" ||
        !part.contains("text") || !part["text"].is_string())
      fail("messages", "only text content parts are supported");
    texts.push_back(part["text"].get<std::string>());
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

}  // namespace

ordered_json template_messages(const ordered_json& messages, text::ContentFormat format,
                               NullContent null_content) {
  ordered_json out = ordered_json::array();
  for (const auto& m : messages) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      fail("messages", "every message needs a string 'role'");
    ordered_json message = m;
    const auto at = m.find("content");
    const ordered_json* content = at == m.end() || at->is_null() ? nullptr : &*at;
    if (content && !content->is_string() && !content->is_array())
      fail("messages", "message content must be a string or a list of text parts");
    std::vector<std::string> texts;
    if (content && content->is_array()) texts = text_parts(*content);
    if (content && content->is_string()) texts.push_back(content->get<std::string>());
    const bool parts = format == text::ContentFormat::kOpenAI && m["role"] != "tool";
    // Only an assistant turn: DeepSeek-V3's other branches concatenate content, so a null there
    // is an error in transformers, and "" under vLLM.
    if (!content && null_content == NullContent::kNone && m["role"] == "assistant")
      message["content"] = nullptr;
    else
      message["content"] = parts ? as_parts(texts) : ordered_json(joined(texts));
    out.push_back(std::move(message));
  }
  return out;
}

}  // namespace tandem::api
