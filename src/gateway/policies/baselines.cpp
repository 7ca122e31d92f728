// The peers' published policies, as baselines for ours: round_robin, SGLang's cache_aware and
// Dynamo's KV-router cost. Rules and defaults: docs/gateway.md, "Scheduling policies".
#include <algorithm>
#include <limits>
#include <span>
#include <tuple>
#include <vector>

#include "gateway/policies/common.h"
#include "gateway/policy.h"

namespace tandem::gateway {
namespace {

using detail::Candidates;

Candidates usable(const std::vector<EndpointLoad>& pool, const RequestInfo& request, int group) {
  return detail::candidates(
      pool, request, [group](const EndpointLoad& e) { return detail::in_group(e, group); },
      detail::at_in_flight_limit);
}

// ------------------------------------------------------------------------------- round_robin

Choice round_robin(const std::vector<EndpointLoad>& pool, const RequestInfo& request, int group,
                   int last) {
  const Candidates c = usable(pool, request, group);
  if (c.free.empty()) return c.none();
  const EndpointLoad* first = nullptr;  // the lowest id
  const EndpointLoad* next = nullptr;   // the lowest id after `last`
  for (const EndpointLoad* e : c.free) {
    if (!first || e->id < first->id) first = e;
    if (e->id > last && (!next || e->id < next->id)) next = e;
  }
  return {Choice::Kind::kChosen, (next ? next : first)->id};
}

class RoundRobinPolicy final : public Policy {
 public:
  const char* name() const override { return "round_robin"; }
  Choice choose_prefill(const ClusterView& view, const RequestInfo& request,
                        Clock::time_point) const override {
    return round_robin(view.prefill, request, -1, view.state ? view.state->last_prefill : -1);
  }
  Choice choose_decode(const ClusterView& view, const RequestInfo& request, int group,
                       Clock::time_point) const override {
    return round_robin(view.decode, request, group, view.state ? view.state->last_decode : -1);
  }
  void record(PolicyState& state, const RequestInfo&, int prefill, int decode,
              Clock::time_point) const override {
    if (prefill >= 0) state.last_prefill = prefill;
    if (decode >= 0) state.last_decode = decode;
  }
};

// ------------------------------------------------------------------------------- cache_aware

const EndpointLoad* min_load(const std::vector<const EndpointLoad*>& free) {
  return *std::min_element(free.begin(), free.end(), [](const auto* a, const auto* b) {
    return std::tie(a->in_flight, a->id) < std::tie(b->in_flight, b->id);
  });
}

// A prompt as the cache_aware tree holds it. A salted prompt's ids follow two marks made from
// its salt: token ids are never negative and the marks always are, so salted prompts share no
// path with unsalted ones and prompts with different salts part at the first marks, as the
// engines' prefix caches keep them apart (62 bits of the salt; the tree is a model anyway).
class TreeKey {
 public:
  explicit TreeKey(const RequestInfo& r) : tokens_(r.prompt_ids) {
    if (!r.cache_salt || r.prompt_ids.empty()) return;
    const uint64_t s = *r.cache_salt;
    salted_.reserve(r.prompt_ids.size() + kMarks);
    salted_.push_back(-1 - static_cast<int32_t>(s >> 33));
    salted_.push_back(-1 - static_cast<int32_t>(s & 0x7fffffff));
    salted_.insert(salted_.end(), r.prompt_ids.begin(), r.prompt_ids.end());
    tokens_ = salted_;
    marks_ = kMarks;
  }
  std::span<const int32_t> tokens() const { return tokens_; }
  // Prompt tokens of a tree match of `depth` key tokens (the marks are none of the prompt's).
  int64_t prompt_depth(int64_t depth) const { return std::max<int64_t>(0, depth - marks_); }

 private:
  static constexpr int64_t kMarks = 2;
  std::vector<int32_t> salted_;
  std::span<const int32_t> tokens_;
  int64_t marks_ = 0;
};

Choice cache_aware(const std::vector<EndpointLoad>& pool, const RequestInfo& request, int group,
                   const PrefixTree* tree, const CacheAwareOptions& o) {
  const Candidates c = usable(pool, request, group);
  if (c.free.empty()) return c.none();
  const EndpointLoad* shortest = min_load(c.free);
  int64_t max_load = 0;
  for (const auto* e : c.free) max_load = std::max(max_load, e->in_flight);
  const int64_t min_load_v = shortest->in_flight;
  const bool imbalanced =
      max_load - min_load_v > o.balance_abs_threshold &&
      static_cast<double>(max_load) > static_cast<double>(min_load_v) * o.balance_rel_threshold;
  if (imbalanced || !tree || request.prompt_ids.empty())
    return {Choice::Kind::kChosen, shortest->id};
  const TreeKey key(request);
  const std::map<int, int64_t> depth = tree->match(key.tokens());
  const EndpointLoad* best = nullptr;
  int64_t best_depth = 0;
  for (const auto* e : c.free) {
    auto it = depth.find(e->id);
    const int64_t d = it == depth.end() ? 0 : key.prompt_depth(it->second);
    if (d == 0) continue;
    if (!best || d > best_depth ||
        (d == best_depth && std::tie(e->in_flight, e->id) < std::tie(best->in_flight, best->id))) {
      best = e;
      best_depth = d;
    }
  }
  const double rate =
      static_cast<double>(best_depth) / static_cast<double>(request.prompt_ids.size());
  if (best && rate > o.cache_threshold) return {Choice::Kind::kChosen, best->id};
  return {Choice::Kind::kChosen, shortest->id};
}

int64_t to_ms(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}

class CacheAwarePolicy final : public Policy {
 public:
  explicit CacheAwarePolicy(CacheAwareOptions o) : o_(o) {}
  const char* name() const override { return "cache_aware"; }
  Choice choose_prefill(const ClusterView& view, const RequestInfo& request,
                        Clock::time_point) const override {
    return cache_aware(view.prefill, request, -1, view.state ? &view.state->prefill_tree : nullptr,
                       o_);
  }
  Choice choose_decode(const ClusterView& view, const RequestInfo& request, int group,
                       Clock::time_point) const override {
    return cache_aware(view.decode, request, group, view.state ? &view.state->decode_tree : nullptr,
                       o_);
  }
  // Inserts the prompt under the chosen engines; evicts every eviction_interval (SGLang runs its
  // eviction on a timer thread; here the interval is measured on the injected clock).
  void record(PolicyState& state, const RequestInfo& request, int prefill, int decode,
              Clock::time_point now) const override {
    if (!request.prompt_ids.empty()) {
      const TreeKey key(request);
      if (prefill >= 0) state.prefill_tree.insert(key.tokens(), prefill, to_ms(now));
      if (decode >= 0) state.decode_tree.insert(key.tokens(), decode, to_ms(now));
    }
    if (!state.evicted_once) {
      state.evicted_once = true;
      state.last_eviction = now;
    } else if (now - state.last_eviction >= o_.eviction_interval) {
      state.prefill_tree.evict(o_.max_tree_size);
      state.decode_tree.evict(o_.max_tree_size);
      state.last_eviction = now;
    }
  }

 private:
  CacheAwareOptions o_;
};

// --------------------------------------------------------------------------------- kv_router

// Dynamo's cost: overlap_score_weight * prefill blocks to compute + decode blocks. `prefills`:
// the engine computes prompts (prefill pool, aggregated engines); a P/D decode engine does not,
// so its cost is its decode blocks alone.
double kv_cost(const EndpointLoad& e, const RequestInfo& r, bool prefills,
               const KvRouterOptions& o) {
  const int64_t bs = detail::block_size_of(e, o.block_size);
  const int64_t prompt = std::max<int64_t>(r.prompt_tokens, 0);
  const int64_t overlap_blocks = std::clamp<int64_t>(e.cached_tokens, 0, prompt) / bs;
  double prefill_blocks = 0;
  if (prefills) {
    const int64_t fresh = prompt - overlap_blocks * bs;
    prefill_blocks =
        static_cast<double>(detail::queued_prefill(e) + fresh) / static_cast<double>(bs);
  }
  const int64_t held = e.context_tokens >= 0 ? e.context_tokens : e.tokens_in_flight;
  const double decode_blocks =
      static_cast<double>(detail::ceil_div(held, bs) + detail::ceil_div(prompt, bs));
  return o.overlap_score_weight * prefill_blocks + decode_blocks;
}

Choice kv_router(const std::vector<EndpointLoad>& pool, const RequestInfo& request, int group,
                 bool prefills, const KvRouterOptions& o) {
  const Candidates c = usable(pool, request, group);
  if (c.free.empty()) return c.none();
  const EndpointLoad* best = nullptr;
  double best_cost = std::numeric_limits<double>::infinity();
  for (const auto* e : c.free) {
    const double cost = kv_cost(*e, request, prefills, o);
    if (!best || cost < best_cost ||
        (cost == best_cost &&
         std::tie(e->in_flight, e->id) < std::tie(best->in_flight, best->id))) {
      best = e;
      best_cost = cost;
    }
  }
  return {Choice::Kind::kChosen, best->id};
}

class KvRouterPolicy final : public Policy {
 public:
  explicit KvRouterPolicy(KvRouterOptions o) : o_(o) {}
  const char* name() const override { return "kv_router"; }
  Choice choose_prefill(const ClusterView& view, const RequestInfo& request,
                        Clock::time_point) const override {
    return kv_router(view.prefill, request, -1, true, o_);
  }
  Choice choose_decode(const ClusterView& view, const RequestInfo& request, int group,
                       Clock::time_point) const override {
    return kv_router(view.decode, request, group, group < 0, o_);
  }

 private:
  KvRouterOptions o_;
};

}  // namespace

std::unique_ptr<Policy> make_round_robin_policy() {
  return std::make_unique<RoundRobinPolicy>();
}

std::unique_ptr<Policy> make_cache_aware_policy(CacheAwareOptions options) {
  return std::make_unique<CacheAwarePolicy>(options);
}

std::unique_ptr<Policy> make_kv_router_policy(KvRouterOptions options) {
  return std::make_unique<KvRouterPolicy>(options);
}

}  // namespace tandem::gateway
