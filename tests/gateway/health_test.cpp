// The health monitor's model check, on a virtual clock with engines whose calls the test answers:
// an engine's GET /v1/models is read on the io thread with the bounded reader (a hostile answer is
// no list, said why, and the engine kept as before); the line that keeps an engine serving any
// name says its address, once per process however many gateway replicas check it. No sockets, no
// sleeps: a timeout moves the virtual clock.
#include "gateway/health.h"

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/model_list.h"
#include "gateway/endpoints.h"
#include "gateway/gateway_metrics.h"
#include "gateway/prefix_index.h"
#include "gateway/virtual_executor.h"
#include "util/metrics.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;

// Engines whose calls stay open until the test answers or ends them. cancel() ends a call at once.
class Engines final : public Upstream {
 public:
  struct Call {
    CallId id = 0;
    net::AsyncHttpRequest request;
    net::AsyncHttpHandlers handlers;
    bool done = false;
  };

  CallId start(net::AsyncHttpRequest request, net::AsyncHttpHandlers handlers) override {
    calls_.push_back(
        std::make_shared<Call>(Call{++next_, std::move(request), std::move(handlers)}));
    return next_;
  }
  void cancel(CallId id) override {
    for (const auto& c : calls_)
      if (c->id == id) end(*c, "cancelled");
  }
  // The open calls to `host`'s `target`.
  std::vector<std::shared_ptr<Call>> open(const std::string& host, const std::string& target) {
    std::vector<std::shared_ptr<Call>> out;
    for (const auto& c : calls_)
      if (!c->done && c->request.host == host && c->request.target == target) out.push_back(c);
    return out;
  }
  // Answers `host`'s one open call to `target`; false when there is none.
  bool answer(const std::string& host, const std::string& target, int status,
              const std::string& body) {
    const auto calls = open(host, target);
    if (calls.size() != 1) return false;
    Call& c = *calls[0];
    if (c.handlers.on_head) c.handlers.on_head(status, net::Headers{});
    // A reader that wants no more ends the call, as the HTTP client does.
    if (c.handlers.on_body && !c.handlers.on_body(body)) {
      end(c, "cancelled");
      return true;
    }
    end(c, "");
    return true;
  }
  static void end(Call& c, const std::string& error) {
    if (c.done) return;
    c.done = true;
    if (c.handlers.on_done) c.handlers.on_done(error);
  }

 private:
  CallId next_ = 0;
  std::vector<std::shared_ptr<Call>> calls_;
};

Endpoint engine(const std::string& name) {
  Endpoint e;
  e.name = name;
  e.host = name + ".engines";
  e.port = 8000;
  return e;
}

Topology one_engine(Dialect dialect) {
  Topology t;
  t.mode = PdMode::kAggregated;
  t.served_model_name = "m";
  t.decode.dialect = dialect;
  t.decode.max_in_flight = 4;
  t.decode.endpoints = {engine("a")};
  t.health.probe_interval = milliseconds(2000);
  t.health.probe_timeout = milliseconds(500);
  t.health.failures_to_eject = 2;
  return t;
}

// The gateway's health parts as Gateway wires them: the topology's engines join first.
struct Monitor {
  explicit Monitor(Topology t)
      : topo(std::move(t)),
        metrics(registry),
        endpoints(topo, metrics, index),
        health(topo, clock, engines, endpoints, [this] { ++changes; }) {
    for (const auto& e : topo.decode.endpoints) endpoints.add(false, e);
  }
  int id_of(const std::string& name) const {
    for (const auto& [id, e] : endpoints.all())
      if (e.config.name == name) return id;
    return -1;
  }
  const EndpointState& state(const std::string& name) const { return *endpoints.find(id_of(name)); }
  // The engine passes its probe and answers its model list.
  void checked(const std::string& name, int status, const std::string& list) {
    const std::string host = name + ".engines";
    ASSERT_TRUE(engines.answer(host, "/health", 200, ""));
    clock.run_ready();
    ASSERT_TRUE(engines.answer(host, "/v1/models", status, list));
    clock.run_ready();
  }

  Topology topo;
  VirtualExecutor clock;
  Engines engines;
  PrefixIndex index;
  metrics::Registry registry;
  GatewayMetrics metrics;
  EndpointTable endpoints;
  HealthMonitor health;
  int changes = 0;
};

std::string list_of(const std::string& id, const std::string& owner) {
  return json{{"object", "list"},
              {"data", {{{"id", id}, {"object", "model"}, {"owned_by", owner}}}}}
      .dump();
}

// ------------------------------------------------------------------------ the model list

TEST(ModelList, AListIsReadForTheModelItsIdsAndWhetherItsServerRefusesUnknownNames) {
  json data = json::array();
  for (const char* id : {"x1", "x2", "m", "x3", "x4"}) data.push_back({{"id", id}});
  data.push_back({{"id", "y"}, {"owned_by", "vllm"}});
  data.push_back(42);  // no model entry: skipped
  const ModelListSummary list = read_model_list(json{{"data", data}}.dump(), "m");
  EXPECT_EQ(list.unreadable, "");
  EXPECT_TRUE(list.lists_model);
  EXPECT_EQ(list.listed, "'x1', 'x2', 'm', 'x3'");
  EXPECT_TRUE(list.more);
  EXPECT_TRUE(list.owned_by_refusing_server);

  const ModelListSummary other = read_model_list(list_of("other", "sglang"), "m");
  EXPECT_FALSE(other.lists_model);
  EXPECT_EQ(other.listed, "'other'");
  EXPECT_FALSE(other.more);
  EXPECT_FALSE(other.owned_by_refusing_server);
}

// An engine's answer is its own to choose: nesting deeper than the reader takes (as the whole
// body or inside "data") or no list at all is no model list, and the summary says why.
TEST(ModelList, AHostileOrForeignAnswerIsNoListAndSaysWhy) {
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  EXPECT_NE(read_model_list(deep, "m").unreadable.find("nesting is deeper than 64"),
            std::string::npos)
      << read_model_list(deep, "m").unreadable;
  const std::string deep_entry =
      R"({"data": [)" + std::string(100, '[') + std::string(100, ']') + "]}";
  EXPECT_NE(read_model_list(deep_entry, "m").unreadable.find("nesting is deeper than 64"),
            std::string::npos);
  EXPECT_NE(read_model_list(R"({"object": "list"})", "m").unreadable.find("no \"data\" list"),
            std::string::npos);
  EXPECT_NE(read_model_list("<html>", "m").unreadable, "");
  EXPECT_FALSE(read_model_list(deep, "m").lists_model);
}

// An engine whose GET /v1/models answers something that is no model list (too deep, or too large
// to read) is kept as an engine that does not say: healthy, no longest sequence, and not asked
// again. A 200 too large to read was taken for a failed call, asked again at every probe.
TEST(HealthMonitor, AModelListThatIsNoListKeepsTheEngineAndIsNotAskedAgain) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string huge = list_of(std::string(size_t{2} << 20, 'x'), "vllm");
  for (const std::string* body : {&deep, &huge}) {
    SCOPED_TRACE(body == &deep ? "deep" : "huge");
    Monitor m(one_engine(Dialect::kVllm));  // vLLM refuses a model it does not list
    m.health.start();
    m.clock.run_ready();
    m.checked("a", 200, *body);
    EXPECT_TRUE(m.state("a").healthy);
    EXPECT_EQ(m.state("a").not_serving, "");
    EXPECT_EQ(m.state("a").length_query, LengthQuery::kAnswered);
    EXPECT_EQ(m.state("a").max_model_len, 0);
    m.clock.advance_by(m.topo.health.probe_interval);
    ASSERT_TRUE(m.engines.answer("a.engines", "/health", 200, ""));
    m.clock.run_ready();
    EXPECT_TRUE(m.engines.open("a.engines", "/v1/models").empty());
  }
}

// ------------------------------------------------------------------------ the kept line

// Gateway replicas (--gateways N) each check every engine: the line keeping an engine that lists
// another model but serves any name (SGLang) names its address and is said once in the process.
TEST(HealthMonitor, TheLineKeepingAnEngineThatServesAnyNameIsSaidOncePerProcessWithItsAddress) {
  Topology t = one_engine(Dialect::kSglang);
  t.decode.endpoints = {engine("kept-once")};
  ::testing::internal::CaptureStderr();
  for (int replica = 0; replica < 3; ++replica) {
    Monitor m(t);
    m.health.start();
    m.clock.run_ready();
    m.checked("kept-once", 200, list_of("/models/DeepSeek-V3", "sglang"));
    EXPECT_TRUE(m.state("kept-once").healthy);
  }
  const std::string said = ::testing::internal::GetCapturedStderr();
  size_t lines = 0;
  for (size_t at = said.find("kept:"); at != std::string::npos; at = said.find("kept:", at + 1))
    ++lines;
  EXPECT_EQ(lines, 1u) << said;
  EXPECT_NE(said.find("engine kept-once (kept-once.engines:8000): its GET /v1/models lists "
                      "'/models/DeepSeek-V3'"),
            std::string::npos)
      << said;
}

}  // namespace
}  // namespace tandem::gateway
