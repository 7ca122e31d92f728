#pragma once
// Tokenizer reuse in the gateway. With a model folder configured, the gateway applies the chat
// template and tokenizes a request once: it keeps the ids (prefix hashing, load estimates) and
// sends them downstream as a tokens-in request, a /v1/completions body whose prompt is the id
// list (vLLM, SGLang and our engine all accept it), whatever endpoint the client called. The
// engine's completion-shaped answer is translated back into what the client asked for: a chat
// client gets `chat.completion` bodies and `chat.completion.chunk` events exactly as our engine
// would have sent them for the chat request itself.
//
// The ids are computed by the engine's own parse_completion / parse_chat (api/request.h)
// with the same tokenizer and template, so they are the ids the engine would compute. Requests
// whose answer cannot be translated faithfully (chat with logprobs, tools or response_format, a
// batch of prompts, echo, ...) are not tokenized: the gateway passes their body through as is.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/request.h"
#include "api/response.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace tandem::gateway {

// A request the gateway sends tokens-in.
struct TokensIn {
  api::ApiKind client_kind = api::ApiKind::kCompletion;  // or kChat
  std::vector<int32_t> ids;  // the prompt, as the engine itself would tokenize it
  int64_t max_tokens = 0;    // the completion budget of each choice (defaults applied)
  int64_t n = 1;             // choices
  bool stream = false;
  // The chat answer's role: the last message's when the chat asks for no generation prompt, as
  // the engine answers (api::ApiRequest::response_role).
  std::string response_role = "assistant";
  // vLLM's cache_salt as the engines fold it into a prompt's first block (api::cache_salt_hash,
  // as the engine's generation API hashes it): the prefix-cache entries the prompt may share.
  std::optional<uint64_t> cache_salt;
};

class PromptTokenizer {
 public:
  // Loads DIR's tokenizer (tokenizer.json; tokenizer_config.json's BOS/EOS and chat template)
  // as the engine does, and the limits from DIR/config.json (`vocab_size`,
  // `max_position_embeddings`) when it exists. `model_name`: the model id clients must name
  // (others are answered 404, as the engine does); empty: any. `max_model_len` > 0 overrides the
  // config's (the simulator, which knows its engines' length). `loaded`: DIR's tokenizer when the
  // caller has it already (it is not read again). Throws tandem::Error for unreadable files.
  explicit PromptTokenizer(const std::filesystem::path& dir, std::string model_name = {},
                           int64_t max_model_len = 0,
                           std::shared_ptr<const text::Tokenizer> loaded = nullptr);
  ~PromptTokenizer();

  // For a request to `path` ("/v1/completions" or "/v1/chat/completions") with this body: the
  // prompt's ids, or nullopt when the body must be passed through unchanged (another path, a
  // request that cannot be translated faithfully). Throws api::ApiError for a body the
  // engine would refuse (the gateway answers it with its status, message and param).
  // `engines_max_model_len` > 0: the longest sequence the engines said they take, which is what
  // they judge by (an engine's KV cache or --max-model-len may hold less than the model's
  // context). A chat without max_tokens needs it for its default (what the context leaves):
  // without it, and without the constructor's, such a chat passes through.
  // `raw_body`: the request's text, whose key order the template sees (messages, tools), as the
  // engine's parser reads it; empty: `body`'s (sorted) order.
  std::optional<TokensIn> tokenize(std::string_view path, const nlohmann::json& body,
                                   int64_t engines_max_model_len = 0,
                                   std::string_view raw_body = {}) const;

  // The operator's limits on max_tokens (api::ModelLimits); 0: none.
  void limit_max_tokens(int64_t limit, int64_t default_value) {
    limits_.max_tokens_limit = limit;
    limits_.default_max_tokens = default_value;
  }
  // The engines' generation config's max_new_tokens (api::SamplingDefaults): a chat's max_tokens
  // when it gives none, and a cap on every request's; 0: none.
  void use_generation_max_tokens(int64_t fallback, int64_t cap) {
    limits_.sampling.max_tokens = fallback;
    limits_.sampling.max_tokens_cap = cap;
  }

  const text::Tokenizer& tokenizer() const { return *tokenizer_; }
  // 0 when neither config.json nor the constructor said.
  int64_t max_model_len() const { return limits_.max_model_len; }

 private:
  // The length a request is judged by, and whether the chat default may be computed from it.
  struct Length {
    int64_t max_model_len = 0;  // 0: unknown
    bool sets_chat_default = false;
  };
  Length length(int64_t engines_max_model_len) const;

  std::shared_ptr<const text::Tokenizer> tokenizer_;
  std::unique_ptr<text::ChatTemplate> chat_template_;
  api::ModelLimits limits_;
  bool length_is_engines_ = false;  // the constructor's max_model_len: the engines' own
};

// The tokens-in /v1/completions body for a client body that tokenize() accepted: the client's
// fields with `prompt` replaced by the ids; a chat body also loses the fields the template
// consumed (messages, chat_template_kwargs, ...), and its max_completion_tokens becomes
// max_tokens with the chat default applied (completions would default to 16).
nlohmann::json tokens_in_body(nlohmann::json client_body, const TokensIn& request);

// Whether one streamed event's data is a usage chunk ("choices":[], the usage-only chunk that ends
// a stream asked for stream_options.include_usage).
bool is_usage_chunk(std::string_view data);

// Turns the engine's answers to a tokens-in request back into the client's API. For a
// completion client it is the identity. Anything that is not a completion answer (an error
// body or event, text that is not JSON) goes through unchanged.
class ResponseTranslator {
 public:
  // `role`: a chat answer's (TokensIn::response_role).
  explicit ResponseTranslator(api::ApiKind client_kind, std::string role = "assistant");

  // The gateway asked the engine for a usage chunk the client did not ask for (to read what the
  // engine reused): event() drops it.
  void drop_usage_chunks() { drop_usage_ = true; }

  // A whole non-streaming response body.
  std::string body(std::string_view completion_json) const;
  // One SSE event's data (a JSON chunk or "[DONE]") to the data of the events to send to the
  // client, in order (one chunk may become several events; each needs its own SSE framing).
  std::vector<std::string> event(std::string_view data);

 private:
  bool chat_ = false;
  bool drop_usage_ = false;
  std::string role_;
  std::set<int64_t> started_;  // choices whose first (role) chunk was sent
};

}  // namespace tandem::gateway
