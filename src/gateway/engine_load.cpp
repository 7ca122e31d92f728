#include "gateway/engine_load.h"

#include <algorithm>
#include <cmath>

namespace tandem::gateway {
bool reports_a_restart(const EngineLoadState& state, const LoadReport& report) {
  if (!state.known) return false;
  // Another process, however many steps it has run; a report that names none after one that did
  // (or the other way round) comes from another server at the address.
  if (report.instance != state.report.instance) return true;
  // The step count says it even when the new process has run no step yet (and lists none).
  if (report.steps < state.report.steps) return true;
  return !report.recent_steps.empty() && report.recent_steps.back().index < state.last_step;
}

EngineLoadState absorb(EngineLoadState state, LoadReport report, PrefillWork launched_at_poll,
                       Clock::time_point received, const BatchTimeOptions& prior) {
  if (!state.known) state.batch_time.options = prior;
  if (reports_a_restart(state, report)) state.last_step = 0;
  for (const auto& s : report.recent_steps) {
    if (s.index <= state.last_step) continue;
    state.batch_time =
        observe(std::move(state.batch_time), s.seqs, s.tokens, s.seconds, s.prefill_pairs);
    state.last_step = s.index;
  }
  state.known = true;
  state.report = std::move(report);
  state.received = received;
  state.launched_at_poll = launched_at_poll;
  return state;
}

void fill_load(EndpointLoad& load, const EngineLoadState& state, const GatewayCounts& counts,
               Clock::time_point now, Clock::duration max_age) {
  // Without a fresh report, the gateway's own count of what it has in flight there, pairs
  // included: an engine whose report is late must not look cheaper than its peers because its
  // cost is read in tokens only while theirs counts attention.
  load.queued_prefill_tokens = std::max<int64_t>(counts.uncached_in_flight.tokens, 0);
  load.queued_prefill_pairs = std::max<int64_t>(counts.uncached_in_flight.pairs, 0);
  // How the engine schedules is a property of its process, not of the load: a late report still
  // says it (without it a request would go with no priority, which such an engine runs first).
  load.schedules_by_priority = state.known && state.report.schedules_by_priority;
  if (!state.known || now - state.received > max_age) return;
  const LoadReport& r = state.report;
  // The report's queue plus what was launched after its poll left, less the legs that finished
  // after it arrived. Not capped by the gateway's own count of tokens in flight: that misses work
  // the gateway took as cached and the engine recomputes (a prefix evicted while the request
  // waited there), and an engine taken as idle while it computes a 100K-token prompt draws every
  // request (the Mooncake replay showed 80 s first tokens).
  // The same for the attention pairs of that work, when the engine reports them.
  const PrefillWork unreported = counts.launched_total - state.launched_at_poll;
  const PrefillWork finished =
      counts.launched_total - counts.uncached_in_flight - state.finished_at_report;
  auto queued = [](int64_t reported, int64_t unreported, int64_t finished) {
    return std::max<int64_t>(
        reported + std::max<int64_t>(unreported, 0) - std::max<int64_t>(finished, 0), 0);
  };
  load.queued_prefill_tokens = queued(r.prefill_tokens, unreported.tokens, finished.tokens);
  load.queued_prefill_pairs =
      r.prefill_pairs >= 0 ? queued(r.prefill_pairs, unreported.pairs, finished.pairs) : -1;
  load.running_seqs = r.running;
  load.context_tokens = r.tokens_in_flight;
  load.free_kv_blocks = r.free_blocks;
  load.total_kv_blocks = r.total_blocks;
  if (r.block_size > 0) load.kv_block_size = r.block_size;
  if (r.max_batch_tokens > 0) load.max_batch_tokens = r.max_batch_tokens;
  if (state.batch_time.observations > 0) load.batch_time = &state.batch_time;
  load.time_until_free_s = 0;
  if (r.step_seqs > 0) {
    const double since = std::chrono::duration<double>(now - state.received).count();
    const BatchTimeEstimator& e = state.batch_time;
    load.time_until_free_s = time_until_free_s(e, r.step_seqs, r.step_tokens,
                                               r.step_running_for_s + since, r.step_prefill_pairs);
  }
}

int64_t queued_prefill_seqs(const EngineLoadState& state, const GatewayCounts& counts,
                            int64_t in_flight, Clock::time_point now, Clock::duration max_age) {
  if (!state.known || now - state.received > max_age) return -1;
  // Not the gateway's legs less the engine's running sequences: those count other gateways'
  // requests and a request's n sequences, so a long queue read as none. Legs that finished since
  // the report are not taken off its waiting: most finished running; an early end costs one
  // report's interval of caution.
  const int64_t unreported = std::clamp<int64_t>(counts.legs_launched - state.legs_launched_at_poll,
                                                 0, std::max<int64_t>(in_flight, 0));
  // An engine takes requests in only between steps: those handed to it during a long step are in
  // neither its waiting nor its running. This gateway's own legs it does not report running are
  // still to prefill, whatever the report says of its queue.
  const int64_t not_running = in_flight - std::max<int64_t>(state.report.running, 0);
  return std::max(std::max<int64_t>(state.report.waiting, 0) + unreported, not_running);
}

}  // namespace tandem::gateway
