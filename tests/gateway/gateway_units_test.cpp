// Unit tests of the gateway's small, self-contained parts: the least-load scheduling policy (pure
// functions of a cluster view), the request lifecycle record (PhaseTimes) and the scheduling
// thread (post/at/stop). Everything here is deterministic: times are injected where the component
// takes them, and the scheduling-thread tests only assert orders and lower bounds on timer times.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "gateway/lifecycle.h"
#include "gateway/policy.h"
#include "gateway/scheduling_thread.h"
#include "util/bounded_wait.h"

namespace tandem::gateway {
namespace {

// ------------------------------------------------------------------------------------ policy

using Kind = Choice::Kind;

EndpointLoad ep(int id, int64_t in_flight, int64_t max_in_flight = 4, int64_t tokens = 0,
                int group = 0, bool eligible = true) {
  EndpointLoad e;
  e.id = id;
  e.group = group;
  e.eligible = eligible;
  e.in_flight = in_flight;
  e.max_in_flight = max_in_flight;
  e.tokens_in_flight = tokens;
  return e;
}

// An engine of `group` with the given load (the policy tests of groups care about little else).
EndpointLoad in_group(int id, int group, int64_t in_flight = 0, int64_t max_in_flight = 4) {
  return ep(id, in_flight, max_in_flight, 0, group);
}

EndpointLoad ineligible(int id, int group = 0) {
  return ep(id, 0, 4, 0, group, false);
}

RequestInfo request(std::vector<int> excluded = {}) {
  RequestInfo r;
  r.prompt_tokens = 10;
  r.excluded = std::move(excluded);
  return r;
}

Choice prefill(const std::vector<EndpointLoad>& pool, const RequestInfo& r = request()) {
  ClusterView v;
  v.prefill = pool;
  return make_least_load_policy()->choose_prefill(v, r, Clock::time_point());
}

Choice decode(const std::vector<EndpointLoad>& pool, int group, const RequestInfo& r = request()) {
  ClusterView v;
  v.decode = pool;
  return make_least_load_policy()->choose_decode(v, r, group, Clock::time_point());
}

PairChoice pair(const std::vector<EndpointLoad>& prefills, const std::vector<EndpointLoad>& decodes,
                const RequestInfo& r = request()) {
  ClusterView v;
  v.prefill = prefills;
  v.decode = decodes;
  return make_least_load_policy()->choose_together(v, r, Clock::time_point());
}

TEST(LeastLoadPolicy, HasItsName) {
  EXPECT_STREQ(make_least_load_policy()->name(), "least_load");
}

TEST(LeastLoadPolicy, ChoosesFewestInFlight) {
  const Choice c = prefill({ep(1, 3), ep(2, 1), ep(3, 2)});
  EXPECT_EQ(c.kind, Kind::kChosen);
  EXPECT_EQ(c.endpoint, 2);
}

TEST(LeastLoadPolicy, FewerInFlightBeatsFewerTokens) {
  // Requests in flight come first: tokens only break ties.
  const Choice c = prefill({ep(1, 2, 4, 0), ep(2, 1, 4, 1000)});
  EXPECT_EQ(c.endpoint, 2);
}

TEST(LeastLoadPolicy, TiesBrokenByTokensInFlightThenLowestId) {
  EXPECT_EQ(prefill({ep(5, 1, 4, 100), ep(4, 1, 4, 50), ep(3, 1, 4, 70)}).endpoint, 4);
  // Same requests and tokens: the lowest id, wherever it is in the view.
  EXPECT_EQ(prefill({ep(7, 1, 4, 50), ep(3, 1, 4, 50), ep(9, 1, 4, 50)}).endpoint, 3);
}

TEST(LeastLoadPolicy, SkipsSaturatedEngines) {
  // Engine 1 has fewer requests but is at its own (lower) limit.
  const Choice c = prefill({ep(1, 2, 2), ep(2, 3, 8)});
  EXPECT_EQ(c.kind, Kind::kChosen);
  EXPECT_EQ(c.endpoint, 2);
}

TEST(LeastLoadPolicy, AllSaturatedMeansWait) {
  const Choice c = prefill({ep(1, 4, 4), ep(2, 5, 4)});
  EXPECT_EQ(c.kind, Kind::kSaturated);
  EXPECT_EQ(c.endpoint, -1);
}

TEST(LeastLoadPolicy, NoEligibleEngineMeansFail) {
  EXPECT_EQ(prefill({}).kind, Kind::kNoneEligible);
  EXPECT_EQ(prefill({}).endpoint, -1);
  const Choice c = prefill({ineligible(1), ineligible(2)});
  EXPECT_EQ(c.kind, Kind::kNoneEligible);
  EXPECT_EQ(c.endpoint, -1);
}

TEST(LeastLoadPolicy, NeverChoosesAnIneligibleEngine) {
  // The ineligible engine is idle and has the lowest id: it would win on load alone.
  EXPECT_EQ(prefill({ineligible(1), ep(2, 3)}).endpoint, 2);
  // Only a saturated eligible engine besides it: wait, do not fall back to the ineligible one.
  const Choice c = prefill({ineligible(1), ep(2, 4, 4)});
  EXPECT_EQ(c.kind, Kind::kSaturated);
}

TEST(LeastLoadPolicy, AvoidsEnginesThatFailedTheRequest) {
  // Engine 1 is idle but already failed this request.
  const Choice c = prefill({ep(1, 0), ep(2, 3)}, request({1}));
  EXPECT_EQ(c.kind, Kind::kChosen);
  EXPECT_EQ(c.endpoint, 2);
}

TEST(LeastLoadPolicy, UsesAFailedEngineWhenNothingElseIsLeft) {
  // The only engine.
  EXPECT_EQ(prefill({ep(1, 2)}, request({1})).endpoint, 1);
  // The only eligible engine.
  EXPECT_EQ(prefill({ep(1, 2), ineligible(2)}, request({1})).endpoint, 1);
  // All failed: the least loaded of them.
  const Choice c = prefill({ep(1, 2), ep(2, 1), ep(3, 3)}, request({1, 2, 3}));
  EXPECT_EQ(c.kind, Kind::kChosen);
  EXPECT_EQ(c.endpoint, 2);
  // All failed and all saturated: wait.
  EXPECT_EQ(prefill({ep(1, 4, 4)}, request({1})).kind, Kind::kSaturated);
}

TEST(LeastLoadPolicy, PrefersWaitingForAFreshEngineOverAFailedOne) {
  // Engine 2 has not failed the request and is eligible, so it is still "left": the request waits
  // for it rather than going back to the engine that failed it.
  const Choice c = prefill({ep(1, 0), ep(2, 4, 4)}, request({1}));
  EXPECT_EQ(c.kind, Kind::kSaturated);
  EXPECT_EQ(c.endpoint, -1);
}

TEST(LeastLoadPolicy, DecodeStaysInThePrefillGroup) {
  const std::vector<EndpointLoad> pool = {in_group(10, 0, 2), in_group(11, 1, 3),
                                          in_group(12, 1, 1), in_group(13, 2, 0)};
  EXPECT_EQ(decode(pool, 0).endpoint, 10);
  EXPECT_EQ(decode(pool, 1).endpoint, 12);
  EXPECT_EQ(decode(pool, 2).endpoint, 13);
  // Group -1 (aggregated): any group, least loaded overall.
  EXPECT_EQ(decode(pool, -1).endpoint, 13);
}

TEST(LeastLoadPolicy, DecodeGroupWithoutEnginesFailsEvenIfOthersAreFree) {
  const Choice c = decode({in_group(10, 0), in_group(11, 1)}, 5);
  EXPECT_EQ(c.kind, Kind::kNoneEligible);
  EXPECT_EQ(c.endpoint, -1);
  // Only ineligible engines in the group.
  EXPECT_EQ(decode({ineligible(10, 5), in_group(11, 1)}, 5).kind, Kind::kNoneEligible);
}

TEST(LeastLoadPolicy, SaturatedDecodeGroupWaitsRatherThanLeavingTheGroup) {
  const Choice c = decode({in_group(10, 0, 4, 4), in_group(11, 1, 0)}, 0);
  EXPECT_EQ(c.kind, Kind::kSaturated);
  EXPECT_EQ(c.endpoint, -1);
}

TEST(LeastLoadPolicy, DecodeAvoidsFailedEnginesWithinTheGroup) {
  // Engine 11 (group 1) is fresh but outside the group: it does not make 10 "not the last".
  EXPECT_EQ(decode({in_group(10, 0), in_group(11, 1)}, 0, request({10})).endpoint, 10);
  EXPECT_EQ(decode({in_group(10, 0), in_group(12, 0, 3)}, 0, request({10})).endpoint, 12);
}

TEST(ChooseTogether, ChoosesLeastLoadedPrefillAndADecodeOfItsGroup) {
  const PairChoice c = pair({in_group(1, 0, 2), in_group(2, 1, 1)},
                            {in_group(10, 0, 0), in_group(11, 1, 3), in_group(12, 1, 2)});
  EXPECT_EQ(c.kind, Kind::kChosen);
  EXPECT_EQ(c.prefill, 2);
  EXPECT_EQ(c.decode, 12);
}

TEST(ChooseTogether, TriesTheNextPrefillWhenItsGroupHasNoFreeDecode) {
  // Prefill 1 is the least loaded but its group's decode engine is saturated.
  PairChoice c =
      pair({in_group(1, 0, 0), in_group(2, 1, 2)}, {in_group(10, 0, 4, 4), in_group(11, 1, 3)});
  EXPECT_EQ(c.kind, Kind::kChosen);
  EXPECT_EQ(c.prefill, 2);
  EXPECT_EQ(c.decode, 11);
  // Its group has no decode engine at all; nor has the next one's: the third prefill it is.
  c = pair({in_group(1, 0, 0), in_group(2, 1, 1), in_group(3, 2, 2)}, {in_group(10, 2, 0)});
  EXPECT_EQ(c.kind, Kind::kChosen);
  EXPECT_EQ(c.prefill, 3);
  EXPECT_EQ(c.decode, 10);
}

TEST(ChooseTogether, SaturatedWhenWaitingCouldHelp) {
  // The only decode engine of any prefill's group is saturated.
  PairChoice c = pair({in_group(1, 0)}, {in_group(10, 0, 4, 4)});
  EXPECT_EQ(c.kind, Kind::kSaturated);
  EXPECT_EQ(c.prefill, -1);
  EXPECT_EQ(c.decode, -1);
  // One group has no decode engine, the other's is saturated: waiting could help.
  c = pair({in_group(1, 0), in_group(2, 1)}, {in_group(11, 1, 4, 4)});
  EXPECT_EQ(c.kind, Kind::kSaturated);
  // Every prefill engine is saturated.
  c = pair({in_group(1, 0, 4, 4)}, {in_group(10, 0)});
  EXPECT_EQ(c.kind, Kind::kSaturated);
  // The free prefill has no decode; the other prefill (with a free decode) is saturated.
  c = pair({in_group(1, 0, 0), in_group(2, 1, 4, 4)}, {in_group(11, 1)});
  EXPECT_EQ(c.kind, Kind::kSaturated);
}

TEST(ChooseTogether, NoneEligibleWhenNoPairCanEverForm) {
  EXPECT_EQ(pair({}, {}).kind, Kind::kNoneEligible);
  EXPECT_EQ(pair({in_group(1, 0)}, {}).kind, Kind::kNoneEligible);
  EXPECT_EQ(pair({}, {in_group(10, 0)}).kind, Kind::kNoneEligible);
  // Decode engines exist, but in no prefill's group.
  const PairChoice c = pair({in_group(1, 0), in_group(2, 1)}, {in_group(10, 2), in_group(11, 3)});
  EXPECT_EQ(c.kind, Kind::kNoneEligible);
  EXPECT_EQ(c.prefill, -1);
  EXPECT_EQ(c.decode, -1);
}

TEST(ChooseTogether, NeverChoosesIneligibleEngines) {
  // The ineligible prefill's group has the free decode engine; the eligible one's is saturated.
  PairChoice c = pair({ineligible(1, 0), in_group(2, 1)}, {in_group(10, 0), in_group(11, 1, 4, 4)});
  EXPECT_EQ(c.kind, Kind::kSaturated);
  // An ineligible decode engine in the group is not used either.
  c = pair({in_group(1, 0)}, {ineligible(10, 0)});
  EXPECT_EQ(c.kind, Kind::kNoneEligible);
  c = pair({in_group(1, 0)}, {ineligible(10, 0), in_group(11, 0, 3)});
  EXPECT_EQ(c.kind, Kind::kChosen);
  EXPECT_EQ(c.decode, 11);
}

TEST(ChooseTogether, FallsBackToAFailedPrefillWhenNoOtherCanPair) {
  // Prefill 1 failed the request; prefill 2 is fresh but its group has no decode engine.
  const PairChoice c = pair({in_group(1, 0), in_group(2, 1)}, {in_group(10, 0)}, request({1}));
  EXPECT_EQ(c.kind, Kind::kChosen);
  EXPECT_EQ(c.prefill, 1);
  EXPECT_EQ(c.decode, 10);
}

TEST(ChooseTogether, LeavesTheCallersViewAlone) {
  ClusterView v;
  v.prefill = {in_group(1, 0), in_group(2, 1)};
  v.decode = {in_group(11, 1)};
  const PairChoice c = make_least_load_policy()->choose_together(v, request(), Clock::time_point());
  EXPECT_EQ(c.prefill, 2);
  EXPECT_TRUE(v.prefill[0].eligible);
  EXPECT_TRUE(v.prefill[1].eligible);
}

// --------------------------------------------------------------------------------- lifecycle

constexpr int64_t kSecond = 1'000'000'000;

const Phase kAllPhases[] = {
    Phase::kReceived,         Phase::kTokenizing, Phase::kPrefixMatching, Phase::kPrefillWaiting,
    Phase::kPrefillScheduled, Phase::kPrefilling, Phase::kDecodeWaiting,  Phase::kDecodeScheduled,
    Phase::kDecoding,         Phase::kCompleted,
};

TEST(Lifecycle, PhaseNamesInOrder) {
  const char* expected[] = {
      "received",   "tokenizing",     "prefix_matching",  "prefill_waiting", "prefill_scheduled",
      "prefilling", "decode_waiting", "decode_scheduled", "decoding",        "completed"};
  ASSERT_EQ(kPhaseCount, 10);
  for (int i = 0; i < kPhaseCount; ++i) {
    EXPECT_EQ(static_cast<int>(kAllPhases[i]), i);
    EXPECT_STREQ(phase_name(kAllPhases[i]), expected[i]);
  }
}

TEST(Lifecycle, NothingStampedAtFirst) {
  PhaseTimes t;
  for (Phase p : kAllPhases) {
    EXPECT_FALSE(t.at(p).has_value()) << phase_name(p);
    EXPECT_FALSE(t.seconds_in(p).has_value()) << phase_name(p);
  }
  EXPECT_FALSE(t.prefill_done().has_value());
  EXPECT_EQ(t.current(), Phase::kReceived);
  EXPECT_TRUE(t.offsets().is_object());
  EXPECT_TRUE(t.offsets().empty());
}

TEST(Lifecycle, EachStampIsSetOnce) {
  PhaseTimes t;
  t.mark(Phase::kPrefillWaiting, 100);
  t.mark(Phase::kPrefillWaiting, 200);  // a retry re-enters the phase: the first time stays
  EXPECT_EQ(t.at(Phase::kPrefillWaiting), 100);
  t.mark(Phase::kPrefillWaiting);  // the clock's "now" does not overwrite it either
  EXPECT_EQ(t.at(Phase::kPrefillWaiting), 100);
  t.mark_prefill_done(300);
  t.mark_prefill_done(400);
  EXPECT_EQ(t.prefill_done(), 300);
  // Other stamps are untouched.
  EXPECT_FALSE(t.at(Phase::kPrefillScheduled).has_value());
}

TEST(Lifecycle, StampAtZeroStillCounts) {
  PhaseTimes t;
  t.mark(Phase::kTokenizing, 0);
  EXPECT_TRUE(t.at(Phase::kTokenizing).has_value());
  t.mark(Phase::kTokenizing, 500);
  EXPECT_NE(t.at(Phase::kTokenizing), 500);
}

TEST(Lifecycle, MarkWithoutTimeUsesTheSteadyClock) {
  PhaseTimes t;
  const int64_t before = steady_now_ns();
  t.mark(Phase::kReceived);
  const int64_t after = steady_now_ns();
  ASSERT_TRUE(t.at(Phase::kReceived).has_value());
  EXPECT_GE(*t.at(Phase::kReceived), before);
  EXPECT_LE(*t.at(Phase::kReceived), after);
}

TEST(Lifecycle, ConcurrentMarksKeepExactlyOneOfThem) {
  PhaseTimes t;
  std::vector<std::thread> threads;
  for (int i = 1; i <= 8; ++i)
    threads.emplace_back([&t, i] {
      for (int k = 0; k < 100; ++k) t.mark(Phase::kDecoding, i * 1000 + k);
    });
  for (auto& th : threads) th.join();
  ASSERT_TRUE(t.at(Phase::kDecoding).has_value());
  const int64_t v = *t.at(Phase::kDecoding);
  EXPECT_GE(v % 1000, 0);
  EXPECT_LT(v % 1000, 100);
  EXPECT_GE(v / 1000, 1);
  EXPECT_LE(v / 1000, 8);
  // The first mark of a thread wins over its later ones, whichever thread won.
  EXPECT_EQ(v % 1000, 0);
}

TEST(Lifecycle, CurrentIsTheLatestPhaseReached) {
  PhaseTimes t;
  t.mark(Phase::kReceived, 1);
  EXPECT_EQ(t.current(), Phase::kReceived);
  t.mark(Phase::kTokenizing, 2);
  EXPECT_EQ(t.current(), Phase::kTokenizing);
  t.mark(Phase::kPrefillWaiting, 3);  // prefix matching skipped
  EXPECT_EQ(t.current(), Phase::kPrefillWaiting);
  t.mark(Phase::kDecodeWaiting, 4);
  EXPECT_EQ(t.current(), Phase::kDecodeWaiting);
  // The latest in phase order, not in time: a parallel-mode prefill leg stamped afterwards does
  // not move the request back.
  t.mark(Phase::kPrefilling, 5);
  EXPECT_EQ(t.current(), Phase::kDecodeWaiting);
  t.mark_prefill_done(6);  // not a phase
  EXPECT_EQ(t.current(), Phase::kDecodeWaiting);
  t.mark(Phase::kCompleted, 7);
  EXPECT_EQ(t.current(), Phase::kCompleted);
}

TEST(Lifecycle, SecondsInFollowsTheTracks) {
  PhaseTimes t;
  // Every stamp a distinct number of seconds after the previous one, so that a phase measured
  // against the wrong end gives a different duration.
  t.mark(Phase::kReceived, 10 * kSecond);
  t.mark(Phase::kTokenizing, 11 * kSecond);        // received: 1
  t.mark(Phase::kPrefixMatching, 13 * kSecond);    // tokenizing: 2
  t.mark(Phase::kPrefillWaiting, 16 * kSecond);    // prefix_matching: 3
  t.mark(Phase::kPrefillScheduled, 20 * kSecond);  // prefill_waiting: 4
  t.mark(Phase::kPrefilling, 25 * kSecond);        // prefill_scheduled: 5
  t.mark(Phase::kDecodeWaiting, 26 * kSecond);     // (decode leg starts while prefilling)
  t.mark(Phase::kDecodeScheduled, 33 * kSecond);   // decode_waiting: 7
  t.mark_prefill_done(31 * kSecond);               // prefilling: 6 (not 1, to decode_waiting)
  t.mark(Phase::kDecoding, 41 * kSecond);          // decode_scheduled: 8
  t.mark(Phase::kCompleted, 50 * kSecond);         // decoding: 9
  const std::pair<Phase, double> expected[] = {
      {Phase::kReceived, 1},       {Phase::kTokenizing, 2},       {Phase::kPrefixMatching, 3},
      {Phase::kPrefillWaiting, 4}, {Phase::kPrefillScheduled, 5}, {Phase::kPrefilling, 6},
      {Phase::kDecodeWaiting, 7},  {Phase::kDecodeScheduled, 8},  {Phase::kDecoding, 9},
  };
  for (const auto& [phase, seconds] : expected) {
    ASSERT_TRUE(t.seconds_in(phase).has_value()) << phase_name(phase);
    EXPECT_DOUBLE_EQ(*t.seconds_in(phase), seconds) << phase_name(phase);
  }
  EXPECT_FALSE(t.seconds_in(Phase::kCompleted).has_value());  // the end, not a span
}

TEST(Lifecycle, SecondsInIsEmptyUntilThePhaseEnds) {
  PhaseTimes t;
  t.mark(Phase::kPrefilling, 5 * kSecond);
  t.mark(Phase::kDecodeWaiting, 6 * kSecond);
  t.mark(Phase::kCompleted, 9 * kSecond);
  // Prefilling ends at the prefill leg's end only, not at the next phase or at completion.
  EXPECT_FALSE(t.seconds_in(Phase::kPrefilling).has_value());
  // Decode waiting ends at decode_scheduled only.
  EXPECT_FALSE(t.seconds_in(Phase::kDecodeWaiting).has_value());
  // Decoding has an end but no start.
  EXPECT_FALSE(t.seconds_in(Phase::kDecoding).has_value());
  t.mark(Phase::kDecoding, 7 * kSecond);
  EXPECT_DOUBLE_EQ(t.seconds_in(Phase::kDecoding).value_or(-1), 2.0);
  t.mark_prefill_done(8 * kSecond);
  EXPECT_DOUBLE_EQ(t.seconds_in(Phase::kPrefilling).value_or(-1), 3.0);
}

TEST(Lifecycle, SecondsInIsEmptyWhenTheEndIsEarlier) {
  PhaseTimes t;
  t.mark(Phase::kPrefilling, 5 * kSecond);
  t.mark_prefill_done(4 * kSecond);
  EXPECT_FALSE(t.seconds_in(Phase::kPrefilling).has_value());
  t.mark(Phase::kTokenizing, 3 * kSecond);
  t.mark(Phase::kPrefixMatching, 3 * kSecond);  // an instant phase is zero, not empty
  EXPECT_DOUBLE_EQ(t.seconds_in(Phase::kTokenizing).value_or(-1), 0.0);
}

TEST(Lifecycle, OffsetsAreSecondsSinceReceivedOfStampedPhases) {
  PhaseTimes t;
  t.mark(Phase::kReceived, 5 * kSecond);
  t.mark(Phase::kTokenizing, 5 * kSecond + kSecond / 4);
  t.mark(Phase::kPrefilling, 5 * kSecond + kSecond / 2);
  t.mark_prefill_done(6 * kSecond);
  t.mark(Phase::kCompleted, 7 * kSecond);
  const nlohmann::json o = t.offsets();
  ASSERT_TRUE(o.is_object());
  EXPECT_EQ(o.size(), 5u) << o.dump();
  EXPECT_DOUBLE_EQ(o.value("received", -1.0), 0.0);
  EXPECT_DOUBLE_EQ(o.value("tokenizing", -1.0), 0.25);
  EXPECT_DOUBLE_EQ(o.value("prefilling", -1.0), 0.5);
  EXPECT_DOUBLE_EQ(o.value("prefill_done", -1.0), 1.0);
  EXPECT_DOUBLE_EQ(o.value("completed", -1.0), 2.0);
  for (const char* absent : {"prefix_matching", "prefill_waiting", "prefill_scheduled",
                             "decode_waiting", "decode_scheduled", "decoding"})
    EXPECT_FALSE(o.contains(absent)) << absent;
}

TEST(Lifecycle, OffsetsNeedTheReceivedStamp) {
  PhaseTimes t;
  t.mark(Phase::kTokenizing, 5 * kSecond);
  t.mark_prefill_done(6 * kSecond);
  EXPECT_TRUE(t.offsets().is_object());
  EXPECT_TRUE(t.offsets().empty()) << t.offsets().dump();
}

// ------------------------------------------------------------------------- scheduling thread

using SchedClock = SchedulingThread::Clock;
using tandem::testing::get_within;
using tandem::testing::kHangGuard;

// Blocks until the scheduling thread has run everything posted before this call.
void flush(SchedulingThread& s) {
  std::promise<void> done;
  s.post([&done] { done.set_value(); });
  auto ran = done.get_future();
  get_within(ran, kHangGuard, "the scheduling thread never ran a posted task");
}

TEST(SchedulingThread, RunsPostedTasksOnItsThread) {
  SchedulingThread s;
  s.start();
  EXPECT_FALSE(s.on_thread());
  std::promise<std::pair<bool, std::thread::id>> where;
  s.post([&] { where.set_value({s.on_thread(), std::this_thread::get_id()}); });
  auto ran = where.get_future();
  const auto [on_thread, id] = get_within(ran, kHangGuard, "the posted task never ran");
  EXPECT_TRUE(on_thread);
  EXPECT_NE(id, std::this_thread::get_id());
  s.stop();
  EXPECT_FALSE(s.on_thread());
}

TEST(SchedulingThread, TasksPostedBeforeStartRunOnItsThread) {
  // Repeated: the task runs as soon as the thread starts, racing with start() itself.
  for (int round = 0; round < 50; ++round) {
    SchedulingThread s;
    std::promise<bool> on_thread;
    s.post([&] { on_thread.set_value(s.on_thread()); });
    s.start();
    auto ran = on_thread.get_future();
    ASSERT_TRUE(get_within(ran, kHangGuard, "a task posted before start never ran"))
        << "round " << round;
    s.stop();
  }
}

TEST(SchedulingThread, EveryTaskFromManyProducersRunsOnceInProducerOrder) {
  constexpr int kProducers = 8, kTasks = 2000;
  SchedulingThread s;
  s.start();
  // Only touched on the scheduling thread; read here after stop() joined it.
  std::vector<std::vector<int>> seen(kProducers);
  std::atomic<int> off_thread{0};
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p)
    producers.emplace_back([&, p] {
      for (int i = 0; i < kTasks; ++i)
        s.post([&, p, i] {
          if (!s.on_thread()) ++off_thread;
          seen[p].push_back(i);
        });
    });
  for (auto& t : producers) t.join();
  s.stop();  // everything was posted before: all of it runs
  EXPECT_EQ(off_thread.load(), 0);
  for (int p = 0; p < kProducers; ++p) {
    ASSERT_EQ(seen[p].size(), static_cast<size_t>(kTasks)) << "producer " << p;
    for (int i = 0; i < kTasks; ++i) ASSERT_EQ(seen[p][i], i) << "producer " << p;
  }
}

TEST(SchedulingThread, StopRunsWhatWasPostedBeforeIt) {
  for (int round = 0; round < 20; ++round) {
    SchedulingThread s;
    s.start();
    int ran = 0;  // scheduling thread only, read after the join
    for (int i = 0; i < 500; ++i) s.post([&ran] { ++ran; });
    s.stop();
    ASSERT_EQ(ran, 500) << "round " << round;
  }
}

TEST(SchedulingThread, StopIsIdempotent) {
  SchedulingThread s;
  s.stop();  // before start: nothing to stop
  s.start();
  std::atomic<int> ran{0};
  s.post([&] { ++ran; });
  s.stop();
  s.stop();
  EXPECT_EQ(ran.load(), 1);
}  // and the destructor stops once more

TEST(SchedulingThread, TasksPostedAfterStopAreDroppedAndFreed) {
  auto token = std::make_shared<int>(0);
  std::weak_ptr<int> watch = token;
  std::atomic<int> ran{0};
  {
    SchedulingThread s;
    s.start();
    flush(s);
    s.stop();
    s.post([&ran, token] { ++ran; });
    token.reset();
    s.post([&ran] { ++ran; });
    s.stop();
    EXPECT_EQ(ran.load(), 0);
  }
  EXPECT_EQ(ran.load(), 0);
  EXPECT_TRUE(watch.expired()) << "a dropped task was never destroyed";
}

struct Fired {
  std::string name;
  SchedClock::time_point when, ran;
};

TEST(SchedulingThread, TimersFireInTimeOrderAndNotEarly) {
  SchedulingThread s;
  s.start();
  std::vector<Fired> fired;  // scheduling thread only until `all` is set
  std::promise<void> all;
  constexpr size_t kTimers = 7;
  auto arm = [&](const std::string& name, SchedClock::time_point when) {
    s.at(when, [&, name, when] {
      EXPECT_TRUE(s.on_thread());
      fired.push_back({name, when, SchedClock::now()});
      if (fired.size() == kTimers) all.set_value();
    });
  };
  s.post([&] {
    const auto now = SchedClock::now();
    using std::chrono::milliseconds;
    arm("c", now + milliseconds(30));
    arm("a", now + milliseconds(10));
    arm("past", now - milliseconds(5));
    arm("b", now + milliseconds(20));
    // Equal times run in the order they were armed.
    arm("t1", now + milliseconds(25));
    arm("t2", now + milliseconds(25));
    arm("t3", now + milliseconds(25));
  });
  auto all_fired = all.get_future();
  get_within(all_fired, kHangGuard, "not every timer fired");
  s.stop();
  std::vector<std::string> order;
  for (const auto& f : fired) {
    order.push_back(f.name);
    EXPECT_GE(f.ran, f.when) << f.name << " fired before its time";
  }
  EXPECT_EQ(order, (std::vector<std::string>{"past", "a", "b", "t1", "t2", "t3", "c"}));
}

TEST(SchedulingThread, TimersCanArmTimersAndPostedTasksStillRun) {
  SchedulingThread s;
  s.start();
  std::promise<std::vector<std::string>> result;
  std::vector<std::string> log;  // scheduling thread only
  s.post([&] {
    const auto first = SchedClock::now() + std::chrono::milliseconds(5);
    s.at(first, [&, first] {
      log.push_back(SchedClock::now() >= first ? "first" : "first-early");
      const auto second = SchedClock::now() + std::chrono::milliseconds(5);
      s.at(second, [&, second] {
        log.push_back(SchedClock::now() >= second ? "second" : "second-early");
        result.set_value(log);
      });
      // A post from a timer task runs too: posted work is drained before the next timer pass.
      s.post([&] { log.push_back("posted"); });
    });
  });
  auto logged = result.get_future();
  const auto got = get_within(logged, kHangGuard, "the second timer never fired");
  s.stop();
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0], "first");
  EXPECT_EQ(got[2], "second");
  EXPECT_EQ(got[1], "posted");
}

TEST(SchedulingThread, CancelledTimersNeverRunAndFreeTheirTasksAtOnce) {
  SchedulingThread s;
  s.start();
  std::promise<std::vector<std::string>> result;
  std::vector<std::string> log;  // scheduling thread only
  s.post([&] {
    const auto now = SchedClock::now();
    using std::chrono::milliseconds;
    auto token = std::make_shared<int>(0);  // held by the late timer's task only
    const std::weak_ptr<int> watch = token;
    const auto late =
        s.at(now + std::chrono::hours(1), [&log, t = std::move(token)] { log.push_back("late"); });
    const auto soon = s.at(now + milliseconds(5), [&log] { log.push_back("cancelled"); });
    // The same time as `soon`: cancelling one timer must not drop its twin.
    s.at(now + milliseconds(5), [&log] { log.push_back("twin"); });
    s.cancel(soon);
    s.cancel(late);
    s.cancel(late);                         // twice: ignored
    s.cancel(SchedulingThread::TimerId{});  // none: ignored
    log.push_back(watch.expired() ? "freed" : "kept");
    s.at(now + milliseconds(10), [&, soon] {
      // A timer that fired can be cancelled afterwards without effect.
      s.cancel(soon);
      result.set_value(log);
    });
  });
  auto logged = result.get_future();
  const auto got = get_within(logged, kHangGuard, "the last timer never fired");
  s.stop();
  EXPECT_EQ(got, (std::vector<std::string>{"freed", "twin"}));
}

// A timer's task ran outside the guard posted tasks have: one that threw ended the scheduling
// thread, and with it the gateway (std::terminate).
TEST(SchedulingThread, TasksAndTimersThatThrowAreReportedAndTheThreadGoesOn) {
  SchedulingThread s;
  s.start();
  std::promise<std::vector<std::string>> result;
  std::vector<std::string> log;  // scheduling thread only
  s.post([] { throw std::runtime_error("a posted task's failure"); });
  s.post([&] {
    const auto now = SchedClock::now();
    s.at(now, [] { throw std::runtime_error("a timer's failure"); });
    s.at(now, [] { throw 42; });  // not even a std::exception
    s.at(now, [&] {
      log.push_back("timer");
      s.post([&] {
        log.push_back("posted");
        result.set_value(log);
      });
    });
  });
  auto logged = result.get_future();
  const auto got = get_within(logged, kHangGuard, "the task posted by the last timer never ran");
  s.stop();
  EXPECT_EQ(got, (std::vector<std::string>{"timer", "posted"}));
}

TEST(SchedulingThread, StopDropsPendingTimers) {
  auto token = std::make_shared<int>(0);
  std::weak_ptr<int> watch = token;
  std::atomic<int> ran{0};
  SchedulingThread s;
  s.start();
  std::promise<void> armed;
  s.post([&, token] {
    s.at(SchedClock::now() + std::chrono::hours(1), [&ran, token] { ++ran; });
    armed.set_value();
  });
  token.reset();
  auto armed_now = armed.get_future();
  get_within(armed_now, kHangGuard, "the task arming the timer never ran");
  s.stop();  // returns without waiting for the hour
  EXPECT_EQ(ran.load(), 0);
  EXPECT_TRUE(watch.expired()) << "the dropped timer's task was kept";
}

}  // namespace
}  // namespace tandem::gateway
