// A client's mistake that an engine finds only once generation starts (a mask that leaves no
// token: allowed_token_ids with min_tokens, or with a JSON format) comes as a stream's error event
// of type invalid_request_error, under the stream's 200. It is the client's error as the engine's
// 400 answer is (docs/gateway.md): answered 400 before the client's stream began, and never
// counted against the engine. And a stream's error event is no token event (output_events, ITL).
// On a virtual clock with fake engines and a fake client, as dispatcher_test.cpp (whose harness
// this trims to what these tests need).
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "api/error.h"
#include "gateway/answer_text.h"
#include "gateway/dispatcher.h"
#include "gateway/endpoints.h"
#include "gateway/front_end.h"
#include "gateway/gateway_metrics.h"
#include "gateway/health.h"
#include "gateway/policy.h"
#include "gateway/prefix_index.h"
#include "gateway/virtual_executor.h"
#include "net/sse.h"
#include "util/metrics.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;

// Engines whose calls the test answers. cancel() reports back at once, as the real client may.
class FakeEngines final : public Upstream {
 public:
  struct Call {
    CallId id = 0;
    net::AsyncHttpRequest request;
    net::AsyncHttpHandlers handlers;
    bool done = false, cancelled = false;
  };

  CallId start(net::AsyncHttpRequest request, net::AsyncHttpHandlers handlers) override {
    auto c = std::make_shared<Call>();
    c->id = ++next_;
    c->request = std::move(request);
    c->handlers = std::move(handlers);
    calls_.push_back(c);
    return c->id;
  }
  void cancel(CallId id) override {
    for (auto& c : calls_)
      if (c->id == id && !c->done) {
        c->cancelled = true;
        finish(*c, "cancelled");
      }
  }
  std::vector<std::shared_ptr<Call>> open() const {
    std::vector<std::shared_ptr<Call>> out;
    for (const auto& c : calls_)
      if (!c->done && c->request.target == "/v1/completions") out.push_back(c);
    return out;
  }
  size_t generation_calls() const {
    size_t n = 0;
    for (const auto& c : calls_) n += c->request.target == "/v1/completions";
    return n;
  }

  static void head(Call& c, int status, const std::string& content_type) {
    net::Headers h;
    h.set("Content-Type", content_type);
    if (c.handlers.on_head) c.handlers.on_head(status, h);
  }
  static bool piece(Call& c, const std::string& bytes) {
    return !c.handlers.on_body || c.handlers.on_body(bytes);
  }
  // The engine's stream: `events` (whole SSE text), then the call ends as the real client ends
  // it: "cancelled" when the gateway's on_body cut it, else by itself.
  static void stream(Call& c, const std::string& events) {
    head(c, 200, "text/event-stream");
    finish(c, piece(c, events) ? "" : "cancelled");
  }
  static void finish(Call& c, const std::string& error) {
    if (c.done) return;
    c.done = true;
    if (!error.empty() && c.handlers.on_failure)
      c.handlers.on_failure(error == "cancelled" ? net::CallFailure::kCancelled
                                                 : net::CallFailure::kUnanswered);
    if (c.handlers.on_done) c.handlers.on_done(error);
  }

 private:
  CallId next_ = 0;
  std::vector<std::shared_ptr<Call>> calls_;
};

// A client that records what the gateway sent it.
class FakeClient final : public ClientReply {
 public:
  bool respond(int s, std::string b, std::string) override {
    status = s;
    body = std::move(b);
    complete = true;
    return true;
  }
  bool send_error(int s, std::string_view message, std::string_view, std::string_view) override {
    status = s;
    body = api::openai_error_body(message);
    complete = true;
    return true;
  }
  bool respond_with_headers(net::HttpResponse r) override {
    return respond(r.status, r.body, "application/json");
  }
  bool start_stream(int s, std::string) override {
    status = s;
    streaming = true;
    return true;
  }
  bool write(std::string_view chunk) override {
    streamed += chunk;
    return true;
  }
  bool end() override {
    complete = true;
    close_ = nullptr;
    return true;
  }
  void abort() override { close_ = nullptr; }
  void on_close(std::function<void()> callback) override { close_ = std::move(callback); }

  int status = 0;
  std::string body, streamed;
  bool streaming = false, complete = false;

 private:
  std::function<void()> close_;
};

Endpoint engine(const std::string& name) {
  Endpoint e;
  e.name = name;
  e.host = name + ".engines";
  e.port = 8000;
  e.bootstrap_port = 8998;
  return e;
}

// Engines a and b (decode; p1, p2 prefill in the P/D modes), one failure ejects an engine, and
// a failed attempt is retried once: a blamed engine would show, and so would a retry.
Topology topology(PdMode mode) {
  Topology t;
  t.mode = mode;
  t.policy = "least_load";
  t.decode.endpoints = {engine("a"), engine("b")};
  t.decode.dialect = Dialect::kVllm;
  t.decode.max_in_flight = 8;
  if (mode != PdMode::kAggregated) {
    t.prefill.endpoints = {engine("p1"), engine("p2")};
    t.prefill.dialect = Dialect::kVllm;
    t.prefill.max_in_flight = 8;
  }
  t.health.failures_to_eject = 1;
  t.prefill_retries = 1;
  return t;
}

// The gateway's scheduling parts wired as Gateway wires them, on a virtual clock.
class Cluster {
 public:
  explicit Cluster(Topology topology)
      : topo(std::move(topology)),
        policy(make_policy(topo.policy, policy_options(topo))),
        metrics(registry),
        endpoints(topo, metrics, index),
        dispatcher(topo, clock, engines, *policy, endpoints, metrics, nullptr),
        health(topo, clock, engines, endpoints, [this] { dispatcher.engines_changed(); }),
        front_end(topo, clock, engines, dispatcher, endpoints, registry, nullptr) {
    for (const auto& e : topo.prefill.endpoints) endpoints.add(true, e);
    for (const auto& e : topo.decode.endpoints) endpoints.add(false, e);
    dispatcher.dashboard_state();  // the dashboard is open: the requests' records are kept
  }
  ~Cluster() {
    for (const auto& c : clients_) c->on_close(nullptr);
  }

  // A client sends a streaming completion request.
  std::shared_ptr<FakeClient> send_stream() {
    auto client = std::make_shared<FakeClient>();
    clients_.push_back(client);
    net::HttpRequest req;
    req.method = "POST";
    req.target = req.path = "/v1/completions";
    req.body = json{{"model", "m"}, {"prompt", "x"}, {"stream", true}}.dump();
    if (RequestPtr r = front_end.prepare(req, client)) {
      r->reply->on_close([this, r] { dispatcher.client_gone(r); });
      clock.post_batched([this, r] { dispatcher.submit(r); });
    }
    clock.run_ready();
    return client;
  }

  json endpoint(const std::string& name) const {
    const json all = dispatcher.endpoints_json();
    for (const auto& e : all.at("endpoints"))
      if (e.at("name") == name) return e;
    return nullptr;
  }
  // The value of a rendered metric line, e.g. `tandem:gateway_retries_total`.
  double metric(const std::string& series) const {
    const std::string text = registry.render();
    const size_t at = text.find("\n" + series + " ");
    if (at == std::string::npos) return 0;
    return std::stod(text.substr(at + series.size() + 2));
  }
  // The last finished request's record (as the access log and dashboard have it).
  json last_record() { return dispatcher.dashboard_state().at("recent").back(); }

  Topology topo;
  VirtualExecutor clock;
  FakeEngines engines;
  std::unique_ptr<Policy> policy;
  PrefixIndex index;
  metrics::Registry registry;
  GatewayMetrics metrics;
  EndpointTable endpoints;
  Dispatcher dispatcher;
  HealthMonitor health;
  FrontEnd front_end;

 private:
  std::vector<std::shared_ptr<FakeClient>> clients_;
};

std::string host_of(const FakeEngines::Call& c) {
  return c.request.host.substr(0, c.request.host.find('.'));
}

// What a Tandem engine streams when sampling finds no token the request's masks allow
// (generation_api.cpp Call::fail for a 400): its error event, then [DONE].
const std::string kNoTokenError = api::openai_error_body(
    "generation failed: no token can be sampled: 'allowed_token_ids', 'min_tokens' exclude every "
    "token",
    "invalid_request_error");
const std::string kNoTokenStream = net::sse_event(kNoTokenError) + std::string(net::kSseDone);

const std::string kTokenEvent = net::sse_event(R"({"choices":[{"index":0,"text":"t"}]})");

// Every engine of the topology is in, with no failure counted.
void expect_no_engine_blamed(const Cluster& c) {
  const json all = c.dispatcher.endpoints_json();
  for (const auto& e : all.at("endpoints")) {
    EXPECT_EQ(e.at("healthy"), true) << e;
    EXPECT_EQ(e.at("consecutive_failures"), 0) << e;
  }
}

constexpr PdMode kModes[] = {PdMode::kAggregated, PdMode::kSequential, PdMode::kParallel};

// The answering leg's first event is the client's error: the client gets a 400 with the engine's
// error, the request is not retried, and no engine is blamed or ejected; the next request is
// served.
TEST(ClientErrorStream, AnInvalidRequestErrorAsAStreamsFirstEventIsTheClients400) {
  for (const PdMode mode : kModes) {
    SCOPED_TRACE(static_cast<int>(mode));
    Cluster c(topology(mode));
    auto client = c.send_stream();
    if (mode == PdMode::kSequential) {  // the prefill answers with the prompt's KV
      auto prefill = c.engines.open().at(0);
      FakeEngines::head(*prefill, 200, "application/json");
      FakeEngines::piece(*prefill,
                         R"({"choices":[],"kv_transfer_params":{"remote_block_ids":[]}})");
      FakeEngines::finish(*prefill, "");
      c.clock.run_ready();
    }
    auto legs = c.engines.open();
    std::shared_ptr<FakeEngines::Call> answering;
    for (const auto& l : legs)
      if (host_of(*l) == "a") answering = l;
    ASSERT_TRUE(answering) << legs.size();
    FakeEngines::stream(*answering, kNoTokenStream);
    c.clock.run_ready();
    EXPECT_EQ(client->status, 400);
    EXPECT_EQ(client->body, kNoTokenError);
    EXPECT_FALSE(client->streaming);
    EXPECT_TRUE(client->complete);
    EXPECT_TRUE(c.engines.open().empty());
    EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 0);
    EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"400\"}"), 1);
    expect_no_engine_blamed(c);
    EXPECT_EQ(c.dispatcher.active(), 0u);
  }
}

// Parallel mode streams the prefill leg too, for a streaming client: its first event being the
// client's error answers the client 400 as the decode leg's would, without retry or blame.
TEST(ClientErrorStream, AParallelPrefillLegsInvalidRequestErrorIsTheClients400) {
  Cluster c(topology(PdMode::kParallel));
  auto client = c.send_stream();
  auto legs = c.engines.open();
  ASSERT_EQ(legs.size(), 2u);
  ASSERT_EQ(host_of(*legs[0]), "p1");
  FakeEngines::stream(*legs[0], kNoTokenStream);
  c.clock.run_ready();
  EXPECT_EQ(client->status, 400);
  EXPECT_EQ(client->body, kNoTokenError);
  EXPECT_TRUE(legs[1]->cancelled);  // the decode leg is given up
  EXPECT_TRUE(c.engines.open().empty());
  EXPECT_EQ(c.engines.generation_calls(), 2u);
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 0);
  expect_no_engine_blamed(c);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// vLLM's and SGLang's stream generators send their own failures (a CUDA out-of-memory, a dead
// engine core) as {"type": "BadRequestError", "code": 400}: that is the engine's failure, retried
// on another engine and counted against this one, not the client's 400.
TEST(ClientErrorStream, AVllmBadRequestErrorInAStreamIsTheEnginesFailure) {
  Cluster c(topology(PdMode::kAggregated));
  auto client = c.send_stream();
  auto first = c.engines.open().at(0);
  ASSERT_EQ(host_of(*first), "a");
  const std::string vllm_error =
      R"({"error":{"message":"EngineCore encountered an issue","type":"BadRequestError","param":null,"code":400}})";
  FakeEngines::stream(*first, net::sse_event(vllm_error) + std::string(net::kSseDone));
  c.clock.run_ready();
  EXPECT_FALSE(client->complete);
  auto retry = c.engines.open();
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(host_of(*retry[0]), "b");
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
  EXPECT_EQ(c.endpoint("a")["consecutive_failures"], 1);
}

// Regression guard: an engine's own failure as a stream's first event is still retried on
// another engine, and counted against the failed one.
TEST(ClientErrorStream, AServerErrorAsAStreamsFirstEventIsStillRetriedAndBlamed) {
  Cluster c(topology(PdMode::kAggregated));
  auto client = c.send_stream();
  auto first = c.engines.open().at(0);
  ASSERT_EQ(host_of(*first), "a");
  FakeEngines::stream(
      *first, net::sse_event(api::openai_error_body("generation failed: boom", "server_error")) +
                  std::string(net::kSseDone));
  c.clock.run_ready();
  EXPECT_FALSE(client->complete);
  auto retry = c.engines.open();
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(host_of(*retry[0]), "b");
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
  EXPECT_EQ(c.endpoint("a")["consecutive_failures"], 1);
  EXPECT_EQ(c.endpoint("a")["healthy"], false);
}

// After the client's stream began, the client's error is relayed as the stream's error event
// (the client's stream ends as the engine ended it) but is no failure of the engine's.
TEST(ClientErrorStream, AnInvalidRequestErrorMidStreamIsRelayedButNotCountedAgainstTheEngine) {
  Cluster c(topology(PdMode::kAggregated));
  auto client = c.send_stream();
  const std::string events = kTokenEvent + kNoTokenStream;
  FakeEngines::stream(*c.engines.open().at(0), events);
  c.clock.run_ready();
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(client->streamed, events);
  EXPECT_TRUE(client->complete);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"400\"}"), 1);
  EXPECT_EQ(c.last_record().value("status", 0), 400) << c.last_record();
  expect_no_engine_blamed(c);
}

// A stream that fails after 3 token events: its error event is no output event, and the time
// to it no gap between tokens.
TEST(ClientErrorStream, AStreamsErrorEventIsNoTokenEvent) {
  Cluster c(topology(PdMode::kAggregated));
  auto client = c.send_stream();
  auto call = c.engines.open().at(0);
  FakeEngines::head(*call, 200, "text/event-stream");
  ASSERT_TRUE(FakeEngines::piece(*call, kTokenEvent + kTokenEvent + kTokenEvent));
  c.clock.advance_by(std::chrono::seconds(5));
  ASSERT_TRUE(FakeEngines::piece(
      *call, net::sse_event(api::openai_error_body("generation failed: boom", "server_error")) +
                 std::string(net::kSseDone)));
  FakeEngines::finish(*call, "");
  c.clock.run_ready();
  ASSERT_TRUE(client->complete);
  const json record = c.last_record();
  EXPECT_EQ(record.value("status", 0), 502) << record;
  EXPECT_EQ(record.value("output_events", -1), 3) << record;
  EXPECT_EQ(c.metric("vllm:inter_token_latency_seconds_count"), 2);
  EXPECT_EQ(c.metric("vllm:inter_token_latency_seconds_sum"), 0);
}

TEST(ClientErrorStream, CarriesTokensIsFalseForAnErrorEvent) {
  EXPECT_FALSE(carries_tokens(api::openai_error_body("boom", "server_error")));
  EXPECT_TRUE(carries_tokens(R"({"choices":[{"index":0,"text":"error"}]})"));
}

}  // namespace
}  // namespace tandem::gateway
