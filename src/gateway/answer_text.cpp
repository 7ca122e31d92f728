#include "gateway/answer_text.h"

#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "gateway/tokens_in.h"
#include "util/error.h"
#include "util/json.h"
#include "util/utf8.h"

namespace tandem::gateway {

std::string splice_fields(const std::string& object_text, const std::string& members) {
  const auto close = object_text.rfind('}');
  if (close == std::string::npos) return object_text;
  const auto last = object_text.find_last_not_of(" \t\r\n", close - 1);
  const bool empty = last != std::string::npos && object_text[last] == '{';
  std::string out = object_text.substr(0, close);
  if (!empty) out += ',';
  out += members;
  out += '}';
  return out;
}

namespace {

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

size_t skip_space(std::string_view s, size_t at) {
  while (at < s.size() && is_space(s[at])) ++at;
  return at;
}

// Past the closing quote of the JSON string whose opening quote is at `at`; npos when the text
// ends first.
size_t string_end(std::string_view s, size_t at) {
  for (size_t i = at + 1; i < s.size(); ++i) {
    if (s[i] == '\\')
      ++i;
    else if (s[i] == '"')
      return i + 1;
  }
  return std::string_view::npos;
}

// Past the JSON value that starts at `at` (a number or literal ends at the next delimiter); npos
// when the text ends first.
size_t value_end(std::string_view s, size_t at) {
  if (s[at] == '"') return string_end(s, at);
  if (s[at] != '{' && s[at] != '[') {
    while (at < s.size() && s[at] != ',' && s[at] != '}' && !is_space(s[at])) ++at;
    return at;
  }
  size_t depth = 0;
  for (size_t i = at; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '"') {
      i = string_end(s, i);
      if (i == std::string_view::npos) return i;
      --i;  // the loop steps past the closing quote
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if ((c == '}' || c == ']') && --depth == 0) {
      return i + 1;
    }
  }
  return std::string_view::npos;
}

// The text of each top-level member's value of the JSON object `text` (already parsed, so
// valid), by key; the last of duplicate keys wins, as the parsers have it. Empty for text that
// is no object.
std::unordered_map<std::string, std::string_view> member_texts(std::string_view text) {
  std::unordered_map<std::string, std::string_view> out;
  size_t i = text.starts_with("\xEF\xBB\xBF") ? 3 : 0;  // a byte order mark, which the parsers skip
  i = skip_space(text, i);
  if (i >= text.size() || text[i] != '{') return {};
  i = skip_space(text, i + 1);
  while (i < text.size() && text[i] == '"') {
    const size_t key_end = string_end(text, i);
    if (key_end == std::string_view::npos) return {};
    const std::string_view quoted = text.substr(i, key_end - i);
    std::string key(quoted.substr(1, quoted.size() - 2));
    if (key.find('\\') != std::string::npos) {  // escaped: its value is what the parsers read
      try {
        key = nlohmann::json::parse(quoted).get<std::string>();
      } catch (const nlohmann::json::exception&) {
        return {};
      }
    }
    i = skip_space(text, key_end);
    if (i >= text.size() || text[i] != ':') return {};
    i = skip_space(text, i + 1);
    if (i >= text.size()) return {};
    const size_t end = value_end(text, i);
    if (end == std::string_view::npos) return {};
    out[std::move(key)] = text.substr(i, end - i);
    i = skip_space(text, end);
    if (i < text.size() && text[i] == ',') i = skip_space(text, i + 1);
  }
  return out;
}

// Whether `text` (a member's value as the client sent it) is `value`.
bool same_value(std::string_view text, const nlohmann::json& value) {
  try {
    nlohmann::json parsed = parse_untrusted_json(text);
    const bool same = parsed == value;
    release_json(parsed);
    return same;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace

std::string dump_in_client_order(const nlohmann::json& body, std::string_view client_text) {
  if (!body.is_object()) return body.dump();
  const auto client = member_texts(client_text);
  // Each member's text first, then the whole at its exact size: grown by appending, a body of
  // 100 MB would hold up to twice that (capacity doubling) for as long as its request waits.
  std::vector<std::string> dumped;  // keys and the values written from `body`
  std::vector<std::string_view> parts;
  dumped.reserve(2 * body.size());
  for (auto it = body.begin(); it != body.end(); ++it) {
    parts.push_back(dumped.emplace_back(nlohmann::json(it.key()).dump()));
    const auto sent = client.find(it.key());
    // Only objects have an order to keep.
    if (sent != client.end() && sent->second.find('{') != std::string_view::npos &&
        same_value(sent->second, it.value()))
      parts.push_back(sent->second);
    else
      parts.push_back(dumped.emplace_back(it.value().dump()));
  }
  // The braces, and a ':' or ',' between two parts.
  size_t size = parts.empty() ? 2 : parts.size() + 1;
  for (const std::string_view part : parts) size += part.size();
  std::string out;
  out.reserve(size);
  out += '{';
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += i % 2 == 1 ? ':' : ',';
    out += parts[i];
  }
  out += '}';
  return out;
}

bool looks_like_json_object(std::string_view body) {
  const auto first = body.find_first_not_of(" \t\r\n");
  const auto last = body.find_last_not_of(" \t\r\n");
  return first != std::string_view::npos && body[first] == '{' && body[last] == '}';
}

bool is_json_object(std::string_view body) {
  return looks_like_json_object(body) && nlohmann::json::accept(body);
}

namespace {

// An engine's error text as part of the gateway's message: clipped as client text is (its note
// counting the body's bytes cut), then each run of white space or control bytes one space (an
// HTML page's lines; nothing that could break a log line).
std::string quoted_error_text(std::string_view text) {
  std::string out;
  for (const char ch : utf8::clip(text)) {
    const auto c = static_cast<unsigned char>(ch);
    if (c > 0x20 && c != 0x7f)
      out += ch;
    else if (!out.empty() && out.back() != ' ')
      out += ' ';
  }
  if (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

// Where the digits of the number after the last `"KEY":` in the text lie, as [begin, end): the
// one rule by which the members below are read and rewritten. Empty when there is none.
struct Digits {
  size_t begin = 0, end = 0;
};
Digits last_integer_member_digits(std::string_view text, std::string_view key) {
  const auto at = text.rfind(key);
  if (at == std::string_view::npos) return {};
  size_t i = at + key.size();
  while (i < text.size() && text[i] == ' ') ++i;
  size_t end = i;
  while (end < text.size() && text[end] >= '0' && text[end] <= '9') ++end;
  return {i, end};
}

// The number after the last `"KEY":` in the text, or -1 (read up to 2^40: no count is larger).
int64_t last_integer_member(std::string_view text, std::string_view key) {
  const Digits d = last_integer_member_digits(text, key);
  if (d.begin == d.end) return -1;
  int64_t v = 0;
  for (size_t i = d.begin; i < d.end && v < (int64_t{1} << 40); ++i) v = v * 10 + (text[i] - '0');
  return v;
}

// `text` with the number last_integer_member reads replaced by `value`; as it is without one.
std::string replace_last_integer_member(std::string text, std::string_view key, int64_t value) {
  const Digits d = last_integer_member_digits(text, key);
  if (d.begin == d.end) return text;
  return text.replace(d.begin, d.end - d.begin, std::to_string(value));
}

constexpr std::string_view kCachedTokensKey = "\"cached_tokens\":";

}  // namespace

int64_t usage_completion_tokens(std::string_view body) {
  return last_integer_member(body, "\"completion_tokens\":");
}

int64_t usage_cached_tokens(std::string_view text) {
  return last_integer_member(text, kCachedTokensKey);
}

std::string with_usage_cached_tokens(std::string text, int64_t cached) {
  return replace_last_integer_member(std::move(text), kCachedTokensKey, cached);
}

bool is_error_event(std::string_view data) {
  return data.substr(0, 16).find("\"error\"") != std::string_view::npos;
}

EngineError read_engine_error(std::string_view body) {
  // An error object is a few hundred bytes. A larger body is quoted, not parsed: the callback
  // parser's work grows with the square of the members it drops.
  constexpr size_t kMaxErrorObjectBytes = size_t{64} << 10;
  if (body.size() <= kMaxErrorObjectBytes && looks_like_json_object(body)) {
    // The top level is all that is read, and all that is built: no nesting to bound.
    const nlohmann::json doc = nlohmann::json::parse(
        body, [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) { return depth <= 1; },
        false);
    if (doc.is_object()) {
      const auto error = doc.find("error");
      if (error != doc.end() && error->is_object()) return {true, {}};
      if (error != doc.end() && error->is_string())
        return {false, quoted_error_text(error->get<std::string>())};
      // vLLM's and SGLang's other shape: {"object": "error", "message": ..., "code": 400}.
      const auto message = doc.find("message");
      if (message != doc.end() && message->is_string())
        return {false, quoted_error_text(message->get<std::string>())};
    }
  }
  return {false, quoted_error_text(body)};
}

int error_event_status(std::string_view error_event) {
  // An error object is a few hundred bytes; a larger event is no client's error of an engine's.
  constexpr size_t kMaxErrorObjectBytes = size_t{64} << 10;
  if (error_event.size() > kMaxErrorObjectBytes) return 0;
  const nlohmann::json doc = nlohmann::json::parse(error_event, nullptr, false);
  if (!doc.is_object()) return 0;
  const auto error = doc.find("error");
  if (error == doc.end() || !error->is_object()) return 0;
  // A refusal: a rate limit, or SGLang's scheduler abort (a full queue, an eviction by a higher
  // priority), which its stream handlers send with the abort's status as the code (503). Some
  // proxies write the status as a string.
  if (const auto code = error->find("code"); code != error->end()) {
    if (*code == 429 || *code == "429" || *code == "rate_limit_exceeded") return 429;
    if (*code == 503 || *code == "503") return 503;
  }
  // Only OpenAI's type says so. A 4xx code is no evidence: vLLM's and SGLang's stream generators
  // send their own failures (a CUDA out-of-memory, a dead engine core) as {"type":
  // "BadRequestError", "code": 400}.
  const auto type = error->find("type");
  return type != error->end() && *type == "invalid_request_error" ? 400 : 0;
}

bool carries_tokens(std::string_view data) {
  return data != "[DONE]" && !is_usage_chunk(data) && !is_error_event(data);
}

}  // namespace tandem::gateway
