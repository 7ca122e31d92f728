#include "engine/api/protocol.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "util/error.h"
#include "util/utf8.h"

namespace tandem::engine::api {
namespace {

using nlohmann::json;

[[noreturn]] void fail(const std::string& param, const std::string& message) {
  throw ApiError{400, message, param};
}

const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

double number(const json& body, const char* name, double fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_number()) fail(name, std::string("'") + name + "' must be a number");
  return v->get<double>();
}

int64_t integer(const json& body, const char* name, int64_t fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_number_integer() && !v->is_number_unsigned())
    fail(name, std::string("'") + name + "' must be an integer");
  return v->get<int64_t>();
}

bool boolean(const json& body, const char* name, bool fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_boolean()) fail(name, std::string("'") + name + "' must be a boolean");
  return v->get<bool>();
}

std::vector<int32_t> token_list(const json& v, const char* name, const ModelLimits& limits) {
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (const auto& t : v) {
    if (!t.is_number_integer() && !t.is_number_unsigned())
      fail(name, std::string("'") + name + "' must hold integer token ids");
    const auto id = t.get<int64_t>();
    if (id < 0 || id >= limits.vocab_size)
      fail(name, "token id " + std::to_string(id) + " is outside the vocabulary of " +
                     std::to_string(limits.vocab_size) + " ids");
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

bool is_token_list(const json& v) {
  return v.is_array() && !v.empty() &&
         std::all_of(v.begin(), v.end(), [](const json& t) { return t.is_number(); });
}

// Sampling fields shared by the OpenAI endpoints (with vLLM's extensions) and SGLang's
// sampling_params. `max_tokens_name` differs between the dialects.
SamplingParams sampling_from(const json& body, const char* max_tokens_name, int64_t default_max) {
  SamplingParams p;
  p.temperature = number(body, "temperature", 1.0);
  p.top_p = number(body, "top_p", 1.0);
  p.top_k = integer(body, "top_k", 0);
  p.min_p = number(body, "min_p", 0.0);
  p.repetition_penalty = number(body, "repetition_penalty", 1.0);
  p.presence_penalty = number(body, "presence_penalty", 0.0);
  p.frequency_penalty = number(body, "frequency_penalty", 0.0);
  p.max_tokens = integer(body, max_tokens_name, default_max);
  p.ignore_eos = boolean(body, "ignore_eos", false);
  if (const json* s = field(body, "seed")) {
    if (!s->is_number_integer() && !s->is_number_unsigned())
      fail("seed", "'seed' must be an integer");
    p.seed = static_cast<uint64_t>(s->get<int64_t>());
  }
  if (const json* s = field(body, "stop")) {
    if (s->is_string()) {
      p.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      for (const auto& e : *s) {
        if (!e.is_string()) fail("stop", "'stop' must be a string or a list of strings");
        p.stop.push_back(e.get<std::string>());
      }
    } else {
      fail("stop", "'stop' must be a string or a list of strings");
    }
  }
  if (const json* s = field(body, "stop_token_ids")) {
    if (!s->is_array()) fail("stop_token_ids", "'stop_token_ids' must be a list of token ids");
    for (const auto& e : *s) {
      if (!e.is_number_integer()) fail("stop_token_ids", "'stop_token_ids' must hold integers");
      p.stop_token_ids.push_back(e.get<int32_t>());
    }
  }
  if (const json* b = field(body, "logit_bias"); b && !b->empty())
    fail("logit_bias", "'logit_bias' is not supported");
  try {
    p.validate();
  } catch (const Error& e) {
    fail("", e.what());
  }
  return p;
}

void check_length(const ApiRequest& r, const ModelLimits& limits) {
  for (const auto& ids : r.prompts) {
    if (ids.empty()) fail("prompt", "the prompt is empty");
    const auto total = static_cast<int64_t>(ids.size()) + r.sampling.max_tokens;
    if (total > limits.max_model_len)
      fail("max_tokens", "This model's maximum context length is " +
                             std::to_string(limits.max_model_len) +
                             " tokens. However, you requested " + std::to_string(total) +
                             " tokens (" + std::to_string(ids.size()) + " in the prompt, " +
                             std::to_string(r.sampling.max_tokens) +
                             " in the completion). Please reduce the prompt or max_tokens.");
  }
}

// n > 1: the same prompt several times, each choice with its own seed when one was given.
void expand_n(ApiRequest& r, int64_t n) {
  if (n < 1 || n > 128) fail("n", "'n' must be between 1 and 128");
  r.n = n;
  if (n == 1) return;
  if (r.prompts.size() != 1) fail("n", "'n' > 1 needs a single prompt");
  r.prompts.assign(static_cast<size_t>(n), r.prompts[0]);
  if (!r.prompt_texts.empty()) r.prompt_texts.assign(static_cast<size_t>(n), r.prompt_texts[0]);
}

std::string model_name(const json& body, const ModelLimits& limits) {
  const json* m = field(body, "model");
  if (!m) return limits.model_name;
  if (!m->is_string()) fail("model", "'model' must be a string");
  auto name = m->get<std::string>();
  if (name != limits.model_name)
    throw ApiError{404, "The model `" + name + "` does not exist.", "model", "NotFoundError"};
  return name;
}

uint64_t unsigned_value(const json& v, const char* name) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return uint64_t(v.get<int64_t>());
  if (v.is_string()) {
    const std::string t = v.get<std::string>();
    if (!t.empty() && t.size() <= 20 && std::all_of(t.begin(), t.end(), ::isdigit)) {
      errno = 0;
      char* end = nullptr;
      const unsigned long long x = std::strtoull(t.c_str(), &end, 10);
      if (errno == 0 && *end == 0) return x;
    }
  }
  if (v.is_array())
    fail(name, std::string("'") + name +
                   "' as a list (batched requests) is not supported: send one request per prompt");
  fail(name, std::string("'") + name + "' must be a non-negative integer (or its decimal string)");
}

// Reads the disaggregation fields; a decode leg's prompt_token_ids (sent by our prefill engine)
// replace the prompt, so the decode engine need not template or tokenize again.
void parse_disaggregation(const json& body, ApiRequest& r, const ModelLimits& limits) {
  DisaggregationParams& d = r.disagg;
  if (const json* kv = field(body, "kv_transfer_params")) {
    if (!kv->is_object()) fail("kv_transfer_params", "'kv_transfer_params' must be an object");
    d.remote_decode = boolean(*kv, "do_remote_decode", false);
    d.remote_prefill = boolean(*kv, "do_remote_prefill", false);
    if (d.remote_decode && d.remote_prefill)
      fail("kv_transfer_params",
           "'kv_transfer_params' cannot ask for both do_remote_decode and do_remote_prefill");
    if (d.remote_prefill) {
      auto text = [&](const char* name) {
        const json* v = field(*kv, name);
        if (!v || !v->is_string())
          fail("kv_transfer_params", std::string("kv_transfer_params.") + name +
                                         " must be a string (the prefill engine's answer)");
        return v->get<std::string>();
      };
      d.remote_host = text("remote_host");
      d.remote_engine_id = text("remote_engine_id");
      d.remote_request_id = text("remote_request_id");
      const json* port = field(*kv, "remote_port");
      if (!port || !port->is_number_integer() || port->get<int64_t>() < 1 ||
          port->get<int64_t>() > 65535)
        fail("kv_transfer_params", "kv_transfer_params.remote_port must be a port number");
      d.remote_port = port->get<int64_t>();
      const json* blocks = field(*kv, "remote_block_ids");
      if (!blocks || !blocks->is_array() ||
          !std::all_of(blocks->begin(), blocks->end(),
                       [](const json& b) { return b.is_number_integer(); }))
        fail("kv_transfer_params", "kv_transfer_params.remote_block_ids must be a list of ints");
      for (const auto& b : *blocks) {
        const int64_t v = b.get<int64_t>();
        if (v < 0 || v > INT32_MAX)
          fail("kv_transfer_params", "kv_transfer_params.remote_block_ids holds an invalid id");
        d.remote_block_ids.push_back(static_cast<int32_t>(v));
      }
      if (const json* ids = field(*kv, "prompt_token_ids")) {
        if (!is_token_list(*ids))
          fail("kv_transfer_params", "kv_transfer_params.prompt_token_ids must be a token list");
        if (r.prompts.size() != 1)
          fail("kv_transfer_params", "kv_transfer_params needs a request with one prompt");
        r.prompts[0] = token_list(*ids, "kv_transfer_params", limits);
      }
    }
  }
  const json* room = field(body, "bootstrap_room");
  if (room) {
    d.has_bootstrap = true;
    d.bootstrap_room = unsigned_value(*room, "bootstrap_room");
    if (const json* host = field(body, "bootstrap_host")) {
      if (!host->is_string()) fail("bootstrap_host", "'bootstrap_host' must be a string");
      d.bootstrap_host = host->get<std::string>();
    }
    if (const json* port = field(body, "bootstrap_port")) {
      const uint64_t p = unsigned_value(*port, "bootstrap_port");
      if (p < 1 || p > 65535) fail("bootstrap_port", "'bootstrap_port' must be a port number");
      d.bootstrap_port = static_cast<int64_t>(p);
    }
  }
  if ((d.remote_decode || d.remote_prefill || d.has_bootstrap) && r.prompts.size() != 1)
    fail(d.has_bootstrap ? "bootstrap_room" : "kv_transfer_params",
         "disaggregated requests carry one prompt and n = 1: send one request per prompt");
}

std::string token_text(const text::Tokenizer& tok, int32_t id) {
  return utf8::to_valid_lossy(tok.token_bytes(id));
}

}  // namespace

ApiRequest parse_completion(const json& body, const text::Tokenizer& tokenizer,
                            const ModelLimits& limits) {
  if (!body.is_object()) fail("", "the request body must be a JSON object");
  ApiRequest r;
  r.kind = ApiKind::kCompletion;
  r.model = model_name(body, limits);
  const json* prompt = field(body, "prompt");
  if (!prompt) fail("prompt", "'prompt' is required");
  r.echo = boolean(body, "echo", false);
  // prompt_texts stays aligned with prompts: the text as given, or the ids decoded (for echo).
  auto add_text = [&](const std::string& s) {
    r.prompts.push_back(tokenizer.encode(s, true));
    r.prompt_texts.push_back(s);
  };
  auto add_ids = [&](const json& ids) {
    r.prompts.push_back(token_list(ids, "prompt", limits));
    r.prompt_texts.push_back(r.echo ? tokenizer.decode(r.prompts.back(), false) : std::string());
  };
  const char* kPromptForms =
      "'prompt' must be a string, a list of strings, a list of token ids or a list of lists of "
      "token ids";
  if (prompt->is_string()) {
    add_text(prompt->get<std::string>());
  } else if (is_token_list(*prompt)) {
    add_ids(*prompt);
  } else if (prompt->is_array() && !prompt->empty()) {
    for (const auto& p : *prompt) {
      if (p.is_string())
        add_text(p.get<std::string>());
      else if (is_token_list(p))
        add_ids(p);
      else
        fail("prompt", kPromptForms);
    }
  } else {
    fail("prompt", kPromptForms);
  }
  if (const json* s = field(body, "suffix"); s) fail("suffix", "'suffix' is not supported");
  r.sampling = sampling_from(body, "max_tokens", 16);
  r.stream = boolean(body, "stream", false);
  if (const json* so = field(body, "stream_options"))
    r.include_usage = so->is_object() && boolean(*so, "include_usage", false);
  if (const json* lp = field(body, "logprobs")) {
    if (!lp->is_number_integer() || lp->get<int64_t>() < 0 || lp->get<int64_t>() > 20)
      fail("logprobs", "'logprobs' must be an integer between 0 and 20");
    r.logprobs = lp->get<int32_t>();
  }
  r.priority = integer(body, "priority", 0);
  expand_n(r, integer(body, "n", 1));
  parse_disaggregation(body, r, limits);
  check_length(r, limits);
  return r;
}

ApiRequest parse_chat(const json& body, const text::Tokenizer& tokenizer,
                      const text::ChatTemplate* chat_template, const ModelLimits& limits) {
  if (!body.is_object()) fail("", "the request body must be a JSON object");
  ApiRequest r;
  r.kind = ApiKind::kChat;
  r.model = model_name(body, limits);
  const json* messages = field(body, "messages");
  if (!messages || !messages->is_array() || messages->empty())
    fail("messages", "'messages' must be a non-empty list");
  if (!chat_template) fail("messages", "the model has no chat template; use /v1/completions");
  // Templates expect string contents; text parts are joined, other parts are not supported.
  nlohmann::ordered_json msgs = nlohmann::ordered_json::array();
  for (const auto& m : *messages) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      fail("messages", "every message needs a string 'role'");
    nlohmann::ordered_json out = nlohmann::ordered_json::parse(m.dump());
    if (const json* c = field(m, "content"); c && c->is_array()) {
      std::string joined;
      for (const auto& part : *c) {
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
            !part["text"].is_string())
          fail("messages", "only text content parts are supported");
        joined += part["text"].get<std::string>();
      }
      out["content"] = joined;
    } else if (c && !c->is_string()) {
      fail("messages", "message content must be a string or a list of text parts");
    }
    msgs.push_back(std::move(out));
  }
  nlohmann::ordered_json ctx = {
      {"messages", msgs},
      {"add_generation_prompt", boolean(body, "add_generation_prompt", true)},
      {"bos_token", tokenizer.bos_token()},
      {"eos_token", tokenizer.eos_token()}};
  if (const json* tools = field(body, "tools"))
    ctx["tools"] = nlohmann::ordered_json::parse(tools->dump());
  if (const json* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) fail("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    for (auto it = kw->begin(); it != kw->end(); ++it)
      ctx[it.key()] = nlohmann::ordered_json::parse(it.value().dump());
  }
  std::string rendered;
  try {
    rendered = chat_template->render(ctx);
  } catch (const Error& e) {
    fail("messages", e.what());
  }
  r.prompts.push_back(tokenizer.encode(rendered, false));
  const int64_t prompt_len = static_cast<int64_t>(r.prompts[0].size());
  const int64_t room = std::max<int64_t>(1, limits.max_model_len - prompt_len);
  const char* max_name =
      field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  r.sampling = sampling_from(body, max_name, room);
  r.stream = boolean(body, "stream", false);
  if (const json* so = field(body, "stream_options"))
    r.include_usage = so->is_object() && boolean(*so, "include_usage", false);
  if (boolean(body, "logprobs", false)) {
    const int64_t top = integer(body, "top_logprobs", 0);
    if (top < 0 || top > 20) fail("top_logprobs", "'top_logprobs' must be between 0 and 20");
    r.logprobs = static_cast<int32_t>(top);
  }
  r.priority = integer(body, "priority", 0);
  expand_n(r, integer(body, "n", 1));
  parse_disaggregation(body, r, limits);
  check_length(r, limits);
  return r;
}

ApiRequest parse_generate(const json& body, const text::Tokenizer& tokenizer,
                          const ModelLimits& limits) {
  if (!body.is_object()) fail("", "the request body must be a JSON object");
  ApiRequest r;
  r.kind = ApiKind::kGenerate;
  r.model = limits.model_name;
  const json* ids = field(body, "input_ids");
  const json* text = field(body, "text");
  if ((ids != nullptr) == (text != nullptr))
    fail("input_ids", "exactly one of 'input_ids' and 'text' is required");
  if (ids) {
    if (is_token_list(*ids)) {
      r.prompts.push_back(token_list(*ids, "input_ids", limits));
    } else if (ids->is_array() && !ids->empty() &&
               std::all_of(ids->begin(), ids->end(),
                           [](const json& p) { return is_token_list(p); })) {
      for (const auto& p : *ids) r.prompts.push_back(token_list(p, "input_ids", limits));
    } else {
      fail("input_ids", "'input_ids' must be a non-empty list of token ids or of such lists");
    }
  } else if (text->is_string()) {
    r.prompts.push_back(tokenizer.encode(text->get<std::string>(), true));
  } else if (text->is_array() && !text->empty()) {
    for (const auto& t : *text) {
      if (!t.is_string()) fail("text", "'text' must be a string or a list of strings");
      r.prompts.push_back(tokenizer.encode(t.get<std::string>(), true));
    }
  } else {
    fail("text", "'text' must be a string or a list of strings");
  }
  const json* sp = field(body, "sampling_params");
  if (sp && !sp->is_object()) fail("sampling_params", "'sampling_params' must be an object");
  static const json empty = json::object();
  // SGLang's default for max_new_tokens is 128.
  r.sampling = sampling_from(sp ? *sp : empty, "max_new_tokens", 128);
  r.stream = boolean(body, "stream", false);
  if (boolean(body, "return_logprob", false))
    r.logprobs = static_cast<int32_t>(integer(body, "top_logprobs_num", 0));
  if (const json* rid = field(body, "rid")) {
    if (!rid->is_string()) fail("rid", "'rid' must be a string");
    r.request_id = rid->get<std::string>();
  }
  parse_disaggregation(body, r, limits);
  check_length(r, limits);
  return r;
}

ResponseBuilder::ResponseBuilder(const ApiRequest& request, const text::Tokenizer& tokenizer,
                                 std::string id, int64_t created)
    : request_(request),
      tokenizer_(tokenizer),
      id_(std::move(id)),
      created_(created),
      choices_(request.prompts.size()) {}

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
  // n > 1 repeats one prompt: count it once, as OpenAI does.
  prompt /= request_.n;
  cached /= request_.n;
  json u = {{"prompt_tokens", prompt},
            {"completion_tokens", completion},
            {"total_tokens", prompt + completion}};
  u["prompt_tokens_details"] = cached > 0 ? json{{"cached_tokens", cached}} : json(nullptr);
  return u;
}

json ResponseBuilder::completion_logprobs(const Choice& c, size_t first, size_t text_offset) const {
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  size_t offset = text_offset;
  for (size_t i = first; i < c.logprobs.size(); ++i) {
    const auto& lp = c.logprobs[i];
    const std::string t = token_text(tokenizer_, lp.token);
    tokens.push_back(t);
    lps.push_back(lp.logprob);
    offsets.push_back(offset);
    offset += t.size();
    json top = json::object();
    for (const auto& [id, v] : lp.top) top[token_text(tokenizer_, id)] = v;
    tops.push_back(request_.logprobs > 0 ? top : json(nullptr));
  }
  return {{"tokens", tokens},
          {"token_logprobs", lps},
          {"top_logprobs", tops},
          {"text_offset", offsets}};
}

json ResponseBuilder::chat_logprobs(const Choice& c, size_t first) const {
  auto entry = [&](int32_t id, float v) {
    const std::string raw = tokenizer_.token_bytes(id);
    json bytes = json::array();
    for (unsigned char b : raw) bytes.push_back(static_cast<int>(b));
    return json{{"token", utf8::to_valid_lossy(raw)}, {"logprob", v}, {"bytes", bytes}};
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
  }
  return {{"text", c.text}, {"output_ids", c.tokens}, {"meta_info", meta}};
}

std::vector<json> ResponseBuilder::on_output(size_t index, const RequestOutput& out) {
  Choice& c = choices_.at(index);
  const size_t first_lp = c.logprobs.size();
  const size_t text_before = c.text.size();
  c.text += out.text;
  c.tokens.insert(c.tokens.end(), out.tokens.begin(), out.tokens.end());
  c.logprobs.insert(c.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
  c.prompt_tokens = out.prompt_tokens;
  c.completion_tokens = out.completion_tokens;
  c.cached_tokens = out.cached_tokens;
  if (out.finished) {
    c.finished = true;
    c.finish_reason = out.finish_reason;
  }
  std::vector<json> chunks;
  if (!request_.stream) return chunks;
  const json finish = c.finished ? json(c.finish_reason) : json(nullptr);
  switch (request_.kind) {
    case ApiKind::kCompletion: {
      std::string piece = out.text;
      size_t offset = text_before;
      if (request_.echo && !c.started) {
        piece = request_.prompt_texts[index] + piece;
      } else if (request_.echo) {
        offset += request_.prompt_texts[index].size();
      }
      c.started = true;
      if (piece.empty() && !out.finished) break;
      json choice = {{"index", index}, {"text", piece}, {"finish_reason", finish}};
      choice["logprobs"] =
          request_.logprobs >= 0 ? completion_logprobs(c, first_lp, offset) : json(nullptr);
      chunks.push_back({{"id", id_},
                        {"object", "text_completion"},
                        {"created", created_},
                        {"model", request_.model},
                        {"choices", json::array({choice})}});
      break;
    }
    case ApiKind::kChat: {
      auto chunk = [&](json delta, json fin, json logprobs) {
        json choice = {
            {"index", index}, {"delta", delta}, {"logprobs", logprobs}, {"finish_reason", fin}};
        return json{{"id", id_},
                    {"object", "chat.completion.chunk"},
                    {"created", created_},
                    {"model", request_.model},
                    {"choices", json::array({choice})}};
      };
      if (!c.started) {
        chunks.push_back(chunk({{"role", "assistant"}, {"content", ""}}, nullptr, nullptr));
        c.started = true;
      }
      const json lp = request_.logprobs >= 0 ? chat_logprobs(c, first_lp) : json(nullptr);
      if (!out.text.empty() || (request_.logprobs >= 0 && first_lp < c.logprobs.size()))
        chunks.push_back(chunk({{"content", out.text}}, nullptr, lp));
      if (out.finished) chunks.push_back(chunk(json::object(), finish, nullptr));
      break;
    }
    case ApiKind::kGenerate:
      // SGLang streams the whole text and ids so far in every chunk.
      chunks.push_back(generate_body(index));
      if (choices_.size() > 1) chunks.back()["index"] = index;
      break;
  }
  return chunks;
}

std::optional<json> ResponseBuilder::usage_chunk() const {
  if (!request_.stream || !request_.include_usage || request_.kind == ApiKind::kGenerate)
    return std::nullopt;
  const char* object =
      request_.kind == ApiKind::kChat ? "chat.completion.chunk" : "text_completion";
  return json{{"id", id_},
              {"object", object},
              {"created", created_},
              {"model", request_.model},
              {"choices", json::array()},
              {"usage", usage()}};
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
      const std::string prefix = request_.echo ? request_.prompt_texts[i] : std::string();
      json choice = {{"index", i}, {"text", prefix + c.text}, {"finish_reason", c.finish_reason}};
      choice["logprobs"] =
          request_.logprobs >= 0 ? completion_logprobs(c, 0, prefix.size()) : json(nullptr);
      choices.push_back(choice);
    } else {
      json choice = {{"index", i},
                     {"message", {{"role", "assistant"}, {"content", c.text}}},
                     {"finish_reason", c.finish_reason}};
      choice["logprobs"] = request_.logprobs >= 0 ? chat_logprobs(c, 0) : json(nullptr);
      choices.push_back(choice);
    }
  }
  return {{"id", id_},
          {"object", request_.kind == ApiKind::kChat ? "chat.completion" : "text_completion"},
          {"created", created_},
          {"model", request_.model},
          {"choices", choices},
          {"usage", usage()}};
}

}  // namespace tandem::engine::api
