#include "util/json.h"

#include "util/error.h"

namespace tandem {

nlohmann::json parse_untrusted_json(std::string_view text, size_t max_depth) {
  size_t depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth)
        throw Error("JSON nesting is deeper than " + std::to_string(max_depth) + " levels");
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("malformed JSON: ") + e.what());
  }
}

nlohmann::json parse_json_document(std::string_view text, const std::string& source) {
  try {
    return parse_untrusted_json(text);
  } catch (const Error& e) {
    throw Error(source + ": " + e.what());
  }
}

}  // namespace tandem
