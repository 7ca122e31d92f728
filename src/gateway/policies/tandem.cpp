// The tandem policy: prefill by expected finish time (queued work plus the request's uncached
// tokens, in learned batch durations), with overload limits and miss spreading; decode by expected
// decode load within the prefill's group; in parallel mode both together. Exact rule:
// docs/gateway.md, "Scheduling policies".
#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "gateway/policies/common.h"
#include "gateway/policy.h"

namespace tandem::gateway {
namespace {

using detail::Candidates;

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// What identifies the request's prompt for spreading: the hash of its last full block (which
// names the whole prefix, salt included), else its token ids and salt mixed; 0 when the gateway
// knows neither.
uint64_t spread_key(const RequestInfo& r) {
  if (!r.block_hashes.empty()) return r.block_hashes.back() | 1;
  if (r.prompt_ids.empty()) return 0;
  uint64_t h = 0x54616e64656dULL;
  if (r.cache_salt) h = mix(h ^ *r.cache_salt);
  for (const int32_t t : r.prompt_ids) h = mix(h ^ static_cast<uint32_t>(t));
  return h | 1;
}

class TandemPolicy final : public Policy {
 public:
  explicit TandemPolicy(TandemOptions o) : o_(o) { prior_.options = o.prior; }
  const char* name() const override { return "tandem"; }

  Choice choose_prefill(const ClusterView& view, const RequestInfo& request,
                        Clock::time_point now) const override {
    const Candidates c = prefill_candidates(view.prefill, request, -1);
    if (c.free.empty() || held_long_enough(request, now)) {
      const EndpointLoad* e = pick_unheld(c.free, c.busy, request, now);
      return e ? Choice{Choice::Kind::kChosen, e->id} : c.none();
    }
    const EndpointLoad* best = pick_prefill(c.free, request, nullptr);
    if (!held_long_enough(request, now) &&
        worth_waiting(c.busy, request, prefill_cost(*best, request)))
      return {Choice::Kind::kSaturated, -1};
    return {Choice::Kind::kChosen, best->id};
  }

  Choice choose_decode(const ClusterView& view, const RequestInfo& request, int group,
                       Clock::time_point now) const override {
    if (group < 0) {
      // Aggregated: the engine prefills too, so its prefill finish time decides, among engines
      // with room for the sequence.
      const Candidates c = detail::candidates(
          view.decode, request, [](const EndpointLoad&) { return true; },
          [&](const EndpointLoad& e) {
            return prefill_overloaded(e) || decode_overloaded(e, request);
          });
      std::vector<const EndpointLoad*> busy;  // only those busy prefilling, with decode room
      for (const auto* e : c.busy)
        if (!decode_overloaded(*e, request)) busy.push_back(e);
      if (c.free.empty() || held_long_enough(request, now)) {
        const EndpointLoad* e = pick_unheld(c.free, busy, request, now);
        return e ? Choice{Choice::Kind::kChosen, e->id} : c.none();
      }
      const EndpointLoad* best = pick_prefill(c.free, request, nullptr);
      if (!held_long_enough(request, now) &&
          worth_waiting(busy, request, prefill_cost(*best, request)))
        return {Choice::Kind::kSaturated, -1};
      return {Choice::Kind::kChosen, best->id};
    }
    const Candidates c = decode_candidates(view.decode, request, group);
    if (c.free.empty()) return c.none();
    return {Choice::Kind::kChosen, pick_decode(c.free, request)->id};
  }

  PairChoice choose_together(ClusterView view, const RequestInfo& request,
                             Clock::time_point now) const override {
    // Pairs of a prefill engine and the best decode engine of its group, both usable now. Engines
    // that failed the request are considered only when no other prefill engine can ever pair.
    struct Pair {
      const EndpointLoad *prefill, *decode;
    };
    std::vector<Pair> pairs;
    std::vector<Pair> busy;  // could pair, but the prefill engine is overloaded now
    bool can_pair = false;   // some prefill engine has decode engines in its group at all
    for (const bool with_failed : {false, true}) {
      for (const auto& e : view.prefill) {
        if (!e.eligible || (!with_failed && detail::excluded(request, e.id))) continue;
        const Candidates d = decode_candidates(view.decode, request, e.group);
        if (!d.any) continue;
        can_pair = true;
        if (d.free.empty()) continue;
        (prefill_overloaded(e) ? busy : pairs).push_back({&e, pick_decode(d.free, request)});
      }
      if (can_pair) break;
    }
    auto prefills_of = [](const std::vector<Pair>& of) {
      std::vector<const EndpointLoad*> out;
      for (const auto& pair : of) out.push_back(pair.prefill);
      return out;
    };
    const bool held = held_long_enough(request, now);
    // A prefill engine that recently failed a request pairs only when no other one can now.
    detail::prefer_not_recently_failed(pairs, [](const Pair& p) { return p.prefill; });
    // Held long enough, the request goes where it is computed soonest, over a queue limit too.
    if (pairs.empty() || held) {
      const auto released = release_to(prefills_of(busy), request, now);
      for (const auto& pair : busy)
        if (std::find(released.begin(), released.end(), pair.prefill) != released.end())
          pairs.push_back(pair);
      busy.clear();  // the released engines compete among themselves below
    }
    if (pairs.empty())
      return {can_pair ? Choice::Kind::kSaturated : Choice::Kind::kNoneEligible, -1, -1};
    const std::vector<const EndpointLoad*> prefills = prefills_of(pairs);
    auto decode_of = [&](const EndpointLoad* e) {
      return std::find_if(pairs.begin(), pairs.end(), [e](const Pair& p) { return p.prefill == e; })
          ->decode;
    };
    const EndpointLoad* best = pick_prefill(prefills, request, [&](const EndpointLoad* e) {
      return decode_cost(*decode_of(e), request);
    });
    if (!held && worth_waiting(prefills_of(busy), request, prefill_cost(*best, request)))
      return {Choice::Kind::kSaturated, -1, -1};
    return {Choice::Kind::kChosen, best->id, decode_of(best)->id};
  }

  bool sets_prefill_deadlines() const override { return o_.prefill_deadline_slack > 0; }

  // The slack times the prompt's own compute on `e` (its uncached part, no queue), at most the
  // cap: among prompts that arrive close together the shorter is due first, while one that
  // arrived long enough before keeps its place.
  std::optional<std::chrono::milliseconds> prefill_deadline(const EndpointLoad& e,
                                                            const RequestInfo& r) const override {
    if (!gets_deadlines(e)) return std::nullopt;
    double own_s =
        estimate_work_s(estimator(e), detail::uncached_tokens(e, r), batch_tokens(e),
                        e.queued_prefill_pairs >= 0 ? detail::uncached_pairs(e, r) : int64_t{-1});
    if (o_.prefill_deadline_cap_s > 0) own_s = std::min(own_s, o_.prefill_deadline_cap_s);
    return std::chrono::milliseconds(std::llround(o_.prefill_deadline_slack * own_s * 1e3));
  }

 private:
  TandemOptions o_;
  BatchTimeEstimator prior_;

  // The engine orders its prefills by the deadlines this policy gives.
  bool gets_deadlines(const EndpointLoad& e) const {
    return sets_prefill_deadlines() && e.schedules_by_priority;
  }

  const BatchTimeEstimator& estimator(const EndpointLoad& e) const {
    return e.batch_time ? *e.batch_time : prior_;
  }
  // The engine's prefill tokens per batch: as it reports, else the option.
  int64_t batch_tokens(const EndpointLoad& e) const {
    return e.max_batch_tokens > 0 ? e.max_batch_tokens : o_.max_batch_tokens;
  }

  // Seconds until this engine would have computed the request's prompt: its queued work plus
  // the request's uncached part, in tokens and, when the engine reports them, attention pairs.
  double prefill_cost(const EndpointLoad& e, const RequestInfo& r) const {
    const double wait = std::max(e.time_until_free_s, 0.0);
    const int64_t pairs = e.queued_prefill_pairs >= 0
                              ? e.queued_prefill_pairs + detail::uncached_pairs(e, r)
                              : int64_t{-1};
    return wait + estimate_work_s(estimator(e),
                                  detail::queued_prefill(e) + detail::uncached_tokens(e, r),
                                  batch_tokens(e), pairs);
  }

  // True when an engine that cannot take the request now would still compute it sooner than
  // `best_cost` by more than the near-tie margin (its cached prefix saves more than its queue
  // costs): the request then waits for it rather than being recomputed elsewhere, which would
  // also spend cluster capacity on a prefix that is cached already.
  bool worth_waiting(const std::vector<const EndpointLoad*>& busy, const RequestInfo& r,
                     double best_cost) const {
    const double margin = std::max(best_cost * o_.near_tie_rel, 0.0) + o_.near_tie_abs_s;
    for (const auto* e : busy)
      if (e->cached_tokens > 0 && !detail::at_in_flight_limit(*e) && queue_overloaded(*e) &&
          prefill_cost(*e, r) + margin < best_cost)
        return true;
    return false;
  }

  // True once the request has waited max_hold (its own, else the policy's) since it arrived: it
  // is held no longer.
  bool held_long_enough(const RequestInfo& r, Clock::time_point now) const {
    if (r.max_hold) return now - r.arrived >= *r.max_hold;
    return o_.max_hold.count() > 0 && now - r.arrived >= o_.max_hold;
  }

  // Of the overloaded engines `busy`, those the request goes to anyway, though over their queued
  // token limit (never over an in-flight limit): all of them once it was held max_hold, or when
  // it alone exceeds the limit on each (holding cannot make room for it; it would only let later,
  // shorter requests ahead of it). Empty: keep holding.
  std::vector<const EndpointLoad*> release_to(const std::vector<const EndpointLoad*>& busy,
                                              const RequestInfo& r, Clock::time_point now) const {
    std::vector<const EndpointLoad*> out;
    for (const auto* e : busy)
      if (!detail::at_in_flight_limit(*e) && !at_prefill_seq_limit(*e)) out.push_back(e);
    bool oversized = o_.max_queued_prefill_tokens > 0 && !out.empty();
    for (const auto* e : out)
      if (detail::uncached_tokens(*e, r) < o_.max_queued_prefill_tokens) oversized = false;
    if (!oversized && !held_long_enough(r, now)) out.clear();
    return out;
  }

  // For a request that is not held (no engine is free, or it was held max_hold): the soonest of
  // the free engines and the busy ones release_to lets it go to; null when there is none yet.
  const EndpointLoad* pick_unheld(const std::vector<const EndpointLoad*>& free,
                                  const std::vector<const EndpointLoad*>& busy,
                                  const RequestInfo& r, Clock::time_point now) const {
    std::vector<const EndpointLoad*> out = release_to(busy, r, now);
    out.insert(out.end(), free.begin(), free.end());
    return out.empty() ? nullptr : pick_prefill(out, r, nullptr);
  }

  // The engine's requests still to prefill reach max_prefill_seqs. Those an aggregated engine
  // already runs are generating, bounded by its own limits (in flight, KV room), not this one.
  bool at_prefill_seq_limit(const EndpointLoad& e) const {
    const int64_t to_prefill = e.queued_prefill_seqs >= 0 ? e.queued_prefill_seqs : e.in_flight;
    return o_.max_prefill_seqs > 0 && to_prefill >= o_.max_prefill_seqs;
  }

  bool prefill_overloaded(const EndpointLoad& e) const {
    return detail::at_in_flight_limit(e) || queue_overloaded(e);
  }

  // Over the policy's own prefill limits, whose cause (the queued work) the cost counts; an
  // engine at the gateway's in-flight limit or without decode room may stay so for any time.
  // The queued-token limit holds requests only for engines that compute first come, first
  // served: one that orders its prefills by deadline already lets a short prompt pass the queued
  // ones, and a second, arrival-ordered queue in the gateway only delays it.
  bool queue_overloaded(const EndpointLoad& e) const {
    if (at_prefill_seq_limit(e)) return true;
    if (gets_deadlines(e)) return false;
    const int64_t queued = detail::queued_prefill(e);
    return o_.max_queued_prefill_tokens > 0 && queued > 0 && queued >= o_.max_queued_prefill_tokens;
  }

  int64_t decode_blocks_needed(const EndpointLoad& e, const RequestInfo& r) const {
    const int64_t bs = detail::block_size_of(e, o_.block_size);
    int64_t generation = std::max<int64_t>(o_.decode_kv_reserve_tokens, 0);
    if (r.max_new_tokens > 0) generation = std::min(generation, r.max_new_tokens);
    return detail::ceil_div(std::max<int64_t>(r.prompt_tokens, 0) + generation, bs);
  }

  // Without KV room for the request now, it waits for some to free up. A request that even an
  // empty engine could not hold would wait for nothing but its queue timeout (a 503 that blames
  // the load): it goes, and the engine says why it cannot take it (a 400).
  bool decode_overloaded(const EndpointLoad& e, const RequestInfo& r) const {
    if (detail::at_in_flight_limit(e)) return true;
    const int64_t needed = decode_blocks_needed(e, r);
    if (e.total_kv_blocks > 0 && needed > e.total_kv_blocks) return false;
    return e.free_kv_blocks >= 0 && e.free_kv_blocks < needed;
  }

  // Expected decode load after adding the request, in sequences.
  double decode_cost(const EndpointLoad& e, const RequestInfo& r) const {
    const double seqs = static_cast<double>(std::max(e.in_flight, e.running_seqs));
    const double held = static_cast<double>(std::max(e.tokens_in_flight, e.context_tokens) +
                                            std::max<int64_t>(r.prompt_tokens, 0));
    double cost = seqs + held / std::max(o_.decode_tokens_per_seq, 1.0);
    if (e.total_kv_blocks > 0 && e.free_kv_blocks >= 0) {
      const double used = 1.0 - static_cast<double>(e.free_kv_blocks - decode_blocks_needed(e, r)) /
                                    static_cast<double>(e.total_kv_blocks);
      cost += o_.decode_kv_weight * std::clamp(used, 0.0, 1.0);
    }
    return cost;
  }

  Candidates prefill_candidates(const std::vector<EndpointLoad>& pool, const RequestInfo& r,
                                int group) const {
    return detail::candidates(
        pool, r, [group](const EndpointLoad& e) { return detail::in_group(e, group); },
        [this](const EndpointLoad& e) { return prefill_overloaded(e); });
  }

  Candidates decode_candidates(const std::vector<EndpointLoad>& pool, const RequestInfo& r,
                               int group) const {
    return detail::candidates(
        pool, r, [group](const EndpointLoad& e) { return detail::in_group(e, group); },
        [&](const EndpointLoad& e) { return decode_overloaded(e, r); });
  }

  // The least prefill cost; costs within the near-tie margin of the best are equal, and among
  // them `second` (the pair's decode cost, when given) decides, then the rendezvous hash of the
  // prompt and the engine (so equal engines split distinct prompts evenly while a repeated prompt
  // finds the same engine), then fewer in flight and the lower id.
  template <class Second = std::nullptr_t>
  const EndpointLoad* pick_prefill(const std::vector<const EndpointLoad*>& free,
                                   const RequestInfo& r, Second second) const {
    std::vector<double> cost(free.size());
    double best = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < free.size(); ++i) {
      cost[i] = prefill_cost(*free[i], r);
      best = std::min(best, cost[i]);
    }
    const double margin = std::max(best * o_.near_tie_rel, 0.0) + o_.near_tie_abs_s;
    const uint64_t key = spread_key(r);
    const EndpointLoad* pick = nullptr;
    std::tuple<double, uint64_t, int64_t, int> pick_rank{};
    for (size_t i = 0; i < free.size(); ++i) {
      if (cost[i] > best + margin) continue;
      const EndpointLoad* e = free[i];
      double s = 0;
      if constexpr (!std::is_same_v<Second, std::nullptr_t>) s = second(e);
      // Smaller is better in every field; the hash is inverted so the largest wins.
      const uint64_t h = key ? ~mix(key ^ mix(static_cast<uint64_t>(e->id))) : 0;
      const std::tuple<double, uint64_t, int64_t, int> rank{s, h, e->in_flight, e->id};
      if (!pick || rank < pick_rank) {
        pick = e;
        pick_rank = rank;
      }
    }
    return pick;
  }

  const EndpointLoad* pick_decode(const std::vector<const EndpointLoad*>& free,
                                  const RequestInfo& r) const {
    const EndpointLoad* pick = nullptr;
    double pick_cost = 0;
    for (const auto* e : free) {
      const double c = decode_cost(*e, r);
      if (!pick || c < pick_cost ||
          (c == pick_cost && std::tie(e->in_flight, e->id) < std::tie(pick->in_flight, pick->id))) {
        pick = e;
        pick_cost = c;
      }
    }
    return pick;
  }
};

}  // namespace

std::unique_ptr<Policy> make_tandem_policy(TandemOptions options) {
  return std::make_unique<TandemPolicy>(options);
}

}  // namespace tandem::gateway
