// An engine that restarts loses its prefix cache; the gateway's prefix index must lose it too,
// or it routes prompts to a cache that no longer exists (a user's trial: a prefill engine killed
// and restarted by `tandem serve` within seconds was never ejected, and the next request went to
// it for 4000 "cached" tokens of which it delivered none). The gateway learns of a restart from
// the engine's load reports (another process instance, or its step count or step indices went
// back), and for an engine without reports (vLLM, SGLang) from a readmission after an ejection;
// most ejections are no restart, and an engine that reports keeps its entries through them. The
// tests play the reports, leg and probe results, and feed the index as the engines' KV events
// would (api/block_hash.h's hashes, 16-token blocks); the last one follows a scripted publisher's
// stream on loopback.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "api/block_hash.h"
#include "api/load_report.h"
#include "engine/kv/kv_events.h"
#include "gateway/endpoints.h"
#include "gateway/engine_load.h"
#include "gateway/gateway_metrics.h"
#include "gateway/prefix_index.h"
#include "gateway/request.h"
#include "gateway/scripted_kv_publisher.h"
#include "util/bounded_wait.h"
#include "util/metrics.h"

namespace tandem::gateway {
namespace {

using testing::ScriptedPublisher;

Endpoint engine_named(const std::string& name, const std::string& kv_events = {},
                      const std::string& kv_events_replay = {}) {
  Endpoint e;
  e.name = name;
  e.host = name + ".engines";
  e.port = 8000;
  e.kv_events = kv_events;
  e.kv_events_replay = kv_events_replay;
  return e;
}

std::vector<int32_t> prompt(size_t n) {
  std::vector<int32_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>(1000 + i * 7 % 5000);
  return ids;
}

// A Tandem engine's report after `steps` steps, the last few of them listed.
LoadReport report_after(uint64_t steps) {
  LoadReport r;
  r.total_blocks = 1000;
  r.free_blocks = 900;
  r.block_size = 16;
  r.steps = steps;
  for (uint64_t i = steps > 3 ? steps - 2 : 1; i <= steps; ++i)
    r.recent_steps.push_back({i, 1, 256, 0.05});
  return r;
}

LoadAnswer answer_of(LoadReport report) {
  LoadAnswer a;
  a.kind = LoadAnswer::Kind::kReport;
  a.report = std::move(report);
  return a;
}

// Two prefill engines and a decode engine (sequential P/D), whose KV events the test feeds
// (prefill-a's come from its consumer when `kv_events` is given).
class Gateway {
 public:
  explicit Gateway(const std::string& kv_events = {}, const std::string& kv_events_replay = {})
      : metrics(registry), table(topo, metrics, index) {
    topo.mode = PdMode::kSequential;
    a = table.add(true, engine_named("prefill-a", kv_events, kv_events_replay));
    b = table.add(true, engine_named("prefill-b"));
    table.add(false, engine_named("decode-0"));
    if (kv_events.empty()) table.events_fed_externally(a);
    table.events_fed_externally(b);
  }

  // The engine stored the prompt's full blocks (as its BlockStored events say).
  void caches(int id, const std::vector<int32_t>& ids) {
    ASSERT_TRUE(index.add_blocks(id, api::block_hashes(ids, 16), ids, std::nullopt));
  }

  // The cached prefix of `ids` the scheduler sees for engine `id` (-1: unknown).
  int64_t cached_tokens(int id, const std::vector<int32_t>& ids) const {
    ClusterView view = table.view(now, nullptr);
    table.fill_cached_tokens(view, ids);
    for (const auto& e : view.prefill)
      if (e.id == id) return e.cached_tokens;
    return -2;
  }

  bool report(int id, LoadReport r) {
    return table.load_result(id, {}, answer_of(std::move(r)), now);
  }

  // Ejected by failed legs (e.g. the three legs of one failed step), then readmitted by a passing
  // probe; returns whether it was readmitted.
  bool eject_by_failed_legs_and_readmit(int id) {
    for (int i = 0; i < topo.health.failures_to_eject; ++i) {
      Leg leg;
      leg.endpoint = id;
      leg.prefill = true;
      leg.started = now;
      table.leg_started(*table.find(id), leg);
      table.leg_finished(leg, LegOutcome::kFailed);
    }
    if (table.find(id)->healthy) return false;
    return table.probe_result(id, true, now);
  }

  Topology topo;
  PrefixIndex index;
  metrics::Registry registry;
  GatewayMetrics metrics;
  EndpointTable table;
  Clock::time_point now = Clock::time_point{} + std::chrono::hours(1);
  int a = -1, b = -1;
};

TEST(EngineRestartIndex, AReportWhoseStepCountWentBackDropsTheEnginesCachedPrefixes) {
  Gateway g;
  const auto ids = prompt(4000);
  g.caches(g.a, ids);
  g.caches(g.b, ids);
  g.report(g.a, report_after(120));
  g.report(g.b, report_after(80));
  ASSERT_EQ(g.cached_tokens(g.a, ids), 4000);

  // Killed and restarted between two polls: the new process has run no step yet, so its report
  // lists none, but its step count starts again.
  g.report(g.a, report_after(0));
  EXPECT_EQ(g.cached_tokens(g.a, ids), 0);
  EXPECT_EQ(g.index.num_blocks(g.a), 0);
  // The other engine's cache is untouched.
  EXPECT_EQ(g.cached_tokens(g.b, ids), 4000);
}

TEST(EngineRestartIndex, AReportWhoseStepIndicesWentBackDropsTheEnginesCachedPrefixes) {
  Gateway g;
  const auto ids = prompt(640);
  g.caches(g.a, ids);
  // An engine that does not count its steps (steps 0 throughout) still numbers them.
  LoadReport before = report_after(50), after = report_after(4);
  before.steps = after.steps = 0;
  g.report(g.a, before);
  ASSERT_EQ(g.cached_tokens(g.a, ids), 640);
  g.report(g.a, after);
  EXPECT_EQ(g.cached_tokens(g.a, ids), 0);
}

TEST(EngineRestartIndex, ReportsOfTheSameProcessKeepTheEnginesCachedPrefixes) {
  Gateway g;
  const auto ids = prompt(640);
  g.caches(g.a, ids);
  g.report(g.a, report_after(50));
  g.report(g.a, report_after(50));  // idle between two polls
  g.report(g.a, report_after(53));
  LoadReport quiet = report_after(53);
  quiet.recent_steps.clear();  // a poll that asked only for steps it has not seen
  g.report(g.a, quiet);
  EXPECT_EQ(g.cached_tokens(g.a, ids), 640);
}

// A Tandem engine names its process in each report (`instance`): a restart shows even when the
// new process has run more steps than the old one had by the next poll (a slow poll, a busy
// engine), where its steps only went up.
TEST(EngineRestartIndex, AReportOfAnotherInstanceDropsTheEnginesCachedPrefixes) {
  Gateway g;
  const auto ids = prompt(640);
  g.caches(g.a, ids);
  g.caches(g.b, ids);
  LoadReport before = report_after(50), after = report_after(80);
  before.instance = "9f3c0a1b2c3d4e5f";
  after.instance = "0123456789abcdef";
  g.report(g.a, before);
  g.report(g.b, before);
  ASSERT_EQ(g.cached_tokens(g.a, ids), 640);
  g.report(g.a, after);
  EXPECT_EQ(g.cached_tokens(g.a, ids), 0);
  EXPECT_EQ(g.index.num_blocks(g.a), 0);
  EXPECT_EQ(g.cached_tokens(g.b, ids), 640);
}

TEST(EngineRestartIndex, ReportsOfTheSameInstanceKeepTheEnginesCachedPrefixes) {
  Gateway g;
  const auto ids = prompt(640);
  g.caches(g.a, ids);
  for (uint64_t steps : {50, 50, 53, 400}) {
    LoadReport r = report_after(steps);
    r.instance = "9f3c0a1b2c3d4e5f";
    g.report(g.a, r);
  }
  EXPECT_EQ(g.cached_tokens(g.a, ids), 640);
}

// An engine that names no instance (an older Tandem, another server) is judged by its steps
// alone: going up is the same process, going back a restart.
TEST(EngineRestartIndex, WithoutAnInstanceOnlyStepsThatWentBackShowARestart) {
  Gateway g;
  const auto ids = prompt(640);
  g.caches(g.a, ids);
  g.report(g.a, report_after(50));
  g.report(g.a, report_after(80));
  EXPECT_EQ(g.cached_tokens(g.a, ids), 640);
  g.report(g.a, report_after(3));
  EXPECT_EQ(g.cached_tokens(g.a, ids), 0);
}

// Most ejections are no restart (one failed step's legs, probes timed out in a pause): an engine
// whose load reports would show a restart keeps its cached prefixes when it is readmitted.
TEST(EngineRestartIndex, AReportingEngineReadmittedAfterFailedLegsKeepsItsCachedPrefixes) {
  Gateway g("tcp://127.0.0.1:1");  // its entries are its consumer's, rebuilt if it were reset
  const auto ids = prompt(640);
  g.report(g.a, report_after(120));
  g.caches(g.a, ids);
  ASSERT_TRUE(g.eject_by_failed_legs_and_readmit(g.a));
  EXPECT_EQ(g.cached_tokens(g.a, ids), 640);
  EXPECT_EQ(g.index.num_blocks(g.a), 40);
  // Its next report of the same process keeps them; one whose steps went back drops them.
  g.report(g.a, report_after(121));
  EXPECT_EQ(g.cached_tokens(g.a, ids), 640);
  g.report(g.a, report_after(0));
  EXPECT_EQ(g.cached_tokens(g.a, ids), 0);
}

// The simulator's engines never restart (a killed one never comes back), and nothing would
// announce their cache again: a readmission keeps it.
TEST(EngineRestartIndex, AnEngineFedExternallyKeepsItsCachedPrefixesWhenReadmitted) {
  Gateway g;
  const auto ids = prompt(640);
  g.caches(g.a, ids);
  g.caches(g.b, ids);
  for (int i = 0; i < g.topo.health.failures_to_eject; ++i) g.table.probe_result(g.a, false, g.now);
  ASSERT_FALSE(g.table.find(g.a)->healthy);
  EXPECT_TRUE(g.table.probe_result(g.a, true, g.now));
  EXPECT_EQ(g.cached_tokens(g.a, ids), 640);
  EXPECT_EQ(g.cached_tokens(g.b, ids), 640);
}

// An engine without load reports (vLLM, SGLang) has no other sign of a restart: its readmission
// after an ejection is taken as one; a passing probe of an engine never ejected is not.
TEST(EngineRestartIndex, AnEngineWithoutLoadReportsReadmittedHasNoCachedPrefixes) {
  Gateway g("tcp://127.0.0.1:1");
  LoadAnswer no_report;
  no_report.kind = LoadAnswer::Kind::kNoReport;
  no_report.why = "404";
  g.table.load_result(g.a, {}, no_report, g.now);
  ASSERT_EQ(g.table.find(g.a)->load_source, LoadSource::kOwnCounts);
  const auto ids = prompt(640);
  g.caches(g.a, ids);
  g.table.probe_result(g.a, true, g.now);
  EXPECT_EQ(g.cached_tokens(g.a, ids), 640);

  ASSERT_TRUE(g.eject_by_failed_legs_and_readmit(g.a));
  EXPECT_EQ(g.cached_tokens(g.a, ids), 0);
  EXPECT_EQ(g.index.num_blocks(g.a), 0);
  // What the new process stores from now on is routed to again.
  g.caches(g.a, ids);
  EXPECT_EQ(g.cached_tokens(g.a, ids), 640);
}

// With load polling off (load_interval 0) no report would ever show a restart: a Tandem engine's
// readmission is taken as one, as an engine's without reports is.
TEST(EngineRestartIndex, WithLoadPollingOffAReadmittedEngineHasNoCachedPrefixes) {
  Gateway g("tcp://127.0.0.1:1");
  g.topo.scheduling.load_interval = std::chrono::milliseconds(0);
  const auto ids = prompt(640);
  g.caches(g.a, ids);
  g.table.find(g.a)->dialect = Dialect::kTandem;  // whose reports would be polled, were polling on
  g.table.find(g.a)->load_source = LoadSource::kReports;
  ASSERT_TRUE(g.eject_by_failed_legs_and_readmit(g.a));
  EXPECT_EQ(g.cached_tokens(g.a, ids), 0);
}

// A Tandem engine that reported before and was ejected: a readmission leaves its prefixes to its
// next report. Where that answer says another server (vLLM, SGLang) now serves the address, the
// old engine's prefixes go.
TEST(EngineRestartIndex, AnAutoEngineWhoseAddressNoLongerReportsHasNoCachedPrefixes) {
  Gateway g("tcp://127.0.0.1:1");
  g.table.find(g.a)->dialect = Dialect::kAuto;
  g.table.find(g.a)->load_source = LoadSource::kAsking;
  g.report(g.a, report_after(120));
  const auto ids = prompt(640);
  g.caches(g.a, ids);
  ASSERT_TRUE(g.eject_by_failed_legs_and_readmit(g.a));
  ASSERT_EQ(g.cached_tokens(g.a, ids), 640);
  LoadAnswer no_report;
  no_report.kind = LoadAnswer::Kind::kNoReport;
  no_report.why = "404";
  g.table.load_result(g.a, {}, no_report, g.now);
  EXPECT_EQ(g.cached_tokens(g.a, ids), 0);
}

// An engine added at the name and address of one that left has none of the old one's prefixes:
// they were its id's, and left with it. Where its first probe failed, what its consumer took
// before (from whatever answered there, the old process still running as it joined, say) may
// be gone with a restart: its first passing probe drops it. One whose first probe passes keeps
// what its consumer took: nothing says the process changed.
TEST(EngineRestartIndex, AnEngineThatJoinsAtALeftEnginesAddressHasNoneOfItsCachedPrefixes) {
  Gateway g("tcp://127.0.0.1:1");
  g.table.check_joining_engines([](int) {});
  const auto ids = prompt(640);
  g.caches(g.a, ids);
  ASSERT_TRUE(g.table.drain(g.a));
  const int again = g.table.add(true, engine_named("prefill-a", "tcp://127.0.0.1:1"));
  ASSERT_NE(again, g.a);
  EXPECT_EQ(g.cached_tokens(again, ids), 0);
  EXPECT_EQ(g.index.num_blocks(g.a), 0);

  g.caches(again, ids);
  EXPECT_TRUE(g.table.probe_result(again, false, g.now, "connect: Connection refused"));
  EXPECT_TRUE(g.table.probe_result(again, true, g.now));
  EXPECT_EQ(g.cached_tokens(again, ids), 0);

  const int fresh = g.table.add(true, engine_named("prefill-c", "tcp://127.0.0.1:1"));
  g.caches(fresh, ids);
  EXPECT_FALSE(g.table.probe_result(fresh, true, g.now));
  EXPECT_EQ(g.cached_tokens(fresh, ids), 640);
}

std::vector<int32_t> chain_tokens(int32_t base, int n) {
  std::vector<int32_t> t;
  for (int k = 0; k < n; ++k) {
    t.push_back(base + 10 * k);
    t.push_back(base + 10 * k + 1);
  }
  return t;
}

// The batch that stores block k of a chain of 2-token blocks [base + 10k, base + 10k + 1], hashed
// as a Tandem engine hashes them.
std::string chain_block(int32_t base, int k) {
  const std::vector<uint64_t> hashes = api::block_hashes(chain_tokens(base, k + 1), 2);
  engine::BlockStored s;
  s.block_hashes = {hashes[k]};
  if (k > 0) s.parent_block_hash = hashes[k - 1];
  s.token_ids = {base + 10 * k, base + 10 * k + 1};
  s.block_size = 2;
  return engine::encode_kv_event_batch({1.0, {s}, {}});
}

// What the consumer is rebuilt for: the new process publishes no event until its first request,
// and its first seqs (0..6) are no lower than the old stream's last (5), so the old consumer
// cannot see the restart in them; its batches 0..5 are past, only in its replay buffer. After the
// report that shows the restart, the engine's entries are the new stream's, from seq 0.
TEST(EngineRestartIndex, AfterARestartReportTheNewProcesssStreamIsFollowedFromSeqZero) {
  ScriptedPublisher engine;
  const int32_t old_base = 0, new_base = 1000;
  for (int k = 0; k < 6; ++k) engine.publish(k, chain_block(old_base, k), /*live=*/false);
  Gateway g(engine.endpoint(), engine.replay_endpoint());
  g.report(g.a, report_after(30));
  // The consumer's thread writes the index.
  testing::repeat_until([&] { return g.index.match_depth(g.a, chain_tokens(old_base, 6)) == 6; },
                        testing::kHangGuard, "the old stream's blocks in the index");

  engine.forget_history();  // the new process: its replay buffer starts empty
  for (int k = 0; k < 6; ++k) engine.publish(k, chain_block(new_base, k), /*live=*/false);
  engine.publish(6, chain_block(new_base, 6));
  g.report(g.a, report_after(1));
  testing::repeat_until([&] { return g.index.match_depth(g.a, chain_tokens(new_base, 7)) == 7; },
                        testing::kHangGuard, "the new stream's blocks in the index");
  EXPECT_EQ(g.index.match_depth(g.a, chain_tokens(old_base, 6)), 0);
}

}  // namespace
}  // namespace tandem::gateway
