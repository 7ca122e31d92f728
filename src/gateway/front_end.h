#pragma once
// The gateway's client side, on the HTTP server's io threads: the OpenAI routes (/v1/completions,
// /v1/chat/completions, /v1/models), /health and /metrics, API keys, and everything done to a
// request before the scheduler sees it: its id, its JSON checked, its prompt tokenized (with a
// model folder) and the bodies of its legs built once (api/disaggregation.h). The client's errors
// are answered here; the rest goes to the dispatcher.
#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "gateway/dispatcher.h"
#include "gateway/request.h"
#include "gateway/seams.h"
#include "gateway/tokens_in.h"
#include "gateway/topology.h"
#include "net/http_server.h"
#include "util/metrics.h"

namespace tandem::gateway {

// Whether the request may use the API (api::api_key_valid with the topology's keys), answering
// 401 if not.
bool api_key_accepted(const Topology& topo, const net::HttpRequest& req, net::Exchange& ex);
// Whether the request may use the admin API; answers 404 (admin off) or 401 if not.
bool admin_key_accepted(const Topology& topo, const net::HttpRequest& req, net::Exchange& ex);

class FrontEnd {
 public:
  // `tokenizer` may be null (no model folder configured).
  FrontEnd(const Topology& topology, Executor& executor, Upstream& upstream, Dispatcher& dispatcher,
           const EndpointTable& endpoints, metrics::Registry& registry,
           const PromptTokenizer* tokenizer);

  void add_routes(net::HttpServer& server);
  // New requests, and /health, get 503 from now on.
  void stop() { stopping_ = true; }

  // The request the client sent, prepared for the dispatcher; null when it was answered here
  // (a missing API key or another error of the client's, recorded; or the gateway stopping).
  // `same_prompt`: shared by the choices of one prompt (they differ in their seed only), which
  // is then tokenized once, by the first of them.
  struct SamePrompt {
    bool tokenized = false;
    std::optional<TokensIn> tokens;  // what the first choice's tokenization gave
  };
  // `body` is the client's body (req.body is not read): taken from the server's exchange, it is
  // moved into the request where it is sent as it came, and freed here otherwise, so a waiting
  // request never holds it beside the bodies of its legs.
  RequestPtr prepare(const net::HttpRequest& req, std::string body,
                     std::shared_ptr<ClientReply> reply, SamePrompt* same_prompt = nullptr);
  // For callers that keep their request (the simulator, tests): prepares a copy of its body.
  RequestPtr prepare(const net::HttpRequest& req, std::shared_ptr<ClientReply> reply) {
    return prepare(req, req.body, std::move(reply));
  }

 private:
  // Takes the body from `ex` (req is ex's request, its body empty from then on).
  void receive(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex);
  // Submits a prepared request (null: it was answered) and cancels it if the client goes.
  void start(const RequestPtr& r);
  // P/D modes: a request for several choices, as one request per choice whose answers are
  // merged (choice_fan_out.h); false when it is not one, for prepare() to answer as any.
  // `body` is freed once split into the choices' bodies.
  bool receive_choices(const net::HttpRequest& req, std::string& body,
                       const std::shared_ptr<ClientReply>& reply);
  RequestPtr new_request(const net::HttpRequest& req, std::shared_ptr<ClientReply> reply) const;
  // `call` (method, target, body, timeouts) to an engine that is up, however busy
  // (Dispatcher::models_endpoint), with the client's Authorization, its answer relayed to `ex`;
  // 503 when there is none.
  void relay_to_an_engine(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex,
                          net::AsyncHttpRequest call);

  const Topology& topo_;
  Executor& exec_;
  Upstream& upstream_;
  Dispatcher& dispatcher_;
  const EndpointTable& endpoints_;
  metrics::Registry& registry_;
  const PromptTokenizer* tokenizer_;
  std::atomic<bool> stopping_{false};
};

}  // namespace tandem::gateway
