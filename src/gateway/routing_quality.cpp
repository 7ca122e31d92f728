#include "gateway/routing_quality.h"

#include <algorithm>

namespace tandem::gateway {

PrefixReuse reuse_at_decision(const std::vector<EndpointLoad>& pool, int computes) {
  PrefixReuse reuse;
  for (const auto& e : pool)
    if (e.id == computes) reuse.chosen = e.cached_tokens;
  if (reuse.chosen < 0) return {};
  // Every engine of the pool counts, saturated or ejected: the prefix exists in the cluster.
  reuse.available = reuse.chosen;
  for (const auto& e : pool) reuse.available = std::max(reuse.available, e.cached_tokens);
  return reuse;
}

void ReuseTotals::add(const PrefixReuse& reuse, int64_t prompt) {
  if (!reuse.measured()) return;
  ++requests;
  prompt_tokens += prompt;
  available += reuse.available;
  chosen += reuse.chosen;
  delivered += reuse.delivered;
}

}  // namespace tandem::gateway
