#include "gateway/policy.h"

#include <algorithm>
#include <tuple>

namespace tandem::gateway {
namespace {

bool excluded(const RequestInfo& r, int id) {
  return std::find(r.excluded.begin(), r.excluded.end(), id) != r.excluded.end();
}

// The least-loaded candidate among `pool` that passes `fits`. An engine that already failed this
// request is used only when it is the last one left, so a retry prefers another engine without
// turning a transient failure of the only engine into a hard one.
template <class Fits>
Choice least_load(const std::vector<EndpointLoad>& pool, const RequestInfo& request, Fits fits) {
  const EndpointLoad* best = nullptr;
  bool any = false, any_fresh = false;
  for (const auto& e : pool)
    if (e.eligible && fits(e) && !excluded(request, e.id)) any_fresh = true;
  for (const auto& e : pool) {
    if (!e.eligible || !fits(e)) continue;
    if (any_fresh && excluded(request, e.id)) continue;
    any = true;
    if (e.in_flight >= e.max_in_flight) continue;
    if (!best || std::tie(e.in_flight, e.tokens_in_flight, e.id) <
                     std::tie(best->in_flight, best->tokens_in_flight, best->id))
      best = &e;
  }
  if (best) return {Choice::Kind::kChosen, best->id};
  return {any ? Choice::Kind::kSaturated : Choice::Kind::kNoneEligible, -1};
}

class LeastLoadPolicy final : public Policy {
 public:
  const char* name() const override { return "least_load"; }
  Choice choose_prefill(const ClusterView& view, const RequestInfo& request,
                        Clock::time_point) const override {
    return least_load(view.prefill, request, [](const EndpointLoad&) { return true; });
  }
  Choice choose_decode(const ClusterView& view, const RequestInfo& request, int group,
                       Clock::time_point) const override {
    return least_load(view.decode, request,
                      [group](const EndpointLoad& e) { return group < 0 || e.group == group; });
  }
};

}  // namespace

PairChoice choose_pair(const Policy& policy, ClusterView view, const RequestInfo& request,
                       Clock::time_point now) {
  bool saturated = false;
  for (size_t tries = 0; tries <= view.prefill.size(); ++tries) {
    const Choice p = policy.choose_prefill(view, request, now);
    if (p.kind != Choice::Kind::kChosen) {
      saturated = saturated || p.kind == Choice::Kind::kSaturated;
      break;
    }
    auto it = std::find_if(view.prefill.begin(), view.prefill.end(),
                           [&](const EndpointLoad& e) { return e.id == p.endpoint; });
    if (it == view.prefill.end()) break;  // a policy that invents endpoints: refuse
    const Choice d = policy.choose_decode(view, request, it->group, now);
    if (d.kind == Choice::Kind::kChosen) return {Choice::Kind::kChosen, p.endpoint, d.endpoint};
    saturated = saturated || d.kind == Choice::Kind::kSaturated;
    it->eligible = false;  // this prefill's group cannot decode now: try the next prefill
  }
  return {saturated ? Choice::Kind::kSaturated : Choice::Kind::kNoneEligible, -1, -1};
}

std::unique_ptr<Policy> make_least_load_policy() {
  return std::make_unique<LeastLoadPolicy>();
}

}  // namespace tandem::gateway
