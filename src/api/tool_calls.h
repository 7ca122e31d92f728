#pragma once
// Tool calls in a model's answer: the markup each model family writes when it calls a function
// (DeepSeek-V3's and V3.1's special tokens, the "hermes" <tool_call> JSON of Qwen), read back into
// OpenAI's tool_calls, update by update, as vLLM's --tool-call-parser deepseek_v3 / deepseek_v31 /
// hermes do. One parser
// serves streamed and whole answers: a whole answer is the fold of its stream, so both agree.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "structured/output_spec.h"
#include "text/tokenizer.h"

namespace tandem::api {

enum class ToolCallFormat { kNone, kDeepSeekV3, kDeepSeekV31, kHermes };

std::string_view tool_call_format_name(ToolCallFormat format);

// The markup a model speaks: the format whose opening marker is a single token of the tokenizer's
// vocabulary (models are trained to emit it as one token), and for DeepSeek's tokens, whose shape
// of call its chat template writes (V3's or V3.1's); kNone when there is none.
ToolCallFormat tool_call_format_of(const text::Tokenizer& tokenizer,
                                   std::string_view chat_template);

// The system-prompt text that describes `tools` (OpenAI's list of {"type":"function",...}) and the
// markup of `format`, for chat templates that do not render tools themselves (DeepSeek-V3's
// template shows calls and results but never the tool list).
std::string tool_prompt(ToolCallFormat format, const nlohmann::ordered_json& tools);

// The structured output that forces tool calls written in `format`'s markup: calls of the
// functions in `tools` (OpenAI's list), between min_calls and max_calls of them (-1: no limit),
// each with arguments valid under the function's parameters schema. `field` names the request
// field for errors.
structured::OutputSpec forced_tool_calls(ToolCallFormat format, const nlohmann::ordered_json& tools,
                                         int64_t min_calls, int64_t max_calls, std::string field);

// Why `format`'s markup cannot carry a forced call of the function `name` (its parser would read
// back another name, or none), or nothing when it can.
std::optional<std::string> markup_cannot_carry(ToolCallFormat format, std::string_view name);

// The schema a forced call's arguments follow: the function's `parameters`, with "type":
// "object" added when they list "properties" without a "type" (clients write them so, and vLLM
// takes them). Any other schema is taken as it is (the grammar needs an object's).
nlohmann::ordered_json arguments_schema(const nlohmann::ordered_json& parameters);

// What became certain of the answer after one update: content text, or a piece of tool call
// `call` (its name on the first piece, then parts of its JSON arguments).
struct ToolCallDelta {
  int call = -1;  // -1: content
  std::string content;
  std::optional<std::string> name;
  std::string arguments;
};

class ToolCallParser {
 public:
  explicit ToolCallParser(ToolCallFormat format);

  // The next text of the answer. Text that may still turn out to be markup is held back.
  std::vector<ToolCallDelta> feed(std::string_view text);
  // The answer ended: what was held back. A call cut off before its name is complete (a hermes
  // call: before its "arguments" began) stays content, as written; one cut off in its arguments
  // keeps the arguments it got, without the start of a close marker.
  std::vector<ToolCallDelta> finish();
  int calls() const { return calls_; }

 private:
  enum class State { kText, kBetweenCalls, kCallType, kCallName, kCallArguments, kHermesCall };
  // Moves through `pending_`, appending to `out`; returns false when more text is needed.
  bool step(std::vector<ToolCallDelta>& out);
  void emit_content(std::vector<ToolCallDelta>& out, std::string text);
  // Appends content as it is, white space included.
  void emit_content_raw(std::vector<ToolCallDelta>& out, std::string text);
  void emit_arguments(std::vector<ToolCallDelta>& out, std::string text);
  void revert(std::vector<ToolCallDelta>& out);
  size_t find_hermes_close();
  void end_hermes_call(std::vector<ToolCallDelta>& out, size_t at);
  bool end_cut_hermes_call(std::vector<ToolCallDelta>& out);
  void emit_hermes_call(std::string name, std::string arguments, std::vector<ToolCallDelta>& out);

  ToolCallFormat format_;
  State state_ = State::kText;
  std::string pending_;           // text not yet decided
  std::string call_raw_;          // the markup of the call being read, for a call that is not one
  std::string whitespace_;        // white space held back until what follows it is known
  bool after_call_ = false;       // no content came since the last call
  bool content_started_ = false;  // content other than white space came
  int calls_ = 0;
  // A hermes call's scan for its end marker (find_hermes_close), kept across feeds: how far into
  // pending_ it read, whether that is inside a JSON string (and just after its backslash), and
  // where the marker first came inside a string.
  size_t scan_ = 0;
  bool in_string_ = false, escaped_ = false;
  size_t first_close_ = std::string::npos;
};

// A whole answer read at once: its content (empty when it is only calls) and its calls as
// OpenAI's {"id","type":"function","function":{"name","arguments"}} without ids.
struct ParsedToolCalls {
  std::string content;
  struct Call {
    std::string name, arguments;
  };
  std::vector<Call> calls;
};
ParsedToolCalls parse_tool_calls(ToolCallFormat format, std::string_view answer);

}  // namespace tandem::api
