#pragma once
// Which shape a chat template expects a message's `content` in, read from its syntax tree the
// way vLLM and SGLang decide it, so a request renders the same prompt here as there.
#include "text/jinja/ast.h"

namespace tandem::text::jinja {

enum class ContentFormat {
  kString,  // content is one string; text parts are joined with "\n"
  kOpenAI,  // content is a list of {"type": "text", "text": ...} parts, as the request sent it
};

// kOpenAI when the template loops over a message's content: `for part in message['content']`
// (or `.content`, possibly filtered or sliced) where `message` is a loop variable over
// `messages` or over a variable set from it, or `for part in content`. Anything else is
// kString. An assignment from `messages` to a target other than one plain name also gives
// kString (vLLM's detection gives up there, and falls back to the string format).
ContentFormat detect_content_format(const Body& body);

// Whether the template tells a null content from an empty one: it tests a content with
// `is none` or `is not none` (`message['content']`, `message.content` or a plain `content`).
// DeepSeek-V3's writes an assistant turn's tool calls only for a null content.
bool tests_content_for_none(const Body& body);

// Whether the template adds a tool call's arguments to a string with `+`
// (`'```json\n' + tool['function']['arguments']`, DeepSeek-V3's, R1's and V3.1's): it takes them
// as the JSON text the model wrote, where a mapping, as vLLM gives every template, fails in
// Python ("can only concatenate str (not "dict") to str"). Any `x['arguments']` or `x.arguments`
// as an operand of `+` counts.
bool concatenates_tool_arguments(const Body& body);

}  // namespace tandem::text::jinja
