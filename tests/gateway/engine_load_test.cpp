// The gateway's reading of engine load reports (engine_load.h; the report's JSON itself is tested
// in tests/api/load_report_test.cpp): step durations learned once each (again after an engine
// restart), and the policy fields filled from a fresh report, the gateway's own counts, or neither
// when the report is stale.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "api/load_report_samples.h"
#include "gateway/engine_load.h"
#include "util/error.h"

namespace tandem::gateway {
namespace {

using std::chrono::milliseconds;

constexpr const char* kReport = api::samples::kRunningStepReport;

std::string error_of(const std::string& body) {
  try {
    api::parse_load_report(body);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(EngineLoad, StepsAreLearnedOnceAndAgainAfterARestart) {
  const auto t0 = Clock::time_point{} + std::chrono::hours(1);
  EngineLoadState s = absorb({}, api::parse_load_report(kReport), {}, t0, {});
  EXPECT_TRUE(s.known);
  EXPECT_EQ(s.batch_time.observations, 3);
  EXPECT_EQ(s.last_step, 17u);
  EXPECT_NEAR(estimate_batch_s(s.batch_time, 2, 2048), 0.25, 1e-9);
  // The next poll overlaps the last: only step 18 is new.
  LoadReport next = api::parse_load_report(kReport);
  next.recent_steps = {{16, 2, 2048, 0.25}, {17, 2, 2048, 0.25}, {18, 2, 2048, 0.25}};
  s = absorb(std::move(s), next, {}, t0, {});
  EXPECT_EQ(s.batch_time.observations, 4);
  // A restarted engine counts from 1 again: its steps are new, not ignored as old.
  LoadReport restarted = api::parse_load_report(kReport);
  restarted.recent_steps = {{1, 1, 512, 0.1}, {2, 1, 512, 0.1}};
  s = absorb(std::move(s), restarted, {}, t0, {});
  EXPECT_EQ(s.batch_time.observations, 6);
  EXPECT_EQ(s.last_step, 2u);
}

// One process's step count and indices only grow: a report where either went back is another
// process's, even one that has run no step yet and lists none.
TEST(EngineLoad, AReportWhoseStepsWentBackIsARestart) {
  const auto t0 = Clock::time_point{} + std::chrono::hours(1);
  const LoadReport first = api::parse_load_report(kReport);
  EXPECT_FALSE(reports_a_restart({}, first));  // nothing to compare with
  const EngineLoadState s = absorb({}, first, {}, t0, {});
  EXPECT_FALSE(reports_a_restart(s, first));  // idle between two polls

  LoadReport later = first;
  later.steps = first.steps + 5;
  later.recent_steps.clear();  // a poll asking only for steps it has not seen
  EXPECT_FALSE(reports_a_restart(s, later));

  LoadReport fresh = first;
  fresh.steps = 0;
  fresh.recent_steps.clear();
  EXPECT_TRUE(reports_a_restart(s, fresh));

  // An engine that reports no step count still numbers its steps.
  EngineLoadState uncounted = s;
  uncounted.report.steps = 0;
  LoadReport renumbered = first;
  renumbered.steps = 0;
  renumbered.recent_steps = {{1, 1, 512, 0.1}};
  EXPECT_TRUE(reports_a_restart(uncounted, renumbered));
}

// A report naming another process instance is a restart whatever its steps say; the same
// instance is judged by its steps, as is an engine that names none.
TEST(EngineLoad, AReportOfAnotherInstanceIsARestart) {
  const auto t0 = Clock::time_point{} + std::chrono::hours(1);
  LoadReport first = api::parse_load_report(kReport);
  first.instance = "9f3c0a1b2c3d4e5f";
  const EngineLoadState s = absorb({}, first, {}, t0, {});

  LoadReport busier = first;  // the new process ran more steps than the old one had
  busier.instance = "0123456789abcdef";
  busier.steps = first.steps + 100;
  busier.recent_steps = {{first.steps + 100, 1, 512, 0.1}};
  EXPECT_TRUE(reports_a_restart(s, busier));
  // The steps it lists are all learned, those numbered at or below the old process's last too
  // (a live poll asks only for steps after that one, so it lists them only when it sends all).
  busier.recent_steps = {{3, 1, 512, 0.1}, {first.steps + 100, 1, 512, 0.1}};
  const EngineLoadState after = absorb(s, busier, {}, t0, {});
  EXPECT_EQ(after.batch_time.observations, s.batch_time.observations + 2);

  LoadReport same = busier;
  same.instance = first.instance;
  EXPECT_FALSE(reports_a_restart(s, same));
  same.steps = 0;  // one process's steps do not go back; if they do, it is another
  same.recent_steps.clear();
  EXPECT_TRUE(reports_a_restart(s, same));

  // A report without an instance after one with it comes from another server at the address.
  LoadReport unnamed = busier;
  unnamed.instance.clear();
  EXPECT_TRUE(reports_a_restart(s, unnamed));
}

TEST(EngineLoad, FillsThePolicyFieldsFromAFreshReportOnly) {
  const auto t0 = Clock::time_point{} + std::chrono::hours(1);
  GatewayCounts counts;
  counts.uncached_in_flight = {9000, 0};
  counts.launched_total = {50000, 0};

  // No report: only the gateway's own count of prefill work in flight.
  EndpointLoad none;
  fill_load(none, {}, counts, t0, milliseconds(400));
  EXPECT_EQ(none.queued_prefill_tokens, 9000);
  EXPECT_EQ(none.queued_prefill_pairs, 0);  // the gateway counted no pairs here
  EXPECT_EQ(none.running_seqs, -1);
  EXPECT_EQ(none.free_kv_blocks, -1);
  EXPECT_EQ(none.batch_time, nullptr);
  EXPECT_LT(none.time_until_free_s, 0);

  // A report whose poll left when the gateway had launched 49000 tokens there: 1000 launched
  // since are not in its queue of 6000.
  EngineLoadState s = absorb({}, api::parse_load_report(kReport), {49000, 0}, t0, {});
  s.finished_at_report = counts.launched_total - counts.uncached_in_flight;  // when it arrived
  EndpointLoad fresh;
  fill_load(fresh, s, counts, t0 + milliseconds(50), milliseconds(400));
  EXPECT_EQ(fresh.queued_prefill_tokens, 7000);
  EXPECT_EQ(fresh.running_seqs, 2);
  EXPECT_EQ(fresh.context_tokens, 5000);
  EXPECT_EQ(fresh.free_kv_blocks, 900);
  EXPECT_EQ(fresh.total_kv_blocks, 1024);
  EXPECT_EQ(fresh.kv_block_size, 16);
  EXPECT_EQ(fresh.max_batch_tokens, 2048);
  EXPECT_FALSE(fresh.schedules_by_priority);  // the sample does not say it does
  EXPECT_EQ(fresh.batch_time, &s.batch_time);
  // The running step takes 0.25 s, has run 0.05 s at the report and 0.05 s since.
  EXPECT_NEAR(fresh.time_until_free_s, 0.15, 1e-9);

  // The report wins over the gateway's own count, also when that is lower: the engine may be
  // computing a prefix the gateway took as cached (evicted while the request waited there), and
  // an engine taken as idle while it computes 100K tokens would draw every request.
  GatewayCounts believed = counts;
  believed.uncached_in_flight = {2500, 0};
  EngineLoadState believed_state = s;
  believed_state.finished_at_report = believed.launched_total - believed.uncached_in_flight;
  EndpointLoad reported;
  fill_load(reported, believed_state, believed, t0 + milliseconds(50), milliseconds(400));
  EXPECT_EQ(reported.queued_prefill_tokens, 7000);

  // Legs that finished after the report arrived no longer count: 6500 of the 9000 tokens in
  // flight there finished since.
  GatewayCounts later = counts;
  later.uncached_in_flight = {2500, 0};
  EndpointLoad after;
  fill_load(after, s, later, t0 + milliseconds(50), milliseconds(400));
  EXPECT_EQ(after.queued_prefill_tokens, 500);
  later.uncached_in_flight = {0, 0};  // never below nothing
  fill_load(after, s, later, t0 + milliseconds(50), milliseconds(400));
  EXPECT_EQ(after.queued_prefill_tokens, 0);

  // A report older than max_age is not used.
  EndpointLoad stale;
  fill_load(stale, s, counts, t0 + milliseconds(401), milliseconds(400));
  EXPECT_EQ(stale.queued_prefill_tokens, 9000);
  EXPECT_EQ(stale.running_seqs, -1);
  EXPECT_EQ(stale.batch_time, nullptr);
  // How the engine schedules still holds: its next report would say if that changed.
  EngineLoadState by_priority = s;
  by_priority.report.schedules_by_priority = true;
  EndpointLoad stale_by_priority;
  fill_load(stale_by_priority, by_priority, counts, t0 + milliseconds(401), milliseconds(400));
  EXPECT_TRUE(stale_by_priority.schedules_by_priority);
}

// Engines report attention pairs: of the queue, of the running step and of each recent step. The
// pairs of the queue get the same corrections for unreported and finished legs as its tokens;
// reports without pairs leave them unknown.
TEST(EngineLoad, CarriesAttentionPairs) {
  const auto t0 = Clock::time_point{} + std::chrono::hours(1);
  const LoadReport old = api::parse_load_report(kReport);
  EXPECT_EQ(old.prefill_pairs, -1);
  EXPECT_EQ(old.step_prefill_pairs, -1);
  EXPECT_EQ(old.recent_steps[0].prefill_pairs, -1);
  const std::string with_pairs = R"({"prefill_tokens":6000,"prefill_pairs":50000000,
    "step":{"seqs":1,"tokens":2048,"prefill_pairs":9000000,"running_for_s":0.05},
    "recent_steps":[[1,1,2048,0.25,2098176],[2,1,2048,0.30,6292480]]})";
  const LoadReport r = api::parse_load_report(with_pairs);
  EXPECT_EQ(r.prefill_pairs, 50000000);
  EXPECT_EQ(r.step_prefill_pairs, 9000000);
  ASSERT_EQ(r.recent_steps.size(), 2u);
  EXPECT_EQ(r.recent_steps[1].prefill_pairs, 6292480);
  EXPECT_NE(error_of(R"({"recent_steps":[[1,1,64,0.1,-5]]})").find("recent_steps[0]"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"recent_steps":[[1,1,64,0.1,5,6]]})").find("recent_steps[0]"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"prefill_pairs":1.5})").find("prefill_pairs"), std::string::npos);

  // The poll left when 1000 tokens (3M pairs) launched since were not yet in; 500 tokens (1M
  // pairs) finished after the report arrived.
  GatewayCounts counts;
  counts.launched_total = {50000, 40000000};
  counts.uncached_in_flight = {9000, 8000000};
  EngineLoadState s = absorb({}, r, {49000, 37000000}, t0, {});
  EXPECT_EQ(s.batch_time.pair_fit.count, 2);  // the steps fed the pairs model
  s.finished_at_report = counts.launched_total - counts.uncached_in_flight;
  s.finished_at_report -= {500, 1000000};
  EndpointLoad load;
  fill_load(load, s, counts, t0, milliseconds(400));
  EXPECT_EQ(load.queued_prefill_tokens, 6000 + 1000 - 500);
  EXPECT_EQ(load.queued_prefill_pairs, 50000000 + 3000000 - 1000000);
  EndpointLoad without;
  fill_load(without, absorb({}, old, {49000, 37000000}, t0, {}), counts, t0, milliseconds(400));
  EXPECT_EQ(without.queued_prefill_pairs, -1);
  // A late report: the gateway's own counts, tokens and pairs, so the engine is not costed in
  // tokens only next to peers whose reports count attention.
  EndpointLoad late;
  fill_load(late, s, counts, t0 + milliseconds(401), milliseconds(400));
  EXPECT_EQ(late.queued_prefill_tokens, 9000);
  EXPECT_EQ(late.queued_prefill_pairs, 8000000);
}

// The tandem policy reads what the reports say: of two engines with the same gateway-side load,
// the one whose report shows a long prefill queue and a slow running step is avoided.
TEST(EngineLoad, TheTandemPolicyAvoidsTheEngineReportedBusy) {
  const auto t0 = Clock::time_point{} + std::chrono::hours(1);
  GatewayCounts counts;
  counts.uncached_in_flight = {8000, 0};
  counts.launched_total = {8000, 0};
  LoadReport busy = api::parse_load_report(kReport);
  busy.prefill_tokens = 8000;
  LoadReport light = api::parse_load_report(kReport);
  light.prefill_tokens = 0;
  light.step_seqs = 0;
  const EngineLoadState a = absorb({}, busy, {8000, 0}, t0, {});
  const EngineLoadState b = absorb({}, light, {8000, 0}, t0, {});
  ClusterView view;
  for (const auto& [id, state] : {std::pair{0, &a}, std::pair{1, &b}}) {
    EndpointLoad e;
    e.id = id;
    e.in_flight = 1;
    e.max_in_flight = 100;
    e.tokens_in_flight = 8000;
    fill_load(e, *state, counts, t0, milliseconds(400));
    view.prefill.push_back(e);
  }
  RequestInfo request;
  request.prompt_tokens = 1000;
  const auto policy = make_policy("tandem");
  const Choice c = policy->choose_prefill(view, request, t0);
  ASSERT_EQ(c.kind, Choice::Kind::kChosen);
  EXPECT_EQ(c.endpoint, 1);
}

// An aggregated engine's sequences still to prefill: those it reports waiting plus the legs
// launched since the poll its report answers, of which no more than are still in flight.
TEST(EngineLoad, SequencesToPrefillAreTheReportedWaitingPlusTheLegsLaunchedSinceItsPoll) {
  const auto t0 = Clock::time_point{} + std::chrono::hours(1);
  LoadReport r = api::parse_load_report(kReport);
  r.running = 60;
  r.waiting = 40;
  EngineLoadState s = absorb({}, r, {}, t0, {});
  s.legs_launched_at_poll = 42;
  GatewayCounts counts;
  counts.legs_launched = 42;
  EXPECT_EQ(queued_prefill_seqs(s, counts, 42, t0, milliseconds(400)), 40);
  counts.legs_launched = 45;
  EXPECT_EQ(queued_prefill_seqs(s, counts, 45, t0, milliseconds(400)), 43);
  // Two of the three already finished: at most the legs in flight are unreported.
  EXPECT_EQ(queued_prefill_seqs(s, counts, 1, t0, milliseconds(400)), 41);
  EXPECT_EQ(queued_prefill_seqs(s, counts, 45, t0 + milliseconds(401), milliseconds(400)), -1);
  EXPECT_EQ(queued_prefill_seqs({}, counts, 45, t0, milliseconds(400)), -1);
}

// An engine takes requests in only between steps: those handed to it during a long step are in
// neither its report's waiting nor its running, and the legs launched before the last poll are
// not "since the poll" either. This gateway's own legs the engine does not report running are
// still to prefill (a review of d80f898: 40 legs sent during a 1 s step read as none).
TEST(EngineLoad, LegsTheEngineHasNotTakenInDuringALongStepAreStillToPrefill) {
  const auto t0 = Clock::time_point{} + std::chrono::hours(1);
  LoadReport r = api::parse_load_report(kReport);
  r.running = 8;
  r.waiting = 0;
  EngineLoadState s = absorb({}, r, {}, t0, {});
  s.legs_launched_at_poll = 48;
  GatewayCounts counts;
  counts.legs_launched = 48;
  EXPECT_EQ(queued_prefill_seqs(s, counts, 48, t0, milliseconds(400)), 40);
}

}  // namespace
}  // namespace tandem::gateway
