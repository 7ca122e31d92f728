// The gateway's scheduling code without sockets, threads or sleeps: the front end's intake, the
// dispatcher, the relay and the health monitor run against a virtual clock (VirtualExecutor) and
// fake engines (an Upstream whose calls the test answers) and a fake client (a ClientReply that
// records what it got). Every time is virtual: a timeout test moves the clock, it never waits.
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "api/block_hash.h"
#include "api/error.h"
#include "api/load_report.h"
#include "api/model_list.h"
#include "gateway/admin_api.h"
#include "gateway/choice_fan_out.h"
#include "gateway/dispatcher.h"
#include "gateway/endpoints.h"
#include "gateway/fake_upstream.h"
#include "gateway/front_end.h"
#include "gateway/gateway_metrics.h"
#include "gateway/health.h"
#include "gateway/policy.h"
#include "gateway/prefix_index.h"
#include "gateway/tokens_in.h"
#include "gateway/virtual_executor.h"
#include "net/sse.h"
#include "text/oracle_support.h"
#include "util/error.h"
#include "util/metrics.h"
#include "util/random_id.h"
#include "util/utf8.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;

// ---------------------------------------------------------------------------------- fakes

// A client that records what the gateway sent it.
class FakeClient final : public ClientReply {
 public:
  bool respond(int s, std::string b, std::string) override {
    if (complete_) return false;
    ++answers;
    status = s;
    body = std::move(b);
    finish();
    return true;
  }
  bool send_error(int s, std::string_view message, std::string_view type,
                  std::string_view code) override {
    if (complete_) return false;
    ++answers;
    status = s;
    error_message = std::string(message);
    error_type = std::string(type);
    error_code = std::string(code);
    finish();
    return true;
  }
  bool respond_with_headers(net::HttpResponse r) override {
    if (complete_) return false;
    ++answers;
    status = r.status;
    body = r.body;
    retry_after = r.headers.get("Retry-After");
    // An engine's own error body may leave out any of these (a const json's [] asserts the key).
    const json error = json::parse(r.body)["error"];
    error_message = error.value("message", "");
    error_type = error.value("type", "");
    const auto code = error.find("code");
    error_code = code != error.end() && code->is_string() ? code->get<std::string>() : "";
    finish();
    return true;
  }
  bool start_stream(int s, std::string) override {
    status = s;
    streaming = true;
    return true;
  }
  bool write(std::string_view chunk) override {
    if (gone_) return false;
    streamed += chunk;
    return true;
  }
  bool end() override {
    finish();
    return true;
  }
  void abort() override {
    aborted = true;
    close_ = nullptr;
  }
  void on_close(std::function<void()> callback) override { close_ = std::move(callback); }
  // The client hangs up.
  void leave() {
    gone_ = true;
    if (auto close = std::move(close_)) close();
  }
  // Its connection broke: writes fail before the server tells the request (its close callback).
  void break_connection() { gone_ = true; }

  int status = 0;
  std::string body, streamed, error_message, error_type, error_code;
  std::string retry_after;  // the Retry-After header of an answer that has one
  int answers = 0;          // whole answers it got (a stream is none)
  bool streaming = false, aborted = false;
  bool complete() const { return complete_; }

 private:
  // As the server's exchange: a response that ended drops its close callback, which holds the
  // request (the request holds this reply).
  void finish() {
    complete_ = true;
    close_ = nullptr;
  }

  bool complete_ = false, gone_ = false;
  std::function<void()> close_;
};

Endpoint engine(const std::string& name, int group = 0, int64_t max_in_flight = 0) {
  Endpoint e;
  e.name = name;
  e.host = name + ".engines";
  e.port = 8000;
  e.bootstrap_port = 8998;
  e.group = group;
  e.max_in_flight = max_in_flight;
  return e;
}

Topology aggregated(std::vector<Endpoint> decode) {
  Topology t;
  t.mode = PdMode::kAggregated;
  t.policy = "least_load";
  t.decode.endpoints = std::move(decode);
  t.decode.dialect = Dialect::kVllm;
  t.decode.max_in_flight = 8;
  return t;
}

Topology disaggregated(PdMode mode, std::vector<Endpoint> prefill, std::vector<Endpoint> decode) {
  Topology t = aggregated(std::move(decode));
  t.mode = mode;
  t.prefill.endpoints = std::move(prefill);
  t.prefill.dialect = Dialect::kVllm;
  t.prefill.max_in_flight = 8;
  return t;
}

// One engine `a` and no retry: what it answers is what the client gets.
Topology one_engine_without_retries() {
  Topology t = aggregated({engine("a")});
  t.prefill_retries = 0;
  return t;
}

// `t` whose engines are ejected at their first failure and probed every second.
Topology probed_every_second(Topology t) {
  t.health.failures_to_eject = 1;
  t.health.probe_interval = milliseconds(1000);
  return t;
}

// Sequential P/D with one prefill engine `p` that is a Tandem engine (it holds the prompt's KV for
// its decode leg and takes releases) and one decode engine `d`.
Topology tandem_sequential_pair() {
  Topology t = disaggregated(PdMode::kSequential, {engine("p")}, {engine("d")});
  t.prefill.dialect = Dialect::kTandem;
  return t;
}

std::string completion_answer(const std::string& text) {
  return json{{"id", "cmpl-1"},
              {"object", "text_completion"},
              {"choices", json::array({{{"index", 0}, {"text", text}, {"finish_reason", "stop"}}})},
              {"usage", {{"prompt_tokens", 3}, {"completion_tokens", 2}, {"total_tokens", 5}}}}
      .dump();
}

// The gateway's scheduling parts wired as Gateway wires them, on a virtual clock.
class Cluster {
 public:
  // `tokenizer`: the front end tokenizes with it, as with a model folder.
  explicit Cluster(Topology topology, const PromptTokenizer* tokenizer = nullptr)
      : topo(std::move(topology)),
        policy(make_policy(topo.policy, policy_options(topo))),
        metrics(registry),
        endpoints(topo, metrics, index),
        dispatcher(topo, clock, engines, *policy, endpoints, metrics, nullptr),
        health(topo, clock, engines, endpoints, [this] { dispatcher.engines_changed(); }),
        front_end(topo, clock, engines, dispatcher, endpoints, registry, tokenizer) {
    for (const auto& e : topo.prefill.endpoints) endpoints.add(true, e);
    for (const auto& e : topo.decode.endpoints) endpoints.add(false, e);
  }

  // Requests still in flight at the end hold their client's close callback, which holds them;
  // a server drops those callbacks when it closes its connections.
  ~Cluster() {
    for (const auto& c : clients_)
      if (auto client = c.lock()) client->on_close(nullptr);
  }

  // A client sends a completion request; it reaches the dispatcher as the front end prepares it.
  std::shared_ptr<FakeClient> send(bool stream = false, const std::string& id = {}) {
    auto client = std::make_shared<FakeClient>();
    clients_.push_back(client);
    net::HttpRequest req;
    req.method = "POST";
    req.target = req.path = "/v1/completions";
    req.body = json{{"model", "m"}, {"prompt", "hello there"}, {"stream", stream}}.dump();
    if (!id.empty()) req.headers.set("X-Request-Id", id);
    if (RequestPtr r = front_end.prepare(req, client)) {
      last_sent = r;
      r->reply->on_close([this, r] { dispatcher.client_gone(r); });
      clock.post_batched([this, r] { dispatcher.submit(r); });
    }
    clock.run_ready();
    return client;
  }

  // `count` requests submitted together, as the choices of one client request are (with an
  // Authorization bearer `key` when given).
  std::vector<std::shared_ptr<FakeClient>> send_together(size_t count,
                                                         const std::string& key = {}) {
    std::vector<std::shared_ptr<FakeClient>> clients;
    std::vector<RequestPtr> group;
    for (size_t i = 0; i < count; ++i) {
      clients.push_back(std::make_shared<FakeClient>());
      clients_.push_back(clients.back());
      net::HttpRequest req;
      req.method = "POST";
      req.target = req.path = "/v1/completions";
      req.body = json{{"model", "m"}, {"prompt", "hello there"}}.dump();
      if (!key.empty()) req.headers.set("Authorization", "Bearer " + key);
      if (RequestPtr r = front_end.prepare(req, clients.back())) {
        r->reply->on_close([this, r] { dispatcher.client_gone(r); });
        group.push_back(std::move(r));
      }
    }
    clock.post_batched([this, group] { dispatcher.submit(group); });
    clock.run_ready();
    return clients;
  }

  // One client request for `count` choices as the P/D modes serve it (FrontEnd::receive_choices):
  // a request per choice, each answering through one ChoiceMerger to the one client, submitted
  // together; a choice let go because another failed ends with that failure.
  std::shared_ptr<FakeClient> send_choices(size_t count, const std::string& key = {},
                                           bool stream = false) {
    auto client = std::make_shared<FakeClient>();
    clients_.push_back(client);
    const auto merger = ChoiceMerger::create(client, count, count);
    std::vector<RequestPtr> group;
    for (size_t i = 0; i < count; ++i) {
      net::HttpRequest req;
      req.method = "POST";
      req.target = req.path = "/v1/completions";
      req.body = json{{"model", "m"}, {"prompt", "hello there"}, {"stream", stream}}.dump();
      if (!key.empty()) req.headers.set("Authorization", "Bearer " + key);
      if (RequestPtr r = front_end.prepare(req, merger->reply(i))) group.push_back(std::move(r));
    }
    for (const RequestPtr& r : group)
      r->reply->on_close([this, weak = std::weak_ptr<Request>(r),
                          weak_merger = std::weak_ptr<ChoiceMerger>(merger)] {
        const RequestPtr r = weak.lock();
        if (!r) return;
        const auto m = weak_merger.lock();
        if (const auto failure = m ? m->failure() : std::nullopt)
          dispatcher.end_request(r, {failure->status, "another choice failed"});
        else
          dispatcher.client_gone(r);
      });
    clock.post_batched([this, group] { dispatcher.submit(group); });
    clock.run_ready();
    return client;
  }

  // A client sends `body` (with an Authorization bearer `key` when given) to /v1/completions.
  std::shared_ptr<FakeClient> send_body(const json& body, const std::string& key = {}) {
    auto client = std::make_shared<FakeClient>();
    clients_.push_back(client);
    net::HttpRequest req;
    req.method = "POST";
    req.target = req.path = "/v1/completions";
    req.body = body.dump();
    if (!key.empty()) req.headers.set("Authorization", "Bearer " + key);
    if (RequestPtr r = front_end.prepare(req, client)) {
      r->reply->on_close([this, r] { dispatcher.client_gone(r); });
      clock.post_batched([this, r] { dispatcher.submit(r); });
    }
    clock.run_ready();
    return client;
  }

  // A request whose prompt the gateway tokenized (as a model folder would): `ids` decide what the
  // engines' cached prefixes match.
  std::shared_ptr<FakeClient> send_tokens(const std::vector<int32_t>& ids, bool stream = false) {
    auto client = std::make_shared<FakeClient>();
    clients_.push_back(client);
    net::HttpRequest req;
    req.method = "POST";
    req.target = req.path = "/v1/completions";
    req.body = json{{"model", "m"}, {"prompt", ids}, {"stream", stream}}.dump();
    if (RequestPtr r = front_end.prepare(req, client)) {
      r->prompt_ids = ids;
      r->prompt_tokens = static_cast<int64_t>(ids.size());
      r->tokens_known = true;
      r->reply->on_close([this, r] { dispatcher.client_gone(r); });
      clock.post_batched([this, r] { dispatcher.submit(r); });
    }
    clock.run_ready();
    return client;
  }

  // The engine named `name` holds the first `tokens` ids of `ids` in its prefix cache (as a
  // Tandem engine's KV events would say: our hashes, 16-token blocks).
  void engine_caches(const std::string& name, const std::vector<int32_t>& ids, size_t tokens) {
    for (const auto& [id, e] : endpoints.all())
      if (e.config.name == name) {
        endpoints.events_fed_externally(id);
        const auto cached = std::span(ids).first(tokens);
        index.add_blocks(id, api::block_hashes(cached, 16), cached, std::nullopt);
      }
  }

  json endpoint(const std::string& name) const {
    const json all = dispatcher.endpoints_json();
    for (const auto& e : all.at("endpoints"))
      if (e.at("name") == name) return e;
    return nullptr;
  }
  // The value of a rendered metric line, e.g. `tandem:gateway_requests_total{status="502"}`.
  double metric(const std::string& series) const {
    const std::string text = registry.render();
    const size_t at = text.find("\n" + series + " ");
    if (at == std::string::npos) return 0;
    return std::stod(text.substr(at + series.size() + 2));
  }
  // Answers every open leg call with `body` and lets the scheduler account for it.
  void answer_all(const std::string& text = "ok") {
    for (const auto& c : engines.open("/v1/completions"))
      FakeEngines::answer(*c, 200, completion_answer(text));
    clock.run_ready();
  }

  Topology topo;
  // The request send() prepared last, for a test of what the gateway holds for it.
  std::weak_ptr<Request> last_sent;
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
  std::vector<std::weak_ptr<FakeClient>> clients_;
};

std::string host_of(const FakeEngines::Call& c) {
  return c.request.host.substr(0, c.request.host.find('.'));
}

// A stream cut after the client got `prefix`: it then got an error event (given back in
// `error`) and [DONE], as a failing engine ends its stream.
void expect_error_event_then_done_after(const FakeClient& client, const std::string& prefix,
                                        json& error) {
  ASSERT_EQ(client.streamed.substr(0, prefix.size()), prefix);
  net::SseParser events;
  const auto tail = events.feed(client.streamed.substr(prefix.size()));
  ASSERT_EQ(tail.size(), 2u) << client.streamed;
  error = json::parse(tail[0]).at("error");
  EXPECT_EQ(tail[1], "[DONE]");
}

// After the first attempt, on engine a, failed: the request went on to b (the one attempt open)
// with the client seeing nothing yet, one retry counted and a's failure too. `on_b`, when given,
// gets b's attempt.
void expect_retried_on_b(const Cluster& c, const FakeClient& client,
                         std::shared_ptr<FakeEngines::Call>* on_b = nullptr) {
  const auto open = c.engines.open("/v1/completions");
  ASSERT_EQ(open.size(), 1u);
  EXPECT_EQ(host_of(*open[0]), "b");
  EXPECT_FALSE(client.complete());
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
  EXPECT_EQ(c.endpoint("a")["consecutive_failures"], 1);
  if (on_b) *on_b = open[0];
}

// ------------------------------------------------------------------------ dispatch and relay

TEST(Dispatcher, SendsARequestToTheLeastLoadedEngineAndRelaysItsAnswer) {
  Cluster c(aggregated({engine("a"), engine("b")}));
  auto first = c.send();
  auto second = c.send();
  auto calls = c.engines.open("/v1/completions");
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(host_of(*calls[0]), "a");
  EXPECT_EQ(host_of(*calls[1]), "b");  // a has one in flight
  EXPECT_EQ(calls[0]->request.method, "POST");
  EXPECT_EQ(json::parse(calls[0]->request.body)["prompt"], "hello there");
  EXPECT_FALSE(calls[0]->request.headers.get("X-Request-Id").empty());

  FakeEngines::answer(*calls[0], 200, completion_answer("from a"));
  c.clock.run_ready();
  EXPECT_EQ(first->status, 200);
  EXPECT_EQ(json::parse(first->body)["choices"][0]["text"], "from a");
  EXPECT_FALSE(second->complete());
  EXPECT_EQ(c.dispatcher.active(), 1u);
  EXPECT_EQ(c.endpoint("a")["in_flight"], 0);
  EXPECT_EQ(c.endpoint("b")["in_flight"], 1);
  c.answer_all();
  EXPECT_EQ(c.dispatcher.active(), 0u);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"200\"}"), 2);
}

TEST(Dispatcher, HonoursAPlainRequestIdAndReplacesAHostileOne) {
  Cluster c(aggregated({engine("a")}));
  c.send(false, "client-id-1");
  c.send(false, "an id with spaces");
  auto calls = c.engines.open("/v1/completions");
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0]->request.headers.get("X-Request-Id"), "client-id-1");
  const std::string replaced = calls[1]->request.headers.get("X-Request-Id");
  EXPECT_FALSE(replaced.empty());
  EXPECT_EQ(replaced.find(' '), std::string::npos);
}

TEST(Dispatcher, RelaysAStreamVerbatimOnceItsFirstEventIsNoError) {
  Cluster c(aggregated({engine("a")}));
  auto client = c.send(true);
  auto call = c.engines.open("/v1/completions").at(0);
  FakeEngines::head(*call, 200, "text/event-stream");
  // Half an event: nothing reaches the client yet (it might still turn out to be an error).
  ASSERT_TRUE(FakeEngines::piece(*call, "data: {\"choices\":[{\"text\":\"he"));
  EXPECT_FALSE(client->streaming);
  ASSERT_TRUE(FakeEngines::piece(*call, "llo\"}]}\n\ndata: {\"choices\":[{\"text\":\"!\"}]}\n\n"));
  EXPECT_TRUE(client->streaming);
  ASSERT_TRUE(FakeEngines::piece(*call, "data: [DONE]\n\n"));
  FakeEngines::finish(*call, "");
  c.clock.run_ready();
  EXPECT_EQ(client->streamed,
            "data: {\"choices\":[{\"text\":\"hello\"}]}\n\ndata: {\"choices\":[{\"text\":\"!\"}]}"
            "\n\ndata: [DONE]\n\n");
  EXPECT_TRUE(client->complete());
  EXPECT_FALSE(client->aborted);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"200\"}"), 1);
}

// A streaming request on one engine that has sent its head: the client and the engine's call.
struct OpenStream {
  std::shared_ptr<FakeClient> client;
  std::shared_ptr<FakeEngines::Call> call;
};
OpenStream open_stream(Cluster& c) {
  auto client = c.send(true);
  auto call = c.engines.open("/v1/completions").at(0);
  FakeEngines::head(*call, 200, "text/event-stream");
  return {client, call};
}

TEST(Dispatcher, AStreamCutByItsEngineEndsWithAnErrorEvent) {
  Cluster c(aggregated({engine("a")}));
  auto [client, call] = open_stream(c);
  ASSERT_TRUE(FakeEngines::piece(*call, "data: {\"choices\":[{\"text\":\"hello\"}]}\n\n"));
  // The engine dies halfway through its second event.
  ASSERT_TRUE(FakeEngines::piece(*call, "data: {\"choices\":[{\"te"));
  FakeEngines::finish(*call, "connection closed by peer");
  c.clock.run_ready();
  // The half event is ended, so that the error event after it parses as one; the stream then
  // ends properly: the client can tell a cut answer from a whole one.
  const std::string prefix =
      "data: {\"choices\":[{\"text\":\"hello\"}]}\n\ndata: {\"choices\":[{\"te\n\n";
  json error;
  ASSERT_NO_FATAL_FAILURE(expect_error_event_then_done_after(*client, prefix, error));
  EXPECT_EQ(error.at("type"), "server_error");
  const std::string message = error.at("message");
  EXPECT_EQ(message, "the answer was cut: engine a: connection closed by peer");
  EXPECT_TRUE(client->complete());
  EXPECT_FALSE(client->aborted);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"502\"}"), 1);
  // A cut before any [DONE] or error event is the engine's failure (toward its ejection).
  EXPECT_EQ(c.metric("tandem:gateway_endpoint_failures_total{pool=\"decode\",endpoint=\"a\"}"), 1);
}

TEST(Dispatcher, AStreamWholeUpToDoneIsCompleteThoughTheConnectionThenBroke) {
  Cluster c(aggregated({engine("a")}));
  auto [client, call] = open_stream(c);
  ASSERT_TRUE(FakeEngines::piece(*call, "data: {\"choices\":[{\"text\":\"hi\"}]}\n\n"));
  ASSERT_TRUE(FakeEngines::piece(*call, "data: [DONE]\n\n"));
  FakeEngines::finish(*call, "connection closed by peer");
  c.clock.run_ready();
  EXPECT_EQ(client->streamed, "data: {\"choices\":[{\"text\":\"hi\"}]}\n\ndata: [DONE]\n\n");
  EXPECT_TRUE(client->complete());
  EXPECT_FALSE(client->aborted);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"200\"}"), 1);
}

TEST(Dispatcher, AStreamWhoseClientLeftIsCutWithoutAnError) {
  Cluster c(aggregated({engine("a")}));
  auto [client, call] = open_stream(c);
  ASSERT_TRUE(FakeEngines::piece(*call, "data: {\"choices\":[{\"text\":\"hi\"}]}\n\n"));
  client->leave();
  c.clock.run_ready();
  FakeEngines::finish(*call, "cancelled");
  c.clock.run_ready();
  EXPECT_EQ(client->streamed, "data: {\"choices\":[{\"text\":\"hi\"}]}\n\n");
  EXPECT_TRUE(client->aborted);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"499\"}"), 1);
}

// Only [DONE] says a stream is whole: one that ends cleanly without it (a body delimited by the
// connection's close, cut there) was cut, as the choice merger also has it.
TEST(Dispatcher, AStreamThatEndsWithoutItsDoneIsCut) {
  Cluster c(aggregated({engine("a")}));
  auto [client, call] = open_stream(c);
  const std::string first = "data: {\"choices\":[{\"text\":\"hi\"}]}\n\n";
  ASSERT_TRUE(FakeEngines::piece(*call, first));
  FakeEngines::finish(*call, "");
  c.clock.run_ready();
  json error;
  ASSERT_NO_FATAL_FAILURE(expect_error_event_then_done_after(*client, first, error));
  EXPECT_EQ(error.at("message"),
            "the answer was cut: engine a: the stream ended without its [DONE]");
  EXPECT_TRUE(client->complete());
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"502\"}"), 1);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"200\"}"), 0);
  EXPECT_EQ(c.endpoint("a")["consecutive_failures"], 1);
}

// An engine whose generation fails after its first tokens says so in an error event, then ends
// its stream with [DONE] (Tandem engines and vLLM do). The client gets the stream as it came, but
// the request failed and so did the engine: recorded 502, the engine blamed.
TEST(Dispatcher, AMidStreamErrorEventThenDoneIsRelayedButRecordedAsTheEnginesFailure) {
  Topology t = aggregated({engine("a")});
  t.health.failures_to_eject = 1;
  Cluster c(t);
  auto [client, call] = open_stream(c);
  const std::string events =
      "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
      "data: {\"error\":{\"message\":\"generation failed: boom\",\"type\":\"server_error\"}}"
      "\n\ndata: [DONE]\n\n";
  ASSERT_TRUE(FakeEngines::piece(*call, events));
  FakeEngines::finish(*call, "");
  c.clock.run_ready();
  EXPECT_EQ(client->streamed, events);  // nothing added: the engine ended its stream itself
  EXPECT_TRUE(client->complete());
  EXPECT_FALSE(client->aborted);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"502\"}"), 1);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"200\"}"), 0);
  EXPECT_EQ(c.endpoint("a")["consecutive_failures"], 1);
  EXPECT_EQ(c.endpoint("a")["healthy"], false);
  EXPECT_EQ(c.endpoint("a")["in_flight"], 0);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A whole answer that only the connection's close delimited is parsed: cut short, it may still
// end in '}'. It is a failed leg, not a 200.
TEST(Dispatcher, AWholeAnswerCutBeforeTheCloseThatDelimitsItIsAFailedLeg) {
  Cluster c(one_engine_without_retries());
  auto client = c.send();
  const std::string answer = completion_answer("hi");
  ASSERT_EQ(answer.substr(answer.size() - 2), "}}");
  // The fake engine's head has neither Content-Length nor chunked encoding: until close.
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 200,
                      answer.substr(0, answer.size() - 1));
  c.clock.run_ready();
  EXPECT_EQ(client->status, 502);
  EXPECT_EQ(client->error_type, "server_error");
  EXPECT_EQ(client->error_message, "engine a sent a malformed answer (not a JSON object)");
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"502\"}"), 1);
}

// A whole answer is held until it is complete (so a failure can still be retried), up to a limit.
// One past it is the gateway's refusal, not the engine's failure: no other engine is asked to
// compute it again, the engine is not blamed, and the client is told to stream it.
TEST(Dispatcher, AnAnswerLargerThanTheGatewayHoldsIsRefusedWithoutRetryOrBlame) {
  Topology t = aggregated({engine("a"), engine("b")});
  t.max_answer_bytes = 1024;
  Cluster c(t);
  auto client = c.send();
  auto call = c.engines.open("/v1/completions").at(0);
  FakeEngines::head(*call, 200, "application/json");
  ASSERT_TRUE(FakeEngines::piece(*call, "{\"choices\":[{\"text\":\"" + std::string(1000, 'x')));
  EXPECT_FALSE(FakeEngines::piece(*call, std::string(100, 'x')));
  FakeEngines::finish(*call, "cancelled");  // as the real client ends a call its on_body refused
  c.clock.run_ready();
  EXPECT_EQ(c.engines.all("/v1/completions").size(), 1u);
  EXPECT_EQ(client->status, 502);
  EXPECT_EQ(client->error_code, "answer_too_large");
  EXPECT_NE(client->error_message.find("larger than 1024 bytes"), std::string::npos)
      << client->error_message;
  EXPECT_NE(client->error_message.find("\"stream\": true"), std::string::npos)
      << client->error_message;
  EXPECT_EQ(c.endpoint("a")["consecutive_failures"], 0);
  EXPECT_EQ(c.endpoint("a")["in_flight"], 0);
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 0);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"502\"}"), 1);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// The limit is on what the gateway holds, not on what it relays: a stream goes on past it.
TEST(Dispatcher, AStreamLongerThanTheAnswerLimitIsRelayedWhole) {
  Topology t = aggregated({engine("a")});
  t.max_answer_bytes = 1024;
  Cluster c(t);
  auto [client, call] = open_stream(c);
  const std::string event =
      "data: {\"choices\":[{\"text\":\"" + std::string(500, 'x') + "\"}]}\n\n";
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(FakeEngines::piece(*call, event));
  ASSERT_TRUE(FakeEngines::piece(*call, "data: [DONE]\n\n"));
  FakeEngines::finish(*call, "");
  c.clock.run_ready();
  EXPECT_EQ(client->streamed.size(), 8 * event.size() + 14);
  EXPECT_TRUE(client->complete());
  EXPECT_FALSE(client->aborted);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"200\"}"), 1);
}

// ------------------------------------------------------------------------------- retries

TEST(Dispatcher, RetriesAFailedAttemptOnAnotherEngine) {
  Cluster c(aggregated({engine("a"), engine("b")}));
  auto client = c.send();
  auto first = c.engines.open("/v1/completions").at(0);
  EXPECT_EQ(host_of(*first), "a");
  FakeEngines::answer(*first, 500, R"({"error":{"message":"boom"}})");
  c.clock.run_ready();
  auto second = c.engines.open("/v1/completions");
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(host_of(*second[0]), "b");
  EXPECT_FALSE(client->complete());  // the client saw nothing of the failure
  c.answer_all("from b");
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
  EXPECT_EQ(c.endpoint("a")["consecutive_failures"], 1);
  EXPECT_EQ(c.endpoint("b")["consecutive_failures"], 0);
}

TEST(Dispatcher, ThePolicyHearsEachPicksOutcome) {
  Cluster c(aggregated({engine("a"), engine("b")}));
  c.send();
  FakeEngines::answer(*c.engines.open().at(0), 503, "");  // a fails (retried on b)
  c.clock.run_ready();
  c.answer_all();
  // Both idle now; a failed recently, so the next request goes to b, and after a's failure is
  // forgotten (10 s), least_load's lowest id wins again.
  c.send();
  EXPECT_EQ(host_of(*c.engines.open().at(0)), "b");
  c.answer_all();
  c.clock.advance_by(std::chrono::seconds(10));
  c.send();
  EXPECT_EQ(host_of(*c.engines.open().at(0)), "a");
}

TEST(Dispatcher, RetriesAStreamThatStartsWithAnErrorEvent) {
  Cluster c(aggregated({engine("a"), engine("b")}));
  auto client = c.send(true);
  auto first = c.engines.open("/v1/completions").at(0);
  FakeEngines::head(*first, 200, "text/event-stream");
  EXPECT_FALSE(FakeEngines::piece(*first, "data: {\"error\":{\"message\":\"no KV\"}}\n\n"));
  FakeEngines::finish(*first, "cancelled");
  c.clock.run_ready();
  EXPECT_FALSE(client->streaming);
  auto second = c.engines.open("/v1/completions");
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(host_of(*second[0]), "b");
}

// A 200 event stream that ends cleanly without a single event brought no answer: the attempt is
// retried elsewhere, and the engine that sent it failed.
TEST(Dispatcher, AnEmptyStreamIsRetriedAndTheEngineBlamed) {
  Topology t = aggregated({engine("a"), engine("b")});
  t.health.failures_to_eject = 1;
  Cluster c(t);
  auto client = c.send(true);
  auto first = c.engines.open("/v1/completions").at(0);
  ASSERT_EQ(host_of(*first), "a");
  FakeEngines::head(*first, 200, "text/event-stream");
  FakeEngines::finish(*first, "");
  c.clock.run_ready();
  ASSERT_NO_FATAL_FAILURE(expect_retried_on_b(c, *client));
  EXPECT_EQ(c.endpoint("a")["healthy"], false);
  EXPECT_EQ(c.metric("tandem:gateway_endpoint_failures_total{pool=\"decode\",endpoint=\"a\"}"), 1);
}

// The answer limit is on answers the gateway would relay whole. An error answer is read only as
// far as what it says (its start): one past the limit is still the engine's failure, retried
// elsewhere and, once retries run out, quoted in the gateway's 502, not refused as too large.
TEST(Dispatcher, AnErrorAnswerLargerThanTheAnswerLimitIsTheEnginesFailure) {
  Topology t = aggregated({engine("a"), engine("b")});
  t.max_answer_bytes = 1024;
  t.prefill_retries = 1;
  Cluster c(t);
  auto client = c.send(true);  // a streaming client too: nothing streams before the first event
  auto first = c.engines.open("/v1/completions").at(0);
  ASSERT_EQ(host_of(*first), "a");
  const std::string page = "<html>" + std::string(size_t{1} << 20, 'x');
  FakeEngines::head(*first, 500, "text/html");
  EXPECT_TRUE(FakeEngines::piece(*first, page));
  EXPECT_TRUE(FakeEngines::piece(*first, page));
  FakeEngines::finish(*first, "");
  c.clock.run_ready();
  std::shared_ptr<FakeEngines::Call> second;
  ASSERT_NO_FATAL_FAILURE(expect_retried_on_b(c, *client, &second));
  FakeEngines::answer(*second, 500, page, "text/html");
  c.clock.run_ready();
  EXPECT_EQ(client->status, 502);
  EXPECT_FALSE(client->streaming);
  EXPECT_EQ(client->error_type, "server_error");
  EXPECT_EQ(client->error_code, "");
  EXPECT_EQ(client->error_message.rfind("engine b answered HTTP 500: <html>xxx", 0), 0u)
      << client->error_message;
  EXPECT_EQ(c.endpoint("b")["consecutive_failures"], 1);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

TEST(Dispatcher, PassesAnEnginesClientErrorThroughWithoutRetrying) {
  Cluster c(aggregated({engine("a"), engine("b")}));
  auto client = c.send();
  const std::string refusal = R"({"error":{"message":"max_tokens too large","type":"x"}})";
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 400, refusal);
  c.clock.run_ready();
  EXPECT_EQ(client->status, 400);
  EXPECT_EQ(client->body, refusal);
  EXPECT_TRUE(c.engines.open().empty());
  EXPECT_EQ(c.engines.all("/v1/completions").size(), 1u);
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 0);
}

// Only an OpenAI error is relayed as the engine's answer. Any other body of an error status went
// to the client labelled application/json as it was: a proxy's HTML page too.
TEST(Dispatcher, AnEnginesErrorThatIsNoOpenAIErrorIsQuotedInTheGatewaysOwn) {
  Cluster c(one_engine_without_retries());
  const auto answered = [&](int status, const std::string& body, const std::string& type) {
    auto client = c.send();
    FakeEngines::answer(*c.engines.open("/v1/completions").at(0), status, body, type);
    c.clock.run_ready();
    return client;
  };
  auto page =
      answered(500, "<html>\r\n<body>Internal  Server Error</body>\r\n</html>\n", "text/html");
  EXPECT_EQ(page->status, 502);
  EXPECT_EQ(page->error_type, "server_error");
  EXPECT_EQ(page->error_message,
            "engine a answered HTTP 500: <html> <body>Internal Server Error</body> </html>");
  // The gateway's own error (the engine's page was never the body).
  EXPECT_EQ(page->body, api::openai_error_body(page->error_message, "server_error"));

  auto forbidden = answered(403, "Forbidden", "text/plain");
  EXPECT_EQ(forbidden->status, 403);
  EXPECT_EQ(forbidden->error_message, "engine a answered HTTP 403: Forbidden");
  EXPECT_EQ(forbidden->body,
            api::openai_error_body(forbidden->error_message, api::default_error_type(403)));

  // vLLM's and SGLang's other error shape: its message is quoted.
  auto sglang =
      answered(400, R"({"object":"error","message":"bad top_k","code":400})", "application/json");
  EXPECT_EQ(sglang->status, 400);
  EXPECT_EQ(sglang->error_message, "engine a answered HTTP 400: bad top_k");

  // A long body is clipped (the note counts the body's bytes cut), and control bytes never reach
  // the message.
  auto long_text = answered(502, "\x1b[31m" + std::string(5000, 'x'), "text/plain");
  EXPECT_EQ(long_text->status, 502);
  EXPECT_EQ(long_text->error_message,
            "engine a answered HTTP 502: [31m" + std::string(251, 'x') + "\u2026(+4749 bytes)");

  auto empty = answered(404, "", "text/plain");
  EXPECT_EQ(empty->status, 404);
  EXPECT_EQ(empty->error_message, "engine a answered HTTP 404");

  // An OpenAI error is relayed as it is, a 5xx one with its own status.
  const std::string overloaded = R"({"error":{"message":"no KV left","type":"server_error"}})";
  auto relayed = answered(503, overloaded, "application/json");
  EXPECT_EQ(relayed->status, 503);
  EXPECT_EQ(relayed->body, overloaded);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// An engine's answer that it is full (a 503 or 429 refusal).
const std::string kEngineFull =
    R"({"error":{"message":"the engine's queue is full","type":"server_error"}})";

// An engine's 429 says it is full, as a 503 does (reliability.md, "Overload is not failure"):
// retried on another engine and not counted toward its ejection; a client gets it only when no
// retry is left. It went to the client at once, as a 400 does.
TEST(Dispatcher, AnEnginesTooManyRequestsIsRetriedElsewhereAsItsFull503Is) {
  Cluster c(aggregated({engine("a"), engine("b")}));
  auto client = c.send();
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 429, kEngineFull);
  c.clock.run_ready();
  const auto open = c.engines.open("/v1/completions");
  ASSERT_EQ(open.size(), 1u);
  EXPECT_EQ(host_of(*open[0]), "b");
  EXPECT_FALSE(client->complete());
  c.answer_all("from b");
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
  EXPECT_EQ(c.endpoint("a")["consecutive_failures"], 0);

  Cluster one(one_engine_without_retries());
  auto refused = one.send();
  FakeEngines::answer(*one.engines.open("/v1/completions").at(0), 429, kEngineFull);
  one.clock.run_ready();
  EXPECT_EQ(refused->status, 429);
  EXPECT_EQ(refused->body, kEngineFull);
}

// A retry after an engine's refusal (429, 503: its queue is full) that can only go back to an
// engine that refused or failed the request waits the topology's retry_backoff first: sent again at
// once, it met the same full queue. Once retries are spent the client gets the engine's refusal
// with its Retry-After, which the gateway dropped.
TEST(Dispatcher, ARetryThatCanOnlyGoBackToARefusingEngineWaitsTheBackoffAndKeepsItsRetryAfter) {
  for (const PdMode mode : {PdMode::kAggregated, PdMode::kSequential}) {
    Topology t = mode == PdMode::kAggregated ? aggregated({engine("a")}) : tandem_sequential_pair();
    t.prefill_retries = 1;
    t.retry_backoff.first = milliseconds(40);
    t.retry_backoff.max = milliseconds(400);
    Cluster c(t);
    auto client = c.send();
    FakeEngines::refuse(*c.engines.open("/v1/completions").at(0), 429, kEngineFull, "3");
    c.clock.run_ready();
    EXPECT_TRUE(c.engines.open("/v1/completions").empty()) << "sent straight back";
    c.clock.advance_by(milliseconds(19));  // the least jittered wait is half of 40 ms
    EXPECT_TRUE(c.engines.open("/v1/completions").empty()) << "sent within the backoff";
    c.clock.advance_by(milliseconds(21));
    auto retry = c.engines.open("/v1/completions");
    ASSERT_EQ(retry.size(), 1u) << "not sent after the backoff";
    EXPECT_EQ(host_of(*retry[0]), mode == PdMode::kAggregated ? "a" : "p");
    EXPECT_FALSE(client->complete());
    FakeEngines::refuse(*retry[0], 429, kEngineFull, "3");
    c.clock.run_ready();
    EXPECT_EQ(client->status, 429);
    EXPECT_EQ(client->body, kEngineFull);
    EXPECT_EQ(client->retry_after, "3");
    EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
    EXPECT_EQ(c.dispatcher.active(), 0u);
    EXPECT_EQ(c.clock.pending_timers(), 0u);
  }
}

// Each refusal backoff waits longer than the one before: the second is drawn from before(2) (40 to
// 80 ms for a first of 40 ms), not again from before(1) (20 to 40 ms), as the busy retries count.
TEST(Dispatcher, EachRefusalBackoffWaitsLongerThanTheOneBefore) {
  Topology t = aggregated({engine("a")});
  t.prefill_retries = 2;
  t.retry_backoff.first = milliseconds(40);
  t.retry_backoff.max = milliseconds(400);
  Cluster c(t);
  auto client = c.send();
  FakeEngines::refuse(*c.engines.open("/v1/completions").at(0), 429, kEngineFull, "3");
  c.clock.run_ready();
  c.clock.advance_by(milliseconds(40));  // the first backoff is at most 40 ms
  auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 1u) << "not sent after the first backoff";
  FakeEngines::refuse(*retry[0], 429, kEngineFull, "3");
  c.clock.run_ready();
  c.clock.advance_by(milliseconds(39));  // the second's least jittered wait is half of 80 ms
  EXPECT_TRUE(c.engines.open("/v1/completions").empty()) << "the second backoff was no longer";
  c.clock.advance_by(milliseconds(41));
  retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 1u) << "not sent after the second backoff";
  FakeEngines::refuse(*retry[0], 429, kEngineFull, "3");
  c.clock.run_ready();
  EXPECT_EQ(client->status, 429);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// Parallel mode: a retry is a pair, so it goes back to an engine that refused where either pool
// has no other. After its one decode engine refused, a prefill engine's refusal is retried after
// the backoff too, though another prefill engine is untried: the pair would meet the decode
// engine's full queue again. Only the refusing engine's pool was judged: sent at once.
TEST(Dispatcher, AParallelRetryWaitsTheBackoffWhereEitherPoolHasOnlyEnginesThatRefused) {
  Topology t = disaggregated(PdMode::kParallel, {engine("p1"), engine("p2")}, {engine("d")});
  t.prefill_retries = 2;
  t.retry_backoff.first = milliseconds(40);
  t.retry_backoff.max = milliseconds(400);
  Cluster c(t);
  auto client = c.send();
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  ASSERT_EQ(host_of(*legs[1]), "d");
  FakeEngines::refuse(*legs[1], 429, kEngineFull, "3");
  c.clock.run_ready();
  EXPECT_TRUE(c.engines.open("/v1/completions").empty()) << "sent straight back to d";
  c.clock.advance_by(milliseconds(40));  // the first backoff is at most 40 ms
  legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u) << "not sent after the first backoff";
  const std::string refusing = host_of(*legs[0]);
  FakeEngines::refuse(*legs[0], 503, kEngineFull, "3");  // now the prefill engine is full
  c.clock.run_ready();
  EXPECT_TRUE(c.engines.open("/v1/completions").empty()) << "sent at once to d, which refused";
  c.clock.advance_by(milliseconds(80));  // the second backoff is at most 80 ms
  legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u) << "not sent after the second backoff";
  EXPECT_NE(host_of(*legs[0]), refusing);
  EXPECT_EQ(host_of(*legs[1]), "d");
  c.answer_all("after the backoffs");
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// Sequential mode: a decode engine's refusal starts the request again from its prefill (the
// refusing engine read the request, and may have let go of the KV). The restart judges the decode
// pool: with another decode engine untried it goes at once; with none, it waits the backoff, as
// its decode leg would meet the same full queue.
TEST(Dispatcher, ASequentialDecodeRefusalRestartsAfterTheBackoffOnlyWhereNoDecodeEngineIsLeft) {
  const std::string prefilled = R"({"choices":[],"kv_transfer_params":{"remote_block_ids":[]}})";
  for (const bool another_decode_engine : {false, true}) {
    SCOPED_TRACE(another_decode_engine);
    std::vector<Endpoint> decode = {engine("d1")};
    if (another_decode_engine) decode.push_back(engine("d2"));
    Topology t = disaggregated(PdMode::kSequential, {engine("p")}, decode);
    t.prefill_retries = 1;
    t.retry_backoff.first = milliseconds(40);
    t.retry_backoff.max = milliseconds(400);
    Cluster c(t);
    auto client = c.send();
    FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 200, prefilled);
    c.clock.run_ready();
    auto legs = c.engines.open("/v1/completions");
    ASSERT_EQ(legs.size(), 1u);
    ASSERT_EQ(host_of(*legs[0]), "d1");
    FakeEngines::refuse(*legs[0], 429, kEngineFull, "3");
    c.clock.run_ready();
    if (!another_decode_engine) {
      EXPECT_TRUE(c.engines.open("/v1/completions").empty()) << "sent straight back to d1";
      c.clock.advance_by(milliseconds(40));  // the first backoff is at most 40 ms
    }
    legs = c.engines.open("/v1/completions");
    ASSERT_EQ(legs.size(), 1u) << "no restart";
    EXPECT_EQ(host_of(*legs[0]), "p");
    FakeEngines::answer(*legs[0], 200, prefilled);
    c.clock.run_ready();
    legs = c.engines.open("/v1/completions");
    ASSERT_EQ(legs.size(), 1u);
    EXPECT_EQ(host_of(*legs[0]), another_decode_engine ? "d2" : "d1");
    c.answer_all("decoded");
    EXPECT_EQ(client->status, 200);
    EXPECT_EQ(c.dispatcher.active(), 0u);
  }
}

// An engine's 503 whose body is no OpenAI error (a proxy's page, plain text) is a refusal still:
// once retries are spent the client gets a 503 (the gateway's own OpenAI error quoting the body)
// with the engine's Retry-After. It got a 502 without it, as for a failed engine.
TEST(Dispatcher, AnEnginesRefusalWhoseBodyIsNoOpenAIErrorStaysA503WithItsRetryAfter) {
  Cluster c(one_engine_without_retries());
  auto client = c.send();
  FakeEngines::refuse(*c.engines.open("/v1/completions").at(0), 503, "Service Unavailable", "7");
  c.clock.run_ready();
  EXPECT_EQ(client->status, 503);
  EXPECT_EQ(client->retry_after, "7");
  EXPECT_EQ(client->error_type, "server_error");
  EXPECT_EQ(client->error_message, "engine a answered HTTP 503: Service Unavailable");

  auto without = c.send();
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 503, "Service Unavailable",
                      "text/plain");
  c.clock.run_ready();
  EXPECT_EQ(without->status, 503);
  EXPECT_EQ(without->retry_after, "");
  EXPECT_EQ(without->error_type, "server_error");
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"503\"}"), 2);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A request of several choices answered by its parts (ChoiceMerger) keeps the refusing engine's
// Retry-After too.
TEST(Dispatcher, AChoicesRefusalReachesItsClientWithTheEnginesRetryAfter) {
  Cluster c(one_engine_without_retries());
  auto client = c.send_choices(2);
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  FakeEngines::refuse(*legs[1], 503, kEngineFull, "3");
  c.clock.run_ready();
  EXPECT_EQ(client->status, 503);
  EXPECT_EQ(client->answers, 1);
  EXPECT_EQ(client->body, kEngineFull);
  EXPECT_EQ(client->retry_after, "3");
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// An engine's Retry-After reaches the client only as delay-seconds (at most a day) or an
// IMF-fixdate: anything else ("soon", a negative number) is dropped, an excessive delay capped.
TEST(Dispatcher, AnEnginesRetryAfterIsRelayedOnlyAsDelaySecondsOrAnHttpDate) {
  const std::pair<std::string, std::string> cases[] = {
      {"3", "3"},
      {"soon", ""},
      {"-5", ""},
      {"3.5", ""},
      {"", ""},
      {"99999999999", "86400"},
      {"86401", "86400"},
      {"000000000007", "000000000007"},
      {"Wed, 21 Oct 2015 07:28:00 GMT", "Wed, 21 Oct 2015 07:28:00 GMT"},
      {"Wed, 21 Oct 2015 07:28:00 UTC", ""},
      {"Tuesday, 21-Oct-15 07:28:00 GMT", ""},
  };
  Cluster c(one_engine_without_retries());
  for (const auto& [sent, relayed] : cases) {
    auto client = c.send();
    FakeEngines::refuse(*c.engines.open("/v1/completions").at(0), 429, kEngineFull, sent);
    c.clock.run_ready();
    EXPECT_EQ(client->status, 429) << sent;
    EXPECT_EQ(client->retry_after, relayed) << sent;
  }
}

TEST(Dispatcher, AnswersA502WhenRetriesRunOut) {
  Topology t = aggregated({engine("a"), engine("b")});
  t.prefill_retries = 1;
  Cluster c(t);
  auto client = c.send();
  for (int i = 0; i < 2; ++i) {
    auto open = c.engines.open("/v1/completions");
    ASSERT_EQ(open.size(), 1u);
    FakeEngines::finish(*open[0], "connection refused");
    c.clock.run_ready();
  }
  EXPECT_EQ(client->status, 502);
  EXPECT_EQ(client->error_type, "server_error");
  EXPECT_NE(client->error_message.find("connection refused"), std::string::npos);
  EXPECT_EQ(c.engines.all("/v1/completions").size(), 2u);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A gateway that tokenizes but knows no length (no config.json, and no engine said its own yet)
// leaves the length to the engines. It judged by a stand-in for "no limit", and named it: "This
// model's maximum context length is 1099511627776 tokens".
TEST(Dispatcher, ATokenizingGatewayThatKnowsNoLengthLeavesItToTheEngines) {
  const PromptTokenizer tokenizer(test::lenml_model("deepseek_v3"));
  Cluster c(aggregated({engine("a")}), &tokenizer);
  for (const int64_t max_tokens : {int64_t{1} << 40, int64_t{1} << 62}) {
    auto client =
        c.send_body({{"model", "m"}, {"prompt", "hello there"}, {"max_tokens", max_tokens}});
    ASSERT_FALSE(client->complete()) << client->error_message;
    auto call = c.engines.open("/v1/completions").at(0);
    const json sent = json::parse(call->request.body);
    EXPECT_TRUE(sent["prompt"].is_array());  // tokens in
    EXPECT_EQ(sent["max_tokens"], max_tokens);
    const std::string refusal =
        R"({"error":{"message":"This model's maximum context length is 4096 tokens.","type":"BadRequestError"}})";
    FakeEngines::answer(*call, 400, refusal);
    c.clock.run_ready();
    EXPECT_EQ(client->status, 400);
    EXPECT_EQ(client->body, refusal);
  }
}

// ------------------------------------------------------------- the client's error in a stream
//
// A client's mistake that an engine finds only once generation starts (a mask that leaves no
// token: allowed_token_ids with min_tokens, or with a JSON format) comes as a stream's error event
// of type invalid_request_error, under the stream's 200. It is the client's error as the engine's
// 400 answer is (docs/gateway.md): answered 400 before the client's stream began, and never
// counted against the engine. And a stream's error event is no token event (output_events, ITL).

// What a Tandem engine streams when sampling finds no token the request's masks allow
// (generation_api.cpp Call::fail for a 400): its error event, then [DONE].
const std::string kNoTokenError = api::openai_error_body(
    "generation failed: no token can be sampled: 'allowed_token_ids', 'min_tokens' exclude every "
    "token",
    "invalid_request_error");
const std::string kNoTokenStream = net::sse_event(kNoTokenError) + std::string(net::kSseDone);

const std::string kTokenEvent = net::sse_event(R"({"choices":[{"index":0,"text":"t"}]})");

// A rate limit as an engine behind a proxy may stream it (a refusal: error_event_status 429).
const std::string kRateLimited =
    R"({"error":{"message":"rate limit reached","type":"requests","code":429}})";

// Engines' errors the parallel legs' tests answer with: a decode leg's whose room was never
// filled (it names no code), SGLang's full queue (a refusal), and two client's errors.
const std::string kRoomFailed =
    R"({"error":{"message":"bootstrap room 7 failed","type":"server_error"}})";
const std::string kQueueFull =
    R"({"error":{"message":"The request queue is full.","type":"SERVICE_UNAVAILABLE","code":503}})";
const std::string kPromptTooLong =
    R"({"error":{"message":"the prompt is too long","type":"invalid_request_error"}})";
const std::string kMaxTokensInvalid =
    R"({"error":{"message":"max_tokens must be at least 1","type":"invalid_request_error"}})";

// One failure ejects an engine of `t`, and a failed attempt is retried once: a blamed engine
// would show, and so would a retry.
Topology each_ejected_at_one_failure(Topology t) {
  t.health.failures_to_eject = 1;
  t.prefill_retries = 1;
  return t;
}

// Engines a and b (decode; p1, p2 prefill in the P/D modes), each_ejected_at_one_failure.
Topology two_engines_each_ejected_at_one_failure(PdMode mode) {
  return each_ejected_at_one_failure(
      mode == PdMode::kAggregated
          ? aggregated({engine("a"), engine("b")})
          : disaggregated(mode, {engine("p1"), engine("p2")}, {engine("a"), engine("b")}));
}

// Parallel mode with one prefill engine, p1, before decode engines a and b,
// each_ejected_at_one_failure.
Topology one_prefill_engine_each_ejected_at_one_failure() {
  return each_ejected_at_one_failure(
      disaggregated(PdMode::kParallel, {engine("p1")}, {engine("a"), engine("b")}));
}

// Every engine of the cluster is in, with no failure counted.
void expect_no_engine_blamed(const Cluster& c) {
  const json all = c.dispatcher.endpoints_json();
  for (const auto& e : all.at("endpoints")) {
    EXPECT_EQ(e.at("healthy"), true) << e;
    EXPECT_EQ(e.at("consecutive_failures"), 0) << e;
  }
}

// A stream whose engine ended it with an error event reached the client whole (its head was
// 200), and the request is counted and recorded with the event's `status`.
void expect_streamed_whole_and_recorded(Cluster& c, const FakeClient& client,
                                        const std::string& events, int status) {
  EXPECT_EQ(client.status, 200);
  EXPECT_EQ(client.streamed, events);
  EXPECT_TRUE(client.complete());
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"" + std::to_string(status) + "\"}"),
            1);
  const json record = c.dispatcher.dashboard_state().at("recent").back();
  EXPECT_EQ(record.value("status", 0), status) << record;
}

// A parallel attempt's client error decided it: its two legs were all that was sent, nothing was
// retried, the request was recorded 400, and no engine was blamed.
void expect_decided_by_the_clients_error(Cluster& c) {
  EXPECT_EQ(c.engines.all("/v1/completions").size(), 2u);
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 0);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"400\"}"), 1);
  expect_no_engine_blamed(c);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// The answering leg's first event is the client's error: the client gets a 400 with the engine's
// error, the request is not retried, and no engine is blamed or ejected.
TEST(Dispatcher, AnInvalidRequestErrorAsAStreamsFirstEventIsTheClients400) {
  for (const PdMode mode : {PdMode::kAggregated, PdMode::kSequential, PdMode::kParallel}) {
    SCOPED_TRACE(static_cast<int>(mode));
    Cluster c(two_engines_each_ejected_at_one_failure(mode));
    auto client = c.send(true);
    if (mode == PdMode::kSequential) {  // the prefill answers with the prompt's KV
      FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 200,
                          R"({"choices":[],"kv_transfer_params":{"remote_block_ids":[]}})");
      c.clock.run_ready();
    }
    std::shared_ptr<FakeEngines::Call> answering;
    for (const auto& l : c.engines.open("/v1/completions"))
      if (host_of(*l) == "a") answering = l;
    ASSERT_TRUE(answering);
    FakeEngines::stream(*answering, kNoTokenStream);
    c.clock.run_ready();
    EXPECT_EQ(client->status, 400);
    EXPECT_EQ(client->body, kNoTokenError);
    EXPECT_FALSE(client->streaming);
    EXPECT_TRUE(client->complete());
    EXPECT_TRUE(c.engines.open("/v1/completions").empty());
    EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 0);
    EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"400\"}"), 1);
    expect_no_engine_blamed(c);
    EXPECT_EQ(c.dispatcher.active(), 0u);
  }
}

// Parallel mode streams the prefill leg too, for a streaming client: its first event being the
// client's error answers the client 400 as the decode leg's would, without retry or blame.
TEST(Dispatcher, AParallelPrefillLegsInvalidRequestErrorIsTheClients400) {
  Cluster c(two_engines_each_ejected_at_one_failure(PdMode::kParallel));
  auto client = c.send(true);
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  ASSERT_EQ(host_of(*legs[0]), "p1");
  FakeEngines::stream(*legs[0], kNoTokenStream);
  c.clock.run_ready();
  EXPECT_EQ(client->status, 400);
  EXPECT_EQ(client->body, kNoTokenError);
  EXPECT_TRUE(legs[1]->cancelled);  // the decode leg is given up
  EXPECT_TRUE(c.engines.open("/v1/completions").empty());
  EXPECT_EQ(c.engines.all("/v1/completions").size(), 2u);
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 0);
  expect_no_engine_blamed(c);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// An engine's own failure as a stream's first event is retried on another engine and counted
// against the failed one. vLLM's and SGLang's stream generators send theirs (a CUDA out-of-memory,
// a dead engine core) as {"type": "BadRequestError", "code": 400}: that is the engine's failure
// too, not the client's 400.
TEST(Dispatcher, AnEnginesFailureAsAStreamsFirstEventIsRetriedAndBlamedWhateverItsCode) {
  const std::string vllm_error =
      R"({"error":{"message":"EngineCore encountered an issue","type":"BadRequestError","param":null,"code":400}})";
  for (const std::string& error :
       {vllm_error, api::openai_error_body("generation failed: boom", "server_error")}) {
    SCOPED_TRACE(error);
    Cluster c(two_engines_each_ejected_at_one_failure(PdMode::kAggregated));
    auto client = c.send(true);
    auto first = c.engines.open("/v1/completions").at(0);
    ASSERT_EQ(host_of(*first), "a");
    FakeEngines::stream(*first, net::sse_event(error) + std::string(net::kSseDone));
    c.clock.run_ready();
    ASSERT_NO_FATAL_FAILURE(expect_retried_on_b(c, *client));
    EXPECT_EQ(c.endpoint("a")["healthy"], false);
  }
}

// After the client's stream began, the client's error is relayed as the stream's error event
// (the client's stream ends as the engine ended it) but is no failure of the engine's.
TEST(Dispatcher, AnInvalidRequestErrorMidStreamIsRelayedButNotCountedAgainstTheEngine) {
  Cluster c(two_engines_each_ejected_at_one_failure(PdMode::kAggregated));
  c.dispatcher.dashboard_state();  // the dashboard is open: the requests' records are kept
  auto client = c.send(true);
  const std::string events = kTokenEvent + kNoTokenStream;
  FakeEngines::stream(*c.engines.open("/v1/completions").at(0), events);
  c.clock.run_ready();
  expect_streamed_whole_and_recorded(c, *client, events, 400);
  expect_no_engine_blamed(c);
}

// A stream that fails after 3 token events: its error event is no output event, and the time
// to it no gap between tokens.
TEST(Dispatcher, AStreamsErrorEventIsNoTokenEvent) {
  Cluster c(two_engines_each_ejected_at_one_failure(PdMode::kAggregated));
  c.dispatcher.dashboard_state();  // the dashboard is open: the requests' records are kept
  auto client = c.send(true);
  auto call = c.engines.open("/v1/completions").at(0);
  FakeEngines::head(*call, 200, "text/event-stream");
  ASSERT_TRUE(FakeEngines::piece(*call, kTokenEvent + kTokenEvent + kTokenEvent));
  c.clock.advance_by(std::chrono::seconds(5));
  ASSERT_TRUE(FakeEngines::piece(
      *call, net::sse_event(api::openai_error_body("generation failed: boom", "server_error")) +
                 std::string(net::kSseDone)));
  FakeEngines::finish(*call, "");
  c.clock.run_ready();
  ASSERT_TRUE(client->complete());
  const json record = c.dispatcher.dashboard_state().at("recent").back();
  EXPECT_EQ(record.value("status", 0), 502) << record;
  EXPECT_EQ(record.value("output_events", -1), 3) << record;
  EXPECT_EQ(c.metric("vllm:inter_token_latency_seconds_count"), 2);
  EXPECT_EQ(c.metric("vllm:inter_token_latency_seconds_sum"), 0);
}

// Parallel mode: a prefill engine that refuses the client's request (a 400, or the client's error
// as its stream's first event) leaves its decode engine waiting for a room never filled, whose leg
// then fails too, naming no code, at about the same time (and the other way round). Whichever leg
// tells first, the client's error decides the attempt: the client gets its 400, nothing is
// retried, and neither engine is counted failed. The decode engine's 502 told first was retried
// and blamed it (ejected here).
TEST(Dispatcher, AParallelLegsClientErrorWinsOverItsPairsFailureWhicheverTellsFirst) {
  for (const bool stream : {false, true})
    for (const bool prefill_refuses : {true, false})
      for (const bool refusal_first : {true, false}) {
        SCOPED_TRACE(testing::Message() << "stream " << stream << ", prefill refuses "
                                        << prefill_refuses << ", refusal first " << refusal_first);
        Cluster c(two_engines_each_ejected_at_one_failure(PdMode::kParallel));
        auto client = c.send(stream);
        auto legs = c.engines.open("/v1/completions");
        ASSERT_EQ(legs.size(), 2u);
        ASSERT_EQ(host_of(*legs[0]), "p1");
        FakeEngines::Call& refusing = *legs[prefill_refuses ? 0 : 1];
        FakeEngines::Call& failing = *legs[prefill_refuses ? 1 : 0];
        auto refuse = [&] {
          if (stream)
            FakeEngines::stream(refusing, kNoTokenStream);
          else
            FakeEngines::answer(refusing, 400, kPromptTooLong);
        };
        if (refusal_first) refuse();
        FakeEngines::answer(failing, 502, kRoomFailed);
        if (!refusal_first) refuse();
        c.clock.run_ready();
        EXPECT_EQ(client->status, 400);
        EXPECT_EQ(client->body, stream ? kNoTokenError : kPromptTooLong);
        expect_decided_by_the_clients_error(c);
      }
}

// Parallel mode: a prefill engine that refuses the request for now (a 503 or 429 answer, or
// SGLang's queue-full event as its stream's first) leaves its decode engine waiting for a room
// never filled, whose leg then fails naming no code. Whichever leg tells first, the refusal
// decides the attempt: the decode engine is not counted failed, and the retry is a refusal's (it
// waits the backoff, the only prefill engine having refused; once retries are spent the client
// gets the 503 with the engine's Retry-After). The decode engine's 502 told first was retried at
// once, blamed that engine (ejected here), and ended in a 502.
TEST(Dispatcher, AParallelLegsRefusalWinsOverItsPairsFailureWhicheverTellsFirst) {
  for (const bool stream : {false, true})
    for (const bool refusal_first : {true, false}) {
      SCOPED_TRACE(testing::Message()
                   << "stream " << stream << ", refusal first " << refusal_first);
      Topology t = one_prefill_engine_each_ejected_at_one_failure();
      t.retry_backoff.first = milliseconds(40);
      t.retry_backoff.max = milliseconds(400);
      Cluster c(t);
      auto client = c.send(stream);
      auto fail_both = [&] {
        auto legs = c.engines.open("/v1/completions");
        ASSERT_EQ(legs.size(), 2u);
        ASSERT_EQ(host_of(*legs[0]), "p1");
        auto refuse = [&] {
          if (stream)
            FakeEngines::stream(*legs[0], net::sse_event(kQueueFull) + std::string(net::kSseDone));
          else
            FakeEngines::refuse(*legs[0], 503, kQueueFull, "3");
        };
        if (refusal_first) refuse();
        FakeEngines::answer(*legs[1], 502, kRoomFailed);
        if (!refusal_first) refuse();
        c.clock.run_ready();
      };
      ASSERT_NO_FATAL_FAILURE(fail_both());
      expect_no_engine_blamed(c);
      EXPECT_TRUE(c.engines.open("/v1/completions").empty()) << "sent straight back to p1";
      c.clock.advance_by(milliseconds(40));  // the first backoff is at most 40 ms
      ASSERT_NO_FATAL_FAILURE(fail_both());
      EXPECT_EQ(client->status, 503);
      EXPECT_EQ(client->body, kQueueFull);
      EXPECT_EQ(client->retry_after, stream ? "" : "3");
      EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
      EXPECT_EQ(
          c.metric("tandem:gateway_endpoint_overloaded_total{pool=\"prefill\",endpoint=\"p1\"}"),
          2);
      expect_no_engine_blamed(c);
      EXPECT_EQ(c.dispatcher.active(), 0u);
    }
}

// Parallel mode: a prefill engine refuses the request for now (a 503: its queue is full) and the
// decode engine finds it invalid (a 400) in the same attempt. Whichever tells first, the client's
// error decides: the client gets its 400 at once and no engine is counted failed. The refusal told
// first was retried, and once retries were spent the client got a 503 and, coming back, another
// for as long as the prefill engine had no room: its 400 only once it had.
TEST(Dispatcher, AParallelLegsClientErrorWinsOverItsPairsRefusalWhicheverTellsFirst) {
  for (const bool refusal_first : {true, false}) {
    SCOPED_TRACE(testing::Message() << "refusal first " << refusal_first);
    Cluster c(one_prefill_engine_each_ejected_at_one_failure());
    auto client = c.send(false);
    auto legs = c.engines.open("/v1/completions");
    ASSERT_EQ(legs.size(), 2u);
    ASSERT_EQ(host_of(*legs[0]), "p1");
    if (refusal_first) FakeEngines::refuse(*legs[0], 503, kQueueFull, "3");
    FakeEngines::answer(*legs[1], 400, kMaxTokensInvalid);
    if (!refusal_first) FakeEngines::refuse(*legs[0], 503, kQueueFull, "3");
    c.clock.run_ready();
    EXPECT_EQ(client->status, 400);
    EXPECT_EQ(client->body, kMaxTokensInvalid);
    EXPECT_EQ(client->retry_after, "");
    expect_decided_by_the_clients_error(c);
  }
}

// Parallel mode: a leg's failure handled (its attempt retried) cuts its pair; the pair's client
// error (a 400) that crossed the cut decides nothing: the failure still counts against its engine.
// The crossing 400 marked the attempt decided by the client's error, and the failed leg's
// accounting, which follows its report, then counted it as no failure of its engine's.
TEST(Dispatcher, AParallelLegsClientErrorCrossingThePairsHandledFailureChangesNothing) {
  Topology t =
      disaggregated(PdMode::kParallel, {engine("p1"), engine("p2")}, {engine("d1"), engine("d2")});
  t.prefill_retries = 1;
  Cluster c(t);
  auto client = c.send();
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  ASSERT_EQ(host_of(*legs[0]), "p1");
  ASSERT_EQ(host_of(*legs[1]), "d1");
  c.engines.answer_crossing_cancel = kMaxTokensInvalid;  // the prefill leg's answer crosses its cut
  c.engines.answer_crossing_cancel_status = 400;
  FakeEngines::answer(*legs[1], 500, "boom");
  c.clock.run_ready();
  c.engines.answer_crossing_cancel.clear();
  EXPECT_TRUE(legs[0]->cancelled);
  EXPECT_EQ(c.endpoint("d1")["consecutive_failures"], 1);
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
  EXPECT_FALSE(client->complete());
  c.answer_all();
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// The same for an attempt answered without retry (a decode leg's whole answer timed out: 504): the
// prefill leg's client error (a 400) that crossed the cut decides nothing, and the timed-out
// decode engine is blamed (ejected here). The crossing 400 made the decode leg's timeout no
// failure of its engine's.
TEST(Dispatcher, AParallelLegsClientErrorCrossingThePairsTimedOutWholeAnswerChangesNothing) {
  Topology t = two_engines_each_ejected_at_one_failure(PdMode::kParallel);
  t.timeouts.first_token = milliseconds(500);
  Cluster c(t);
  auto client = c.send(false);
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  ASSERT_EQ(host_of(*legs[0]), "p1");
  ASSERT_EQ(host_of(*legs[1]), "a");
  c.engines.answer_after_cancel = true;  // the decode leg's deadline cuts it; the test ends it
  c.clock.advance_by(milliseconds(500));
  ASSERT_TRUE(legs[1]->cancelled);
  c.engines.answer_after_cancel = false;
  FakeEngines::finish(*legs[1], "cancelled");
  c.engines.answer_crossing_cancel = kMaxTokensInvalid;  // the prefill leg's answer crosses its cut
  c.engines.answer_crossing_cancel_status = 400;
  c.clock.run_ready();
  c.engines.answer_crossing_cancel.clear();
  EXPECT_TRUE(legs[0]->cancelled);
  EXPECT_EQ(client->status, 504);
  EXPECT_EQ(c.endpoint("a")["consecutive_failures"], 1);
  EXPECT_EQ(c.endpoint("a")["healthy"], false);
  EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 0);
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 0);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// Parallel mode: the decode leg's whole answer timed out (its deadline cut it), or was larger than
// the gateway holds, and the prefill leg's client error (a 400) came before that was answered: the
// 400 decides the attempt, as it does over any failure of its pair's. The client was answered 504
// (or 502) "engine a sent no whole answer", and its 400 was lost.
TEST(Dispatcher, AParallelLegsClientErrorBeforeThePairsTimedOutOrTooLargeAnswerIsAnsweredDecides) {
  for (const bool timed_out : {true, false}) {
    SCOPED_TRACE(testing::Message() << "timed out " << timed_out);
    Topology t = two_engines_each_ejected_at_one_failure(PdMode::kParallel);
    t.timeouts.first_token = milliseconds(500);
    t.max_answer_bytes = 1024;
    Cluster c(t);
    auto client = c.send(false);
    auto legs = c.engines.open("/v1/completions");
    ASSERT_EQ(legs.size(), 2u);
    ASSERT_EQ(host_of(*legs[0]), "p1");
    ASSERT_EQ(host_of(*legs[1]), "a");
    if (timed_out) {
      c.engines.answer_after_cancel = true;  // the decode leg's deadline cuts it; the test ends it
      c.clock.advance_by(milliseconds(500));
      ASSERT_TRUE(legs[1]->cancelled);
      c.engines.answer_after_cancel = false;
    } else {
      FakeEngines::head(*legs[1], 200, "application/json");
      ASSERT_FALSE(FakeEngines::piece(*legs[1], std::string(1100, 'x')));
    }
    FakeEngines::finish(*legs[1], "cancelled");             // its answer (504 or 502) is posted
    FakeEngines::answer(*legs[0], 400, kMaxTokensInvalid);  // and the 400 comes before it runs
    c.clock.run_ready();
    EXPECT_EQ(client->status, 400);
    EXPECT_EQ(client->body, kMaxTokensInvalid);
    expect_decided_by_the_clients_error(c);
  }
}

// A refusal retried where every engine of a pool was tried waits the retry backoff, lest it meet
// the same full queue at once; an engine that failed the request (and did not refuse it) is no
// full queue. Parallel mode, one prefill engine: p1 failed the first attempt, a decode engine
// refused the second; the third goes at once, to p1 and the other decode engine. p1's failure
// counted as a refusal, and the third attempt waited the backoff.
TEST(Dispatcher, AParallelRefusalBehindAPrefillEngineThatOnlyFailedIsRetriedAtOnce) {
  Topology t = disaggregated(PdMode::kParallel, {engine("p1")}, {engine("d1"), engine("d2")});
  t.prefill_retries = 2;
  Cluster c(t);
  auto client = c.send();
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  ASSERT_EQ(host_of(*legs[0]), "p1");
  FakeEngines::answer(*legs[0], 500, "boom");
  c.clock.run_ready();
  legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  ASSERT_EQ(host_of(*legs[0]), "p1");
  const std::string refusing = host_of(*legs[1]);
  FakeEngines::refuse(*legs[1], 503, kQueueFull, "3");
  c.clock.run_ready();
  legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);  // no backoff: the clock did not move
  EXPECT_EQ(host_of(*legs[0]), "p1");
  EXPECT_NE(host_of(*legs[1]), refusing);
  c.answer_all();
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 2);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// n > 1: a choice whose stream fails after the client's stream began ends the merged stream with
// its error event, and every choice's request is recorded as that error says: the client's 400 or
// a refusal's 429 (no engine blamed), or the engine's failure, 502. The failing choice was
// recorded 499 (its [DONE] after the error was refused as by a client gone) and the others 502
// whatever the error. Nothing after the error is read: the failing choice's call is ended at its
// next bytes (an engine that went on sending was read to its end).
TEST(Dispatcher, AChoicesMidStreamErrorIsRecordedForEveryChoiceAsItsErrorSays) {
  const std::pair<std::string, int> cases[] = {
      {kNoTokenError, 400},
      {kRateLimited, 429},
      {api::openai_error_body("generation failed: boom", "server_error"), 502}};
  for (const auto& [error, status] : cases) {
    SCOPED_TRACE(status);
    Cluster c(two_engines_each_ejected_at_one_failure(PdMode::kAggregated));
    auto client = c.send_choices(2, {}, true);
    auto legs = c.engines.open("/v1/completions");
    ASSERT_EQ(legs.size(), 2u);
    for (const auto& l : legs) {
      FakeEngines::head(*l, 200, "text/event-stream");
      ASSERT_TRUE(FakeEngines::piece(*l, kTokenEvent));
    }
    ASSERT_TRUE(FakeEngines::piece(*legs[1], net::sse_event(error)));
    // The engine goes on after its error: the gateway ends the call.
    const bool more_taken = FakeEngines::piece(*legs[1], kTokenEvent + std::string(net::kSseDone));
    FakeEngines::finish(*legs[1], more_taken ? "" : "cancelled");
    c.clock.run_ready();
    EXPECT_FALSE(more_taken);
    EXPECT_TRUE(legs[0]->cancelled);
    EXPECT_TRUE(client->complete());
    const std::string tail = net::sse_event(error) + std::string(net::kSseDone);
    ASSERT_GE(client->streamed.size(), tail.size());
    EXPECT_EQ(client->streamed.substr(client->streamed.size() - tail.size()), tail);
    EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"" + std::to_string(status) + "\"}"),
              2);
    EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"499\"}"), 0);
    EXPECT_EQ(c.endpoint(host_of(*legs[0]))["consecutive_failures"], 0);
    EXPECT_EQ(c.endpoint(host_of(*legs[1]))["consecutive_failures"], status == 502 ? 1 : 0);
    EXPECT_EQ(c.dispatcher.active(), 0u);
  }
}

// A rate limit an engine streams under its 200 (code 429, or OpenAI's rate_limit_exceeded: vLLM
// and SGLang send it only as a status, but an engine behind a proxy may stream it) is a refusal,
// as a 429 answer is: retried elsewhere and not counted toward the engine's ejection; once retries
// are spent the client gets that 429 with the engine's error. It was the engine's failure.
TEST(Dispatcher, ARateLimitAsAStreamsFirstEventIsARefusalNotTheEnginesFailure) {
  const std::string exceeded =
      R"({"error":{"message":"rate limit reached","type":"requests","code":"rate_limit_exceeded"}})";
  Cluster c(two_engines_each_ejected_at_one_failure(PdMode::kAggregated));
  auto client = c.send(true);
  auto first = c.engines.open("/v1/completions").at(0);
  ASSERT_EQ(host_of(*first), "a");
  FakeEngines::stream(*first, net::sse_event(kRateLimited) + std::string(net::kSseDone));
  c.clock.run_ready();
  const auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(host_of(*retry[0]), "b");
  EXPECT_FALSE(client->complete());
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
  FakeEngines::stream(*retry[0], net::sse_event(exceeded) + std::string(net::kSseDone));
  c.clock.run_ready();
  EXPECT_EQ(client->status, 429);
  EXPECT_EQ(client->body, exceeded);
  EXPECT_FALSE(client->streaming);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"429\"}"), 1);
  expect_no_engine_blamed(c);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A rate limit an engine streams after the client's stream began is relayed as it came (the
// client's stream ends as the engine ended it), and the stream ended as the engine's refusal:
// recorded 429, and counted as its engine being full, neither a success of its (which would clear
// its failures) nor a failure toward its ejection. It was recorded 429 but counted the engine's
// success.
TEST(Dispatcher, ARateLimitMidStreamIsRecordedAndCountedAsTheEnginesRefusal) {
  Topology t = one_engine_without_retries();
  t.health.failures_to_eject = 2;
  Cluster c(t);
  c.dispatcher.dashboard_state();  // the dashboard is open: the requests' records are kept
  // A failure of a's first: a success would clear it.
  auto failed = c.send();
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 500, "boom");
  c.clock.run_ready();
  ASSERT_TRUE(failed->complete());
  ASSERT_EQ(c.endpoint("a")["consecutive_failures"], 1);
  auto client = c.send(true);
  auto call = c.engines.open("/v1/completions").at(0);
  const std::string events =
      kTokenEvent + net::sse_event(kRateLimited) + std::string(net::kSseDone);
  FakeEngines::stream(*call, events);
  c.clock.run_ready();
  expect_streamed_whole_and_recorded(c, *client, events, 429);
  EXPECT_EQ(c.endpoint("a")["healthy"], true);
  EXPECT_EQ(c.endpoint("a")["consecutive_failures"], 1);
  EXPECT_EQ(c.metric("tandem:gateway_endpoint_overloaded_total{pool=\"decode\",endpoint=\"a\"}"),
            1);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A refusal an engine streams after the client's stream began, its connection then closed without
// [DONE], is still its refusal: recorded 429, as its leg is counted (the engine full), and the
// client's stream ends as the engine's error then [DONE]. It was recorded 502 (a stream cut, a
// second error event after the engine's) while its leg counted the engine full.
TEST(Dispatcher, ARateLimitMidStreamThenACloseWithoutDoneStaysTheEnginesRefusal) {
  Cluster c(one_engine_without_retries());
  c.dispatcher.dashboard_state();  // the dashboard is open: the requests' records are kept
  auto client = c.send(true);
  const std::string events = kTokenEvent + net::sse_event(kRateLimited);
  FakeEngines::stream(*c.engines.open("/v1/completions").at(0), events);
  c.clock.run_ready();
  EXPECT_EQ(client->streamed, events + std::string(net::kSseDone));
  EXPECT_TRUE(client->complete());
  EXPECT_FALSE(client->aborted);
  const json record = c.dispatcher.dashboard_state().at("recent").back();
  EXPECT_EQ(record.value("status", 0), 429) << record;
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"429\"}"), 1);
  EXPECT_EQ(c.metric("tandem:gateway_endpoint_overloaded_total{pool=\"decode\",endpoint=\"a\"}"),
            1);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// Once the engine's error event for the client's mistake reached the client, the request is
// decided (a 400): a connection to the engine that breaks afterwards, or an event too large after
// it (the gateway's own cut), is no failure of the engine's. The record said 400 while the leg
// counted toward the engine's ejection.
TEST(Dispatcher, AClientErrorEventMidStreamThenACutIsNotTheEnginesFailure) {
  for (const bool oversized : {false, true}) {
    SCOPED_TRACE(oversized ? "an event too large after it" : "the connection reset after it");
    Topology t = one_engine_without_retries();
    t.max_answer_bytes = 4096;
    Cluster c(t);
    c.dispatcher.dashboard_state();
    auto client = c.send(true);
    auto call = c.engines.open("/v1/completions").at(0);
    FakeEngines::head(*call, 200, "text/event-stream");
    ASSERT_TRUE(FakeEngines::piece(*call, kTokenEvent + net::sse_event(kNoTokenError)));
    if (oversized) {
      EXPECT_FALSE(FakeEngines::piece(*call, "data: " + std::string(8192, 'x')));
      FakeEngines::finish(*call, "cancelled");
    } else {
      FakeEngines::finish(*call, "connection reset by peer");
    }
    c.clock.run_ready();
    const json record = c.dispatcher.dashboard_state().at("recent").back();
    EXPECT_EQ(record.value("status", 0), 400) << record;
    EXPECT_EQ(c.metric("tandem:gateway_endpoint_failures_total{pool=\"decode\",endpoint=\"a\"}"),
              0);
    EXPECT_EQ(c.dispatcher.active(), 0u);
  }
}

// A client whose connection broke as the engine's error event was written to it never had that
// error: it left (499), as any client whose write failed. The error event counted as written
// before the write, and the request was recorded as the engine's failure (502).
TEST(Dispatcher, AClientGoneAsTheEnginesErrorEventIsWrittenIsRecordedAsGone) {
  Cluster c(one_engine_without_retries());
  c.dispatcher.dashboard_state();
  auto client = c.send(true);
  auto call = c.engines.open("/v1/completions").at(0);
  FakeEngines::head(*call, 200, "text/event-stream");
  ASSERT_TRUE(FakeEngines::piece(*call, kTokenEvent));
  client->break_connection();
  EXPECT_FALSE(FakeEngines::piece(
      *call, net::sse_event(api::openai_error_body("generation failed", "server_error"))));
  FakeEngines::finish(*call, "cancelled");
  c.clock.run_ready();
  EXPECT_EQ(client->streamed, kTokenEvent);
  EXPECT_TRUE(client->aborted);
  const json record = c.dispatcher.dashboard_state().at("recent").back();
  EXPECT_EQ(record.value("status", 0), 499) << record;
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// SGLang's stream handlers send a scheduler's abort as the stream's first event under the 200
// (create_streaming_error_response with the abort's status): a full queue (--max-queued-requests)
// or an eviction by a higher priority is {"type": "SERVICE_UNAVAILABLE", "code": 503}. That is the
// engine being full, a refusal as its 503 answer is: retried elsewhere, no engine blamed, and once
// retries are spent the client gets the 503 with the engine's error. It was the engine's failure,
// counted toward its ejection, and the client got a 502. Some proxies send the code as a string.
TEST(Dispatcher, AFullQueueAsAStreamsFirstEventIsARefusalNotTheEnginesFailure) {
  const std::string queue_full =
      R"({"error":{"message":"The request queue is full.","type":"SERVICE_UNAVAILABLE","param":null,"code":503}})";
  const std::string as_string =
      R"({"error":{"message":"The request queue is full.","type":"SERVICE_UNAVAILABLE","code":"503"}})";
  Cluster c(two_engines_each_ejected_at_one_failure(PdMode::kAggregated));
  auto client = c.send(true);
  auto first = c.engines.open("/v1/completions").at(0);
  ASSERT_EQ(host_of(*first), "a");
  FakeEngines::stream(*first, net::sse_event(queue_full) + std::string(net::kSseDone));
  c.clock.run_ready();
  const auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(host_of(*retry[0]), "b");
  EXPECT_FALSE(client->complete());
  FakeEngines::stream(*retry[0], net::sse_event(as_string) + std::string(net::kSseDone));
  c.clock.run_ready();
  EXPECT_EQ(client->status, 503);
  EXPECT_EQ(client->body, as_string);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"503\"}"), 1);
  expect_no_engine_blamed(c);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// ------------------------------------------------------------------------------- timeouts

TEST(Dispatcher, TheFirstTokenTimeoutCancelsTheLegAndRetriesElsewhere) {
  Topology t = aggregated({engine("a"), engine("b")});
  t.timeouts.first_token = milliseconds(500);
  Cluster c(t);
  auto client = c.send(true);
  auto first = c.engines.open("/v1/completions").at(0);
  c.clock.advance_by(milliseconds(499));
  EXPECT_FALSE(first->cancelled);
  c.clock.advance_by(milliseconds(1));
  EXPECT_TRUE(first->cancelled);
  auto second = c.engines.open("/v1/completions");
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(host_of(*second[0]), "b");
  EXPECT_EQ(c.endpoint("a")["consecutive_failures"], 1);  // a timeout is the engine's fault
  EXPECT_FALSE(client->complete());
}

TEST(Dispatcher, AStreamThatStartedIsNotCutByTheFirstTokenTimeout) {
  Topology t = aggregated({engine("a")});
  t.timeouts.first_token = milliseconds(500);
  Cluster c(t);
  auto client = c.send(true);
  auto call = c.engines.open("/v1/completions").at(0);
  FakeEngines::head(*call, 200, "text/event-stream");
  FakeEngines::piece(*call, "data: {\"choices\":[{\"text\":\"a\"}]}\n\n");
  c.clock.advance_by(milliseconds(5000));
  EXPECT_FALSE(call->cancelled);
  EXPECT_TRUE(client->streaming);
}

TEST(Dispatcher, ARequestNoEngineTakesWithinTheQueueTimeoutGets503SayingWhy) {
  Topology t = aggregated({engine("a", 0, 1)});
  t.timeouts.queue = milliseconds(2000);
  Cluster c(t);
  auto running = c.send();
  auto waiting = c.send();
  EXPECT_EQ(c.dispatcher.waiting(), 1u);
  c.clock.advance_by(milliseconds(1999));
  EXPECT_FALSE(waiting->complete());
  c.clock.advance_by(milliseconds(1));
  EXPECT_EQ(waiting->status, 503);
  EXPECT_NE(waiting->error_message.find("queue timeout"), std::string::npos);
  EXPECT_NE(waiting->error_message.find("decode pool: 1 engine, 1 at the in-flight limit"),
            std::string::npos)
      << waiting->error_message;
  EXPECT_FALSE(running->complete());
  EXPECT_EQ(c.dispatcher.waiting(), 0u);
}

// vllm:num_requests_running counts what engines serve, not the queue too (it counted every
// request in the gateway); vllm:num_requests_waiting the queue. So does the dashboard's state.
TEST(Dispatcher, RunningCountsWhatEnginesServeWithoutTheQueue) {
  Cluster c(aggregated({engine("a", 0, 1)}));
  auto first = c.send();
  auto second = c.send();
  auto third = c.send();
  EXPECT_EQ(c.metric("vllm:num_requests_running"), 1);
  EXPECT_EQ(c.metric("vllm:num_requests_waiting"), 2);
  const json state = c.dispatcher.dashboard_state();
  EXPECT_EQ(state["running"], 1);
  EXPECT_EQ(state["waiting"], 2);
  c.answer_all();  // the second starts
  EXPECT_EQ(c.metric("vllm:num_requests_running"), 1);
  EXPECT_EQ(c.metric("vllm:num_requests_waiting"), 1);
  c.answer_all();
  c.answer_all();
  EXPECT_EQ(third->status, 200);
  EXPECT_EQ(c.metric("vllm:num_requests_running"), 0);
  EXPECT_EQ(c.metric("vllm:num_requests_waiting"), 0);
}

TEST(Dispatcher, AWaitingRequestStartsWhenAnEngineFrees) {
  Cluster c(aggregated({engine("a", 0, 1)}));
  auto first = c.send();
  auto second = c.send();
  ASSERT_EQ(c.engines.open().size(), 1u);
  c.answer_all();
  EXPECT_EQ(first->status, 200);
  ASSERT_EQ(c.engines.open().size(), 1u);  // the second took the freed slot
  c.answer_all();
  EXPECT_EQ(second->status, 200);
  EXPECT_EQ(c.clock.pending_timers(), 0u);  // no queue or deadline timer left behind
}

TEST(Dispatcher, AFullQueueAnswers429) {
  Topology t = aggregated({engine("a", 0, 1)});
  t.max_queue = 1;
  Cluster c(t);
  c.send();
  c.send();
  auto refused = c.send();
  EXPECT_EQ(refused->status, 429);
  EXPECT_EQ(refused->error_code, "rate_limit_exceeded");
}

// The gateway's own overload answers are no client error, and say when to come back (OpenAI's
// SDKs honour Retry-After): a full queue's 429 is of type "requests" (OpenAI's rate limits), a
// queue timeout's 503 of type "server_error".
TEST(Dispatcher, OverloadAnswersCarryRetryAfterAndANonClientType) {
  Topology t = aggregated({engine("a", 0, 1)});
  t.max_queue = 1;
  t.timeouts.queue = milliseconds(2000);
  Cluster c(t);
  c.send();
  auto timed_out = c.send();
  auto refused = c.send();
  EXPECT_EQ(refused->status, 429);
  EXPECT_EQ(refused->error_code, "rate_limit_exceeded");
  EXPECT_EQ(refused->error_type, "requests");
  EXPECT_EQ(refused->retry_after, "1");
  c.clock.advance_by(milliseconds(2000));
  EXPECT_EQ(timed_out->status, 503);
  EXPECT_EQ(timed_out->error_type, "server_error");
  EXPECT_EQ(timed_out->retry_after, "1");
}

// `t` with its queue bounded to `bytes` of request bodies (Topology::max_queued_body_bytes).
Topology with_queued_body_bytes(Topology t, size_t bytes) {
  t.max_queued_body_bytes = bytes;
  return t;
}

// The queue is bounded in bytes too (Topology::max_queued_body_bytes): an arrival whose
// body would take the waiting bodies past the bound gets 429 as at a full queue, though max_queue
// has places; a place freed admits the next. A gateway holding many 8 MiB bodies ran out of memory.
TEST(Dispatcher, AnArrivalPastTheQueuesByteBoundGets429) {
  const size_t body =
      json{{"model", "m"}, {"prompt", "hello there"}, {"stream", false}}.dump().size();
  Cluster c(with_queued_body_bytes(aggregated({engine("a", 0, 1)}), 2 * body));
  auto running = c.send();
  auto first = c.send(), second = c.send();
  EXPECT_EQ(c.dispatcher.waiting(), 2u);
  auto refused = c.send();
  EXPECT_EQ(refused->status, 429);
  EXPECT_EQ(refused->retry_after, "1");
  EXPECT_EQ(refused->error_code, "rate_limit_exceeded");
  EXPECT_NE(refused->error_message.find("max_queued_body_bytes " + std::to_string(2 * body)),
            std::string::npos)
      << refused->error_message;
  c.answer_all();  // `first` starts
  EXPECT_EQ(running->status, 200);
  auto admitted = c.send();
  EXPECT_FALSE(admitted->complete());
  EXPECT_EQ(c.dispatcher.waiting(), 2u);
  for (int i = 0; i < 3; ++i) c.answer_all();
  EXPECT_EQ(admitted->status, 200);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

TEST(Dispatcher, RequestsSubmittedTogetherAreAllRefusedWhenTheQueueIsFull) {
  Topology t = aggregated({engine("a", 0, 1)});
  t.max_queue = 2;
  Cluster c(t);
  c.send();
  c.send();
  c.send();  // both wait: the queue is full
  for (const auto& client : c.send_together(2)) EXPECT_EQ(client->status, 429);
  EXPECT_EQ(c.dispatcher.waiting(), 2u);
  EXPECT_EQ(c.engines.open().size(), 1u);
}

// Requests submitted together join a queue that has a place free, overshooting max_queue by at
// most their number less one (n is at most max_queue). Needing all their places free at once, a
// group met a queue kept near its bound by single requests full every time, and starved.
TEST(Dispatcher, RequestsSubmittedTogetherJoinAQueueWithAPlaceFree) {
  Topology t = aggregated({engine("a", 0, 1)});
  t.max_queue = 3;
  Cluster c(t);
  auto first = c.send();
  auto second = c.send();  // waits
  auto third = c.send();   // waits: one place is left
  const auto together = c.send_together(3);
  for (const auto& client : together) EXPECT_EQ(client->status, 0);  // no answer yet
  EXPECT_EQ(c.dispatcher.waiting(), 5u);  // 2 past max_queue: the queue is full now
  auto refused = c.send();
  EXPECT_EQ(refused->status, 429);
  for (const auto& client : c.send_together(2)) EXPECT_EQ(client->status, 429);
  EXPECT_EQ(c.dispatcher.waiting(), 5u);
  for (int i = 0; i < 6; ++i) c.answer_all();  // one at a time through the one slot
  for (const auto& client : {first, second, third}) EXPECT_EQ(client->status, 200);
  for (const auto& client : together) EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.dispatcher.waiting(), 0u);
}

// A request of more choices than max_queue can never be queued whole: it is the client's error (a
// 400 naming n and max_queue), not a rate limit that OpenAI's SDKs would retry in vain.
TEST(Dispatcher, MoreChoicesThanMaxQueueIsA400NamingNAndMaxQueue) {
  Topology t = aggregated({engine("a", 0, 1)});
  t.max_queue = 8;
  Cluster c(t);
  auto client = c.send_choices(16);
  EXPECT_EQ(client->status, 400);
  EXPECT_EQ(client->answers, 1);
  const json error = json::parse(client->body)["error"];
  EXPECT_EQ(error["type"], "invalid_request_error");
  const std::string message = error["message"];
  EXPECT_NE(message.find("`n`"), std::string::npos) << message;
  EXPECT_NE(message.find("max_queue"), std::string::npos) << message;
  EXPECT_EQ(client->retry_after, "");
  EXPECT_TRUE(c.engines.open("/v1/completions").empty());
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// --------------------------------------------------------------------------- client leaves

TEST(Dispatcher, AClientThatLeavesCancelsItsLegWithoutBlamingTheEngine) {
  Cluster c(aggregated({engine("a")}));
  auto client = c.send(true);
  auto call = c.engines.open("/v1/completions").at(0);
  client->leave();
  c.clock.run_ready();
  EXPECT_TRUE(call->cancelled);
  EXPECT_EQ(c.endpoint("a")["consecutive_failures"], 0);
  EXPECT_EQ(c.endpoint("a")["in_flight"], 0);
  EXPECT_EQ(c.dispatcher.active(), 0u);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"499\"}"), 1);
}

// ------------------------------------------------------------------------------ shutdown

// A stopping gateway's drain: the requests in flight go on as ever (a failure is still retried)
// and the gateway is idle once they all ended.
TEST(Dispatcher, TheDrainWaitsForTheRequestsInFlightWhichGoOnAsEver) {
  Cluster c(aggregated({engine("a"), engine("b")}));
  bool idle = false;
  c.dispatcher.when_idle([&] { idle = true; });
  EXPECT_TRUE(idle);  // nothing in flight: idle at once
  idle = false;
  auto client = c.send();
  c.dispatcher.when_idle([&] { idle = true; });
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 500,
                      R"({"error":{"message":"boom"}})");
  c.clock.run_ready();
  EXPECT_FALSE(idle);
  ASSERT_EQ(c.engines.open("/v1/completions").size(), 1u);  // retried on b
  c.answer_all("from b");
  EXPECT_EQ(client->status, 200);
  EXPECT_TRUE(idle);
}

// Once the drain is over, every request left ends as the gateway's doing: a client with nothing
// yet gets 503 in OpenAI error JSON (not a closed connection), a stream ends with that error
// event, a waiting request gets 503; nothing is retried and no engine is blamed. Requests that
// come after get 503 too.
TEST(Dispatcher, ShutDownAnswersTheRequestsLeft503WithoutRetryOrBlame) {
  Topology t = aggregated({engine("a", 0, 1), engine("b", 0, 1)});
  t.health.failures_to_eject = 1;
  Cluster c(t);
  auto whole = c.send();
  auto streaming = c.send(true);
  const auto stream_call = c.engines.open("/v1/completions").at(1);
  FakeEngines::head(*stream_call, 200, "text/event-stream");
  const std::string first = "data: {\"choices\":[{\"text\":\"hi\"}]}\n\n";
  ASSERT_TRUE(FakeEngines::piece(*stream_call, first));
  auto waiting = c.send();
  ASSERT_EQ(c.dispatcher.waiting(), 1u);
  const auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);

  c.dispatcher.shut_down();
  c.clock.run_ready();
  for (const auto& leg : legs) EXPECT_TRUE(leg->cancelled);
  EXPECT_EQ(whole->status, 503);
  EXPECT_EQ(whole->error_message, "the gateway is shutting down");
  EXPECT_EQ(whole->error_type, "server_error");
  EXPECT_EQ(waiting->status, 503);
  EXPECT_EQ(waiting->error_message, "the gateway is shutting down");
  json error;
  ASSERT_NO_FATAL_FAILURE(expect_error_event_then_done_after(*streaming, first, error));
  EXPECT_EQ(error.at("message"), "the answer was cut: the gateway is shutting down");
  EXPECT_TRUE(streaming->complete());
  EXPECT_FALSE(streaming->aborted);
  EXPECT_EQ(c.engines.all("/v1/completions").size(), 2u);  // no retry, no leg for the waiting one
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 0);
  for (const char* name : {"a", "b"}) {
    EXPECT_EQ(c.endpoint(name)["consecutive_failures"], 0) << name;
    EXPECT_EQ(c.endpoint(name)["healthy"], true) << name;
    EXPECT_EQ(c.endpoint(name)["in_flight"], 0) << name;
  }
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"503\"}"), 3);
  EXPECT_EQ(c.dispatcher.active(), 0u);

  auto late = c.send();
  EXPECT_EQ(late->status, 503);
  EXPECT_EQ(late->error_message, "the gateway is shutting down");
  EXPECT_EQ(c.engines.all("/v1/completions").size(), 2u);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// Parallel mode: both legs of a request are cancelled, neither engine blamed, and the prefill
// leg's cancel retries nothing.
TEST(Dispatcher, ShutDownEndsBothLegsOfAParallelRequest) {
  Cluster c(
      disaggregated(PdMode::kParallel, {engine("p1"), engine("p2")}, {engine("d1"), engine("d2")}));
  auto client = c.send();
  const auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  c.dispatcher.shut_down();
  c.clock.run_ready();
  EXPECT_TRUE(legs[0]->cancelled);
  EXPECT_TRUE(legs[1]->cancelled);
  EXPECT_EQ(client->status, 503);
  EXPECT_EQ(c.engines.all("/v1/completions").size(), 2u);
  EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 0);
  EXPECT_EQ(c.endpoint("d1")["consecutive_failures"], 0);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// -------------------------------------------------------------------------- P/D flows

TEST(Dispatcher, SequentialModeSendsTheDecodeLegThePrefillsKvTransferParams) {
  Cluster c(disaggregated(PdMode::kSequential, {engine("p")}, {engine("d")}));
  auto client = c.send();
  auto prefill = c.engines.open("/v1/completions").at(0);
  EXPECT_EQ(host_of(*prefill), "p");
  const json prefill_body = json::parse(prefill->request.body);
  EXPECT_EQ(prefill_body["max_tokens"], 1);
  EXPECT_EQ(prefill_body["kv_transfer_params"]["do_remote_decode"], true);
  const json params = {{"do_remote_prefill", true},
                       {"remote_engine_id", "p-1"},
                       {"remote_block_ids", {1, 2}},
                       {"remote_host", "p.engines"},
                       {"remote_port", 9000}};
  FakeEngines::answer(*prefill, 200, json{{"kv_transfer_params", params}}.dump());
  c.clock.run_ready();
  auto decode = c.engines.open("/v1/completions");
  ASSERT_EQ(decode.size(), 1u);
  EXPECT_EQ(host_of(*decode[0]), "d");
  EXPECT_EQ(json::parse(decode[0]->request.body)["kv_transfer_params"], params);
  c.answer_all("decoded");
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(json::parse(client->body)["choices"][0]["text"], "decoded");
}

// Answers every open health probe: 200, but a connection refused for the engines in `down`.
void probes_answer(Cluster& c, const std::set<std::string>& down = {}) {
  for (const auto& p : c.engines.open("/health")) {
    if (down.count(host_of(*p)))
      FakeEngines::finish(*p, "connection refused");
    else
      FakeEngines::answer(*p, 200, "");
  }
  c.clock.run_ready();
}

// Starts the cluster's health checks and passes every engine's first probe.
void start_probes(Cluster& c) {
  c.health.start();
  probes_answer(c);
}

// Two groups, each with a prefill and a decode engine, sequential mode, engines ejected at their
// first failed probe.
Topology two_groups(int64_t p0_limit = 0) {
  return probed_every_second(disaggregated(PdMode::kSequential,
                                           {engine("p0", 0, p0_limit), engine("p1", 1)},
                                           {engine("d0", 0), engine("d1", 1)}));
}

// Sequential mode prefills only where the prompt's KV can be decoded: a prefill engine whose
// group has no eligible decode engine is no candidate, as parallel mode's pairs have it
// (docs/gateway.md: a decode engine only serves requests prefilled in its own group). It was
// picked as any: every other request got 503 "no healthy engine" though group 0 could serve it,
// and with no decode engine left a request was prefilled first, its KV held for nothing.
TEST(Dispatcher, SequentialModePrefillsOnlyInAGroupThatCanDecode) {
  Topology t = two_groups();
  t.policy = "round_robin";
  Cluster c(t);
  c.health.start();
  probes_answer(c, {"d1"});
  ASSERT_EQ(c.endpoint("d1")["healthy"], false);
  std::vector<std::shared_ptr<FakeClient>> clients;
  for (int i = 0; i < 4; ++i) clients.push_back(c.send());
  const auto prefills = c.engines.open("/v1/completions");
  ASSERT_EQ(prefills.size(), 4u);
  for (const auto& p : prefills) EXPECT_EQ(host_of(*p), "p0");
  for (const auto& client : clients) EXPECT_FALSE(client->complete()) << client->error_message;

  // No decode engine left: 503 at once, and no prefill for it.
  c.clock.advance_by(milliseconds(1000));
  probes_answer(c, {"d0", "d1"});
  auto refused = c.send();
  EXPECT_EQ(refused->status, 503);
  EXPECT_EQ(c.engines.all("/v1/completions").size(), 4u);
  EXPECT_NE(refused->error_message.find(
                "prefill pool: 2 engines, 2 whose group has no eligible decode engine"),
            std::string::npos)
      << refused->error_message;
}

// "Every engine was tried" is judged as the policies see the pool: a prefill engine whose group has
// no eligible decode engine is none the retry could go to. It was counted as untried, so a retry
// after p0's 429 went straight back to p0 (the policy's fallback to the engines that refused).
TEST(Dispatcher, ARefusalRetriedWhereOnlyAPrefillEngineOfAGroupThatCannotDecodeIsLeftWaits) {
  Topology t = two_groups();
  t.prefill_retries = 1;
  t.retry_backoff.first = milliseconds(40);
  t.retry_backoff.max = milliseconds(400);
  Cluster c(t);
  c.health.start();
  probes_answer(c, {"d1"});
  ASSERT_EQ(c.endpoint("d1")["healthy"], false);
  auto client = c.send();
  auto prefill = c.engines.open("/v1/completions");
  ASSERT_EQ(prefill.size(), 1u);
  ASSERT_EQ(host_of(*prefill[0]), "p0");
  FakeEngines::refuse(*prefill[0], 429, kEngineFull, "3");
  c.clock.run_ready();
  EXPECT_TRUE(c.engines.open("/v1/completions").empty()) << "sent straight back";
  c.clock.advance_by(milliseconds(40));
  auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 1u) << "not sent after the backoff";
  EXPECT_EQ(host_of(*retry[0]), "p0");
  EXPECT_FALSE(client->complete());
}

// A 503 that says why no engine took a request names the reason each idle engine could not:
// a prefill engine whose group cannot decode was "over the policy's load limits", a reason
// least_load does not even have.
TEST(Dispatcher, TheQueueTimeoutsReasonNamesAPrefillGroupThatCannotDecode) {
  Topology t = two_groups(1);
  t.timeouts.queue = milliseconds(2000);
  Cluster c(t);
  c.health.start();
  probes_answer(c, {"d1"});
  auto running = c.send();
  auto waiting = c.send();
  EXPECT_EQ(c.dispatcher.waiting(), 1u);
  // The probes keep being answered: an engine ejected by an unanswered probe would have its legs
  // cut (Dispatcher::engines_changed).
  c.clock.advance_by(milliseconds(1000));
  probes_answer(c, {"d1"});
  c.clock.advance_by(milliseconds(1000));
  EXPECT_EQ(waiting->status, 503);
  EXPECT_NE(waiting->error_message.find("prefill pool: 2 engines, 1 at the in-flight limit, 1 "
                                        "whose group has no eligible decode engine"),
            std::string::npos)
      << waiting->error_message;
  EXPECT_EQ(waiting->error_message.find("policy's load limits"), std::string::npos)
      << waiting->error_message;
  EXPECT_FALSE(running->complete());
}

// Parallel mode pairs a decode engine with a prefill engine of its group: with none eligible
// there, an idle decode engine cannot serve, and the 503 says so. It said "2 over the policy's
// load limits (queued prefill work or free KV)" of two idle engines.
TEST(Dispatcher, The503NamesDecodeEnginesThatHaveNoPrefillEngineToPairWith) {
  Topology t = disaggregated(PdMode::kParallel, {engine("p")}, {engine("d1"), engine("d2")});
  t.health.failures_to_eject = 1;
  Cluster c(t);
  c.health.start();
  probes_answer(c, {"p"});
  ASSERT_EQ(c.endpoint("p")["healthy"], false);
  auto refused = c.send();
  EXPECT_EQ(refused->status, 503);
  EXPECT_NE(refused->error_message.find(
                "prefill pool: 1 engine, 1 ejected after failing requests or health checks; "
                "decode pool: 2 engines, 2 with no eligible prefill engine in their group to "
                "pair with"),
            std::string::npos)
      << refused->error_message;
  EXPECT_EQ(refused->error_message.find("policy's load limits"), std::string::npos)
      << refused->error_message;
}

// vllm:request_queue_time_seconds counts requests: a sequential request's two stages and a retry
// each wait in the queue, and the request's waits are observed once, when it ends.
TEST(Dispatcher, QueueTimeIsObservedOncePerRequestWhateverItsStagesAndRetries) {
  Cluster c(disaggregated(PdMode::kSequential, {engine("p1"), engine("p2")}, {engine("d")}));
  auto client = c.send();
  // The first prefill answers without kv_transfer_params: a retry on p2.
  FakeEngines::answer(*c.engines.open().at(0), 200, completion_answer("no params"));
  c.clock.run_ready();
  const json params = {{"do_remote_prefill", true},
                       {"remote_engine_id", "p2-1"},
                       {"remote_block_ids", {1}},
                       {"remote_host", "p2.engines"},
                       {"remote_port", 9000}};
  FakeEngines::answer(*c.engines.open().at(0), 200, json{{"kv_transfer_params", params}}.dump());
  c.clock.run_ready();
  EXPECT_EQ(c.metric("vllm:request_queue_time_seconds_count"), 0);  // still running
  c.answer_all("decoded");
  ASSERT_EQ(client->status, 200) << client->body;
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
  EXPECT_EQ(c.metric("vllm:request_queue_time_seconds_count"), 1);
}

TEST(Dispatcher, SequentialModeRetriesAPrefillWithoutKvTransferParams) {
  Cluster c(disaggregated(PdMode::kSequential, {engine("p1"), engine("p2")}, {engine("d")}));
  c.send();
  FakeEngines::answer(*c.engines.open().at(0), 200, completion_answer("no params"));
  c.clock.run_ready();
  auto retry = c.engines.open();
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(host_of(*retry[0]), "p2");
}

// A prefill answer past what the gateway holds (16 MiB) is refused whole, by the gateway's
// choice: not cut and then read as an answer without kv_transfer_params (a retry, and the
// engine blamed).
TEST(Dispatcher, SequentialModeRefusesAPrefillAnswerLargerThanItHolds) {
  Cluster c(disaggregated(PdMode::kSequential, {engine("p1"), engine("p2")}, {engine("d")}));
  auto client = c.send();
  auto prefill = c.engines.open("/v1/completions").at(0);
  FakeEngines::head(*prefill, 200, "application/json");
  const std::string mib(size_t{1} << 20, ' ');
  bool taken = true;
  for (int i = 0; i < 17 && taken; ++i) taken = FakeEngines::piece(*prefill, mib);
  EXPECT_FALSE(taken) << "the 17th MiB is refused";
  FakeEngines::finish(*prefill, "cancelled");
  c.clock.run_ready();
  EXPECT_EQ(client->status, 502);
  EXPECT_EQ(client->error_code, "answer_too_large");
  EXPECT_NE(client->error_message.find("prefill answer"), std::string::npos)
      << client->error_message;
  EXPECT_TRUE(c.engines.open().empty()) << "no retry, no decode leg";
  EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 0);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

TEST(Dispatcher, ParallelModeStartsBothLegsWithOneBootstrapRoom) {
  Cluster c(disaggregated(PdMode::kParallel, {engine("p")}, {engine("d")}));
  auto client = c.send();
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  const json p = json::parse(legs[0]->request.body), d = json::parse(legs[1]->request.body);
  EXPECT_EQ(host_of(*legs[0]), "p");
  EXPECT_EQ(p["bootstrap_host"], "p.engines");
  EXPECT_EQ(p["bootstrap_port"], 8998);
  EXPECT_EQ(p["bootstrap_room"], d["bootstrap_room"]);
  // The decode leg failing cancels the prefill leg, and the request is retried as a pair.
  FakeEngines::finish(*legs[1], "connection reset");
  c.clock.run_ready();
  EXPECT_TRUE(legs[0]->cancelled);
  EXPECT_EQ(c.engines.open("/v1/completions").size(), 2u);
  EXPECT_FALSE(client->complete());
}

// A leg the gateway gave up on (its pair's other leg failed) must not answer the client, even
// when its answer crossed the cancel: the request is retried, or answered with the failure.
TEST(Dispatcher, AnAnswerThatCrossedTheGatewaysCancelIsNotRelayed) {
  for (const int retries : {1, 0}) {
    Topology t = disaggregated(PdMode::kParallel, {engine("p1"), engine("p2")}, {engine("d")});
    t.prefill_retries = retries;
    Cluster c(t);
    auto client = c.send();
    auto legs = c.engines.open("/v1/completions");
    ASSERT_EQ(legs.size(), 2u);
    ASSERT_EQ(host_of(*legs[1]), "d");
    c.engines.answer_crossing_cancel = completion_answer("from the cancelled leg");
    FakeEngines::finish(*legs[0], "connection reset");  // the prefill leg fails
    c.clock.run_ready();
    c.engines.answer_crossing_cancel.clear();
    EXPECT_TRUE(legs[1]->cancelled);
    if (retries == 0) {
      EXPECT_EQ(client->status, 502) << client->body;
      EXPECT_NE(client->error_message.find("connection reset"), std::string::npos);
      continue;
    }
    EXPECT_FALSE(client->complete()) << client->body;
    ASSERT_EQ(c.engines.open("/v1/completions").size(), 2u);  // the pair, retried
    c.answer_all("from the retry");
    EXPECT_EQ(client->status, 200);
    EXPECT_EQ(json::parse(client->body)["choices"][0]["text"], "from the retry");
  }
}

// A room's prefill engine answers 502 room_abandoned when the decode leg ended before it joined
// the room (the engine's abandon frame): the decode leg's own failure decides the attempt, so the
// healthy prefill engine is neither excluded from the retry nor counted as failed.
std::string room_abandoned_answer() {
  return api::openai_error_body(
      "generation failed: the decode request of bootstrap_room 7 ended before it registered: no "
      "free KV blocks for the prompt's transfer within 120 s",
      "server_error", api::kRoomAbandonedCode);
}

// Parallel P/D over p1, p2 and d1, d2, a failed pair tried once more.
Topology parallel_pairs_with_one_retry() {
  Topology t =
      disaggregated(PdMode::kParallel, {engine("p1"), engine("p2")}, {engine("d1"), engine("d2")});
  t.prefill_retries = 1;
  return t;
}

TEST(Dispatcher, AnAbandonedRoomsPrefillAnswerLeavesTheAttemptToItsDecodeLeg) {
  Topology t = parallel_pairs_with_one_retry();
  Cluster c(t);
  auto client = c.send();
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  ASSERT_EQ(host_of(*legs[0]), "p1");
  ASSERT_EQ(host_of(*legs[1]), "d1");
  // The prefill engine's answer comes first: nothing is retried, the decode leg goes on.
  FakeEngines::answer(*legs[0], 502, room_abandoned_answer());
  c.clock.run_ready();
  EXPECT_FALSE(legs[1]->cancelled);
  EXPECT_EQ(c.engines.all("/v1/completions").size(), 2u);
  EXPECT_FALSE(client->complete());
  EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 0);
  // The decode leg's failure retries the pair, without d1 but with p1 (least_load's first pick).
  FakeEngines::answer(*legs[1], 503, R"({"error":{"message":"no free KV blocks"}})");
  c.clock.run_ready();
  auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 2u);
  EXPECT_EQ(host_of(*retry[0]), "p1");
  EXPECT_EQ(host_of(*retry[1]), "d2");
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
  c.answer_all("from the retry");
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 0);
  EXPECT_EQ(c.endpoint("p1")["in_flight"], 0);
  EXPECT_EQ(c.dispatcher.active(), 0u);

  // Without retries the client gets the decode leg's answer, not the prefill engine's.
  t.prefill_retries = 0;
  Cluster once(t);
  auto alone = once.send();
  legs = once.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  FakeEngines::answer(*legs[0], 502, room_abandoned_answer());
  once.clock.run_ready();
  EXPECT_FALSE(alone->complete());
  FakeEngines::answer(*legs[1], 503, R"({"error":{"message":"no free KV blocks"}})");
  once.clock.run_ready();
  EXPECT_EQ(alone->status, 503);
  EXPECT_EQ(alone->body, R"({"error":{"message":"no free KV blocks"}})");
  EXPECT_EQ(once.endpoint("p1")["consecutive_failures"], 0);
  EXPECT_EQ(once.dispatcher.active(), 0u);
}

// The other order: the decode leg's failure is handled first and the gateway cancels the prefill
// leg, whose room_abandoned answer crossed the cancel. That 502 is not the engine's failure either.
TEST(Dispatcher, AnAbandonedRoomsPrefillAnswerAfterTheDecodeLegsFailureIsNoFault) {
  Topology t = parallel_pairs_with_one_retry();
  Cluster c(t);
  auto client = c.send();
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  c.engines.answer_crossing_cancel = room_abandoned_answer();
  c.engines.answer_crossing_cancel_status = 502;
  FakeEngines::answer(*legs[1], 503, R"({"error":{"message":"no free KV blocks"}})");
  c.clock.run_ready();
  c.engines.answer_crossing_cancel.clear();
  EXPECT_TRUE(legs[0]->cancelled);
  EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 0);
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
  c.answer_all("from the retry");
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 0);
}

// A room_abandoned code means nothing outside parallel mode (no rooms): it is an engine's failure.
TEST(Dispatcher, ARoomAbandonedCodeOutsideParallelModeIsAFailure) {
  Topology t = disaggregated(PdMode::kSequential, {engine("p1"), engine("p2")}, {engine("d")});
  t.prefill_retries = 1;
  Cluster c(t);
  auto client = c.send();
  auto first = c.engines.open("/v1/completions");
  ASSERT_EQ(first.size(), 1u);
  FakeEngines::answer(*first[0], 502, room_abandoned_answer());
  c.clock.run_ready();
  auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(host_of(*retry[0]), "p2");
  EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 1);
  EXPECT_FALSE(client->complete());
}

// Parallel mode, a streaming client: the prefill leg streams too, and a prefill engine that fails
// says so in an error event under its 200. That is its failure, as an error status is: the pair
// is retried at once (the decode leg does not wait out first_token_ms) and the engine blamed.
TEST(Dispatcher, AStreamedPrefillsErrorEventFailsTheAttempt) {
  Topology t = parallel_pairs_with_one_retry();
  t.health.failures_to_eject = 1;
  Cluster c(t);
  auto client = c.send(true);
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  ASSERT_EQ(host_of(*legs[0]), "p1");
  ASSERT_EQ(json::parse(legs[0]->request.body).at("stream"), true);
  FakeEngines::head(*legs[0], 200, "text/event-stream");
  ASSERT_TRUE(FakeEngines::piece(*legs[0],
                                 "data: {\"error\":{\"message\":\"generation failed: prefill "
                                 "broke\",\"type\":\"server_error\"}}\n\ndata: [DONE]\n\n"));
  FakeEngines::finish(*legs[0], "");
  c.clock.run_ready();
  EXPECT_TRUE(legs[1]->cancelled);
  auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 2u);
  EXPECT_EQ(host_of(*retry[0]), "p2");
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
  EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 1);
  EXPECT_EQ(c.endpoint("p1")["healthy"], false);
  EXPECT_FALSE(client->complete());

  // Without retries the client is told which engine failed, and why.
  t.prefill_retries = 0;
  Cluster once(t);
  auto alone = once.send(true);
  legs = once.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  FakeEngines::head(*legs[0], 200, "text/event-stream");
  ASSERT_TRUE(FakeEngines::piece(
      *legs[0], "data: {\"error\":{\"message\":\"prefill broke\"}}\n\ndata: [DONE]\n\n"));
  FakeEngines::finish(*legs[0], "");
  once.clock.run_ready();
  EXPECT_EQ(alone->status, 502);
  EXPECT_EQ(alone->error_message, "prefill engine p1 failed: prefill broke");
  EXPECT_EQ(once.dispatcher.active(), 0u);
}

// ... and a streamed prefill's room_abandoned error event leaves the attempt to its decode leg, as
// the same error status does.
TEST(Dispatcher, AStreamedPrefillsAbandonedRoomLeavesTheAttemptToItsDecodeLeg) {
  Cluster c(parallel_pairs_with_one_retry());
  auto client = c.send(true);
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  FakeEngines::head(*legs[0], 200, "text/event-stream");
  ASSERT_TRUE(
      FakeEngines::piece(*legs[0], "data: " + room_abandoned_answer() + "\n\ndata: [DONE]\n\n"));
  FakeEngines::finish(*legs[0], "");
  c.clock.run_ready();
  EXPECT_FALSE(legs[1]->cancelled);
  EXPECT_EQ(c.engines.all("/v1/completions").size(), 2u);
  EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 0);
  EXPECT_FALSE(client->complete());
}

// A decode engine that could not take the prompt's KV from the prefill engine says so with code
// kv_transfer_failed: the prefill engine of that attempt failed (hung, gone), and the decode
// engine only reported it. The decode leg's failure was counted against the decode engine, and
// the retry avoided it: a hung prefill engine got every healthy decode engine ejected (its legs
// waiting for KV there failed together at the transfer timeout) and requests 503 after.
std::string kv_transfer_failed_answer() {
  return api::openai_error_body(
      "generation failed: KV transfer from the prefill engine at 10.0.0.1:8998 failed: timed out "
      "after 120 s",
      "server_error", api::kKvTransferFailedCode);
}

TEST(Dispatcher, ADecodeLegWhoseKvTransferFailedCountsAgainstItsPrefillEngine) {
  for (const bool stream : {false, true}) {
    Topology t = parallel_pairs_with_one_retry();
    t.health.failures_to_eject = 1;
    Cluster c(t);
    auto client = c.send(stream);
    auto legs = c.engines.open("/v1/completions");
    ASSERT_EQ(legs.size(), 2u);
    ASSERT_EQ(host_of(*legs[0]), "p1");
    ASSERT_EQ(host_of(*legs[1]), "d1");
    if (stream) {  // a streaming decode leg says it in its first event, under a 200
      FakeEngines::head(*legs[1], 200, "text/event-stream");
      FakeEngines::piece(*legs[1], "data: " + kv_transfer_failed_answer() + "\n\ndata: [DONE]\n\n");
      FakeEngines::finish(*legs[1], "");
    } else {
      FakeEngines::answer(*legs[1], 502, kv_transfer_failed_answer());
    }
    c.clock.run_ready();
    EXPECT_TRUE(legs[0]->cancelled) << stream;
    auto retry = c.engines.open("/v1/completions");
    ASSERT_EQ(retry.size(), 2u) << stream;
    EXPECT_EQ(host_of(*retry[0]), "p2") << stream;
    EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 1) << stream;
    EXPECT_EQ(c.endpoint("p1")["healthy"], false) << stream;
    EXPECT_EQ(c.endpoint("d1")["consecutive_failures"], 0) << stream;
    EXPECT_EQ(c.endpoint("d1")["healthy"], true) << stream;
    EXPECT_EQ(c.metric("tandem:gateway_endpoint_failures_total{pool=\"prefill\",endpoint=\"p1\"}"),
              1)
        << stream;
    EXPECT_EQ(c.metric("tandem:gateway_endpoint_failures_total{pool=\"decode\",endpoint=\"d1\"}"),
              0)
        << stream;
    c.answer_all("from the retry");
    EXPECT_EQ(client->status, 200) << stream;
    EXPECT_EQ(c.dispatcher.active(), 0u);
  }
}

// Parallel mode: a decode leg whose KV transfer failed because its prefill engine refused the
// request (the client's 400, or a 503 refusal) is no failure of that prefill engine's, nor of its
// own, whichever leg tells first: the refusal decides the attempt (a kv_transfer_failed otherwise
// counts against the prefill engine).
TEST(Dispatcher, AKvTransferFailedByAPrefillEnginesRefusalBlamesNoEngine) {
  for (const int status : {400, 503})
    for (const bool refusal_first : {true, false}) {
      SCOPED_TRACE(testing::Message() << status << ", refusal first " << refusal_first);
      Topology t = parallel_pairs_with_one_retry();
      t.health.failures_to_eject = 1;
      Cluster c(t);
      auto client = c.send();
      auto legs = c.engines.open("/v1/completions");
      ASSERT_EQ(legs.size(), 2u);
      ASSERT_EQ(host_of(*legs[0]), "p1");
      ASSERT_EQ(host_of(*legs[1]), "d1");
      auto refuse = [&] {
        FakeEngines::answer(*legs[0], status, status == 400 ? kPromptTooLong : kEngineFull);
      };
      if (refusal_first) refuse();
      FakeEngines::answer(*legs[1], 502, kv_transfer_failed_answer());
      if (!refusal_first) refuse();
      c.clock.run_ready();
      expect_no_engine_blamed(c);
      EXPECT_EQ(
          c.metric("tandem:gateway_endpoint_failures_total{pool=\"prefill\",endpoint=\"p1\"}"), 0);
      if (status == 400) {
        EXPECT_EQ(client->status, 400);
        EXPECT_EQ(client->body, kPromptTooLong);
      } else {
        c.answer_all("from the retry");
        EXPECT_EQ(client->status, 200);
      }
      EXPECT_EQ(c.dispatcher.active(), 0u);
    }
}

// The reported case: a hung prefill engine, requests waiting for its KV on a healthy decode
// engine, their decode legs failing together at the transfer timeout. The prefill engine is
// ejected after failures_to_eject of them, and the decode engine stays: the next request's 503
// names the prefill pool (it named "decode pool: 1 engine, 1 ejected"). The prefill legs the
// gateway cancels as each attempt fails are no successes of the hung engine's: counted as such,
// they wiped its failures one by one.
TEST(Dispatcher, AHungPrefillEngineIsEjectedByTheKvTransfersItFailsAndTheDecodeEngineStays) {
  Topology t = disaggregated(PdMode::kParallel, {engine("p")}, {engine("d")});
  t.prefill_retries = 0;
  Cluster c(t);
  std::vector<std::shared_ptr<FakeClient>> clients;
  for (int i = 0; i < 3; ++i) clients.push_back(c.send());
  std::vector<std::shared_ptr<FakeEngines::Call>> decode_legs;
  for (const auto& leg : c.engines.open("/v1/completions"))
    if (host_of(*leg) == "d") decode_legs.push_back(leg);
  ASSERT_EQ(decode_legs.size(), 3u);
  for (const auto& leg : decode_legs) {
    FakeEngines::answer(*leg, 502, kv_transfer_failed_answer());
    c.clock.run_ready();
  }
  for (const auto& client : clients) EXPECT_EQ(client->status, 502);
  EXPECT_EQ(c.endpoint("p")["healthy"], false);
  EXPECT_EQ(c.endpoint("d")["healthy"], true);
  EXPECT_EQ(c.endpoint("d")["consecutive_failures"], 0);
  auto refused = c.send();
  EXPECT_EQ(refused->status, 503);
  EXPECT_NE(refused->error_message.find("prefill pool: 1 engine, 1 ejected"), std::string::npos)
      << refused->error_message;
  EXPECT_EQ(refused->error_message.find("decode pool: 1 engine, 1 ejected"), std::string::npos)
      << refused->error_message;
}

// Sequential mode: the decode leg pulls the KV the prefill leg left on its engine. A pull that
// failed is the prefill engine's failure (retried from the prefill while retries remain: below;
// here none remain, and the client gets the decode engine's error).
TEST(Dispatcher, ASequentialDecodeLegWhoseKvTransferFailedCountsAgainstItsPrefillEngine) {
  Topology t = disaggregated(PdMode::kSequential, {engine("p")}, {engine("d")});
  t.prefill_retries = 0;
  Cluster c(t);
  auto client = c.send();
  const json params = {{"do_remote_prefill", true}, {"remote_engine_id", "p-1"}};
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 200,
                      json{{"kv_transfer_params", params}}.dump());
  c.clock.run_ready();
  auto decode = c.engines.open("/v1/completions");
  ASSERT_EQ(decode.size(), 1u);
  ASSERT_EQ(host_of(*decode[0]), "d");
  FakeEngines::answer(*decode[0], 502, kv_transfer_failed_answer());
  c.clock.run_ready();
  EXPECT_EQ(client->status, 502);
  EXPECT_EQ(client->body, kv_transfer_failed_answer());
  EXPECT_EQ(c.endpoint("p")["consecutive_failures"], 1);
  EXPECT_EQ(c.endpoint("d")["consecutive_failures"], 0);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// One failure of a prefill engine counts once, whichever of its attempt's legs tells of it first:
// here the decode leg (it could not take the KV), then the prefill leg itself (a 502), both
// before the gateway gave up on the attempt. They were counted twice: with failures_to_eject 2,
// one failure ejected the engine.
TEST(Dispatcher, OneFailureOfAPrefillEngineCountsOnceWhicheverLegTellsOfItFirst) {
  Topology t = disaggregated(PdMode::kParallel, {engine("p")}, {engine("d")});
  t.prefill_retries = 0;
  t.health.failures_to_eject = 2;
  Cluster c(t);
  auto client = c.send();
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  ASSERT_EQ(host_of(*legs[0]), "p");
  FakeEngines::answer(*legs[1], 502, kv_transfer_failed_answer());
  FakeEngines::answer(*legs[0], 502, R"({"error":{"message":"the room failed"}})");
  c.clock.run_ready();
  EXPECT_EQ(client->status, 502);
  EXPECT_EQ(c.endpoint("p")["consecutive_failures"], 1);
  EXPECT_EQ(c.endpoint("p")["healthy"], true);
  EXPECT_EQ(c.metric("tandem:gateway_endpoint_failures_total{pool=\"prefill\",endpoint=\"p\"}"), 1);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A decode leg that failed by its prefill engine is no success of the decode engine's either:
// it reset the decode engine's failure count, so a decode engine failing every other request
// on its own was never ejected.
TEST(Dispatcher, ADecodeLegFailedByItsPrefillEngineLeavesTheDecodeEnginesCountAsItWas) {
  Topology t = disaggregated(PdMode::kSequential, {engine("p")}, {engine("d")});
  t.prefill_retries = 0;  // each client gets its decode leg's answer
  Cluster c(t);
  const json params = {{"do_remote_prefill", true}, {"remote_engine_id", "p-1"}};
  auto decode_leg_answers = [&](int status, const std::string& body) {
    auto client = c.send();
    FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 200,
                        json{{"kv_transfer_params", params}}.dump());
    c.clock.run_ready();
    auto decode = c.engines.open("/v1/completions");
    ASSERT_EQ(decode.size(), 1u);
    ASSERT_EQ(host_of(*decode[0]), "d");
    FakeEngines::answer(*decode[0], status, body);
    c.clock.run_ready();
    EXPECT_EQ(client->status, status);
  };
  decode_leg_answers(500, R"({"error":{"message":"the decode engine failed"}})");
  ASSERT_EQ(c.endpoint("d")["consecutive_failures"], 1);
  decode_leg_answers(502, kv_transfer_failed_answer());
  EXPECT_EQ(c.endpoint("d")["consecutive_failures"], 1);
  EXPECT_EQ(c.endpoint("p")["consecutive_failures"], 1);
}

// A prefill engine that passed a health probe since the decode leg was sent is alive: a KV
// transfer it failed then is load (a prompt queued past the transfer timeout), counted as
// overload as a leg's own timeout would be, never towards ejecting it.
TEST(Dispatcher, AKvTransferFailedByAPrefillEngineThatPassesItsProbesIsOverload) {
  Topology t = probed_every_second(disaggregated(PdMode::kParallel, {engine("p")}, {engine("d")}));
  t.prefill_retries = 0;
  Cluster c(t);
  start_probes(c);
  auto client = c.send();
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  c.clock.advance_by(milliseconds(1000));
  probes_answer(c);  // alive while the decode leg waits for its KV
  FakeEngines::answer(*legs[1], 502, kv_transfer_failed_answer());
  c.clock.run_ready();
  EXPECT_EQ(client->status, 502);
  EXPECT_EQ(c.endpoint("p")["healthy"], true);
  EXPECT_EQ(c.endpoint("p")["consecutive_failures"], 0);
  EXPECT_EQ(c.metric("tandem:gateway_endpoint_overloaded_total{pool=\"prefill\",endpoint=\"p\"}"),
            1);
}

// A decode leg the gateway gave up on (its prefill leg failed first, and was counted) whose
// kv_transfer_failed answer crossed the cancel blames the prefill engine no second time: one
// failure, one count.
TEST(Dispatcher, AKvTransferFailureThatCrossedTheGatewaysCancelBlamesNoOneAgain) {
  Cluster c(parallel_pairs_with_one_retry());
  auto client = c.send();
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  c.engines.answer_crossing_cancel = kv_transfer_failed_answer();
  c.engines.answer_crossing_cancel_status = 502;
  FakeEngines::finish(*legs[0], "connection reset");  // the prefill leg fails
  c.clock.run_ready();
  c.engines.answer_crossing_cancel.clear();
  EXPECT_TRUE(legs[1]->cancelled);
  EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 1);
  EXPECT_EQ(c.endpoint("d1")["consecutive_failures"], 0);
  c.answer_all("from the retry");
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 1);
}

// ------------------------------------------------------------------ sequential decode stage

const json kHeldKv = {{"do_remote_prefill", true},
                      {"remote_engine_id", "p-1"},
                      {"remote_block_ids", {1, 2}},
                      {"remote_host", "p.engines"},
                      {"remote_port", 9000}};

// The open prefill leg answers with the KV's whereabouts (and, when given, its usage), and the
// request's decode stage is dispatched.
void prefill_answers(Cluster& c, const std::string& usage = {}) {
  auto open = c.engines.open("/v1/completions");
  ASSERT_EQ(open.size(), 1u);
  json answer = {{"kv_transfer_params", kHeldKv}};
  if (!usage.empty()) answer["usage"] = json::parse(usage);
  FakeEngines::answer(*open[0], 200, answer.dump());
  c.clock.run_ready();
}

// A sequential decode leg that never reached its engine (a crashed engine refusing connections,
// not yet ejected) left the prompt's KV held on the prefill engine: the decode stage goes to
// another decode engine with the same kv_transfer_params. It was answered 502 at once.
TEST(Dispatcher, ASequentialDecodeLegThatCannotConnectGoesToAnotherDecodeEngineWithTheSameKv) {
  Cluster c(disaggregated(PdMode::kSequential, {engine("p")}, {engine("d1"), engine("d2")}));
  auto client = c.send();
  prefill_answers(c);
  auto first = c.engines.open("/v1/completions");
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(host_of(*first[0]), "d1");
  FakeEngines::unreachable(*first[0]);
  c.clock.run_ready();
  auto second = c.engines.open("/v1/completions");
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(host_of(*second[0]), "d2");
  EXPECT_EQ(json::parse(second[0]->request.body)["kv_transfer_params"], kHeldKv);
  EXPECT_EQ(c.engines.all("/v1/completions").size(), 3u) << "no second prefill";
  EXPECT_FALSE(client->complete());
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
  EXPECT_EQ(c.endpoint("d1")["consecutive_failures"], 1);
  c.answer_all("decoded");
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(json::parse(client->body)["choices"][0]["text"], "decoded");
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A decode leg that reached its engine may have taken the KV (the hold is then gone): one that
// failed there before the client got anything (the engine died: its connection reset, a stream cut
// before its first event; or it hung past first_token_ms) starts the request again from its
// prefill, avoiding that decode engine, as parallel mode retries its pair. The prefill engine is
// told nothing: the decode engine took the hold, or it times out there. Each was answered 502 with
// the retries unused.
TEST(Dispatcher, ASequentialDecodeLegThatFailedAfterConnectingStartsAgainFromItsPrefill) {
  enum class Failure { kReset, kStreamCutBeforeItsFirstEvent, kFirstTokenTimeout };
  for (const Failure failure :
       {Failure::kReset, Failure::kStreamCutBeforeItsFirstEvent, Failure::kFirstTokenTimeout}) {
    const int which = static_cast<int>(failure);
    Topology t = disaggregated(PdMode::kSequential, {engine("p")}, {engine("d1"), engine("d2")});
    t.prefill.dialect = Dialect::kTandem;
    t.timeouts.first_token = milliseconds(500);
    Cluster c(t);
    const bool stream = failure != Failure::kReset;
    auto client = c.send(stream);
    prefill_answers(c);
    auto decode = c.engines.open("/v1/completions");
    ASSERT_EQ(decode.size(), 1u) << which;
    ASSERT_EQ(host_of(*decode[0]), "d1") << which;
    if (failure == Failure::kReset) {
      FakeEngines::finish(*decode[0], "cannot read the response header: connection closed");
    } else if (failure == Failure::kStreamCutBeforeItsFirstEvent) {
      FakeEngines::head(*decode[0], 200, "text/event-stream");
      FakeEngines::finish(*decode[0], "Connection reset by peer");
    } else {
      c.clock.advance_by(milliseconds(500));
      EXPECT_TRUE(decode[0]->cancelled) << which;
    }
    c.clock.run_ready();
    auto retry = c.engines.open("/v1/completions");
    ASSERT_EQ(retry.size(), 1u) << which;
    EXPECT_EQ(host_of(*retry[0]), "p") << which;
    EXPECT_EQ(json::parse(retry[0]->request.body)["max_tokens"], 1) << "a prefill leg " << which;
    EXPECT_FALSE(client->complete()) << which;
    EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1) << which;
    EXPECT_EQ(c.endpoint("d1")["consecutive_failures"], 1) << which;
    prefill_answers(c);
    decode = c.engines.open("/v1/completions");
    ASSERT_EQ(decode.size(), 1u) << which;
    EXPECT_EQ(host_of(*decode[0]), "d2") << which;
    c.answer_all("decoded");
    EXPECT_EQ(client->status, 200) << which;
    // The first prefill's hold, told to let go when the prompt was prefilled again (d1 may have
    // pulled it: then it answers not_held); d2 took the second.
    const auto releases = c.engines.all("/v1/kv_transfer/release");
    ASSERT_EQ(releases.size(), 1u) << which;
    EXPECT_EQ(host_of(*releases[0]), "p") << which;
    EXPECT_EQ(c.dispatcher.active(), 0u) << which;
  }
}

// Once the client has part of a stream, a decode leg that fails is not retried: the stream is cut
// with an error event, as before.
TEST(Dispatcher, ASequentialDecodeStreamThatFailsAfterItsFirstEventIsCutNotRetried) {
  Cluster c(disaggregated(PdMode::kSequential, {engine("p")}, {engine("d1"), engine("d2")}));
  auto client = c.send(true);
  prefill_answers(c);
  auto decode = c.engines.open("/v1/completions").at(0);
  FakeEngines::head(*decode, 200, "text/event-stream");
  const std::string first = net::sse_event(R"({"choices":[{"index":0,"text":"x"}]})");
  FakeEngines::piece(*decode, first);
  FakeEngines::finish(*decode, "Connection reset by peer");
  c.clock.run_ready();
  json error;
  expect_error_event_then_done_after(*client, first, error);
  EXPECT_TRUE(c.engines.open("/v1/completions").empty());
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 0);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A sequential decode leg that could not take the KV from its prefill engine (kv_transfer_failed:
// the prefill engine died or hung) starts the request again from its prefill, on another prefill
// engine, as docs/gateway.md says of both P/D modes. It was answered 502.
TEST(Dispatcher, ASequentialDecodeLegWhoseKvTransferFailedIsRetriedFromAnotherPrefillEngine) {
  Cluster c(disaggregated(PdMode::kSequential, {engine("p1"), engine("p2")}, {engine("d")}));
  auto client = c.send();
  ASSERT_EQ(host_of(*c.engines.open("/v1/completions").at(0)), "p1");
  prefill_answers(c);
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 502, kv_transfer_failed_answer());
  c.clock.run_ready();
  auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(host_of(*retry[0]), "p2");
  EXPECT_EQ(json::parse(retry[0]->request.body)["max_tokens"], 1) << "a prefill leg";
  EXPECT_FALSE(client->complete());
  prefill_answers(c);
  auto decode = c.engines.open("/v1/completions");
  ASSERT_EQ(decode.size(), 1u);
  EXPECT_EQ(host_of(*decode[0]), "d");
  c.answer_all("decoded");
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.endpoint("p1")["consecutive_failures"], 1);
  EXPECT_EQ(c.endpoint("d")["consecutive_failures"], 0);
}

// A decode engine whose pull found the prompt's KV gone from the prefill engine (it expired, was
// pulled already, or the engine restarted) says so with code kv_transfer_expired. The KV must be
// computed again: the request starts again from a prefill leg, and neither engine failed. It was
// answered 502 with the decode engine counted as failed (ejected here, failures_to_eject 1).
std::string kv_transfer_expired_answer() {
  return api::openai_error_body(
      "generation failed: KV transfer from the prefill engine at 10.0.0.1:8998 failed: unknown "
      "transfer 'p-1' (never held here, already pulled, or expired after 120 s)",
      "server_error", api::kKvTransferExpiredCode);
}

TEST(Dispatcher, ASequentialDecodeLegWhoseKvExpiredStartsAgainFromItsPrefillBlamingNoEngine) {
  for (const bool stream : {false, true}) {
    Topology t = disaggregated(PdMode::kSequential, {engine("p")}, {engine("d")});
    t.health.failures_to_eject = 1;
    Cluster c(t);
    auto client = c.send(stream);
    prefill_answers(c);
    auto decode = c.engines.open("/v1/completions");
    ASSERT_EQ(decode.size(), 1u);
    ASSERT_EQ(host_of(*decode[0]), "d");
    if (stream) {  // a streaming decode leg says it in its first event, under a 200
      FakeEngines::head(*decode[0], 200, "text/event-stream");
      FakeEngines::piece(*decode[0],
                         "data: " + kv_transfer_expired_answer() + "\n\ndata: [DONE]\n\n");
      FakeEngines::finish(*decode[0], "");
    } else {
      FakeEngines::answer(*decode[0], 502, kv_transfer_expired_answer());
    }
    c.clock.run_ready();
    auto retry = c.engines.open("/v1/completions");
    ASSERT_EQ(retry.size(), 1u) << stream;
    EXPECT_EQ(host_of(*retry[0]), "p") << stream;
    EXPECT_EQ(json::parse(retry[0]->request.body)["max_tokens"], 1) << "a prefill leg";
    EXPECT_FALSE(client->complete()) << stream;
    EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1) << stream;
    for (const char* name : {"p", "d"}) {
      EXPECT_EQ(c.endpoint(name)["consecutive_failures"], 0) << name << " " << stream;
      EXPECT_EQ(c.endpoint(name)["healthy"], true) << name << " " << stream;
    }
    prefill_answers(c);
    decode = c.engines.open("/v1/completions");
    ASSERT_EQ(decode.size(), 1u) << stream;
    EXPECT_EQ(host_of(*decode[0]), "d") << stream;
    c.answer_all("decoded");
    EXPECT_EQ(client->status, 200) << stream;
    EXPECT_EQ(c.dispatcher.active(), 0u) << stream;
  }
}

// The prefill engine holds the prompt's KV for its --kv-transfer-timeout (120 s by default) only:
// a decode stage that waited longer would be sent to pull KV that is gone. It waits at most
// timeouts.decode_queue_ms (90 s by default) and is then answered 503 saying why. It waited the
// whole queue_ms (300 s), then failed its pull, and the healthy decode engine was blamed.
TEST(Dispatcher, ADecodeStageWaitsNoLongerThanThePrefillEngineHoldsItsKv) {
  Cluster c(
      disaggregated(PdMode::kSequential, {engine("p")}, {engine("d", 0, 1), engine("gone", 0, 1)}));
  // Both prompts are prefilled while two decode engines have room; one of them is then drained,
  // and the first decode leg fills the other.
  auto running = c.send();
  auto waiting = c.send();
  auto prefills = c.engines.open("/v1/completions");
  ASSERT_EQ(prefills.size(), 2u);
  ASSERT_TRUE(c.dispatcher.remove_endpoint("gone", nullptr));
  FakeEngines::answer(*prefills[0], 200, json{{"kv_transfer_params", kHeldKv}}.dump());
  c.clock.run_ready();
  FakeEngines::answer(*prefills[1], 200, json{{"kv_transfer_params", kHeldKv}}.dump());
  c.clock.run_ready();
  ASSERT_EQ(c.dispatcher.waiting(), 1u);
  c.clock.advance_by(milliseconds(89999));
  EXPECT_FALSE(waiting->complete());
  c.clock.advance_by(milliseconds(1));
  EXPECT_EQ(waiting->status, 503);
  EXPECT_NE(waiting->error_message.find("decode_queue_ms"), std::string::npos)
      << waiting->error_message;
  EXPECT_EQ(c.dispatcher.waiting(), 0u);
  EXPECT_FALSE(running->complete());
  EXPECT_EQ(c.endpoint("d")["consecutive_failures"], 0);
}

// ------------------------------------------------ a prefill engine whose transfer connections are
// busy

// A decode engine whose pull its prefill engine refused for now (every KV transfer connection it
// allows was in use) says so with code kv_transfer_busy: the KV is still held there, and no
// engine failed.
std::string kv_transfer_busy_answer() {
  return api::openai_error_body(
      "generation failed: KV transfer from the prefill engine at 10.0.0.1:8998 refused: all 4 "
      "transfer connections are in use",
      "server_error", api::kKvTransferBusyCode);
}

// The decode leg `call` answers kv_transfer_busy: as a 503 error, or in a stream's first event.
void answer_kv_transfer_busy(FakeEngines::Call& call, bool stream) {
  if (stream) {
    FakeEngines::head(call, 200, "text/event-stream");
    FakeEngines::piece(call, "data: " + kv_transfer_busy_answer() + "\n\ndata: [DONE]\n\n");
    FakeEngines::finish(call, "");
  } else {
    FakeEngines::answer(call, 503, kv_transfer_busy_answer());
  }
}

// The milliseconds until a decode leg is open (the clock advanced one at a time), at most `bound`;
// -1 if none came.
int ms_until_a_decode_leg(Cluster& c, int bound) {
  for (int ms = 0; ms <= bound; ++ms) {
    if (!c.engines.open("/v1/completions").empty()) return ms;
    c.clock.advance_by(milliseconds(1));
  }
  return -1;
}

// A decode leg answered kv_transfer_busy is sent again, with the same kv_transfer_params (no
// prefill runs again), once the topology's retry_backoff_ms has passed: the prefill engine needs
// a transfer connection to free up, and an immediate retry would meet the same limit. Neither
// engine is blamed or avoided (the one decode engine takes the retry). It was answered as the
// decode engine's failure: a retry from the prefill avoiding that engine (none left here: 503),
// which counted the refusal against it.
TEST(Dispatcher, ADecodeLegRefusedForBusyTransfersIsSentAgainWithItsKvAfterTheBackoff) {
  for (const bool stream : {false, true}) {
    Topology t = tandem_sequential_pair();
    t.health.failures_to_eject = 1;
    t.retry_backoff.first = milliseconds(40);
    Cluster c(t);
    auto client = c.send(stream);
    prefill_answers(c);
    auto decode = c.engines.open("/v1/completions");
    ASSERT_EQ(decode.size(), 1u);
    ASSERT_EQ(host_of(*decode[0]), "d");
    const json first_params = json::parse(decode[0]->request.body)["kv_transfer_params"];
    ASSERT_EQ(first_params, kHeldKv);
    answer_kv_transfer_busy(*decode[0], stream);
    c.clock.run_ready();
    EXPECT_TRUE(c.engines.open("/v1/completions").empty()) << "sent again at once: " << stream;
    // The wait is jittered: from half the backoff to all of it.
    c.clock.advance_by(milliseconds(19));
    EXPECT_TRUE(c.engines.open("/v1/completions").empty()) << stream;
    EXPECT_FALSE(client->complete()) << stream;
    const int waited = ms_until_a_decode_leg(c, 21);
    EXPECT_GE(waited, 1) << stream;
    auto again = c.engines.open("/v1/completions");
    ASSERT_EQ(again.size(), 1u) << stream;
    EXPECT_EQ(host_of(*again[0]), "d") << stream;
    EXPECT_EQ(json::parse(again[0]->request.body)["kv_transfer_params"], first_params) << stream;
    EXPECT_EQ(c.engines.all("/v1/completions").size(), 3u) << "one prefill leg only: " << stream;
    EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1) << stream;
    for (const char* name : {"p", "d"}) {
      EXPECT_EQ(c.endpoint(name)["consecutive_failures"], 0) << name << " " << stream;
      EXPECT_EQ(c.endpoint(name)["healthy"], true) << name << " " << stream;
    }
    if (stream) {
      FakeEngines::head(*again[0], 200, "text/event-stream");
      FakeEngines::piece(*again[0], "data: {\"choices\":[{\"text\":\"hi\"}]}\n\ndata: [DONE]\n\n");
      FakeEngines::finish(*again[0], "");
      c.clock.run_ready();
    } else {
      c.answer_all("decoded");
    }
    EXPECT_EQ(client->status, 200) << stream;
    EXPECT_TRUE(c.engines.all("/v1/kv_transfer/release").empty()) << "d took the KV: " << stream;
    EXPECT_EQ(c.dispatcher.active(), 0u) << stream;
  }
}

// Each busy retry waits twice as long as the one before, up to retry_backoff_max_ms (each wait
// jittered: from half of it to all of it), and the last goes when the prefill engine's hold ends
// (timeouts.decode_queue_ms after its answer): refused then too, the client gets the engine's 503
// and the prefill engine is told to let go of the KV that no decode engine took (a stream's
// refusal too: it was answered 502, as the decode engine's failure). Such retries spend none of
// prefill_retries: the third refusal was answered 503 after 30 ms, with the KV held for long
// after.
TEST(Dispatcher, BusyTransferRetriesBackOffExponentiallyUntilTheKvHoldEndsThenTheKvIsLetGo) {
  for (const bool stream : {false, true}) {
    Topology t = tandem_sequential_pair();
    t.retry_backoff.first = milliseconds(10);
    t.retry_backoff.max = milliseconds(30);
    t.timeouts.decode_queue = milliseconds(100);
    Cluster c(t);
    c.dispatcher.dashboard_state();  // the watch starts: the lines are kept for the dashboard
    auto client = c.send(stream);
    prefill_answers(c);
    int since_prefill = 0, legs = 0;
    while (since_prefill < 100) {
      auto decode = c.engines.open("/v1/completions");
      ASSERT_EQ(decode.size(), 1u) << since_prefill;
      ++legs;
      EXPECT_TRUE(c.engines.all("/v1/kv_transfer/release").empty()) << since_prefill;
      answer_kv_transfer_busy(*decode[0], stream);
      c.clock.run_ready();
      EXPECT_FALSE(client->complete()) << since_prefill << ": " << client->status;
      const int waited = ms_until_a_decode_leg(c, 1000);
      ASSERT_GE(waited, 0) << since_prefill;
      since_prefill += waited;
      // 10, 20, then 30 (40 capped), or less where the hold ends first.
      const int backoff = std::min(10 << std::min(legs - 1, 2), 30);
      EXPECT_LE(waited, backoff) << legs;
      if (since_prefill < 100) {
        EXPECT_GE(waited, backoff / 2) << legs;
      }
    }
    EXPECT_EQ(since_prefill, 100) << "the last leg goes when the hold ends";
    EXPECT_GE(legs, 5);  // 0, 10, 30, 60, 90 without jitter
    auto last = c.engines.open("/v1/completions");
    ASSERT_EQ(last.size(), 1u);
    answer_kv_transfer_busy(*last[0], stream);
    c.clock.run_ready();
    EXPECT_EQ(client->status, 503) << stream;
    EXPECT_EQ(client->body, kv_transfer_busy_answer()) << stream;
    // Recorded once, however often it went again (a review of 133d28c: ~100 entries per request
    // over a default 90 s hold); the record's attempts count every leg.
    EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 1);
    const json recent = c.dispatcher.dashboard_state()["recent"];
    ASSERT_EQ(recent.size(), 1u);
    EXPECT_EQ(recent[0]["retried_after"].size(), 1u);
    EXPECT_EQ(recent[0]["attempts"], legs + 1);
    EXPECT_EQ(c.engines.all("/v1/completions").size(), size_t(legs) + 2) << "one prefill leg";
    const auto releases = c.engines.all("/v1/kv_transfer/release");
    ASSERT_EQ(releases.size(), 1u) << stream;
    EXPECT_EQ(host_of(*releases[0]), "p");
    EXPECT_EQ(json::parse(releases[0]->request.body), json({{"kv_transfer_params", kHeldKv}}));
    EXPECT_EQ(c.endpoint("d")["consecutive_failures"], 0) << stream;
    EXPECT_EQ(c.dispatcher.active(), 0u) << stream;
  }
}

// Decode legs refused for busy transfer connections at the same instant come back spread over
// their wait (jittered by the gateway's random source, seeded here as a simulation seeds it): all
// at one tick, they would meet the same limit again. All ten came back 50 ms later, together.
TEST(Dispatcher, DecodeLegsRefusedTogetherForBusyTransfersAreNotAllSentAgainAtOneTick) {
  seed_random_ids(2026);
  Topology t = tandem_sequential_pair();
  t.prefill.max_in_flight = t.decode.max_in_flight = 10;
  Cluster c(t);
  std::vector<std::shared_ptr<FakeClient>> clients;
  for (int i = 0; i < 10; ++i) clients.push_back(c.send());
  auto prefills = c.engines.open("/v1/completions");
  ASSERT_EQ(prefills.size(), 10u);
  for (const auto& p : prefills)
    FakeEngines::answer(*p, 200, json{{"kv_transfer_params", kHeldKv}}.dump());
  c.clock.run_ready();
  auto decode = c.engines.open("/v1/completions");
  ASSERT_EQ(decode.size(), 10u);
  for (const auto& d : decode) answer_kv_transfer_busy(*d, false);
  c.clock.run_ready();
  std::set<int> ticks;  // the milliseconds after the refusals at which legs went again
  size_t sent = 0;
  for (int ms = 1; ms <= 50; ++ms) {
    c.clock.advance_by(milliseconds(1));
    const size_t open = c.engines.open("/v1/completions").size();
    if (open > sent) ticks.insert(ms);
    if (ms < 25) {
      EXPECT_EQ(open, 0u) << ms;
    }
    sent = open;
  }
  EXPECT_EQ(sent, 10u);
  EXPECT_GT(ticks.size(), 1u);
  c.answer_all("decoded");
  for (const auto& client : clients) EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// With the default topology (prefill_retries 2, retry_backoff_ms 50): refused for busy transfer
// connections three times (at +0, +50 and +150 ms without jitter), the decode leg goes a fourth
// time, and a failure of its engine after that still has its retry from the prefill. The third
// refusal was answered 503, 150 ms after the prefill, and two refusals left a failure no retry.
TEST(Dispatcher, BusyTransferRefusalsSpendNoneOfTheRetriesAFailureNeeds) {
  Topology t = tandem_sequential_pair();
  Cluster c(t);
  auto client = c.send();
  prefill_answers(c);
  for (const int backoff : {50, 100, 200}) {
    answer_kv_transfer_busy(*c.engines.open("/v1/completions").at(0), false);
    c.clock.run_ready();
    const int waited = ms_until_a_decode_leg(c, 1000);
    ASSERT_GE(waited, backoff / 2) << client->status;  // jittered
    EXPECT_LE(waited, backoff);
  }
  FakeEngines::finish(*c.engines.open("/v1/completions").at(0), "connection reset by peer");
  c.clock.run_ready();
  auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(json::parse(retry[0]->request.body)["max_tokens"], 1) << "a prefill leg";
  prefill_answers(c);
  c.answer_all("decoded");
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 2);  // the busy ones once, the failure
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A busy refusal that came whole just as the decode leg's first_token_ms deadline cut it (the
// answer and the cancel crossed) is no failure of the decode engine's: the client gets the 504 of
// a timed-out whole answer, and the engine is counted neither failed nor overloaded. The 504 was
// answered before the refusal's code was read, and its 503 counted as the engine's overload.
TEST(Dispatcher, ABusyRefusalThatCrossesTheDecodeLegsDeadlineIsNoFaultOfItsEngine) {
  Topology t = tandem_sequential_pair();
  t.timeouts.first_token = milliseconds(500);
  Cluster c(t);
  auto client = c.send();
  prefill_answers(c);
  auto decode = c.engines.open("/v1/completions");
  ASSERT_EQ(decode.size(), 1u);
  c.engines.answer_crossing_cancel = kv_transfer_busy_answer();
  c.engines.answer_crossing_cancel_status = 503;
  c.clock.advance_by(milliseconds(500));
  c.clock.run_ready();
  c.engines.answer_crossing_cancel.clear();
  EXPECT_TRUE(decode[0]->cancelled);
  EXPECT_EQ(client->status, 504);
  EXPECT_EQ(c.endpoint("d")["consecutive_failures"], 0);
  EXPECT_EQ(c.metric("tandem:gateway_endpoint_overloaded_total{pool=\"decode\",endpoint=\"d\"}"),
            0);
  EXPECT_EQ(c.engines.all("/v1/kv_transfer/release").size(), 1u) << "no decode engine took it";
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A client that leaves while its decode stage waits out the backoff ends there: its KV is let
// go of, and no decode leg is sent when the wait is over.
TEST(Dispatcher, AClientThatLeavesDuringTheBusyBackoffHasItsKvLetGo) {
  Topology t = tandem_sequential_pair();
  Cluster c(t);
  auto client = c.send();
  prefill_answers(c);
  answer_kv_transfer_busy(*c.engines.open("/v1/completions").at(0), false);
  c.clock.run_ready();
  client->leave();
  c.clock.run_ready();
  EXPECT_EQ(c.engines.all("/v1/kv_transfer/release").size(), 1u);
  EXPECT_EQ(c.dispatcher.active(), 0u);
  c.clock.advance_by(t.retry_backoff.max);
  EXPECT_TRUE(c.engines.open("/v1/completions").empty());
}

// The backoff's settings in a topology file: checked, each error naming its field.
TEST(Topology, RetryBackoffIsReadFromTheFileAndChecked) {
  const std::string pools =
      "mode: sequential\nprefill: {dialect: tandem, endpoints: [p:1]}\n"
      "decode: {dialect: tandem, endpoints: [d:1]}\n";
  const Topology defaults = parse_topology_yaml(pools, "t.yaml");
  EXPECT_EQ(defaults.retry_backoff.first, milliseconds(50));
  EXPECT_EQ(defaults.retry_backoff.max, milliseconds(1000));
  const Topology set =
      parse_topology_yaml(pools + "retry_backoff_ms: 20\nretry_backoff_max_ms: 200\n", "t.yaml");
  EXPECT_EQ(set.retry_backoff.first, milliseconds(20));
  EXPECT_EQ(set.retry_backoff.max, milliseconds(200));
  auto error = [&](const std::string& extra) {
    try {
      parse_topology_yaml(pools + extra, "t.yaml");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(error("retry_backoff_ms: 0\n"), testing::HasSubstr("retry_backoff_ms: expected"));
  EXPECT_THAT(error("retry_backoff_ms: soon\n"), testing::HasSubstr("retry_backoff_ms"));
  // (retry_backoff_ms alone sets a max that follows it: topology_test.cpp.)
  EXPECT_THAT(error("retry_backoff_ms: 2000\nretry_backoff_max_ms: 1000\n"),
              testing::HasSubstr("retry_backoff_max_ms: expected a duration >= retry_backoff_ms "
                                 "(2000 ms), got 1000"));
}

// ------------------------------------------------ releasing prefill KV no decode engine took

// Sequential mode over Tandem prefill engines (which have POST /v1/kv_transfer/release): two
// requests prefilled while two decode engines have room, then one decode engine drained, so the
// second request's decode stage waits in the queue with its KV held on p. `waiting` is its
// client; `running`, the first one's, whose decode leg runs on d.
struct DecodeStageWaiting {
  explicit DecodeStageWaiting(Dialect prefill_dialect = Dialect::kTandem)
      : c([&] {
          Topology t = disaggregated(PdMode::kSequential, {engine("p")},
                                     {engine("d", 0, 1), engine("gone", 0, 1)});
          t.prefill.dialect = prefill_dialect;
          return t;
        }()) {
    running = c.send_body({{"model", "m"}, {"prompt", "hello"}}, "k-1");
    waiting = c.send_body({{"model", "m"}, {"prompt", "there"}}, "k-2");
    auto prefills = c.engines.open("/v1/completions");
    EXPECT_EQ(prefills.size(), 2u);
    EXPECT_TRUE(c.dispatcher.remove_endpoint("gone", nullptr));
    for (const auto& p : prefills) {
      FakeEngines::answer(*p, 200, json{{"kv_transfer_params", kHeldKv}}.dump());
      c.clock.run_ready();
    }
    EXPECT_EQ(c.dispatcher.waiting(), 1u);
    EXPECT_TRUE(c.engines.all(kRelease).empty());
  }
  static constexpr const char* kRelease = "/v1/kv_transfer/release";
  double releases(const std::string& result) const {
    return c.metric("tandem:gateway_kv_releases_total{result=\"" + result + "\"}");
  }
  Cluster c;
  std::shared_ptr<FakeClient> running, waiting;
};

// A client that leaves after its prompt was prefilled and before a decode engine took the KV
// (its decode stage still waits for one): the prefill engine is told to let go of the KV at
// once, with the kv_transfer_params it answered and the client's key, instead of holding it for
// its --kv-transfer-timeout (120 s) while other prompts wait for memory. It kept it.
TEST(Dispatcher, AClientThatLeavesBeforeTheDecodeLegHasThePrefillEngineLetGoOfTheKv) {
  DecodeStageWaiting s;
  s.waiting->leave();
  s.c.clock.run_ready();
  const auto releases = s.c.engines.open(DecodeStageWaiting::kRelease);
  ASSERT_EQ(releases.size(), 1u);
  const auto& release = *releases[0];
  EXPECT_EQ(host_of(release), "p");
  EXPECT_EQ(release.request.method, "POST");
  EXPECT_EQ(json::parse(release.request.body), json({{"kv_transfer_params", kHeldKv}}));
  EXPECT_EQ(release.request.headers.get("Authorization"), "Bearer k-2");
  EXPECT_EQ(s.c.dispatcher.active(), 1u);  // its end waited for no answer to the release
  FakeEngines::answer(*releases[0], 200, R"({"released":true})");
  s.c.clock.run_ready();
  EXPECT_EQ(s.releases("released"), 1);
  // The other request's decode leg reached d, which owns its KV: no release for it, ever.
  s.running->leave();
  s.c.clock.run_ready();
  EXPECT_EQ(s.c.engines.all(DecodeStageWaiting::kRelease).size(), 1u);
  EXPECT_EQ(s.c.dispatcher.active(), 0u);
}

// The decode stage that waits past timeouts.decode_queue_ms is answered 503 and its KV let go
// of; a release the engine answers {"released": false} (it expired meanwhile) or fails is
// counted, and changes nothing for the client.
TEST(Dispatcher, ADecodeStageThatTimesOutLetsGoOfItsKvAndTheOutcomeIsCounted) {
  DecodeStageWaiting s;
  s.c.clock.advance_by(milliseconds(90000));
  EXPECT_EQ(s.waiting->status, 503);
  auto releases = s.c.engines.open(DecodeStageWaiting::kRelease);
  ASSERT_EQ(releases.size(), 1u);
  FakeEngines::answer(*releases[0], 200, R"({"released":false})");
  s.c.clock.run_ready();
  EXPECT_EQ(s.releases("not_held"), 1);

  // A request that ends before its prefill answered holds nothing: nothing is released.
  auto again = s.c.send_body({{"model", "m"}, {"prompt", "again"}});
  EXPECT_EQ(s.c.dispatcher.waiting(), 1u);  // not prefilled while d has no room
  again->leave();
  s.c.clock.run_ready();
  EXPECT_EQ(s.c.engines.all(DecodeStageWaiting::kRelease).size(), 1u);
}

// A release that the engine does not answer is cut at timeouts.connect_ms and counted as failed;
// the log says why (it said "cancelled", as if someone had given it up).
TEST(Dispatcher, AReleaseThatGetsNoAnswerIsCutAndCountedAsFailed) {
  DecodeStageWaiting s;
  s.waiting->leave();
  s.c.clock.run_ready();
  ASSERT_EQ(s.c.engines.open(DecodeStageWaiting::kRelease).size(), 1u);
  testing::internal::CaptureStderr();
  s.c.clock.advance_by(s.c.topo.timeouts.connect);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(s.c.engines.open(DecodeStageWaiting::kRelease).empty());
  EXPECT_EQ(s.releases("failed"), 1);
  EXPECT_NE(log.find("no answer within timeouts.connect_ms"), std::string::npos) << log;
}

// Hundreds of clients leaving at once (a load balancer giving up) each leave KV held on the
// prefill engine: the releases past those sent at once wait their turn and are all sent as the
// earlier ones end. Past 64 under way they were dropped, and the KV stayed held for 120 s.
TEST(Dispatcher, ABurstOfReleasesIsSentInTurnNotDropped) {
  constexpr int kLeaving = 200;
  Topology t = disaggregated(PdMode::kSequential, {engine("p")},
                             {engine("d", 0, 1), engine("gone", 0, kLeaving)});
  t.prefill.dialect = Dialect::kTandem;
  t.prefill.max_in_flight = kLeaving + 1;
  Cluster c(t);
  auto running = c.send_body({{"model", "m"}, {"prompt", "hello"}});
  std::vector<std::shared_ptr<FakeClient>> leaving;
  for (int i = 0; i < kLeaving; ++i)
    leaving.push_back(c.send_body({{"model", "m"}, {"prompt", "there " + std::to_string(i)}}));
  auto prefills = c.engines.open("/v1/completions");
  ASSERT_EQ(prefills.size(), size_t{kLeaving + 1});
  ASSERT_TRUE(c.dispatcher.remove_endpoint("gone", nullptr));
  for (const auto& p : prefills) {
    FakeEngines::answer(*p, 200, json{{"kv_transfer_params", kHeldKv}}.dump());
    c.clock.run_ready();
  }
  ASSERT_EQ(c.dispatcher.waiting(), size_t{kLeaving});
  for (const auto& client : leaving) client->leave();
  c.clock.run_ready();
  for (auto open = c.engines.open("/v1/kv_transfer/release"); !open.empty();
       open = c.engines.open("/v1/kv_transfer/release")) {
    for (const auto& release : open) FakeEngines::answer(*release, 200, R"({"released":true})");
    c.clock.run_ready();
  }
  EXPECT_EQ(c.engines.all("/v1/kv_transfer/release").size(), size_t{kLeaving});
  auto releases = [&](const std::string& result) {
    return c.metric("tandem:gateway_kv_releases_total{result=\"" + result + "\"}");
  };
  EXPECT_EQ(releases("released"), kLeaving);
  EXPECT_EQ(releases("dropped"), 0);
}

// vLLM's engines have no release route (NIXL frees held KV at its own timeout): nothing is sent.
TEST(Dispatcher, NoReleaseGoesToAVllmPrefillEngine) {
  DecodeStageWaiting s(Dialect::kVllm);
  s.waiting->leave();
  s.c.clock.run_ready();
  EXPECT_TRUE(s.c.engines.all(DecodeStageWaiting::kRelease).empty());
  EXPECT_EQ(s.c.dispatcher.active(), 1u);
}

// A decode leg that never reached its engine left the KV with the gateway: when the retries are
// spent on such legs, the prefill engine is told to let go. So it is when the last retry's leg
// reached its engine and failed there (its connection reset: the engine may be gone, and its pull
// with it), as a retry from the prefill lets go of the first hold; that KV was left held until the
// prefill engine's --kv-transfer-timeout (a hold that engine pulled answers not_held).
TEST(Dispatcher, DecodeLegsThatNeverConnectedLeaveTheReleaseToTheGateway) {
  for (const bool reached : {false, true}) {
    Topology t = disaggregated(PdMode::kSequential, {engine("p")}, {engine("d1"), engine("d2")});
    t.prefill.dialect = Dialect::kTandem;
    // One that reached its engine starts again from the prefill while a retry is left: none is.
    t.prefill_retries = reached ? 0 : 1;
    Cluster c(t);
    auto client = c.send();
    prefill_answers(c);
    for (int leg = 0; leg < 2 && !client->complete(); ++leg) {
      auto decode = c.engines.open("/v1/completions");
      ASSERT_EQ(decode.size(), 1u) << reached;
      if (reached)
        FakeEngines::finish(*decode[0], "connection reset by peer");
      else
        FakeEngines::unreachable(*decode[0]);
      c.clock.run_ready();
    }
    EXPECT_EQ(client->status, 502) << reached;
    EXPECT_EQ(c.engines.all("/v1/kv_transfer/release").size(), 1u) << reached;
  }
}

// A decode engine that could not pull the KV from its prefill engine (kv_transfer_failed) leaves
// the hold there (a pull that never ran frees nothing): whether the request then starts again
// from another prefill engine or its retries are spent, the prefill engine is told to let go,
// once. Neither was told: the KV stayed held until its --kv-transfer-timeout.
TEST(Dispatcher, ADecodeLegWhoseKvTransferFailedHasThePrefillEngineLetGoOnce) {
  for (const int retries : {0, 1}) {
    Topology t = disaggregated(PdMode::kSequential, {engine("p1"), engine("p2")}, {engine("d")});
    t.prefill.dialect = Dialect::kTandem;
    t.prefill_retries = retries;
    Cluster c(t);
    auto client = c.send();
    ASSERT_EQ(host_of(*c.engines.open("/v1/completions").at(0)), "p1");
    prefill_answers(c);
    FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 502, kv_transfer_failed_answer());
    c.clock.run_ready();
    auto releases = c.engines.all("/v1/kv_transfer/release");
    ASSERT_EQ(releases.size(), 1u) << retries;
    EXPECT_EQ(host_of(*releases[0]), "p1") << retries;
    EXPECT_EQ(json::parse(releases[0]->request.body), json({{"kv_transfer_params", kHeldKv}}));
    if (retries == 0) {
      EXPECT_EQ(client->status, 502);
    } else {
      ASSERT_EQ(host_of(*c.engines.open("/v1/completions").at(0)), "p2");
      prefill_answers(c);
      c.answer_all("decoded");
      EXPECT_EQ(client->status, 200);
    }
    EXPECT_EQ(c.engines.all("/v1/kv_transfer/release").size(), 1u) << retries;
    EXPECT_EQ(c.dispatcher.active(), 0u) << retries;
  }
}

// A decode leg whose pull failed naming no engine (a 502 without a code: the prefill engine
// refused it for an allow list, a layout or a secret that do not match) starts the request again
// from the prefill, and the gateway tells the prefill engine to let go of the first hold, once:
// the decode engine's own release is refused for the same mismatch. Nobody released it: the
// blocks stayed held until the prefill engine's --kv-transfer-timeout.
TEST(Dispatcher, ADecodeLegThatFailsNamingNoEngineHasThePrefillEngineLetGo) {
  Topology t = disaggregated(PdMode::kSequential, {engine("p")}, {engine("d1"), engine("d2")});
  t.prefill.dialect = Dialect::kTandem;
  Cluster c(t);
  auto client = c.send();
  prefill_answers(c);
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 502,
                      api::openai_error_body("generation failed: KV transfer from the prefill "
                                             "engine at p.engines:9000 failed: refused",
                                             "server_error"));
  c.clock.run_ready();
  const auto releases = c.engines.all("/v1/kv_transfer/release");
  ASSERT_EQ(releases.size(), 1u);
  EXPECT_EQ(host_of(*releases[0]), "p");
  EXPECT_EQ(json::parse(releases[0]->request.body), json({{"kv_transfer_params", kHeldKv}}));
  auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(json::parse(retry[0]->request.body)["max_tokens"], 1) << "a prefill leg";
  prefill_answers(c);
  c.answer_all("decoded");
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.engines.all("/v1/kv_transfer/release").size(), 1u) << "d2 took the second hold";
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A decode leg that fails naming no code (its engine failed mid-pull or mid-generation: a 502, or
// its deadline) when no retry is left ends the request: the prefill engine is told to let go of the
// prompt's KV, as a retry from the prefill does (a hold the decode engine pulled answers not_held).
// Nothing was sent: the KV stayed held until the prefill engine's --kv-transfer-timeout.
TEST(Dispatcher, ADecodeLegFailingWithoutACodeWithNoRetryLeftHasThePrefillEngineLetGo) {
  for (const bool timed_out : {false, true}) {
    Topology t = tandem_sequential_pair();
    t.prefill_retries = 0;
    t.timeouts.first_token = milliseconds(500);
    Cluster c(t);
    auto client = c.send(true);
    prefill_answers(c);
    auto decode = c.engines.open("/v1/completions");
    ASSERT_EQ(decode.size(), 1u);
    if (timed_out)
      c.clock.advance_by(milliseconds(500));
    else
      FakeEngines::answer(
          *decode[0], 502,
          api::openai_error_body("generation failed: the engine stopped", "server_error"));
    c.clock.run_ready();
    EXPECT_EQ(client->status, 502) << timed_out;
    const auto releases = c.engines.all("/v1/kv_transfer/release");
    ASSERT_EQ(releases.size(), 1u) << timed_out;
    EXPECT_EQ(host_of(*releases[0]), "p");
    EXPECT_EQ(json::parse(releases[0]->request.body), json({{"kv_transfer_params", kHeldKv}}));
    EXPECT_EQ(c.dispatcher.active(), 0u) << timed_out;
  }
}

// A decode engine whose HTTP server refuses the leg before any application reads it (a wrong API
// key, a body past its limit: 401, 413, 431) never saw the KV, and told the prefill engine
// nothing: the gateway does, once, as the client gets the refusal. A 400 is the engine's own
// refusal of a body it read, which lets go of the KV itself (GenerationApi): nothing is sent.
TEST(Dispatcher, ADecodeLegRefusedUnreadHasThePrefillEngineLetGo) {
  for (const int status : {401, 413, 431, 400}) {
    Topology t = tandem_sequential_pair();
    Cluster c(t);
    auto client = c.send();
    prefill_answers(c);
    FakeEngines::answer(*c.engines.open("/v1/completions").at(0), status,
                        api::openai_error_body("refused", "invalid_request_error"));
    c.clock.run_ready();
    EXPECT_EQ(client->status, status);
    const auto releases = c.engines.all("/v1/kv_transfer/release");
    ASSERT_EQ(releases.size(), status == 400 ? 0u : 1u) << status;
    if (status != 400) {
      EXPECT_EQ(host_of(*releases[0]), "p") << status;
    }
    EXPECT_EQ(c.dispatcher.active(), 0u) << status;
  }
}

// A decode leg the gateway cancels while its connection is still being made (its client left)
// never reached its engine, and the HTTP client now says so (CallFailure::kNotConnected, not
// kCancelled: async_http_client_cancel_test): the prefill engine is told to let go. One cancelled
// once connected may have reached its engine, which owns the KV: nothing is sent. (Before the
// client's change, the first case counted as reached too and the KV stayed held until its
// --kv-transfer-timeout.)
TEST(Dispatcher, ADecodeLegCancelledWhileConnectingHasThePrefillEngineLetGo) {
  for (const bool connected : {false, true}) {
    Topology t = tandem_sequential_pair();
    Cluster c(t);
    auto client = c.send();
    prefill_answers(c);
    auto decode = c.engines.open("/v1/completions");
    ASSERT_EQ(decode.size(), 1u) << connected;
    decode[0]->connecting = !connected;
    client->leave();
    c.clock.run_ready();
    EXPECT_TRUE(decode[0]->cancelled) << connected;
    EXPECT_EQ(c.engines.all("/v1/kv_transfer/release").size(), connected ? 0u : 1u) << connected;
    EXPECT_EQ(c.dispatcher.active(), 0u) << connected;
  }
}

// The real HTTP client reports a cancelled call later, from its io thread: the request may end
// (finished() runs) while its decode leg is still connecting, and the leg then ends without
// having reached its engine. The prefill engine must still be told to let go, once, when that
// leg ends. The gateway had dropped the KV's params at the request's end and sent nothing: the
// blocks stayed held until the engine's --kv-transfer-timeout.
TEST(Dispatcher, ADecodeLegThatEndsUnconnectedAfterItsRequestEndedHasThePrefillEngineLetGo) {
  Topology t = tandem_sequential_pair();
  Cluster c(t);
  auto client = c.send();
  prefill_answers(c);
  auto decode = c.engines.open("/v1/completions");
  ASSERT_EQ(decode.size(), 1u);
  c.engines.answer_after_cancel = true;  // the cancel's report comes after the request ended
  client->leave();
  c.clock.run_ready();
  EXPECT_TRUE(decode[0]->cancelled);
  EXPECT_TRUE(c.engines.all("/v1/kv_transfer/release").empty()) << "the leg may still reach d";
  FakeEngines::unreachable(*decode[0]);
  c.clock.run_ready();
  const auto releases = c.engines.all("/v1/kv_transfer/release");
  ASSERT_EQ(releases.size(), 1u);
  EXPECT_EQ(host_of(*releases[0]), "p");
  EXPECT_EQ(json::parse(releases[0]->request.body), json({{"kv_transfer_params", kHeldKv}}));
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// The same leg ending after it connected may have reached its engine, which owns the KV then:
// nothing is sent, now or later.
TEST(Dispatcher, ADecodeLegThatEndsConnectedAfterItsRequestEndedLeavesTheKvToItsEngine) {
  Topology t = tandem_sequential_pair();
  Cluster c(t);
  auto client = c.send();
  prefill_answers(c);
  auto decode = c.engines.open("/v1/completions");
  ASSERT_EQ(decode.size(), 1u);
  c.engines.answer_after_cancel = true;
  client->leave();
  c.clock.run_ready();
  FakeEngines::finish(*decode[0], "cancelled");
  c.clock.run_ready();
  EXPECT_TRUE(c.engines.all("/v1/kv_transfer/release").empty());
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// An `auto` prefill engine whose GET /load has not answered yet (it just joined, or was just
// readmitted after an ejection) answered with kv_transfer_params like any other: a Tandem engine
// holds that KV, so it is told to let go. The release was skipped and counted nowhere.
TEST(Dispatcher, AnAutoPrefillEngineNotYetKnownIsToldToLetGo) {
  DecodeStageWaiting s(Dialect::kAuto);
  ASSERT_EQ(s.c.endpoint("p")["load_source"], "asking");
  s.waiting->leave();
  s.c.clock.run_ready();
  const auto releases = s.c.engines.open(DecodeStageWaiting::kRelease);
  ASSERT_EQ(releases.size(), 1u);
  EXPECT_EQ(host_of(*releases[0]), "p");
  FakeEngines::answer(*releases[0], 200, R"({"released":true})");
  s.c.clock.run_ready();
  EXPECT_EQ(s.releases("released"), 1);
}

// A prefill answer that crossed the client's leaving (the call ended with it after the cancel)
// is of KV that no decode leg will take: it is let go of at once.
TEST(Dispatcher, APrefillAnswerThatCrossesTheClientsLeavingIsLetGoOf) {
  Topology t = tandem_sequential_pair();
  Cluster c(t);
  auto client = c.send();
  ASSERT_EQ(c.engines.open("/v1/completions").size(), 1u);
  c.engines.answer_crossing_cancel = json{{"kv_transfer_params", kHeldKv}}.dump();
  client->leave();
  c.clock.run_ready();
  const auto releases = c.engines.all("/v1/kv_transfer/release");
  ASSERT_EQ(releases.size(), 1u);
  EXPECT_EQ(json::parse(releases[0]->request.body), json({{"kv_transfer_params", kHeldKv}}));
  EXPECT_TRUE(c.engines.all("/v1/completions").size() == 1u) << "no decode leg";
}

// Sequential mode prefills a prompt only while a decode engine of the prefill engine's group has
// room for it (by the policy's own decode limits): prefilled now, its KV would wait on the
// prefill engine for a decode engine, and expire there. It was prefilled at once.
TEST(Dispatcher, SequentialModeWaitsToPrefillWhileNoDecodeEngineHasRoom) {
  for (const std::string policy : {"least_load", "tandem"}) {
    Topology t = disaggregated(PdMode::kSequential, {engine("p")}, {engine("d", 0, 1)});
    t.policy = policy;
    Cluster c(t);
    auto first = c.send();
    prefill_answers(c);
    auto decode = c.engines.open("/v1/completions");
    ASSERT_EQ(decode.size(), 1u) << policy;
    ASSERT_EQ(host_of(*decode[0]), "d") << policy;
    auto second = c.send();
    EXPECT_TRUE(c.engines.open("/v1/completions").size() == 1u) << policy << ": no prefill yet";
    EXPECT_EQ(c.dispatcher.waiting(), 1u) << policy;
    FakeEngines::answer(*decode[0], 200, completion_answer("first"));
    c.clock.run_ready();
    EXPECT_EQ(first->status, 200) << policy;
    auto prefill = c.engines.open("/v1/completions");
    ASSERT_EQ(prefill.size(), 1u) << policy;
    EXPECT_EQ(host_of(*prefill[0]), "p") << policy;
    EXPECT_FALSE(second->complete()) << policy;
  }
}

// A prompt being prefilled, or waiting to decode, counts against its group's decode room until
// its decode leg is sent: with room for one decode leg, three prompts are prefilled one at a
// time, whether they came one by one or together (one dispatch pass). All three were prefilled at
// once: one decoded and the others' KV waited on the prefill engine until decode_queue_ms (503).
TEST(Dispatcher, SequentialModePrefillsNoMorePromptsThanItsDecodeEnginesHaveRoomFor) {
  for (const std::string policy : {"least_load", "tandem"}) {
    for (const bool together : {false, true}) {
      Topology t = disaggregated(PdMode::kSequential, {engine("p")}, {engine("d", 0, 1)});
      t.policy = policy;
      Cluster c(t);
      std::vector<std::shared_ptr<FakeClient>> clients;
      if (together) {
        clients = c.send_together(3);
      } else {
        for (int i = 0; i < 3; ++i) clients.push_back(c.send());
      }
      const std::string where = policy + (together ? ", together" : ", one by one");
      for (int i = 0; i < 3; ++i) {
        auto prefill = c.engines.open("/v1/completions");
        ASSERT_EQ(prefill.size(), 1u) << where << ": prompt " << i;
        ASSERT_EQ(host_of(*prefill[0]), "p") << where;
        EXPECT_EQ(c.dispatcher.waiting(), size_t(2 - i)) << where;
        prefill_answers(c);
        auto decode = c.engines.open("/v1/completions");
        ASSERT_EQ(decode.size(), 1u) << where << ": no prefill while the decode leg runs";
        ASSERT_EQ(host_of(*decode[0]), "d") << where;
        FakeEngines::answer(*decode[0], 200, completion_answer("decoded"));
        c.clock.run_ready();
      }
      for (const auto& client : clients) EXPECT_EQ(client->status, 200) << where;
      EXPECT_EQ(c.dispatcher.active(), 0u) << where;
    }
  }
}

// The room a prompt sets aside goes with it: a prefill that failed and is retried, or a decode
// leg that could not reach its engine and waits for another, holds one place, not two (a leaked
// reservation would leave the only decode engine's room taken, and the next prompt waiting).
TEST(Dispatcher, ARetriedSequentialRequestHoldsOneDecodePlace) {
  Topology t = disaggregated(PdMode::kSequential, {engine("p1"), engine("p2")},
                             {engine("d1", 0, 1), engine("d2", 0, 1)});
  Cluster c(t);
  auto first = c.send();
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 500, "");  // p1 fails: p2
  c.clock.run_ready();
  prefill_answers(c);
  auto decode = c.engines.open("/v1/completions");
  ASSERT_EQ(decode.size(), 1u);
  FakeEngines::unreachable(*decode[0]);  // d1: then d2
  c.clock.run_ready();
  ASSERT_EQ(c.engines.open("/v1/completions").size(), 1u);
  // d1 is free (its leg failed), d2 decodes the first request: one more prompt is prefilled.
  c.send();
  c.send();
  ASSERT_EQ(c.engines.open("/v1/completions").size(), 2u);
  EXPECT_EQ(c.dispatcher.waiting(), 1u);
  // The first request's decode leg ends: d2's place is free, and the third prompt is prefilled.
  for (const auto& call : c.engines.open("/v1/completions"))
    if (host_of(*call) == "d2") FakeEngines::answer(*call, 200, completion_answer("first"));
  c.clock.run_ready();
  EXPECT_EQ(first->status, 200);
  EXPECT_EQ(c.dispatcher.waiting(), 0u);
  auto prefills = c.engines.open("/v1/completions");
  ASSERT_EQ(prefills.size(), 2u);
  for (const auto& call : prefills) EXPECT_EQ(host_of(*call)[0], 'p');
}

// A request that ends while it holds its group's decode place (its prefill engine refused it)
// gives the place to the next prompt at once: the place was freed after the pass that followed
// the failure, and with nothing else to dispatch, the next prompt waited for another request to
// arrive, or for its queue timeout, while every engine was idle.
TEST(Dispatcher, ARequestThatEndsHoldingADecodePlaceLetsTheNextPromptBePrefilled) {
  Topology t = disaggregated(PdMode::kSequential, {engine("p")}, {engine("d", 0, 1)});
  Cluster c(t);
  auto refused = c.send();
  auto next = c.send();
  auto prefill = c.engines.open("/v1/completions");
  ASSERT_EQ(prefill.size(), 1u);
  EXPECT_EQ(c.dispatcher.waiting(), 1u);
  FakeEngines::answer(*prefill[0], 400,
                      R"({"error":{"message":"bad","type":"BadRequestError","param":null,)"
                      R"("code":400}})");
  c.clock.run_ready();
  EXPECT_EQ(refused->status, 400);
  EXPECT_EQ(c.dispatcher.waiting(), 0u);
  prefill = c.engines.open("/v1/completions");
  ASSERT_EQ(prefill.size(), 1u) << "the next prompt is prefilled";
  EXPECT_EQ(host_of(*prefill[0]), "p");
}

// A non-streaming answer comes whole or not at all, so first_token_ms bounds the whole of it: one
// that takes longer is answered 504 saying so, and not started again elsewhere, where it would
// take as long (a long generation ran on up to three engines in turn, each cut as a "first
// token" timeout, then got 502). As nginx answers a POST whose upstream timed out: 504, no retry.
TEST(Dispatcher, ANonStreamingAnswerLongerThanFirstTokenMsIs504WithoutRetry) {
  for (const PdMode mode : {PdMode::kAggregated, PdMode::kSequential}) {
    Topology t = mode == PdMode::kAggregated
                     ? aggregated({engine("a"), engine("b")})
                     : disaggregated(mode, {engine("p")}, {engine("a"), engine("b")});
    t.timeouts.first_token = milliseconds(500);
    Cluster c(t);
    auto client = c.send(false);
    if (mode == PdMode::kSequential) prefill_answers(c);
    auto leg = c.engines.open("/v1/completions");
    ASSERT_EQ(leg.size(), 1u);
    ASSERT_EQ(host_of(*leg[0]), "a");
    c.clock.advance_by(milliseconds(500));
    EXPECT_TRUE(leg[0]->cancelled);
    EXPECT_EQ(client->status, 504);
    EXPECT_NE(client->error_message.find("first_token_ms"), std::string::npos)
        << client->error_message;
    EXPECT_NE(client->error_message.find("\"stream\": true"), std::string::npos)
        << client->error_message;
    EXPECT_TRUE(c.engines.open("/v1/completions").empty());
    EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 0);
    EXPECT_EQ(c.dispatcher.active(), 0u);
  }
}

// A non-streaming leg still connecting when first_token_ms (its whole answer's bound) expires never
// reached its engine: another engine would not take as long, so it is retried (a sequential decode
// leg with the same KV), not answered 504 "not retried, as another engine would take as long".
TEST(Dispatcher, ANonStreamingLegStillConnectingAtFirstTokenMsIsRetriedNot504) {
  for (const PdMode mode : {PdMode::kAggregated, PdMode::kSequential}) {
    Topology t = mode == PdMode::kAggregated
                     ? aggregated({engine("a"), engine("b")})
                     : disaggregated(mode, {engine("p")}, {engine("a"), engine("b")});
    t.timeouts.first_token = milliseconds(500);
    Cluster c(t);
    auto client = c.send(false);
    if (mode == PdMode::kSequential) prefill_answers(c);
    auto leg = c.engines.open("/v1/completions");
    ASSERT_EQ(leg.size(), 1u);
    ASSERT_EQ(host_of(*leg[0]), "a");
    leg[0]->connecting = true;
    c.clock.advance_by(milliseconds(500));
    EXPECT_TRUE(leg[0]->cancelled);
    EXPECT_FALSE(client->complete()) << client->error_message;
    auto retry = c.engines.open("/v1/completions");
    ASSERT_EQ(retry.size(), 1u);
    EXPECT_EQ(host_of(*retry[0]), "b");
    if (mode == PdMode::kSequential) {
      EXPECT_EQ(json::parse(retry[0]->request.body)["kv_transfer_params"], kHeldKv);
    }
    c.answer_all("late but whole");
    EXPECT_EQ(client->status, 200);
    EXPECT_EQ(c.dispatcher.active(), 0u);
  }
}

// A decode leg that fails with a 502 naming no code (here the text an engine without the
// kv_transfer_busy code gives for a pull its prefill engine refused as busy: "too many KV transfer
// connections ...; try again"; one with the code is sent again with its KV instead,
// ADecodeLegRefusedForBusyTransfersIsSentAgainWithItsKvAfterTheBackoff) starts the sequential
// request again from its prefill, and the client gets its answer. Each such request was answered
// 502.
TEST(Dispatcher, ADecodeLegFailingWithoutACodeStartsTheRequestAgainFromItsPrefill) {
  Cluster c(disaggregated(PdMode::kSequential, {engine("p")}, {engine("d1"), engine("d2")}));
  auto client = c.send();
  prefill_answers(c);
  FakeEngines::answer(
      *c.engines.open("/v1/completions").at(0), 502,
      api::openai_error_body("generation failed: KV transfer from the prefill engine at "
                             "10.0.0.1:8998 failed: too many KV transfer connections from this "
                             "address; try again",
                             "server_error"));
  c.clock.run_ready();
  auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(json::parse(retry[0]->request.body)["max_tokens"], 1) << "a prefill leg";
  prefill_answers(c);
  c.answer_all("decoded");
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A sequential request started again from its prefill (its decode leg failed) lets go of its
// decode body, which the next prefill's answer makes anew: it waits for that prefill holding only
// the bodies the queue's byte bound counts. It held the failed stage's decode body meanwhile.
TEST(Dispatcher, ARequestStartedAgainFromItsPrefillLetsGoOfItsDecodeBody) {
  Cluster c(disaggregated(PdMode::kSequential, {engine("p")}, {engine("d1"), engine("d2")}));
  auto client = c.send();
  prefill_answers(c);
  const RequestPtr r = c.last_sent.lock();
  ASSERT_TRUE(r);
  size_t held = 0;
  {
    std::lock_guard lock(r->mutex);
    held = r->decode_body.size();
  }
  ASSERT_GT(held, 0u);
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 500, "boom");
  c.clock.run_ready();
  auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(json::parse(retry[0]->request.body)["max_tokens"], 1) << "a prefill leg";
  {
    std::lock_guard lock(r->mutex);
    EXPECT_TRUE(r->decode_body.empty());
    EXPECT_LT(r->decode_body.capacity(), held) << "its memory is let go of";
  }
  // The prompt is prefilled anew, its KV held in other blocks: the decode leg takes it from there.
  json again = kHeldKv;
  again["remote_block_ids"] = {3, 4};
  FakeEngines::answer(*retry[0], 200, json{{"kv_transfer_params", again}}.dump());
  c.clock.run_ready();
  auto decode = c.engines.open("/v1/completions");
  ASSERT_EQ(decode.size(), 1u);
  EXPECT_EQ(json::parse(decode[0]->request.body)["kv_transfer_params"], again);
  c.answer_all("decoded");
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

TEST(Dispatcher, ThePromptsLegCarriesItsDeadlineOnlyToAnEngineThatSchedulesByPriority) {
  for (const bool by_priority : {true, false}) {
    Topology t = disaggregated(PdMode::kParallel, {engine("p")}, {engine("d")});
    t.policy = "tandem";
    t.prefill.dialect = t.decode.dialect = Dialect::kTandem;
    t.scheduling.load_interval = milliseconds(100);
    Cluster c(t);
    c.health.start();
    for (const auto& poll : c.engines.open("/load")) {
      api::LoadReport r;
      r.total_blocks = r.free_blocks = 1000;
      r.block_size = 16;
      r.schedules_by_priority = by_priority && host_of(*poll) == "p";
      FakeEngines::answer(*poll, 200, api::to_json(r));
    }
    c.clock.run_ready();
    const int64_t sent_ms = c.clock.unix_ms();
    auto client = c.send_body({{"model", "m"}, {"prompt", "hello there"}, {"priority", 7}});
    const auto legs = c.engines.open("/v1/completions");
    ASSERT_EQ(legs.size(), 2u);
    ASSERT_EQ(host_of(*legs[0]), "p");
    const json p = json::parse(legs[0]->request.body), d = json::parse(legs[1]->request.body);
    // The gateway owns the field: the client's priority reaches neither engine.
    EXPECT_FALSE(d.contains("priority"));
    if (!by_priority) {
      EXPECT_FALSE(p.contains("priority"));
      continue;
    }
    // Due 8 times its own compute after it arrived: a short prompt, well within the 5 s cap.
    ASSERT_TRUE(p.contains("priority"));
    EXPECT_GT(p["priority"].get<int64_t>(), sent_ms);
    EXPECT_LT(p["priority"].get<int64_t>(), sent_ms + 8 * 5000);
    (void)client;
  }
}

// ------------------------------------------------------------------------ routing quality

std::string answer_with_cached(int64_t cached) {
  json a = json::parse(completion_answer("ok"));
  a["usage"]["prompt_tokens_details"] = {{"cached_tokens", cached}};
  return a.dump();
}

std::vector<int32_t> prompt_ids(size_t n) {
  std::vector<int32_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>(100 + i);
  return ids;
}

TEST(Dispatcher, RecordsWhatWasAvailableChosenAndDeliveredOfAPrefix) {
  Topology t = aggregated({engine("a"), engine("b")});  // least_load: a, the lower id, on a tie
  Cluster c(t);
  c.dispatcher.dashboard_state();  // the dashboard is open: requests that end are kept for it
  const auto ids = prompt_ids(100);
  c.engine_caches("a", ids, 0);
  c.engine_caches("b", ids, 64);
  auto client = c.send_tokens(ids);
  auto call = c.engines.open("/v1/completions").at(0);
  EXPECT_EQ(host_of(*call), "a");  // the policy gave the cached prefix up
  FakeEngines::answer(*call, 200, answer_with_cached(0));
  c.clock.run_ready();
  ASSERT_EQ(client->status, 200);
  EXPECT_EQ(c.metric("tandem:gateway_prefix_reuse_tokens_total{split=\"available\"}"), 64);
  EXPECT_EQ(c.metric("tandem:gateway_prefix_reuse_tokens_total{split=\"chosen\"}"), 0);
  EXPECT_EQ(c.metric("tandem:gateway_prefix_reuse_tokens_total{split=\"delivered\"}"), 0);
  EXPECT_EQ(c.metric("tandem:gateway_prefix_reuse_prompt_tokens_total"), 100);
  EXPECT_EQ(c.metric("tandem:gateway_prefix_reuse_requests_total"), 1);

  // Now a holds a request: least_load picks b, whose cache the engine reports it used (48 of the
  // 64 tokens: a block evicted in between).
  auto busy = c.send_tokens(prompt_ids(20));
  auto second = c.send_tokens(ids);
  auto calls = c.engines.open("/v1/completions");
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(host_of(*calls[1]), "b");
  FakeEngines::answer(*calls[1], 200, answer_with_cached(48));
  FakeEngines::answer(*calls[0], 200, completion_answer("no usage details"));  // not measured
  c.clock.run_ready();
  EXPECT_EQ(c.metric("tandem:gateway_prefix_reuse_tokens_total{split=\"available\"}"), 128);
  EXPECT_EQ(c.metric("tandem:gateway_prefix_reuse_tokens_total{split=\"chosen\"}"), 64);
  EXPECT_EQ(c.metric("tandem:gateway_prefix_reuse_tokens_total{split=\"delivered\"}"), 48);
  EXPECT_EQ(c.metric("tandem:gateway_prefix_reuse_requests_total"), 2);

  // The dashboard's view: the split per request (newest last), the totals, each engine's reuse.
  const json state = c.dispatcher.dashboard_state();
  const json& recent = state.at("recent");
  ASSERT_EQ(recent.size(), 3u);
  EXPECT_EQ(recent[0]["prefix_reuse"], (json{{"available", 64}, {"chosen", 0}, {"delivered", 0}}));
  EXPECT_EQ(recent[1]["prefix_reuse"],
            (json{{"available", 64}, {"chosen", 64}, {"delivered", 48}}));
  EXPECT_EQ(recent[2]["prefix_reuse"]["delivered"], -1);
  EXPECT_EQ(state["totals"]["prefix_reuse"], (json{{"requests", 2},
                                                   {"prompt_tokens", 200},
                                                   {"available", 128},
                                                   {"chosen", 64},
                                                   {"delivered", 48}}));
  EXPECT_EQ(state["totals"]["requests"], 3);
  EXPECT_EQ(state["totals"]["by_status"]["200"], 3);
  for (const auto& e : state["endpoints"]) {
    if (e["name"] == "b") {
      EXPECT_EQ(e["reuse"], (json{{"requests", 1}, {"prompt_tokens", 100}, {"delivered", 48}}));
    }
  }
  EXPECT_EQ(state["histograms"]["e2e"]["count"], 3);
  (void)busy;
  (void)second;
}

// Building a request's line costs the scheduling thread: without an access log it is built only
// while someone watches the dashboard (a poll keeps the watch a minute); the totals always count.
TEST(Dispatcher, RecentRequestsAreKeptOnlyWhileTheDashboardIsWatched) {
  Cluster c(aggregated({engine("a")}));
  auto finish_one = [&] {
    c.send();
    c.answer_all();
  };
  finish_one();
  json state = c.dispatcher.dashboard_state();  // the first poll: the watch starts now
  EXPECT_TRUE(state["recent"].empty());
  EXPECT_EQ(state["totals"]["requests"], 1);
  finish_one();
  c.clock.advance_by(std::chrono::seconds(59));
  finish_one();
  EXPECT_EQ(c.dispatcher.dashboard_state()["recent"].size(), 2u);  // and the watch goes on
  c.clock.advance_by(std::chrono::seconds(61));
  finish_one();
  state = c.dispatcher.dashboard_state();
  EXPECT_EQ(state["recent"].size(), 2u);
  EXPECT_EQ(state["totals"]["requests"], 4);
}

// The access log and the dashboard say what an engine's OpenAI error said, which the client got
// as the engine sent it: the line's error said only "engine error", and each retried_after only
// "NAME: HTTP 500". A long message is clipped where it is kept, on a character boundary.
TEST(Dispatcher, TheLineQuotesTheEnginesRelayedErrorAndEachRetriedOne) {
  Topology t = aggregated({engine("a"), engine("b")});
  t.prefill_retries = 1;
  Cluster c(t);
  c.dispatcher.dashboard_state();  // the watch starts: the lines are kept for the dashboard
  auto client = c.send();
  std::string long_message;
  for (int i = 0; i < 1000; ++i) long_message += "\u00e9";
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 500,
                      api::openai_error_body(long_message, "server_error"));
  c.clock.run_ready();
  const std::string last =
      R"({"error":{"message":"CUDA error: out of memory","type":"server_error"}})";
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 500, last);
  c.clock.run_ready();
  EXPECT_EQ(client->status, 500);
  EXPECT_EQ(client->body, last);
  const json recent = c.dispatcher.dashboard_state()["recent"];
  ASSERT_EQ(recent.size(), 1u);
  EXPECT_EQ(recent[0]["error"], "engine b answered HTTP 500: CUDA error: out of memory");
  ASSERT_EQ(recent[0]["retried_after"].size(), 1u);
  const std::string first = recent[0]["retried_after"][0];
  EXPECT_EQ(first.rfind("a: HTTP 500: \u00e9\u00e9", 0), 0u) << first;
  EXPECT_LT(first.size(), 300u);
  EXPECT_TRUE(utf8::is_valid(first));
}

TEST(Dispatcher, AStreamsUsageChunkSaysWhatTheEngineReused) {
  Cluster c(aggregated({engine("a")}));
  const auto ids = prompt_ids(40);
  c.engine_caches("a", ids, 32);
  auto client = c.send_tokens(ids, true);
  auto call = c.engines.open("/v1/completions").at(0);
  FakeEngines::head(*call, 200, "text/event-stream");
  FakeEngines::piece(*call,
                     "data: {\"choices\":[{\"text\":\"x\"}]}\n\n"
                     "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,"
                     "\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n");
  FakeEngines::finish(*call, "");
  c.clock.run_ready();
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.metric("tandem:gateway_prefix_reuse_tokens_total{split=\"delivered\"}"), 32);
  EXPECT_EQ(c.metric("tandem:gateway_prefix_reuse_tokens_total{split=\"chosen\"}"), 32);
}

// The access log's completion_tokens: a whole answer's usage, and a stream's usage chunk (asked
// for with stream_options.include_usage); a stream without one has none.
TEST(Dispatcher, TheLinesCompletionTokensComeFromAStreamsUsageChunkAsFromAWholeAnswer) {
  Cluster c(aggregated({engine("a")}));
  c.dispatcher.dashboard_state();  // the dashboard is open: the requests' lines are kept
  auto whole = c.send();
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 200, completion_answer("ok"));
  c.clock.run_ready();
  auto streamed = open_stream(c);
  FakeEngines::piece(*streamed.call,
                     "data: {\"choices\":[{\"text\":\"x\"}]}\n\n"
                     "data: {\"choices\":[{\"text\":\"y\"}]}\n\n"
                     "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,"
                     "\"completion_tokens\":7,\"total_tokens\":10}}\n\n");
  FakeEngines::piece(*streamed.call, "data: [DONE]\n\n");
  FakeEngines::finish(*streamed.call, "");
  c.clock.run_ready();
  auto bare = open_stream(c);
  FakeEngines::piece(*bare.call, "data: {\"choices\":[{\"text\":\"x\"}]}\n\ndata: [DONE]\n\n");
  FakeEngines::finish(*bare.call, "");
  c.clock.run_ready();
  ASSERT_EQ(whole->status, 200);
  ASSERT_TRUE(streamed.client->complete());
  ASSERT_TRUE(bare.client->complete());
  const json recent = c.dispatcher.dashboard_state().at("recent");
  ASSERT_EQ(recent.size(), 3u);
  EXPECT_EQ(recent[0].value("completion_tokens", -1), 2);
  EXPECT_EQ(recent[1].value("completion_tokens", -1), 7);
  EXPECT_EQ(recent[1].value("output_events", -1), 2);
  EXPECT_FALSE(recent[2].contains("completion_tokens")) << recent[2];
}

TEST(Dispatcher, InPdModesThePrefillEnginesUsageCountsAndAStreamsPrefillLegAsksForIt) {
  Cluster c(disaggregated(PdMode::kParallel, {engine("p")}, {engine("d")}));
  const auto ids = prompt_ids(64);
  c.engine_caches("p", ids, 48);
  c.engine_caches("d", ids, 64);  // the decode engine's cache computes nothing: not counted
  auto client = c.send_tokens(ids, true);
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  const json p = json::parse(legs[0]->request.body), d = json::parse(legs[1]->request.body);
  EXPECT_EQ(p["stream_options"], (json{{"include_usage", true}}));
  EXPECT_FALSE(d.contains("stream_options"));  // the client gets what it asked for
  // The decode leg may end the request before the prefill leg's answer arrives: the record waits
  // for it.
  FakeEngines::head(*legs[1], 200, "text/event-stream");
  FakeEngines::piece(*legs[1], "data: {\"choices\":[{\"text\":\"x\"}]}\n\ndata: [DONE]\n\n");
  FakeEngines::finish(*legs[1], "");
  c.clock.run_ready();
  EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"200\"}"), 0);
  FakeEngines::head(*legs[0], 200, "text/event-stream");
  FakeEngines::piece(*legs[0],
                     "data: {\"choices\":[{\"text\":\"x\"}]}\n\n"
                     "data: {\"choices\":[],\"usage\":{\"prompt_tokens_details\":"
                     "{\"cached_tokens\":48}}}\n\ndata: [DONE]\n\n");
  FakeEngines::finish(*legs[0], "");
  c.clock.run_ready();
  EXPECT_EQ(c.metric("tandem:gateway_requests_total{status=\"200\"}"), 1);
  EXPECT_EQ(c.metric("tandem:gateway_prefix_reuse_tokens_total{split=\"available\"}"), 48);
  EXPECT_EQ(c.metric("tandem:gateway_prefix_reuse_tokens_total{split=\"delivered\"}"), 48);
  EXPECT_EQ(client->streamed.find("cached_tokens"), std::string::npos);
}

// In the P/D modes the prompt is computed on the prefill engine, and its usage says what it
// reused; the decode engine took the KV and reports its own (often 0). The client's
// usage.prompt_tokens_details.cached_tokens is the prefill engine's, in a whole answer and in a
// stream's usage chunk, as llm-d rewrites it. The client got the decode engine's.
TEST(Dispatcher, InPdModesTheClientsCachedTokensAreThePrefillEnginesWholeOrStreamed) {
  const std::string decode_usage =
      R"("usage":{"prompt_tokens":64,"completion_tokens":2,"total_tokens":66,)"
      R"("prompt_tokens_details":{"cached_tokens":0}})";
  for (const bool stream : {false, true}) {
    Cluster c(disaggregated(PdMode::kSequential, {engine("p")}, {engine("d")}));
    auto client = c.send(stream);
    prefill_answers(c, R"({"prompt_tokens":64,"prompt_tokens_details":{"cached_tokens":48}})");
    auto decode = c.engines.open("/v1/completions").at(0);
    if (stream) {
      FakeEngines::head(*decode, 200, "text/event-stream");
      FakeEngines::piece(*decode,
                         "data: {\"choices\":[{\"text\":\"x\"}]}\n\ndata: {\"choices\":[],");
      FakeEngines::piece(*decode, decode_usage + "}\n\ndata: [DONE]\n\n");
      FakeEngines::finish(*decode, "");
    } else {
      FakeEngines::answer(*decode, 200,
                          R"({"id":"cmpl-1","choices":[{"text":"x"}],)" + decode_usage + "}");
    }
    c.clock.run_ready();
    ASSERT_EQ(client->status, 200) << stream;
    json usage;
    if (stream) {
      net::SseParser events;
      const auto data = events.feed(client->streamed);
      ASSERT_EQ(data.size(), 3u) << client->streamed;
      EXPECT_EQ(data[0], "{\"choices\":[{\"text\":\"x\"}]}");
      EXPECT_EQ(data[2], "[DONE]");
      usage = json::parse(data[1]).at("usage");
    } else {
      usage = json::parse(client->body).at("usage");
      EXPECT_EQ(json::parse(client->body)["choices"][0]["text"], "x");
    }
    EXPECT_EQ(usage["prompt_tokens_details"]["cached_tokens"], 48) << stream;
    EXPECT_EQ(usage["completion_tokens"], 2) << stream;
    EXPECT_EQ(usage["prompt_tokens"], 64) << stream;
  }
}

// A prefill engine that reports no reuse (vLLM without --enable-prompt-tokens-details) leaves the
// decode engine's usage as it is.
TEST(Dispatcher, InPdModesADecodeAnswersUsageStaysWhenThePrefillEngineReportedNone) {
  Cluster c(disaggregated(PdMode::kSequential, {engine("p")}, {engine("d")}));
  auto client = c.send();
  prefill_answers(c);
  const std::string answer =
      R"({"choices":[{"text":"x"}],"usage":{"prompt_tokens_details":{"cached_tokens":16}}})";
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 200, answer);
  c.clock.run_ready();
  EXPECT_EQ(client->body, answer);
}

// A retried request's prompt is computed again, and only that computation's reuse is reported:
// the first prefill engine's cached_tokens (48) stayed when the retry's prefill engine reported
// none, and the client was told of reuse that its answer did not have.
TEST(Dispatcher, AnEarlierAttemptsCachedTokensAreNotReportedForARetry) {
  Topology t = disaggregated(PdMode::kSequential, {engine("p1"), engine("p2")}, {engine("d")});
  Cluster c(t);
  auto client = c.send();
  prefill_answers(c, R"({"prompt_tokens":64,"prompt_tokens_details":{"cached_tokens":48}})");
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 502, kv_transfer_failed_answer());
  c.clock.run_ready();
  ASSERT_EQ(host_of(*c.engines.open("/v1/completions").at(0)), "p2");
  prefill_answers(c);  // no usage
  const std::string answer =
      R"({"choices":[{"text":"x"}],"usage":{"prompt_tokens_details":{"cached_tokens":0}}})";
  FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 200, answer);
  c.clock.run_ready();
  ASSERT_EQ(client->status, 200);
  EXPECT_EQ(client->body, answer);
}

// A prefill leg of a failed attempt whose answer crossed the gateway's cancel and arrived after
// the retry started reported its engine's reuse (48) as the retry's: the client was told of reuse
// that the retry's prefill engine, which reported none, did not have.
TEST(Dispatcher, AGivenUpPrefillLegsLateAnswerDoesNotReportItsReuseForTheRetry) {
  Cluster c(parallel_pairs_with_one_retry());
  auto client = c.send();
  auto legs = c.engines.open("/v1/completions");
  ASSERT_EQ(legs.size(), 2u);
  ASSERT_EQ(host_of(*legs[0]), "p1");
  c.engines.answer_after_cancel = true;
  FakeEngines::answer(*legs[1], 500, R"({"error":{"message":"decode failed"}})");
  c.clock.run_ready();
  auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 3u);  // the first prefill leg, cancelled but still open; the retry's
  ASSERT_TRUE(legs[0]->cancelled);
  FakeEngines::answer(
      *legs[0], 200,
      R"({"choices":[{"text":"x"}],"usage":{"prompt_tokens":64,"prompt_tokens_details":{"cached_tokens":48}}})");
  c.clock.run_ready();
  retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 2u);
  ASSERT_EQ(host_of(*retry[0]), "p2");
  FakeEngines::answer(*retry[0], 200, R"({"choices":[{"text":"x"}]})");  // no usage
  c.clock.run_ready();
  const std::string answer =
      R"({"choices":[{"text":"y"}],"usage":{"prompt_tokens_details":{"cached_tokens":0}}})";
  FakeEngines::answer(*retry[1], 200, answer);
  c.clock.run_ready();
  ASSERT_EQ(client->status, 200);
  EXPECT_EQ(client->body, answer);
}

// A P/D stream is framed anew event by event (its usage chunk rewritten): an event of several
// data lines reaches the client as one event of those lines. Its continuation lines went out
// bare ("data: {...,\n\"b\":1}"), which a client's parser drops.
TEST(Dispatcher, AMultiLineEventOfAPdStreamReachesTheClientWhole) {
  Cluster c(disaggregated(PdMode::kSequential, {engine("p")}, {engine("d")}));
  auto client = c.send(true);
  prefill_answers(c);
  auto decode = c.engines.open("/v1/completions").at(0);
  FakeEngines::head(*decode, 200, "text/event-stream");
  FakeEngines::piece(*decode, "data: {\"choices\":[{\"text\":\"x\"}],\ndata: \"b\":1}\n\n");
  FakeEngines::piece(*decode, "data: [DONE]\n\n");
  FakeEngines::finish(*decode, "");
  c.clock.run_ready();
  ASSERT_EQ(client->status, 200);
  net::SseParser events;
  const auto data = events.feed(client->streamed);
  ASSERT_EQ(data.size(), 2u) << client->streamed;
  EXPECT_EQ(json::parse(data[0]), json::parse(R"({"choices":[{"text":"x"}],"b":1})"))
      << client->streamed;
  EXPECT_EQ(data[1], "[DONE]");
}

// A stream's first event is held until it completes (it may be an error, to retry elsewhere), up
// to max_answer_bytes; past it the gateway refuses the stream, as it does a verbatim one. A P/D
// stream, framed anew, had no bound: its first event grew in the gateway without limit.
TEST(Dispatcher, APdStreamsFirstEventLargerThanTheAnswerLimitIsRefused) {
  Topology t = disaggregated(PdMode::kSequential, {engine("p")}, {engine("d")});
  t.max_answer_bytes = 1024;
  Cluster c(t);
  auto client = c.send(true);
  prefill_answers(c);
  auto decode = c.engines.open("/v1/completions").at(0);
  FakeEngines::head(*decode, 200, "text/event-stream");
  ASSERT_TRUE(
      FakeEngines::piece(*decode, "data: {\"choices\":[{\"text\":\"" + std::string(900, 'x')));
  EXPECT_FALSE(FakeEngines::piece(*decode, std::string(200, 'x')));
  FakeEngines::finish(*decode, "cancelled");
  c.clock.run_ready();
  EXPECT_EQ(client->status, 502);
  EXPECT_FALSE(client->streaming);
  EXPECT_EQ(client->error_code, "answer_too_large");
  EXPECT_NE(client->error_message.find("first event"), std::string::npos) << client->error_message;
  EXPECT_EQ(c.endpoint("d")["consecutive_failures"], 0);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// ------------------------------------------------------------------------ priority classes

Topology with_classes(Topology t) {
  t.api_keys = {"k-batch", "k-chat"};
  t.priority.classes = {{"interactive", 0, std::chrono::seconds(2), std::nullopt},
                        {"batch", 10, std::chrono::seconds(30), std::nullopt}};
  t.priority.api_keys = {{"k-batch", 1}};
  return t;
}

TEST(Dispatcher, EnginesGetTheClassPriorityAndTheQueueServesAHigherClassFirst) {
  Cluster c(with_classes(aggregated({engine("a", 0, 1)})));
  c.dispatcher.dashboard_state();
  const json body = {{"model", "m"}, {"prompt", "hi"}};
  auto running = c.send_body(body, "k-chat");
  auto batch = c.send_body(body, "k-batch");
  json chat_body = body;
  chat_body["priority"] = "interactive";
  auto chat = c.send_body(chat_body, "k-chat");
  auto calls = c.engines.open("/v1/completions");
  ASSERT_EQ(calls.size(), 1u);  // the engine takes one at a time
  EXPECT_EQ(json::parse(calls[0]->request.body)["priority"], 0);
  FakeEngines::answer(*calls[0], 200, completion_answer("first"));
  c.clock.run_ready();
  calls = c.engines.open("/v1/completions");
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(json::parse(calls[0]->request.body)["priority"], 0);  // the interactive one
  FakeEngines::answer(*calls[0], 200, completion_answer("second"));
  c.clock.run_ready();
  EXPECT_EQ(chat->status, 200);
  EXPECT_FALSE(batch->complete());
  calls = c.engines.open("/v1/completions");
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(json::parse(calls[0]->request.body)["priority"], 10);
  FakeEngines::answer(*calls[0], 200, completion_answer("third"));
  c.clock.run_ready();
  EXPECT_EQ(batch->status, 200);
  const json state = c.dispatcher.dashboard_state();
  EXPECT_EQ(state["totals"]["by_class"], (json{{"batch", 1}, {"interactive", 2}}));
  EXPECT_EQ(state["recent"][2]["priority_class"], "batch");
  (void)running;
}

// A queue full of batch requests must not refuse interactive ones (docs/gateway.md, "Priority
// classes"): the newest waiting request of the lowest class gives up its place, answered 429.
TEST(Dispatcher, AFullQueueShedsTheNewestWaitingRequestOfALowerClassForAHigherOne) {
  Topology t = with_classes(aggregated({engine("a", 0, 1)}));
  t.max_queue = 2;
  Cluster c(t);
  const json body = {{"model", "m"}, {"prompt", "hi"}};
  auto running = c.send_body(body, "k-batch");
  auto older = c.send_body(body, "k-batch");
  auto newer = c.send_body(body, "k-batch");
  auto chat = c.send_body(body, "k-chat");
  EXPECT_EQ(newer->status, 429);
  EXPECT_EQ(newer->error_code, "rate_limit_exceeded");
  EXPECT_NE(newer->error_message.find("higher-priority"), std::string::npos)
      << newer->error_message;
  EXPECT_FALSE(chat->complete());
  EXPECT_FALSE(older->complete());
  EXPECT_EQ(c.dispatcher.waiting(), 2u);
  // A request of the lowest class finds the queue full, as before.
  auto batch = c.send_body(body, "k-batch");
  EXPECT_EQ(batch->status, 429);
  EXPECT_NE(batch->error_message.find("queue is full"), std::string::npos) << batch->error_message;
  auto chat2 = c.send_body(body, "k-chat");  // sheds the older batch request
  EXPECT_EQ(older->status, 429);
  // Nothing of a lower class waits now: one of the same class finds the queue full.
  auto chat3 = c.send_body(body, "k-chat");
  EXPECT_EQ(chat3->status, 429);
  EXPECT_NE(chat3->error_message.find("queue is full"), std::string::npos) << chat3->error_message;
  for (int i = 0; i < 3; ++i) c.answer_all();
  EXPECT_EQ(running->status, 200);
  EXPECT_EQ(chat->status, 200);
  EXPECT_EQ(chat2->status, 200);
  EXPECT_EQ(c.dispatcher.waiting(), 0u);
  EXPECT_EQ(c.dispatcher.active(), 0u);
  EXPECT_EQ(c.clock.pending_timers(), 0u);  // the shed requests' queue timers went with them
}

// The queue's byte bound (Topology::max_queued_body_bytes) sheds lower classes as its
// count bound does: an interactive arrival at a queue whose batch requests hold the bytes takes the
// place of the newest of them, and only a request that nothing may be shed for is refused. The byte
// check came before the shedding and refused any arrival, whatever its class.
TEST(Dispatcher, AHigherClassArrivalPastTheByteBoundShedsALowerClassRequest) {
  const Topology t = with_classes(aggregated({engine("a", 0, 1)}));
  const json body = {{"model", "m"}, {"prompt", "hi"}};
  size_t per_request = 0;
  {
    Cluster probe(t);
    probe.send_body(body, "k-batch");
    probe.send_body(body, "k-batch");
    per_request = probe.dispatcher.queued_body_bytes();
  }
  ASSERT_GT(per_request, 0u);
  Cluster c(with_queued_body_bytes(t, 2 * per_request));
  auto running = c.send_body(body, "k-batch");
  auto older = c.send_body(body, "k-batch");
  auto newer = c.send_body(body, "k-batch");
  EXPECT_EQ(c.dispatcher.queued_body_bytes(), 2 * per_request);
  auto chat = c.send_body(body, "k-chat");
  EXPECT_FALSE(chat->complete());
  EXPECT_EQ(newer->status, 429);
  EXPECT_NE(newer->error_message.find("higher-priority"), std::string::npos)
      << newer->error_message;
  EXPECT_FALSE(older->complete());
  EXPECT_LE(c.dispatcher.queued_body_bytes(), 2 * per_request);  // the classes' bodies differ
  // A request of the lowest class finds the bytes taken, as before.
  auto batch = c.send_body(body, "k-batch");
  EXPECT_EQ(batch->status, 429);
  EXPECT_NE(batch->error_message.find("max_queued_body_bytes"), std::string::npos)
      << batch->error_message;
  for (int i = 0; i < 3; ++i) c.answer_all();
  EXPECT_EQ(running->status, 200);
  EXPECT_EQ(chat->status, 200);
  EXPECT_EQ(older->status, 200);
  EXPECT_EQ(c.dispatcher.queued_body_bytes(), 0u);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A waiting request whose client leaves gives its bytes back to the queue's byte bound.
TEST(Dispatcher, AWaitingRequestWhoseClientLeavesGivesItsBodyBytesBack) {
  Cluster c(with_queued_body_bytes(aggregated({engine("a", 0, 1)}), size_t{1} << 20));
  auto running = c.send();
  auto waiting = c.send();
  EXPECT_GT(c.dispatcher.queued_body_bytes(), 0u);
  waiting->leave();
  c.clock.run_ready();
  EXPECT_EQ(c.dispatcher.waiting(), 0u);
  EXPECT_EQ(c.dispatcher.queued_body_bytes(), 0u);
  c.answer_all();
  EXPECT_EQ(running->status, 200);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// An arrival whose body alone is larger than the queue's byte bound fits only an empty queue: while
// anything waits it is refused at once (the full queue's 429, naming the bound), and sheds no lower
// class's request. It shed every waiting batch request to be admitted alone.
TEST(Dispatcher, AnArrivalLargerThanTheByteBoundByItselfIsRefusedAtOnceSheddingNone) {
  const json body = {{"model", "m"}, {"prompt", "hi"}};
  const json large = {{"model", "m"}, {"prompt", std::string(4096, 'x')}};
  Cluster c(with_queued_body_bytes(with_classes(aggregated({engine("a", 0, 1)})), 2048));
  auto running = c.send_body(body, "k-batch");
  auto older = c.send_body(body, "k-batch");
  auto newer = c.send_body(body, "k-batch");
  ASSERT_EQ(c.dispatcher.waiting(), 2u);
  const size_t queued = c.dispatcher.queued_body_bytes();
  auto chat = c.send_body(large, "k-chat");
  EXPECT_EQ(chat->status, 429);
  EXPECT_EQ(chat->retry_after, "1");
  EXPECT_EQ(chat->error_code, "rate_limit_exceeded");
  EXPECT_NE(chat->error_message.find("max_queued_body_bytes 2048"), std::string::npos)
      << chat->error_message;
  EXPECT_FALSE(older->complete());
  EXPECT_FALSE(newer->complete());
  EXPECT_EQ(c.dispatcher.waiting(), 2u);
  EXPECT_EQ(c.dispatcher.queued_body_bytes(), queued);
  // Where nothing waits it is served, as before.
  for (int i = 0; i < 3; ++i) c.answer_all();
  ASSERT_EQ(c.dispatcher.active(), 0u);
  auto alone = c.send_body(large, "k-chat");
  c.answer_all();
  EXPECT_EQ(alone->status, 200);
  EXPECT_EQ(older->status, 200);
  EXPECT_EQ(newer->status, 200);
  EXPECT_EQ(c.dispatcher.queued_body_bytes(), 0u);
}

// A sequential decode stage waiting in the queue holds its decode body (the body plus the
// prefill's kv_transfer_params) besides the bodies it came with: the byte bound counts it. Only
// the bodies it came with were counted.
TEST(Dispatcher, ASequentialDecodeStageWaitingCountsItsDecodeBodyTowardTheByteBound) {
  DecodeStageWaiting s(Dialect::kVllm);
  Cluster& c = s.c;
  // The second prefill leg is the waiting request's (the first decode leg came after both).
  const size_t prefill_body = c.engines.all("/v1/completions").at(1)->request.body.size();
  ASSERT_EQ(c.dispatcher.waiting(), 1u);
  const size_t queued = c.dispatcher.queued_body_bytes();
  auto first_decode = c.engines.open("/v1/completions").at(0);
  FakeEngines::answer(*first_decode, 200, completion_answer("one"));
  c.clock.run_ready();
  EXPECT_EQ(s.running->status, 200);
  EXPECT_EQ(c.dispatcher.queued_body_bytes(), 0u);
  auto second_decode = c.engines.open("/v1/completions").at(0);
  // Its prefill and decode legs' bodies (and its client's body besides) waited with it.
  EXPECT_GE(queued, prefill_body + second_decode->request.body.size());
  FakeEngines::answer(*second_decode, 200, completion_answer("two"));
  c.clock.run_ready();
  EXPECT_EQ(s.waiting->status, 200);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A group (n > 1, a prompt list: one request per choice, ChoiceMerger) is shed whole or not at
// all: a higher class's arrival sheds every choice of a lower-class group none of whose choices was
// sent to an engine, its client gets one 429, and the queue stays within max_queue. Groups neither
// shed nor were shed (f9f8106): a queue full of batch groups refused every interactive request.
TEST(Dispatcher, AHigherClassRequestShedsAWholeWaitingGroupOfALowerClass) {
  Topology t = with_classes(aggregated({engine("a", 0, 1)}));
  t.max_queue = 3;
  Cluster c(t);
  const json body = {{"model", "m"}, {"prompt", "hi"}};
  auto running = c.send_body(body, "k-batch");
  auto group = c.send_choices(3, "k-batch");
  ASSERT_EQ(c.dispatcher.waiting(), 3u);
  ASSERT_EQ(c.dispatcher.active(), 4u);
  auto chat = c.send_body(body, "k-chat");
  EXPECT_EQ(group->status, 429);
  EXPECT_EQ(group->answers, 1);
  EXPECT_NE(group->body.find("higher-priority"), std::string::npos) << group->body;
  EXPECT_FALSE(chat->complete());
  EXPECT_EQ(c.dispatcher.waiting(), 1u);  // the three choices left, the arrival joined
  EXPECT_EQ(c.dispatcher.active(), 2u);
  for (int i = 0; i < 2; ++i) c.answer_all();
  EXPECT_EQ(running->status, 200);
  EXPECT_EQ(chat->status, 200);
  EXPECT_EQ(c.dispatcher.active(), 0u);
  EXPECT_EQ(c.clock.pending_timers(), 0u);  // the shed choices' queue timers went with them
}

// A group one of whose choices was sent to an engine is not shed (its client would lose work under
// way): a single lower-class request is shed instead, and without one the arrival gets 429.
TEST(Dispatcher, AGroupWithAChoiceAlreadySentIsNotShed) {
  Topology t = with_classes(aggregated({engine("a", 0, 1)}));
  t.max_queue = 3;
  Cluster c(t);
  const json body = {{"model", "m"}, {"prompt", "hi"}};
  auto group = c.send_choices(3, "k-batch");  // choice 0 runs on the engine, 1 and 2 wait
  ASSERT_EQ(c.engines.open("/v1/completions").size(), 1u);
  ASSERT_EQ(c.dispatcher.waiting(), 2u);
  auto batch = c.send_body(body, "k-batch");
  ASSERT_EQ(c.dispatcher.waiting(), 3u);
  auto chat = c.send_body(body, "k-chat");  // sheds the lone batch request, not the group
  EXPECT_EQ(batch->status, 429);
  EXPECT_FALSE(chat->complete());
  auto chat2 = c.send_body(body, "k-chat");
  EXPECT_EQ(chat2->status, 429);
  EXPECT_NE(chat2->error_message.find("queue is full"), std::string::npos) << chat2->error_message;
  EXPECT_FALSE(group->complete());
  EXPECT_EQ(c.dispatcher.waiting(), 3u);
  for (int i = 0; i < 4; ++i) c.answer_all();
  EXPECT_EQ(group->status, 200);
  EXPECT_EQ(json::parse(group->body)["choices"].size(), 3u);
  EXPECT_EQ(chat->status, 200);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

// A higher-class group at a full queue sheds one place's worth (the newest lower-class request, or
// group whole) and joins, as a single request does, overshooting max_queue by at most its number
// less one. At a queue already past its bound it must shed enough to leave one place free; when
// all the lower-class work would not, it sheds nothing and is refused whole (the overshoot never
// compounds).
TEST(Dispatcher, AHigherClassGroupAtAFullQueueShedsOnePlacesWorthAndJoins) {
  Topology t = with_classes(aggregated({engine("a", 0, 1)}));
  t.max_queue = 4;
  Cluster c(t);
  const json body = {{"model", "m"}, {"prompt", "hi"}};
  auto running = c.send_body(body, "k-batch");
  auto chat1 = c.send_body(body, "k-chat");
  auto chat2 = c.send_body(body, "k-chat");
  auto batch1 = c.send_body(body, "k-batch");
  auto batch2 = c.send_body(body, "k-batch");
  ASSERT_EQ(c.dispatcher.waiting(), 4u);
  auto four = c.send_choices(4, "k-chat");  // sheds the newest batch request only
  EXPECT_FALSE(four->complete());
  EXPECT_EQ(batch2->status, 429);
  EXPECT_NE(batch2->error_message.find("higher-priority"), std::string::npos)
      << batch2->error_message;
  EXPECT_FALSE(batch1->complete());
  EXPECT_EQ(c.dispatcher.waiting(), 7u);
  // 7 waiting of 4: one place free needs 4 shed, and only batch1 is of a lower class.
  auto refused = c.send_choices(2, "k-chat");
  EXPECT_EQ(refused->status, 429);
  EXPECT_EQ(refused->answers, 1);
  EXPECT_NE(refused->body.find("queue is full"), std::string::npos) << refused->body;
  EXPECT_FALSE(batch1->complete());
  EXPECT_EQ(c.dispatcher.waiting(), 7u);
  for (int i = 0; i < 9; ++i) c.answer_all();
  for (const auto& client : {running, chat1, chat2, four, batch1}) EXPECT_EQ(client->status, 200);
  EXPECT_EQ(c.dispatcher.active(), 0u);
}

TEST(Dispatcher, AnUnknownPriorityIsA400NamingTheField) {
  Cluster c(with_classes(aggregated({engine("a")})));
  for (const json& bad : {json(3), json("urgent")}) {
    auto client = c.send_body({{"model", "m"}, {"prompt", "hi"}, {"priority", bad}}, "k-chat");
    EXPECT_EQ(client->status, 400);
    EXPECT_EQ(json::parse(client->body)["error"]["param"], "priority");
  }
  EXPECT_TRUE(c.engines.open("/v1/completions").empty());
}

// ------------------------------------------------------------------------ drain and reload

TEST(Dispatcher, ADrainedEngineFinishesItsRequestsTakesNoNewOnesThenLeaves) {
  Cluster c(aggregated({engine("a"), engine("b")}));
  auto held = c.send();
  ASSERT_EQ(host_of(*c.engines.open().at(0)), "a");
  int64_t in_flight = -1;
  ASSERT_TRUE(c.dispatcher.remove_endpoint("a", &in_flight));
  EXPECT_EQ(in_flight, 1);
  EXPECT_EQ(c.endpoint("a")["draining"], true);
  EXPECT_FALSE(c.dispatcher.remove_endpoint("a", nullptr));  // already draining
  c.send();
  c.send();
  auto open = c.engines.open();
  ASSERT_EQ(open.size(), 3u);
  EXPECT_EQ(host_of(*open[1]), "b");
  EXPECT_EQ(host_of(*open[2]), "b");
  c.answer_all();
  EXPECT_EQ(held->status, 200);
  EXPECT_TRUE(c.endpoint("a").is_null());  // gone once its last leg finished
}

// A removed engine's series stay while it drains (its in-flight gauge counting the legs that
// still run, not 0), and go once it left: a gateway whose engines come and go does not keep
// every name it ever had in /metrics. The name, back later, starts its series at 0.
TEST(Dispatcher, ARemovedEnginesSeriesGoOnceItHasDrained) {
  Cluster c(aggregated({engine("a"), engine("b")}));
  auto held = c.send();
  ASSERT_EQ(host_of(*c.engines.open().at(0)), "a");
  const std::string in_flight = "tandem:gateway_endpoint_in_flight{pool=\"decode\",endpoint=\"a\"}";
  const std::string requests =
      "tandem:gateway_endpoint_requests_total{pool=\"decode\",endpoint=\"a\"}";
  ASSERT_TRUE(c.dispatcher.remove_endpoint("a", nullptr));
  EXPECT_EQ(c.metric(in_flight), 1);  // its leg still runs
  EXPECT_EQ(c.metric(requests), 1);
  c.answer_all();
  EXPECT_EQ(held->status, 200);
  const std::string text = c.registry.render();
  EXPECT_EQ(text.find("endpoint=\"a\""), std::string::npos) << text;
  EXPECT_NE(text.find("endpoint=\"b\""), std::string::npos);
  ASSERT_EQ(c.dispatcher.add_endpoint(false, engine("a")), "");
  EXPECT_NE(c.registry.render().find(requests + " 0\n"), std::string::npos);
}

// The name comes back while the old engine still drains: the newcomer owns the name's series
// (in flight 0, healthy 1), and they stay when the old one leaves.
TEST(Dispatcher, ANameBackWhileItsEngineDrainsKeepsItsSeries) {
  Cluster c(aggregated({engine("a"), engine("b")}));
  auto held = c.send();
  ASSERT_EQ(host_of(*c.engines.open().at(0)), "a");
  ASSERT_TRUE(c.dispatcher.remove_endpoint("a", nullptr));
  Endpoint back = engine("a");
  back.port = 8001;  // the same name at a new address
  ASSERT_EQ(c.dispatcher.add_endpoint(false, back), "");
  const std::string labels = "{pool=\"decode\",endpoint=\"a\"}";
  EXPECT_EQ(c.metric("tandem:gateway_endpoint_in_flight" + labels), 0);
  EXPECT_EQ(c.metric("tandem:gateway_endpoint_healthy" + labels), 1);
  c.answer_all();  // the old a leaves
  EXPECT_EQ(held->status, 200);
  EXPECT_NE(c.registry.render().find("tandem:gateway_endpoint_in_flight" + labels + " 0\n"),
            std::string::npos);
  EXPECT_EQ(c.metric("tandem:gateway_endpoint_healthy" + labels), 1);
}

TEST(Dispatcher, RequestsWaitingForARemovedPoolGet503) {
  Cluster c(aggregated({engine("a", 0, 1)}));
  c.send();
  auto waiting = c.send();
  c.dispatcher.remove_endpoint("a", nullptr);
  EXPECT_EQ(waiting->status, 503);
  EXPECT_NE(waiting->error_message.find("draining"), std::string::npos);
}

TEST(Dispatcher, ReloadKeepsUnchangedEnginesDrainsChangedOnesAndAddsNewOnes) {
  Cluster c(aggregated({engine("a"), engine("b")}));
  c.send();  // on a: its load must survive the reload
  Topology next = aggregated({engine("a"), engine("b", 0, 3), engine("c")});
  const auto result = c.dispatcher.reload(next);
  EXPECT_EQ(result.added, 2);    // b (changed) and c
  EXPECT_EQ(result.removed, 1);  // the old b
  EXPECT_EQ(c.endpoint("a")["in_flight"], 1);
  EXPECT_EQ(c.endpoint("b")["max_in_flight"], 3);
  EXPECT_EQ(c.endpoint("c")["healthy"], true);
  EXPECT_EQ(c.dispatcher.reload(next).added, 0);  // idempotent
}

// A reload applies what the file says of each engine as it would join now: its pool's limit and
// dialect, and where its KV events come from; engines added later join with them too.
TEST(Dispatcher, AReloadAppliesThePoolsLimitAndDialectAndTheEnginesKvEvents) {
  Cluster c(aggregated({engine("a"), engine("b", 0, 5)}));
  Topology next = aggregated({engine("a"), engine("b", 0, 5)});
  next.decode.max_in_flight = 3;
  auto result = c.dispatcher.reload(next);
  EXPECT_EQ(result.added, 1);  // a, with the pool's new limit; b keeps a limit of its own
  EXPECT_EQ(result.removed, 1);
  EXPECT_EQ(c.endpoint("a")["max_in_flight"], 3);
  EXPECT_EQ(c.endpoint("b")["max_in_flight"], 5);
  EXPECT_EQ(c.endpoint("a")["load_source"], "own_counts");

  next.decode.dialect = Dialect::kTandem;
  result = c.dispatcher.reload(next);
  EXPECT_EQ(result.added, 2);
  EXPECT_EQ(result.removed, 2);
  EXPECT_EQ(c.endpoint("a")["load_source"], "reports");

  next.decode.endpoints[0].kv_events = "inproc://kv-events-of-a";
  result = c.dispatcher.reload(next);
  EXPECT_EQ(result.added, 1);
  EXPECT_EQ(result.removed, 1);
  EXPECT_TRUE(c.endpoint("a").contains("prefix_blocks"));  // a consumer feeds the index now
  EXPECT_EQ(c.dispatcher.reload(next).added, 0);           // idempotent

  ASSERT_EQ(c.dispatcher.add_endpoint(false, engine("c")), "");
  EXPECT_EQ(c.endpoint("c")["max_in_flight"], 3);
  EXPECT_EQ(c.endpoint("c")["load_source"], "reports");
}

// A new engine's KV-event consumer is built before the reload changes anything. It threw after
// the engines it replaced were drained: with every engine changed, none was left (/health 503,
// and POST /admin/reload answered 500 without an answer of its own).
TEST(Dispatcher, AReloadWhoseNewEngineCannotFollowItsKvEventsChangesNothing) {
  Cluster c(aggregated({engine("a"), engine("b")}));
  c.send();  // on a
  Topology next = aggregated({engine("a"), engine("b", 0, 3), engine("c")});
  next.decode.max_in_flight = 4;                 // every engine changes
  next.decode.endpoints[2].kv_events = "bogus";  // ZMQ refuses it (the file's reader would too)
  EXPECT_THROW(c.dispatcher.reload(next), Error);
  for (const char* name : {"a", "b"}) {
    EXPECT_EQ(c.endpoint(name)["draining"], false) << name;
    EXPECT_EQ(c.endpoint(name)["max_in_flight"], 8) << name;
  }
  EXPECT_EQ(c.endpoint("a")["in_flight"], 1);
  EXPECT_TRUE(c.endpoint("c").is_null());
  EXPECT_TRUE(c.endpoints.ready());
  EXPECT_EQ(c.registry.render().find("endpoint=\"c\""), std::string::npos);

  next.decode.endpoints[2].kv_events = "inproc://kv-events-of-c";
  const auto result = c.dispatcher.reload(next);
  EXPECT_EQ(result.added, 3);
  EXPECT_EQ(result.removed, 2);
  EXPECT_TRUE(c.endpoint("c").contains("prefix_blocks"));
}

// An engine whose KV events cannot be followed is refused before it leaves a trace: its metric
// series were labelled (healthy 1) and an id spent before the consumer threw.
TEST(Dispatcher, AnEngineWhoseKvEventsCannotBeFollowedIsRefusedWithoutATrace) {
  Cluster c(aggregated({engine("a")}));
  Endpoint x = engine("x");
  x.kv_events = "inproc://kv-events-of-x";
  x.kv_events_replay = "bogus";
  EXPECT_THAT(c.dispatcher.add_endpoint(false, x),
              ::testing::HasSubstr("cannot connect to replay endpoint 'bogus'"));
  EXPECT_TRUE(c.endpoint("x").is_null());
  EXPECT_EQ(c.registry.render().find("endpoint=\"x\""), std::string::npos);
  int id = -1;
  ASSERT_EQ(c.dispatcher.add_endpoint(false, engine("y"), &id), "");
  EXPECT_EQ(id, 1);  // the next id after a's
}

TEST(Dispatcher, AdmissionRefusesADuplicateNameAndAPrefillEngineInAggregatedMode) {
  Cluster c(aggregated({engine("a")}));
  EXPECT_NE(c.dispatcher.add_endpoint(false, engine("a")).find("exists"), std::string::npos);
  EXPECT_NE(c.dispatcher.add_endpoint(true, engine("p")).find("no prefill pool"),
            std::string::npos);
  EXPECT_EQ(c.dispatcher.add_endpoint(false, engine("b")), "");
  EXPECT_EQ(c.endpoint("b")["pool"], "decode");
}

// One engine under two names would take twice its in-flight limit: the address (its host in any
// case) is refused in the pool that has it, naming the field and the engine there. Once that one
// drains, the address may join again.
TEST(Dispatcher, AdmissionRefusesAnAddressThePoolHasUnderAnotherName) {
  Cluster c(aggregated({engine("a")}));
  Endpoint twin = engine("a");
  twin.name = "a-again";
  EXPECT_EQ(c.dispatcher.add_endpoint(false, twin),
            "endpoint.url: a.engines:8000 is already in the decode pool, as 'a'");
  // Host names are case-insensitive, as DNS resolves them (and as topology files compare them).
  Endpoint shouting = twin;
  shouting.host = "A.Engines";
  EXPECT_EQ(c.dispatcher.add_endpoint(false, shouting),
            "endpoint.url: A.Engines:8000 is already in the decode pool, as 'a'");
  Endpoint other_port = twin;
  other_port.name = "a-8001";
  other_port.port = 8001;
  EXPECT_EQ(c.dispatcher.add_endpoint(false, other_port), "");
  ASSERT_TRUE(c.dispatcher.remove_endpoint("a", nullptr));
  EXPECT_EQ(c.dispatcher.add_endpoint(false, twin), "");
}

TEST(Dispatcher, AdmissionRefusesAPrefillEngineWhoseGroupHasNoDecodeEngine) {
  Cluster c(disaggregated(PdMode::kSequential, {engine("p")}, {engine("d")}));
  EXPECT_EQ(c.dispatcher.add_endpoint(true, engine("p1", 1)),
            "group 1 has no decode engine; add one to the group before its prefill engines");
  EXPECT_EQ(c.dispatcher.add_endpoint(false, engine("d1", 1)), "");
  EXPECT_EQ(c.dispatcher.add_endpoint(true, engine("p1", 1)), "");
}

// The admin API reads an engine as the topology file does: what wrapped, overflowed or reached
// the upstream Host header raw before is refused naming the field.
TEST(AdminApi, ReadsAnEngineWithTheTopologyFilesChecks) {
  auto error = [](const json& j) {
    try {
      endpoint_from_json(j);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error({{"host", "a"}, {"port", 65616}}),
            "endpoint.port: expected a port 1..65535, got 65616");
  EXPECT_EQ(error({{"url", "a:1"}, {"bootstrap_port", 65616}}),
            "endpoint.bootstrap_port: expected a port 1..65535, got 65616");
  EXPECT_EQ(error({{"url", "a:1"}, {"group", 1e300}}),
            "endpoint.group: expected a whole number >= 0, got 1e+300");
  EXPECT_EQ(error({{"host", "a\r\nX-Injected: 1"}, {"port", 80}}).substr(0, 50),
            "endpoint.host: expected a host name or address (le");
  EXPECT_EQ(error({{"url", "a:1"}, {"max_inflight", 3}}).substr(0, 47),
            "endpoint.max_inflight: expected one of url, hos");
  const Endpoint e = endpoint_from_json({{"host", "a"}, {"port", 80}, {"max_in_flight", 4}});
  EXPECT_EQ(e.name, "a:80");
  EXPECT_EQ(e.max_in_flight, 4);
  EXPECT_EQ(endpoint_from_json("b:81@82").bootstrap_port, 82);
  // A name labels the engine's metric series: at most 256 bytes of text (a 7 MB name made every
  // scrape 35 MB).
  const std::string expected_name =
      "endpoint.name: expected a name of 1..256 bytes of UTF-8 text without control characters, "
      "got '";
  EXPECT_EQ(
      error({{"url", "a:1"}, {"name", std::string(257, 'x')}}).substr(0, expected_name.size()),
      expected_name);
  EXPECT_EQ(error({{"url", "a:1"}, {"name", "a\nb"}}), expected_name + "a\\x0ab'");
  EXPECT_EQ(endpoint_from_json({{"url", "a:1"}, {"name", std::string(256, 'x')}}).name.size(),
            256u);
  EXPECT_EQ(endpoint_from_json({{"url", "a:1"}, {"name", "m\xc3\xbcnchen-1"}}).name,
            "m\xc3\xbcnchen-1");
}

// ------------------------------------------------------------------------------- health

TEST(HealthMonitor, EjectsAnEngineAfterFailedProbesAndReadmitsItWithSlowStart) {
  Topology t = aggregated({engine("a", 0, 10), engine("b", 0, 10)});
  t.health.failures_to_eject = 2;
  t.health.probe_interval = milliseconds(1000);
  t.health.slow_start = milliseconds(10000);
  Cluster c(t);
  c.health.start();
  auto fail_a_probes = [&] {
    for (const auto& p : c.engines.open("/health")) {
      if (host_of(*p) == "a")
        FakeEngines::finish(*p, "connection refused");
      else
        FakeEngines::answer(*p, 200, "");
    }
    c.clock.run_ready();
  };
  fail_a_probes();
  EXPECT_EQ(c.endpoint("a")["healthy"], true);
  c.clock.advance_by(milliseconds(1000));
  fail_a_probes();
  EXPECT_EQ(c.endpoint("a")["healthy"], false);
  EXPECT_TRUE(c.endpoints.ready());  // b still serves
  for (int i = 0; i < 3; ++i) c.send();
  for (const auto& call : c.engines.open("/v1/completions")) EXPECT_EQ(host_of(*call), "b");

  // a answers again: readmitted, but it takes one request at first, more as the ramp goes on.
  c.clock.advance_by(milliseconds(1000));
  for (const auto& p : c.engines.open("/health")) FakeEngines::answer(*p, 200, "");
  c.clock.run_ready();
  EXPECT_EQ(c.endpoint("a")["healthy"], true);
  for (int i = 0; i < 4; ++i) c.send();
  int on_a = 0;
  for (const auto& call : c.engines.open("/v1/completions")) on_a += host_of(*call) == "a";
  EXPECT_EQ(on_a, 1);
}

// An engine that answers 503 (it is full), or whose leg times out while it passes its health
// probes, is overloaded, not broken: it is never ejected for that, so a load peak cannot eject
// every engine. A timeout with no probe passed since the leg was sent counts as a failure.
TEST(HealthMonitor, AnOverloadedEngineIsNotEjected) {
  Topology t = aggregated({engine("a")});
  t.health.failures_to_eject = 2;
  t.health.probe_interval = milliseconds(1000);
  t.timeouts.first_token = milliseconds(1500);
  t.prefill_retries = 0;
  Cluster c(t);
  c.health.start();
  auto answer_probes = [&] {
    for (const auto& p : c.engines.open("/health")) FakeEngines::answer(*p, 200, "");
    c.clock.run_ready();
  };
  answer_probes();
  for (int i = 0; i < 3; ++i) {
    auto client = c.send();
    FakeEngines::answer(*c.engines.open("/v1/completions").at(0), 503,
                        R"({"error":{"message":"the engine's queue is full"}})");
    c.clock.run_ready();
    EXPECT_TRUE(client->complete());
  }
  for (int i = 0; i < 3; ++i) {
    auto client = c.send(true);
    c.clock.advance_by(milliseconds(1000));
    answer_probes();  // alive while the leg waits
    c.clock.advance_by(milliseconds(500));
    EXPECT_TRUE(client->complete());
  }
  EXPECT_EQ(c.endpoint("a")["healthy"], true);
  EXPECT_EQ(c.endpoint("a")["consecutive_failures"], 0);
  EXPECT_EQ(c.metric("tandem:gateway_endpoint_overloaded_total{pool=\"decode\",endpoint=\"a\"}"),
            6);

  // A leg that times out with no probe passed since it was sent: a failure.
  t.timeouts.first_token = milliseconds(500);
  Cluster quiet(t);
  quiet.health.start();
  for (const auto& p : quiet.engines.open("/health")) FakeEngines::answer(*p, 200, "");
  quiet.clock.run_ready();
  quiet.send(true);
  quiet.clock.advance_by(milliseconds(500));
  EXPECT_EQ(quiet.endpoint("a")["consecutive_failures"], 1);
}

// An engine ejected by its health probes answers at once the requests it leaves without any
// engine (503 naming why), as a leg's failure that ejects it does. Only a readmission
// re-dispatched the queue: a request waited for its queue timeout or another leg's end.
TEST(HealthMonitor, AnEjectionAnswersTheRequestsItLeavesWithoutAnEngine) {
  Topology t = probed_every_second(aggregated({engine("a", 0, 1)}));
  Cluster c(t);
  start_probes(c);
  auto running = c.send();
  auto waiting = c.send();
  ASSERT_EQ(c.dispatcher.waiting(), 1u);
  c.clock.advance_by(milliseconds(1000));
  probes_answer(c, {"a"});
  EXPECT_EQ(waiting->status, 503);
  EXPECT_NE(waiting->error_message.find("1 ejected"), std::string::npos) << waiting->error_message;
  EXPECT_EQ(c.dispatcher.waiting(), 0u);
  // The running one's leg was cut with its engine (ejected engines are cut: below), and no engine
  // is left to retry it on.
  EXPECT_EQ(running->status, 503);
  EXPECT_NE(running->error_message.find("no healthy engine"), std::string::npos)
      << running->error_message;
}

// An engine ejected by its failed probes (hung: it answers nothing) no longer holds the requests
// already sent to it that sent their client nothing until their timeouts (300 s): such a leg is
// cut and retried on another engine (they waited for the hung engine). A stream under way keeps
// its leg: an ejection may be late probes of a loaded engine whose streams still move.
TEST(HealthMonitor, AnEjectionRetriesElsewhereTheLegsOnItsEngineThatSentNothing) {
  for (const bool streaming : {false, true}) {
    Topology t = probed_every_second(aggregated({engine("a"), engine("b")}));
    Cluster c(t);
    start_probes(c);
    auto client = c.send(streaming);
    auto leg = c.engines.open("/v1/completions");
    ASSERT_EQ(leg.size(), 1u);
    ASSERT_EQ(host_of(*leg[0]), "a");
    const std::string first = net::sse_event(R"({"choices":[{"index":0,"text":"x"}]})");
    if (streaming) {
      FakeEngines::head(*leg[0], 200, "text/event-stream");
      FakeEngines::piece(*leg[0], first);
      c.clock.run_ready();
    }
    c.clock.advance_by(milliseconds(1000));
    probes_answer(c, {"a"});
    EXPECT_EQ(leg[0]->cancelled, !streaming);
    if (streaming) {
      EXPECT_EQ(c.engines.open("/v1/completions").size(), 1u);  // no retry: it goes on
      ASSERT_TRUE(FakeEngines::piece(*leg[0], "data: [DONE]\n\n"));
      FakeEngines::finish(*leg[0], "");
      c.clock.run_ready();
      EXPECT_TRUE(client->complete());
      EXPECT_EQ(client->streamed, first + "data: [DONE]\n\n");
    } else {
      auto retry = c.engines.open("/v1/completions");
      ASSERT_EQ(retry.size(), 1u);
      EXPECT_EQ(host_of(*retry[0]), "b");
      EXPECT_FALSE(client->complete());
      c.answer_all("from b");
      EXPECT_EQ(client->status, 200);
    }
    EXPECT_EQ(c.dispatcher.active(), 0u) << streaming;
  }
}

// An engine ejected for failed requests that still answers its probes (a loaded one) may still
// be working through the legs it holds: they are not cut until its probes fail too.
TEST(HealthMonitor, AnEngineEjectedForFailedRequestsKeepsItsLegsUntilItsProbesFail) {
  Topology t = probed_every_second(aggregated({engine("a"), engine("b")}));
  Cluster c(t);
  start_probes(c);
  auto client = c.send();
  auto leg = c.engines.open("/v1/completions");
  ASSERT_EQ(leg.size(), 1u);
  ASSERT_EQ(host_of(*leg[0]), "a");
  for (const auto& [id, e] : c.endpoints.all())
    if (e.config.name == "a") c.endpoints.failure(*c.endpoints.find(id));  // a failed request
  c.dispatcher.engines_changed();  // as a load report from any engine calls it
  EXPECT_FALSE(leg[0]->cancelled);
  c.clock.advance_by(milliseconds(1000));
  probes_answer(c, {"a"});
  EXPECT_TRUE(leg[0]->cancelled);
  auto retry = c.engines.open("/v1/completions");
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(host_of(*retry[0]), "b");
  c.answer_all("from b");
  EXPECT_EQ(client->status, 200);
}

// A leg cut for its engine's ejection whose call reports the cancel late (the real client does,
// from its io thread) may meet its deadline meanwhile: the first reason stands. The deadline's
// overwrote it, and the whole-answer timeout then answered 504 "not retried" for a leg that the
// ejection had cut: the client got a timeout from an engine the gateway had given up on.
TEST(HealthMonitor, ALegCutForAnEjectionKeepsThatReasonWhenItsDeadlinePassesBeforeItEnds) {
  Topology t = probed_every_second(aggregated({engine("a"), engine("b")}));
  t.timeouts.first_token = milliseconds(1500);
  t.prefill_retries = 0;
  Cluster c(t);
  start_probes(c);
  auto client = c.send();
  auto leg = c.engines.open("/v1/completions");
  ASSERT_EQ(leg.size(), 1u);
  ASSERT_EQ(host_of(*leg[0]), "a");
  c.engines.answer_after_cancel = true;
  c.clock.advance_by(milliseconds(1000));
  probes_answer(c, {"a"});
  ASSERT_TRUE(leg[0]->cancelled);
  c.clock.advance_by(milliseconds(500));  // the leg's deadline, before its cancel reports back
  FakeEngines::finish(*leg[0], "cancelled");
  c.clock.run_ready();
  EXPECT_EQ(client->status, 502);
  EXPECT_THAT(client->error_message, testing::HasSubstr("its engine was ejected"));
  EXPECT_THAT(client->error_message, testing::Not(testing::HasSubstr("timed out")));
}

// A cut (its engine's ejection, its deadline) that crosses a non-streaming leg's whole answer
// (the answer arrived before the cancel reached the call, which then ended by itself) loses to
// it: the client gets the answer, and no engine is asked again. The answer was dropped, and the
// request retried on another engine (the ejection) or answered 504 (the deadline).
TEST(HealthMonitor, AWholeAnswerThatCrossesItsLegsCutIsRelayed) {
  for (const bool ejected : {true, false}) {
    Topology t = probed_every_second(aggregated({engine("a"), engine("b")}));
    t.timeouts.first_token = milliseconds(ejected ? 5000 : 500);
    Cluster c(t);
    start_probes(c);
    auto client = c.send();
    auto leg = c.engines.open("/v1/completions");
    ASSERT_EQ(leg.size(), 1u) << ejected;
    ASSERT_EQ(host_of(*leg[0]), "a") << ejected;
    c.engines.answer_crossing_cancel = completion_answer("from a");
    if (ejected) {
      c.clock.advance_by(milliseconds(1000));
      probes_answer(c, {"a"});
    } else {
      c.clock.advance_by(milliseconds(500));
    }
    c.clock.run_ready();
    EXPECT_TRUE(leg[0]->cancelled) << ejected;
    EXPECT_EQ(client->status, 200) << ejected;
    EXPECT_EQ(client->body, completion_answer("from a")) << ejected;
    EXPECT_EQ(c.engines.all("/v1/completions").size(), 1u) << ejected;
    EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 0) << ejected;
  }
}

// The same for a sequential prefill leg: its whole answer, with the KV's whereabouts, crossed the
// cut of its engine's ejection. The decode stage takes that KV; the prompt was prefilled again on
// another engine, and the KV of the first prefill stayed held on p1, released by nobody.
TEST(HealthMonitor, AWholePrefillAnswerThatCrossesItsLegsCutIsUsed) {
  Topology t = probed_every_second(
      disaggregated(PdMode::kSequential, {engine("p1"), engine("p2")}, {engine("d")}));
  Cluster c(t);
  start_probes(c);
  auto client = c.send();
  auto prefill = c.engines.open("/v1/completions");
  ASSERT_EQ(prefill.size(), 1u);
  ASSERT_EQ(host_of(*prefill[0]), "p1");
  c.engines.answer_crossing_cancel = json{{"kv_transfer_params", kHeldKv}}.dump();
  c.clock.advance_by(milliseconds(1000));
  probes_answer(c, {"p1"});
  EXPECT_TRUE(prefill[0]->cancelled);
  c.engines.answer_crossing_cancel.clear();
  auto decode = c.engines.open("/v1/completions");
  ASSERT_EQ(decode.size(), 1u);
  EXPECT_EQ(host_of(*decode[0]), "d");
  EXPECT_EQ(json::parse(decode[0]->request.body)["kv_transfer_params"], kHeldKv);
  EXPECT_EQ(c.metric("tandem:gateway_retries_total"), 0);
  c.answer_all("decoded");
  EXPECT_EQ(client->status, 200);
}

// A drained engine is not ejected: its legs finish.
TEST(HealthMonitor, ADrainLetsTheLegsOnItsEngineFinish) {
  Topology t = aggregated({engine("a"), engine("b")});
  t.health.probe_interval = milliseconds(1000);
  Cluster c(t);
  start_probes(c);
  auto client = c.send();
  auto leg = c.engines.open("/v1/completions").at(0);
  ASSERT_EQ(host_of(*leg), "a");
  ASSERT_TRUE(c.dispatcher.remove_endpoint("a", nullptr));
  c.clock.advance_by(milliseconds(1000));
  probes_answer(c);
  EXPECT_FALSE(leg->cancelled);
  c.answer_all("from a");
  EXPECT_EQ(client->status, 200);
}

// GET /v1/models, /tokenize and /detokenize are one call to one engine: any engine that is up
// takes it, however busy. They went through the policy's pick, so a pool at its limits answered
// 503 "no healthy engine".
TEST(Dispatcher, OneOffCallsGoToAnEngineThatIsUpHoweverBusy) {
  Cluster c(aggregated({engine("a", 0, 1), engine("b", 0, 1)}));
  c.send();
  c.send();
  c.send();  // waits: both are at their limit
  ASSERT_EQ(c.dispatcher.waiting(), 1u);
  const EndpointState* e = c.dispatcher.models_endpoint();
  ASSERT_NE(e, nullptr);
  int64_t in_flight = 0;
  ASSERT_TRUE(c.dispatcher.remove_endpoint("a", &in_flight));
  e = c.dispatcher.models_endpoint();
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->config.name, "b");
  ASSERT_TRUE(c.dispatcher.remove_endpoint("b", &in_flight));
  EXPECT_EQ(c.dispatcher.models_endpoint(), nullptr);
}

// An engine that joined and has not passed its first health check takes no one-off call either,
// as it takes no request (it may serve another model, or still be loading). The least busy
// engine that was up took them: the new one, idle.
TEST(Dispatcher, OneOffCallsGoToNoEngineThatHasNotPassedItsFirstCheck) {
  Cluster c(aggregated({engine("a")}));
  c.endpoints.check_joining_engines([](int) {});
  auto running = c.send();  // a has a request in flight
  ASSERT_EQ(c.dispatcher.add_endpoint(false, engine("new")), "");
  ASSERT_EQ(c.endpoint("new")["unchecked"], true);
  const EndpointState* e = c.dispatcher.models_endpoint();
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->config.name, "a");
  c.answer_all();
  EXPECT_EQ(running->status, 200);
}

// A probe is bounded as a whole, not only per piece as the HTTP client bounds it: an engine that
// sends its head and then trickles its body (each byte within the per-piece timeout) fails its
// probe at probe_timeout and is probed again. Its probe stayed open, and the engine was never
// judged again.
TEST(HealthMonitor, AProbeThatNeverEndsFailsAtTheProbeTimeout) {
  Topology t = probed_every_second(aggregated({engine("a")}));
  t.health.probe_timeout = milliseconds(500);
  Cluster c(t);
  c.health.start();
  const auto probe = c.engines.open("/health").at(0);
  FakeEngines::head(*probe, 200, "text/plain");
  c.clock.advance_by(milliseconds(400));
  FakeEngines::piece(*probe, "o");
  c.clock.advance_by(milliseconds(100));
  EXPECT_TRUE(probe->cancelled);
  EXPECT_EQ(c.endpoint("a")["healthy"], false);
  c.clock.advance_by(milliseconds(500));
  EXPECT_EQ(c.engines.all("/health").size(), 2u);  // asked again
}

// The engines' longest sequence (GET /v1/models' max_model_len) is what tokens-in chats take
// their default max_tokens from: asked of each engine once it passes a probe, the least of the
// eligible engines that said one, asked again after a failed call or a readmission, never again
// of an engine that answered without it.
TEST(HealthMonitor, LearnsTheEnginesLongestSequenceFromTheirModelLists) {
  Topology t = probed_every_second(aggregated({engine("a"), engine("b"), engine("c")}));
  Cluster c(t);
  c.health.start();
  auto answer_probes = [&](const std::string& failing = {}) {
    for (const auto& p : c.engines.open("/health")) {
      if (host_of(*p) == failing)
        FakeEngines::finish(*p, "connection refused");
      else
        FakeEngines::answer(*p, 200, "");
    }
    c.clock.run_ready();
  };
  auto model_list = [](int64_t length) { return api::model_list_json({"m", 1, length}); };
  EXPECT_TRUE(c.engines.open("/v1/models").empty());  // only once a probe passed
  answer_probes();
  auto asked = c.engines.open("/v1/models");
  ASSERT_EQ(asked.size(), 3u);
  EXPECT_EQ(c.endpoints.max_model_len(), 0);
  for (const auto& call : asked) {
    if (host_of(*call) == "a") FakeEngines::answer(*call, 200, model_list(4096));
    if (host_of(*call) == "b") FakeEngines::finish(*call, "connection reset");
    if (host_of(*call) == "c") FakeEngines::answer(*call, 404, R"({"detail":"Not Found"})");
  }
  c.clock.run_ready();
  EXPECT_EQ(c.endpoints.max_model_len(), 4096);
  EXPECT_EQ(c.endpoint("a")["max_model_len"], 4096);

  // The next probe asks b again (its call failed), not a (answered) nor c (answered without it).
  c.clock.advance_by(milliseconds(1000));
  answer_probes();
  asked = c.engines.open("/v1/models");
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(host_of(*asked[0]), "b");
  FakeEngines::answer(*asked[0], 200, model_list(1024));
  c.clock.run_ready();
  EXPECT_EQ(c.endpoints.max_model_len(), 1024);  // the least

  // b is ejected: only eligible engines count. Readmitted, it is asked again (it may have
  // restarted with another length).
  c.clock.advance_by(milliseconds(1000));
  answer_probes("b");
  EXPECT_EQ(c.endpoint("b")["healthy"], false);
  EXPECT_EQ(c.endpoints.max_model_len(), 4096);
  EXPECT_TRUE(c.engines.open("/v1/models").empty());
  c.clock.advance_by(milliseconds(1000));
  answer_probes();
  asked = c.engines.open("/v1/models");
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(host_of(*asked[0]), "b");
  EXPECT_EQ(c.endpoints.max_model_len(), 4096);  // not known again until it answers
  FakeEngines::answer(*asked[0], 200, model_list(8192));
  c.clock.run_ready();
  EXPECT_EQ(c.endpoints.max_model_len(), 4096);
  EXPECT_EQ(c.endpoint("b")["max_model_len"], 8192);
}

TEST(HealthMonitor, AnAutoEngineWithoutALoadReportIsRoutedByOwnCounts) {
  Topology t = aggregated({engine("a")});
  t.decode.dialect = Dialect::kAuto;
  t.scheduling.load_interval = milliseconds(100);
  Cluster c(t);
  c.health.start();
  EXPECT_EQ(c.endpoint("a")["load_source"], "asking");
  auto polls = c.engines.open("/load");
  ASSERT_EQ(polls.size(), 1u);
  FakeEngines::answer(*polls[0], 404, R"({"detail":"Not Found"})");
  c.clock.run_ready();
  EXPECT_EQ(c.endpoint("a")["load_source"], "own_counts");
  c.clock.advance_by(milliseconds(1000));
  EXPECT_TRUE(c.engines.open("/load").empty());  // never asked again
}

size_t count_of(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// An engine that is to report (a `tandem` one, or an `auto` one that reported) but answers
// GET /load without a report is asked on every poll, and said once per reason: once when it
// starts, again when the reason changes, and again after reports resumed and stopped anew.
// An engine's load report: 100 blocks of 16 tokens, nothing else said.
std::string a_load_report() {
  api::LoadReport report;
  report.total_blocks = 100;
  report.block_size = 16;
  return api::to_json(report);
}

// One engine `a` of `dialect`, polled for its load every 100 ms.
Topology polled_for_load(Dialect dialect) {
  Topology t = aggregated({engine("a")});
  t.decode.dialect = dialect;
  t.scheduling.load_interval = milliseconds(100);
  return t;
}

TEST(HealthMonitor, AnEngineWithoutLoadReportsIsSaidOncePerReasonNotOnEveryPoll) {
  for (const Dialect dialect : {Dialect::kTandem, Dialect::kAuto}) {
    SCOPED_TRACE(dialect == Dialect::kTandem ? "tandem" : "auto");
    Cluster c(polled_for_load(dialect));
    ::testing::internal::CaptureStderr();
    c.health.start();
    // Answers the one poll open now, then lets the next one leave.
    auto answer_poll = [&](int status, const std::string& body) {
      auto polls = c.engines.open("/load");
      ASSERT_EQ(polls.size(), 1u);
      FakeEngines::answer(*polls[0], status, body);
      c.clock.advance_by(milliseconds(100));
    };
    if (dialect == Dialect::kAuto) answer_poll(200, a_load_report());  // it reports
    for (int i = 0; i < 20; ++i) answer_poll(404, R"({"detail":"Not Found"})");
    const json a = c.endpoint("a");
    EXPECT_EQ(a["load_source"], "reports");  // still asked: its reports may come back
    EXPECT_EQ(a.value("load_error", ""), "it answered HTTP 404");
    for (int i = 0; i < 5; ++i) answer_poll(200, R"({"server_load": 3})");  // another reason
    answer_poll(200, a_load_report());
    EXPECT_FALSE(c.endpoint("a").contains("load_error"));
    for (int i = 0; i < 5; ++i) answer_poll(404, R"({"detail":"Not Found"})");
    const std::string said = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(count_of(said,
                       "engine a answered GET /load without a Tandem load report (it "
                       "answered HTTP 404)"),
              2u)
        << said;
    EXPECT_EQ(count_of(said, "without a Tandem load report (its answer names no KV cache"), 1u)
        << said;
    EXPECT_EQ(count_of(said, "engine a reports its load again"), 1u) << said;
    EXPECT_EQ(count_of(said, "tandem gateway:"), 4u) << said;
  }
}

// An auto engine that reported, then answered 404, is readmitted after an ejection as a new
// server (asked again): its old trouble is not shown any more, and when the new server has no
// reports either it is routed by the gateway's own counts, no longer polled, so no load_error
// stays on /admin/endpoints for good (it did).
TEST(HealthMonitor, AReadmittedEngineShowsNoOldLoadTrouble) {
  Topology t = probed_every_second(polled_for_load(Dialect::kAuto));
  Cluster c(t);
  ::testing::internal::CaptureStderr();
  c.health.start();
  auto answer_polls = [&](int status, const std::string& body) {
    for (const auto& p : c.engines.open("/load")) FakeEngines::answer(*p, status, body);
    c.clock.run_ready();
  };
  auto answer_probes = [&](bool ok) {
    for (const auto& p : c.engines.open("/health")) {
      if (ok)
        FakeEngines::answer(*p, 200, "");
      else
        FakeEngines::finish(*p, "connection refused");
    }
    c.clock.run_ready();
  };
  answer_probes(true);
  answer_polls(200, a_load_report());
  c.clock.advance_by(milliseconds(100));
  answer_polls(404, R"({"detail":"Not Found"})");
  EXPECT_EQ(c.endpoint("a").value("load_error", ""), "it answered HTTP 404");
  c.clock.advance_by(milliseconds(1000));
  answer_probes(false);
  ASSERT_EQ(c.endpoint("a")["healthy"], false);
  c.clock.advance_by(milliseconds(1000));
  answer_probes(true);
  ASSERT_EQ(c.endpoint("a")["healthy"], true);
  EXPECT_FALSE(c.endpoint("a").contains("load_error"));
  c.clock.advance_by(milliseconds(100));
  answer_polls(404, R"({"detail":"Not Found"})");
  EXPECT_EQ(c.endpoint("a")["load_source"], "own_counts");
  EXPECT_FALSE(c.endpoint("a").contains("load_error"));
  ::testing::internal::GetCapturedStderr();
}

TEST(HealthMonitor, ALoadPollAsksOnlyForTheStepsAfterTheLastOneSeen) {
  Topology t = aggregated({engine("a")});
  t.decode.dialect = Dialect::kTandem;
  t.scheduling.load_interval = milliseconds(100);
  Cluster c(t);
  c.health.start();
  auto polls = c.engines.open("/load");
  ASSERT_EQ(polls.size(), 1u);
  EXPECT_EQ(polls[0]->request.target, "/load");  // nothing seen yet
  api::LoadReport r;
  r.total_blocks = 100;
  r.block_size = 16;
  r.recent_steps = {{41, 1, 8, 0.02, -1}, {42, 1, 8, 0.02, -1}};
  FakeEngines::answer(*polls[0], 200, api::to_json(r));
  c.clock.advance_by(milliseconds(100));
  polls = c.engines.open("/load");
  ASSERT_EQ(polls.size(), 1u);
  EXPECT_EQ(polls[0]->request.target, "/load?since_step=42");
}

// A load report past the 1 MiB the gateway reads is no report, said on stderr once and shown as
// the engine's load_error, as one that is not JSON (docs/gateway.md). The cut read was a failed
// call: retried on every poll, without a word.
TEST(HealthMonitor, ALoadReportTooLargeToReadIsSaidOnceAndShown) {
  Cluster c(polled_for_load(Dialect::kTandem));
  ::testing::internal::CaptureStderr();
  c.health.start();
  for (int i = 0; i < 3; ++i) {
    const auto polls = c.engines.open("/load");
    ASSERT_EQ(polls.size(), 1u);
    FakeEngines::head(*polls[0], 200, "application/json");
    // As the HTTP client does when on_body refuses more.
    const bool more = FakeEngines::piece(*polls[0], std::string((size_t{1} << 20) + 1, ' '));
    FakeEngines::finish(*polls[0], more ? "" : "cancelled");
    c.clock.run_ready();
    c.clock.advance_by(milliseconds(100));
  }
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_of(said, "larger than 1 MiB"), 1u) << said;
  EXPECT_NE(c.endpoint("a").value("load_error", std::string()).find("larger than 1 MiB"),
            std::string::npos)
      << c.endpoint("a").dump();
}

TEST(HealthMonitor, AFailedLoadPollNeitherBlocksRequestsNorDecidesTheDialect) {
  Topology t = aggregated({engine("a")});
  t.decode.dialect = Dialect::kAuto;
  Cluster c(t);
  c.health.start();
  FakeEngines::finish(*c.engines.open("/load").at(0), "connection refused");
  c.clock.run_ready();
  EXPECT_EQ(c.endpoint("a")["load_source"], "asking");
  auto client = c.send();
  ASSERT_EQ(c.engines.open("/v1/completions").size(), 1u);
  c.answer_all();
  EXPECT_EQ(client->status, 200);
}

}  // namespace
}  // namespace tandem::gateway
