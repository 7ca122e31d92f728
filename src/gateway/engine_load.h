#pragma once
// What the gateway knows of an engine's load between two of its reports: a tandem engine's
// GET /load (running and waiting sequences, free KV, the prefill tokens queued behind the step
// that runs now, and its recent step durations), folded into a per-engine state the scheduling
// thread owns, and turned into the policy's EndpointLoad fields. Pure functions; the clock is
// passed in.
#include <chrono>
#include <cstdint>
#include <string_view>
#include <vector>

#include "api/load_report.h"
#include "api/prefill_work.h"
#include "gateway/policy.h"

namespace tandem::gateway {

// A parsed GET /load answer (api/load_report.h).
using api::LoadReport;

// Uncached prompt work, as the gateway counts it: tokens and their causal attention pairs.
using api::PrefillWork;

// The scheduling thread's record of one engine's reports.
struct EngineLoadState {
  bool known = false;  // a report has arrived
  LoadReport report;
  Clock::time_point received{};  // when it arrived
  // The gateway's count of uncached prompt tokens launched on the engine that the report is taken
  // to include (the count when the poll before the one that brought it was sent: a leg launched
  // just before a poll may still be on its way into the engine when it answers).
  PrefillWork launched_at_poll;
  // The gateway's count of uncached prompt tokens of legs finished there when the report
  // arrived: legs finishing after it no longer count against the report's queue.
  PrefillWork finished_at_report;
  // The gateway's count of legs launched on the engine that the report is taken to include (as
  // launched_at_poll).
  int64_t legs_launched_at_poll = 0;
  uint64_t last_step = 0;  // the newest step index already observed
  BatchTimeEstimator batch_time;
};

// Whether `report` comes from another process than the reports before it, which restarted with an
// empty prefix cache and a new step history: it names another process `instance` (a Tandem engine
// names its own in each report, however many steps the new process has run), or its step count or
// step indices went back (one process's only grow; the only sign from an engine that names no
// instance, which cannot show a restart whose new process has already run more steps than the old
// one had). An engine ejected while it restarted is polled while ejected, so its first report
// usually shows it before its readmission; a request routed between its readmission and its next
// report may still follow its old prefixes, which costs a prefill, never a wrong answer. Only an
// engine whose reports cannot tell is taken as restarted on readmission, endpoints.h.
bool reports_a_restart(const EngineLoadState& state, const LoadReport& report);

// The state after a report: its steps newer than `last_step` become batch-time observations (a
// restarted engine, reports_a_restart, is observed from its first step again).
EngineLoadState absorb(EngineLoadState state, LoadReport report, PrefillWork launched_at_poll,
                       Clock::time_point received, const BatchTimeOptions& prior);

// What the gateway counts itself for one engine.
struct GatewayCounts {
  PrefillWork uncached_in_flight;  // uncached prompt work of its prefill legs in flight there
  PrefillWork launched_total;      // uncached prompt work ever launched there
  int64_t legs_launched = 0;       // legs ever launched there
};

// What the gateway had launched on an engine when a load poll left (GatewayCounts): the report
// that poll's successor brings is taken to include these, not those launched after.
struct LaunchedAtPoll {
  PrefillWork work;
  int64_t legs = 0;
};

// Fills `load`'s report-based fields (queued prefill tokens and pairs, running sequences, held
// tokens, KV blocks, block size, batch budget, time until free, batch-time estimator) from `state`
// at `now`. A state without a report, or one older than `max_age`, leaves the fields unknown except
// queued_prefill_tokens and queued_prefill_pairs, which then are the gateway's own counts (a fresh
// report without pairs leaves the pairs unknown). The estimator is pointed to only
// once it has observations (the policy's prior otherwise); `load` must not outlive `state`.
void fill_load(EndpointLoad& load, const EngineLoadState& state, const GatewayCounts& counts,
               Clock::time_point now, Clock::duration max_age);

// The sequences an engine that prefills and decodes its requests (aggregated mode) has still to
// prefill, for EndpointLoad::queued_prefill_seqs: those its report says wait, which counts every
// client's (other gateways' too) and each of a request's n sequences, plus the legs this gateway
// launched there since the poll the report is taken to include (at most the `in_flight` legs it
// has there), and at least this gateway's legs there that the report does not count running
// (handed to the engine during a long step, they are in neither its waiting nor its running).
// -1 without a report no older than `max_age`: the gateway cannot tell which of its
// legs the engine has started (it does not see their first tokens), and the caller counts every
// leg in flight.
int64_t queued_prefill_seqs(const EngineLoadState& state, const GatewayCounts& counts,
                            int64_t in_flight, Clock::time_point now, Clock::duration max_age);

}  // namespace tandem::gateway
