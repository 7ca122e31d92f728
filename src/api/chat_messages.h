#pragma once
// A chat request's messages and tools in the shape its chat template reads them: the server's
// parse_chat and `tandem tokenize --chat-file` render the same prompt from the same input.
#include <nlohmann/json.hpp>

#include "api/tool_calls.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace tandem::api {

// Each message as sent, in the client's key order (`messages` as the body's text holds it:
// templates print a call's arguments and whole messages with tojson, in the order of Python's
// dicts), with its content given in `format`, as vLLM gives it:
//  - kString: text parts joined with "\n" into one string (templates that print content).
//  - kOpenAI: a list of {"type": "text", "text": ...} parts, a string content becoming one part
//    (templates that loop over content, e.g. multimodal ones). A tool message's content is one
//    string still (its texts joined): tool branches print it.
// A null or absent content is no text: "" in the string format, no parts in the openai one, as
// vLLM and SGLang give it, so that templates searching or printing it (Qwen3's `'</think>' in
// message.content`) render an assistant turn that only calls tools, as OpenAI's SDKs send it.
// Except, with NullContent::kNone, for a template that tests content with `is none`
// (text::ChatTemplate::tests_content_for_none): an assistant turn's null or absent content is
// then null, because such a template writes what it means by null there: DeepSeek-V3's writes
// an assistant turn's tool calls only for a null content (given "", as under vLLM and SGLang, it
// drops them; transformers passes a null as null and refuses an absent one). Other roles get ""
// still: DeepSeek-V3's concatenates their content. An assistant turn's `reasoning` (vLLM's name
// for it, which Tandem's answers carry beside reasoning_content) is given as reasoning_content too,
// the name templates read, as vLLM gives it (a reasoning_content sent beside it is replaced, as
// there); a reasoning_content alone is kept as sent. An assistant turn's `tool_calls` are given
// as vLLM's _postprocess_messages gives them: a null or empty list is left out (a template's
// `'tool_calls' in message` then reads the turn as text), and each call's function.arguments in
// the shape `arguments` says:
//  - kObject: the object its JSON string holds, as vLLM gives it to every template (after
//    transformers' convention, which templates that print arguments with tojson follow: Qwen3's,
//    Llama 3.1's): "", null or absent as {}; a string that is not JSON (an answer cut off
//    mid-call) or JSON that is no object as {} too, as vLLM does since its PR #48922 (a 400 would
//    refuse every later turn of that chat); an object sent as one is kept.
//  - kText: as sent, for a template that adds them to a string
//    (text::ChatTemplate::concatenates_tool_arguments, DeepSeek-V3's): given the object it fails,
//    under vLLM too, in every later turn of the chat; the text is what it was written for.
// Throws ApiError naming `messages` for a message without a string role or with content other
// than a string, null or a list of text parts; naming `messages[i].tool_calls` (or the call, its
// type or function) for tool calls vLLM refuses: no list, a call that is no object, of a type
// other than "function", or without a function object; and naming
// `messages[i].tool_calls[j].function.arguments` for JSON nested deeper than 64, which is read no
// further (vLLM would parse it).
enum class NullContent { kNoText, kNone };
enum class ToolArguments { kObject, kText };
nlohmann::ordered_json template_messages(const nlohmann::ordered_json& messages,
                                         text::ContentFormat format,
                                         NullContent null_content = NullContent::kNoText,
                                         ToolArguments arguments = ToolArguments::kObject);

// `messages` as the template that renders the chat (`chat_template`'s pick for a chat with or
// without tools) reads them: its content format, null content and tool arguments, as its syntax
// shows them (text::ChatTemplate). The server and `tandem tokenize` both call this.
nlohmann::ordered_json template_messages(const nlohmann::ordered_json& messages,
                                         const text::ChatTemplate& chat_template, bool with_tools);

// A request's `tools` (OpenAI's [{"type": "function", "function": {"name", "description",
// "parameters"}}]) checked as vLLM's ChatCompletionToolsParam and FunctionDefinition check them,
// and each given as their model_dump() gives it to the template: "type" (Literal["function"],
// "function" when absent), then "function" with name, description and parameters (null when
// absent), then what else the client sent (OpenAI's "strict"), in its order (Pydantic dumps the
// declared fields first and the extra ones its extra="allow" kept after). Templates test these
// fields (`is defined`) and print whole tools with tojson. What the models refuse is an ApiError
// naming the field: 'tools' not a list, tools[i] not an object, tools[i].type other than
// "function" (null included), tools[i].function absent or no object, its name no string, its
// description no string or null, its parameters no object or null. A name may be empty or listed
// twice, as there; what forcing a call needs besides is checked where a call is forced.
nlohmann::ordered_json template_tools(const nlohmann::ordered_json& tools);

// The tool-call markup the model's answers are read with (tool_call_format_of its tool-use
// template), for a chat with tools. Throws ApiError naming `tools` when the model has none of the
// markups Tandem reads: its calls could not be read back, so its chats with tools are refused.
// The server (for tools it does not switch off with tool_choice "none") and `tandem tokenize`
// both ask this, so they refuse the same chats.
ToolCallFormat tool_call_markup(const text::Tokenizer& tokenizer);

// For a model whose tool-use chat template does not show tools (DeepSeek-V3's shows calls and
// results but never the tool list): `messages` (as template_messages gives them, in `format`) get
// a system message describing `tools` (as template_tools gives them) and the model's call
// `markup` (tool_call_markup; tool_prompt), after the client's own system messages. Otherwise
// they are left as they are. The server and `tandem tokenize` both call this, so they count the
// same prompt.
void add_tool_description(nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                          const text::Tokenizer& tokenizer, ToolCallFormat markup,
                          text::ContentFormat format);

}  // namespace tandem::api
