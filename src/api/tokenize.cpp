#include "api/tokenize.h"

#include <string>
#include <string_view>
#include <vector>

#include "api/body_fields.h"
#include "api/error.h"
#include "text/token_text.h"

namespace tandem::api {
namespace {

using nlohmann::json;

// The fields of vLLM's TokenizeChatRequest and TokenizeCompletionRequest that decide the ids;
// others are ignored, as vLLM ignores them (a chat's tool_choice: see chat_request).
constexpr const char* kChatFields[] = {"model",
                                       "messages",
                                       "add_generation_prompt",
                                       "continue_final_message",
                                       "add_special_tokens",
                                       "chat_template",
                                       "chat_template_kwargs",
                                       "tools"};
constexpr const char* kCompletionFields[] = {"model", "prompt", "add_special_tokens"};

template <size_t N>
json copy_fields(const json& body, const char* const (&names)[N]) {
  json out = json::object();
  for (const char* name : names)
    if (const json* v = field(body, name)) out[name] = *v;
  // The generation parsers need a budget; one token asks nothing of the context.
  out["max_tokens"] = 1;
  return out;
}

// The chat request /tokenize's ids are those of. vLLM's TokenizeChatRequest has no tool_choice
// (its prompt does not depend on one), so vLLM counts a chat whatever its tool_choice. Tandem's
// prompt depends only on whether it is "none", which adds no tool description and needs no
// tool-call markup (read_tools); every other choice renders as the default does. So "none" alone
// is passed on: a forced choice would compile its grammar and refuse tools that vLLM counts, and
// a value the chat endpoint refuses would refuse a body that vLLM takes.
json chat_request(const json& body) {
  json chat = copy_fields(body, kChatFields);
  if (const json* choice = field(body, "tool_choice"); choice && *choice == "none")
    chat["tool_choice"] = "none";
  return chat;
}

}  // namespace

json tokenize_answer(const json& body, const text::Tokenizer& tokenizer,
                     const text::ChatTemplate* chat_template, const ModelLimits& limits,
                     std::string_view raw_body) {
  if (!body.is_object()) fail("", "the request body must be a JSON object");
  const bool token_strs = boolean(body, "return_token_strs", false);
  // The count is the answer: a prompt longer than the context is counted, not refused.
  ModelLimits unbounded = limits;
  unbounded.max_model_len = 0;
  unbounded.max_tokens_limit = 0;
  unbounded.default_max_tokens = 0;
  ApiRequest parsed;
  if (field(body, "messages")) {
    parsed = parse_chat(chat_request(body), tokenizer, chat_template, unbounded, raw_body,
                        ChatUse::kCount);
  } else if (const json* prompt = field(body, "prompt")) {
    if (!prompt->is_string()) fail("prompt", "'prompt' must be a string");
    parsed = parse_completion(copy_fields(body, kCompletionFields), tokenizer, unbounded);
  } else {
    fail("prompt", "the request needs 'prompt' (text) or 'messages' (a chat)");
  }
  const std::vector<int32_t>& ids = parsed.prompts.at(0);
  json answer = {{"count", ids.size()}, {"max_model_len", limits.max_model_len}, {"tokens", ids}};
  if (token_strs) {
    json strs = json::array();
    for (int32_t id : ids) strs.push_back(tokenizer.id_to_token(id).value_or(""));
    answer["token_strs"] = std::move(strs);
  } else {
    answer["token_strs"] = nullptr;
  }
  return answer;
}

json detokenize_answer(const json& body, const text::Tokenizer& tokenizer,
                       const ModelLimits& limits) {
  if (!body.is_object()) fail("", "the request body must be a JSON object");
  const json* tokens = field(body, "tokens");
  if (!tokens || !tokens->is_array()) fail("tokens", "'tokens' must be a list of token ids");
  model_name(body, limits);
  // Any id the model has (its vocab_size when known): a prompt may hold each of them.
  const int64_t vocab =
      limits.vocab_size > 0 ? limits.vocab_size : static_cast<int64_t>(tokenizer.vocab_size());
  const std::vector<int32_t> ids =
      tokens->empty() ? std::vector<int32_t>{} : token_list(*tokens, "tokens", vocab);
  // vLLM answers with transformers' tokenizer.decode, which skips the ids its tokenizer has no
  // text for: a padded vocabulary's rows past the tokenizer's ids read back as nothing.
  return {{"prompt", tokenizer.decode_as_transformers(text::ids_with_text(tokenizer, ids),
                                                      /*skip_special_tokens=*/false)}};
}

}  // namespace tandem::api
