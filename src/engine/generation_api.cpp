#include "engine/generation_api.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <mutex>
#include <string_view>
#include <utility>

#include "api/block_hash.h"
#include "api/disaggregation.h"
#include "api/error.h"
#include "api/response.h"
#include "api/tokenize.h"
#include "net/sse.h"
#include "util/error.h"
#include "util/json.h"
#include "util/random_id.h"

namespace tandem::engine {
namespace {

using api::ApiError;
using api::ApiKind;
using api::ApiRequest;
using api::DisaggregationParams;
using api::ModelLimits;
using api::ResponseBuilder;
using nlohmann::json;

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Invalid UTF-8 in generated text (a token cut mid-character is held back by the detokenizer,
// but a model may emit any bytes) is replaced rather than failing the whole response.
std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}
std::string sse(const json& j) {
  return net::sse_event(dump(j));
}

// One HTTP request in flight: its choices' engine requests and the response being built.
struct Call {
  ApiRequest request;
  std::unique_ptr<ResponseBuilder> builder;
  std::shared_ptr<net::Reply> reply;
  std::vector<std::string> engine_ids;
  std::mutex mutex;
  bool failed = false;
  const KvTransfers* transfer = nullptr;  // for a prefill leg's kv_transfer_params
  Engine* engine = nullptr;

  void on_output(size_t index, const RequestOutput& out) {
    std::lock_guard lock(mutex);
    if (failed) return;
    if (out.finish_reason == "error") {
      fail(out.error_status, "generation failed: " + out.error, out.error_code);
      return;
    }
    // A rendering that throws (a parser's bug on some model output) ends this request with an
    // error: the render thread would only log it, and the client would wait for ever.
    try {
      render(index, out);
    } catch (const std::exception& e) {
      fail(500, std::string("rendering the answer failed: ") + e.what(), {});
    }
  }

  // Ends the reply with an error: the other choices are aborted, since with the reply goes the
  // connection's close callback and they would run to max_tokens for nobody.
  void fail(int status, const std::string& msg, const std::string& code) {
    failed = true;
    for (const auto& id : engine_ids) engine->abort(id);
    const char* type = status < 500 ? "invalid_request_error" : "server_error";
    if (request.stream) {
      reply->write(net::sse_event(api::openai_error_body(msg, type, code)));
      reply->write(net::kSseDone);
      reply->end();
    } else {
      reply->send_error(status, msg, type, code);
    }
  }

  void render(size_t index, const RequestOutput& out) {
    if (!out.kv_transfer_id.empty()) {
      kv_transfer_params = prefill_answer(out);
      kv_transfer_id = out.kv_transfer_id;
    }
    auto chunks = builder->on_output(index, out);
    if (request.stream) {
      for (const auto& c : chunks) reply->write(sse(c));
      if (builder->all_finished()) {
        if (auto usage = builder->usage_chunk()) reply->write(sse(*usage));
        reply->write(net::kSseDone);
        reply->end();
      }
    } else if (builder->all_finished()) {
      json body = builder->final_body();
      if (!kv_transfer_params.is_null()) body["kv_transfer_params"] = kv_transfer_params;
      // A prefill answer its client (the gateway) left before it came names KV nobody will
      // pull or release: freed now, not at --kv-transfer-timeout.
      if (!reply->respond(200, dump(body), "application/json") && !kv_transfer_id.empty())
        engine->release_held_kv(kv_transfer_id);
    }
  }

  // What a decode engine needs to pull this prefill's KV.
  json prefill_answer(const RequestOutput& out) const {
    return api::kv_transfer_params({transfer->config().engine_id, transfer->config().advertise_host,
                                    transfer->port(), out.kv_transfer_id, out.kv_blocks,
                                    request.prompts.at(0), out.prompt_logprobs});
  }
  json kv_transfer_params;
  std::string kv_transfer_id;  // the hold they name
};

// Turns the request's disaggregation fields into the engine's transfer mode for this engine's
// role. Throws ApiError for a leg this role does not serve.
KvTransferSpec transfer_spec(const DisaggregationParams& d, EngineRole role) {
  KvTransferSpec t;
  using Mode = KvTransferSpec::Mode;
  if (d.remote_decode) {
    if (role == EngineRole::kDecode)
      throw ApiError{400,
                     "this engine runs with --role decode: send prefill legs "
                     "(do_remote_decode) to a prefill engine",
                     "kv_transfer_params"};
    t.mode = Mode::kPrefillForPull;
  } else if (d.remote_prefill) {
    if (role == EngineRole::kPrefill)
      throw ApiError{400,
                     "this engine runs with --role prefill: send decode legs "
                     "(do_remote_prefill) to a decode engine",
                     "kv_transfer_params"};
    t.mode = Mode::kDecodeByPull;
    t.host = d.remote_host;
    t.port = static_cast<uint16_t>(d.remote_port);
    t.engine_id = d.remote_engine_id;
    t.transfer_id = d.remote_request_id;
    t.remote_blocks = d.remote_block_ids;
  } else if (d.has_bootstrap && role != EngineRole::kBoth) {
    // SGLang sends the same body to both legs; the engine's role says which leg this is. An
    // engine with both roles serves the request alone.
    t.room = d.bootstrap_room;
    if (role == EngineRole::kPrefill) {
      t.mode = Mode::kPrefillForRoom;
    } else {
      if (d.bootstrap_host.empty() || d.bootstrap_port == 0)
        throw ApiError{400, "a decode leg needs bootstrap_host and bootstrap_port",
                       "bootstrap_host"};
      t.mode = Mode::kDecodeByRoom;
      t.host = d.bootstrap_host;
      t.port = static_cast<uint16_t>(d.bootstrap_port);
    }
  }
  return t;
}

}  // namespace

GenerationApi::GenerationApi(Engine& engine, Post post, NewId new_id, UnixNow unix_now)
    : engine_(engine),
      post_(std::move(post)),
      new_id_(new_id ? std::move(new_id) : NewId([] { return random_hex(2); })),
      unix_now_(unix_now ? std::move(unix_now) : UnixNow(unix_seconds)) {
  if (!engine_.tokenizer().chat_templates().empty())
    chat_template_.emplace(engine_.tokenizer().chat_templates());
}

// A decode leg refused before it could pull or join its room (a bad field, a role mismatch, a
// full engine) would strand the prefill engine's blocks until its timeout: tell the prefill
// engine to let go now. A room is named with its prompt: `prompts`, the request's, or empty when
// the parser refused it.
void GenerationApi::release_refused_decode_leg(ApiKind kind, const net::HttpRequest& req,
                                               const json& body,
                                               const std::vector<std::vector<int32_t>>& prompts,
                                               const std::string& why) {
  if (!body.is_object()) return;
  DisaggregationParams d;
  try {
    // Any token ids will do: only the transfer's name is needed.
    d = api::parse_disaggregation(body, std::numeric_limits<int64_t>::max());
  } catch (const ApiError&) {
    return;  // not enough to name the transfer: the prefill engine's timeout frees it
  }
  if (d.remote_prefill) {
    engine_.release_remote_kv(d.remote_host, static_cast<uint16_t>(d.remote_port),
                              d.remote_engine_id, d.remote_request_id, d.remote_block_ids);
    return;
  }
  // As transfer_spec: a bootstrap leg is a room's decode leg on a decode engine.
  if (d.remote_decode || !d.has_bootstrap || engine_.role() != EngineRole::kDecode ||
      d.bootstrap_host.empty() || d.bootstrap_port == 0)
    return;
  std::vector<std::vector<int32_t>> parsed;
  if (prompts.empty()) {
    // The parser refuses a leg mostly for its length (max_tokens past what this engine allows,
    // where the prefill engine allowed it), which says nothing against its prompt: read without
    // the length limits, the body names the room's prompt. Otherwise the prefill engine's
    // timeout frees the room.
    ModelLimits relaxed = engine_.request_limits();
    relaxed.max_model_len = 0;
    relaxed.max_tokens_limit = 0;
    try {
      switch (kind) {
        case ApiKind::kCompletion:
          parsed = api::parse_completion(body, engine_.tokenizer(), relaxed, req.body).prompts;
          break;
        case ApiKind::kChat:
          parsed = api::parse_chat(body, engine_.tokenizer(),
                                   chat_template_ ? &*chat_template_ : nullptr, relaxed, req.body)
                       .prompts;
          break;
        case ApiKind::kGenerate:
          parsed = api::parse_generate(body, engine_.tokenizer(), relaxed).prompts;
          break;
      }
    } catch (...) {
      return;  // refused for more than its length
    }
  }
  const auto& prompt = prompts.empty() ? parsed : prompts;
  if (prompt.size() != 1) return;  // a batched leg names no one room
  engine_.abandon_remote_room(d.bootstrap_host, static_cast<uint16_t>(d.bootstrap_port),
                              d.bootstrap_room, prompt[0],
                              "the decode request of bootstrap_room " +
                                  std::to_string(d.bootstrap_room) + " was refused: " + why);
}

namespace {

// Answers a request that is worked out at once (no engine step): `answer` reads the body; a bad
// one is the OpenAI error it names.
void answer_at_once(const net::HttpRequest& req, net::Reply& reply,
                    const std::function<json(const json& body)>& answer) {
  try {
    reply.respond(
        200,
        answer(parse_untrusted_json(req.body)).dump(-1, ' ', false, json::error_handler_t::replace),
        "application/json");
  } catch (const ApiError& e) {
    reply.respond(e.status, api::api_error_body(e), "application/json");
  } catch (const Error& e) {
    reply.send_error(400, e.what());
  }
}

}  // namespace

void GenerationApi::tokenize(const net::HttpRequest& req, std::shared_ptr<net::Reply> ex) {
  answer_at_once(req, *ex, [&](const json& body) {
    return api::tokenize_answer(body, engine_.tokenizer(),
                                chat_template_ ? &*chat_template_ : nullptr,
                                engine_.request_limits(), req.body);
  });
}

void GenerationApi::detokenize(const net::HttpRequest& req, std::shared_ptr<net::Reply> ex) {
  answer_at_once(req, *ex, [&](const json& body) {
    return api::detokenize_answer(body, engine_.tokenizer(), engine_.request_limits());
  });
}

void GenerationApi::release_kv(const net::HttpRequest& req, std::shared_ptr<net::Reply> ex) {
  answer_at_once(req, *ex, [&](const json& body) {
    const KvTransfers* transfer = engine_.transfer();
    if (!transfer || !transfer->serving())
      throw ApiError{400,
                     transfer ? "this engine runs with --role decode and holds no KV for decode "
                                "engines: send the release to the prefill engine that answered "
                                "with these kv_transfer_params"
                              : "this engine has no KV transfer (start it with --role prefill "
                                "or both) and holds no KV for decode engines",
                     "kv_transfer_params"};
    if (!body.is_object()) throw ApiError{400, "the body must be a JSON object", ""};
    if (!body.contains("kv_transfer_params"))
      throw ApiError{400,
                     "'kv_transfer_params' is missing: send the object the prefill answer "
                     "carried",
                     "kv_transfer_params"};
    // Any token ids will do: only the transfer's name is read.
    const DisaggregationParams d =
        api::parse_disaggregation(body, std::numeric_limits<int64_t>::max());
    if (!d.remote_prefill)
      throw ApiError{400,
                     "'kv_transfer_params' must be a prefill answer's (do_remote_prefill true)",
                     "kv_transfer_params"};
    // Another engine's transfer (this one restarted since, with a new id) is not held here.
    const bool released = d.remote_engine_id == transfer->config().engine_id &&
                          engine_.release_held_kv(d.remote_request_id);
    return json{{"released", released}};
  });
}

namespace {

// Whether a body's text may name a transfer (release_refused_decode_leg's fields), read without
// parsing it. A key spelled with escapes is missed: the gateway and vLLM's and SGLang's proxies
// write them plain, and such a leg's KV is freed at the prefill engine's timeout.
bool may_name_a_transfer(std::string_view body) {
  return body.find("\"kv_transfer_params\"") != std::string_view::npos ||
         body.find("\"bootstrap_room\"") != std::string_view::npos;
}

}  // namespace

void GenerationApi::refuse(ApiKind kind, const net::HttpRequest& req, net::Reply& reply,
                           const std::string& why) {
  // A refusal comes when the engine can least afford work (it stops, or its client left): the
  // body is parsed only where it may name a transfer that this engine can let go of.
  if (engine_.transfer() && may_name_a_transfer(req.body)) {
    json body;
    const ReleaseJsonOnExit release_body{body};
    try {
      body = parse_untrusted_json(req.body);
    } catch (const Error&) {
      // Not JSON: no transfer to name.
    }
    release_refused_decode_leg(kind, req, body, {}, why);
  }
  reply.send_error(503, why, "server_error");
}

void GenerationApi::handle(ApiKind kind, const net::HttpRequest& req,
                           std::shared_ptr<net::Reply> ex) {
  const ModelLimits limits = engine_.request_limits();
  auto call = std::make_shared<Call>();
  KvTransferSpec kv_transfer;
  int32_t scored_prompt = -1;  // the prompt logprobs the engine computes
  json body;
  const ReleaseJsonOnExit release_body{body};  // a prompt's ids, freed cheaply
  try {
    body = parse_untrusted_json(req.body);
    switch (kind) {
      case ApiKind::kCompletion:
        call->request = api::parse_completion(body, engine_.tokenizer(), limits, req.body);
        break;
      case ApiKind::kChat:
        call->request =
            api::parse_chat(body, engine_.tokenizer(), chat_template_ ? &*chat_template_ : nullptr,
                            limits, req.body);
        break;
      case ApiKind::kGenerate:
        call->request = api::parse_generate(body, engine_.tokenizer(), limits);
        break;
    }
    // As vLLM: a priority means nothing to an engine that serves in arrival order, and taking it
    // silently would let the client believe it counted.
    if (call->request.priority != 0 && !engine_.schedules_by_priority())
      throw ApiError{400,
                     "priority " + std::to_string(call->request.priority) +
                         " was given, but this engine does not schedule by priority (start it "
                         "with --scheduling-policy priority)",
                     "priority"};
    kv_transfer = transfer_spec(call->request.disagg, engine_.role());
    scored_prompt = call->request.scored_prompt();
    if (kv_transfer.prefill()) {
      call->request.sampling.limit_to_prefill_leg();
      // Its body is read for kv_transfer_params alone: a pull leg's prompt logprobs go to the
      // decode engine there; a room leg's would go nowhere (its decode leg computes them).
      call->request.logprobs = -1;
      call->request.prompt_logprobs = -1;
      call->request.logprob_start_len = -1;
      if (kv_transfer.mode == KvTransferSpec::Mode::kPrefillForRoom) scored_prompt = -1;
    }
    // A pull-prefill leg's answer carries kv_transfer_params, which only a whole JSON body has
    // (vLLM's proxy sends these legs with stream false anyway).
    if (kv_transfer.mode == KvTransferSpec::Mode::kPrefillForPull) call->request.stream = false;
  } catch (const ApiError& e) {
    release_refused_decode_leg(kind, req, body, call->request.prompts, e.message);
    ex->respond(e.status, api::api_error_body(e), "application/json");
    return;
  } catch (const Error& e) {
    release_refused_decode_leg(kind, req, body, call->request.prompts, e.what());
    ex->send_error(400, e.what());
    return;
  }
  call->transfer = engine_.transfer();
  call->engine = &engine_;
  // As vLLM: "cmpl-" / "chatcmpl-" before the client's X-Request-Id (the gateway sends its own),
  // or before a random one.
  const std::string prefix(api::response_id_prefix(kind));
  std::string id = req.headers.get("x-request-id");
  if (!api::usable_request_id(id)) id = random_hex(2);
  if (id.rfind(prefix, 0) != 0) id = prefix + id;
  // The grammar the parser compiled goes to the engine requests only (the engine hands it to its
  // cache): the call and its builder live as long as the request and would keep it alive, ~30 MB
  // for a large one, even when the cache has one for the spec.
  std::shared_ptr<const structured::Grammar> compiled;
  if (auto& spec = call->request.sampling.structured_output)
    compiled = std::exchange(spec->compiled, nullptr);
  // As OpenAI and vLLM: when this request came, not when the engine started.
  call->builder =
      std::make_unique<ResponseBuilder>(call->request, engine_.tokenizer(), id, unix_now_());
  call->reply = ex;
  // Engine ids are ours and unique, whatever id the client chose.
  const std::string base = new_id_();
  const auto& prompts = call->request.prompts;
  const size_t count = call->request.choice_count();
  for (size_t i = 0; i < count; ++i) call->engine_ids.push_back(base + "-" + std::to_string(i));
  std::vector<EngineRequest> requests(count);
  // Choices are prompt-major: each run of n is one prompt's, counted together in the metrics.
  const size_t n = call->request.choices_per_prompt();
  std::shared_ptr<ChoiceGroup> choices;
  for (size_t i = 0; i < count; ++i) {
    EngineRequest& er = requests[i];
    if (n > 1) {
      if (i % n == 0) choices = std::make_shared<ChoiceGroup>(static_cast<int64_t>(n));
      er.choices = choices;
    }
    er.id = call->engine_ids[i];
    er.prompt = call->request.choice_prompt(i);
    er.sampling = call->request.sampling;
    if (compiled) er.sampling.structured_output->compiled = compiled;
    // As vLLM: every prompt of a list takes the request's seed, and only a prompt's own choices
    // count up from it, so a seeded prompt answers the same alone or in a list.
    if (er.sampling.seed) er.sampling.seed = *er.sampling.seed + i % n;
    er.priority = call->request.priority;
    if (call->request.cache_salt) er.cache_salt = api::cache_salt_hash(*call->request.cache_salt);
    er.logprobs = call->request.logprobs;
    er.prompt_logprobs = scored_prompt;
    if (er.prompt_logprobs >= 0 && kv_transfer.mode == KvTransferSpec::Mode::kDecodeByPull)
      er.known_prompt_logprobs = call->request.disagg.prompt_logprobs;
    er.kv_transfer = kv_transfer;
    er.on_output = [call, i, post = post_](const RequestOutput& out) {
      post([call, i, out] { call->on_output(i, out); });
    };
  }
  // What the engine refuses for the request itself (too long for its KV cache, say) is a 400,
  // also for a stream: one that started with a 200 and an error event made the gateway take the
  // refusal for an engine failure (a 502, counted towards ejecting the engine).
  try {
    for (const auto& er : requests) engine_.check(er);
  } catch (const Error& e) {
    release_refused_decode_leg(kind, req, body, prompts, e.what());
    ex->send_error(400, e.what());
    return;
  }
  if (call->request.stream) ex->start_stream(200, "text/event-stream");
  for (size_t i = 0; i < requests.size(); ++i) {
    try {
      engine_.submit(std::move(requests[i]));
    } catch (const Error& e) {  // the engine stopping meanwhile
      release_refused_decode_leg(kind, req, body, prompts, e.what());
      for (size_t k = 0; k < i; ++k) engine_.abort(call->engine_ids[k]);
      std::lock_guard lock(call->mutex);
      call->failed = true;
      if (call->request.stream) {
        ex->write(net::sse_event(api::openai_error_body(e.what())));
        ex->write(net::kSseDone);
        ex->end();
      } else {
        ex->send_error(400, e.what());
      }
      return;
    }
  }
  Engine* engine = &engine_;
  ex->on_close([engine, ids = call->engine_ids] {
    for (const auto& id : ids) engine->abort(id);
  });
}

}  // namespace tandem::engine
