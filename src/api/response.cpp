#include "api/response.h"

#include <algorithm>

#include "text/token_text.h"
#include "util/random_id.h"
#include "util/utf8.h"

namespace tandem::api {
namespace {

using nlohmann::json;

// As vLLM names a logprob's token: transformers' decode([id]), cleaned up when the tokenizer's
// config says so (Llama 3: " ." shows as ".").
std::string token_text(const text::Tokenizer& tok, int32_t id) {
  // A prompt's id past the tokenizer's (a padded vocabulary's row, which vLLM accepts too) shows
  // as nothing (text/token_text.h).
  if (!text::has_text(tok, id)) return std::string();
  std::string text = utf8::to_valid_lossy(tok.token_bytes(id));
  return tok.clean_up_tokenization_spaces() ? text::clean_up_tokenization(text) : text;
}

// A logprob's token as the request asked to see it: its text, or "token_id:N".
std::string shown_token(const ApiRequest& r, const text::Tokenizer& tok, int32_t id) {
  return r.tokens_as_ids ? "token_id:" + std::to_string(id) : token_text(tok, id);
}

// Two completion_logprobs objects as one: the lists of `first`, then those of `second`.
json joined_logprobs(json first, const json& second) {
  for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
    for (const auto& v : second.at(key)) first.at(key).push_back(v);
  return first;
}

// SGLang's top logprobs at one position: [[logprob, id, null], ...].
json sglang_top(const std::vector<std::pair<int32_t, float>>& top) {
  json out = json::array();
  for (const auto& [id, v] : top) out.push_back(json::array({wire_logprob(v), id, nullptr}));
  return out;
}

}  // namespace

bool usable_request_id(std::string_view id) {
  return !id.empty() && id.size() <= 256 &&
         std::all_of(id.begin(), id.end(), [](char c) { return c > 0x20 && c < 0x7f; });
}

std::string_view response_id_prefix(ApiKind kind) {
  switch (kind) {
    case ApiKind::kCompletion:
      return "cmpl-";
    case ApiKind::kChat:
      return "chatcmpl-";
    case ApiKind::kGenerate:
      break;
  }
  return "";
}

json chat_message_choice(int64_t index, std::string content, json logprobs, json finish_reason,
                         json stop_reason, std::string_view role) {
  return {{"index", index},
          {"message", {{"role", role}, {"content", std::move(content)}}},
          {"logprobs", std::move(logprobs)},
          {"finish_reason", std::move(finish_reason)},
          {"stop_reason", std::move(stop_reason)}};
}

json chat_chunk_choice(int64_t index, json delta, json logprobs, json finish_reason,
                       json stop_reason) {
  return {{"index", index},
          {"delta", std::move(delta)},
          {"logprobs", std::move(logprobs)},
          {"finish_reason", std::move(finish_reason)},
          {"stop_reason", std::move(stop_reason)}};
}

// vLLM's stop_reason and SGLang's matched for a finished output.
json stop_reason_of(const RequestOutput& out) {
  if (out.stop_string) return *out.stop_string;
  if (out.stop_token && !out.stop_at_eos) return *out.stop_token;
  return nullptr;
}
json matched_of(const RequestOutput& out) {
  if (out.stop_string) return *out.stop_string;
  if (out.stop_token) return *out.stop_token;
  return nullptr;
}

json chat_role_delta(std::string_view role) {
  return {{"role", role}, {"content", ""}};
}

json chat_content_delta(std::string text) {
  return {{"content", std::move(text)}};
}

json chat_reasoning_delta(std::string text) {
  return {{"reasoning_content", text}, {"reasoning", text}};
}

json chat_tool_call_delta(int64_t index, const std::string* id, const std::string* name,
                          std::string arguments) {
  json call = {{"index", index}};
  if (id) call["id"] = *id;
  if (name) call["type"] = "function";
  json function = json::object();
  if (name) function["name"] = *name;
  function["arguments"] = std::move(arguments);
  call["function"] = std::move(function);
  return {{"tool_calls", json::array({std::move(call)})}};
}

ResponseBuilder::ResponseBuilder(const ApiRequest& request, const text::Tokenizer& tokenizer,
                                 std::string id, int64_t created)
    : request_(request),
      tokenizer_(tokenizer),
      id_(std::move(id)),
      created_(created),
      choices_(request.choice_count()) {
  if (request.kind == ApiKind::kChat && request.tool_calls != ToolCallFormat::kNone)
    for (Choice& c : choices_) c.tool_parser = std::make_shared<ToolCallParser>(request.tool_calls);
  if (request.kind == ApiKind::kChat && request.reasoning != ReasoningFormat::kNone)
    for (Choice& c : choices_)
      c.reasoning_parser = std::make_shared<ReasoningParser>(request.reasoning_all_content);
  // With logprobs, offsets run on over the echoed prompt's tokens (vLLM's one running sum), so
  // that they never go back; without, the answer's start after the prompt's text.
  if (request.kind == ApiKind::kCompletion && request.echo)
    for (size_t i = 0; i < choices_.size(); ++i) {
      size_t& chars = choices_[i].prompt_chars;
      if (request.logprobs < 0) {
        chars = utf8::code_points(request.choice_prompt_text(i));
        continue;
      }
      for (int32_t id : request.choice_prompt(i))
        chars += utf8::code_points(shown_token(request, tokenizer, id));
    }
}

std::string ResponseBuilder::chat_finish_reason(const Choice& c) const {
  // As OpenAI: a call the client forced by name ends as "stop".
  return !c.calls.empty() && c.finish_reason == "stop" && !request_.tool_choice_named
             ? "tool_calls"
             : c.finish_reason;
}

std::vector<json> ResponseBuilder::read_chat(Choice& c, const RequestOutput& out) {
  if (!c.reasoning_parser) return read_tool_calls(c, out.text, out.finished);
  ReasoningDelta d = c.reasoning_parser->feed(out.text);
  if (out.finished) {
    ReasoningDelta rest = c.reasoning_parser->finish();
    d.reasoning += rest.reasoning;
    d.content += rest.content;
  }
  std::vector<json> rendered;
  if (!d.reasoning.empty()) {
    c.reasoning += d.reasoning;
    rendered.push_back(chat_reasoning_delta(std::move(d.reasoning)));
  }
  // Tool calls are read in the content alone (vLLM's order: reasoning first, then calls).
  if (c.tool_parser) {
    for (auto& j : read_tool_calls(c, d.content, out.finished)) rendered.push_back(std::move(j));
  } else if (!d.content.empty()) {
    c.content += d.content;
    rendered.push_back(chat_content_delta(std::move(d.content)));
  }
  return rendered;
}

std::vector<json> ResponseBuilder::read_tool_calls(Choice& c, const std::string& text,
                                                   bool finished) {
  std::vector<ToolCallDelta> deltas = c.tool_parser->feed(text);
  if (finished) {
    auto rest = c.tool_parser->finish();
    deltas.insert(deltas.end(), std::make_move_iterator(rest.begin()),
                  std::make_move_iterator(rest.end()));
  }
  std::vector<json> rendered;
  for (auto& d : deltas) {
    // parallel_tool_calls false: the first call alone, as vLLM answers (the model may still
    // write more when it was not forced).
    if (d.call > 0 && !request_.parallel_tool_calls) continue;
    if (d.call < 0) {
      c.content += d.content;
      rendered.push_back(chat_content_delta(std::move(d.content)));
      continue;
    }
    const auto k = static_cast<size_t>(d.call);
    if (k >= c.calls.size()) c.calls.resize(k + 1);
    Choice::Call& call = c.calls[k];
    call.arguments += d.arguments;
    if (d.name) {
      call.name = *d.name;
      call.id = "call_" + random_hex(2).substr(0, 24);
      rendered.push_back(
          chat_tool_call_delta(d.call, &call.id, &call.name, std::move(d.arguments)));
    } else {
      rendered.push_back(chat_tool_call_delta(d.call, nullptr, nullptr, std::move(d.arguments)));
    }
  }
  return rendered;
}

bool ResponseBuilder::all_finished() const {
  return std::all_of(choices_.begin(), choices_.end(), [](const Choice& c) { return c.finished; });
}

json ResponseBuilder::usage() const {
  int64_t prompt = 0, completion = 0, cached = 0;
  for (const auto& c : choices_) {
    prompt += c.prompt_tokens;
    completion += c.completion_tokens;
    cached += c.cached_tokens;
  }
  // n > 1 repeats each prompt n times: count each once, as OpenAI and vLLM do.
  prompt /= request_.n;
  cached /= request_.n;
  json u = {{"prompt_tokens", prompt},
            {"completion_tokens", completion},
            {"total_tokens", prompt + completion}};
  // Always an object, as OpenAI sends it: the gateway reads what the engine reused from it.
  u["prompt_tokens_details"] = {{"cached_tokens", cached}};
  return u;
}

json ResponseBuilder::completion_logprobs(const Choice& c, size_t first, size_t text_offset) const {
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  // Offsets count characters (code points), as the length of a Python str: vLLM's len(token).
  size_t offset = text_offset;
  for (size_t i = first; i < c.logprobs.size(); ++i) {
    const auto& lp = c.logprobs[i];
    const std::string t = shown_token(request_, tokenizer_, lp.token);
    tokens.push_back(t);
    lps.push_back(wire_logprob(lp.logprob));
    offsets.push_back(offset);
    offset += utf8::code_points(t);
    // The sampled token and then the alternatives, as OpenAI ("the API will always return the
    // logprob of the sampled token, so there may be up to logprobs+1 elements") and vLLM: with
    // logprobs 0 the sampled token alone. Tokens of the same text share an entry, the last one's.
    json top = json::object();
    top[t] = wire_logprob(lp.logprob);
    for (const auto& [id, v] : lp.top) top[shown_token(request_, tokenizer_, id)] = wire_logprob(v);
    tops.push_back(std::move(top));
  }
  return {{"tokens", tokens},
          {"token_logprobs", lps},
          {"top_logprobs", tops},
          {"text_offset", offsets}};
}

json ResponseBuilder::echoed_logprobs(size_t index) const {
  const std::vector<int32_t>& prompt = request_.choice_prompt(index);
  const Choice& c = choices_.at(index);
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  size_t offset = 0;
  for (size_t p = 0; p < prompt.size(); ++p) {
    const std::string t = shown_token(request_, tokenizer_, prompt[p]);
    tokens.push_back(t);
    offsets.push_back(offset);
    offset += utf8::code_points(t);
    // The first token has no context to be predicted from; a choice that failed before its
    // prompt was scored has none either.
    if (p == 0 || p > c.prompt_logprobs.size()) {
      lps.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    const TokenLogprob& lp = c.prompt_logprobs[p - 1];
    lps.push_back(wire_logprob(lp.logprob));
    json top = json::object();
    top[t] = wire_logprob(lp.logprob);
    for (size_t k = 0; k < lp.top.size() && k < size_t(request_.logprobs); ++k)
      top[shown_token(request_, tokenizer_, lp.top[k].first)] = wire_logprob(lp.top[k].second);
    tops.push_back(std::move(top));
  }
  return {{"tokens", tokens},
          {"token_logprobs", lps},
          {"top_logprobs", tops},
          {"text_offset", offsets}};
}

json ResponseBuilder::vllm_prompt_logprobs(size_t index, int32_t top) const {
  const Choice& c = choices_.at(index);
  const size_t n = request_.choice_prompt(index).size();
  json out = json::array();
  out.push_back(nullptr);
  auto entry = [&](int32_t id, float logprob, int32_t rank) {
    // The token's text, also with return_tokens_as_token_ids (the ids are the keys), as vLLM's.
    return json{{"logprob", wire_logprob(logprob)},
                {"rank", rank},
                {"decoded_token", token_text(tokenizer_, id)}};
  };
  for (size_t p = 1; p < n; ++p) {
    if (p > c.prompt_logprobs.size()) {
      out.push_back(nullptr);
      continue;
    }
    const TokenLogprob& lp = c.prompt_logprobs[p - 1];
    json position = json::object();
    position[std::to_string(lp.token)] = entry(lp.token, lp.logprob, lp.rank);
    for (size_t k = 0; k < lp.top.size() && k < size_t(top); ++k)
      position[std::to_string(lp.top[k].first)] =
          entry(lp.top[k].first, lp.top[k].second, int32_t(k + 1));
    out.push_back(std::move(position));
  }
  return out;
}

void ResponseBuilder::sglang_input_logprobs(size_t index, json& meta) const {
  const Choice& c = choices_.at(index);
  const std::vector<int32_t>& prompt = request_.choice_prompt(index);
  json tokens = json::array(), tops = json::array();
  for (size_t p = size_t(request_.logprob_start_len); p < prompt.size(); ++p) {
    // As SGLang's: the entry at logprob_start_len has none (it is the one its logprobs start
    // after), whatever the position.
    const bool scored = p > size_t(request_.logprob_start_len) && p <= c.prompt_logprobs.size();
    tokens.push_back(
        json::array({scored ? json(wire_logprob(c.prompt_logprobs[p - 1].logprob)) : json(nullptr),
                     prompt[p], nullptr}));
    tops.push_back(scored ? sglang_top(c.prompt_logprobs[p - 1].top) : json(nullptr));
  }
  meta["input_token_logprobs"] = std::move(tokens);
  if (request_.logprobs > 0) meta["input_top_logprobs"] = std::move(tops);
}

json ResponseBuilder::chat_logprobs(const Choice& c, size_t first) const {
  auto entry = [&](int32_t id, float v) {
    // With token ids shown, bytes are the shown string's, as vLLM sends them.
    const std::string raw =
        request_.tokens_as_ids ? shown_token(request_, tokenizer_, id) : tokenizer_.token_bytes(id);
    json bytes = json::array();
    for (unsigned char b : raw) bytes.push_back(static_cast<int>(b));
    // The token as vLLM shows it, its bytes as the model wrote them (OpenAI's: what the text is
    // made of).
    return json{{"token", shown_token(request_, tokenizer_, id)},
                {"logprob", wire_logprob(v)},
                {"bytes", bytes}};
  };
  json content = json::array();
  for (size_t i = first; i < c.logprobs.size(); ++i) {
    json e = entry(c.logprobs[i].token, c.logprobs[i].logprob);
    json top = json::array();
    for (const auto& [id, v] : c.logprobs[i].top) top.push_back(entry(id, v));
    e["top_logprobs"] = top;
    content.push_back(e);
  }
  return {{"content", content}};
}

json ResponseBuilder::generate_body(size_t index) const {
  const Choice& c = choices_[index];
  json finish = nullptr;
  if (c.finished) {
    finish = {{"type", c.finish_reason}};
    if (c.finish_reason == "length") finish["length"] = c.completion_tokens;
    if (!c.matched.is_null()) finish["matched"] = c.matched;
  }
  json meta = {{"id", request_.request_id.empty() ? id_ : request_.request_id},
               {"finish_reason", finish},
               {"prompt_tokens", c.prompt_tokens},
               {"completion_tokens", c.completion_tokens},
               {"cached_tokens", c.cached_tokens}};
  if (request_.logprobs >= 0) {
    json out = json::array();
    for (const auto& lp : c.logprobs) out.push_back(json::array({lp.logprob, lp.token, nullptr}));
    meta["output_token_logprobs"] = out;
    if (request_.logprobs > 0) {
      json tops = json::array();
      for (const auto& lp : c.logprobs) tops.push_back(sglang_top(lp.top));
      meta["output_top_logprobs"] = tops;
    }
    if (request_.logprob_start_len >= 0) sglang_input_logprobs(index, meta);
  }
  return {{"text", c.text}, {"output_ids", c.tokens}, {"meta_info", meta}};
}

std::vector<json> ResponseBuilder::on_output(size_t index, const RequestOutput& out) {
  if (request_.echo_only) return on_echo_only(index, out);
  Choice& c = choices_.at(index);
  const size_t first_lp = c.logprobs.size();
  const size_t chars_before = c.text_chars;
  c.text += out.text;
  c.text_chars += utf8::code_points(out.text);
  c.tokens.insert(c.tokens.end(), out.tokens.begin(), out.tokens.end());
  c.logprobs.insert(c.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
  if (!out.prompt_logprobs.empty()) c.prompt_logprobs = out.prompt_logprobs;
  c.prompt_tokens = out.prompt_tokens;
  c.completion_tokens = out.completion_tokens;
  c.cached_tokens = out.cached_tokens;
  if (out.finished) {
    c.finished = true;
    c.finish_reason = out.finish_reason;
    c.stop_reason = stop_reason_of(out);
    c.matched = matched_of(out);
  }
  std::vector<json> chunks;
  if (!request_.stream) {
    if (c.tool_parser || c.reasoning_parser) read_chat(c, out);
    return chunks;
  }
  // The chunks that open a chat stream before the answer: the role's, and the echo's.
  const size_t opening = c.started || request_.kind != ApiKind::kChat ? 0 : (echoes_text() ? 2 : 1);
  stream_chunks(index, c, out, first_lp, chars_before, chunks);
  // vLLM's continuous_usage_stats: each chunk carries its choice's usage so far (the chunks that
  // open a chat stream none of its tokens yet).
  if (request_.include_usage && request_.continuous_usage && request_.kind != ApiKind::kGenerate)
    for (size_t k = 0; k < chunks.size(); ++k) {
      const int64_t completion = k < opening ? 0 : c.completion_tokens;
      chunks[k]["usage"] = {{"prompt_tokens", c.prompt_tokens},
                            {"completion_tokens", completion},
                            {"total_tokens", c.prompt_tokens + completion}};
    }
  return chunks;
}

void ResponseBuilder::stream_chunks(size_t index, Choice& c, const RequestOutput& out,
                                    size_t first_lp, size_t chars_before,
                                    std::vector<json>& chunks) {
  const json finish = c.finished ? json(c.finish_reason) : json(nullptr);
  switch (request_.kind) {
    case ApiKind::kCompletion: {
      std::string piece = out.text;
      // The generated text starts after the echoed prompt, in the first chunk too (which
      // carries the prompt): offsets are the answer's, as the whole body's are.
      const size_t offset = chars_before + c.prompt_chars;
      const bool echoing = request_.echo && !c.started;
      if (echoing) piece = request_.choice_prompt_text(index) + piece;
      c.started = true;
      // Tokens that add no text yet (held back for a stop string, half a character, a special
      // token) still send their logprobs: the next chunk's start after them.
      const bool new_logprobs = request_.logprobs >= 0 && first_lp < c.logprobs.size();
      if (piece.empty() && !out.finished && !new_logprobs) break;
      json choice = {{"index", index},
                     {"text", piece},
                     {"finish_reason", finish},
                     {"stop_reason", c.stop_reason}};
      choice["logprobs"] = request_.logprobs < 0 ? json(nullptr)
                           : echoing             ? joined_logprobs(echoed_logprobs(index),
                                                                   completion_logprobs(c, first_lp, offset))
                                                 : completion_logprobs(c, first_lp, offset);
      chunks.push_back(stream_chunk(kCompletionObject, std::move(choice)));
      break;
    }
    case ApiKind::kChat: {
      auto chunk = [&](json delta, json fin, json logprobs) {
        json stop = fin.is_null() ? json(nullptr) : c.stop_reason;
        return stream_chunk(kChatChunkObject,
                            chat_chunk_choice(int64_t(index), std::move(delta), std::move(logprobs),
                                              std::move(fin), std::move(stop)));
      };
      if (!c.started) {
        chunks.push_back(chunk(chat_role_delta(request_.response_role), nullptr, nullptr));
        // vLLM's echo: a chunk of its own after the role's (none for no text).
        if (echoes_text())
          chunks.push_back(chunk(chat_content_delta(*request_.chat_echo), nullptr, nullptr));
        c.started = true;
      }
      json lp = request_.logprobs >= 0 ? chat_logprobs(c, first_lp) : json(nullptr);
      const bool new_logprobs = request_.logprobs >= 0 && first_lp < c.logprobs.size();
      if (c.tool_parser || c.reasoning_parser) {
        std::vector<json> deltas = read_chat(c, out);
        if (deltas.empty() && new_logprobs) deltas.push_back(chat_content_delta(""));
        for (auto& d : deltas) {  // the update's logprobs go with its first delta
          chunks.push_back(chunk(std::move(d), nullptr, lp));
          lp = nullptr;
        }
        if (out.finished) chunks.push_back(chunk(json::object(), chat_finish_reason(c), nullptr));
        break;
      }
      if (!out.text.empty() || new_logprobs)
        chunks.push_back(chunk(chat_content_delta(out.text), nullptr, lp));
      if (out.finished) chunks.push_back(chunk(json::object(), finish, nullptr));
      break;
    }
    case ApiKind::kGenerate:
      // SGLang streams the whole text and ids so far in every chunk.
      chunks.push_back(generate_body(index));
      if (choices_.size() > 1) chunks.back()["index"] = index;
      break;
  }
}

// Echo with max_tokens 0: the engine's one token is left out (as vLLM leaves it); the answer is
// the prompt, which ended at the length asked for. Streamed, it is one chunk at the end.
std::vector<json> ResponseBuilder::on_echo_only(size_t index, const RequestOutput& out) {
  Choice& c = choices_.at(index);
  c.prompt_tokens = out.prompt_tokens;
  c.cached_tokens = out.cached_tokens;
  if (!out.prompt_logprobs.empty()) c.prompt_logprobs = out.prompt_logprobs;
  if (!out.finished || c.finished) return {};
  c.finished = true;
  c.finish_reason = out.finish_reason == "abort" ? out.finish_reason : "length";
  if (!request_.stream) return {};
  json choice = {{"index", index},
                 {"text", request_.choice_prompt_text(index)},
                 {"logprobs", request_.logprobs >= 0 ? echoed_logprobs(index) : json(nullptr)},
                 {"finish_reason", c.finish_reason},
                 {"stop_reason", nullptr}};
  return {stream_chunk(kCompletionObject, std::move(choice))};
}

json ResponseBuilder::stream_chunk(std::string_view object, json choice) const {
  return json{{"id", id_},
              {"object", object},
              {"created", created_},
              {"model", request_.model},
              {"choices", json::array({std::move(choice)})}};
}

std::optional<json> ResponseBuilder::usage_chunk() const {
  if (!request_.stream || !request_.include_usage || request_.kind == ApiKind::kGenerate)
    return std::nullopt;
  const std::string_view object =
      request_.kind == ApiKind::kChat ? kChatChunkObject : kCompletionObject;
  return json{{"id", id_},
              {"object", object},
              {"created", created_},
              {"model", request_.model},
              {"choices", json::array()},
              {"usage", usage()}};
}

json ResponseBuilder::chat_choice(size_t i) const {
  const Choice& c = choices_[i];
  const json logprobs = request_.logprobs >= 0 ? chat_logprobs(c, 0) : json(nullptr);
  if (!c.tool_parser && !c.reasoning_parser)
    return chat_message_choice(int64_t(i), c.text, logprobs, c.finish_reason, c.stop_reason,
                               request_.response_role);
  json choice = chat_message_choice(int64_t(i), c.content, logprobs, chat_finish_reason(c),
                                    c.stop_reason, request_.response_role);
  if (c.reasoning_parser) {
    // As vLLM's: null for a part the answer does not have.
    json& message = choice["message"];
    const json reasoning = c.reasoning.empty() ? json(nullptr) : json(c.reasoning);
    message["reasoning_content"] = reasoning;
    message["reasoning"] = reasoning;
    if (c.content.empty()) message["content"] = nullptr;
  }
  if (!c.calls.empty()) {
    json& message = choice["message"];
    if (c.content.empty()) message["content"] = nullptr;  // as OpenAI answers a call
    json calls = json::array();
    for (const auto& call : c.calls)
      calls.push_back({{"id", call.id},
                       {"type", "function"},
                       {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
    message["tool_calls"] = std::move(calls);
  }
  return choice;
}

json ResponseBuilder::final_body() const {
  if (request_.kind == ApiKind::kGenerate) {
    if (choices_.size() == 1) return generate_body(0);
    json all = json::array();
    for (size_t i = 0; i < choices_.size(); ++i) all.push_back(generate_body(i));
    return all;
  }
  json choices = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    if (request_.kind == ApiKind::kCompletion) {
      const std::string prefix = request_.echo ? request_.choice_prompt_text(i) : std::string();
      const std::string text = request_.echo_only ? prefix : prefix + c.text;
      json choice = {{"index", i},
                     {"text", text},
                     {"finish_reason", c.finish_reason},
                     {"stop_reason", c.stop_reason}};
      json logprobs = nullptr;
      if (request_.logprobs >= 0) {
        logprobs =
            request_.echo_only ? echoed_logprobs(i) : completion_logprobs(c, 0, c.prompt_chars);
        if (request_.echo && !request_.echo_only)
          logprobs = joined_logprobs(echoed_logprobs(i), std::move(logprobs));
      }
      choice["logprobs"] = std::move(logprobs);
      // vLLM's choice has them whenever they were computed: asked for, or for echo's logprobs.
      if (request_.scored_prompt() >= 0)
        choice["prompt_logprobs"] = vllm_prompt_logprobs(
            i, request_.prompt_logprobs >= 0 ? request_.prompt_logprobs : request_.logprobs);
      choices.push_back(choice);
    } else {
      json choice = chat_choice(i);
      // vLLM's echo: the echoed text, then the content (none: ""), whatever the answer is.
      if (request_.chat_echo) {
        json& content = choice["message"]["content"];
        content = *request_.chat_echo + (content.is_string() ? content.get<std::string>() : "");
      }
      choices.push_back(std::move(choice));
    }
  }
  json body = {{"id", id_},
               {"object", request_.kind == ApiKind::kChat ? kChatObject : kCompletionObject},
               {"created", created_},
               {"model", request_.model},
               {"choices", choices},
               {"usage", usage()}};
  // vLLM's chat answer carries them once, beside the choices (its choices share one prompt).
  if (request_.kind == ApiKind::kChat && request_.prompt_logprobs >= 0 && !choices_.empty())
    body["prompt_logprobs"] = vllm_prompt_logprobs(0, request_.prompt_logprobs);
  return body;
}

}  // namespace tandem::api
