// The gateway against fake engines it cannot tell from real ones (our HTTP server answering as
// an engine would, or failing on purpose), in-process: retries of a failed prefill on another
// engine, refused connections, slow engines and per-phase timeouts, malformed answers, engines
// dying mid-stream, client disconnects reaching both legs, health checks, bounded queues,
// API keys, the admin API and config reload under traffic, and the lifecycle record (access
// log, /debug/requests). After every scenario no engine may be left with requests in flight.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <thread>
#include <tuple>

#include <nlohmann/json.hpp>

#include "api/error.h"
#include "api/load_report.h"
#include "gateway/fake_engine.h"
#include "gateway/gateway.h"
#include "gateway/http_seams.h"
#include "gateway/policy.h"
#include "net/http_client.h"
#include "net/http_server.h"
#include "net/sse.h"
#include "util/bounded_wait.h"
#include "util/error.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;
using tandem::testing::get_within;
using tandem::testing::kHangGuard;
using testing::Behaviour;
using testing::endpoint_of;
using testing::FakeEngine;

bool eventually(const std::function<bool()>& done, std::chrono::milliseconds limit = 10s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return done();
}

// The message of a stream's error event when the stream ends as a failing engine ends its own
// (vLLM's, ours): with that event, then [DONE], the only one. Empty when it does not.
std::string last_error(const std::string& streamed) {
  net::SseParser parser;
  const std::vector<std::string> events = parser.feed(streamed);
  if (events.size() < 2 || events.back() != "[DONE]" ||
      std::count(events.begin(), events.end(), "[DONE]") != 1)
    return {};
  return api::openai_error_message(events[events.size() - 2]).value_or("");
}

// A client on a raw connection that has sent a POST of `body` to /v1/completions and reads
// nothing: it leaves when the test says so (or is destroyed), not on a timer. receive_buffer > 0
// shrinks its receive buffer first, so that the kernel holds little of the answer for it.
class RawClient {
 public:
  RawClient(uint16_t port, const std::string& body, int receive_buffer = 0)
      : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    if (fd_ < 0) throw Error("socket failed");
    if (receive_buffer > 0 &&
        ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer) != 0)
      throw Error("setsockopt SO_RCVBUF failed");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0)
      throw Error("cannot connect to the gateway");
    const std::string request =
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        "Content-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body;
    if (::send(fd_, request.data(), request.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(request.size()))
      throw Error("cannot send the request");
  }
  ~RawClient() { leave(); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;
  // Closes the connection: the client went away.
  void leave() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

// Each test runs twice: with two io threads the decisions run on a scheduling thread of their
// own; with one, on the io thread itself (IoThreadExecutor).
class GatewayFailures : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    // A parameterised test's name has a slash ("Name/OneIoThread"): one directory, not two
    // (TearDown removed only the inner one and left the outer in the temp folder).
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '-');
    dir_ = std::filesystem::temp_directory_path() /
           ("gateway-failure-" + std::to_string(::getpid()) + "-" + name);
    std::filesystem::create_directories(dir_);
    log_ = (dir_ / "access.jsonl").string();
  }
  void TearDown() override {
    gw_.reset();
    std::filesystem::remove_all(dir_);
  }

  Topology topology(PdMode mode) const {
    Topology t;
    t.host = "127.0.0.1";
    t.port = 0;
    t.mode = mode;
    t.access_log = log_;
    t.admin_api_key = "admin";
    t.health.probe_interval = 100ms;
    // Only an engine that stops answering would reach it (none here does): two probes slowed past
    // it by a loaded machine would eject a healthy fake engine.
    t.health.probe_timeout = 3s;
    t.health.failures_to_eject = 2;
    t.timeouts.queue = 2s;
    t.timeouts.prefill = 5s;
    t.timeouts.first_token = 5s;
    t.timeouts.idle = 5s;
    t.io_threads = GetParam();
    return t;
  }

  void start(Topology t, std::string config = {}) {
    gw_ = std::make_unique<Gateway>(std::move(t), std::move(config));
    gw_->start();
  }
  uint16_t port() const { return gw_->port(); }
  // A streamed POST /v1/completions of `body`; what arrives is added to `got`.
  net::HttpClientResponse post_stream(const json& body, std::string& got) {
    return net::http_request_stream("127.0.0.1", port(), "POST", "/v1/completions", body.dump(), {},
                                    [&](std::string_view p) {
                                      got += p;
                                      return true;
                                    });
  }

  net::HttpClientResponse post(const json& body, const net::Headers& headers = {},
                               const std::string& path = "/v1/completions") {
    return net::http_request("127.0.0.1", port(), "POST", path, body.dump(), headers, 30s);
  }
  net::HttpClientResponse admin(const std::string& method, const std::string& target,
                                const std::string& body = {}) {
    net::Headers h;
    h.set("Authorization", "Bearer admin");
    return net::http_request("127.0.0.1", port(), method, target, body, h, 10s);
  }
  json endpoints() { return json::parse(admin("GET", "/admin/endpoints").body)["endpoints"]; }
  // No engine is left with a request the gateway counts as in flight.
  // A gateway in aggregated mode in front of one engine.
  void start_aggregated(FakeEngine& engine, const std::string& name) {
    auto t = topology(PdMode::kAggregated);
    t.decode.endpoints = {endpoint_of(engine, name)};
    start(t);
  }
  bool all_idle() {
    for (const auto& e : endpoints())
      if (e["in_flight"] != 0) return false;
    return json::parse(admin("GET", "/debug/requests").body)["requests"].empty();
  }
  double metric(const std::string& sample) {
    const auto body = net::http_request("127.0.0.1", port(), "GET", "/metrics").body;
    const auto at = body.find("\n" + sample + " ");
    return at == std::string::npos ? -1 : std::stod(body.substr(at + sample.size() + 2));
  }
  std::vector<json> log_lines() {
    std::vector<json> out;
    std::ifstream in(log_);
    for (std::string l; std::getline(in, l);) out.push_back(json::parse(l));
    return out;
  }

  static json completion(bool stream = false) {
    return {{"model", "fake"}, {"prompt", "hello"}, {"max_tokens", 3}, {"stream", stream}};
  }

  std::filesystem::path dir_;
  std::string log_;
  std::unique_ptr<Gateway> gw_;
};

TEST_P(GatewayFailures, APrefillThatFailsIsRetriedOnAnotherEngine) {
  FakeEngine bad("bad"), good("good"), decode("decode");
  bad.set(Behaviour::kError500);
  auto t = topology(PdMode::kSequential);
  t.prefill.endpoints = {endpoint_of(bad, "bad"), endpoint_of(good, "good")};
  t.decode.endpoints = {endpoint_of(decode, "d")};
  start(t);
  for (int i = 0; i < 4; ++i) {
    const auto r = post(completion());
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(json::parse(r.body)["choices"][0]["text"], "decode");
  }
  // The decode leg carried the good prefill's kv_transfer_params, verbatim.
  EXPECT_EQ(decode.last_body()["kv_transfer_params"]["remote_engine_id"], "good");
  EXPECT_GE(bad.requests(), 1);
  EXPECT_GE(metric("tandem:gateway_retries_total"), 1);
  ASSERT_TRUE(eventually([&] { return log_lines().size() == 4; }));  // logged after answering
  const auto lines = log_lines();
  EXPECT_TRUE(std::any_of(lines.begin(), lines.end(), [](const json& l) {
    return l["attempts"] == 2 && l["prefill"] == "good";
  }));
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
}

TEST_P(GatewayFailures, RefusedConnectionsAndMalformedAnswersAreRetriedThenReported) {
  FakeEngine garbage("garbage"), decode("decode");
  garbage.set(Behaviour::kGarbage);
  auto t = topology(PdMode::kSequential);
  Endpoint refused = parse_endpoint("127.0.0.1:1");
  refused.name = "refused";
  t.prefill.endpoints = {refused, endpoint_of(garbage, "garbage")};
  t.decode.endpoints = {endpoint_of(decode, "d")};
  t.prefill_retries = 1;
  start(t);
  // Both prefill engines fail: two attempts, then 502 naming the last failure, OpenAI-shaped.
  const auto r = post(completion());
  EXPECT_EQ(r.status, 502);
  const json err = json::parse(r.body);
  ASSERT_TRUE(err.contains("error")) << r.body;
  EXPECT_EQ(err["error"]["type"], "server_error");
  EXPECT_EQ(decode.requests(), 0);
  ASSERT_TRUE(eventually([&] { return log_lines().size() == 1; }));  // written after the answer
  EXPECT_EQ(log_lines().at(0)["attempts"], 2);
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
}

TEST_P(GatewayFailures, AnEngineClientErrorIsPassedThroughNotRetried) {
  FakeEngine p1("p1"), p2("p2"), decode("decode");
  auto t = topology(PdMode::kSequential);
  t.prefill.endpoints = {endpoint_of(p1, "p1"), endpoint_of(p2, "p2")};
  t.decode.endpoints = {endpoint_of(decode, "d")};
  start(t);
  // A fake that answers 400 like an engine refusing the body: use the gateway's own JSON check.
  const auto r = net::http_request("127.0.0.1", port(), "POST", "/v1/completions", "[1,2]");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("invalid_request_error"), std::string::npos);
  EXPECT_EQ(p1.requests() + p2.requests(), 0);
}

// An engine's own client error is the client's answer, with the engine's status and body (or an
// OpenAI error naming the status when it sent none): the request is not retried elsewhere.
TEST_P(GatewayFailures, AnEnginesClientErrorReachesTheClientWithItsStatus) {
  FakeEngine e1("e1"), e2("e2");
  e1.set(Behaviour::kError400);
  e2.set(Behaviour::kError400);
  auto t = topology(PdMode::kAggregated);
  t.decode.endpoints = {endpoint_of(e1, "e1"), endpoint_of(e2, "e2")};
  t.prefill_retries = 1;
  start(t);
  auto r = post(completion());
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("refuses max_tokens"), std::string::npos) << r.body;
  EXPECT_EQ(e1.requests() + e2.requests(), 1);
  e1.set(Behaviour::kEmpty422);
  e2.set(Behaviour::kEmpty422);
  r = post(completion());
  EXPECT_EQ(r.status, 422);
  const json err = json::parse(r.body);
  ASSERT_TRUE(err.contains("error")) << r.body;
  EXPECT_NE(err["error"]["message"].get<std::string>().find("422"), std::string::npos) << r.body;
  EXPECT_EQ(e1.requests() + e2.requests(), 2);
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
}

TEST_P(GatewayFailures, SlowEnginesHitThePhaseTimeouts) {
  FakeEngine slow("slow"), fast("fast"), decode("decode");
  slow.set(Behaviour::kHold);
  auto t = topology(PdMode::kSequential);
  t.prefill.endpoints = {endpoint_of(slow, "slow"), endpoint_of(fast, "fast")};
  t.decode.endpoints = {endpoint_of(decode, "d")};
  // Every leg has them, the retried prefill and the decode legs too: only the held legs may reach
  // them, however slowly a loaded machine runs the others (each answers at once).
  t.timeouts.prefill = 2s;
  t.timeouts.first_token = 2s;
  start(t);
  // The first request lands on the slow prefill (lowest id); it times out and is retried.
  auto r = post(completion());
  EXPECT_EQ(r.status, 200) << r.body;
  // The slow engine saw the gateway give up (the leg was cancelled: the connection closed).
  EXPECT_TRUE(eventually([&] { return slow.closed_early() >= 1; }));
  // A decode that never sends its first token: 502 naming the phase, no retry of a decode.
  fast.set(Behaviour::kOk);
  slow.set(Behaviour::kOk);
  decode.set(Behaviour::kHold);
  r = post(completion(true));
  EXPECT_EQ(r.status, 502);
  EXPECT_NE(r.body.find("first token timed out"), std::string::npos) << r.body;
  EXPECT_TRUE(eventually([&] { return decode.closed_early() >= 1; }));
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
}

TEST_P(GatewayFailures, AnEngineDyingMidStreamEndsTheClientStreamWithAnErrorEvent) {
  FakeEngine engine("e");
  engine.set(Behaviour::kCutStream);
  start_aggregated(engine, "e");
  std::string got;
  const auto resp = post_stream(completion(true), got);
  // A whole HTTP answer (the chunked body properly ended) whose stream says it was cut: what
  // was generated, then an OpenAI error event and [DONE], as a failing engine ends its stream.
  EXPECT_EQ(resp.status, 200);
  const size_t generated = got.find("e0"), error = got.find("data: {\"error\"");
  ASSERT_NE(generated, std::string::npos) << got;
  ASSERT_NE(error, std::string::npos) << got;
  EXPECT_LT(generated, error);
  EXPECT_EQ(got.substr(got.size() - 2), "\n\n") << got;
  EXPECT_TRUE(last_error(got).starts_with("the answer was cut: engine e: ")) << got;
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
  ASSERT_TRUE(eventually([&] { return log_lines().size() == 1; }));
  EXPECT_EQ(log_lines()[0]["status"], 502);
  // The access log names the engine as the client's event does (it lacked "engine e: ").
  EXPECT_EQ("the answer was cut: " + log_lines()[0]["error"].get<std::string>(), last_error(got));
}

// However a stream fails once the client has tokens, it ends as a failing engine ends its own
// (vLLM's, ours): an OpenAI error event, then [DONE], for one choice as for n. The gateway's own
// tail had no [DONE], and n choices' merged stream dropped the engine's after its error event
// (one choice's kept it).
TEST_P(GatewayFailures, AStreamFailingMidAnswerEndsWithAnErrorEventThenDoneForAnyN) {
  for (Behaviour failure : {Behaviour::kCutStream, Behaviour::kFailMidStream}) {
    for (int n : {1, 2}) {
      SCOPED_TRACE(std::string(failure == Behaviour::kCutStream ? "cut" : "engine error") + ", n " +
                   std::to_string(n));
      FakeEngine prefill("p"), decode("d");
      decode.set(failure);
      auto t = topology(PdMode::kParallel);
      t.prefill.endpoints = {endpoint_of(prefill, "p", 7001)};
      t.decode.endpoints = {endpoint_of(decode, "d")};
      start(t);
      json body = completion(true);
      body["n"] = n;
      std::string got;
      const auto r = post_stream(body, got);
      EXPECT_EQ(r.status, 200);
      EXPECT_NE(got.find("d0"), std::string::npos) << got;  // what was generated came first
      EXPECT_FALSE(last_error(got).empty()) << got;
      EXPECT_TRUE(eventually([&] { return all_idle(); }));
      gw_.reset();  // before its engines go
    }
  }
}

// An engine whose stream sends one token event, then an event that never ends: a data line of
// `x`s in 16 KiB writes, up to `bytes` of them (fewer once a write fails: the gateway cut it),
// then the stream ends (no [DONE]).
class EndlessEventEngine {
 public:
  explicit EndlessEventEngine(size_t bytes) {
    net::HttpServerOptions o;
    o.host = "127.0.0.1";
    o.threads = 2;
    server_ = std::make_unique<net::HttpServer>(o);
    server_->route("GET", "/health",
                   [](const net::HttpRequest&, auto ex) { ex->respond(200, "", "text/plain"); });
    server_->route("POST", "/v1/completions", [this, bytes](const net::HttpRequest&, auto ex) {
      ex->start_stream(200, "text/event-stream");
      ex->write(net::sse_event(R"({"choices":[{"index":0,"text":"first"}]})"));
      ex->write(R"(data: {"choices":[{"index":0,"text":")");
      std::thread([ex, bytes, ended = ended_] {
        const std::string xs(16 << 10, 'x');
        bool written = true;
        for (size_t sent = 0; written && sent < bytes; sent += xs.size()) written = ex->write(xs);
        if (written) ex->end();
        *ended = true;
      }).detach();
    });
    server_->start();
  }
  ~EndlessEventEngine() { server_->stop(); }
  Endpoint endpoint() const {
    Endpoint p = parse_endpoint("127.0.0.1:" + std::to_string(server_->port()));
    p.name = "e";
    return p;
  }
  bool ended() const { return *ended_; }

 private:
  std::unique_ptr<net::HttpServer> server_;
  std::shared_ptr<std::atomic<bool>> ended_ = std::make_shared<std::atomic<bool>>(false);
};

// Once a stream has begun, each of its events is still held whole until it ends (relayed byte for
// byte or framed anew): an engine that sends an event without end after its first one is cut at
// max_answer_bytes, as an engine failure, and the client's stream ends with an OpenAI error event
// naming the limit, then [DONE]. Before, the gateway read on without bound (its parser held the
// whole line), and the client got all 8 MiB of it. (What the parser holds:
// Sse.PendingBytesAreTheEventNotEndedYet.)
TEST_P(GatewayFailures, AnEventWithoutEndAfterTheFirstIsCutAtTheTopologysLimit) {
  for (const PdMode mode : {PdMode::kAggregated, PdMode::kParallel}) {
    SCOPED_TRACE(mode == PdMode::kAggregated ? "verbatim (aggregated)" : "framed anew (parallel)");
    FakeEngine prefill("p");
    EndlessEventEngine engine(size_t{8} << 20);
    auto t = topology(mode);
    if (mode == PdMode::kParallel) t.prefill.endpoints = {endpoint_of(prefill, "p", 7001)};
    t.decode.endpoints = {engine.endpoint()};
    t.max_answer_bytes = size_t{1} << 20;
    start(t);
    std::string got;
    const auto r = post_stream(completion(true), got);
    EXPECT_EQ(r.status, 200);
    const size_t first = got.find("first"), error = got.find("data: {\"error\"");
    ASSERT_NE(first, std::string::npos) << got.substr(0, 200);
    ASSERT_NE(error, std::string::npos) << got.substr(0, 200);
    EXPECT_LT(first, error);
    const std::string message = last_error(got);
    EXPECT_TRUE(message.starts_with("the answer was cut: engine e: ")) << message;
    EXPECT_NE(message.find("larger than 1 MiB"), std::string::npos) << message;
    // At most the limit of the event, plus what one read brought past it, reached the client.
    EXPECT_LT(got.size(), size_t{2} << 20);
    EXPECT_TRUE(eventually([&] { return engine.ended(); }));
    ASSERT_TRUE(eventually([&] { return log_lines().size() == 1; }));
    EXPECT_EQ(log_lines()[0]["status"], 502);
    EXPECT_TRUE(eventually([&] { return all_idle(); }));
    gw_.reset();  // before its engines go
    std::filesystem::remove(log_);
  }
}

TEST_P(GatewayFailures, AStreamThatStartsWithAnErrorIsRetriedInParallelMode) {
  FakeEngine p1("p1"), p2("p2"), bad_decode("bad"), good_decode("good");
  bad_decode.set(Behaviour::kErrorEvent);
  auto t = topology(PdMode::kParallel);
  t.prefill.endpoints = {endpoint_of(p1, "p1", 7001), endpoint_of(p2, "p2", 7002)};
  t.decode.endpoints = {endpoint_of(bad_decode, "bad"), endpoint_of(good_decode, "good")};
  start(t);
  std::string got;
  const auto r = post_stream(completion(true), got);
  EXPECT_EQ(r.status, 200);
  EXPECT_NE(got.find("good0"), std::string::npos) << got;
  EXPECT_EQ(got.find("KV transfer failed"), std::string::npos) << got;
  // Both legs carried the same bootstrap room, and the prefill's own address.
  ASSERT_EQ(good_decode.bodies().size(), 1u);
  const json room = good_decode.last_body()["bootstrap_room"];
  // The prefill leg runs alongside: its request may reach its engine after the answer.
  auto matching = [&] {
    int n = 0;
    for (auto* p : {&p1, &p2})
      for (const auto& b : p->bodies())
        if (b["bootstrap_room"] == room) {
          ++n;
          EXPECT_EQ(b["bootstrap_port"], p == &p1 ? 7001 : 7002);
        }
    return n;
  };
  EXPECT_TRUE(eventually([&] { return matching() == 1; })) << matching();
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
}

// An engine reads a body's objects in their key order: it shows tools to the model, and generates
// a schema's properties, in the order the body lists them. Every body the gateway writes (a
// priority class's, a client's priority dropped, both P/D flows' legs, each of n choices) keeps
// the client's order: re-serialized from nlohmann::json they reached the engines with their keys
// sorted (a tool's {zeta, alpha} as {alpha, zeta}).
TEST_P(GatewayFailures, EveryBodyTheGatewayWritesKeepsTheClientsKeyOrder) {
  const std::string chat =
      R"({"model":"fake","messages":[{"role":"user","content":"hi"}],"max_tokens":3,)"
      R"("priority":"interactive","tools":[{"type":"function","function":{"name":"f","parameters":)"
      R"({"type":"object","properties":{"zeta":{"type":"string"},"alpha":{"type":"string"}}}}}],)"
      R"("response_format":{"type":"json_schema","json_schema":{"name":"s","schema":)"
      R"({"type":"object","properties":{"omega":{"type":"integer"},"beta":{"type":"integer"}}}}}})";
  auto before = [](const std::string& text, const char* first, const char* second) {
    const auto a = text.find(first), b = text.find(second);
    return a != std::string::npos && b != std::string::npos && a < b;
  };
  struct Case {
    const char* name;
    PdMode mode;
    bool classes;
    int n;
  };
  for (const Case& c :
       {Case{"aggregated, priority classes", PdMode::kAggregated, true, 1},
        Case{"aggregated, the client's priority dropped", PdMode::kAggregated, false, 1},
        Case{"sequential", PdMode::kSequential, false, 1},
        Case{"parallel", PdMode::kParallel, false, 1},
        Case{"sequential, n 2", PdMode::kSequential, false, 2},
        Case{"parallel, n 2", PdMode::kParallel, true, 2}}) {
    SCOPED_TRACE(c.name);
    FakeEngine prefill("p"), decode("d");
    auto t = topology(c.mode);
    t.decode.endpoints = {endpoint_of(decode, "d")};
    if (c.mode != PdMode::kAggregated) t.prefill.endpoints = {endpoint_of(prefill, "p", 7001)};
    if (c.classes) t.priority.classes = {PriorityClass{"interactive", 3, 2s, std::nullopt}};
    start(t);
    const std::string body = c.n == 1 ? chat : R"({"n":2,)" + chat.substr(1);
    const auto r =
        net::http_request("127.0.0.1", port(), "POST", "/v1/chat/completions", body, {}, 30s);
    EXPECT_EQ(r.status, 200) << r.body;
    // A parallel prefill leg runs alongside: it may reach its engine after the answer.
    const size_t legs = size_t(c.n) * (c.mode == PdMode::kAggregated ? 1 : 2);
    EXPECT_TRUE(eventually([&] { return prefill.texts().size() + decode.texts().size() == legs; }));
    for (FakeEngine* e : {&prefill, &decode}) {
      for (const std::string& text : e->texts()) {
        EXPECT_TRUE(before(text, "\"zeta\"", "\"alpha\"")) << text;
        EXPECT_TRUE(before(text, "\"omega\"", "\"beta\"")) << text;
        // What the gateway changes it changed: the class's priority for its name, or none (the
        // policy sets prefill deadlines instead).
        const json parsed = json::parse(text);
        if (c.classes)
          EXPECT_EQ(parsed.value("priority", json()), 3) << text;
        else
          EXPECT_FALSE(parsed.contains("priority")) << text;
      }
    }
    EXPECT_TRUE(eventually([&] { return all_idle(); }));
    gw_.reset();  // before its engines go
  }
}

TEST_P(GatewayFailures, AClientThatLeavesCancelsBothLegs) {
  FakeEngine prefill("p"), decode("d");
  prefill.set(Behaviour::kHold);
  decode.set(Behaviour::kHold);
  auto t = topology(PdMode::kParallel);
  t.prefill.endpoints = {endpoint_of(prefill, "p", 7001)};
  t.decode.endpoints = {endpoint_of(decode, "d")};
  start(t);
  RawClient client(port(), completion(true).dump());
  ASSERT_TRUE(eventually([&] { return prefill.held() == 1 && decode.held() == 1; }));
  // While both legs run, the request is listed with its phase.
  const json dbg = json::parse(admin("GET", "/debug/requests").body);
  ASSERT_EQ(dbg["requests"].size(), 1u) << dbg.dump();
  // Parallel mode: prefilling while the decode leg waits for its first token.
  EXPECT_EQ(dbg["requests"][0]["phase"], "decode_scheduled");
  EXPECT_TRUE(dbg["requests"][0]["phases"].contains("prefilling"));
  client.leave();  // it closes its connection
  EXPECT_TRUE(
      eventually([&] { return prefill.closed_early() == 1 && decode.closed_early() == 1; }));
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
  ASSERT_TRUE(eventually([&] { return log_lines().size() == 1; }));
  EXPECT_EQ(log_lines().at(0)["status"], 499);
}

// A client that leaves in the middle of a stream is logged 499, whether the gateway learns it
// from the closed connection or from a failed write of the next event.
TEST_P(GatewayFailures, AClientThatLeavesMidStreamIsLogged499) {
  FakeEngine e("e");
  e.set(Behaviour::kSlowStream);
  start_aggregated(e, "e");
  for (int i = 0; i < 3; ++i) {
    // It leaves (closes its connection) once the first event has reached it; the engine's stream
    // goes on until the gateway gives its leg up.
    std::string got;
    const auto r =
        net::http_request_stream("127.0.0.1", port(), "POST", "/v1/completions",
                                 completion(true).dump(), {}, [&](std::string_view piece) {
                                   got += piece;
                                   return got.find("\n\n") == std::string::npos;
                                 });
    EXPECT_EQ(r.status, 200);
    EXPECT_NE(got.find("data: "), std::string::npos) << got;
  }
  ASSERT_TRUE(eventually([&] { return log_lines().size() == 3; }));
  for (const auto& line : log_lines()) {
    EXPECT_EQ(line["status"], 499) << line.dump();
    EXPECT_GT(line["output_events"].get<int>(), 0) << line.dump();  // it left mid-stream
  }
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
  EXPECT_TRUE(eventually([&] { return e.closed_early() == 3; }));
}

// listen.max_unsent_bytes reaches the gateway's HTTP server. A streaming client that never
// reads (its receive buffer shrunk, so the kernel holds little of the stream for it) is cut once
// 256 KiB of its stream wait in the gateway: the engine's leg is cancelled and the request logged
// 499. At the default 16 MiB the engine's whole 12 MiB stream would wait in the gateway for the
// write timeout (60 s) instead.
TEST_P(GatewayFailures, AStreamingClientThatNeverReadsIsCutAtTheTopologysHighWaterMark) {
  FakeEngine e("e");
  e.set(Behaviour::kFloodStream);
  auto t = topology(PdMode::kAggregated);
  t.decode.endpoints = {endpoint_of(e, "e")};
  t.max_unsent_bytes = size_t{256} << 10;
  start(t);
  RawClient client(port(), completion(true).dump(), 4096);
  EXPECT_TRUE(eventually([&] { return e.closed_early() == 1; }, 20s))
      << "the engine's leg was not cancelled";
  ASSERT_TRUE(eventually([&] { return log_lines().size() == 1; }));
  EXPECT_EQ(log_lines()[0]["status"], 499);
  client.leave();
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
}

// max_answer_bytes from the topology: a whole answer past it is the gateway's refusal (502,
// answer_too_large, saying the limit; not retried), while a stream passes.
TEST_P(GatewayFailures, AWholeAnswerPastTheTopologysLimitIsRefused) {
  FakeEngine e("e");
  auto t = topology(PdMode::kAggregated);
  t.decode.endpoints = {endpoint_of(e, "e")};
  t.max_answer_bytes = 100;  // the fake engine's answer is about 250 bytes
  start(t);
  const auto r = post(completion());
  EXPECT_EQ(r.status, 502);
  const json error = json::parse(r.body)["error"];
  EXPECT_EQ(error["code"], "answer_too_large") << r.body;
  EXPECT_NE(error["message"].get<std::string>().find("larger than 100 bytes"), std::string::npos)
      << r.body;
  EXPECT_EQ(e.requests(), 1);
  EXPECT_EQ(post(completion(true)).status, 200);
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
}

TEST_P(GatewayFailures, HealthChecksEjectAndReadmitEngines) {
  FakeEngine a("a"), b("b");
  auto t = topology(PdMode::kAggregated);
  t.decode.endpoints = {endpoint_of(a, "a"), endpoint_of(b, "b")};
  start(t);
  a.set_healthy(false);
  ASSERT_TRUE(eventually([&] {
    for (const auto& e : endpoints())
      if (e["name"] == "a") return e["healthy"] == false;
    return false;
  }));
  const int before = a.requests();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(post(completion()).status, 200);
  EXPECT_EQ(a.requests(), before);  // all went to b
  // The ejection is counted (its stderr line is not read here).
  EXPECT_EQ(metric("tandem:gateway_endpoint_ejections_total{pool=\"decode\",endpoint=\"a\"}"), 1);
  EXPECT_EQ(metric("tandem:gateway_endpoint_ejections_total{pool=\"decode\",endpoint=\"b\"}"), 0);
  EXPECT_EQ(metric("tandem:gateway_endpoint_healthy{pool=\"decode\",endpoint=\"a\"}"), 0);
  // A passing probe readmits it.
  a.set_healthy(true);
  ASSERT_TRUE(eventually([&] {
    for (const auto& e : endpoints())
      if (e["name"] == "a") return e["healthy"] == true;
    return false;
  }));
  // Passive: failed requests count against the engine, and are retried on the other meanwhile.
  a.set(Behaviour::kError500);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(post(completion()).status, 200);
  EXPECT_GT(metric("tandem:gateway_endpoint_failures_total{pool=\"decode\",endpoint=\"a\"}"), 0);
  a.set(Behaviour::kOk);
  // No engine at all: 503 at once, and /health says so.
  a.set_healthy(false);
  b.set_healthy(false);
  ASSERT_TRUE(eventually(
      [&] { return net::http_request("127.0.0.1", port(), "GET", "/health").status == 503; }));
  EXPECT_EQ(post(completion()).status, 503);
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
}

// An engine whose GET /v1/models does not list the model the gateway serves would answer every
// request it takes 404 ("The model `dsv3` does not exist."), instantly, so least-load preferred
// it: it is kept out, unhealthy with the reason in /admin/endpoints, until it lists the model.
TEST_P(GatewayFailures, AnEngineServingAnotherModelIsNotAdmitted) {
  FakeEngine right("right"), wrong("wrong");
  right.set_models({"dsv3"});
  // vLLM's list (an auto pool): vLLM refuses a request naming a model it does not list.
  wrong.set_models({"other"}, {{"owned_by", "vllm"}});
  auto t = topology(PdMode::kAggregated);
  t.served_model_name = "dsv3";
  t.decode.endpoints = {endpoint_of(right, "right")};
  start(t);
  const auto r = admin(
      "POST", "/admin/endpoints",
      json{{"pool", "decode"}, {"endpoint", {{"url", wrong.address()}, {"name", "wrong"}}}}.dump());
  ASSERT_EQ(r.status, 201) << r.body;
  auto wrong_state = [&] {
    for (const auto& e : endpoints())
      if (e["name"] == "wrong") return e;
    return json();
  };
  ASSERT_TRUE(eventually([&] { return wrong_state()["healthy"] == false; }));
  const std::string why = wrong_state().value("unhealthy_reason", "");
  EXPECT_NE(why.find("'other'"), std::string::npos) << why;
  EXPECT_NE(why.find("'dsv3'"), std::string::npos) << why;
  const int before = wrong.requests();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(post(completion()).status, 200);
  EXPECT_EQ(wrong.requests(), before);
  // Restarted with the model: its next probe readmits it.
  wrong.set_models({"dsv3", "dsv3-lora"});
  ASSERT_TRUE(eventually([&] { return wrong_state()["healthy"] == true; }));
  EXPECT_FALSE(wrong_state().contains("unhealthy_reason"));
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
}

// The openai client's models.retrieve (GET /v1/models/{id}) was a 404 'Invalid URL' from the
// gateway, which the engine answers: the model object of the list, at its id as it is and
// percent-encoded, and another id a 404 model_not_found, as the engine answers a request naming it.
TEST_P(GatewayFailures, TheModelIsRetrievedAtItsIdAndAnotherIdIsModelNotFound) {
  FakeEngine engine("e");
  auto t = topology(PdMode::kAggregated);
  t.served_model_name = "Qwen/Qwen3-8B";
  t.decode.endpoints = {endpoint_of(engine, "e")};
  start(t);
  const json listed =
      json::parse(net::http_request("127.0.0.1", port(), "GET", "/v1/models").body)["data"][0];
  for (const char* path :
       {"/v1/models/Qwen/Qwen3-8B", "/v1/models/Qwen%2FQwen3-8B", "/v1/models/Qwen%2fQwen3-8B"}) {
    const auto r = net::http_request("127.0.0.1", port(), "GET", path);
    ASSERT_EQ(r.status, 200) << path << " " << r.body;
    json got = json::parse(r.body);
    EXPECT_GE(got["created"].get<int64_t>(), listed["created"].get<int64_t>());
    got["created"] = listed["created"];  // the time of the answer
    EXPECT_EQ(got, listed) << path;
  }
  const auto r = net::http_request("127.0.0.1", port(), "GET", "/v1/models/dsv3");
  EXPECT_EQ(r.status, 404) << r.body;
  EXPECT_EQ(api::openai_error_code(r.body), "model_not_found") << r.body;
  EXPECT_EQ(api::openai_error_message(r.body), "The model `dsv3` does not exist.") << r.body;
  EXPECT_EQ(engine.requests(), 0);
}

// Without served_model_name the gateway knows no model: models.retrieve goes to an engine with
// the path as the client sent it (the openai Python client's '/' as it is, the Node client's %2F).
// A path with a dot segment is answered model_not_found and not relayed: the engine, or a proxy
// before it, would resolve /v1/models/../completions into another route. Its %2F separates no
// segments: `--model ./Qwen3-8B`, which the engine lists as "./Qwen3-8B", is retrieved as
// .%2FQwen3-8B, relayed as sent. It was answered 404, its id read with the %2F decoded.
TEST_P(GatewayFailures, ModelRetrievalIsRelayedAsSentButNeverWithADotSegment) {
  FakeEngine engine("e");
  auto t = topology(PdMode::kAggregated);
  t.decode.endpoints = {endpoint_of(engine, "e")};
  start(t);
  auto get = [&](const char* path) { return net::http_request("127.0.0.1", port(), "GET", path); };
  ASSERT_TRUE(eventually([&] { return get("/v1/models/deepseek-ai/DeepSeek-V3").status == 200; }));
  EXPECT_EQ(get("/v1/models/deepseek-ai%2FDeepSeek-V3").status, 200);
  for (const char* path :
       {"/v1/models/../completions", "/v1/models/%2E%2E/health",
        "/v1/models/deepseek-ai/./DeepSeek-V3", "/v1/models/.", "/v1/models/x/..",
        // Decoded, it climbs: a proxy that decodes %2F before resolving would reach /flush_cache.
        "/v1/models/x%2F..%2F..%2Fflush_cache", "/v1/models/x%2F..%2Fy"}) {
    const auto r = get(path);
    EXPECT_EQ(r.status, 404) << path << ": " << r.body;
    EXPECT_EQ(api::openai_error_code(r.body), "model_not_found") << path << ": " << r.body;
  }
  for (const char* path : {"/v1/models/.%2FQwen3-8B", "/v1/models/x%2F.%2Fy"}) {
    const auto r = get(path);
    EXPECT_EQ(r.status, 200) << path << ": " << r.body;
    EXPECT_EQ(engine.retrieved().back(), path);
  }
  for (const std::string& target : engine.retrieved())
    EXPECT_TRUE(target == "/v1/models/deepseek-ai/DeepSeek-V3" ||
                target == "/v1/models/deepseek-ai%2FDeepSeek-V3" ||
                target == "/v1/models/.%2FQwen3-8B" || target == "/v1/models/x%2F.%2Fy")
        << target;
}

// SGLang (and TGI, llama.cpp) list their model path but serve a request naming any model: with
// served_model_name an alias, such an engine serves it, so the model check keeps it (an sglang
// pool, or an auto pool whose engine's list says owned_by "sglang"). A tandem pool's engine, which
// refuses an unknown name, is ejected for the same list, naming why.
TEST_P(GatewayFailures, TheModelCheckEjectsOnlyEnginesThatRefuseAnUnknownName) {
  struct Case {
    Dialect dialect;
    json fields;
    bool kept;
  };
  const Case cases[] = {{Dialect::kSglang, {{"owned_by", "sglang"}}, true},
                        {Dialect::kSglang, json::object(), true},
                        {Dialect::kAuto, {{"owned_by", "sglang"}}, true},
                        {Dialect::kAuto, json::object(), true},
                        {Dialect::kTandem, json::object(), false},
                        {Dialect::kVllm, {{"owned_by", "vllm"}}, false}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(dialect_name(c.dialect)) + " " + c.fields.dump());
    FakeEngine engine("e");
    json fields = c.fields;
    fields["max_model_len"] = 4096;  // in /admin/endpoints once the list was read
    engine.set_models({"/models/DeepSeek-V3"}, fields);
    auto t = topology(PdMode::kAggregated);
    t.served_model_name = "dsv3";
    t.decode.dialect = c.dialect;
    t.decode.endpoints = {endpoint_of(engine, "e")};
    start(t);
    auto state = [&] { return endpoints().at(0); };
    if (c.kept) {
      ASSERT_TRUE(eventually([&] { return state().value("max_model_len", 0) == 4096; }));
      EXPECT_EQ(state()["healthy"], true);
      EXPECT_FALSE(state().contains("unhealthy_reason"));
      const int before = engine.requests();
      for (int i = 0; i < 3; ++i) EXPECT_EQ(post(completion()).status, 200);
      EXPECT_EQ(engine.requests(), before + 3);
    } else {
      ASSERT_TRUE(eventually([&] { return state()["healthy"] == false; }));
      const std::string why = state().value("unhealthy_reason", "");
      EXPECT_NE(why.find("'/models/DeepSeek-V3'"), std::string::npos) << why;
      EXPECT_NE(why.find("'dsv3'"), std::string::npos) << why;
    }
    gw_.reset();
  }
}

// With served_model_name set, the gateway's vllm:* series carry it as model_name, as the engines'
// do (a dashboard filtering by model_name finds both); its own tandem:* series do not.
TEST_P(GatewayFailures, VllmSeriesNameTheServedModel) {
  FakeEngine engine("e");
  auto t = topology(PdMode::kAggregated);
  t.decode.endpoints = {endpoint_of(engine, "e")};
  t.served_model_name = "tiny";
  start(t);
  const auto body = net::http_request("127.0.0.1", port(), "GET", "/metrics").body;
  EXPECT_NE(body.find("\nvllm:num_requests_waiting{model_name=\"tiny\"} "), std::string::npos)
      << body;
  EXPECT_NE(body.find("\nvllm:e2e_request_latency_seconds_count{model_name=\"tiny\"} "),
            std::string::npos)
      << body;
  EXPECT_NE(body.find("\ntandem:gateway_retries_total "), std::string::npos) << body;
}

// The queue is bounded: with the one engine at its in-flight limit and one request queued, the
// next is refused at once; the queued one waits, unseen by the engine, until the engine frees.
// (A queued request's 503 at the queue timeout, and its wording, are
// Dispatcher.ARequestNoEngineTakesWithinTheQueueTimeoutGets503SayingWhy's, on a fake clock.)
TEST_P(GatewayFailures, QueuesAreBoundedAndAQueuedRequestWaitsForTheEngine) {
  FakeEngine engine("e");
  engine.set(Behaviour::kHold);
  auto t = topology(PdMode::kAggregated);
  t.decode.endpoints = {endpoint_of(engine, "e")};
  t.decode.max_in_flight = 1;
  t.max_queue = 1;
  t.timeouts.queue = 60s;  // the second request stays queued however late the third comes
  start(t);
  auto first = std::async(std::launch::async, [&] { return post(completion()).status; });
  ASSERT_TRUE(eventually([&] { return engine.held() == 1; }));
  auto second = std::async(std::launch::async, [&] { return post(completion()); });
  ASSERT_TRUE(eventually([&] { return metric("vllm:num_requests_waiting") == 1; }));
  // The queue is full: refused at once, 429 in the OpenAI shape.
  const auto third = post(completion());
  EXPECT_EQ(third.status, 429);
  EXPECT_TRUE(json::parse(third.body).contains("error"));
  EXPECT_EQ(engine.requests(), 1);  // neither the queued nor the refused one reached it
  // Once the first is answered, the queued one goes to the engine.
  engine.set(Behaviour::kOk);
  engine.release();
  EXPECT_EQ(first.get(), 200);
  const auto queued = second.get();
  EXPECT_EQ(queued.status, 200) << queued.body;
  EXPECT_EQ(engine.requests(), 2);
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
}

// The default dialect (auto) in front of engines that do not report their load as Tandem's do: a
// plain OpenAI server without GET /load (vLLM, SGLang), and one whose /load is another API's
// (vLLM's server-load tracking). Each is routed by the gateway's own counts and serves at once; a
// Tandem engine's reports are used.
TEST_P(GatewayFailures, AutoDialectRoutesEnginesWithoutLoadReportsByItsOwnCounts) {
  FakeEngine plain("plain"), vllm_load("vllm_load"), tandem("tandem");
  vllm_load.set_load(200, R"({"server_load":0})");
  api::LoadReport report;
  report.free_blocks = report.total_blocks = 4096;
  report.block_size = 16;
  report.prefill_pairs = report.step_prefill_pairs = 0;
  tandem.set_load(200, api::to_json(report));
  auto t = topology(PdMode::kAggregated);
  ASSERT_EQ(t.decode.dialect, Dialect::kAuto);
  t.scheduling.load_interval = 20ms;
  t.decode.endpoints = {endpoint_of(plain, "plain"), endpoint_of(vllm_load, "vllm_load"),
                        endpoint_of(tandem, "tandem")};
  start(t);
  for (int i = 0; i < 6; ++i) {
    const auto r = post(completion());
    ASSERT_EQ(r.status, 200) << r.body;
  }
  auto source = [&](const std::string& name) {
    for (const auto& e : endpoints())
      if (e["name"] == name) return e["load_source"].get<std::string>();
    return std::string("missing");
  };
  EXPECT_TRUE(eventually([&] { return source("plain") == "own_counts"; })) << source("plain");
  EXPECT_TRUE(eventually([&] { return source("vllm_load") == "own_counts"; }))
      << source("vllm_load");
  EXPECT_TRUE(eventually([&] { return source("tandem") == "reports"; })) << source("tandem");
  // Still serving once every engine's kind is known.
  for (int i = 0; i < 6; ++i) EXPECT_EQ(post(completion()).status, 200);
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
}

TEST_P(GatewayFailures, ApiKeysAreRequiredWhenConfigured) {
  FakeEngine engine("e");
  auto t = topology(PdMode::kAggregated);
  t.decode.endpoints = {endpoint_of(engine, "e")};
  t.api_keys = {"k1", "k2"};
  start(t);
  auto r = post(completion());
  EXPECT_EQ(r.status, 401);
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "invalid_api_key");
  net::Headers h;
  h.set("Authorization", "Bearer k2");
  EXPECT_EQ(post(completion(), h).status, 200);
  h.set("Authorization", "Bearer nope");
  EXPECT_EQ(post(completion(), h).status, 401);
  EXPECT_EQ(engine.requests(), 1);
  // The admin API takes only its own key.
  net::Headers a;
  a.set("Authorization", "Bearer k1");
  EXPECT_EQ(net::http_request("127.0.0.1", port(), "GET", "/admin/endpoints", {}, a).status, 401);
  // Without a metrics key, /metrics stays open (Prometheus scrapes it as vLLM's).
  EXPECT_EQ(net::http_request("127.0.0.1", port(), "GET", "/metrics").status, 200);
}

TEST_P(GatewayFailures, MetricsTakeOnlyTheMetricsKeyWhenOneIsSet) {
  FakeEngine engine("e");
  auto t = topology(PdMode::kAggregated);
  t.decode.endpoints = {endpoint_of(engine, "e")};
  t.api_keys = {"k1"};
  t.metrics_api_key = "scrape";
  start(t);
  net::Headers client;
  client.set("Authorization", "Bearer k1");
  ASSERT_EQ(post(completion(), client).status, 200);  // the engine now has samples
  auto get = [&](const std::string& key) {
    net::Headers h;
    if (!key.empty()) h.set("Authorization", "Bearer " + key);
    return net::http_request("127.0.0.1", port(), "GET", "/metrics", {}, h);
  };
  const auto none = get("");
  EXPECT_EQ(none.status, 401);
  EXPECT_EQ(json::parse(none.body)["error"]["code"], "invalid_api_key");
  EXPECT_EQ(none.body.find("endpoint="), std::string::npos) << none.body;
  EXPECT_EQ(get("k1").status, 401);
  EXPECT_EQ(get("admin").status, 401);
  const auto ok = get("scrape");
  EXPECT_EQ(ok.status, 200);
  EXPECT_NE(ok.body.find("endpoint=\"e\""), std::string::npos) << ok.body;
}

TEST_P(GatewayFailures, EndpointsAreAddedAndRemovedWithoutDroppingRequests) {
  FakeEngine a("a"), b("b");
  a.set(Behaviour::kHold);
  start_aggregated(a, "a");
  auto held = std::async(std::launch::async, [&] { return post(completion()); });
  ASSERT_TRUE(eventually([&] { return a.held() == 1; }));
  // Add b, remove a while its request is in flight: a drains, b takes new requests.
  auto r = admin(
      "POST", "/admin/endpoints",
      json{{"pool", "decode"}, {"endpoint", {{"url", "http://" + b.address()}, {"name", "b"}}}}
          .dump());
  ASSERT_EQ(r.status, 201) << r.body;
  r = admin("POST", "/admin/endpoints/remove", json{{"name", "a"}}.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["draining_requests"], 1);
  // A planned drain is no outage: a stays healthy in /metrics, as in /admin/endpoints, and says
  // it drains.
  EXPECT_EQ(metric("tandem:gateway_endpoint_healthy{pool=\"decode\",endpoint=\"a\"}"), 1);
  EXPECT_EQ(metric("tandem:gateway_endpoint_draining{pool=\"decode\",endpoint=\"a\"}"), 1);
  EXPECT_EQ(metric("tandem:gateway_endpoint_draining{pool=\"decode\",endpoint=\"b\"}"), 0);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(post(completion()).status, 200);
  EXPECT_EQ(b.requests(), 3);
  a.release();
  const auto first = held.get();
  EXPECT_EQ(first.status, 200);
  EXPECT_EQ(json::parse(first.body)["choices"][0]["text"], "a");
  // Once drained, a is gone.
  EXPECT_TRUE(eventually([&] { return endpoints().size() == 1; }));
  EXPECT_EQ(admin("POST", "/admin/endpoints/remove", json{{"name", "a"}}.dump()).status, 404);
  // A malformed removal says what is wrong in the gateway's words, naming the field (it quoted
  // nlohmann's exception text: "[json.exception.out_of_range.403] key 'name' not found").
  for (const auto& [body, said] :
       {std::pair{"[]", "admin: expected an object {\"name\": NAME}"},
        std::pair{"{}", "admin: name: expected an engine's name, got nothing"},
        std::pair{R"({"name": 3})",
                  "admin: name: expected an engine's name (a non-empty string), got number"},
        std::pair{R"({"name": "a", "drain": 1})",
                  "admin: drain: expected only name, got an unknown key"}}) {
    r = admin("POST", "/admin/endpoints/remove", body);
    EXPECT_EQ(r.status, 400) << body;
    EXPECT_EQ(json::parse(r.body)["error"]["message"], said) << body;
  }
  EXPECT_EQ(
      admin("POST", "/admin/endpoints", json{{"pool", "decode"}, {"endpoint", "x"}}.dump()).status,
      400);
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
}

TEST_P(GatewayFailures, ReloadUnderTrafficLosesNothing) {
  FakeEngine a("a"), b("b");
  const auto file = dir_ / "topology.yaml";
  auto write = [&](const FakeEngine& e, const std::string& name) {
    std::ofstream(file) << "mode: aggregated\nadmin_api_key: admin\naccess_log: access.jsonl\n"
                        << "listen: {host: 127.0.0.1, port: 1}\n"
                        << "decode:\n  endpoints:\n    - {url: \"http://" << e.address()
                        << "\", name: " << name << "}\n";
  };
  write(a, "a");
  Topology t = load_topology(file.string());
  t.port = 0;
  t.io_threads = GetParam();
  start(t, file.string());
  std::atomic<int> ok{0}, failed{0};
  // jthreads: an ASSERT below that returns early stops and joins them, where a joinable
  // std::thread's destructor would end the run in std::terminate, the failure unreported.
  std::vector<std::jthread> clients;
  for (int c = 0; c < 3; ++c)
    clients.emplace_back([&, c](std::stop_token stop) {
      while (!stop.stop_requested()) (post(completion(c % 2 == 0)).status == 200 ? ok : failed)++;
    });
  ASSERT_TRUE(eventually([&] { return ok > 20; }));
  write(b, "b");
  const auto r = admin("POST", "/admin/reload");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body), (json{{"added", 1}, {"removed", 1}}));
  const int b_before = b.requests();
  ASSERT_TRUE(eventually([&] { return b.requests() > b_before + 20; }));
  for (auto& c : clients) c.request_stop();
  for (auto& c : clients) c.join();
  EXPECT_EQ(failed, 0);
  const int a_after = a.requests();
  EXPECT_EQ(post(completion()).status, 200);
  EXPECT_EQ(a.requests(), a_after);  // a no longer gets anything
  // A broken file leaves the topology as it was.
  std::ofstream(file) << "decode: {endpoints: [\"no-port\"]}\n";
  EXPECT_EQ(admin("POST", "/admin/reload").status, 400);
  EXPECT_EQ(post(completion()).status, 200);
  // So does a duration past the bound a file is checked against at start (about 24.8 days).
  std::ofstream(file) << "mode: aggregated\nadmin_api_key: admin\n"
                      << "health: {probe_interval_ms: 10000000000000}\n"
                      << "decode: {endpoints: [\"" << b.address() << "\"]}\n";
  const auto refused = admin("POST", "/admin/reload");
  EXPECT_EQ(refused.status, 400);
  EXPECT_NE(refused.body.find("health.probe_interval_ms: expected a duration in milliseconds "
                              "1..2147483647"),
            std::string::npos)
      << refused.body;
  EXPECT_EQ(post(completion()).status, 200);
  EXPECT_TRUE(eventually([&] { return all_idle(); }));
}

// A reload checks the file as a start would and refuses, naming the field, what a start refuses
// (it answered 200 for "policy: tandom" and a model folder without tokenizer.json); a setting it
// does not apply (it needs a restart) is named in the answer, not silently ignored.
TEST_P(GatewayFailures, AReloadRefusesWhatAStartRefusesAndNamesWhatItDoesNotApply) {
  FakeEngine a("a");
  const auto file = dir_ / "topology.yaml";
  auto write = [&](const std::string& extra) {
    std::ofstream(file) << "mode: aggregated\nadmin_api_key: admin\n"
                        << "listen: {host: 127.0.0.1, port: 1}\n"
                        << extra << "decode:\n  endpoints:\n    - {url: \"http://" << a.address()
                        << "\", name: a}\n";
  };
  write("");
  Topology t = load_topology(file.string());
  t.port = 0;
  t.io_threads = GetParam();
  start(t, file.string());
  for (const auto& [extra, said] :
       {std::pair{"policy: tandom\n", "policy: unknown scheduling policy 'tandom'"},
        std::pair{"model: /nonexistent/model\n", "model: "}}) {
    write(extra);
    const auto r = admin("POST", "/admin/reload");
    EXPECT_EQ(r.status, 400) << extra << r.body;
    EXPECT_NE(r.body.find(said), std::string::npos) << r.body;
  }
  write("policy: round_robin\n");
  auto r = admin("POST", "/admin/reload");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body),
            (json{{"added", 0}, {"removed", 0}, {"not_applied", json::array({"policy"})}}));
  write("");
  r = admin("POST", "/admin/reload");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body), (json{{"added", 0}, {"removed", 0}}));
  EXPECT_EQ(post(completion()).status, 200);
}

// A reload checks a start-time setting only where the file changed it: a file whose access_log
// lies in a folder missing on this host, which the gateway's own setting overrode at start
// (`--access-log -`), answered 400 to every reload, even one that only adds an engine.
TEST_P(GatewayFailures, AReloadChecksOnlyTheStartSettingsItsFileChanged) {
  FakeEngine a("a"), b("b");
  const auto file = dir_ / "topology.yaml";
  auto write = [&](const std::string& engines) {
    std::ofstream(file) << "mode: aggregated\nadmin_api_key: admin\n"
                        << "access_log: " << (dir_ / "no-such-dir" / "access.jsonl").string()
                        << "\ndecode: {endpoints: [" << engines << "]}\n";
  };
  write("\"" + a.address() + "\"");
  Topology t = load_topology(file.string());
  t.host = "127.0.0.1";
  t.port = 0;
  t.io_threads = GetParam();
  t.access_log = "-";  // as the flag overrides it
  start(t, file.string());
  write("\"" + a.address() + "\", \"" + b.address() + "\"");
  const auto r = admin("POST", "/admin/reload");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body), (json{{"added", 1}, {"removed", 0}}));
}

// Every setting a reload does not apply is named: the listen section's and the scheduling
// section's beyond the ones once compared (max_body_time_ms, max_hold_ms were missed), and the
// queue's byte bound.
TEST_P(GatewayFailures, AReloadNamesEveryListenAndSchedulingSettingItDoesNotApply) {
  FakeEngine a("a");
  const auto file = dir_ / "topology.yaml";
  auto write = [&](const std::string& listen, const std::string& extra) {
    std::ofstream(file) << "mode: aggregated\nadmin_api_key: admin\n"
                        << "listen: {host: 127.0.0.1, port: 1" << listen << "}\n"
                        << extra << "decode: {endpoints: [\"" << a.address() << "\"]}\n";
  };
  write("", "");
  Topology t = load_topology(file.string());
  t.port = 0;
  t.io_threads = GetParam();
  start(t, file.string());
  for (const auto& [listen, extra, named] :
       {std::tuple{", max_body_time_ms: 1000", "", "listen"},
        std::tuple{"", "scheduling: {max_hold_ms: 5}\n", "scheduling"},
        std::tuple{"", "scheduling: {cache_aware: {cache_threshold: 0.5}}\n", "scheduling"},
        std::tuple{"", "scheduling: {queue_length_weight: 0.5}\n", "scheduling"},
        std::tuple{"", "max_queued_body_bytes: 4096\n", "max_queued_body_bytes"}}) {
    write(listen, extra);
    const auto r = admin("POST", "/admin/reload");
    ASSERT_EQ(r.status, 200) << extra << r.body;
    EXPECT_EQ(json::parse(r.body),
              (json{{"added", 0}, {"removed", 0}, {"not_applied", json::array({named})}}))
        << listen << extra;
  }
}

TEST_P(GatewayFailures, HostileInputIsRefusedWithoutHarm) {
  FakeEngine p("p"), d("d");
  auto t = topology(PdMode::kSequential);
  t.prefill.endpoints = {endpoint_of(p, "p")};
  t.decode.endpoints = {endpoint_of(d, "d")};
  start(t);
  // An id that is not a plain token is replaced (it goes into the JSON access log).
  net::Headers h;
  h.set("X-Request-Id",
        "\xff\xfe"
        "bad");
  EXPECT_EQ(post(completion(), h).status, 200);
  ASSERT_TRUE(eventually([&] { return log_lines().size() == 1; }));
  EXPECT_EQ(log_lines()[0]["request_id"].get<std::string>().size(), 32u);
  EXPECT_EQ(d.last_body().is_object(), true);
  // A plain id is honoured and reaches the engines.
  h.set("X-Request-Id", "my-request-1");
  EXPECT_EQ(post(completion(), h).status, 200);
  ASSERT_TRUE(eventually([&] { return log_lines().size() == 2; }));
  EXPECT_EQ(log_lines()[1]["request_id"], "my-request-1");
  // A stream flag of the wrong type is the client's error.
  auto r = post(json{{"prompt", "x"}, {"stream", "yes"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("stream"), std::string::npos);
  EXPECT_EQ(net::http_request("127.0.0.1", port(), "GET", "/health").status, 200);
}

TEST_P(GatewayFailures, ThePolicyIsChosenByName) {
  FakeEngine a("a"), b("b");
  auto t = topology(PdMode::kAggregated);
  t.decode.endpoints = {endpoint_of(a, "a"), endpoint_of(b, "b")};
  t.policy = "no-such-policy";
  try {
    Gateway g(t, {});
    ADD_FAILURE() << "an unknown policy was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("least_load"), std::string::npos) << e.what();
  }
  // One request at a time: least_load sends each to the idle engine with the lowest id,
  // round_robin alternates. "At a time" includes the gateway's accounting, which ends on its
  // scheduling thread shortly after the answer reached the client.
  auto one_at_a_time = [&] {
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(post(completion()).status, 200);
      ASSERT_TRUE(eventually([&] { return all_idle(); }));
    }
  };
  t.policy = "round_robin";
  start(t);
  one_at_a_time();
  EXPECT_EQ(a.requests(), 2);
  EXPECT_EQ(b.requests(), 2);
  gw_.reset();
  t.policy = "least_load";
  start(t);
  one_at_a_time();
  EXPECT_EQ(a.requests(), 6);
  EXPECT_EQ(b.requests(), 2);
}

// A file's unknown policy is refused as the file's other errors are, "FILE: key: ...", listing
// the names it could be (the gateway said "unknown scheduling policy 'tandom'", naming neither).
TEST_P(GatewayFailures, AnUnknownPolicyInAFileNamesTheFileAndTheKey) {
  FakeEngine d("d");
  const auto file = (dir_ / "topology.yaml").string();
  std::ofstream(file) << "policy: tandom\ndecode: {endpoints: [\"" << d.address() << "\"]}\n";
  Topology t = load_topology(file);
  t.port = 0;
  t.io_threads = GetParam();
  try {
    Gateway g(t, file);
    ADD_FAILURE() << "an unknown policy was accepted";
  } catch (const Error& e) {
    std::string valid;
    for (const auto& n : policy_names()) valid += (valid.empty() ? "" : ", ") + n;
    EXPECT_EQ(std::string(e.what()), file +
                                         ": policy: unknown scheduling policy 'tandom'; "
                                         "expected one of: " +
                                         valid);
  }
}

// A stopping gateway refuses new requests (503) at once, and lets those in flight finish within
// its drain: stop() returns once they have.
TEST_P(GatewayFailures, StopLetsTheRequestsInFlightFinish) {
  FakeEngine engine("e");
  engine.set(Behaviour::kHold);
  start_aggregated(engine, "e");
  auto answer = std::async(std::launch::async, [&] { return post(completion()); });
  ASSERT_TRUE(eventually([&] { return engine.held() == 1; }));
  auto stopped = std::async(std::launch::async, [&] { gw_->stop(std::chrono::minutes(1)); });
  // A new request is refused as soon as the stop began (a body that is no JSON: a 400 before).
  ASSERT_TRUE(eventually([&] {
    return net::http_request("127.0.0.1", port(), "POST", "/v1/completions", "{", {}, 10s).status ==
           503;
  }));
  EXPECT_EQ(stopped.wait_for(0s), std::future_status::timeout);  // the held request drains
  engine.release();
  const auto r = answer.get();
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["choices"][0]["text"].get<std::string>().rfind("e", 0), 0u)
      << r.body;
  stopped.get();
}

// Once the drain is over, the requests left are answered, not dropped: a client with nothing yet
// gets 503 in OpenAI error JSON, a stream ends with that error event (and properly: a whole
// HTTP answer). It was a connection closed without a response (curl: exit 52), and a stream cut
// as its engine's failure ("engine e: cancelled").
TEST_P(GatewayFailures, StopAnswersWhatIsLeftAfterTheDrain) {
  FakeEngine engine("e");
  engine.set(Behaviour::kHold);
  start_aggregated(engine, "e");
  auto whole = std::async(std::launch::async, [&] { return post(completion()); });
  ASSERT_TRUE(eventually([&] { return engine.held() == 1; }));
  engine.set(Behaviour::kSlowStream);
  std::promise<void> first_event;
  std::string got;
  auto stream = std::async(std::launch::async, [&] {
    bool told = false;
    return net::http_request_stream("127.0.0.1", port(), "POST", "/v1/completions",
                                    completion(true).dump(), {}, [&](std::string_view p) {
                                      got += p;
                                      if (!told && got.find("e0") != std::string::npos) {
                                        told = true;
                                        first_event.set_value();
                                      }
                                      return true;
                                    });
  });
  auto streaming = first_event.get_future();
  get_within(streaming, kHangGuard, "the stream's first event never came");
  gw_->stop(0ms);
  const auto r = whole.get();
  EXPECT_EQ(r.status, 503) << r.body;
  const json error = json::parse(r.body).at("error");
  EXPECT_EQ(error.at("message"), "the gateway is shutting down");
  EXPECT_EQ(error.at("type"), "server_error");
  const auto s = stream.get();
  EXPECT_EQ(s.status, 200);
  EXPECT_EQ(last_error(got), "the answer was cut: the gateway is shutting down") << got;
  gw_.reset();  // the access log is written through
  const auto lines = log_lines();
  ASSERT_EQ(lines.size(), 2u);
  for (const auto& line : lines) EXPECT_EQ(line["status"], 503) << line.dump();
}

TEST_P(GatewayFailures, AGatewayThatCannotStartFailsAtOnce) {
  FakeEngine d("d");
  auto t = topology(PdMode::kAggregated);
  t.decode.endpoints = {endpoint_of(d, "d")};
  // An access log that cannot be opened: an error naming it, not a hang.
  auto bad = t;
  bad.access_log = (dir_ / "no-such-dir" / "access.jsonl").string();
  EXPECT_THROW(Gateway(bad, {}), Error);
  // A port in use: start() throws, and the gateway can still be destroyed.
  start(t);
  auto taken = t;
  taken.port = port();
  Gateway second(taken, {});
  EXPECT_THROW(second.start(), Error);
}

// Every completed request's phases are all stamped and in order (the prefill and decode tracks
// each monotonic; in parallel mode they overlap).
void expect_phases_complete_and_ordered(const json& line, PdMode mode) {
  const json& p = line["phases"];
  const char* all[] = {"received",          "tokenizing", "prefix_matching", "prefill_waiting",
                       "prefill_scheduled", "prefilling", "decode_waiting",  "decode_scheduled",
                       "decoding",          "completed"};
  for (const char* name : all) ASSERT_TRUE(p.contains(name)) << name << " missing: " << line.dump();
  auto le = [&](const char* a, const char* b) {
    EXPECT_LE(p[a].get<double>(), p[b].get<double>()) << a << " after " << b << ": " << line.dump();
  };
  le("received", "tokenizing");
  le("tokenizing", "prefix_matching");
  le("prefix_matching", "prefill_waiting");
  le("prefill_waiting", "prefill_scheduled");
  le("prefill_scheduled", "prefilling");
  le("prefilling", "completed");
  le("prefill_waiting", "decode_waiting");
  le("decode_waiting", "decode_scheduled");
  le("decode_scheduled", "decoding");
  le("decoding", "completed");
  if (mode == PdMode::kSequential) {
    le("prefilling", "prefill_done");
    le("prefill_done", "decode_waiting");
  }
}

TEST_P(GatewayFailures, EveryRequestRecordsTenOrderedPhases) {
  for (PdMode mode : {PdMode::kAggregated, PdMode::kSequential, PdMode::kParallel}) {
    SCOPED_TRACE(mode_name(mode));
    std::filesystem::remove(log_);
    FakeEngine prefill("p"), decode("d");
    auto t = topology(mode);
    if (mode != PdMode::kAggregated) t.prefill.endpoints = {endpoint_of(prefill, "p", 7001)};
    t.decode.endpoints = {endpoint_of(decode, "d")};
    start(t);
    EXPECT_EQ(post(completion(false)).status, 200);
    EXPECT_EQ(post(completion(true)).status, 200);
    EXPECT_EQ(post(completion(false), {}, "/v1/chat/completions").status, 200);
    ASSERT_TRUE(eventually([&] { return log_lines().size() == 3; }));
    gw_.reset();
    const auto lines = log_lines();
    for (const auto& l : lines) {
      EXPECT_EQ(l["status"], 200);
      EXPECT_EQ(l["mode"], mode_name(mode));
      EXPECT_EQ(l["decode"], "d");
      expect_phases_complete_and_ordered(l, mode);
    }
    // The stream's three token events. Lines are written as requests finish, and a stream's line
    // may follow the next request's: find it by its "stream" field, not its position.
    const auto streamed = std::count_if(lines.begin(), lines.end(), [](const json& l) {
      return l.value("stream", false) && l.value("output_events", 0) == 3;
    });
    EXPECT_EQ(streamed, 1) << json(lines).dump();
  }
}

INSTANTIATE_TEST_SUITE_P(IoThreads, GatewayFailures, ::testing::Values(2, 1),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param == 1 ? std::string("OneIoThread")
                                                  : std::string("SchedulingThread");
                         });

// An engine that answers every call at once with `status` and `body`, behind a server whose
// GET /v1/models relays to it.
struct CannedEngine final : Upstream {
  std::atomic<int> status{200};
  std::string body = "{}";
  CallId start(net::AsyncHttpRequest, net::AsyncHttpHandlers h) override {
    h.on_head(status, {});
    // As the HTTP client: a body the caller refuses more of ends the call, cancelled.
    const bool more = h.on_body(body);
    h.on_done(more ? "" : "cancelled");
    return 1;
  }
  void cancel(CallId) override {}
};

class RelayEngineGet : public ::testing::Test {
 protected:
  RelayEngineGet() : server_(options()) {
    server_.route("GET", "/v1/models", [this](const net::HttpRequest&, auto ex) {
      relay_engine_call(engine_, {}, "a", std::move(ex));
    });
    server_.start();
  }
  ~RelayEngineGet() override { server_.stop(); }
  static net::HttpServerOptions options() {
    net::HttpServerOptions o;
    o.host = "127.0.0.1";
    o.error_response = api::openai_error_response;
    return o;
  }
  net::HttpClientResponse get(int status, const std::string& body = "{}") {
    engine_.status = status;
    engine_.body = body;
    return net::http_request("127.0.0.1", server_.port(), "GET", "/v1/models");
  }

  CannedEngine engine_;
  net::HttpServer server_;
};

// An engine's GET answered with a status that cannot be passed on as final (a 101, or one past
// 599) is a 502 naming it: before, a 1xx made respond() throw, and the client got the server's
// generic 500, and a 700 was relayed as it was.
TEST_F(RelayEngineGet, AnEngineStatusOutsideTheFinalRangeIs502) {
  const std::string openai = R"({"error":{"message":"overloaded","type":"server_error"}})";
  for (int status : {101, 700, 599, 200}) {
    const auto r = get(status, status >= 400 ? openai : "{}");
    if (status == 200 || status == 599) {
      EXPECT_EQ(r.status, status);
      EXPECT_EQ(r.body, status == 200 ? "{}" : openai);
      continue;
    }
    EXPECT_EQ(r.status, 502) << status;
    EXPECT_NE(r.body.find("engine a answered HTTP " + std::to_string(status)), std::string::npos)
        << r.body;
  }
}

// GET /v1/models and the dashboard's expert loads relay an engine's answer; an error that is no
// OpenAI error (a proxy's HTML page) reached clients labelled application/json. As a request's
// error answer: an OpenAI error is relayed as it is, anything else quoted in the gateway's own
// (the engine's 4xx status, 502 for a 5xx).
TEST_F(RelayEngineGet, AnErrorThatIsNoOpenAIErrorIsQuotedInTheGatewaysOwn) {
  const std::string page = "<html>\n<body>upstream\texploded</body></html>";
  auto r = get(500, page);
  EXPECT_EQ(r.status, 502);
  EXPECT_EQ(r.headers.get("Content-Type"), "application/json");
  EXPECT_EQ(api::openai_error_message(r.body),
            "engine a answered HTTP 500: <html> <body>upstream exploded</body></html>");
  r = get(404, page);
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(api::openai_error_message(r.body),
            "engine a answered HTTP 404: <html> <body>upstream exploded</body></html>");
  // vLLM's other error shape: its message is quoted.
  r = get(400, R"({"object":"error","message":"bad","type":"BadRequestError","code":400})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(api::openai_error_message(r.body), "engine a answered HTTP 400: bad");
  const std::string openai =
      R"({"error":{"message":"invalid key","type":"invalid_request_error"}})";
  r = get(401, openai);
  EXPECT_EQ(r.status, 401);
  EXPECT_EQ(r.body, openai);
}

// A relayed answer past the 16 MiB the gateway holds of one is a 502 naming that limit; it was
// "engine a failed: cancelled", as if the engine had broken.
TEST_F(RelayEngineGet, AnAnswerPastWhatTheGatewayHoldsIsA502NamingTheLimit) {
  const auto r = get(200, std::string((size_t{16} << 20) + 1, ' '));
  EXPECT_EQ(r.status, 502);
  EXPECT_NE(api::openai_error_message(r.body).value_or("").find("larger than 16 MiB"),
            std::string::npos)
      << r.body;
}

}  // namespace
}  // namespace tandem::gateway
