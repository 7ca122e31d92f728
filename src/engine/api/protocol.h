#pragma once
// The engine's HTTP dialects as pure functions: request bodies of OpenAI /v1/completions and
// /v1/chat/completions and of SGLang's tokens-in /generate become token ids plus sampling
// parameters; generated outputs become the response bodies and stream chunks those APIs return.
// No sockets here, so the translation is tested directly.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/sampler.h"
#include "engine/scheduler/sequence.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace tandem::engine::api {

// A client error: becomes an HTTP 4xx with the OpenAI error JSON.
struct ApiError {
  int status = 400;
  std::string message;
  std::string param;  // the offending field, when there is one
  std::string type = "invalid_request_error";
};

enum class ApiKind { kCompletion, kChat, kGenerate };

// The prefill/decode disaggregation fields a gateway adds to a request body, in both dialects:
// vLLM's `kv_transfer_params` (sequential: prefill first, then decode pulls) and SGLang's
// `bootstrap_host` / `bootstrap_port` / `bootstrap_room` (parallel: both legs at once).
struct DisaggregationParams {
  bool remote_decode = false;   // do_remote_decode: this is the prefill leg
  bool remote_prefill = false;  // do_remote_prefill: this is the decode leg
  std::string remote_host, remote_engine_id, remote_request_id;
  int64_t remote_port = 0;
  std::vector<int32_t> remote_block_ids;
  bool has_bootstrap = false;
  std::string bootstrap_host;
  int64_t bootstrap_port = 0;  // 0 when null or absent
  uint64_t bootstrap_room = 0;
};

struct ApiRequest {
  ApiKind kind = ApiKind::kCompletion;
  std::string model;
  std::vector<std::vector<int32_t>> prompts;  // one entry per choice
  std::vector<std::string> prompt_texts;      // completions with echo: the prompt text per choice
  SamplingParams sampling;
  bool stream = false, include_usage = false;
  int32_t logprobs = -1;  // -1: none, else the number of top alternatives per token
  bool echo = false;
  int64_t priority = 0;
  int64_t n = 1;           // choices per prompt
  std::string request_id;  // the client's (body "rid"/"request_id"), else empty
  DisaggregationParams disagg;
};

struct ModelLimits {
  std::string model_name;
  int64_t max_model_len = 0;
  int64_t vocab_size = 0;
};

// Each throws ApiError for a malformed or unsupported request, naming the field.
ApiRequest parse_completion(const nlohmann::json& body, const text::Tokenizer& tokenizer,
                            const ModelLimits& limits);
ApiRequest parse_chat(const nlohmann::json& body, const text::Tokenizer& tokenizer,
                      const text::ChatTemplate* chat_template, const ModelLimits& limits);
ApiRequest parse_generate(const nlohmann::json& body, const text::Tokenizer& tokenizer,
                          const ModelLimits& limits);

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
    std::vector<int32_t> tokens;
    std::vector<TokenLogprob> logprobs;
    std::string finish_reason;
    bool finished = false, started = false;
    int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  };
  nlohmann::json usage() const;
  nlohmann::json completion_logprobs(const Choice& c, size_t first, size_t text_offset) const;
  nlohmann::json chat_logprobs(const Choice& c, size_t first) const;
  nlohmann::json generate_body(size_t index) const;

  const ApiRequest& request_;
  const text::Tokenizer& tokenizer_;
  std::string id_;
  int64_t created_;
  std::vector<Choice> choices_;
};

}  // namespace tandem::engine::api
