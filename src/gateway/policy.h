#pragma once
// Scheduling policy of the gateway: pure functions of a view of the cluster, the request and the
// time (injected, never read from a clock here), so that every decision can be replayed in a
// unit test. The scheduling thread builds the view from the state it owns and applies the
// decision; nothing here has state or side effects.
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gateway/policies/batch_time.h"
#include "gateway/policies/prefix_tree.h"
#include "gateway/policies/queue_order.h"

namespace tandem::gateway {

using Clock = std::chrono::steady_clock;

// One engine as the policy sees it.
struct EndpointLoad {
  int id = 0;  // the scheduler's endpoint id
  int group = 0;
  bool eligible = true;          // healthy and not being removed
  int64_t in_flight = 0;         // requests the gateway has sent it that have not finished
  int64_t max_in_flight = 0;     // its limit: at the limit it is saturated
  int64_t tokens_in_flight = 0;  // prompt tokens of those requests (known or estimated)

  // Optional signals for the cache- and time-aware policies. -1 (or null) means unknown; each
  // policy says what it uses instead (docs/gateway.md, "Scheduling policies").
  // Leading tokens of THIS request's prompt this engine holds in its prefix cache (the global
  // prefix index's match depth, in tokens): refilled for every request the policy is asked about.
  int64_t cached_tokens = 0;
  // Prompt tokens still to prefill on this engine (requests routed there whose prefill has not
  // finished, less their cached parts), from the gateway's accounting and the engine's reports.
  int64_t queued_prefill_tokens = -1;
  // The causal attention pairs of that queued work (api::causal_pairs), engine-reported; -1:
  // unknown (the cost then reads tokens only).
  int64_t queued_prefill_pairs = -1;
  // Sequences there still to be prefilled, where the engine also decodes them (aggregated mode):
  // those its fresh report says wait (every client's, each of a request's n) plus the legs sent
  // since (queued_prefill_seqs, engine_load.h), so that requests already generating do not fill
  // its prefill queue. -1: every request in flight counts (a prefill engine's are all prefill
  // work; without a fresh report the gateway cannot tell).
  int64_t queued_prefill_seqs = -1;
  int64_t running_seqs = -1;    // sequences the engine runs now (decode batch size)
  int64_t context_tokens = -1;  // tokens those sequences hold (prompt + generated)
  int64_t free_kv_blocks = -1;  // allocatable KV blocks (free or evictable), engine-reported
  int64_t total_kv_blocks = -1;
  int64_t kv_block_size = 0;     // tokens per KV block; 0: the policy's default
  int64_t max_batch_tokens = 0;  // the engine's prefill tokens per batch; 0: the policy's default
  // Expected seconds until the engine finishes the batch it runs now (time_until_free_s() of its
  // estimator); -1: unknown, the queued work is counted in full.
  double time_until_free_s = -1;
  // The engine's learned batch durations (owned by the caller, alive during the call); null: the
  // policy's prior.
  const BatchTimeEstimator* batch_time = nullptr;
  // A request it served failed within PolicyState::failure_memory (Policy::outcome): every
  // policy uses it only when no other engine is free now.
  bool recently_failed = false;
  // The engine orders its prefills by the requests' priority (it says so in its load report).
  bool schedules_by_priority = false;
};

// An engine readmitted `since` ago after being ejected takes a growing share of its in-flight
// `limit` over `ramp` (nginx's slow_start): one request at readmission, growing linearly to all of
// `limit` at `ramp`. A zero ramp, or a non-positive `since` past it, gives `limit`.
int64_t ramped_in_flight_limit(int64_t limit, Clock::duration since, Clock::duration ramp);

struct PolicyState;

struct ClusterView {
  std::vector<EndpointLoad> prefill, decode;
  // The explicit state of the stateful policies (round_robin, cache_aware), owned by the caller
  // and updated through Policy::record(); null behaves as a fresh state.
  const PolicyState* state = nullptr;
};

struct RequestInfo {
  int64_t prompt_tokens = 0;
  Clock::time_point arrived;
  std::vector<int> excluded;  // endpoints that already failed this request
  // The prompt, for policies that read it (cache_aware's tree, tandem's miss spreading); views
  // into the caller's request, valid during the call. Empty when not tokenized.
  std::span<const int32_t> prompt_ids{};
  std::span<const uint64_t> block_hashes{};  // api/block_hash.h hashes of its full blocks
  // Its cache salt as the engines fold it into the first block (TokensIn::cache_salt, salting
  // block_hashes): only prompts with the same salt, or both none, share cached blocks.
  std::optional<uint64_t> cache_salt;
  int64_t max_new_tokens = 0;  // 0: unknown
  // How long tandem may hold this request for the engines' queued-token limits (its priority
  // class's hold_ms): 0 never; none: the policy's max_hold. Engines that schedule by priority put
  // a higher class ahead of the queue that limit measures.
  std::optional<Clock::duration> max_hold;
};

struct Choice {
  enum class Kind {
    kChosen,        // `endpoint` takes it now
    kSaturated,     // an eligible engine exists but all are at their limit: wait
    kNoneEligible,  // no engine can take it (none healthy, none in the group): fail
  };
  Kind kind = Kind::kNoneEligible;
  int endpoint = -1;
};

struct PairChoice {
  Choice::Kind kind = Choice::Kind::kNoneEligible;
  int prefill = -1, decode = -1;
};

class Policy {
 public:
  virtual ~Policy() = default;
  virtual const char* name() const = 0;
  // The prefill engine for a request (P/D modes).
  virtual Choice choose_prefill(const ClusterView& view, const RequestInfo& request,
                                Clock::time_point now) const = 0;
  // The decode engine; `group` is the chosen prefill engine's group, or -1 for any (aggregated).
  virtual Choice choose_decode(const ClusterView& view, const RequestInfo& request, int group,
                               Clock::time_point now) const = 0;
  // Parallel mode: a prefill engine and a decode engine of its group, both free now. The default
  // tries the policy's prefill choices in turn until one has a free decode engine in its group;
  // the result is kChosen only when both are, kSaturated if waiting could help, else
  // kNoneEligible. A policy may weigh the two together (tandem ranks pairs by both costs).
  virtual PairChoice choose_together(ClusterView view, const RequestInfo& request,
                                     Clock::time_point now) const;
  // Records a decision the caller applied (-1 for a leg it did not choose) in `state`, the state
  // the caller passes in ClusterView::state. Stateless policies do nothing.
  virtual void record(PolicyState& state, const RequestInfo& request, int prefill, int decode,
                      Clock::time_point now) const;
  // How a pick ended, once its leg finished (nginx's free_peer): `ok` false when the engine
  // failed it (an error, a timeout; not a cancellation by the gateway). The default remembers
  // the last failure per engine (PolicyState::last_failure), which makes the engine
  // recently_failed in the views the caller builds (recently_failed()).
  virtual void outcome(PolicyState& state, int endpoint, bool ok, Clock::time_point now) const;
  // When the prompt's prefill is due, after the request arrived, on `engine` (the one chosen to
  // compute it): engines that schedule by priority get the due time (the gateway's Unix time in
  // ms) as the request's `priority` and compute prefills earliest deadline first. None: the
  // request goes as it came. Only a policy that sets_prefill_deadlines() gives deadlines, and only
  // for engines that say they schedule by priority (EndpointLoad::schedules_by_priority).
  virtual bool sets_prefill_deadlines() const { return false; }
  virtual std::optional<std::chrono::milliseconds> prefill_deadline(
      const EndpointLoad& engine, const RequestInfo& request) const;
};

// Whether `endpoint` failed a pick within state.failure_memory before `now`.
bool recently_failed(const PolicyState& state, int endpoint, Clock::time_point now);

// Fewest requests in flight; ties: fewest prompt tokens in flight, then the lowest id.
std::unique_ptr<Policy> make_least_load_policy();

// ------------------------------------------------------------------------------ more policies
// Exact rules and defaults: docs/gateway.md, "Scheduling policies".

// The explicit state of the stateful policies; the caller owns one, passes it in
// ClusterView::state and updates it with Policy::record() after applying each decision.
struct PolicyState {
  int last_prefill = -1, last_decode = -1;  // round_robin: the engines chosen last
  PrefixTree prefill_tree, decode_tree;     // cache_aware: what was routed where
  Clock::time_point last_eviction{};        // cache_aware: last evict() of the trees
  bool evicted_once = false;
  // Policy::outcome: when each engine last failed a pick (none since its last success), and how
  // long that keeps it second choice (nginx's fail_timeout, 10 s by default).
  std::map<int, Clock::time_point> last_failure;
  Clock::duration failure_memory = std::chrono::seconds(10);
};

// Each engine in turn (by id, cyclic from the one chosen last), skipping saturated ones.
std::unique_ptr<Policy> make_round_robin_policy();

// SGLang's cache_aware (its CLI defaults).
struct CacheAwareOptions {
  double cache_threshold = 0.3;        // match rate above which the matched engine is used
  int64_t balance_abs_threshold = 64;  // imbalanced if max - min load exceeds this ...
  double balance_rel_threshold = 1.5;  // ... and max load exceeds min load times this
  std::chrono::milliseconds eviction_interval{120'000};
  int64_t max_tree_size = int64_t{1} << 26;  // tokens per engine in the tree
  bool operator==(const CacheAwareOptions&) const = default;
};
std::unique_ptr<Policy> make_cache_aware_policy(CacheAwareOptions options = {});

// Dynamo's KV router cost at temperature 0.
struct KvRouterOptions {
  double overlap_score_weight = 1.0;
  int64_t block_size = 16;  // when an engine does not say (EndpointLoad::kv_block_size)
  bool operator==(const KvRouterOptions&) const = default;
};
std::unique_ptr<Policy> make_kv_router_policy(KvRouterOptions options = {});

// Ours: expected prefill finish time with cache credit, overload limits, miss spreading; decode
// by expected decode load within the prefill's group.
struct TandemOptions {
  int64_t max_batch_tokens = 2048;  // an engine's prefill tokens per batch, when it does not say
  // Overload: more queued prefill tokens (0: no limit); not on engines given deadlines (below).
  int64_t max_queued_prefill_tokens = 32000;
  // Overload: more requests to prefill (EndpointLoad::queued_prefill_seqs, else in flight); 0: no
  // limit.
  int64_t max_prefill_seqs = 32;
  // A request is held for the queue limit above at most this long after it arrived; then it goes
  // to the engine that computes it soonest, over that engine's queued-token limit (never over
  // the in-flight limits). 0: no bound.
  std::chrono::nanoseconds max_hold = std::chrono::seconds(2);
  double near_tie_rel = 0.05;           // costs within 5% ...
  double near_tie_abs_s = 0.002;        // ... plus 2 ms of the best are equal (spreading decides)
  int64_t block_size = 16;              // when an engine does not say
  double decode_tokens_per_seq = 2048;  // decode load: this many held tokens weigh as one sequence
  double decode_kv_weight = 4;          // decode load added at a full KV cache
  // Decode KV need: the prompt plus this many generated tokens (max_new_tokens if smaller).
  int64_t decode_kv_reserve_tokens = 256;
  BatchTimeOptions prior;  // batch durations of engines without an estimator
  // Prefill deadlines (Policy::prefill_deadline): a prompt is due this many times its own
  // expected compute time after it arrived, counting at most prefill_deadline_cap_s of it, so on
  // engines that compute prefills earliest deadline first a short prompt passes long ones at
  // their next chunk, and prompts longer than the cap keep their arrival order. 0: no deadlines.
  double prefill_deadline_slack = 12;
  double prefill_deadline_cap_s = 5;
  bool operator==(const TandemOptions&) const = default;
};
std::unique_ptr<Policy> make_tandem_policy(TandemOptions options = {});

// The options of every policy that takes any (the topology's `scheduling` section).
struct PolicyOptions {
  TandemOptions tandem;
  CacheAwareOptions cache_aware;
  KvRouterOptions kv_router;
};

// Names make_policy() accepts, the default first: the registry's order.
std::vector<std::string> policy_names();
// Why `name` names no policy of the registry ("unknown scheduling policy 'x'; expected one of:
// tandem, ..."); empty when it names one. What make_policy throws, for checks that build none.
std::string unknown_policy_error(std::string_view name);
// A policy by name from the registry ("tandem", "round_robin", "least_load", "cache_aware",
// "kv_router"), with its options. Throws tandem::Error naming the valid names for anything else.
std::unique_ptr<Policy> make_policy(std::string_view name, const PolicyOptions& options = {});

// Updates `view` as starting `request` on `prefill` and/or `decode` (-1: none) changes the
// engines' load, so the next decision of the same dispatch pass sees it: in flight and tokens in
// flight; the prefill engine's queued prefill tokens (by its uncached part) and the decode
// engine's running sequences and held tokens where known; without a prefill engine (aggregated
// mode), the decode engine's queued prefill tokens and requests to prefill too.
void apply_choice(ClusterView& view, const RequestInfo& request, int prefill, int decode);

}  // namespace tandem::gateway
