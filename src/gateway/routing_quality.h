#pragma once
// Routing quality: how much of a prompt's reusable prefix routing found. Three numbers per request,
// for the engine that computes its prompt (the prefill engine in P/D modes, the engine itself when
// aggregated):
//   available  the longest cached prefix any engine of that pool holds (the global prefix index,
//              at decision time), whether or not that engine could take the request then;
//   chosen     the cached prefix of the engine the policy chose, at decision time;
//   delivered  what that engine reports it reused (usage.prompt_tokens_details.cached_tokens).
// available - chosen is what the policy gave up (load, limits, spreading); chosen - delivered is
// what was gone (evicted, not yet stored) or never known by the time the engine ran it. Pure
// functions; the gateway's books and metrics are in request_record.h.
#include <cstdint>

#include "gateway/policy.h"

namespace tandem::gateway {

struct PrefixReuse {
  int64_t available = -1;  // tokens; -1: unknown (prompt not tokenized, or no engine's events)
  int64_t chosen = -1;
  int64_t delivered = -1;  // -1: the engine did not report it

  // All three known: the request counts toward the aggregated split.
  bool measured() const { return available >= 0 && chosen >= 0 && delivered >= 0; }
};

// The decision's part (available, chosen) for a request about to run on `computes`, one of the
// engines of `pool` (whose cached_tokens hold this request's match depths: -1 for engines without
// KV events). Unknown (-1, -1) when `computes` is not in the pool or its depth is unknown.
PrefixReuse reuse_at_decision(const std::vector<EndpointLoad>& pool, int computes);

// Running totals of measured requests (PrefixReuse::measured), in tokens.
struct ReuseTotals {
  int64_t requests = 0, prompt_tokens = 0, available = 0, chosen = 0, delivered = 0;

  void add(const PrefixReuse& reuse, int64_t prompt_tokens);
};

}  // namespace tandem::gateway
