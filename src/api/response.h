#pragma once
// The response bodies and stream chunks of OpenAI /v1/completions and /v1/chat/completions and of
// SGLang's /generate: the engine renders its outputs with ResponseBuilder, and the gateway turns
// an engine's completion-shaped answer to a tokens-in request back into a chat answer with the
// same chat shapes, so both sides write them in one place.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/output.h"
#include "api/request.h"
#include "text/tokenizer.h"

namespace tandem::api {

// The "object" of each response.
inline constexpr std::string_view kCompletionObject = "text_completion";
inline constexpr std::string_view kChatObject = "chat.completion";
inline constexpr std::string_view kChatChunkObject = "chat.completion.chunk";

// How response ids start: "cmpl-" for completions and "chatcmpl-" for chats (as vLLM names them);
// SGLang's /generate has none.
std::string_view response_id_prefix(ApiKind kind);

// Whether a client's X-Request-Id may name its response: a plain token of at most 256 printable
// ASCII characters. It goes into logs, JSON, engine headers and every streamed chunk, so the
// gateway and the engines replace any other with a random id.
bool usable_request_id(std::string_view id);

// The role of a chat answer after a generation prompt (ApiRequest::response_role says which).
inline constexpr std::string_view kAssistantRole = "assistant";

// Chat choices: a whole message (non-streaming) and one stream chunk's delta, with vLLM's
// stop_reason (null but on a finished choice that a stop string or stop id ended).
nlohmann::json chat_message_choice(int64_t index, std::string content, nlohmann::json logprobs,
                                   nlohmann::json finish_reason, nlohmann::json stop_reason,
                                   std::string_view role = kAssistantRole);
nlohmann::json chat_chunk_choice(int64_t index, nlohmann::json delta, nlohmann::json logprobs,
                                 nlohmann::json finish_reason, nlohmann::json stop_reason);
// The deltas of a chat stream, in order: the role first (with empty content), then content, then
// an empty delta with the finish reason.
nlohmann::json chat_role_delta(std::string_view role = kAssistantRole);
nlohmann::json chat_content_delta(std::string text);
// A delta of reasoning text, under both names clients read: reasoning_content (DeepSeek's API,
// and vLLM's until 2026) and reasoning (vLLM's now, OpenRouter's).
nlohmann::json chat_reasoning_delta(std::string text);
// A delta of tool call `index`: its first carries the id, type and name.
nlohmann::json chat_tool_call_delta(int64_t index, const std::string* id, const std::string* name,
                                    std::string arguments);

// Accumulates the outputs of one API request (one engine request per choice) and renders them.
class ResponseBuilder {
 public:
  ResponseBuilder(const ApiRequest& request, const text::Tokenizer& tokenizer, std::string id,
                  int64_t created);

  // Stream chunks (JSON objects, without the SSE framing) for one update of choice `index`.
  std::vector<nlohmann::json> on_output(size_t index, const RequestOutput& out);
  // The chunk with usage that ends an OpenAI stream when include_usage was asked (else null).
  std::optional<nlohmann::json> usage_chunk() const;
  // The complete non-streaming body, once every choice finished.
  nlohmann::json final_body() const;
  bool all_finished() const;

 private:
  struct Choice {
    std::string text;
    // Characters (code points) in text, and in the echoed prompt before it (completions with
    // echo): where text_offset counts from.
    size_t text_chars = 0, prompt_chars = 0;
    std::vector<int32_t> tokens;
    std::vector<TokenLogprob> logprobs;
    // Scored prompts: positions 1.. of the prompt (they come with the first output).
    std::vector<TokenLogprob> prompt_logprobs;
    std::string finish_reason;
    // vLLM's stop_reason (the stop string or stop id that ended it; null otherwise, the EOS
    // included) and SGLang's finish_reason.matched (the EOS id too); null until finished.
    nlohmann::json stop_reason, matched;
    bool finished = false, started = false;
    int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
    // Chat with tools: the answer read as content and calls.
    std::shared_ptr<ToolCallParser> tool_parser;
    // Chat with a reasoning parser: the answer's reasoning, read apart from its content.
    std::shared_ptr<ReasoningParser> reasoning_parser;
    std::string reasoning;
    std::string content;
    struct Call {
      std::string id, name, arguments;
    };
    std::vector<Call> calls;
  };
  // Whether a chat stream echoes text after its role (vLLM's echo with a message to echo).
  bool echoes_text() const { return request_.chat_echo && !request_.chat_echo->empty(); }
  // A chat choice of the whole body (before echo): its message, logprobs and finish.
  nlohmann::json chat_choice(size_t i) const;
  // A chat choice's finish reason: "tool_calls" for an answer that called tools and stopped.
  std::string chat_finish_reason(const Choice& c) const;
  // Folds the update's reasoning, content and tool-call deltas into a chat choice read by
  // parsers, and renders them as stream deltas.
  std::vector<nlohmann::json> read_chat(Choice& c, const RequestOutput& out);
  // The tool-call part of read_chat, for the update's content `text`.
  std::vector<nlohmann::json> read_tool_calls(Choice& c, const std::string& text, bool finished);
  // on_output's stream chunks for one update of choice `c` (`first_lp`: its first new logprob,
  // `chars_before`: its characters before the update).
  void stream_chunks(size_t index, Choice& c, const RequestOutput& out, size_t first_lp,
                     size_t chars_before, std::vector<nlohmann::json>& chunks);
  // on_output for a completion with echo and max_tokens 0.
  std::vector<nlohmann::json> on_echo_only(size_t index, const RequestOutput& out);
  nlohmann::json usage() const;
  // A stream chunk of `object` carrying one choice.
  nlohmann::json stream_chunk(std::string_view object, nlohmann::json choice) const;
  nlohmann::json completion_logprobs(const Choice& c, size_t first, size_t text_offset) const;
  // Echo with logprobs: completion_logprobs' lists for choice `index`'s prompt tokens (the first
  // has no logprob), offsets from 0.
  nlohmann::json echoed_logprobs(size_t index) const;
  // vLLM's prompt_logprobs: null for the first token, then {id: {logprob, rank, decoded_token}}
  // per position with the prompt's token and its `top` alternatives.
  nlohmann::json vllm_prompt_logprobs(size_t index, int32_t top) const;
  // SGLang's input_token_logprobs (and with top > 0 input_top_logprobs) from logprob_start_len.
  void sglang_input_logprobs(size_t index, nlohmann::json& meta) const;
  nlohmann::json chat_logprobs(const Choice& c, size_t first) const;
  nlohmann::json generate_body(size_t index) const;

  const ApiRequest& request_;
  const text::Tokenizer& tokenizer_;
  std::string id_;
  int64_t created_;
  std::vector<Choice> choices_;
};

}  // namespace tandem::api
