#pragma once
// vLLM's /tokenize and /detokenize: what clients call to count a prompt's tokens before they
// send it, or to read ids back as text. A chat is rendered and tokenized by the same parser as
// /v1/chat/completions (parse_chat), so /tokenize's ids are exactly those a generation request
// with the same messages would run on.
#include <string_view>

#include <nlohmann/json.hpp>

#include "api/request.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace tandem::api {

// The answer to POST /tokenize: {count, max_model_len, tokens, token_strs}. The body is either
// a completion ({"prompt": text, "add_special_tokens": true}) or a chat ({"messages": [...],
// "add_generation_prompt": true, "continue_final_message", "add_special_tokens": false,
// "chat_template", "chat_template_kwargs", "tools"}), as vLLM takes them. A chat's "tool_choice",
// not a field of vLLM's (its prompt does not depend on one), is never refused: "none" is counted
// as the chat endpoint renders it (no tool description, no tool-call markup needed), any other
// value as the default. "tools": [], which the chat endpoint refuses, is counted as vLLM counts
// it: the template is given the empty list (Qwen3's then shows no tools; Llama 3.1's prints its
// tool-use preamble). "return_token_strs" adds each id's token string. No length check: the
// answer says the count and the limit.
// Throws ApiError naming the field for a malformed body, 404 for another model's name.
// `raw_body`, the body's text, keeps the client's key order as parse_chat's does.
nlohmann::json tokenize_answer(const nlohmann::json& body, const text::Tokenizer& tokenizer,
                               const text::ChatTemplate* chat_template, const ModelLimits& limits,
                               std::string_view raw_body = {});

// The answer to POST /detokenize {"tokens": [ids]}: {"prompt": text}, special tokens' text
// included and tokenization spaces cleaned up where the model's config says so (vLLM decodes with
// transformers' tokenizer.decode). An id the tokenizer has no text for (a padded vocabulary's row
// past the tokenizer's ids) reads as nothing, as that decode skips it; an id outside the model's
// vocabulary (or negative) is a 400 naming "tokens", where vLLM's decode would skip it too: no
// prompt or answer can hold it, so a client that sends one has a bug to be told of.
nlohmann::json detokenize_answer(const nlohmann::json& body, const text::Tokenizer& tokenizer,
                                 const ModelLimits& limits);

}  // namespace tandem::api
