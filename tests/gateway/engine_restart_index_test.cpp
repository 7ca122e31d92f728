// An engine that restarts loses its prefix cache; the gateway's prefix index must lose it too,
// or it routes prompts to a cache that no longer exists (a user's trial: a prefill engine killed
// and restarted by `tandem serve` within seconds was never ejected, and the next request went to
// it for 4000 "cached" tokens of which it delivered none). The gateway learns of a restart from
// the engine's load reports (its step count or step indices went back) and from a readmission
// after an ejection. Pure: the test plays the reports and probe results, and feeds the index as
// the engines' KV events would (api/block_hash.h's hashes, 16-token blocks).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "api/block_hash.h"
#include "api/load_report.h"
#include "gateway/endpoints.h"
#include "gateway/engine_load.h"
#include "gateway/gateway_metrics.h"
#include "gateway/prefix_index.h"
#include "util/metrics.h"

namespace tandem::gateway {
namespace {

Endpoint engine_named(const std::string& name, const std::string& kv_events = {}) {
  Endpoint e;
  e.name = name;
  e.host = name + ".engines";
  e.port = 8000;
  e.kv_events = kv_events;
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

// Two prefill engines and a decode engine (sequential P/D), whose KV events the test feeds.
class Gateway {
 public:
  explicit Gateway(const std::string& kv_events = {})
      : metrics(registry), table(topo, metrics, index) {
    topo.mode = PdMode::kSequential;
    a = table.add(true, engine_named("prefill-a", kv_events));
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

TEST(EngineRestartIndex, AnEngineEjectedAndReadmittedHasNoCachedPrefixes) {
  Gateway g;
  const auto ids = prompt(640);
  g.caches(g.a, ids);
  g.caches(g.b, ids);
  for (int i = 0; i < g.topo.health.failures_to_eject; ++i) g.table.probe_result(g.a, false, g.now);
  ASSERT_FALSE(g.table.find(g.a)->healthy);
  // A passing probe of an engine never ejected says nothing of a restart.
  g.table.probe_result(g.b, true, g.now);
  EXPECT_EQ(g.cached_tokens(g.b, ids), 640);

  EXPECT_TRUE(g.table.probe_result(g.a, true, g.now));  // readmitted: may be a new process
  EXPECT_EQ(g.cached_tokens(g.a, ids), 0);
  EXPECT_EQ(g.cached_tokens(g.b, ids), 640);
  // What the new process stores from now on is routed to again.
  g.caches(g.a, ids);
  EXPECT_EQ(g.cached_tokens(g.a, ids), 640);
}

// With a KV-event consumer (nothing publishes at its address, and it has no replay endpoint, so
// it writes nothing to the index itself): the restart clears what it had applied, and a new
// consumer follows the new process from its seq 0.
TEST(EngineRestartIndex, AnEngineWithAConsumerIsClearedOnARestartToo) {
  Gateway g("tcp://127.0.0.1:1");
  const auto ids = prompt(640);
  g.caches(g.a, ids);
  g.report(g.a, report_after(30));
  ASSERT_EQ(g.cached_tokens(g.a, ids), 640);
  g.report(g.a, report_after(1));
  EXPECT_EQ(g.cached_tokens(g.a, ids), 0);
  EXPECT_EQ(g.index.num_blocks(g.a), 0);
}

}  // namespace
}  // namespace tandem::gateway
