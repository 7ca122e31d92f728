#include "gateway/front_end.h"

#include <algorithm>
#include <span>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/api_key.h"
#include "api/block_hash.h"
#include "api/body_fields.h"
#include "api/disaggregation.h"
#include "api/error.h"
#include "api/model_list.h"
#include "api/request.h"
#include "api/response.h"
#include "gateway/answer_text.h"
#include "gateway/choice_fan_out.h"
#include "gateway/http_seams.h"
#include "gateway/priority.h"
#include "util/error.h"
#include "util/json.h"
#include "util/random_id.h"
#include "util/secret.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;

// Prompt blocks the gateway hashes its ids in (api/block_hash.h): the policies' prompt identity
// (tandem's miss spreading). The prefix index learns each engine's own block size from its events.
constexpr int64_t kPrefixBlockTokens = 16;

using api::kInvalidApiKey;

// Seconds a client refused by a stopping gateway is told to wait: a restart, or the other
// replicas behind a load balancer, take new requests within about that.
constexpr int kShutdownRetryAfterSeconds = 2;

// The stopping gateway's 503. With `Connection: close`, as nginx on a graceful stop: a keep-alive
// client (or a load balancer's pooled connection) reconnects, to another instance, instead of
// meeting this one again on the same connection until it exits (up to its shutdown timeout).
net::HttpResponse shutting_down_answer() {
  net::HttpResponse r =
      api::openai_error_response(503, std::string(kShuttingDown), "server_error", "");
  r.headers.set("Retry-After", std::to_string(kShutdownRetryAfterSeconds));
  r.headers.set("Connection", "close");
  return r;
}

}  // namespace

bool api_key_accepted(const Topology& topo, const net::HttpRequest& req, net::Exchange& ex) {
  if (api::api_key_valid(topo.api_keys, req)) return true;
  ex.send_error(401, kInvalidApiKey, "invalid_request_error", "invalid_api_key");
  return false;
}

bool admin_key_accepted(const Topology& topo, const net::HttpRequest& req, net::Exchange& ex) {
  if (topo.admin_api_key.empty()) {
    ex.send_error(404, "the admin API is off (set admin_api_key)");
    return false;
  }
  if (secrets_equal(api::bearer_token(req), topo.admin_api_key)) return true;
  ex.send_error(401, "invalid or missing admin API key", "invalid_request_error",
                "invalid_api_key");
  return false;
}

FrontEnd::FrontEnd(const Topology& topology, Executor& executor, Upstream& upstream,
                   Dispatcher& dispatcher, const EndpointTable& endpoints,
                   metrics::Registry& registry, const PromptTokenizer* tokenizer)
    : topo_(topology),
      exec_(executor),
      upstream_(upstream),
      dispatcher_(dispatcher),
      endpoints_(endpoints),
      registry_(registry),
      tokenizer_(tokenizer) {}

void FrontEnd::add_routes(net::HttpServer& server) {
  server.route("GET", "/health", [this](const net::HttpRequest&, auto ex) {
    // A stopping gateway takes no new request: load balancers that probe it stop sending.
    if (stopping_.load())
      ex->respond(shutting_down_answer());
    else if (endpoints_.ready())
      ex->respond(200, "", "text/plain");
    else
      ex->send_error(503, "no eligible engine", "server_error");
  });
  server.route("GET", "/metrics", [this](const net::HttpRequest& req, auto ex) {
    const std::span<const std::string> key(&topo_.metrics_api_key,
                                           topo_.metrics_api_key.empty() ? 0 : 1);
    if (!api::api_key_valid(key, req)) {
      ex->send_error(401, "invalid or missing metrics API key", "invalid_request_error",
                     "invalid_api_key");
      return;
    }
    ex->respond(200, registry_.render(), std::string(metrics::Registry::kContentType));
  });
  server.route("GET", "/v1/models", [this](const net::HttpRequest& req, auto ex) {
    if (!api_key_accepted(topo_, req, *ex)) return;
    if (!topo_.served_model_name.empty()) {
      // With the engines' longest sequence once one said it (clients size requests by it).
      ex->respond(200, api::model_list_json({topo_.served_model_name, exec_.unix_ms() / 1000,
                                             endpoints_.max_model_len()}));
      return;
    }
    net::AsyncHttpRequest u;
    u.target = "/v1/models";
    u.timeout = topo_.timeouts.connect;
    relay_to_an_engine(req, std::move(ex), std::move(u));
  });
  // The openai client's models.retrieve: the model object of the list, or model_not_found for
  // another id (api::retrieved_model_id reads it).
  server.route_prefix("GET", "/v1/models/", [this](const net::HttpRequest& req, auto ex) {
    if (!api_key_accepted(topo_, req, *ex)) return;
    // A path with a dot segment is not relayed, where the engine (or a proxy before it) would
    // resolve /v1/models/../x into another route: the path as sent, whose %2F separates no
    // segments (`--model ./Qwen3-8B` is retrieved as .%2FQwen3-8B, one segment, relayed as it is).
    // Nor one whose id, decoded, has a ".." segment (api::has_parent_segment says why). A
    // served_model_name is answered here, whatever it is.
    if (!topo_.served_model_name.empty() || api::has_dot_segment(req.path) ||
        api::has_parent_segment(api::retrieved_model_id(req.path))) {
      ex->respond(api::model_retrieval(
          req.path, {topo_.served_model_name, exec_.unix_ms() / 1000, endpoints_.max_model_len()}));
      return;
    }
    net::AsyncHttpRequest u;
    u.target = req.path;
    u.timeout = topo_.timeouts.connect;
    relay_to_an_engine(req, std::move(ex), std::move(u));
  });
  // vLLM's /tokenize and /detokenize: an engine answers them with its own tokenizer and template,
  // the ones its generation requests run on.
  for (const char* path : {"/tokenize", "/detokenize"})
    server.route("POST", path, [this, path](const net::HttpRequest& req, auto ex) {
      if (!api_key_accepted(topo_, req, *ex)) return;
      net::AsyncHttpRequest u;
      u.method = "POST";
      u.target = path;
      u.body = ex->take_body();
      u.headers.set("Content-Type", "application/json");
      u.connect_timeout = topo_.timeouts.connect;
      u.timeout = topo_.timeouts.prefill;  // a long chat is rendered and tokenized
      relay_to_an_engine(req, std::move(ex), std::move(u));
    });
  auto generation = [this](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
    receive(req, std::move(ex));
  };
  server.route("POST", "/v1/completions", generation);
  server.route("POST", "/v1/chat/completions", generation);
}

void FrontEnd::receive(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
  // Taken, not copied: the exchange lives as long as the request, which may wait in the queue
  // for long, and a copy would hold the body (up to max_body_bytes) twice all that time.
  std::string body = ex->take_body();
  auto reply = std::make_shared<net::ExchangeReply>(std::move(ex));
  if (topo_.mode != PdMode::kAggregated && may_ask_several_choices(body) &&
      receive_choices(req, body, reply))
    return;
  // Apart from start(): the argument's copy of the body (freed by the caller at the end of the
  // full expression) must not outlive the handing on of the request, which may wait long.
  const RequestPtr r = prepare(req, std::move(body), std::move(reply));
  start(r);
}

void FrontEnd::start(const RequestPtr& r) {
  if (!r) return;
  r->reply->on_close([this, r] { dispatcher_.client_gone(r); });
  exec_.post_batched([this, r] { dispatcher_.submit(r); });
}

bool FrontEnd::receive_choices(const net::HttpRequest& req, std::string& body,
                               const std::shared_ptr<ClientReply>& reply) {
  if (stopping_.load() || !api::api_key_valid(topo_.api_keys, req)) return false;
  ChoiceRequests split;
  try {
    split = split_choices(req.path, parse_untrusted_json(body), body);
  } catch (const api::ApiError& e) {
    const RequestPtr r = new_request(req, reply);
    r->reply->respond(e.status, api::api_error_body(e), "application/json");
    dispatcher_.end_request(r, {e.status, e.message});
    return true;
  } catch (const std::exception&) {
    return false;  // not JSON: answered as any request
  }
  if (split.bodies.empty()) return false;
  std::exchange(body, std::string());  // freed (clear() would keep its buffer): split from now on
  const auto merger = ChoiceMerger::create(reply, split.bodies.size(), split.repeats);
  std::string id = req.headers.get("X-Request-Id");
  // Room for the choice's "-i" within the 256 bytes a request id may have.
  if (!api::usable_request_id(id) || id.size() > 250) id = random_hex(2);
  net::HttpRequest one = req;  // its request id is each choice's (the body: taken, empty)
  // A choice refused here (a bad field) answers for all: none is submitted, and those prepared
  // before it end with its failure (their close callbacks run when registered).
  std::vector<RequestPtr> choices;
  // The n choices of each prompt (in a row): tokenized once.
  std::vector<SamePrompt> same_prompt(split.bodies.size() / split.repeats);
  for (size_t i = 0; i < split.bodies.size() && !merger->ended(); ++i) {
    one.headers.set("X-Request-Id", id + "-" + std::to_string(i));
    SamePrompt* same = split.repeats > 1 ? &same_prompt[i / split.repeats] : nullptr;
    if (RequestPtr r = prepare(one, std::move(split.bodies[i]), merger->reply(i), same))
      choices.push_back(std::move(r));
  }
  // A choice let go because another failed ends with that failure, not as a client that left.
  for (const RequestPtr& r : choices)
    r->reply->on_close([this, r, weak = std::weak_ptr<ChoiceMerger>(merger)] {
      const auto m = weak.lock();
      const auto failure = m ? m->failure() : std::nullopt;
      if (failure)
        dispatcher_.end_request(r, {failure->status, "choice " + std::to_string(failure->choice) +
                                                         " of the request failed"});
      else
        dispatcher_.client_gone(r);
    });
  if (!merger->ended())
    exec_.post_batched([this, choices = std::move(choices)] { dispatcher_.submit(choices); });
  return true;
}

RequestPtr FrontEnd::new_request(const net::HttpRequest& req,
                                 std::shared_ptr<ClientReply> reply) const {
  auto r = std::make_shared<Request>();
  r->times.mark(Phase::kReceived, exec_.now_ns());
  r->received_unix_ms = exec_.unix_ms();
  r->method = req.method;
  r->path = req.path;
  r->target = req.target;
  set_client(*r, req, std::move(reply));  // its address, and a reply that counts body bytes
  r->id = req.headers.get("X-Request-Id");
  if (!api::usable_request_id(r->id)) r->id = random_hex(2);
  r->headers.set("X-Request-Id", r->id);
  if (const auto* auth = req.headers.find("Authorization")) r->headers.set("Authorization", *auth);
  return r;
}

RequestPtr FrontEnd::prepare(const net::HttpRequest& req, std::string client_body,
                             std::shared_ptr<ClientReply> reply, SamePrompt* same_prompt) {
  const RequestPtr r = new_request(req, std::move(reply));
  // The client's error: answered here, and recorded (`logged`: the access log's error, if not
  // the message).
  auto ended = [&](int status, std::string logged) {
    dispatcher_.end_request(r, {status, std::move(logged)});
    return nullptr;
  };
  auto refuse = [&](int status, const std::string& message, std::string_view type = {},
                    std::string_view code = {}, std::string logged = {}) {
    r->reply->send_error(status, message, type, code);
    return ended(status, logged.empty() ? message : std::move(logged));
  };
  // Counted and logged as any refusal: an operator sees what a stop turned away.
  if (stopping_.load()) {
    r->reply->respond_with_headers(shutting_down_answer());
    return ended(503, std::string(kShuttingDown));
  }
  if (!api::api_key_valid(topo_.api_keys, req))
    return refuse(401, kInvalidApiKey, "invalid_request_error", "invalid_api_key", "unauthorized");

  r->times.mark(Phase::kTokenizing, exec_.now_ns());
  const bool classes = topo_.priority.enabled();
  // The gateway sets `priority` for deadlines: a client's is dropped (found without parsing, so
  // that an aggregated gateway without a tokenizer still relays other bodies verbatim).
  const bool drop_priority =
      dispatcher_.sets_prefill_deadlines() && client_body.find("\"priority\"") != std::string::npos;
  const bool needs_json =
      topo_.mode != PdMode::kAggregated || tokenizer_ || classes || drop_priority;
  json body;
  const ReleaseJsonOnExit release_body{body};  // a prompt's ids, freed cheaply
  if (needs_json) {
    try {
      body = parse_untrusted_json(client_body);
      if (!body.is_object()) throw Error("the request body must be a JSON object");
    } catch (const std::exception& e) {
      return refuse(400, std::string("invalid JSON body: ") + e.what());
    }
    // As the engine reads it (vLLM's Optional[bool]): null is absent, another type a 400
    // naming the field.
    try {
      r->stream = api::boolean(body, "stream", false);
    } catch (const api::ApiError& e) {
      r->reply->respond(e.status, api::api_error_body(e), "application/json");
      return ended(e.status, e.message);
    }
    if (auto m = body.find("model"); m != body.end() && m->is_string()) r->model = *m;
  }
  if (classes) {
    // The engines schedule by the class's priority, whatever the client asked.
    const auto p = body.find("priority");
    try {
      r->priority_class = static_cast<int>(request_class(
          topo_.priority, p == body.end() ? json(nullptr) : *p, api::bearer_token(req)));
    } catch (const api::ApiError& e) {
      r->reply->respond(e.status, api::api_error_body(e), "application/json");
      return ended(e.status, e.message);
    }
    body["priority"] = topo_.priority.classes[static_cast<size_t>(r->priority_class)].priority;
  }
  if (drop_priority) body.erase("priority");  // the dispatcher adds the policy's deadline
  // Without a tokenizer the prompt's length is estimated from the body's size (about four
  // bytes per token in English text).
  r->prompt_tokens = static_cast<int64_t>(client_body.size() / 4);
  bool rewritten = false;
  if (tokenizer_) {
    try {
      std::optional<TokensIn> tokenized;
      if (same_prompt && same_prompt->tokenized) {
        tokenized = same_prompt->tokens;
      } else {
        tokenized = tokenizer_->tokenize(req.path, body, endpoints_.max_model_len(), client_body);
        if (same_prompt) *same_prompt = {true, tokenized};
      }
      if (auto& t = tokenized) {
        const Pool& first = topo_.mode == PdMode::kAggregated ? topo_.decode : topo_.prefill;
        r->prompt_tokens = static_cast<int64_t>(t->ids.size()) * t->n;
        r->tokens_known = true;
        r->times.mark(Phase::kPrefixMatching, exec_.now_ns());
        r->cache_salt = t->cache_salt;
        r->block_hashes = api::block_hashes(t->ids, kPrefixBlockTokens, t->cache_salt);
        r->prompt_ids = t->ids;
        if (first.tokens_in && topo_.decode.tokens_in) {
          r->translator = std::make_unique<ResponseTranslator>(t->client_kind, t->response_role);
          body = tokens_in_body(std::move(body), *t);
          r->target = "/v1/completions";
          rewritten = true;
        }
      }
    } catch (const api::ApiError& e) {
      // The field goes into OpenAI's "param", as the engines answer.
      r->reply->respond(e.status, api::api_error_body(e), "application/json");
      return ended(e.status, e.message);
    } catch (const std::exception& e) {
      return refuse(400, std::string("cannot tokenize the request: ") + e.what());
    }
  }
  r->times.mark(Phase::kPrefixMatching, exec_.now_ns());

  switch (topo_.mode) {
    case PdMode::kAggregated:
      // The engine's usage chunk says what it reused (routing_quality.h): asked for when the
      // client did not, and dropped from what the client gets (only a translated stream can).
      if (rewritten && r->stream && !body.contains("stream_options")) {
        body["stream_options"] = {{"include_usage", true}};
        r->translator->drop_usage_chunks();
      }
      // Else verbatim: the engine parses it.
      r->body = rewritten || classes || drop_priority ? dump_in_client_order(body, client_body)
                                                      : std::move(client_body);
      break;
    case PdMode::kSequential:
      api::strip_disaggregation_fields(body);
      r->body = dump_in_client_order(body, client_body);
      r->prefill_body = dump_in_client_order(api::prefill_leg_body(std::move(body)), client_body);
      break;
    case PdMode::kParallel:
      api::strip_disaggregation_fields(body);
      // The prefill leg's answer goes nowhere but to the gateway, which reads what the engine
      // reused from its usage: a stream has one only when asked (a client's own stream_options
      // stay as they are).
      r->prefill_asks_usage = r->stream && !body.contains("stream_options");
      r->body = dump_in_client_order(body, client_body);
      break;
  }
  return r;
}

// Scheduling thread: a call relayed to one engine that is up (Dispatcher::models_endpoint).
void FrontEnd::relay_to_an_engine(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex,
                                  net::AsyncHttpRequest call) {
  // Only what identifies the caller: no hop-by-hop fields.
  if (const auto* a = req.headers.find("Authorization")) call.headers.set("Authorization", *a);
  exec_.post([this, ex = std::move(ex), call = std::move(call)]() mutable {
    const EndpointState* e = dispatcher_.models_endpoint();
    if (!e) {
      ex->send_error(503, "no healthy engine", "server_error");
      return;
    }
    call.host = e->config.host;
    call.port = e->config.port;
    relay_engine_call(upstream_, std::move(call), e->config.name, std::move(ex));
  });
}

}  // namespace tandem::gateway
