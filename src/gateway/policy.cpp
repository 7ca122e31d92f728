#include "gateway/policy.h"

#include <algorithm>
#include <tuple>

#include "gateway/policies/common.h"
#include "util/error.h"

namespace tandem::gateway {
namespace {

using detail::excluded;

// The least-loaded candidate among `pool` that passes `fits` (detail::candidates: engines that
// failed this request, or recently failed others, are second choice).
template <class Fits>
Choice least_load(const std::vector<EndpointLoad>& pool, const RequestInfo& request, Fits fits) {
  const detail::Candidates c = detail::candidates(pool, request, fits, detail::at_in_flight_limit);
  if (c.free.empty()) return c.none();
  const EndpointLoad* best = *std::min_element(c.free.begin(), c.free.end(), [](auto* a, auto* b) {
    return std::tie(a->in_flight, a->tokens_in_flight, a->id) <
           std::tie(b->in_flight, b->tokens_in_flight, b->id);
  });
  return {Choice::Kind::kChosen, best->id};
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

PairChoice Policy::choose_together(ClusterView view, const RequestInfo& request,
                                   Clock::time_point now) const {
  bool saturated = false;
  for (size_t tries = 0; tries <= view.prefill.size(); ++tries) {
    const Choice p = choose_prefill(view, request, now);
    if (p.kind != Choice::Kind::kChosen) {
      saturated = saturated || p.kind == Choice::Kind::kSaturated;
      break;
    }
    auto it = std::find_if(view.prefill.begin(), view.prefill.end(),
                           [&](const EndpointLoad& e) { return e.id == p.endpoint; });
    if (it == view.prefill.end()) break;  // a policy that invents endpoints: refuse
    const Choice d = choose_decode(view, request, it->group, now);
    if (d.kind == Choice::Kind::kChosen) return {Choice::Kind::kChosen, p.endpoint, d.endpoint};
    saturated = saturated || d.kind == Choice::Kind::kSaturated;
    it->eligible = false;  // this prefill's group cannot decode now: try the next prefill
  }
  return {saturated ? Choice::Kind::kSaturated : Choice::Kind::kNoneEligible, -1, -1};
}

void Policy::record(PolicyState&, const RequestInfo&, int, int, Clock::time_point) const {}

void Policy::outcome(PolicyState& state, int endpoint, bool ok, Clock::time_point now) const {
  if (ok)
    state.last_failure.erase(endpoint);
  else
    state.last_failure[endpoint] = now;
}

std::optional<std::chrono::milliseconds> Policy::prefill_deadline(const EndpointLoad&,
                                                                  const RequestInfo&) const {
  return std::nullopt;
}

bool recently_failed(const PolicyState& state, int endpoint, Clock::time_point now) {
  auto it = state.last_failure.find(endpoint);
  return it != state.last_failure.end() && now - it->second < state.failure_memory;
}

std::unique_ptr<Policy> make_least_load_policy() {
  return std::make_unique<LeastLoadPolicy>();
}

namespace {

// The registry: every policy by name, the default first.
struct PolicyEntry {
  std::string_view name;
  std::unique_ptr<Policy> (*make)(const PolicyOptions&);
};
constexpr PolicyEntry kPolicies[] = {
    {"tandem", [](const PolicyOptions& o) { return make_tandem_policy(o.tandem); }},
    {"round_robin", [](const PolicyOptions&) { return make_round_robin_policy(); }},
    {"least_load", [](const PolicyOptions&) { return make_least_load_policy(); }},
    {"cache_aware", [](const PolicyOptions& o) { return make_cache_aware_policy(o.cache_aware); }},
    {"kv_router", [](const PolicyOptions& o) { return make_kv_router_policy(o.kv_router); }},
};

}  // namespace

std::vector<std::string> policy_names() {
  std::vector<std::string> names;
  for (const auto& p : kPolicies) names.emplace_back(p.name);
  return names;
}

std::string unknown_policy_error(std::string_view name) {
  for (const auto& p : kPolicies)
    if (p.name == name) return {};
  std::string valid;
  for (const auto& n : policy_names()) valid += (valid.empty() ? "" : ", ") + n;
  return "unknown scheduling policy '" + std::string(name) + "'; expected one of: " + valid;
}

std::unique_ptr<Policy> make_policy(std::string_view name, const PolicyOptions& options) {
  for (const auto& p : kPolicies)
    if (p.name == name) return p.make(options);
  throw Error(unknown_policy_error(name));
}

int64_t ramped_in_flight_limit(int64_t limit, Clock::duration since, Clock::duration ramp) {
  if (ramp.count() <= 0 || since >= ramp || limit <= 1) return limit;
  const double share = std::max(std::chrono::duration<double>(since).count(), 0.0) /
                       std::chrono::duration<double>(ramp).count();
  return std::clamp<int64_t>(1 + static_cast<int64_t>(share * static_cast<double>(limit - 1)), 1,
                             limit);
}

namespace {
void add_queued_prefill(EndpointLoad& e, const RequestInfo& request) {
  if (e.queued_prefill_tokens >= 0) e.queued_prefill_tokens += detail::uncached_tokens(e, request);
  if (e.queued_prefill_pairs >= 0) e.queued_prefill_pairs += detail::uncached_pairs(e, request);
}
}  // namespace

void apply_choice(ClusterView& view, const RequestInfo& request, int prefill, int decode) {
  for (auto& e : view.prefill) {
    if (e.id != prefill) continue;
    ++e.in_flight;
    e.tokens_in_flight += request.prompt_tokens;
    add_queued_prefill(e, request);
  }
  for (auto& e : view.decode) {
    if (e.id != decode) continue;
    ++e.in_flight;
    e.tokens_in_flight += request.prompt_tokens;
    if (e.running_seqs >= 0) ++e.running_seqs;
    if (e.context_tokens >= 0) e.context_tokens += request.prompt_tokens;
    // Aggregated mode: the decode engine prefills too.
    if (prefill < 0) {
      add_queued_prefill(e, request);
      if (e.queued_prefill_seqs >= 0) ++e.queued_prefill_seqs;
    }
  }
}

}  // namespace tandem::gateway
