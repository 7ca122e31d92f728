#include "api/tool_calls.h"

#include <algorithm>

#include "structured/ordered_json.h"
#include "util/error.h"

namespace tandem::api {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

// DeepSeek-V3's markup (its chat template writes calls this way, and the model answers so):
//   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```
//   <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
// DeepSeek-V3.1's (and V3.2-Exp's), the same tokens without the type and the fence:
//   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...
//   <｜tool▁calls▁end｜>
constexpr std::string_view kCallsBegin = "<｜tool▁calls▁begin｜>";
constexpr std::string_view kCallsEnd = "<｜tool▁calls▁end｜>";
constexpr std::string_view kCallBegin = "<｜tool▁call▁begin｜>";
constexpr std::string_view kCallEnd = "<｜tool▁call▁end｜>";
constexpr std::string_view kSeparator = "<｜tool▁sep｜>";
constexpr std::string_view kArgumentsOpen = "\n```json\n";
constexpr std::string_view kArgumentsClose = "\n```<｜tool▁call▁end｜>";
// Hermes (Qwen2.5, Qwen3): <tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>
constexpr std::string_view kHermesOpen = "<tool_call>";
constexpr std::string_view kHermesClose = "</tool_call>";

// Longer type or name fields than these are not markup but text that happened to contain it.
constexpr size_t kMaxTypeBytes = 64, kMaxNameBytes = 256;

struct Markup {
  ToolCallFormat format;
  std::string_view name;
  std::string_view open;  // what starts the calls
};
constexpr Markup kMarkups[] = {
    {ToolCallFormat::kDeepSeekV3, "deepseek_v3", kCallsBegin},
    {ToolCallFormat::kDeepSeekV31, "deepseek_v31", kCallsBegin},
    {ToolCallFormat::kHermes, "hermes", kHermesOpen},
};

const Markup* markup_of(ToolCallFormat format) {
  for (const Markup& m : kMarkups)
    if (m.format == format) return &m;
  return nullptr;
}

// The length of the longest end of `text` that `marker` starts with (and is shorter than it): the
// bytes that may still become the marker.
size_t held_prefix(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n)
    if (marker.substr(0, n) == text.substr(text.size() - n)) return n;
  return 0;
}

bool is_space(char c) {
  return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && is_space(s[b])) ++b;
  while (e > b && is_space(s[e - 1])) --e;
  return std::string(s.substr(b, e - b));
}

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// Whether the markup read so far (white space before it aside) opened a block of calls of which
// none was read yet (call_raw_ is emptied once a call's name is read).
bool opens_block(std::string_view raw) {
  size_t b = 0;
  while (b < raw.size() && is_space(raw[b])) ++b;
  return starts_with(raw.substr(b), kCallsBegin);
}

size_t skip_space(std::string_view s, size_t at) {
  while (at < s.size() && is_space(s[at])) ++at;
  return at;
}

// The end of the JSON value that starts at `at` in `s`, which is valid JSON.
size_t skip_value(std::string_view s, size_t at) {
  if (s[at] == '"') {
    for (++at; s[at] != '"'; at += s[at] == '\\' ? 2 : 1) {
    }
    return at + 1;
  }
  if (s[at] == '{' || s[at] == '[') {
    int depth = 0;
    while (true) {
      const char c = s[at];
      if (c == '"') {
        at = skip_value(s, at);
        continue;
      }
      ++at;
      if (c == '{' || c == '[') ++depth;
      if ((c == '}' || c == ']') && --depth == 0) return at;
    }
  }
  while (at < s.size() && s[at] != ',' && s[at] != '}' && s[at] != ']' && !is_space(s[at])) ++at;
  return at;
}

// The text of member `key` of the JSON object `s` (valid JSON), as written: the last one when
// the key repeats, as parse_ordered reads it.
std::string_view member_text(std::string_view s, std::string_view key) {
  std::string_view found;
  size_t at = skip_space(s, 0) + 1;  // past '{'
  while (true) {
    at = skip_space(s, at);
    if (s[at] == '}') return found;
    const size_t key_end = skip_value(s, at);
    // Keys may be written with escapes: compared as the strings they are.
    const bool match = json::parse(s.substr(at, key_end - at)).get<std::string>() == key;
    at = skip_space(s, skip_space(s, key_end) + 1);  // past ':'
    const size_t value_end = skip_value(s, at);
    if (match) found = s.substr(at, value_end - at);
    at = skip_space(s, value_end);
    if (s[at] == ',') ++at;
  }
}

// A hermes call's body: {"name": string, "arguments": object}. As vLLM's hermes parser, a body
// without arguments is no call (vLLM reads the answer as content). The arguments are the model's
// text as written: a JSON round trip would lose integers past 64 bits and the model's layout.
std::optional<ParsedToolCalls::Call> hermes_call(std::string_view body) {
  // JSON text starts at its first non-space byte; the parser below also skips a UTF-8 BOM, which
  // Python's json.loads (vLLM's parser) refuses and member_text() would read as the object.
  const size_t start = skip_space(body, 0);
  if (start >= body.size() || body[start] != '{') return std::nullopt;
  ordered_json ordered;
  try {
    // Linear in the keys (the model may write many): structured/ordered_json.h.
    ordered = structured::parse_ordered(body);
  } catch (const Error&) {
    return std::nullopt;
  }
  if (!ordered.is_object() || !ordered.contains("name") || !ordered["name"].is_string())
    return std::nullopt;
  ParsedToolCalls::Call call;
  call.name = ordered["name"].get<std::string>();
  if (!ordered.contains("arguments")) {
    return std::nullopt;
  } else if (ordered["arguments"].is_object()) {
    call.arguments = std::string(member_text(body, "arguments"));
  } else if (ordered["arguments"].is_string()) {  // some fine-tunes write the JSON as a string
    call.arguments = ordered["arguments"].get<std::string>();
  } else {
    return std::nullopt;
  }
  return call;
}

// The JSON string starting at `at` in `s` ('"'), decoded, and `at` moved past it; nullopt when
// it does not end in `s` or is no JSON string.
std::optional<std::string> json_string_at(std::string_view s, size_t& at) {
  if (at >= s.size() || s[at] != '"') return std::nullopt;
  for (size_t i = at + 1; i < s.size(); ++i) {
    if (s[i] == '\\') {
      ++i;
    } else if (s[i] == '"') {
      try {
        const auto text = structured::parse_ordered(s.substr(at, i + 1 - at));
        at = i + 1;
        return text.get<std::string>();
      } catch (const Error&) {
        return std::nullopt;
      }
    }
  }
  return std::nullopt;
}

// The end of the JSON value starting at `at` in `s`, which may be cut off anywhere; npos when it
// does not end in `s` (a bare value running to the end of `s` may have been cut too).
size_t end_of_whole_value(std::string_view s, size_t at) {
  constexpr size_t npos = std::string_view::npos;
  auto end_of_string = [&](size_t i) {  // i at its opening '"'
    for (++i; i < s.size() && s[i] != '"'; i += s[i] == '\\' ? 2 : 1) {
    }
    return i < s.size() ? i + 1 : npos;
  };
  if (at >= s.size()) return npos;
  if (s[at] == '"') return end_of_string(at);
  if (s[at] != '{' && s[at] != '[') {
    while (at < s.size() && s[at] != ',' && s[at] != '}' && s[at] != ']' && !is_space(s[at])) ++at;
    return at < s.size() ? at : npos;
  }
  int depth = 0;
  while (at < s.size()) {
    const char c = s[at];
    if (c == '"') {
      at = end_of_string(at);
      if (at == npos) return npos;
      continue;
    }
    ++at;
    if (c == '{' || c == '[') ++depth;
    if ((c == '}' || c == ']') && --depth == 0) return at;
  }
  return npos;
}

// A hermes call cut off once its arguments began: {"name": "<name>", "arguments": and the text
// after that, as written (vLLM's hermes parser streams such a call's name and arguments so far).
// nullopt when its name is unfinished or its arguments have not begun, and when its arguments
// ended and anything but white space follows them: then the answer was not cut in the call (a
// '}' ends a body hermes_call refused; prose after them is no call, as for vLLM).
std::optional<ParsedToolCalls::Call> cut_hermes_call(std::string_view body) {
  size_t at = skip_space(body, 0);
  auto expect = [&](char c) {
    if (at >= body.size() || body[at] != c) return false;
    at = skip_space(body, at + 1);
    return true;
  };
  auto string = [&]() {
    auto text = json_string_at(body, at);
    at = skip_space(body, at);
    return text;
  };
  if (!expect('{') || string() != "name" || !expect(':')) return std::nullopt;
  auto name = string();
  if (!name || !expect(',') || string() != "arguments" || !expect(':')) return std::nullopt;
  const size_t end = end_of_whole_value(body, at);
  if (end == std::string_view::npos)
    return ParsedToolCalls::Call{std::move(*name), std::string(body.substr(at))};
  if (skip_space(body, end) != body.size()) return std::nullopt;
  return ParsedToolCalls::Call{std::move(*name), std::string(body.substr(at, end - at))};
}

}  // namespace

std::string_view tool_call_format_name(ToolCallFormat format) {
  const Markup* m = markup_of(format);
  return m ? m->name : "none";
}

ToolCallFormat tool_call_format_of(const text::Tokenizer& tokenizer,
                                   std::string_view chat_template) {
  if (tokenizer.token_to_id(kCallsBegin)) {
    // V3's and V3.1's vocabularies are the same; their templates differ in how they write a
    // call: V3's with the ```json fence after the name, V3.1's with none anywhere.
    const bool v31 = chat_template.find(kSeparator) != std::string_view::npos &&
                     chat_template.find("```json") == std::string_view::npos;
    return v31 ? ToolCallFormat::kDeepSeekV31 : ToolCallFormat::kDeepSeekV3;
  }
  if (tokenizer.token_to_id(kHermesOpen)) return ToolCallFormat::kHermes;
  return ToolCallFormat::kNone;
}

std::string tool_prompt(ToolCallFormat format, const ordered_json& tools) {
  std::string out = "## Tools\n\nYou can call the functions below. ";
  switch (format) {
    case ToolCallFormat::kDeepSeekV3:
      out += std::string("To call functions, answer with\n") + std::string(kCallsBegin) +
             std::string(kCallBegin) + "function" + std::string(kSeparator) + "FUNCTION_NAME" +
             std::string(kArgumentsOpen) + "ARGUMENTS" + std::string(kArgumentsClose) +
             std::string(kCallsEnd) +
             "\nwith one call per function you call, each in its own call markers, where "
             "ARGUMENTS is a JSON object that follows the function's parameters.\n";
      break;
    case ToolCallFormat::kDeepSeekV31:
      out += std::string("To call functions, answer with\n") + std::string(kCallsBegin) +
             std::string(kCallBegin) + "FUNCTION_NAME" + std::string(kSeparator) + "ARGUMENTS" +
             std::string(kCallEnd) + std::string(kCallsEnd) +
             "\nwith one call per function you call, each in its own call markers and nothing "
             "between them, where ARGUMENTS is a JSON object that follows the function's "
             "parameters.\n";
      break;
    case ToolCallFormat::kHermes:
      out += std::string("To call a function, answer with\n") + std::string(kHermesOpen) +
             "\n{\"name\": FUNCTION_NAME, \"arguments\": ARGUMENTS}\n" + std::string(kHermesClose) +
             "\nonce per call, where ARGUMENTS is a JSON object that follows the function's "
             "parameters.\n";
      break;
    case ToolCallFormat::kNone:
      break;
  }
  out += "\n### Functions\n";
  for (const auto& tool : tools) {
    const ordered_json& f = tool.at("function");
    out += "\n- `" + f.at("name").get<std::string>() + "`";
    if (f.contains("description") && f["description"].is_string())
      out += ": " + f["description"].get<std::string>();
    out += "\n";
    // A null one is none (vLLM's dump gives an absent one as null).
    if (f.contains("parameters") && !f["parameters"].is_null())
      out += "```json\n" +
             f["parameters"].dump(-1, ' ', false, ordered_json::error_handler_t::replace) +
             "\n```\n";
  }
  return out;
}

std::optional<std::string> markup_cannot_carry(ToolCallFormat format, std::string_view name) {
  if (name.empty()) return "its name is empty";
  switch (format) {
    case ToolCallFormat::kHermes:
      return std::nullopt;  // a JSON string: any name, escaped (forced_tool_calls)
    case ToolCallFormat::kDeepSeekV3:
    case ToolCallFormat::kDeepSeekV31: {
      // The parser reads a name up to the first end marker, trims white space, and takes at
      // most kMaxNameBytes (ToolCallParser::step, State::kCallName).
      if (name.size() > kMaxNameBytes)
        return "DeepSeek's markup carries names of at most " + std::to_string(kMaxNameBytes) +
               " bytes";
      if (is_space(name.front()) || is_space(name.back()))
        return std::string("DeepSeek's markup trims the white space around a name");
      const std::string_view end =
          format == ToolCallFormat::kDeepSeekV31 ? kSeparator : kArgumentsOpen;
      if ((std::string(name) + std::string(end)).find(end) != name.size())
        return "the name holds the text that ends a name in DeepSeek's markup";
      return std::nullopt;
    }
    case ToolCallFormat::kNone:
      break;
  }
  return std::string("the model has no tool-call markup");
}

ordered_json arguments_schema(const ordered_json& parameters) {
  if (!parameters.is_object() || parameters.contains("type") || !parameters.contains("properties"))
    return parameters;
  ordered_json schema = {{"type", "object"}};
  for (auto it = parameters.begin(); it != parameters.end(); ++it) schema[it.key()] = it.value();
  return schema;
}

structured::OutputSpec forced_tool_calls(ToolCallFormat format, const ordered_json& tools,
                                         int64_t min_calls, int64_t max_calls, std::string field) {
  ordered_json calls;
  switch (format) {
    case ToolCallFormat::kDeepSeekV3:
      calls = {{"open", kCallsBegin},
               {"call_prefix", std::string(kCallBegin) + "function" + std::string(kSeparator)},
               {"after_name", kArgumentsOpen},
               {"call_suffix", kArgumentsClose},
               {"between", "\n"},
               {"close", kCallsEnd}};
      break;
    case ToolCallFormat::kDeepSeekV31:
      calls = {{"open", kCallsBegin},
               {"call_prefix", kCallBegin},
               {"after_name", kSeparator},
               {"call_suffix", kCallEnd},
               {"between", ""},
               {"close", kCallsEnd}};
      break;
    case ToolCallFormat::kHermes:
      // The name is a JSON string: written escaped (below), as the parser reads it back.
      calls = {{"open", ""},
               {"call_prefix", std::string(kHermesOpen) + "\n{\"name\": \""},
               {"after_name", "\", \"arguments\": "},
               {"call_suffix", "}\n" + std::string(kHermesClose)},
               {"between", "\n"},
               {"close", ""}};
      break;
    case ToolCallFormat::kNone:
      throw Error("forced tool calls need a markup");
  }
  ordered_json functions = ordered_json::array();
  for (const auto& t : tools) {
    const ordered_json& function = t.at("function");
    std::string name = function.at("name").get<std::string>();
    if (format == ToolCallFormat::kHermes) {
      name = ordered_json(name).dump();
      name = name.substr(1, name.size() - 2);  // inside the call_prefix's quotes
    }
    ordered_json f = {{"name", std::move(name)}};
    if (function.contains("parameters")) f["parameters"] = arguments_schema(function["parameters"]);
    functions.push_back(std::move(f));
  }
  calls["functions"] = std::move(functions);
  calls["min_calls"] = min_calls;
  calls["max_calls"] = max_calls;
  return {structured::OutputSpec::Kind::kToolCalls, calls.dump(), std::move(field)};
}

ToolCallParser::ToolCallParser(ToolCallFormat format) : format_(format) {
  if (!markup_of(format)) throw Error("ToolCallParser: a format with markup is needed");
}

void ToolCallParser::emit_content(std::vector<ToolCallDelta>& out, std::string text) {
  // Text is content as written. White space is held until what follows it is known: the white
  // space that only separates calls (before the first when nothing else came, between them,
  // after the last) is layout and dropped (step, finish).
  text.insert(0, whitespace_);
  whitespace_.clear();
  size_t e = text.size();
  while (e > 0 && is_space(text[e - 1])) --e;
  whitespace_ = text.substr(e);
  text.resize(e);
  if (text.empty()) return;
  after_call_ = false;
  content_started_ = true;
  emit_content_raw(out, std::move(text));
}

void ToolCallParser::emit_content_raw(std::vector<ToolCallDelta>& out, std::string text) {
  if (!out.empty() && out.back().call < 0) {
    out.back().content += text;
  } else {
    ToolCallDelta d;
    d.content = std::move(text);
    out.push_back(std::move(d));
  }
}

void ToolCallParser::emit_arguments(std::vector<ToolCallDelta>& out, std::string text) {
  if (text.empty()) return;
  if (!out.empty() && out.back().call == calls_ - 1) {
    out.back().arguments += text;
  } else {
    ToolCallDelta d;
    d.call = calls_ - 1;
    d.arguments = std::move(text);
    out.push_back(std::move(d));
  }
}

void ToolCallParser::revert(std::vector<ToolCallDelta>& out) {
  // Not a call after all: its markup so far is content, and the rest is read as text again.
  state_ = State::kText;
  emit_content(out, std::move(call_raw_));
  call_raw_.clear();
}

// Where the hermes call's end marker starts in pending_ (npos: not yet read). Valid JSON holds a
// '<' only in its strings, and an argument may hold the marker's text there (code that prints
// it; the forced grammar allows any string), so only a marker outside strings ends the call.
// The scan resumes where it stopped, so a stream is read once however it was split.
size_t ToolCallParser::find_hermes_close() {
  for (; scan_ < pending_.size(); ++scan_) {
    const char c = pending_[scan_];
    if (c == '<') {
      const std::string_view rest = std::string_view(pending_).substr(scan_);
      if (starts_with(rest, kHermesClose)) {
        if (!in_string_) return scan_;
        if (first_close_ == std::string::npos) first_close_ = scan_;
      } else if (starts_with(kHermesClose, rest)) {
        return std::string::npos;  // may still become the marker
      }
    }
    if (escaped_)
      escaped_ = false;
    else if (c == '\\')
      escaped_ = in_string_;
    else if (c == '"')
      in_string_ = !in_string_;
  }
  return std::string::npos;
}

// The hermes call whose body ends at `at` in pending_, followed by its end marker: a call, or
// content when its body is not one.
void ToolCallParser::end_hermes_call(std::vector<ToolCallDelta>& out, size_t at) {
  auto call = hermes_call(std::string_view(pending_).substr(0, at));
  if (!call && first_close_ < at) {
    // Not JSON up to the marker outside strings (a stray quote made the scan see the rest as a
    // string): the call ends at its first marker, so the text after it is read again and a call
    // there is still found.
    at = first_close_;
  }
  call_raw_ += pending_.substr(0, at + kHermesClose.size());
  pending_.erase(0, at + kHermesClose.size());
  if (!call) {
    revert(out);
    return;
  }
  emit_hermes_call(std::move(call->name), std::move(call->arguments), out);
}

// A hermes call read whole (or cut, at the answer's end) becomes its delta; text follows it.
void ToolCallParser::emit_hermes_call(std::string name, std::string arguments,
                                      std::vector<ToolCallDelta>& out) {
  call_raw_.clear();
  ToolCallDelta d;
  d.call = calls_++;
  d.name = std::move(name);
  d.arguments = std::move(arguments);
  out.push_back(std::move(d));
  state_ = State::kText;
  after_call_ = true;
}

// The hermes call the answer ended in, cut off (max_tokens) before its end marker: a whole call
// cut in its end marker, or one cut in its arguments with the arguments it got. False when it is
// neither (cut before its arguments began), for the caller to make content.
bool ToolCallParser::end_cut_hermes_call(std::vector<ToolCallDelta>& out) {
  std::string_view body = pending_;
  body.remove_suffix(held_prefix(body, kHermesClose));
  auto call = hermes_call(body);
  if (!call) call = cut_hermes_call(body);
  if (!call) return false;
  emit_hermes_call(std::move(call->name), std::move(call->arguments), out);
  return true;
}

bool ToolCallParser::step(std::vector<ToolCallDelta>& out) {
  switch (state_) {
    case State::kText: {
      const std::string_view open = markup_of(format_)->open;
      const size_t at = pending_.find(open);
      if (at == std::string::npos) {
        const size_t keep = held_prefix(pending_, open);
        emit_content(out, pending_.substr(0, pending_.size() - keep));
        pending_.erase(0, pending_.size() - keep);
        return false;
      }
      emit_content(out, pending_.substr(0, at));
      // White space between content and a call stays content (vLLM's content is the text
      // before the call as written); other white space is kept with the markup in case it is
      // not a call after all.
      if (content_started_ && !after_call_ && !whitespace_.empty()) {
        emit_content_raw(out, std::move(whitespace_));
        whitespace_.clear();
      }
      call_raw_ = whitespace_ + std::string(open);
      whitespace_.clear();
      pending_.erase(0, at + open.size());
      state_ = format_ == ToolCallFormat::kHermes ? State::kHermesCall : State::kBetweenCalls;
      scan_ = 0;
      in_string_ = escaped_ = false;
      first_close_ = std::string::npos;
      return true;
    }
    case State::kBetweenCalls: {
      size_t b = 0;
      while (b < pending_.size() && is_space(pending_[b])) ++b;
      call_raw_ += pending_.substr(0, b);
      pending_.erase(0, b);
      if (starts_with(pending_, kCallBegin)) {
        call_raw_ += kCallBegin;
        pending_.erase(0, kCallBegin.size());
        state_ = format_ == ToolCallFormat::kDeepSeekV31 ? State::kCallName : State::kCallType;
        return true;
      }
      if (starts_with(pending_, kCallsEnd)) {
        pending_.erase(0, kCallsEnd.size());
        call_raw_.clear();
        state_ = State::kText;
        after_call_ = calls_ > 0;
        return true;
      }
      if (pending_.empty() || starts_with(kCallBegin, pending_) || starts_with(kCallsEnd, pending_))
        return false;
      if (opens_block(call_raw_)) {  // calls began with no call: text after all
        revert(out);
        return true;
      }
      call_raw_.clear();  // the block ended without its end marker
      state_ = State::kText;
      after_call_ = true;
      return true;
    }
    case State::kCallType: {
      // (The bounds hold wherever the text was split, so a stream reads as the whole does.)
      const size_t at = pending_.find(kSeparator);
      if (at == std::string::npos ? pending_.size() >= kMaxTypeBytes + kSeparator.size()
                                  : at > kMaxTypeBytes) {
        revert(out);
        return true;
      }
      if (at == std::string::npos) return false;
      call_raw_ += pending_.substr(0, at + kSeparator.size());
      pending_.erase(0, at + kSeparator.size());
      state_ = State::kCallName;
      return true;
    }
    case State::kCallName: {
      // V3.1's name ends at the separator, V3's at the arguments' fence.
      const std::string_view name_end =
          format_ == ToolCallFormat::kDeepSeekV31 ? kSeparator : kArgumentsOpen;
      const size_t at = pending_.find(name_end);
      if (at == std::string::npos ? pending_.size() >= kMaxNameBytes + name_end.size()
                                  : at > kMaxNameBytes) {
        revert(out);
        return true;
      }
      if (at == std::string::npos) return false;
      std::string name = trim(std::string_view(pending_).substr(0, at));
      if (name.empty()) {
        revert(out);
        return true;
      }
      pending_.erase(0, at + name_end.size());
      call_raw_.clear();
      ToolCallDelta d;
      d.call = calls_++;
      d.name = std::move(name);
      out.push_back(std::move(d));
      state_ = State::kCallArguments;
      return true;
    }
    case State::kCallArguments: {
      const std::string_view close =
          format_ == ToolCallFormat::kDeepSeekV31 ? kCallEnd : kArgumentsClose;
      const size_t at = pending_.find(close);
      if (at == std::string::npos) {
        const size_t keep = held_prefix(pending_, close);
        emit_arguments(out, pending_.substr(0, pending_.size() - keep));
        pending_.erase(0, pending_.size() - keep);
        return false;
      }
      emit_arguments(out, pending_.substr(0, at));
      pending_.erase(0, at + close.size());
      state_ = State::kBetweenCalls;
      return true;
    }
    case State::kHermesCall: {
      const size_t at = find_hermes_close();
      if (at == std::string::npos) return false;
      end_hermes_call(out, at);
      return true;
    }
  }
  return false;
}

std::vector<ToolCallDelta> ToolCallParser::feed(std::string_view text) {
  std::vector<ToolCallDelta> out;
  pending_ += text;
  while (step(out)) {
  }
  return out;
}

std::vector<ToolCallDelta> ToolCallParser::finish() {
  std::vector<ToolCallDelta> out;
  // A call whose end marker came only inside strings (a stray quote) ends at its first one, and
  // the text after it is read again.
  while (state_ == State::kHermesCall && first_close_ != std::string::npos) {
    end_hermes_call(out, first_close_);
    while (step(out)) {
    }
  }
  switch (state_) {
    case State::kText:
      emit_content(out, std::move(pending_));
      break;
    case State::kCallArguments:
      // Cut off in its arguments (max_tokens): what it got, which step() emitted already. What
      // is left is the start of the close marker ("\n```" of V3's fence), held back as markup.
      break;
    case State::kHermesCall:
      if (end_cut_hermes_call(out)) break;
      call_raw_ += pending_;
      revert(out);
      break;
    case State::kBetweenCalls:
      if (!opens_block(call_raw_)) break;  // the calls' end marker is all that is missing
      [[fallthrough]];
    case State::kCallType:
    case State::kCallName:
      call_raw_ += pending_;
      revert(out);
      break;
  }
  pending_.clear();
  // Trailing white space is the answer's own, unless it only follows a call.
  if (!whitespace_.empty() && !after_call_) emit_content_raw(out, std::move(whitespace_));
  whitespace_.clear();
  return out;
}

ParsedToolCalls parse_tool_calls(ToolCallFormat format, std::string_view answer) {
  ToolCallParser parser(format);
  ParsedToolCalls result;
  auto fold = [&](const std::vector<ToolCallDelta>& deltas) {
    for (const auto& d : deltas) {
      if (d.call < 0) {
        result.content += d.content;
        continue;
      }
      if (d.call >= static_cast<int>(result.calls.size())) result.calls.resize(d.call + 1);
      if (d.name) result.calls[d.call].name = *d.name;
      result.calls[d.call].arguments += d.arguments;
    }
  };
  fold(parser.feed(answer));
  fold(parser.finish());
  return result;
}

}  // namespace tandem::api
