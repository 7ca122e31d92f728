// Unit tests of the gateway's scheduling policies (src/gateway/policy.h, src/gateway/policies/):
// the prefill queue order and its starvation bound, the learned batch-time estimator, SGLang's
// prefix tree, each baseline's published rule on hand-built clusters, and the tandem policy's
// cache preference, overload avoidance, miss spreading and decode group constraint. All pure:
// time is passed in, nothing sleeps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <vector>

#include "api/load_report.h"
#include "api/prefill_work.h"
#include "gateway/endpoints.h"
#include "gateway/gateway_metrics.h"
#include "gateway/policy.h"
#include "gateway/prefix_index.h"
#include "gateway/request.h"
#include "gateway/topology.h"
#include "util/error.h"
#include "util/metrics.h"

namespace tandem::gateway {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

const Clock::time_point t0 = Clock::time_point(seconds(1000));

EndpointLoad ep(int id, int group = 0, int64_t in_flight = 0, int64_t max_in_flight = 8) {
  EndpointLoad e;
  e.id = id;
  e.group = group;
  e.in_flight = in_flight;
  e.max_in_flight = max_in_flight;
  return e;
}

RequestInfo req(int64_t prompt_tokens) {
  RequestInfo r;
  r.prompt_tokens = prompt_tokens;
  r.arrived = t0;
  return r;
}

// ------------------------------------------------------------------------------ queue order

TEST(QueueOrder, ShortPromptsFirstWhenWaitsAreEqual) {
  const std::vector<QueuedRequest> q = {{4000, t0}, {100, t0}, {2000, t0}};
  EXPECT_EQ(order(q, t0 + milliseconds(10), {}), (std::vector<size_t>{1, 2, 0}));
}

TEST(QueueOrder, ScoreIsOmniProxysFormula) {
  // max_prompt 1000, max_wait 200 ms: length 0.9, wait 0.5 -> 0.8 * 0.9 + 0.2 * 0.5.
  const QueuedRequest r{100, t0};
  EXPECT_NEAR(queue_score(r, t0 + milliseconds(100), 1000, milliseconds(200), {}), 0.82, 1e-12);
  // The wait is normalised by at least min_wait_norm (50 ms).
  EXPECT_NEAR(queue_score(r, t0 + milliseconds(10), 1000, milliseconds(10), {}),
              0.8 * 0.9 + 0.2 * 0.2, 1e-12);
}

TEST(QueueOrder, LongWaitOvertakesAShorterPrompt) {
  // A 1000-token request waiting 1 s against a 900-token one that just arrived: length terms
  // 0 and 0.1 (0.08 weighted), wait terms 1 and 0 (0.2 weighted).
  const std::vector<QueuedRequest> q = {{900, t0 + seconds(1)}, {1000, t0}};
  EXPECT_EQ(order(q, t0 + seconds(1), {}), (std::vector<size_t>{1, 0}));
}

TEST(QueueOrder, WeightsAreConfigurable) {
  const std::vector<QueuedRequest> q = {{100, t0 + milliseconds(900)}, {1000, t0}};
  QueueWeights fifo;
  fifo.length_weight = 0;
  fifo.wait_weight = 1;
  EXPECT_EQ(order(q, t0 + seconds(1), fifo), (std::vector<size_t>{1, 0}));
  QueueWeights sjf;
  sjf.length_weight = 1;
  sjf.wait_weight = 0;
  EXPECT_EQ(order(q, t0 + seconds(1), sjf), (std::vector<size_t>{0, 1}));
}

TEST(QueueOrder, TiesGoInArrivalOrder) {
  const std::vector<QueuedRequest> q = {{500, t0 + milliseconds(5)}, {500, t0}, {500, t0}};
  QueueWeights w;
  w.wait_weight = 0;
  EXPECT_EQ(order(q, t0 + milliseconds(10), w), (std::vector<size_t>{1, 2, 0}));
}

TEST(QueueOrder, StarvingRequestsGoFirstInArrivalOrder) {
  QueueWeights w;
  w.starvation_after = seconds(2);
  const auto now = t0 + seconds(10);
  const std::vector<QueuedRequest> q = {
      {10, now},                         // tiny and fresh: best score
      {90000, t0 + seconds(7)},          // starving, arrived second
      {80000, t0 + seconds(5)},          // starving, arrived first
      {5000, now - milliseconds(100)}};  // not starving, longer than the first
  EXPECT_EQ(order(q, now, w), (std::vector<size_t>{2, 1, 0, 3}));
}

// The bound: simulate a stream of short requests that would overtake a long one forever under the
// pure score; with the bound, the long one goes first within starvation_after of its arrival
// (plus one dispatch step).
TEST(QueueOrder, StarvationBoundsHowLongARequestIsOvertaken) {
  auto run = [](std::chrono::nanoseconds starvation_after) {
    QueueWeights w;
    w.wait_weight = 0.01;  // wait barely counts: short prompts always win on score
    w.starvation_after = starvation_after;
    std::vector<QueuedRequest> q = {{100000, t0}};
    std::vector<int> ids = {0};  // 0 is the long request
    int next_id = 1;
    for (int step = 0; step < 100; ++step) {  // every 100 ms: two short arrivals, one dispatch
      const auto now = t0 + milliseconds(100 * step);
      for (int k = 0; k < 2; ++k) {
        q.push_back({100, now});
        ids.push_back(next_id++);
      }
      const size_t first = order(q, now, w).front();
      if (ids[first] == 0) return now - t0;
      q.erase(q.begin() + static_cast<std::ptrdiff_t>(first));
      ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(first));
    }
    return Clock::duration::max();
  };
  EXPECT_EQ(run(std::chrono::nanoseconds(0)), Clock::duration::max());  // starves without it
  const auto waited = run(seconds(2));
  EXPECT_GE(waited, seconds(2));
  EXPECT_LE(waited, seconds(2) + milliseconds(100));
}

// Priority classes: the class goes first, the score orders within a class, and each class's own
// bound lets a waiting request of any class go before every newer one.
TEST(QueueOrder, AHigherClassGoesFirstWhateverTheScore) {
  const auto now = t0 + seconds(1);
  const std::vector<QueuedRequest> q = {
      {10, now, 1, seconds(30)},                      // batch, tiny: the best score
      {50000, t0, 0, seconds(5)},                     // interactive, long
      {100, now, 0, seconds(5)},                      // interactive, short
      {20, now - milliseconds(10), 1, seconds(30)}};  // batch, waited longer: ahead of the other
  EXPECT_EQ(order(q, now, {}), (std::vector<size_t>{2, 1, 3, 0}));
}

TEST(QueueOrder, EachClassHasItsOwnStarvationBound) {
  // A batch request waiting past its 30 s bound goes before fresh interactive ones; one waiting
  // 20 s does not. An interactive request past its 1 s bound goes first too, in arrival order.
  const auto now = t0 + seconds(40);
  std::vector<QueuedRequest> q = {{100, now, 0, seconds(1)},
                                  {9000, t0 + seconds(9), 1, seconds(30)},
                                  {9000, t0 + seconds(20), 1, seconds(30)}};
  EXPECT_EQ(order(q, now, {}), (std::vector<size_t>{1, 0, 2}));
  q.push_back({50, now - seconds(2), 0, seconds(1)});
  EXPECT_EQ(order(q, now, {}), (std::vector<size_t>{1, 3, 0, 2}));
}

// The bound as a property: under a stream of interactive arrivals that always outrank it, a batch
// request is offered first within its class's bound (plus one dispatch step), and never without it.
TEST(QueueOrder, ABatchRequestUnderInteractiveLoadWaitsAtMostItsBound) {
  auto run = [](std::chrono::nanoseconds batch_bound) {
    std::vector<QueuedRequest> q = {{100, t0, 1, batch_bound}};
    std::vector<int> ids = {0};  // 0 is the batch request
    int next_id = 1;
    for (int step = 0; step < 600; ++step) {  // every 100 ms: two interactive arrivals, one start
      const auto now = t0 + milliseconds(100 * step);
      for (int k = 0; k < 2; ++k) {
        q.push_back({100, now, 0, seconds(3600)});
        ids.push_back(next_id++);
      }
      const size_t first = order(q, now, {}).front();
      if (ids[first] == 0) return now - t0;
      q.erase(q.begin() + static_cast<std::ptrdiff_t>(first));
      ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(first));
    }
    return Clock::duration::max();
  };
  for (auto bound : {seconds(2), seconds(10), seconds(45)}) {
    const auto waited = run(bound);
    EXPECT_GE(waited, bound);
    EXPECT_LE(waited, bound + milliseconds(100));
  }
  EXPECT_EQ(run(seconds(3600)), Clock::duration::max());  // a bound past the run: it starves
}

// ------------------------------------------------------------------------------ batch times

TEST(BatchTime, UsesThePriorWithoutObservations) {
  BatchTimeEstimator e;
  EXPECT_DOUBLE_EQ(estimate_batch_s(e, 1, 1000), 0.020 + 5e-5 * 1000);
  EXPECT_DOUBLE_EQ(estimate_batch_s(e, 1, 0), 0.0);
}

TEST(BatchTime, IgnoresInvalidObservations) {
  BatchTimeEstimator e;
  e = observe(e, 1, 0, 0.1);
  e = observe(e, 0, 100, 0.1);
  e = observe(e, 1, 100, -1);
  e = observe(e, 1, 100, std::nan(""));
  EXPECT_EQ(e.observations, 0);
}

// Synthetic engine: 15 ms + 40 us per token + 6 us per sequence, with +-10% noise from a fixed
// generator. The estimate converges to the truth between and at the buckets.
TEST(BatchTime, ConvergesOnSyntheticObservations) {
  auto truth = [](int64_t seqs, int64_t tokens) {
    return 0.015 + 4e-5 * static_cast<double>(tokens) + 6e-6 * static_cast<double>(seqs);
  };
  uint64_t state = 42;
  auto uniform = [&] {  // [0, 1)
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<double>(state >> 11) / 9007199254740992.0;
  };
  BatchTimeEstimator e;
  for (int i = 0; i < 20000; ++i) {
    const int64_t seqs = 1 + static_cast<int64_t>(uniform() * 16);
    const int64_t tokens = seqs * (16 + static_cast<int64_t>(uniform() * 1000));
    e = observe(e, seqs, tokens, truth(seqs, tokens) * (0.9 + 0.2 * uniform()));
  }
  for (const int64_t seqs : {1, 4, 12})
    for (const int64_t tokens : {300, 1000, 3000, 8000}) {
      if (tokens < seqs * 16 || tokens > seqs * 1016) continue;  // never observed
      EXPECT_NEAR(estimate_batch_s(e, seqs, tokens), truth(seqs, tokens),
                  0.05 * truth(seqs, tokens))
          << seqs << " seqs, " << tokens << " tokens";
    }
}

TEST(BatchTime, FollowsAnEngineThatSlowsDown) {
  BatchTimeEstimator e;
  for (int i = 0; i < 200; ++i) e = observe(e, 1, 1000, 0.1);
  EXPECT_NEAR(estimate_batch_s(e, 1, 1000), 0.1, 1e-9);
  for (int i = 0; i < 400; ++i) e = observe(e, 1, 1000, 0.2);  // window 64: forgets the past
  EXPECT_NEAR(estimate_batch_s(e, 1, 1000), 0.2, 0.002);
}

TEST(BatchTime, InterpolatesAndExtrapolatesWithoutGoingNegative) {
  BatchTimeEstimator e;
  for (int i = 0; i < 10; ++i) {
    e = observe(e, 1, 1000, 0.1);
    e = observe(e, 1, 4000, 0.4);
  }
  EXPECT_NEAR(estimate_batch_s(e, 1, 2500), 0.25, 1e-9);
  EXPECT_NEAR(estimate_batch_s(e, 1, 8000), 0.8, 1e-9);
  EXPECT_NEAR(estimate_batch_s(e, 1, 500), 0.05, 1e-9);
  EXPECT_NEAR(estimate_batch_s(e, 7, 2500), 0.25, 1e-9);  // empty row: the pooled one
  // Work beyond one batch runs in batches of the chunk budget.
  EXPECT_NEAR(estimate_work_s(e, 9000, 4000), 2 * 0.4 + 0.1, 1e-9);
  EXPECT_NEAR(time_until_free_s(e, 1, 4000, 0.3), 0.1, 1e-9);
  EXPECT_EQ(time_until_free_s(e, 1, 4000, 1.0), 0.0);
}

// ------------------------------------------------------------------------------ prefix tree

std::vector<int32_t> ids(std::initializer_list<int32_t> v) {
  return v;
}

TEST(PrefixTree, MatchesPerTenantIncludingPartialEdges) {
  PrefixTree t;
  t.insert(ids({1, 2, 3, 4, 5}), 7, 10);
  t.insert(ids({1, 2, 3, 9}), 8, 20);
  EXPECT_EQ(t.match(ids({1, 2, 3, 4, 6})), (std::map<int, int64_t>{{7, 4}, {8, 3}}));
  EXPECT_EQ(t.match(ids({1, 2})), (std::map<int, int64_t>{{7, 2}, {8, 2}}));
  EXPECT_TRUE(t.match(ids({5})).empty());
  EXPECT_EQ(t.size(7), 5);
  EXPECT_EQ(t.size(8), 4);
  EXPECT_EQ(t.node_count(), 3);  // [1 2 3], [4 5], [9]
}

TEST(PrefixTree, EvictsLeastRecentlyUsedLeavesPerTenant) {
  PrefixTree t;
  t.insert(ids({1, 2, 3, 4}), 7, 10);  // old
  t.insert(ids({1, 2, 5, 6}), 7, 20);  // newer
  t.insert(ids({1, 2, 3, 4}), 8, 30);  // another tenant shares the old path
  t.evict(4);                          // tenant 7 holds 6 tokens: drop its oldest leaf [3 4]
  EXPECT_EQ(t.size(7), 4);
  EXPECT_EQ(t.match(ids({1, 2, 3, 4})), (std::map<int, int64_t>{{7, 2}, {8, 4}}));
  EXPECT_EQ(t.match(ids({1, 2, 5, 6}))[7], 4);
  EXPECT_EQ(t.size(8), 4);  // untouched: under the limit
  t.evict(0);
  EXPECT_EQ(t.size(7), 0);
  EXPECT_EQ(t.size(8), 0);
  EXPECT_EQ(t.node_count(), 0);
}

TEST(PrefixTree, RemovesATenant) {
  PrefixTree t;
  t.insert(ids({1, 2, 3}), 1, 1);
  t.insert(ids({1, 2, 4}), 2, 2);
  t.remove_tenant(1);
  EXPECT_EQ(t.match(ids({1, 2, 3})), (std::map<int, int64_t>{{2, 2}}));
  EXPECT_EQ(t.size(1), 0);
  EXPECT_EQ(t.node_count(), 2);
}

// ------------------------------------------------------------------------------ factory

TEST(MakePolicy, KnowsEveryNameAndNamesThemOnError) {
  for (const auto& name : policy_names()) EXPECT_EQ(make_policy(name)->name(), name);
  EXPECT_EQ(policy_names().front(), "tandem");
  try {
    make_policy("fastest");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'fastest'"), std::string::npos) << m;
    for (const auto& name : policy_names()) EXPECT_NE(m.find(name), std::string::npos) << m;
  }
}

// The registry hands each policy its own options (the topology's scheduling.cache_aware and
// scheduling.kv_router sections): the same view decides differently with other options.
TEST(MakePolicy, PassesEachPolicyItsOptions) {
  ClusterView v;
  v.prefill = {ep(0), ep(1)};
  v.prefill[0].cached_tokens = 128;
  v.prefill[0].tokens_in_flight = 32;  // two more decode blocks
  EXPECT_EQ(make_policy("kv_router")->choose_prefill(v, req(128), t0).endpoint, 0);
  PolicyOptions pure_load;
  pure_load.kv_router.overlap_score_weight = 0;
  EXPECT_EQ(make_policy("kv_router", pure_load)->choose_prefill(v, req(128), t0).endpoint, 1);
}

// A readmitted engine's share grows from one request to its whole limit over the ramp.
TEST(SlowStart, AReadmittedEnginesLimitRampsFromOneToItsWhole) {
  using std::chrono::seconds;
  EXPECT_EQ(ramped_in_flight_limit(256, seconds(0), seconds(10)), 1);
  EXPECT_EQ(ramped_in_flight_limit(256, seconds(5), seconds(10)), 128);
  EXPECT_EQ(ramped_in_flight_limit(256, seconds(10), seconds(10)), 256);
  EXPECT_EQ(ramped_in_flight_limit(256, seconds(600), seconds(10)), 256);
  EXPECT_EQ(ramped_in_flight_limit(256, seconds(0), seconds(0)), 256);  // no ramp
  EXPECT_EQ(ramped_in_flight_limit(1, seconds(0), seconds(10)), 1);
  int64_t previous = 0;
  for (int ms = 0; ms <= 10000; ms += 250) {
    const int64_t l = ramped_in_flight_limit(64, std::chrono::milliseconds(ms), seconds(10));
    EXPECT_GE(l, previous) << ms;  // never shrinks while it ramps
    EXPECT_GE(l, 1);
    EXPECT_LE(l, 64);
    previous = l;
  }
}

// ------------------------------------------------------------------------------ round_robin

TEST(RoundRobin, CyclesThroughEnginesAndSkipsSaturatedOnes) {
  const auto p = make_policy("round_robin");
  PolicyState state;
  ClusterView v;
  v.prefill = {ep(3), ep(1), ep(2, 0, 8, 8) /* saturated */, ep(5)};
  v.state = &state;
  std::vector<int> chosen;
  for (int i = 0; i < 5; ++i) {
    const Choice c = p->choose_prefill(v, req(10), t0);
    ASSERT_EQ(c.kind, Choice::Kind::kChosen);
    chosen.push_back(c.endpoint);
    p->record(state, req(10), c.endpoint, -1, t0);
  }
  EXPECT_EQ(chosen, (std::vector<int>{1, 3, 5, 1, 3}));
}

TEST(RoundRobin, DecodeStaysInTheGroup) {
  const auto p = make_policy("round_robin");
  PolicyState state;
  ClusterView v;
  v.decode = {ep(10, 0), ep(11, 1), ep(12, 0), ep(13, 1)};
  v.state = &state;
  for (const int expected : {11, 13, 11}) {
    const Choice c = p->choose_decode(v, req(10), 1, t0);
    EXPECT_EQ(c.endpoint, expected);
    p->record(state, req(10), -1, c.endpoint, t0);
  }
}

// ------------------------------------------------------------------------------ outcomes

// Policy::outcome (nginx's free_peer): a failed pick makes the engine second choice for
// failure_memory; a success clears it.
TEST(PickOutcomes, AFailureIsRememberedForFailureMemoryAndClearedBySuccess) {
  const auto p = make_policy("least_load");
  PolicyState state;
  state.failure_memory = seconds(10);
  p->outcome(state, 1, false, t0);
  EXPECT_TRUE(recently_failed(state, 1, t0 + seconds(9)));
  EXPECT_FALSE(recently_failed(state, 1, t0 + seconds(10)));
  EXPECT_FALSE(recently_failed(state, 2, t0));
  p->outcome(state, 1, true, t0 + seconds(1));
  EXPECT_FALSE(recently_failed(state, 1, t0 + seconds(2)));
}

ClusterView recently_failed_view(std::vector<EndpointLoad> pool) {
  ClusterView v;
  v.prefill = pool;
  v.decode = pool;
  return v;
}

TEST(PickOutcomes, EveryPolicyAvoidsARecentlyFailedEngineWhileAnotherIsFree) {
  EndpointLoad failed = ep(1), sound = ep(2, 0, 3);  // the sound one is busier
  failed.recently_failed = true;
  for (const std::string& name : policy_names()) {
    const auto p = make_policy(name);
    const ClusterView v = recently_failed_view({failed, sound});
    EXPECT_EQ(p->choose_prefill(v, req(10), t0).endpoint, 2) << name;
    EXPECT_EQ(p->choose_decode(v, req(10), -1, t0).endpoint, 2) << name;
    EXPECT_EQ(p->choose_together(v, req(10), t0).prefill, 2) << name;
  }
}

TEST(PickOutcomes, ARecentlyFailedEngineStillServesWhenNoOtherIsFree) {
  EndpointLoad failed = ep(1), saturated = ep(2, 0, 8, 8);
  failed.recently_failed = true;
  for (const std::string& name : policy_names()) {
    const auto p = make_policy(name);
    const ClusterView v = recently_failed_view({failed, saturated});
    EXPECT_EQ(p->choose_decode(v, req(10), -1, t0).endpoint, 1) << name;
  }
}

// ------------------------------------------------------------------------------ cache_aware

struct CacheAwareFixture : ::testing::Test {
  std::unique_ptr<Policy> policy = make_cache_aware_policy();
  PolicyState state;
  std::vector<int32_t> prompt(int32_t first, int n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    std::iota(v.begin(), v.end(), first);
    return v;
  }
  // Chooses, and records the choice in the tree unless `record` is false.
  Choice route(ClusterView v, const std::vector<int32_t>& prompt, bool record = true) {
    v.state = &state;
    RequestInfo r = req(static_cast<int64_t>(prompt.size()));
    r.prompt_ids = prompt;
    const Choice c = policy->choose_prefill(v, r, t0);
    if (record && c.kind == Choice::Kind::kChosen) policy->record(state, r, c.endpoint, -1, t0);
    return c;
  }
};

TEST_F(CacheAwareFixture, MatchAboveThresholdGoesToTheMatchedEngine) {
  ClusterView v;
  v.prefill = {ep(0, 0, 0, 1000), ep(1, 0, 10, 1000)};
  state.prefill_tree.insert(prompt(100, 50), 1, 0);
  // 20 of 50 tokens match engine 1: rate 0.4 > 0.3, so the busier engine 1 is chosen.
  auto p = prompt(100, 20);
  auto tail = prompt(5000, 30);
  p.insert(p.end(), tail.begin(), tail.end());
  EXPECT_EQ(route(v, p).endpoint, 1);
}

TEST_F(CacheAwareFixture, MatchAtOrBelowThresholdGoesToTheShortestQueue) {
  ClusterView v;
  v.prefill = {ep(0, 0, 0, 1000), ep(1, 0, 10, 1000)};
  state.prefill_tree.insert(prompt(100, 50), 1, 0);
  auto p = prompt(100, 15);  // 15 of 50: rate 0.3, not above the threshold
  auto tail = prompt(5000, 35);
  p.insert(p.end(), tail.begin(), tail.end());
  EXPECT_EQ(route(v, p).endpoint, 0);
}

TEST_F(CacheAwareFixture, ImbalanceBeyondBothThresholdsGoesToTheShortestQueue) {
  state.prefill_tree.insert(prompt(100, 50), 1, 0);
  ClusterView v;
  // max - min = 70 > 64 and 100 > 30 * 1.5: imbalanced, the full match is ignored.
  v.prefill = {ep(0, 0, 30, 1000), ep(1, 0, 100, 1000)};
  EXPECT_EQ(route(v, prompt(100, 50), false).endpoint, 0);
  // Beyond the absolute threshold only (220 - 150 = 70 > 64, but 220 > 150 * 1.5 is false):
  // balanced, so the match decides.
  v.prefill = {ep(0, 0, 150, 1000), ep(1, 0, 220, 1000)};
  EXPECT_EQ(route(v, prompt(100, 50), false).endpoint, 1);
  // Beyond the relative threshold only (10 > 1 * 1.5, but 9 <= 64): balanced.
  v.prefill = {ep(0, 0, 1, 1000), ep(1, 0, 10, 1000)};
  EXPECT_EQ(route(v, prompt(100, 50), false).endpoint, 1);
}

TEST_F(CacheAwareFixture, RoutedPromptsBuildTheTreeAndRepeatsFollowThem) {
  ClusterView v;
  v.prefill = {ep(0, 0, 0, 1000), ep(1, 0, 0, 1000)};
  EXPECT_EQ(route(v, prompt(100, 40)).endpoint, 0);  // empty tree: shortest queue, lowest id
  v.prefill[0].in_flight = 5;                        // now engine 0 is busier ...
  EXPECT_EQ(route(v, prompt(100, 40)).endpoint, 0);  // ... but holds the prompt
  EXPECT_EQ(route(v, prompt(900, 40)).endpoint, 1);  // a new prompt: shortest queue
  EXPECT_EQ(state.prefill_tree.size(0), 40);
  EXPECT_EQ(state.prefill_tree.size(1), 40);
}

// The tree models the engines' prefix caches, which share blocks only between prompts with the
// same cache_salt (or both none): a prompt routed with one salt is no hit for the same tokens
// unsalted or with another salt, and is one for its own salt.
TEST_F(CacheAwareFixture, APromptsSaltIsPartOfWhatTheTreeMatches) {
  ClusterView v;
  v.prefill = {ep(0, 0, 0, 1000), ep(1, 0, 0, 1000)};
  v.state = &state;
  auto route_salted = [&](std::optional<uint64_t> salt, bool record) {
    RequestInfo r = req(40);
    const auto p = prompt(100, 40);
    r.prompt_ids = p;
    r.cache_salt = salt;
    const Choice c = policy->choose_prefill(v, r, t0);
    if (record) policy->record(state, r, c.endpoint, -1, t0);
    return c.endpoint;
  };
  v.prefill[0].in_flight = 5;  // engine 1, the shorter queue, takes what matches nothing
  EXPECT_EQ(route_salted(7, true), 1);
  v.prefill[0].in_flight = 0;
  v.prefill[1].in_flight = 5;
  EXPECT_EQ(route_salted(7, false), 1);             // its salt: the match wins
  EXPECT_EQ(route_salted(std::nullopt, false), 0);  // without the fix: 1
  EXPECT_EQ(route_salted(8, false), 0);
  EXPECT_EQ(route_salted(std::nullopt, true), 0);
  v.prefill[0].in_flight = 5;
  v.prefill[1].in_flight = 0;
  EXPECT_EQ(route_salted(std::nullopt, false), 0);  // the unsalted prompt is on 0 now
}

TEST(CacheAware, EvictsTheTreeBySizeOnItsInterval) {
  CacheAwareOptions o;
  o.max_tree_size = 10;
  o.eviction_interval = seconds(5);
  const auto p = make_cache_aware_policy(o);
  PolicyState state;
  std::vector<int32_t> a(8, 1), b(8, 2);
  RequestInfo ra = req(8), rb = req(8);
  ra.prompt_ids = a;
  rb.prompt_ids = b;
  p->record(state, ra, 0, -1, t0);
  p->record(state, rb, 0, -1, t0 + seconds(1));
  EXPECT_EQ(state.prefill_tree.size(0), 16);  // over the limit until the interval passes
  p->record(state, rb, 0, -1, t0 + seconds(6));
  EXPECT_EQ(state.prefill_tree.size(0), 8);  // the older prompt went
  EXPECT_TRUE(state.prefill_tree.match(a).empty());
}

// ------------------------------------------------------------------------------ kv_router

TEST(KvRouter, CostIsOverlapWeightedPrefillBlocksPlusDecodeBlocks) {
  const auto p = make_policy("kv_router");
  ClusterView v;
  // Engine 0: 64 of 128 tokens cached, 64 queued prefill tokens, 160 held tokens:
  //   prefill (64 + 64) / 16 = 8, decode 10 + 8 = 18 -> 26.
  // Engine 1: nothing cached, idle: prefill 8, decode 8 -> 16.  Engine 1 wins.
  v.prefill = {ep(0), ep(1)};
  v.prefill[0].cached_tokens = 64;
  v.prefill[0].queued_prefill_tokens = 64;
  v.prefill[0].context_tokens = 160;
  v.prefill[1].queued_prefill_tokens = 0;
  v.prefill[1].context_tokens = 0;
  EXPECT_EQ(p->choose_prefill(v, req(128), t0).endpoint, 1);
  // Engine 0 holding all 128 tokens: prefill 4 + decode 18 = 22 -> still 1; with 40 held tokens
  // instead of 160: 4 + 3 + 8 = 15 < 16 -> 0.
  v.prefill[0].cached_tokens = 128;
  EXPECT_EQ(p->choose_prefill(v, req(128), t0).endpoint, 1);
  v.prefill[0].context_tokens = 40;
  EXPECT_EQ(p->choose_prefill(v, req(128), t0).endpoint, 0);
}

TEST(KvRouter, OverlapWeightZeroIsPureLoad) {
  KvRouterOptions o;
  o.overlap_score_weight = 0;
  const auto p = make_kv_router_policy(o);
  ClusterView v;
  v.prefill = {ep(0), ep(1)};
  v.prefill[0].cached_tokens = 128;
  v.prefill[0].tokens_in_flight = 32;  // two more decode blocks
  EXPECT_EQ(p->choose_prefill(v, req(128), t0).endpoint, 1);
}

TEST(KvRouter, OnlyPartialBlocksOfOverlapDoNotCount) {
  const auto p = make_policy("kv_router");
  ClusterView v;
  v.prefill = {ep(0), ep(1)};
  v.prefill[0].cached_tokens = 15;  // less than a block: no overlap
  v.prefill[1].tokens_in_flight = 0;
  // Equal costs: fewer in flight, then the lower id.
  EXPECT_EQ(p->choose_prefill(v, req(64), t0).endpoint, 0);
  v.prefill[0].in_flight = 1;
  EXPECT_EQ(p->choose_prefill(v, req(64), t0).endpoint, 1);
}

// ------------------------------------------------------------------------------ tandem

TEST(Tandem, PrefersTheEngineWithTheCachedPrefix) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0), ep(1), ep(2)};
  v.prefill[0].tokens_in_flight = 1000;
  v.prefill[1].tokens_in_flight = 1000;
  v.prefill[1].cached_tokens = 3500;  // 3500 of 4000 cached: 1500 tokens of work vs 5000
  v.prefill[2].tokens_in_flight = 1000;
  EXPECT_EQ(p->choose_prefill(v, req(4000), t0).endpoint, 1);
}

TEST(Tandem, ACacheHitDoesNotWinAgainstAMuchLongerQueue) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0), ep(1)};
  v.prefill[0].cached_tokens = 2000;
  v.prefill[0].queued_prefill_tokens = 20000;  // a long queue: finishing elsewhere is sooner
  v.prefill[1].queued_prefill_tokens = 0;
  EXPECT_EQ(p->choose_prefill(v, req(2000), t0).endpoint, 1);
}

// The simulated H800 of the Mooncake replay (sim_latency.h): 24.7 ms a step, 104.8 us a token,
// 10.5 ns an attention pair. Steps are prefill chunks of up to 2048 tokens at contexts up to
// 100K: the pairs model recovers the three costs, and estimates long-prompt work that a
// token-only estimate misses by several times.
double h800_step_s(int64_t context, int64_t chunk) {
  return 0.0247 + 1.048e-4 * static_cast<double>(chunk) +
         1.05e-8 * static_cast<double>(api::causal_pairs(context, context + chunk));
}

TEST(BatchTime, LearnsTheCostOfAttentionPairs) {
  BatchTimeEstimator e;
  uint64_t state = 7;
  auto uniform = [&] {  // [0, 1)
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<double>(state >> 11) / 9007199254740992.0;
  };
  for (int i = 0; i < 400; ++i) {
    const int64_t chunk = 64 + static_cast<int64_t>(uniform() * 1984);
    const int64_t context = static_cast<int64_t>(uniform() * uniform() * 100000);
    e = observe(e, 1, chunk, h800_step_s(context, chunk),
                api::causal_pairs(context, context + chunk));
    EXPECT_EQ(uses_pairs(e), i + 1 >= BatchTimeEstimator::kMinPairObservations);
  }
  EXPECT_NEAR(e.pair_fit.step_s, 0.0247, 1e-6);
  EXPECT_NEAR(e.pair_fit.token_s, 1.048e-4, 1e-8);
  EXPECT_NEAR(e.pair_fit.pair_s, 1.05e-8, 1e-12);
  // The last 80K tokens of a 100K-token prompt, in 40 chunks of 2048 tokens.
  double truth = 0;
  for (int64_t c = 20000; c < 100000; c += 2048)
    truth += h800_step_s(c, std::min<int64_t>(2048, 100000 - c));
  const int64_t pairs = api::causal_pairs(20000, 100000);
  EXPECT_NEAR(estimate_work_s(e, 80000, 2048, pairs), truth, 1e-3 * truth);
  // Without pairs the buckets answer, with the average observed chunk's attention only.
  EXPECT_LT(estimate_work_s(e, 80000, 2048), 0.6 * truth);
  // The running step: a 2048-token chunk at context 90K.
  EXPECT_NEAR(estimate_batch_s(e, 1, 2048, api::causal_pairs(90000, 92048)),
              h800_step_s(90000, 2048), 1e-4);
}

TEST(BatchTime, PairCostsStayNonNegativeAndNeedReportedPairs) {
  BatchTimeEstimator e;
  // Steps that take the same time whatever their size: no per-token or per-pair cost, not a
  // negative one.
  for (int i = 0; i < 50; ++i) {
    const int64_t chunk = 100 + 37 * (i % 11);
    e = observe(e, 1, chunk, 0.05, api::causal_pairs(1000 * (i % 7), 1000 * (i % 7) + chunk));
  }
  EXPECT_NEAR(e.pair_fit.step_s, 0.05, 1e-9);
  EXPECT_GE(e.pair_fit.token_s, 0.0);
  EXPECT_GE(e.pair_fit.pair_s, 0.0);
  EXPECT_NEAR(estimate_batch_s(e, 1, 1000, 123456789), 0.05, 1e-6);
  // Steps a gateway got without pairs (an older engine) do not feed the pairs model.
  BatchTimeEstimator old;
  for (int i = 0; i < 50; ++i) old = observe(old, 1, 1000, 0.1);
  EXPECT_FALSE(uses_pairs(old));
  EXPECT_EQ(old.pair_fit.count, 0);
  EXPECT_NEAR(estimate_batch_s(old, 1, 1000, 5000000), 0.1, 1e-9);  // the buckets
}

TEST(Tandem, UsesLearnedBatchTimesAndTimeUntilFree) {
  const auto p = make_policy("tandem");
  BatchTimeEstimator slow, fast;
  for (int i = 0; i < 10; ++i) {
    slow = observe(slow, 1, 1000, 1.0);
    fast = observe(fast, 1, 1000, 0.1);
  }
  ClusterView v;
  v.prefill = {ep(0), ep(1)};
  v.prefill[0].batch_time = &slow;
  v.prefill[1].batch_time = &fast;
  v.prefill[0].queued_prefill_tokens = 0;
  v.prefill[1].queued_prefill_tokens = 2000;  // 0.3 s of work on the fast engine vs 1 s
  EXPECT_EQ(p->choose_prefill(v, req(1000), t0).endpoint, 1);
  v.prefill[1].time_until_free_s = 0.9;  // but it is busy for another 0.9 s
  EXPECT_EQ(p->choose_prefill(v, req(1000), t0).endpoint, 0);
}

TEST(Tandem, APromptIsDueItsSlackTimesItsOwnComputeAtMostTheCap) {
  TandemOptions o;
  o.prefill_deadline_slack = 8;
  o.prefill_deadline_cap_s = 5;
  const auto p = make_tandem_policy(o);
  ASSERT_TRUE(p->sets_prefill_deadlines());
  BatchTimeEstimator learned;
  for (int i = 0; i < 10; ++i) learned = observe(learned, 1, 1000, 0.1);
  EndpointLoad e = ep(0);
  e.batch_time = &learned;
  e.schedules_by_priority = true;
  auto due_ms = [&](int64_t tokens) {
    return std::llround(8 * estimate_work_s(learned, tokens, 2048) * 1e3);
  };
  // Its own compute, not the engine's queue: a busy engine gives the same deadline.
  EXPECT_EQ(p->prefill_deadline(e, req(1000)), milliseconds(due_ms(1000)));
  e.queued_prefill_tokens = 50000;
  EXPECT_EQ(p->prefill_deadline(e, req(1000)), milliseconds(due_ms(1000)));
  // Only the uncached part counts.
  e.cached_tokens = 600;
  EXPECT_EQ(p->prefill_deadline(e, req(1000)), milliseconds(due_ms(400)));
  // A prompt of more than 5 s of compute is due 8 x 5 s after it arrived, as any longer one.
  e.cached_tokens = 0;
  ASSERT_GT(estimate_work_s(learned, 100000, 2048), 5.0);
  EXPECT_EQ(p->prefill_deadline(e, req(100000)), milliseconds(40000));
  EXPECT_EQ(p->prefill_deadline(e, req(500000)), milliseconds(40000));
  // An engine that does not schedule by priority gets none (a vLLM engine would refuse one).
  e.schedules_by_priority = false;
  EXPECT_FALSE(p->prefill_deadline(e, req(1000)).has_value());
  // Without slack the policy sets none at all; the others never do.
  o.prefill_deadline_slack = 0;
  EXPECT_FALSE(make_tandem_policy(o)->sets_prefill_deadlines());
  for (const auto& name : policy_names()) {
    if (name != "tandem") {
      EXPECT_FALSE(make_policy(name)->sets_prefill_deadlines()) << name;
    }
  }
}

// Two engines with the same queued tokens: one has the tail of a 100K-token prompt queued, the
// other many short prompts. With reported pairs and a learned pairs model, the policy sees that
// the first is busy for far longer; without pairs it could not tell them apart.
TEST(Tandem, CountsTheAttentionOfQueuedLongPrompts) {
  const auto p = make_policy("tandem");
  BatchTimeEstimator learned;
  for (int i = 0; i < 64; ++i) {
    const int64_t context = 1500 * i;
    learned = observe(learned, 1, 2048, h800_step_s(context, 2048),
                      api::causal_pairs(context, context + 2048));
  }
  ClusterView v;
  v.prefill = {ep(0), ep(1)};
  for (auto& e : v.prefill) {
    e.batch_time = &learned;
    e.queued_prefill_tokens = 30000;
  }
  v.prefill[0].queued_prefill_pairs = api::causal_pairs(70000, 100000);  // a long prompt's tail
  v.prefill[1].queued_prefill_pairs = 15 * api::causal_pairs(0, 2000);   // 15 short prompts
  v.prefill[1].in_flight = 5;                                            // more requests, even
  EXPECT_EQ(p->choose_prefill(v, req(3000), t0).endpoint, 1);
  std::swap(v.prefill[0].queued_prefill_pairs, v.prefill[1].queued_prefill_pairs);
  EXPECT_EQ(p->choose_prefill(v, req(3000), t0).endpoint, 0);
  // Unknown pairs: tokens only, and the engine with fewer requests in flight wins the tie.
  v.prefill[0].queued_prefill_pairs = v.prefill[1].queued_prefill_pairs = -1;
  EXPECT_EQ(p->choose_prefill(v, req(3000), t0).endpoint, 0);
}

TEST(Tandem, AvoidsOverloadedEnginesEvenWithACacheHit) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0), ep(1)};
  v.prefill[0].cached_tokens = 4000;
  v.prefill[0].queued_prefill_tokens = 32000;  // at the token limit
  v.prefill[1].queued_prefill_tokens = 1000;   // 5000 tokens of work here, 32000 there
  EXPECT_EQ(p->choose_prefill(v, req(4000), t0).endpoint, 1);
  v.prefill[0].queued_prefill_tokens = 10;
  v.prefill[0].in_flight = 32;  // at the sequence limit
  v.prefill[0].max_in_flight = 64;
  v.prefill[0].cached_tokens = 0;
  EXPECT_EQ(p->choose_prefill(v, req(4000), t0).endpoint, 1);
}

// A request whose prefix an overloaded engine holds waits for that engine when it would still
// be computed there sooner (the cache saves more than the queue costs), instead of being
// recomputed elsewhere; when the free engine is sooner, it goes there.
TEST(Tandem, WaitsForABusyEngineWhoseCacheSavesMoreThanItsQueue) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0), ep(1)};
  v.prefill[0].cached_tokens = 58000;          // of a 60000-token prompt
  v.prefill[0].queued_prefill_tokens = 33000;  // over the 32000-token limit: 35000 to compute
  v.prefill[1].queued_prefill_tokens = 0;      // idle, but 60000 to compute
  EXPECT_EQ(p->choose_prefill(v, req(60000), t0).kind, Choice::Kind::kSaturated);
  // Parallel mode waits the same way.
  v.decode = {ep(10)};
  EXPECT_EQ(p->choose_together(v, req(60000), t0).kind, Choice::Kind::kSaturated);
  // Once it has room, it takes the request.
  v.prefill[0].queued_prefill_tokens = 31000;
  EXPECT_EQ(p->choose_prefill(v, req(60000), t0).endpoint, 0);
  // A small cached part does not justify the wait: the idle engine is sooner.
  v.prefill[0].queued_prefill_tokens = 33000;
  v.prefill[0].cached_tokens = 5000;
  EXPECT_EQ(p->choose_prefill(v, req(60000), t0).endpoint, 1);
  const PairChoice pair = p->choose_together(v, req(60000), t0);
  EXPECT_EQ(pair.kind, Choice::Kind::kChosen);
  EXPECT_EQ(pair.prefill, 1);
}

TEST(Tandem, HoldsTheRequestWhileEveryEngineIsOverloaded) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0), ep(1, 0, 8, 8)};
  v.prefill[0].queued_prefill_tokens = 40000;
  EXPECT_EQ(p->choose_prefill(v, req(100), t0).kind, Choice::Kind::kSaturated);
  // An idle engine always takes a request, however long its prompt.
  v.prefill[0].queued_prefill_tokens = 0;
  EXPECT_EQ(p->choose_prefill(v, req(100000), t0).endpoint, 0);
  v.prefill[0].eligible = false;
  v.prefill[1].eligible = false;
  EXPECT_EQ(p->choose_prefill(v, req(100), t0).kind, Choice::Kind::kNoneEligible);
}

// An engine that orders its prefills by the policy's deadlines lets a short prompt pass its
// queue itself, so the gateway does not hold requests for its queued tokens; the request limit
// (max_prefill_seqs, 32) still holds.
TEST(Tandem, DoesNotHoldForTheQueuedTokensOfAnEngineThatTakesDeadlines) {
  const auto p = make_policy("tandem");
  ASSERT_TRUE(p->sets_prefill_deadlines());
  ClusterView v;
  v.prefill = {ep(0, 0, 1, 64)};
  v.prefill[0].queued_prefill_tokens = 40000;  // over the 32000-token limit
  EXPECT_EQ(p->choose_prefill(v, req(100), t0).kind, Choice::Kind::kSaturated);
  v.prefill[0].schedules_by_priority = true;
  EXPECT_EQ(p->choose_prefill(v, req(100), t0).endpoint, 0);
  v.decode = {ep(10)};
  EXPECT_EQ(p->choose_together(v, req(100), t0).prefill, 0);
  v.prefill[0].in_flight = 32;
  EXPECT_EQ(p->choose_prefill(v, req(100), t0).kind, Choice::Kind::kSaturated);
  // A policy without deadlines holds for the queued tokens of any engine.
  TandemOptions o;
  o.prefill_deadline_slack = 0;
  v.prefill[0].in_flight = 1;
  EXPECT_EQ(make_tandem_policy(o)->choose_prefill(v, req(100), t0).kind, Choice::Kind::kSaturated);
}

// The hold is bounded: after max_hold (2 s) since arrival, a request goes to the engine that
// computes it soonest among those only over their queued-token limit, in every mode.
TEST(Tandem, HoldsAtMostMaxHoldThenGoesToTheSoonestEngine) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0), ep(1), ep(2, 0, 8, 8) /* at the gateway's in-flight limit */};
  v.prefill[0].queued_prefill_tokens = 50000;
  v.prefill[1].queued_prefill_tokens = 40000;
  v.prefill[2].queued_prefill_tokens = 0;
  EXPECT_EQ(p->choose_prefill(v, req(1000), t0 + milliseconds(1999)).kind,
            Choice::Kind::kSaturated);
  EXPECT_EQ(p->choose_prefill(v, req(1000), t0 + seconds(2)).endpoint, 1);
  v.decode = {ep(10)};
  EXPECT_EQ(p->choose_together(v, req(1000), t0 + seconds(1)).kind, Choice::Kind::kSaturated);
  const PairChoice pair = p->choose_together(v, req(1000), t0 + seconds(2));
  EXPECT_EQ(pair.kind, Choice::Kind::kChosen);
  EXPECT_EQ(pair.prefill, 1);
  EXPECT_EQ(pair.decode, 10);
  // Never over the policy's request limit (max_prefill_seqs, 32) either.
  v.prefill[1].in_flight = 32;
  v.prefill[1].max_in_flight = 64;
  EXPECT_EQ(p->choose_prefill(v, req(1000), t0 + seconds(2)).endpoint, 0);
  v.prefill[0].in_flight = 32;
  v.prefill[0].max_in_flight = 64;
  EXPECT_EQ(p->choose_prefill(v, req(1000), t0 + seconds(60)).kind, Choice::Kind::kSaturated);
  // Aggregated mode: the same bound over the engines' prefill queues.
  ClusterView a;
  a.decode = {ep(10), ep(11)};
  a.decode[0].queued_prefill_tokens = 45000;
  a.decode[1].queued_prefill_tokens = 35000;
  EXPECT_EQ(p->choose_decode(a, req(1000), -1, t0).kind, Choice::Kind::kSaturated);
  EXPECT_EQ(p->choose_decode(a, req(1000), -1, t0 + seconds(3)).endpoint, 11);
  // max_hold 0: no bound.
  TandemOptions unbounded;
  unbounded.max_hold = std::chrono::nanoseconds(0);
  PolicyOptions options;
  options.tandem = unbounded;
  EXPECT_EQ(make_policy("tandem", options)->choose_decode(a, req(1000), -1, t0 + seconds(600)).kind,
            Choice::Kind::kSaturated);
}

// Held for an engine whose cached prefix makes it sooner, a request that reached max_hold goes to
// the engine that computes it soonest, busy or free: not to a free engine that is much later
// (the Mooncake windows: a 38K-token prompt waited 38 s instead of 21 s that way).
TEST(Tandem, AfterMaxHoldASoonerBusyEngineBeatsALaterFreeOne) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0), ep(1)};
  v.prefill[0].cached_tokens = 20000;          // of a 38000-token prompt
  v.prefill[0].queued_prefill_tokens = 33000;  // over the limit: 51000 to compute
  v.prefill[1].queued_prefill_tokens = 31000;  // under it, but 69000 to compute
  EXPECT_EQ(p->choose_prefill(v, req(38000), t0).kind, Choice::Kind::kSaturated);
  EXPECT_EQ(p->choose_prefill(v, req(38000), t0 + seconds(2)).endpoint, 0);
  v.decode = {ep(10)};
  EXPECT_EQ(p->choose_together(v, req(38000), t0 + seconds(1)).kind, Choice::Kind::kSaturated);
  EXPECT_EQ(p->choose_together(v, req(38000), t0 + seconds(2)).prefill, 0);
  // When the free engine is the sooner one, it still goes there.
  v.prefill[1].queued_prefill_tokens = 1000;
  EXPECT_EQ(p->choose_prefill(v, req(38000), t0 + seconds(2)).endpoint, 1);
  // Aggregated mode alike.
  ClusterView a;
  a.decode = {ep(10), ep(11)};
  a.decode[0].cached_tokens = 20000;
  a.decode[0].queued_prefill_tokens = 33000;
  a.decode[1].queued_prefill_tokens = 31000;
  EXPECT_EQ(p->choose_decode(a, req(38000), -1, t0).kind, Choice::Kind::kSaturated);
  EXPECT_EQ(p->choose_decode(a, req(38000), -1, t0 + seconds(2)).endpoint, 10);
}

// A priority class's own hold: 0 sends an interactive request on at once to the engine that
// computes it soonest (its engine puts it ahead of the queue the limit measures); a longer one
// holds it that long.
TEST(Tandem, ARequestsOwnHoldReplacesThePolicys) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0), ep(1)};
  v.prefill[0].queued_prefill_tokens = 50000;
  v.prefill[1].queued_prefill_tokens = 40000;
  RequestInfo interactive = req(1000);
  interactive.max_hold = std::chrono::milliseconds(0);
  EXPECT_EQ(p->choose_prefill(v, interactive, t0).endpoint, 1);
  RequestInfo batch = req(1000);
  batch.max_hold = seconds(10);
  EXPECT_EQ(p->choose_prefill(v, batch, t0 + seconds(9)).kind, Choice::Kind::kSaturated);
  EXPECT_EQ(p->choose_prefill(v, batch, t0 + seconds(10)).endpoint, 1);
  EXPECT_EQ(p->choose_prefill(v, req(1000), t0 + seconds(2)).endpoint, 1);  // the policy's 2 s
}

// A prompt that alone exceeds the queued-token limit on every engine is not held: no engine can
// ever take it within the limit, and holding it would only let later, shorter requests ahead.
TEST(Tandem, APromptLargerThanTheQueueLimitIsNotHeld) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0), ep(1)};
  v.prefill[0].queued_prefill_tokens = 40000;
  v.prefill[1].queued_prefill_tokens = 35000;
  EXPECT_EQ(p->choose_prefill(v, req(10000), t0).kind, Choice::Kind::kSaturated);
  EXPECT_EQ(p->choose_prefill(v, req(32000), t0).endpoint, 1);
  // With 5000 of its tokens cached on engine 0 it fits that engine's limit: it waits.
  v.prefill[0].cached_tokens = 5000;
  EXPECT_EQ(p->choose_prefill(v, req(33000), t0).kind, Choice::Kind::kSaturated);
}

// A burst of cache misses on an idle pool, dispatched as the gateway does (the view updated after
// each start): every engine gets its share.
TEST(Tandem, SpreadsABurstOfMisses) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0, 0, 0, 100), ep(1, 0, 0, 100), ep(2, 0, 0, 100), ep(3, 0, 0, 100)};
  for (auto& e : v.prefill) e.queued_prefill_tokens = 0;
  std::map<int, int> count;
  for (int i = 0; i < 16; ++i) {
    const RequestInfo r = req(1000);
    const Choice c = p->choose_prefill(v, r, t0);
    ASSERT_EQ(c.kind, Choice::Kind::kChosen);
    ++count[c.endpoint];
    apply_choice(v, r, c.endpoint, -1);
  }
  for (int id = 0; id < 4; ++id) EXPECT_EQ(count[id], 4) << "engine " << id;
}

// Isolated misses (each on an idle pool) spread by prompt instead of all going to the lowest id,
// and a repeated prompt goes where its first copy went.
TEST(Tandem, SpreadsIsolatedMissesByPrompt) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0), ep(1), ep(2), ep(3)};
  std::set<int> used;
  std::map<uint64_t, int> where;
  for (uint64_t k = 1; k <= 32; ++k) {
    const std::vector<uint64_t> hashes = {k * 0x1234567ULL, k * 0x9876543ULL};
    RequestInfo r = req(1000);
    r.block_hashes = hashes;
    const int e = p->choose_prefill(v, r, t0).endpoint;
    used.insert(e);
    where[k] = e;
    EXPECT_EQ(p->choose_prefill(v, r, t0).endpoint, e);  // deterministic
  }
  EXPECT_EQ(used.size(), 4u);
  std::map<int, int> count;
  for (const auto& [k, e] : where) ++count[e];
  for (const auto& [e, n] : count) EXPECT_GE(n, 3) << "engine " << e;
}

TEST(Tandem, DecodeStaysInTheGroupAndPrefersTheLighterLoad) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.decode = {ep(10, 0), ep(11, 1), ep(12, 1), ep(13, 0)};
  v.decode[1].running_seqs = 6;
  v.decode[2].running_seqs = 2;
  v.decode[2].context_tokens = 20000;  // ~10 sequences' worth of tokens
  EXPECT_EQ(p->choose_decode(v, req(100), 1, t0).endpoint, 11);
  v.decode[2].context_tokens = 2000;
  EXPECT_EQ(p->choose_decode(v, req(100), 1, t0).endpoint, 12);
  // Group 0 engines are idle but never chosen for group 1.
  v.decode[1].max_in_flight = v.decode[1].in_flight = 4;
  v.decode[2].max_in_flight = v.decode[2].in_flight = 4;
  EXPECT_EQ(p->choose_decode(v, req(100), 1, t0).kind, Choice::Kind::kSaturated);
  EXPECT_EQ(p->choose_decode(v, req(100), 2, t0).kind, Choice::Kind::kNoneEligible);
}

TEST(Tandem, DecodeAvoidsEnginesWithoutKvRoomAndWeighsKvPressure) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.decode = {ep(10), ep(11)};
  v.decode[0].free_kv_blocks = 10;  // 1000 + 256 tokens need 79 blocks of 16
  v.decode[0].total_kv_blocks = 10000;
  v.decode[1].in_flight = 3;
  EXPECT_EQ(p->choose_decode(v, req(1000), 0, t0).endpoint, 11);
  v.decode[0].free_kv_blocks = 200;  // room, but 99% full: +3.96 sequences of load
  EXPECT_EQ(p->choose_decode(v, req(1000), 0, t0).endpoint, 11);
  v.decode[0].free_kv_blocks = 9000;
  EXPECT_EQ(p->choose_decode(v, req(1000), 0, t0).endpoint, 10);
}

TEST(Tandem, ARequestNoEngineCouldEverHoldIsSentForTheEngineToRefuse) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0)};
  v.decode = {ep(10)};
  v.decode[0].total_kv_blocks = 1000;  // 16,000 tokens in blocks of 16
  v.decode[0].free_kv_blocks = 10;
  // 1000 + 256 tokens fit the engine once others finish: the request waits for room.
  EXPECT_EQ(p->choose_decode(v, req(1000), 0, t0).kind, Choice::Kind::kSaturated);
  EXPECT_EQ(p->choose_together(v, req(1000), t0).kind, Choice::Kind::kSaturated);
  // 50,000 never fit: waiting would end in the queue timeout, so it goes and the engine answers
  // why it cannot take it.
  EXPECT_EQ(p->choose_decode(v, req(50000), 0, t0).endpoint, 10);
  const PairChoice c = p->choose_together(v, req(50000), t0);
  ASSERT_EQ(c.kind, Choice::Kind::kChosen);
  EXPECT_EQ(c.decode, 10);
}

TEST(Tandem, ParallelModeChoosesAPairInOneGroup) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0, 0), ep(1, 1)};
  v.decode = {ep(10, 0, 4, 4) /* group 0 full */, ep(11, 1)};
  v.prefill[0].cached_tokens = 1000;  // the better prefill, but its group cannot decode now
  const PairChoice c = p->choose_together(v, req(1000), t0);
  ASSERT_EQ(c.kind, Choice::Kind::kChosen);
  EXPECT_EQ(c.prefill, 1);
  EXPECT_EQ(c.decode, 11);
}

TEST(Tandem, ParallelModeBreaksPrefillTiesByDecodeLoad) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0, 0), ep(1, 1)};
  v.decode = {ep(10, 0, 3), ep(11, 1, 1)};
  PairChoice c = p->choose_together(v, req(1000), t0);
  EXPECT_EQ(c.prefill, 1);
  EXPECT_EQ(c.decode, 11);
  v.decode[1].in_flight = 5;
  c = p->choose_together(v, req(1000), t0);
  EXPECT_EQ(c.prefill, 0);
  EXPECT_EQ(c.decode, 10);
}

TEST(Tandem, ParallelModeWaitsOrFailsLikeTheDefaultPairChoice) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0, 0)};
  v.decode = {ep(10, 0, 4, 4)};
  EXPECT_EQ(p->choose_together(v, req(10), t0).kind, Choice::Kind::kSaturated);
  v.decode[0].group = 1;
  EXPECT_EQ(p->choose_together(v, req(10), t0).kind, Choice::Kind::kNoneEligible);
}

TEST(Tandem, RetriesAvoidTheEngineThatFailed) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0), ep(1)};
  v.prefill[0].cached_tokens = 1000;
  RequestInfo r = req(1000);
  EXPECT_EQ(p->choose_prefill(v, r, t0).endpoint, 0);
  r.excluded = {0};
  EXPECT_EQ(p->choose_prefill(v, r, t0).endpoint, 1);
  v.prefill[1].eligible = false;
  EXPECT_EQ(p->choose_prefill(v, r, t0).endpoint, 0);  // the last one left
}

TEST(Tandem, AggregatedModeUsesPrefillTimeAndKvRoom) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.decode = {ep(10), ep(11)};
  v.decode[1].cached_tokens = 900;
  EXPECT_EQ(p->choose_decode(v, req(1000), -1, t0).endpoint, 11);
  v.decode[1].free_kv_blocks = 5;
  EXPECT_EQ(p->choose_decode(v, req(1000), -1, t0).endpoint, 10);
}

// max_prefill_seqs (32) bounds an engine's queue of prompts still to prefill. An aggregated engine
// decodes what it prefills, and its requests that are generating are not in that queue (a user's
// trial: an engine taking 256 sequences ran 32 of 120 streaming clients while 88 waited in the
// gateway, at a third of least_load's throughput).
TEST(Tandem, AnAggregatedEngineWithFortyRequestsDecodingStillGetsTheNextRequest) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.decode = {ep(10, 0, 42, 256)};
  v.decode[0].running_seqs = 40;
  v.decode[0].queued_prefill_seqs = 2;
  EXPECT_EQ(p->choose_decode(v, req(1000), -1, t0).endpoint, 10);
  // Over its queued-token limit it holds the request, and takes it once held max_hold: the
  // requests generating there do not keep it at the request limit either.
  v.decode[0].queued_prefill_tokens = 40000;
  EXPECT_EQ(p->choose_decode(v, req(1000), -1, t0).kind, Choice::Kind::kSaturated);
  EXPECT_EQ(p->choose_decode(v, req(1000), -1, t0 + seconds(2)).endpoint, 10);
}

TEST(Tandem, AnAggregatedEngineWithThirtyTwoRequestsStillToPrefillIsOverloaded) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.decode = {ep(10, 0, 32, 256)};
  v.decode[0].running_seqs = 0;
  v.decode[0].queued_prefill_seqs = 32;
  EXPECT_EQ(p->choose_decode(v, req(1000), -1, t0).kind, Choice::Kind::kSaturated);
  EXPECT_EQ(p->choose_decode(v, req(1000), -1, t0 + seconds(60)).kind, Choice::Kind::kSaturated);
  // An engine with more in flight but fewer to prefill takes it.
  v.decode.push_back(ep(11, 0, 50, 256));
  v.decode[1].running_seqs = 45;
  v.decode[1].queued_prefill_seqs = 5;
  EXPECT_EQ(p->choose_decode(v, req(1000), -1, t0).endpoint, 11);
  // Where the gateway cannot tell (no fresh report), every request in flight counts.
  v.decode[1].queued_prefill_seqs = -1;
  EXPECT_EQ(p->choose_decode(v, req(1000), -1, t0).kind, Choice::Kind::kSaturated);
}

// A prefill engine's requests in flight are all prefill work (P/D modes): each counts against the
// limit, whatever the engine reports running.
TEST(Tandem, APrefillEnginesEveryRequestInFlightCountsAgainstItsPrefillLimit) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.prefill = {ep(0, 0, 32, 64)};
  v.prefill[0].running_seqs = 30;
  v.decode = {ep(10)};
  EXPECT_EQ(p->choose_prefill(v, req(1000), t0).kind, Choice::Kind::kSaturated);
  EXPECT_EQ(p->choose_together(v, req(1000), t0 + seconds(60)).kind, Choice::Kind::kSaturated);
  v.prefill[0].in_flight = 31;
  EXPECT_EQ(p->choose_prefill(v, req(1000), t0).endpoint, 0);
}

// Within one dispatch pass each request sent to an aggregated engine joins its prefill queue, so
// a burst stops at the limit rather than going all to one engine until its next report.
TEST(Tandem, ADispatchPassFillsAnAggregatedEnginesPrefillQueueUpToTheLimit) {
  const auto p = make_policy("tandem");
  ClusterView v;
  v.decode = {ep(10, 0, 40, 256)};
  v.decode[0].running_seqs = 40;
  v.decode[0].queued_prefill_seqs = 0;
  int sent = 0;
  while (sent < 100) {
    const Choice c = p->choose_decode(v, req(100), -1, t0);
    if (c.kind != Choice::Kind::kChosen) break;
    apply_choice(v, req(100), -1, c.endpoint);
    ++sent;
  }
  EXPECT_EQ(sent, 32);
  EXPECT_EQ(v.decode[0].queued_prefill_seqs, 32);
  EXPECT_EQ(v.decode[0].in_flight, 72);
}

// The gateway's view of an aggregated engine with `legs` of its requests in flight, each launched
// before the poll whose report `report` answers (which therefore includes them).
struct AggregatedEngineView {
  Topology topo;
  PrefixIndex index;
  metrics::Registry registry;
  GatewayMetrics gateway_metrics{registry};
  EndpointTable table{topo, gateway_metrics, index};
  int id = -1;

  explicit AggregatedEngineView(int legs, PdMode mode = PdMode::kAggregated) {
    topo.mode = mode;
    Endpoint engine;
    engine.name = "engine-0";
    engine.host = "engine-0.engines";
    engine.port = 8000;
    id = table.add(false, engine);
    for (int i = 0; i < legs; ++i) start_leg();
  }
  void start_leg() {
    Leg leg;
    leg.endpoint = id;
    leg.started = t0;
    table.leg_started(*table.find(id), leg);
  }
  // A report of `running` and `waiting` sequences, taken to include every leg launched so far.
  void report(int64_t running, int64_t waiting, Clock::time_point now = t0) {
    LoadAnswer answer;
    answer.kind = LoadAnswer::Kind::kReport;
    answer.report.running = running;
    answer.report.waiting = waiting;
    answer.report.total_blocks = 100000;
    answer.report.free_blocks = 50000;
    answer.report.block_size = 16;
    const EndpointState& e = *table.find(id);
    table.load_result(id, {e.counts.launched_total, e.counts.legs_launched}, answer, now);
  }
  int64_t queued_seqs(Clock::time_point now = t0) const {
    return table.view(now, nullptr).decode.at(0).queued_prefill_seqs;
  }
};

// The gateway's view: an aggregated engine's sequences still to prefill are those it reports
// waiting, which counts every client's and each of a request's sequences. The gateway's own legs
// less the engine's running sequences read 0 whenever something else runs there.
TEST(EndpointView, AnAggregatedEnginesPrefillQueueIsTheSequencesItReportsWaiting) {
  AggregatedEngineView g(42);
  EXPECT_EQ(g.queued_seqs(), -1);  // no report yet: all 42 count
  // Another client's sequences running there too: 42 - 60 read 0 with 40 waiting.
  g.report(60, 40);
  EXPECT_EQ(g.queued_seqs(), 40);
  g.report(60, 1000);
  EXPECT_EQ(g.queued_seqs(), 1000);
  // A report older than the view trusts (four polls): unknown again.
  EXPECT_EQ(g.queued_seqs(t0 + seconds(10)), -1);
}

// Requests with n = 8 go to the engine as one leg each but run and wait as eight sequences.
TEST(EndpointView, AnAggregatedEngineCountsEachOfARequestsNSequencesStillToPrefill) {
  AggregatedEngineView g(10);
  g.report(48, 32);  // 6 requests running, 4 waiting, 8 sequences each: 10 - 48 read 0
  EXPECT_EQ(g.queued_seqs(), 32);
}

// Two gateways (`serve --gateways 2`) share the engine, 50 of each one's requests running there:
// this one's 70 legs less 100 running read 0 while 40 wait, and it sent more.
TEST(EndpointView, AnEngineSharedWithAnotherGatewayIsAtItsPrefillLimitWithItsQueueFull) {
  AggregatedEngineView g(70);
  g.report(100, 40);
  const ClusterView v = g.table.view(t0, nullptr);
  EXPECT_EQ(v.decode.at(0).queued_prefill_seqs, 40);
  const auto p = make_policy("tandem");
  EXPECT_EQ(p->choose_decode(v, req(1000), -1, t0).kind, Choice::Kind::kSaturated);
}

// Legs launched after the poll a report answers are not in it: each counts as still to prefill
// until a report includes it.
TEST(EndpointView, LegsLaunchedSinceTheReportsPollCountAsStillToPrefill) {
  AggregatedEngineView g(42);
  g.report(41, 1);
  for (int i = 0; i < 5; ++i) g.start_leg();
  EXPECT_EQ(g.queued_seqs(), 6);
  g.report(47, 0);
  EXPECT_EQ(g.queued_seqs(), 0);
}

// P/D modes: the decode engine's legs are not its prefill work, and a prefill engine's all are.
TEST(EndpointView, APdEnginesPrefillQueueIsNotCounted) {
  Topology pd;
  pd.mode = PdMode::kSequential;
  PrefixIndex index;
  metrics::Registry registry;
  GatewayMetrics gateway_metrics(registry);
  EndpointTable pd_table(pd, gateway_metrics, index);
  Endpoint engine;
  engine.name = "prefill-0";
  engine.host = "prefill-0.engines";
  engine.port = 8000;
  const int prefill = pd_table.add(true, engine);
  Endpoint decode_engine = engine;
  decode_engine.name = "decode-0";
  decode_engine.host = "decode-0.engines";
  const int decode = pd_table.add(false, decode_engine);
  LoadAnswer answer;
  answer.kind = LoadAnswer::Kind::kReport;
  answer.report.running = 40;
  answer.report.waiting = 1;
  answer.report.total_blocks = 1000;
  answer.report.free_blocks = 500;
  answer.report.block_size = 16;
  for (const int e : {prefill, decode}) pd_table.load_result(e, {}, answer, t0);
  const ClusterView pd_view = pd_table.view(t0, nullptr);
  EXPECT_EQ(pd_view.prefill.at(0).queued_prefill_seqs, -1);
  EXPECT_EQ(pd_view.decode.at(0).queued_prefill_seqs, -1);
}

// ------------------------------------------------------------------------------ helpers

TEST(ApplyChoice, UpdatesTheLoadOfTheChosenEngines) {
  ClusterView v;
  v.prefill = {ep(0), ep(1)};
  v.prefill[0].queued_prefill_tokens = 100;
  v.prefill[0].cached_tokens = 300;
  v.decode = {ep(10)};
  v.decode[0].running_seqs = 2;
  apply_choice(v, req(1000), 0, 10);
  EXPECT_EQ(v.prefill[0].in_flight, 1);
  EXPECT_EQ(v.prefill[0].tokens_in_flight, 1000);
  EXPECT_EQ(v.prefill[0].queued_prefill_tokens, 800);
  EXPECT_EQ(v.prefill[1].in_flight, 0);
  EXPECT_EQ(v.decode[0].in_flight, 1);
  EXPECT_EQ(v.decode[0].running_seqs, 3);
  EXPECT_EQ(v.decode[0].context_tokens, -1);  // unknown stays unknown
}

}  // namespace
}  // namespace tandem::gateway
