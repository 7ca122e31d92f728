#pragma once
// GET /v1/models, which engines and the gateway both serve and the gateway reads: OpenAI's model
// list with vLLM's `max_model_len`, the longest sequence (prompt and completion) the server
// accepts. vLLM and SGLang report it there too; our engine reports its effective length (the
// least of the model's context, --max-model-len and the KV cache).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "net/http.h"

namespace tandem::api {

struct ModelCard {
  std::string id;
  int64_t created = 0;        // Unix seconds
  int64_t max_model_len = 0;  // 0: not said (the field is left out)
};

// The list body of one model.
std::string model_list_json(const ModelCard& model);
// GET /v1/models/{id}'s body (the openai client's models.retrieve): the model object alone.
std::string model_json(const ModelCard& model);
// The model id GET `path` names (a path under /v1/models/, as it arrived): the rest of the path,
// percent-decoded once, as servers read a path parameter. The openai Python client sends
// "deepseek-ai/DeepSeek-V3" as it is, its Node client (encodeURIComponent) as
// deepseek-ai%2FDeepSeek-V3: both name that model.
std::string retrieved_model_id(std::string_view path);
// Whether `path` (an id, or a path) has a "." or ".." segment, which a proxy or engine the path
// is relayed to would resolve into another route (/v1/models/../completions), never a model's.
// Only relaying refuses it, and of the path as sent, whose %2F separates no segments: a server
// answers its own model's id whatever it is (`--model ./Qwen3-8B` serves "./Qwen3-8B", which the
// Node client sends as .%2FQwen3-8B, one segment, relayed as it is).
bool has_dot_segment(std::string_view id);
// Whether `id` has a ".." segment. Relaying also refuses a decoded id with one: a proxy that
// decodes %2F before it resolves segments (nginx's proxy_pass with a URI, Envoy unescaping
// slashes) would turn x%2F..%2F..%2Fflush_cache into another route of the engine's. A "."
// segment cannot climb out of /v1/models/.
bool has_parent_segment(std::string_view id);
// The answer to GET `path` of a server serving `model`: its object when retrieved_model_id(path)
// is its id, else 404 model_not_found naming the id, as a request naming an unknown model is
// answered.
net::HttpResponse model_retrieval(std::string_view path, const ModelCard& model);

// The least `max_model_len` of a list body's models (an engine may serve several names); nullopt
// when the body is not a model list or no model says one (an older or foreign server).
std::optional<int64_t> max_model_len_of(std::string_view model_list_body);
// The same of a list's "data" array, parsed already.
std::optional<int64_t> max_model_len_of_data(const nlohmann::json& data);

// The id of a list body's first model (the one vLLM's bench sends when told none); nullopt when
// the body is not a model list or lists none.
std::optional<std::string> first_model_id(std::string_view model_list_body);

}  // namespace tandem::api
