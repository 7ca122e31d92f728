#include "gateway/tokens_in.h"

#include <algorithm>
#include <array>

#include "api/block_hash.h"
#include "api/body_fields.h"
#include "util/error.h"
#include "util/file.h"
#include "util/json.h"

namespace tandem::gateway {
namespace {

using api::ApiError;
using api::ApiKind;
using nlohmann::json;

// Chat fields whose effect the tokens-in completion cannot carry: they change the response's
// shape (tool calls, structured output, chat logprobs) or the rendering in ways only the
// serving engine knows (its own template, multimodal inputs). Their requests pass through.
constexpr std::array kChatPassThrough = {"tools",
                                         "functions",
                                         "function_call",
                                         "tool_choice",
                                         "response_format",
                                         "guided_json",
                                         "structured_outputs",
                                         "chat_template",
                                         "continue_final_message",
                                         "documents",
                                         "prompt_logprobs",
                                         "reasoning_effort",
                                         "audio",
                                         "modalities",
                                         "prediction",
                                         "web_search_options"};

// Chat fields that the template consumed or that mean something else on /v1/completions
// (`logprobs` is a boolean in chat and a count in completions). Dropped from the tokens-in body.
constexpr std::array kChatOnly = {"messages",
                                  "add_generation_prompt",
                                  "chat_template_kwargs",
                                  "max_completion_tokens",
                                  "logprobs",
                                  "top_logprobs",
                                  "echo",
                                  "add_special_tokens",
                                  "parallel_tool_calls"};

using api::field;
using api::is_token_list;

// Present with anything but `false`.
bool set(const json& body, const char* name) {
  const json* v = field(body, name);
  return v && !(v->is_boolean() && !v->get<bool>());
}

// Fields whose JSON the engine must see in the client's key order (a schema's properties are
// generated in their order); the tokens-in body is re-serialized with sorted keys.
constexpr std::array kKeyOrderMatters = {"response_format", "guided_json", "structured_outputs"};

bool completion_translatable(const json& body) {
  for (const char* name : kKeyOrderMatters)
    if (field(body, name)) return false;
  // Echo repeats the prompt as the client wrote it, which only the text-in request has.
  if (set(body, "echo")) return false;
  // Without BOS only engines that honour the flag tokenize as asked.
  if (const json* a = field(body, "add_special_tokens"); a && !(a->is_boolean() && a->get<bool>()))
    return false;
  // A batch answers with one choice per prompt; the gateway schedules single prompts.
  const json* prompt = field(body, "prompt");
  return !(prompt && prompt->is_array() && !is_token_list(*prompt));
}

bool chat_translatable(const json& body, bool has_template, bool knows_engines_length) {
  if (!has_template) return false;
  for (const char* name : kChatPassThrough)
    if (field(body, name)) return false;
  if (set(body, "logprobs") || field(body, "top_logprobs") || set(body, "echo") ||
      set(body, "add_special_tokens"))
    return false;
  // The chat default for max tokens is the room the engines leave after the prompt.
  if (!knows_engines_length && !field(body, "max_tokens") && !field(body, "max_completion_tokens"))
    return false;
  // Non-text content parts (images, audio) are for engines that take them.
  if (const json* messages = field(body, "messages"); messages && messages->is_array()) {
    for (const auto& m : *messages) {
      const json* content = m.is_object() ? field(m, "content") : nullptr;
      if (!content || !content->is_array()) continue;
      for (const auto& part : *content)
        if (!part.is_object() || part.value("type", json()) != "text") return false;
    }
  }
  return true;
}

int64_t positive(const json& doc, const char* name, const std::filesystem::path& origin) {
  const json* v = field(doc, name);
  if (!v) return 0;
  if (!v->is_number_integer() || v->get<int64_t>() <= 0)
    throw Error(origin.string() + ": '" + name + "' must be a positive integer");
  return v->get<int64_t>();
}

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// The answer parsed, when it is a completion answer (an object with a list of choices).
std::optional<json> completion_answer(std::string_view text) {
  json doc;
  try {
    doc = parse_untrusted_json(text);
  } catch (const Error&) {
    return std::nullopt;
  }
  if (!doc.is_object() || !doc.contains("choices") || !doc["choices"].is_array())
    return std::nullopt;
  return doc;
}

// A completion answer's fields other than its choices, renamed as the chat answer's.
json chat_envelope(const json& answer, std::string_view object) {
  json out = answer;
  out.erase("choices");
  out["object"] = object;
  // Engines name completions "cmpl-..." and chats "chatcmpl-..." (vLLM and ours).
  if (const json* id = field(answer, "id"); id && id->is_string()) {
    const auto s = id->get<std::string>();
    const std::string_view completion = api::response_id_prefix(ApiKind::kCompletion);
    if (s.rfind(completion, 0) == 0)
      out["id"] =
          std::string(api::response_id_prefix(ApiKind::kChat)) + s.substr(completion.size());
  }
  return out;
}

std::string text_of(const json& choice) {
  const json* t = field(choice, "text");
  return t && t->is_string() ? t->get<std::string>() : std::string();
}

json member(const json& o, const char* name) {
  const json* v = field(o, name);
  return v ? *v : json(nullptr);
}

}  // namespace

PromptTokenizer::PromptTokenizer(const std::filesystem::path& dir, std::string model_name,
                                 int64_t max_model_len,
                                 std::shared_ptr<const text::Tokenizer> loaded)
    : tokenizer_(loaded ? std::move(loaded)
                        : std::make_shared<const text::Tokenizer>(text::Tokenizer::from_dir(dir))) {
  if (!tokenizer_->chat_templates().empty())
    chat_template_ = std::make_unique<text::ChatTemplate>(tokenizer_->chat_templates());
  limits_.model_name = std::move(model_name);
  // The engine's limits: the checkpoint's vocab_size and max_position_embeddings (CpuExecutor),
  // or the tokenizer's vocabulary (SimExecutor). Only these two fields are read: the gateway may
  // front engines of any architecture, whose config.json ModelConfig (DeepSeek's) would refuse.
  limits_.vocab_size = static_cast<int64_t>(tokenizer_->vocab_size());
  const auto config = dir / "config.json";
  if (std::filesystem::exists(config)) {
    json doc;
    try {
      doc = parse_untrusted_json(read_regular_file(config, kMaxModelConfigBytes));
    } catch (const Error& e) {
      throw Error(config.string() + ": " + e.what());
    }
    if (!doc.is_object()) throw Error(config.string() + ": expected a JSON object");
    if (const int64_t v = positive(doc, "vocab_size", config)) limits_.vocab_size = v;
    limits_.max_model_len = positive(doc, "max_position_embeddings", config);
  }
  if (max_model_len > 0) {
    limits_.max_model_len = max_model_len;
    length_is_engines_ = true;
  }
}

// The engines' word is the length they judge by. The model's context (config.json) bounds it
// but may be far above it: a default computed from it is one the engines refuse.
PromptTokenizer::Length PromptTokenizer::length(int64_t engines_max_model_len) const {
  if (engines_max_model_len > 0) return {engines_max_model_len, true};
  return {limits_.max_model_len, length_is_engines_};
}

PromptTokenizer::~PromptTokenizer() = default;

std::optional<TokensIn> PromptTokenizer::tokenize(std::string_view path, const nlohmann::json& body,
                                                  int64_t engines_max_model_len,
                                                  std::string_view raw_body) const {
  ApiKind kind;
  if (path == "/v1/completions")
    kind = ApiKind::kCompletion;
  else if (path == "/v1/chat/completions")
    kind = ApiKind::kChat;
  else
    return std::nullopt;
  const Length len = length(engines_max_model_len);
  // A body that is not an object goes on to the parser, which names the error.
  if (body.is_object() &&
      (kind == ApiKind::kCompletion
           ? !completion_translatable(body)
           : !chat_translatable(body, chat_template_ != nullptr, len.sets_chat_default)))
    return std::nullopt;
  // No length known: none is checked (a stand-in for "no limit" was named in the 400 of a large
  // max_tokens as the model's context length); the engines judge the request by their own.
  api::ModelLimits limits = limits_;
  limits.max_model_len = len.max_model_len;
  if (limits.model_name.empty() && body.is_object()) {
    // Any name is accepted: the engines check it.
    if (const json* m = field(body, "model"); m && m->is_string())
      limits.model_name = m->get<std::string>();
  }
  api::ApiRequest r;
  try {
    r = kind == ApiKind::kCompletion
            ? api::parse_completion(body, *tokenizer_, limits, raw_body)
            : api::parse_chat(body, *tokenizer_, chat_template_.get(), limits, raw_body);
  } catch (const Error& e) {
    throw ApiError{400, e.what(), ""};
  }
  TokensIn t;
  t.client_kind = kind;
  t.ids = r.prompts.at(0);
  t.max_tokens = r.sampling.max_tokens;
  t.n = r.n;
  t.stream = r.stream;
  t.response_role = r.response_role;
  if (r.cache_salt) t.cache_salt = api::cache_salt_hash(*r.cache_salt);
  return t;
}

// A prompt that already is these ids (a client that sent token ids) is left as it is.
static bool is_prompt(const json& prompt, const std::vector<int32_t>& ids) {
  if (!prompt.is_array() || prompt.size() != ids.size()) return false;
  for (size_t i = 0; i < ids.size(); ++i)
    if (!prompt[i].is_number_integer() || prompt[i].get<int64_t>() != ids[i]) return false;
  return true;
}

nlohmann::json tokens_in_body(nlohmann::json client_body, const TokensIn& request) {
  json out;
  if (request.client_kind == ApiKind::kChat) {
    out = json::object();
    for (auto it = client_body.begin(); it != client_body.end(); ++it) {
      const bool drop =
          std::any_of(kChatOnly.begin(), kChatOnly.end(),
                      [&](const char* k) { return it.key() == k; }) ||
          std::any_of(kChatPassThrough.begin(), kChatPassThrough.end(),
                      [&](const char* k) { return it.key() == k; });  // null ones reach here
      if (!drop) out[it.key()] = it.value();
    }
    out["max_tokens"] = request.max_tokens;
  } else {
    out = std::move(client_body);
  }
  if (auto p = out.find("prompt"); p == out.end() || !is_prompt(*p, request.ids))
    out["prompt"] = request.ids;
  return out;
}

bool is_usage_chunk(std::string_view data) {
  // '[' is rare in a chunk and '"' frequent, so look for "[]".
  constexpr std::string_view kKey = "\"choices\":";
  for (size_t at = data.find("[]"); at != std::string_view::npos; at = data.find("[]", at + 2))
    if (at >= kKey.size() && data.substr(at - kKey.size(), kKey.size()) == kKey) return true;
  return false;
}

ResponseTranslator::ResponseTranslator(api::ApiKind client_kind, std::string role)
    : chat_(client_kind == ApiKind::kChat), role_(std::move(role)) {}

std::string ResponseTranslator::body(std::string_view completion_json) const {
  if (!chat_) return std::string(completion_json);
  const auto answer = completion_answer(completion_json);
  if (!answer) return std::string(completion_json);
  json out = chat_envelope(*answer, api::kChatObject);
  json choices = json::array();
  for (size_t i = 0; i < (*answer)["choices"].size(); ++i) {
    const json& c = (*answer)["choices"][i];
    if (!c.is_object()) return std::string(completion_json);
    json choice =
        api::chat_message_choice(int64_t(i), text_of(c), nullptr, member(c, "finish_reason"),
                                 member(c, "stop_reason"), role_);
    if (c.contains("index")) choice["index"] = c["index"];
    choices.push_back(std::move(choice));
  }
  out["choices"] = std::move(choices);
  return dump(out);
}

std::vector<std::string> ResponseTranslator::event(std::string_view data) {
  if (drop_usage_ && is_usage_chunk(data)) return {};
  if (!chat_ || data == "[DONE]") return {std::string(data)};
  const auto answer = completion_answer(data);
  if (!answer) return {std::string(data)};
  const json envelope = chat_envelope(*answer, api::kChatChunkObject);
  const json& choices = (*answer)["choices"];
  std::vector<std::string> events;
  if (choices.empty()) {  // the usage chunk
    json e = envelope;
    e["choices"] = json::array();
    events.push_back(dump(e));
    return events;
  }
  for (const auto& c : choices) {
    if (!c.is_object()) return {std::string(data)};
    const json* index_field = field(c, "index");
    const int64_t index =
        index_field && index_field->is_number_integer() ? index_field->get<int64_t>() : 0;
    auto chunk = [&](json delta, json finish, json stop = nullptr) {
      json e = envelope;
      e["choices"] = json::array({api::chat_chunk_choice(index, std::move(delta), nullptr,
                                                         std::move(finish), std::move(stop))});
      return e;
    };
    // As the engine answers a chat: the role first, then content, then the finish on its own.
    if (started_.insert(index).second) {
      json role = chunk(api::chat_role_delta(role_), nullptr);
      // continuous_usage_stats: the role chunk comes before any of the answer's tokens.
      if (json* usage = role.contains("usage") ? &role["usage"] : nullptr;
          usage && usage->is_object() && usage->contains("prompt_tokens")) {
        (*usage)["completion_tokens"] = 0;
        (*usage)["total_tokens"] = (*usage)["prompt_tokens"];
      }
      events.push_back(dump(role));
    }
    if (const std::string text = text_of(c); !text.empty())
      events.push_back(dump(chunk(api::chat_content_delta(text), nullptr)));
    if (const json finish = member(c, "finish_reason"); !finish.is_null())
      events.push_back(dump(chunk(json::object(), finish, member(c, "stop_reason"))));
  }
  return events;
}

}  // namespace tandem::gateway
