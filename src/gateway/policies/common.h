#pragma once
// Helpers the policies share (private to src/gateway): which engines a request may use.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "api/prefill_work.h"
#include "gateway/policy.h"

namespace tandem::gateway::detail {

inline bool excluded(const RequestInfo& r, int id) {
  return std::find(r.excluded.begin(), r.excluded.end(), id) != r.excluded.end();
}

inline bool in_group(const EndpointLoad& e, int group) {
  return group < 0 || e.group == group;
}

// The engines of `pool` passing `fits` that a request may use now (`free`), and whether any
// usable engine exists at all, saturated or not (`any`). An engine that already failed the
// request is used only when no other one passes `fits`, as least_load does, so a retry prefers
// another engine without turning a transient failure of the only engine into a hard one.
// `saturated(e)` says an engine is at a limit right now. Engines that recently failed a request
// (EndpointLoad::recently_failed) are dropped from `free` while another engine is free.
struct Candidates {
  std::vector<const EndpointLoad*> free;
  std::vector<const EndpointLoad*> busy;  // usable but saturated now
  bool any = false;
  Choice none() const { return {any ? Choice::Kind::kSaturated : Choice::Kind::kNoneEligible, -1}; }
};

// Drops the items whose engine (`engine_of(item)`) recently failed, unless all of them did.
template <class T, class EngineOf>
void prefer_not_recently_failed(std::vector<T>& items, EngineOf engine_of) {
  auto failed = [&](const T& item) { return engine_of(item)->recently_failed; };
  if (std::all_of(items.begin(), items.end(), failed)) return;
  items.erase(std::remove_if(items.begin(), items.end(), failed), items.end());
}

template <class Fits, class Saturated>
Candidates candidates(const std::vector<EndpointLoad>& pool, const RequestInfo& request, Fits fits,
                      Saturated saturated) {
  bool any_fresh = false;
  for (const auto& e : pool)
    if (e.eligible && fits(e) && !excluded(request, e.id)) any_fresh = true;
  Candidates c;
  for (const auto& e : pool) {
    if (!e.eligible || !fits(e)) continue;
    if (any_fresh && excluded(request, e.id)) continue;
    c.any = true;
    (saturated(e) ? c.busy : c.free).push_back(&e);
  }
  prefer_not_recently_failed(c.free, [](const EndpointLoad* e) { return e; });
  return c;
}

inline bool at_in_flight_limit(const EndpointLoad& e) {
  return e.in_flight >= e.max_in_flight;
}

inline int64_t block_size_of(const EndpointLoad& e, int64_t fallback) {
  return e.kv_block_size > 0 ? e.kv_block_size : std::max<int64_t>(fallback, 1);
}

inline int64_t ceil_div(int64_t a, int64_t b) {
  return a <= 0 ? 0 : (a + b - 1) / b;
}

// Prompt tokens this engine must compute for the request (the uncached part).
inline int64_t uncached_tokens(const EndpointLoad& e, const RequestInfo& r) {
  return r.prompt_tokens - std::clamp<int64_t>(e.cached_tokens, 0, r.prompt_tokens);
}

// The attention pairs of the request's uncached part on this engine.
inline int64_t uncached_pairs(const EndpointLoad& e, const RequestInfo& r) {
  return api::PrefillWork::of_prompt(e.cached_tokens, r.prompt_tokens).pairs;
}

// Prefill work already waiting on the engine: its reported/accounted queue, else what the gateway
// has in flight there.
inline int64_t queued_prefill(const EndpointLoad& e) {
  return e.queued_prefill_tokens >= 0 ? e.queued_prefill_tokens : e.tokens_in_flight;
}

}  // namespace tandem::gateway::detail
