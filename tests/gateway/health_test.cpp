// The health monitor's model check and new engines, on a virtual clock with engines whose calls
// the test answers: an engine's GET /v1/models is read on the io thread with the bounded reader
// (a hostile answer is no list, said why, and the engine kept as before); the line that keeps an
// engine serving any name says its address, once per process however many gateway replicas
// check it; and an engine that joins while the gateway runs takes no request before its first
// check ended. No sockets, no sleeps: a timeout moves the virtual clock.
#include "gateway/health.h"

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/model_list.h"
#include "gateway/endpoints.h"
#include "gateway/fake_upstream.h"
#include "gateway/gateway_metrics.h"
#include "gateway/policy.h"
#include "gateway/prefix_index.h"
#include "gateway/virtual_executor.h"
#include "util/metrics.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;

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

std::string list_of(const std::string& id, const std::string& owner) {
  return json{{"object", "list"},
              {"data", {{{"id", id}, {"object", "model"}, {"owned_by", owner}}}}}
      .dump();
}

// The gateway's health parts as Gateway wires them: the topology's engines join first. The lines
// said once are this monitor's, or `shared`'s (replicas of one process).
struct Monitor {
  explicit Monitor(Topology t, SaidOnce* shared = nullptr)
      : topo(std::move(t)),
        metrics(registry),
        endpoints(topo, metrics, index),
        health(
            topo, clock, engines, endpoints, [this] { ++changes; }, shared ? *shared : said) {
    for (const auto& e : topo.decode.endpoints) endpoints.add(false, e);
  }
  int id_of(const std::string& name) const {
    for (const auto& [id, e] : endpoints.all())
      if (e.config.name == name) return id;
    return -1;
  }
  const EndpointState& state(const std::string& name) const { return *endpoints.find(id_of(name)); }
  // What a request would get of the engines now (the dispatcher's view and least-load choice).
  Choice choice() const {
    return policy->choose_decode(endpoints.view(clock.now(), nullptr), RequestInfo{}, -1,
                                 clock.now());
  }
  int64_t limit_of(const std::string& name) const {
    for (const auto& l : endpoints.view(clock.now(), nullptr).decode)
      if (l.id == id_of(name)) return l.max_in_flight;
    return -1;
  }
  // The engine passes its probe and answers its model list.
  void checked(const std::string& name, int status, const std::string& list) {
    const std::string host = name + ".engines";
    ASSERT_TRUE(engines.answer(host, "/health", 200, ""));
    clock.run_ready();
    ASSERT_TRUE(engines.answer(host, "/v1/models", status, list));
    clock.run_ready();
  }
  // The gateway starts, and `first` of its engines passes its first check listing the model.
  void started_with_checked(const std::string& first, const std::string& owner = "vllm") {
    health.start();
    clock.run_ready();
    checked(first, 200, list_of("m", owner));
  }
  // Engines join while the gateway runs: their first probes start at once.
  void join(const std::vector<std::string>& names) {
    for (const auto& name : names) endpoints.add(false, engine(name));
    clock.run_ready();
  }

  Topology topo;
  SaidOnce said;
  VirtualExecutor clock;
  FakeEngines engines;
  std::unique_ptr<Policy> policy = make_policy("least_load");
  PrefixIndex index;
  metrics::Registry registry;
  GatewayMetrics metrics;
  EndpointTable endpoints;
  HealthMonitor health;
  int changes = 0;
};

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

// A 4xx is an answer however large its body (a server without GET /v1/models): the engine is
// kept and not asked again. One too large to read was taken for a failed call, asked again at
// every probe. A 200's list is read once for the model and the longest sequence.
TEST(HealthMonitor, ATooLarge4xxIsAnAnswerAndAListsLongestSequenceIsRead) {
  Monitor m(one_engine(Dialect::kVllm));
  m.health.start();
  m.clock.run_ready();
  m.checked("a", 404, std::string(size_t{2} << 20, 'x'));
  EXPECT_TRUE(m.state("a").healthy);
  EXPECT_EQ(m.state("a").length_query, LengthQuery::kAnswered);
  m.clock.advance_by(m.topo.health.probe_interval);
  ASSERT_TRUE(m.engines.answer("a.engines", "/health", 200, ""));
  m.clock.run_ready();
  EXPECT_TRUE(m.engines.open("a.engines", "/v1/models").empty());

  json list = json::parse(list_of("m", "vllm"));
  list["data"][0]["max_model_len"] = 4096;
  EXPECT_EQ(read_model_list(list.dump(), "m").max_model_len, 4096);
  EXPECT_EQ(read_model_list(list.dump(), "").max_model_len, 4096);
  Monitor n(one_engine(Dialect::kVllm));
  n.health.start();
  n.clock.run_ready();
  n.checked("a", 200, list.dump());
  EXPECT_EQ(n.state("a").max_model_len, 4096);
}

// ------------------------------------------------------------------------ the kept line

// Gateway replicas (--gateways N) each check every engine: the line keeping an engine that lists
// another model but serves any name (SGLang) names its address and is said once in the process.
// An engine removed and added again at the same name and address that lists other models is said
// again: the line says what it lists.
TEST(HealthMonitor, TheLineKeepingAnEngineThatServesAnyNameIsSaidOncePerProcessWithItsAddress) {
  Topology t = one_engine(Dialect::kSglang);
  t.decode.endpoints = {engine("kept-once")};
  SaidOnce process;
  auto lines_said = [&](const std::string& listed, int replicas) {
    ::testing::internal::CaptureStderr();
    for (int replica = 0; replica < replicas; ++replica) {
      Monitor m(t, &process);
      m.health.start();
      m.clock.run_ready();
      m.checked("kept-once", 200, list_of(listed, "sglang"));
      EXPECT_TRUE(m.state("kept-once").healthy);
    }
    return ::testing::internal::GetCapturedStderr();
  };
  auto count = [](const std::string& said) {
    size_t lines = 0;
    for (size_t at = said.find("kept:"); at != std::string::npos; at = said.find("kept:", at + 1))
      ++lines;
    return lines;
  };
  const std::string said = lines_said("/models/DeepSeek-V3", 3);
  EXPECT_EQ(count(said), 1u) << said;
  EXPECT_NE(said.find("engine kept-once (kept-once.engines:8000): its GET /v1/models lists "
                      "'/models/DeepSeek-V3'"),
            std::string::npos)
      << said;
  const std::string again = lines_said("/models/Qwen3-8B", 2);
  EXPECT_EQ(count(again), 1u) << again;
  EXPECT_NE(again.find("lists '/models/Qwen3-8B'"), std::string::npos) << again;
  EXPECT_EQ(count(lines_said("/models/DeepSeek-V3", 1)), 0u);
}

// ------------------------------------------------------------------------ new engines

// The topology's engines take requests as the gateway starts, before any probe answered (as
// ever); an engine that joins later is probed at once and held (an in-flight limit of 0: a
// request waits for it rather than failing) until its model list answered. One that lists
// another model is ejected having taken nothing; one that lists it takes requests.
TEST(HealthMonitor, AnEngineThatJoinsTakesNoRequestBeforeItsFirstCheckEnded) {
  Monitor m(one_engine(Dialect::kVllm));
  EXPECT_EQ(m.limit_of("a"), 4);
  m.health.start();
  m.clock.run_ready();
  EXPECT_EQ(m.limit_of("a"), 4);
  m.checked("a", 200, list_of("m", "vllm"));
  m.endpoints.drain(m.id_of("a"));  // the new engines are the only ones

  m.endpoints.add(false, engine("wrong"));
  m.endpoints.add(false, engine("right"));
  EXPECT_EQ(m.limit_of("wrong"), 0);
  EXPECT_TRUE(m.state("wrong").unchecked);
  EXPECT_EQ(m.endpoints.to_json(m.state("wrong"), m.clock.now())["unchecked"], true);
  EXPECT_EQ(m.choice().kind, Choice::Kind::kSaturated);  // waits, not refused
  EXPECT_NE(m.endpoints.pools_state({false}, m.clock.now()).find("2 not yet checked"),
            std::string::npos)
      << m.endpoints.pools_state({false}, m.clock.now());
  m.clock.run_ready();  // probed now, not at the next interval
  ASSERT_EQ(m.engines.open("wrong.engines", "/health").size(), 1u);
  ASSERT_TRUE(m.engines.answer("wrong.engines", "/health", 200, ""));
  m.clock.run_ready();
  EXPECT_EQ(m.limit_of("wrong"), 0);  // its probe passed, its list is still to come
  const int before = m.changes;
  ASSERT_TRUE(m.engines.answer("wrong.engines", "/v1/models", 200, list_of("other", "vllm")));
  m.clock.run_ready();
  EXPECT_FALSE(m.state("wrong").healthy);
  EXPECT_FALSE(m.state("wrong").unchecked);
  EXPECT_GT(m.changes, before);                          // the waiting requests are looked at again
  EXPECT_EQ(m.choice().kind, Choice::Kind::kSaturated);  // right is still held

  m.checked("right", 200, list_of("m", "vllm"));
  EXPECT_FALSE(m.state("right").unchecked);
  EXPECT_EQ(m.limit_of("right"), 4);
  const Choice c = m.choice();
  EXPECT_EQ(c.kind, Choice::Kind::kChosen);
  EXPECT_EQ(c.endpoint, m.id_of("right"));
}

// The hold is bounded: whatever the engine answers to its model list, or if it does not, its
// first check ends within a probe timeout of its passing probe and today's rules decide. Without
// GET /v1/models (llama.cpp: 404) it is admitted; a list call that never ends is cut at the probe
// timeout and it is admitted (asked again at its next probe).
TEST(HealthMonitor, AnEngineThatJoinsIsAdmittedWhenItsFirstCheckEndsWhateverItsAnswer) {
  Monitor m(one_engine(Dialect::kAuto));
  m.started_with_checked("a", "tandem");

  m.join({"no-list", "silent"});
  m.checked("no-list", 404, R"({"error": "Not Found"})");
  EXPECT_FALSE(m.state("no-list").unchecked);
  EXPECT_TRUE(m.state("no-list").healthy);
  EXPECT_EQ(m.limit_of("no-list"), 4);

  ASSERT_TRUE(m.engines.answer("silent.engines", "/health", 200, ""));
  m.clock.run_ready();
  ASSERT_EQ(m.engines.open("silent.engines", "/v1/models").size(), 1u);
  EXPECT_EQ(m.limit_of("silent"), 0);
  m.clock.advance_by(m.topo.health.probe_timeout);
  m.clock.run_ready();
  EXPECT_TRUE(m.engines.open("silent.engines", "/v1/models").empty());  // cut
  EXPECT_FALSE(m.state("silent").unchecked);
  EXPECT_EQ(m.limit_of("silent"), 4);
  EXPECT_EQ(m.state("silent").length_query, LengthQuery::kToAsk);
}

// An engine added while it still loads its model refuses its first probe (connection refused): it
// is not admitted, as with its limit it would take requests that fail until failures_to_eject. It
// is out of routing as an ejected engine (requests take another engine); a later passing probe
// readmits it and asks its model list, and that answer admits it. The topology's engines are not
// held: one failing its first probe keeps its limit until failures_to_eject.
TEST(HealthMonitor, AnEngineThatJoinsAndFailsItsFirstProbeIsAdmittedOnlyOnceAProbePasses) {
  Topology t = one_engine(Dialect::kVllm);
  t.decode.endpoints = {engine("a"), engine("b")};
  Monitor m(t);
  m.health.start();
  m.clock.run_ready();
  ASSERT_TRUE(m.engines.answer("a.engines", "/health", 503, ""));
  m.clock.run_ready();
  EXPECT_TRUE(m.state("a").healthy);  // one failure of the two that eject it
  EXPECT_EQ(m.limit_of("a"), 4);
  m.checked("b", 200, list_of("m", "vllm"));
  m.endpoints.drain(m.id_of("a"));

  m.join({"loading"});
  const auto probes = m.engines.open("loading.engines", "/health");
  ASSERT_EQ(probes.size(), 1u);
  const int before = m.changes;
  FakeEngines::finish(*probes[0], "connect: Connection refused");
  m.clock.run_ready();
  EXPECT_FALSE(m.state("loading").healthy);
  EXPECT_TRUE(m.state("loading").unchecked);
  EXPECT_GT(m.changes, before);  // the requests waiting for it are looked at again
  Choice c = m.choice();
  EXPECT_EQ(c.kind, Choice::Kind::kChosen);
  EXPECT_EQ(c.endpoint, m.id_of("b"));

  // Still loading at the next interval; then it answers.
  m.clock.advance_by(m.topo.health.probe_interval);
  m.clock.run_ready();
  ASSERT_TRUE(m.engines.answer("loading.engines", "/health", 503, ""));
  m.clock.run_ready();
  EXPECT_FALSE(m.state("loading").healthy);
  m.clock.advance_by(m.topo.health.probe_interval);
  m.clock.run_ready();
  ASSERT_TRUE(m.engines.answer("loading.engines", "/health", 200, ""));
  m.clock.run_ready();
  EXPECT_TRUE(m.state("loading").healthy);
  EXPECT_EQ(m.limit_of("loading"), 0);  // held until its list answered
  ASSERT_TRUE(m.engines.answer("loading.engines", "/v1/models", 200, list_of("m", "vllm")));
  m.clock.run_ready();
  EXPECT_FALSE(m.state("loading").unchecked);
  EXPECT_EQ(m.limit_of("loading"), 4);  // admitted, not readmitted: no slow start
}

// The lines of an engine that joined and failed its first probe say what happened and what the
// gateway does next, never that it was ejected: it took no request, so there is no failure to
// look for. How the probe failed is said (refused, an HTTP status, no answer in time); a later
// failed probe says nothing more; the probe that passes says how many failed before it; a model
// list naming another model leaves it not admitted, and no ejection is counted for it.
TEST(HealthMonitor, TheLinesOfAJoiningEngineWhoseFirstProbeFailedSayItIsNotAdmitted) {
  Monitor m(one_engine(Dialect::kVllm));
  m.started_with_checked("a");
  m.join({"loading", "silent"});

  ::testing::internal::CaptureStderr();
  const auto probes = m.engines.open("loading.engines", "/health");
  ASSERT_EQ(probes.size(), 1u);
  FakeEngines::finish(*probes[0], "connect: Connection refused");
  m.clock.run_ready();
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "tandem gateway: engine loading (loading.engines:8000) not admitted: its first health "
            "probe failed (connect: Connection refused); it takes no requests until a later probe "
            "passes (one every 2000 ms) and its model list has been asked\n");

  ::testing::internal::CaptureStderr();
  m.clock.advance_by(m.topo.health.probe_timeout);  // silent's probe is cut
  m.clock.run_ready();
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "tandem gateway: engine silent (silent.engines:8000) not admitted: its first health "
            "probe failed (no answer within health.probe_timeout_ms, 500 ms); it takes no "
            "requests until a later probe passes (one every 2000 ms) and its model list has been "
            "asked\n");

  // Its second failure reaches failures_to_eject (2): still not admitted, nothing more said.
  ::testing::internal::CaptureStderr();
  m.clock.advance_by(m.topo.health.probe_interval - m.topo.health.probe_timeout);
  m.clock.run_ready();
  ASSERT_TRUE(m.engines.answer("loading.engines", "/health", 503, ""));
  m.clock.run_ready();
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");

  ::testing::internal::CaptureStderr();
  m.clock.advance_by(m.topo.health.probe_interval);
  m.clock.run_ready();
  ASSERT_TRUE(m.engines.answer("loading.engines", "/health", 200, ""));
  m.clock.run_ready();
  ASSERT_TRUE(m.engines.answer("loading.engines", "/v1/models", 200, list_of("other", "vllm")));
  m.clock.run_ready();
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "tandem gateway: engine loading (loading.engines:8000) passed a health probe after 2 "
            "failed probes; its model list is asked before it takes requests\n"
            "tandem gateway: engine loading (loading.engines:8000) not admitted: its GET "
            "/v1/models lists 'other', not the gateway's served_model_name 'm' (each request "
            "would be refused as for an unknown model)\n");
  EXPECT_FALSE(m.state("loading").healthy);
  EXPECT_EQ(m.state("loading").ejections_total->value(), 0u);
}

// The 503 a client gets when no engine can serve counts an engine that joined and failed its
// probe apart from the ejected ones: it is new and failed no request, and "ejected after failing
// requests or health checks" sent an operator looking for a failing engine.
TEST(HealthMonitor, TheNoEngineAnswerCountsAJoiningEngineThatFailedItsProbeAsNotAdmitted) {
  Monitor m(one_engine(Dialect::kVllm));
  m.health.start();
  m.clock.run_ready();
  m.join({"loading"});
  ASSERT_TRUE(m.engines.answer("a.engines", "/health", 503, ""));
  ASSERT_TRUE(m.engines.answer("loading.engines", "/health", 503, ""));
  m.clock.run_ready();
  EXPECT_EQ(m.endpoints.pools_state({false}, m.clock.now()),
            "decode pool: 2 engines, 1 not admitted yet (new, its health probe failed; probed "
            "each interval), 1 over the policy's load limits (queued prefill work or free KV)");
  m.clock.advance_by(m.topo.health.probe_interval);
  m.clock.run_ready();
  ASSERT_TRUE(m.engines.answer("a.engines", "/health", 503, ""));  // a's second: ejected
  m.clock.run_ready();
  EXPECT_EQ(m.choice().kind, Choice::Kind::kNoneEligible);  // the dispatcher's 503
  EXPECT_EQ(m.endpoints.pools_state({false}, m.clock.now()),
            "decode pool: 2 engines, 1 ejected after failing requests or health checks, 1 not "
            "admitted yet (new, its health probe failed; probed each interval)");
}

// Slow start is for an engine coming back from an ejection (it may have restarted, cold). An
// engine that joined is admitted with its whole limit whether its first probe passed or failed
// (it used to ramp up from one request after a failed first probe, and not after a passing one).
TEST(HealthMonitor, AJoiningEngineAdmittedAfterAFailedProbeHasNoSlowStartAsAReadmittedOneHas) {
  Topology t = one_engine(Dialect::kVllm);
  t.health.slow_start = milliseconds(10000);
  t.health.probe_interval = milliseconds(60000);  // no probe while the ramp is looked at
  Monitor m(t);
  m.started_with_checked("a");
  m.join({"loading"});
  ASSERT_TRUE(m.engines.answer("loading.engines", "/health", 503, ""));
  m.clock.run_ready();
  for (int i = 0; i < m.topo.health.failures_to_eject; ++i) {  // a is ejected meanwhile
    m.clock.advance_by(m.topo.health.probe_interval);
    m.clock.run_ready();
    ASSERT_TRUE(m.engines.answer("a.engines", "/health", 503, ""));
    ASSERT_TRUE(m.engines.answer("loading.engines", "/health", 503, ""));
    m.clock.run_ready();
  }
  ASSERT_FALSE(m.state("a").healthy);
  m.clock.advance_by(m.topo.health.probe_interval);
  m.clock.run_ready();
  m.checked("loading", 200, list_of("m", "vllm"));
  ASSERT_TRUE(m.engines.answer("a.engines", "/health", 200, ""));
  m.clock.run_ready();
  EXPECT_FALSE(m.state("loading").unchecked);
  EXPECT_EQ(m.limit_of("loading"), 4);
  EXPECT_EQ(m.limit_of("a"), 1);  // readmitted: from one request ...
  m.clock.advance_by(milliseconds(5000));
  EXPECT_EQ(m.limit_of("a"), 2);  // ... to its limit over slow_start
  m.clock.advance_by(milliseconds(5000));
  EXPECT_EQ(m.limit_of("a"), 4);
  EXPECT_EQ(m.limit_of("loading"), 4);
}

// An ejected engine's counts stand still while it is down: the run of failures that ejected it
// (as its line says), and failures_total, which counts no probe of an engine out of routing (an
// alert on its rate fired for as long as an engine was simply down). Its failed probes are
// counted apart, and its readmission is counted. A leg that fails after the ejection (one in
// flight then) is a request's failure: counted in failures_total, not in the run.
TEST(HealthMonitor, AnEjectedEnginesFailedProbesAreCountedApartAndItsReadmissionIsCounted) {
  Topology t = one_engine(Dialect::kVllm);
  t.decode.endpoints = {engine("a"), engine("b")};
  Monitor m(t);
  m.started_with_checked("b");
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(m.engines.answer("a.engines", "/health", 503, ""));
  m.clock.run_ready();
  for (int i = 0; i < 4; ++i) {
    m.clock.advance_by(m.topo.health.probe_interval);
    m.clock.run_ready();
    ASSERT_TRUE(m.engines.answer("a.engines", "/health", 503, ""));
    ASSERT_TRUE(m.engines.answer("b.engines", "/health", 200, ""));
    m.clock.run_ready();
  }
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "tandem gateway: engine a (a.engines:8000) ejected after 2 failures in a row (the "
            "last: a failed health probe); a passing health probe readmits it\n");
  EXPECT_FALSE(m.state("a").healthy);
  json shown = m.endpoints.to_json(m.state("a"), m.clock.now());
  EXPECT_EQ(shown["consecutive_failures"], 2);
  EXPECT_EQ(shown["failed_probes_while_out"], 3);
  EXPECT_EQ(m.state("a").failures_total->value(), 2u);
  m.endpoints.failure(*m.endpoints.find(m.id_of("a")));  // a leg in flight at the ejection
  EXPECT_EQ(m.state("a").consecutive_failures, 2);
  EXPECT_EQ(m.state("a").failures_total->value(), 3u);

  m.clock.advance_by(m.topo.health.probe_interval);
  m.clock.run_ready();
  ASSERT_TRUE(m.engines.answer("a.engines", "/health", 200, ""));
  m.clock.run_ready();
  EXPECT_TRUE(m.state("a").healthy);
  shown = m.endpoints.to_json(m.state("a"), m.clock.now());
  EXPECT_EQ(shown["consecutive_failures"], 0);
  EXPECT_EQ(shown["failed_probes_while_out"], 0);
  EXPECT_EQ(m.state("a").ejections_total->value(), 1u);
  EXPECT_EQ(m.state("a").readmissions_total->value(), 1u);
  EXPECT_EQ(m.state("b").readmissions_total->value(), 0u);
  EXPECT_NE(m.registry.render().find("tandem:gateway_endpoint_readmissions_total{pool=\"decode\","
                                     "endpoint=\"a\"} 1"),
            std::string::npos);
}

// An engine that joined serving another model was never admitted: once it serves the gateway's
// model it is admitted (said so) with its whole limit, no readmission counted. It was said
// "readmitted" and ramped up by slow start. While it serves another model, the 503 of no engine
// says so, not that it failed requests or health checks.
TEST(HealthMonitor, AJoiningEngineThatServedAnotherModelIsAdmittedNotReadmittedOnceItServesIt) {
  Topology t = one_engine(Dialect::kVllm);
  t.health.slow_start = milliseconds(10000);
  Monitor m(t);
  m.started_with_checked("a");
  m.endpoints.drain(m.id_of("a"));
  m.join({"late"});
  ::testing::internal::CaptureStderr();
  m.checked("late", 200, list_of("other", "vllm"));
  EXPECT_FALSE(m.state("late").healthy);
  EXPECT_EQ(m.endpoints.pools_state({false}, m.clock.now()),
            "decode pool: 1 engine, 1 serving another model (their GET /v1/models lacks "
            "served_model_name)");

  m.clock.advance_by(m.topo.health.probe_interval);
  m.clock.run_ready();
  m.checked("late", 200, list_of("m", "vllm"));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "tandem gateway: engine late (late.engines:8000) not admitted: its GET /v1/models "
            "lists 'other', not the gateway's served_model_name 'm' (each request would be "
            "refused as for an unknown model)\n"
            "tandem gateway: engine late (late.engines:8000) admitted: it serves the model now\n");
  EXPECT_TRUE(m.state("late").healthy);
  EXPECT_EQ(m.limit_of("late"), 4);  // no slow start
  EXPECT_EQ(m.state("late").readmissions_total->value(), 0u);
  EXPECT_EQ(m.state("late").ejections_total->value(), 0u);

  // Admitted now: ejected by its probes, then for another model, it is readmitted each time.
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < m.topo.health.failures_to_eject; ++i) {
    m.clock.advance_by(m.topo.health.probe_interval);
    m.clock.run_ready();
    ASSERT_TRUE(m.engines.answer("late.engines", "/health", 503, ""));
    m.clock.run_ready();
  }
  m.clock.advance_by(m.topo.health.probe_interval);
  m.clock.run_ready();
  m.checked("late", 200, list_of("other", "vllm"));
  EXPECT_EQ(m.state("late").ejections_total->value(), 2u);
  m.clock.advance_by(m.topo.health.probe_interval);
  m.clock.run_ready();
  m.checked("late", 200, list_of("m", "vllm"));
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("late (late.engines:8000) ejected: its GET /v1/models lists 'other'"),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("late (late.engines:8000) readmitted: it serves the model now"),
            std::string::npos)
      << said;
  EXPECT_EQ(m.state("late").readmissions_total->value(), 2u);
  EXPECT_EQ(m.limit_of("late"), 1);  // readmitted: slow start
}

// An engine that joined serving another model and then died is down: the 503 of no engine
// counts it not admitted (its probes fail), as any engine whose probes fail, no longer as
// serving another model (alive), which sent an operator to its model list.
TEST(HealthMonitor, TheNoEngineAnswerCountsAnEngineThatServedAnotherModelAndDiedAsDown) {
  Monitor m(one_engine(Dialect::kVllm));
  m.started_with_checked("a");
  m.endpoints.drain(m.id_of("a"));
  m.join({"late"});
  ::testing::internal::CaptureStderr();
  m.checked("late", 200, list_of("other", "vllm"));
  m.clock.advance_by(m.topo.health.probe_interval);
  m.clock.run_ready();
  ASSERT_TRUE(m.engines.answer("late.engines", "/health", 503, ""));
  m.clock.run_ready();
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(m.endpoints.pools_state({false}, m.clock.now()),
            "decode pool: 1 engine, 1 not admitted yet (new, its health probe failed; probed "
            "each interval)");
}

// A reload that changes a pool's max_in_flight replaces each of its engines: one at the name and
// address of an engine that passed its checks is not held again, while a new engine is.
TEST(HealthMonitor, AnEngineAReloadReplacesWithNewSettingsIsNotHeldAgain) {
  Monitor m(one_engine(Dialect::kVllm));
  m.started_with_checked("a");
  Topology next = m.topo;
  next.decode.max_in_flight = 8;
  next.decode.endpoints = {engine("a"), engine("new")};
  const EndpointTable::ReloadResult r = m.endpoints.reload(next);
  EXPECT_EQ(r.added, 2);
  EXPECT_EQ(r.removed, 1);
  EXPECT_FALSE(m.state("a").unchecked);
  EXPECT_EQ(m.limit_of("a"), 8);
  EXPECT_TRUE(m.state("new").unchecked);
  EXPECT_EQ(m.limit_of("new"), 0);
}

}  // namespace
}  // namespace tandem::gateway
