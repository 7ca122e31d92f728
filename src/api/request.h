#pragma once
// The request bodies of OpenAI /v1/completions and /v1/chat/completions and of SGLang's tokens-in
// /generate, parsed into token ids plus sampling parameters: what the engine serves and what the
// gateway tokenizes to route. Pure functions (no sockets), so the parsing is tested directly.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/disaggregation.h"
#include "api/error.h"
#include "api/reasoning.h"
#include "api/sampling.h"
#include "api/tool_calls.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace tandem::api {

enum class ApiKind { kCompletion, kChat, kGenerate };

// The most prompts one request may list (each becomes an engine request, with its own
// sequence and cache blocks): 1.6 million one-token prompts fit in an 8 MB body.
inline constexpr size_t kMaxPromptsPerRequest = 1024;

struct ApiRequest {
  ApiKind kind = ApiKind::kCompletion;
  std::string model;
  // One entry per prompt, which its n choices share (choice_prompt): a copy per choice took n
  // times a long prompt's memory (n 128 of 8 prompts of 100,000 tokens: 400 MB for 2.4 MB).
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> prompt_texts;  // completions with echo: the prompt text per prompt
  SamplingParams sampling;
  bool stream = false, include_usage = false;
  // vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries the
  // usage so far.
  bool continuous_usage = false;
  int32_t logprobs = -1;  // -1: none, else the number of top alternatives per token
  // vLLM's prompt_logprobs (-1: none): the prompt tokens' logprobs, with this many alternatives,
  // in the body (a completion choice's, or a chat answer's).
  int32_t prompt_logprobs = -1;
  // SGLang's logprob_start_len with return_logprob (-1: none): the prompt's logprobs from this
  // position on, as meta_info.input_token_logprobs.
  int64_t logprob_start_len = -1;
  bool echo = false;  // completions: the answer starts with the prompt
  // Chat: the role the answer is written in, vLLM's (get_chat_request_role): "assistant" after a
  // generation prompt, else the last message's, whose text the model continues.
  std::string response_role = "assistant";
  // Chat with vLLM's echo: each choice's content starts with this text (the last message's when it
  // has the answer's role, else ""); none without echo.
  std::optional<std::string> chat_echo;
  // Completions with echo and max_tokens 0 (OpenAI's and vLLM's): the answer is the prompt alone,
  // finished by "length". As vLLM, the engine still runs the prompt and one token (its usage and
  // cache as any request's), whose text the answer leaves out; sampling.max_tokens is then 1.
  bool echo_only = false;
  // vLLM's return_tokens_as_token_ids: logprob tokens are shown as "token_id:N", which names
  // tokens whose bytes are no text.
  bool tokens_as_ids = false;
  int64_t priority = 0;
  // vLLM's cache_salt: prefix-cache entries are shared only by requests with the same salt (one
  // tenant cannot probe another's prompts by their cache hits).
  std::optional<std::string> cache_salt;
  // Choices per prompt. With several prompts the choices are prompt-major, as OpenAI's and vLLM's:
  // choice k answers prompt k / n.
  int64_t n = 1;
  size_t choice_count() const { return prompts.size() * choices_per_prompt(); }
  const std::vector<int32_t>& choice_prompt(size_t choice) const {
    return prompts.at(choice / choices_per_prompt());
  }
  const std::string& choice_prompt_text(size_t choice) const {
    return prompt_texts.at(choice / choices_per_prompt());
  }
  size_t choices_per_prompt() const { return static_cast<size_t>(std::max<int64_t>(n, 1)); }
  std::string request_id;  // the client's (body "rid"/"request_id"), else empty
  DisaggregationParams disagg;
  // Chat with tools: the markup the answer's tool calls are read from (kNone: the answer is text).
  ToolCallFormat tool_calls = ToolCallFormat::kNone;
  bool tool_choice_named = false;  // tool_choice named a function: the answer is that call
  // OpenAI's parallel_tool_calls: false keeps the answer's first call alone (vLLM drops the rest,
  // streamed and whole; "required" also stops the model after one).
  bool parallel_tool_calls = true;
  // Chat with the engine's --reasoning-parser: the answer's <think> reasoning is read apart
  // (kNone: none is), and `reasoning_all_content` when the prompt already ended it, qwen3's
  // enable_thinking is false, or a constrained answer is constrained from its first token
  // (SamplingParams::reasoning_end_token).
  ReasoningFormat reasoning = ReasoningFormat::kNone;
  bool reasoning_all_content = false;

  // The alternatives per prompt token the engine computes (-1: the prompt is not scored): for
  // prompt_logprobs, for a completion's echo with logprobs (its prompt tokens are listed with
  // their logprobs, as OpenAI and vLLM do), and for SGLang's input logprobs.
  int32_t scored_prompt() const {
    int32_t k = prompt_logprobs;
    if (echo && logprobs >= 0) k = std::max(k, logprobs);
    if (logprob_start_len >= 0) k = std::max(k, std::max<int32_t>(logprobs, 0));
    return k;
  }
};

struct ModelLimits {
  std::string model_name;
  // 0: not known (a gateway the engines have not told theirs): no length check, the engines
  // judge; a chat then needs max_tokens, whose default is the room the length leaves.
  int64_t max_model_len = 0;
  int64_t vocab_size = 0;
  // The operator's limits on max_tokens: the most a request may ask for (0: what the context
  // leaves), and what a request that omits it gets (0: the dialect's default; never above the
  // limit).
  int64_t max_tokens_limit = 0;
  int64_t default_max_tokens = 0;
  // The engine's --reasoning-parser: chat answers' reasoning is read apart in this format.
  ReasoningFormat reasoning = ReasoningFormat::kNone;
  // The model's generation config: what a request that omits a sampling field gets.
  SamplingDefaults sampling = {};
};

// The body's "model", which must be the served one (a 404 naming it otherwise, as vLLM
// answers); the served name when the body names none.
std::string model_name(const nlohmann::json& body, const ModelLimits& limits);

// Each throws ApiError for a malformed or unsupported request, naming the field. `raw_body`, the
// body's text when the caller has it, keeps the client's key order where it matters (schema
// properties, tools); nlohmann::json sorts keys.
ApiRequest parse_completion(const nlohmann::json& body, const text::Tokenizer& tokenizer,
                            const ModelLimits& limits, std::string_view raw_body = {});
// What a chat body is read for: a generation (/v1/chat/completions), or a count (/tokenize), which
// takes "tools": [] as vLLM's TokenizeChatRequest does (the template sees the empty list), where a
// generation refuses it as vLLM's and OpenAI's chat endpoints do.
enum class ChatUse { kGenerate, kCount };
ApiRequest parse_chat(const nlohmann::json& body, const text::Tokenizer& tokenizer,
                      const text::ChatTemplate* chat_template, const ModelLimits& limits,
                      std::string_view raw_body = {}, ChatUse use = ChatUse::kGenerate);
// How a chat request uses tools: the markup its answer is read with (kNone: plain text) and,
// when tool_choice forces calls, the structured output that makes the model write them.
struct ToolUse {
  ToolCallFormat format = ToolCallFormat::kNone;
  std::optional<structured::OutputSpec> forced;
  bool named = false;    // tool_choice named one function
  bool parallel = true;  // parallel_tool_calls
};

// Reads a chat body's `tools`, `tool_choice` and `parallel_tool_calls` as parse_chat does, given
// the tools as template_tools gives them (`tools_in_order`) and the messages as template_messages
// gives them in the template's `format`: "none" (the default without tools or with an empty list,
// which a generation refuses before) asks nothing of the model and changes nothing; "auto" (the
// default with tools), "required" and a named function need the model's tool-call markup
// (tool_call_markup), the forced ones compile the calls' grammar, and, for a template that does
// not show tools (DeepSeek-V3's), a system message after the client's own describes them
// (add_tool_description). The server and `tandem tokenize` both call this, so they render the
// same prompt for each tool_choice. Throws ApiError naming the field.
ToolUse read_tools(const nlohmann::json& body, const text::Tokenizer& tokenizer,
                   nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools_in_order,
                   text::ContentFormat format);

ApiRequest parse_generate(const nlohmann::json& body, const text::Tokenizer& tokenizer,
                          const ModelLimits& limits);

}  // namespace tandem::api
