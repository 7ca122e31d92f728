#include "gateway/dispatcher.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <nlohmann/json.hpp>

#include "api/disaggregation.h"
#include "api/error.h"
#include "gateway/answer_text.h"
#include "gateway/engine_get.h"
#include "gateway/policies/queue_order.h"
#include "util/random_id.h"

namespace tandem::gateway {

using nlohmann::json;

namespace {

// What the gateway reads of an engine's answer to POST /v1/kv_transfer/release ({"released": b},
// or an error).
constexpr size_t kMaxReleaseAnswerBytes = size_t{64} << 10;

// "HTTP 500: TEXT", what an engine's error answer says: an OpenAI error's message (which the
// client gets in the engine's own body, relayed), else the body's text (read_engine_error).
// Not clipped here: the access log clips it, saying how much it left out, and the relay holds no
// more than 64 KiB of an error answer.
std::string engine_said(int status, const std::string& body) {
  std::string text;
  if (status >= 400 && !body.empty()) {
    EngineError said = read_engine_error(body);
    text = said.relay ? api::openai_error_message(body).value_or("") : std::move(said.text);
  }
  return "HTTP " + std::to_string(status) + (text.empty() ? "" : ": " + text);
}

// Whether the client may have asked for a stream. Request::stream says so only where the front
// end parsed the body (P/D modes, a tokenizing gateway); an aggregated gateway relays it unread,
// so its text is searched for `"stream": true`, which a stream's body always has (a nested one
// elsewhere reads as a stream too: the safe side, where the first-token rule applies).
bool may_stream(const Request& r) {
  if (r.stream) return true;
  constexpr std::string_view kKey = "\"stream\"";
  for (size_t at = r.body.find(kKey); at != std::string::npos;
       at = r.body.find(kKey, at + kKey.size())) {
    size_t i = at + kKey.size();
    auto skip_space = [&] {
      while (i < r.body.size() &&
             (r.body[i] == ' ' || r.body[i] == '\t' || r.body[i] == '\n' || r.body[i] == '\r'))
        ++i;
    };
    skip_space();
    if (i >= r.body.size() || r.body[i] != ':') continue;
    ++i;
    skip_space();
    if (r.body.compare(i, 4, "true") == 0) return true;
  }
  return false;
}

// An engine's client error (4xx): the client's to fix, answered without retry. A 429 is none but
// the engine being full, as its 503.
bool is_client_error(int status) {
  return status >= 400 && status < 500 && status != 429;
}

// What a waiting request holds of bodies (Topology::max_queued_body_bytes): those set before it
// reached the scheduler, and a sequential decode stage's decode body (body plus the prefill's
// kv_transfer_params), which it holds while it waits as well.
size_t body_bytes(Request& r) {
  size_t bytes = r.body.size() + r.prefill_body.size();
  if (r.stage == Stage::kDecode) {
    std::lock_guard lock(r.mutex);
    bytes += r.decode_body.size();
  }
  return bytes;
}

// Whether `group` has eligible decode engines in `v` and every one is at its in-flight limit: no
// policy's decode rule (each includes that limit) takes a prompt there now.
bool decode_full(const ClusterView& v, int group) {
  bool any = false;
  for (const auto& e : v.decode) {
    if (!e.eligible || e.group != group) continue;
    if (e.in_flight < e.max_in_flight) return false;
    any = true;
  }
  return any;
}

}  // namespace

std::vector<Upstream::CallId> mark_legs_cancelled(Request& r) {
  std::vector<Upstream::CallId> calls;
  for (const auto& l : r.legs)
    if (l->running()) {
      l->gateway_cancelled = true;
      calls.push_back(l->call);
    }
  return calls;
}

Dispatcher::Dispatcher(const Topology& topology, Executor& executor, Upstream& upstream,
                       const Policy& policy, EndpointTable& endpoints, GatewayMetrics& metrics,
                       AccessLog* access_log)
    : topo_(topology),
      exec_(executor),
      upstream_(upstream),
      policy_(policy),
      endpoints_(endpoints),
      metrics_(metrics),
      relay_(topology, executor, *this),
      recorder_(metrics, access_log, topology) {
  endpoints_.on_forget([this](int id) {
    policy_state_.prefill_tree.remove_tenant(id);
    policy_state_.decode_tree.remove_tenant(id);
    policy_state_.last_failure.erase(id);
  });
}

// ------------------------------------------------------------------------------ the queue

RequestInfo Dispatcher::info(const Request& r) const {
  RequestInfo ri;
  ri.prompt_tokens = r.prompt_tokens;
  ri.arrived = Clock::time_point(std::chrono::nanoseconds(*r.times.at(Phase::kReceived)));
  ri.excluded = r.excluded;
  ri.prompt_ids = r.prompt_ids;
  ri.block_hashes = r.block_hashes;
  ri.cache_salt = r.cache_salt;
  if (topo_.priority.enabled())
    ri.max_hold = topo_.priority.classes[static_cast<size_t>(r.priority_class)].hold;
  return ri;
}

void Dispatcher::submit(std::span<const RequestPtr> group) {
  if (stopping_.load()) {
    for (const RequestPtr& r : group) answer_shutting_down(r);
    return;
  }
  if (group.size() > 1) {
    auto together =
        std::make_shared<std::vector<std::weak_ptr<Request>>>(group.begin(), group.end());
    for (const RequestPtr& r : group) r->submitted_with = together;
  }
  // Only the requests whose client is still there need places (a group's choices share a class).
  size_t places = 0;
  int arriving_class = 0;
  for (const RequestPtr& r : group)
    if (!r->ended()) {
      arriving_class =
          places == 0 ? r->priority_class : std::min(arriving_class, r->priority_class);
      ++places;
    }
  if (places == 0) return;
  // More choices than the queue ever holds at once can never join it: the client's error to fix,
  // not a rate limit (OpenAI's SDKs retry a 429 by themselves, here in vain).
  if (places > topo_.max_queue) {
    const std::string why = "this request asks for " + std::to_string(places) +
                            " choices (`n`, or the prompts of its prompt list), more than the "
                            "gateway's queue takes at once (max_queue " +
                            std::to_string(topo_.max_queue) + "); ask for at most " +
                            std::to_string(topo_.max_queue);
    for (const RequestPtr& r : group) answer_error(r, 400, why);
    return;
  }
  size_t bytes = 0;
  for (const RequestPtr& r : group)
    if (!r->ended()) bytes += body_bytes(*r);
  const std::string refused = make_room(arriving_class, bytes);
  bool queued = false;
  for (const RequestPtr& r : group) {
    if (r->ended()) continue;
    if (!refused.empty()) {
      answer_overload(r, 429, refused);
      continue;
    }
    active_.emplace(r.get(), r);
    enqueue(r, false);
    queued = true;
  }
  if (!queued) return;
  publish_counts();
  exec_.set_busy(true);
  dispatch(waiting_.back()->queued_at);
}

// A full queue gives a higher class's arrival the place of lower classes' waiting requests
// (docs/gateway.md, "Priority classes"): interactive traffic must not be refused behind batch
// traffic, whether it asks for one choice or several.
std::string Dispatcher::make_room(int arriving_class, size_t arriving_bytes) {
  const size_t max = topo_.max_queue;
  // One free place admits an arrival whole: a group of n overshoots max_queue by at most n - 1
  // (n <= max_queue: submit). Needing all n places at once, a group met a queue kept near its
  // bound by single requests full every time, and starved. Retries and decode stages rejoin the
  // queue past its bound (they are no arrivals).
  const size_t to_free = waiting_.size() < max ? 0 : waiting_.size() - max + 1;
  // The byte bound holds unless nothing waits. An arrival larger than the bound by itself fits only
  // then: refused at once, it takes no lower class's place (shedding them all would not admit it
  // while anything unsheddable waits, and would empty the queue of them for one request when not).
  const size_t max_bytes = topo_.max_queued_body_bytes;
  if (max_bytes > 0 && arriving_bytes > max_bytes && !waiting_.empty())
    return "the gateway queue is full: this request's bodies (" + std::to_string(arriving_bytes) +
           " bytes) exceed max_queued_body_bytes " + std::to_string(max_bytes) +
           ", which admits so large a request only while nothing waits; retry later";
  const size_t bytes_to_free =
      max_bytes == 0 || waiting_.empty() || queued_body_bytes_ + arriving_bytes <= max_bytes
          ? 0
          : queued_body_bytes_ + arriving_bytes - max_bytes;
  if (to_free == 0 && bytes_to_free == 0) return {};
  // Which bound is met, said once for the arrival refused and for the work shed for it.
  const std::string bound_met =
      to_free > 0 ? "the gateway queue is full (" + std::to_string(max) + " requests waiting)"
                  : "the gateway queue is full (" + std::to_string(queued_body_bytes_) +
                        " bytes of request bodies waiting, max_queued_body_bytes " +
                        std::to_string(max_bytes) + ")";
  const std::string full = bound_met + "; retry later";
  // Nothing ranks below the last class (or the only one, without classes): no scan of the queue.
  if (static_cast<size_t>(arriving_class) + 1 >= topo_.priority.classes.size()) return full;
  // Only work never sent to an engine gives up its place: a request waiting to decode, or for a
  // retry, holds work (and maybe KV) already done for it. Cheap checks of each request first: a
  // refused arrival at a queue of unsheddable work costs one pass of them.
  auto sheddable = [&](Request& r) {
    return r.priority_class > arriving_class && r.booking == Booking::kQueued &&
           r.stage == Stage::kFirst && r.attempt == 0 && !r.ended();
  };
  // The places of the lowest class's newest requests (the work that waited least) are freed:
  // arrivals join the back of the queue, and only retries and decode stages (never sheddable) its
  // front, so from the back the first of a class is its newest. A group (Request::submitted_with)
  // gives up all its places or none, and none while any of its choices was sent (shed, the choices
  // under way would fail with it). As many are shed as free one place (the queue may be past its
  // bound: groups, retries) and the arrival's bytes; if all of them would not, none is.
  struct Unit {
    int priority_class;
    RequestPtr newest;
    size_t places, bytes;
  };
  std::vector<Unit> units;
  std::unordered_set<const void*> groups_seen;
  for (size_t i = waiting_.size(); i-- > 0;) {
    Request& r = *waiting_[i];
    if (!sheddable(r)) continue;
    size_t places = 1, bytes = r.queued_bytes;
    if (r.submitted_with) {
      if (!groups_seen.insert(r.submitted_with.get()).second) continue;
      bytes = 0;
      const bool whole =
          std::all_of(r.submitted_with->begin(), r.submitted_with->end(), [&](const auto& weak) {
            const RequestPtr choice = weak.lock();
            if (!choice || !sheddable(*choice)) return false;
            bytes += choice->queued_bytes;
            return true;
          });
      if (!whole) continue;
      places = r.submitted_with->size();
    }
    units.push_back({r.priority_class, waiting_[i], places, bytes});
  }
  // Lowest class first; within a class the order found, newest first.
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) {
    return a.priority_class > b.priority_class;
  });
  size_t freed = 0, freed_bytes = 0, picked = 0;
  while (picked < units.size() && (freed < to_free || freed_bytes < bytes_to_free)) {
    freed += units[picked].places;
    freed_bytes += units[picked++].bytes;
  }
  if (freed < to_free || freed_bytes < bytes_to_free) return full;
  std::vector<RequestPtr> shed;
  for (size_t u = 0; u < picked; ++u) {
    if (units[u].newest->submitted_with)
      for (const auto& weak : *units[u].newest->submitted_with) shed.push_back(weak.lock());
    else
      shed.push_back(units[u].newest);
  }
  // Out of the queue first, all of them (as a queue timeout: finished() lets go of what each
  // holds), then answered: a group's first answer ends its other choices (ChoiceMerger), which
  // must not still count against the bound.
  for (const RequestPtr& r : shed) remove_waiting(r);
  const std::string why =
      bound_met + " and this request was shed for higher-priority traffic; retry later";
  for (const RequestPtr& r : shed) answer_overload(r, 429, why);
  return {};
}

// Every waiting request is active too (active_ holds every request from submit to its end):
// running is what engines serve, without those waiting in the queue.
void Dispatcher::publish_counts() {
  metrics_.waiting.set(static_cast<double>(waiting_.size()));
  metrics_.running.set(static_cast<double>(active_.size() - waiting_.size()));
}

void Dispatcher::enqueue(const RequestPtr& r, bool front) {
  // One clock read for the phase stamps and the queue.
  r->queued_at = exec_.now();
  const int64_t ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(r->queued_at.time_since_epoch()).count();
  r->times.mark(Phase::kPrefillWaiting, ns);
  if (topo_.mode != PdMode::kSequential || r->stage == Stage::kDecode)
    r->times.mark(Phase::kDecodeWaiting, ns);
  r->booking = Booking::kQueued;
  if (front)
    waiting_.push_front(r);
  else
    waiting_.push_back(r);
  r->queued_bytes = body_bytes(*r);
  queued_body_bytes_ += r->queued_bytes;
  publish_counts();
  // Its queue timeout is armed by dispatch() if it is still waiting after the pass that
  // follows: most requests start at once, and a timer armed and cancelled per request costs.
}

void Dispatcher::arm_queue_timeout(const RequestPtr& r) {
  // A sequential decode stage waits no longer than its prefill engine holds the prompt's KV,
  // counted from the prefill's answer (a retried decode stage included): sent later, its decode
  // leg would fail to pull KV that expired, and blame a healthy decode engine for it.
  const auto queue_due = r->queued_at + topo_.timeouts.queue;
  const auto kv_due = r->kv_held_since + topo_.timeouts.decode_queue;
  const bool kv_expires_first =
      topo_.mode == PdMode::kSequential && r->stage == Stage::kDecode && kv_due < queue_due;
  // Weak: a timer must not keep a finished request (and its bodies) alive until it fires.
  r->queue_timer = exec_.at(
      kv_expires_first ? kv_due : queue_due,
      [this, weak = std::weak_ptr<Request>(r), kv_expires_first] {
        const RequestPtr r = weak.lock();
        // Cancelled whenever it leaves the queue: a timer that fires belongs to this wait.
        if (!r || r->booking != Booking::kQueued) return;
        remove_waiting(r);
        answer_overload(
            r, 503,
            kv_expires_first
                ? "no decode engine was free within " +
                      std::to_string(topo_.timeouts.decode_queue.count()) +
                      " ms of the prefill (timeouts.decode_queue_ms: the prefill engine holds the "
                      "prompt's KV only so long): " +
                      pools_state(*r)
                : "no engine was free within " + std::to_string(topo_.timeouts.queue.count()) +
                      " ms (queue timeout): " + pools_state(*r));
      });
}

std::string Dispatcher::pools_state(const Request& r) const {
  const auto now = exec_.now();
  if (topo_.mode == PdMode::kAggregated || r.stage == Stage::kDecode)
    return endpoints_.pools_state({false}, now);
  if (topo_.mode == PdMode::kSequential) return endpoints_.pools_state({true}, now);
  return endpoints_.pools_state({true, false}, now);
}

void Dispatcher::remove_waiting(const RequestPtr& r) {
  const auto gone = std::remove(waiting_.begin(), waiting_.end(), r);
  if (gone != waiting_.end()) queued_body_bytes_ -= std::exchange(r->queued_bytes, 0);
  waiting_.erase(gone, waiting_.end());
  r->booking = Booking::kRunning;
  exec_.cancel(r->queue_timer);
  r->queue_timer = {};
  publish_counts();
}

// ------------------------------------------------------------------------------ dispatch

void Dispatcher::dispatch() {
  if (!waiting_.empty()) dispatch(exec_.now());  // most calls under load: nobody waits
}

void Dispatcher::engines_changed() {
  std::vector<int> ejected, newly;
  // Ejected and failing its probes: an engine ejected for failed requests but answering its
  // probes may still be working through the legs it holds (a loaded one), and its next passing
  // probe readmits it.
  for (const auto& [id, e] : endpoints_.all()) {
    if (e.healthy || !e.probe_failed) continue;
    ejected.push_back(id);
    if (e.in_flight > 0 && std::find(ejected_.begin(), ejected_.end(), id) == ejected_.end())
      newly.push_back(id);
  }
  ejected_ = std::move(ejected);
  if (!newly.empty()) {
    // Copied: a cancel may report back at once, and what it posts must not meet a changing map.
    std::vector<RequestPtr> requests;
    requests.reserve(active_.size());
    for (const auto& [key, r] : active_) requests.push_back(r);
    for (const RequestPtr& r : requests) {
      std::vector<Upstream::CallId> calls;
      {
        std::lock_guard lock(r->mutex);
        // Only a request that sent its client nothing: it is retried elsewhere at no cost. A
        // stream under way is left to its idle timeout: an engine is ejected for late probes or
        // failed requests too, and a loaded one whose streams still move would lose them all.
        if (r->client != ClientState::kNothingSent) continue;
        for (const auto& l : r->legs)
          if (l->running() && l->cancel_reason.empty() &&
              std::find(newly.begin(), newly.end(), l->endpoint) != newly.end()) {
            l->cancel_reason = "its engine was ejected";
            calls.push_back(l->call);
          }
      }
      cancel_calls(calls);
    }
  }
  dispatch();
}

// Offers the waiting requests to the policy: first those whose prefill is done (they hold KV on
// a prefill engine), then the others in the policy's queue order (prompt length and waiting
// time, with a starvation bound: policies/queue_order.h). A request that must wait (its engines
// are saturated) does not block the ones behind it that could go elsewhere.
void Dispatcher::dispatch(Clock::time_point now) {
  if (waiting_.empty()) return;
  // Scratch lists keep their capacity from one call to the next (dispatch runs per request
  // under load; nothing it calls dispatches again synchronously), and are emptied at the end
  // so they keep no request alive (and at the start, in case a policy threw).
  std::vector<RequestPtr>& first_stage = scratch_first_stage_;
  std::vector<RequestPtr>& offer = scratch_offer_;  // decode stage first
  first_stage.clear();
  offer.clear();
  for (const auto& r : waiting_) (r->stage == Stage::kDecode ? offer : first_stage).push_back(r);
  if (first_stage.size() == 1) {
    offer.push_back(first_stage.front());
  } else if (!first_stage.empty()) {
    std::vector<QueuedRequest> queued;
    queued.reserve(first_stage.size());
    const auto& classes = topo_.priority.classes;
    for (const auto& r : first_stage) {
      QueuedRequest q{r->prompt_tokens, info(*r).arrived, r->priority_class, {}};
      if (!classes.empty()) q.starvation_after = classes[r->priority_class].max_wait;
      queued.push_back(q);
    }
    for (size_t i : order(queued, now, topo_.scheduling.queue)) offer.push_back(first_stage[i]);
  }
  first_stage.clear();

  ClusterView v = endpoints_.view(now, &policy_state_);  // kept current as requests start
  // Sequential mode: the decode stages go first on the engines' own load (their prompts' KV is
  // held, and their room was set aside when they were prefilled); the prompts to prefill then see
  // the decode room set aside for the requests still being prefilled or waiting to decode.
  bool reservations_in_view = topo_.mode != PdMode::kSequential;
  // Sequential mode: which groups' decode engines are all full in the view, found once a pass
  // (load only grows within one, and a group is looked at again only after a prompt is prefilled
  // for it). While every eligible prefill engine's group is full, a prompt waits without asking
  // the policy: under decode saturation each waiting prompt cost the pair rule's P + 1 prefill
  // choices and a decode choice on every pass.
  std::map<int, bool> group_decode_full;
  auto every_group_decode_full = [&] {
    bool any = false;
    for (const auto& p : v.prefill) {
      if (!p.eligible) continue;
      auto [it, fresh] = group_decode_full.try_emplace(p.group);
      if (fresh) it->second = decode_full(v, p.group);
      if (!it->second) return false;
      any = true;
    }
    return any;
  };
  for (const RequestPtr& r : offer) {
    if (r->ended()) {
      remove_waiting(r);
      continue;
    }
    if (!reservations_in_view && r->stage == Stage::kFirst) {
      add_decode_reservations(v);
      reservations_in_view = true;
    }
    const RequestInfo ri = info(*r);
    endpoints_.fill_cached_tokens(v, r->prompt_ids, r->cache_salt);
    int prefill = -1, decode = -1;
    int held_decode = -1;  // sequential: the decode engine whose room the prefill sets aside
    Choice::Kind kind = Choice::Kind::kChosen;
    if (topo_.mode == PdMode::kAggregated) {
      const Choice c = policy_.choose_decode(v, ri, -1, now);
      kind = c.kind;
      decode = c.endpoint;
    } else if (topo_.mode == PdMode::kParallel) {
      const PairChoice c = policy_.choose_together(v, ri, now);
      kind = c.kind;
      prefill = c.prefill;
      decode = c.decode;
    } else if (r->stage == Stage::kFirst) {
      // Only engines whose group can decode are eligible in the view (EndpointTable::can_serve).
      // The prompt is prefilled only where a decode engine of the group has room for it now, by
      // the policy's own choices (the base pair rule of Policy::choose_together; the decode engine
      // is chosen again when the prefill answered), counting the room set aside for the group's
      // other prompts in prefill or waiting to decode: prefilled meanwhile, its KV would wait on
      // the prefill engine, which holds it only so long (Timeouts::decode_queue).
      const PairChoice c = every_group_decode_full() ? PairChoice{Choice::Kind::kSaturated, -1, -1}
                                                     : policy_.Policy::choose_together(v, ri, now);
      kind = c.kind;
      prefill = c.prefill;
      held_decode = c.decode;
    } else {
      // The prefill engine's group, remembered: the engine may have left (drained) since.
      const Choice c = policy_.choose_decode(v, ri, r->prefill_group, now);
      kind = c.kind;
      decode = c.endpoint;
    }
    if (kind == Choice::Kind::kSaturated) continue;
    remove_waiting(r);
    if (kind == Choice::Kind::kNoneEligible) {
      answer_error(r, 503, "no healthy engine can serve this request: " + pools_state(*r));
      continue;
    }
    // vllm:request_queue_time_seconds counts requests: a stage or a retry adds to the request's
    // wait, observed when it is recorded.
    r->queued_s =
        std::max(r->queued_s, 0.0) + std::chrono::duration<double>(now - r->queued_at).count();
    // The engine that computes the prompt: the prefill engine, or an aggregated decode engine.
    const int computes = prefill >= 0 ? prefill : (topo_.mode == PdMode::kAggregated ? decode : -1);
    r->uncached = {};
    r->prefill_priority.reset();
    for (const auto* pool : {&v.prefill, &v.decode})
      for (const auto& e : *pool)
        if (e.id == computes) {
          r->uncached = PrefillWork::of_prompt(e.cached_tokens, r->prompt_tokens);
          if (const auto due = policy_.prefill_deadline(e, ri))
            r->prefill_priority = r->received_unix_ms + due->count();
        }
    if (computes >= 0) r->reuse = reuse_at_decision(prefill >= 0 ? v.prefill : v.decode, computes);
    start(r, prefill, decode);
    policy_.record(policy_state_, ri, prefill, decode, now);
    // The room a prefill sets aside is held in this pass's view as the decode leg it stands for.
    apply_choice(v, ri, prefill, decode >= 0 ? decode : held_decode);
    if (held_decode >= 0) group_decode_full.erase(r->prefill_group);  // it may be full now
  }
  offer.clear();
  for (const auto& r : waiting_)
    if (r->queue_timer.seq == 0) arm_queue_timeout(r);
}

// A request's reservation lasts from its prefill's dispatch to its decode leg's (or its end):
// while it holds one, its group's decode engines have that much less room for new prompts.
void Dispatcher::reserve_decode(Request& r, int group) {
  release_decode(r);
  r.decode_reserved_group = group;
  ++decode_reserved_[group];
}

bool Dispatcher::release_decode(Request& r) {
  if (r.decode_reserved_group < 0) return false;
  auto it = decode_reserved_.find(r.decode_reserved_group);
  if (--it->second == 0) decode_reserved_.erase(it);
  r.decode_reserved_group = -1;
  return true;
}

// Each group's reservations fill its eligible decode engines' in-flight room one engine after the
// other: the group has room for another prompt exactly when its engines' room exceeds what is set
// aside (which engine a decode leg takes is chosen when its prefill answered).
void Dispatcher::add_decode_reservations(ClusterView& v) const {
  for (const auto& [group, reserved] : decode_reserved_) {
    int64_t left = reserved;
    for (auto& e : v.decode) {
      if (left == 0) break;
      if (!e.eligible || e.group != group) continue;
      const int64_t taken = std::clamp<int64_t>(e.max_in_flight - e.in_flight, 0, left);
      e.in_flight += taken;
      left -= taken;
    }
  }
}

// ------------------------------------------------------------------------------ legs

void Dispatcher::start(const RequestPtr& r, int prefill, int decode) {
  const int64_t now = exec_.now_ns();
  if (prefill >= 0 || topo_.mode == PdMode::kAggregated) {
    // The prompt is computed anew: what an earlier attempt's engine reused is no report of this
    // one's (a retry's prefill engine may report none).
    std::lock_guard lock(r->mutex);
    r->cached_tokens_reported = -1;
    r->cached_tokens_attempt = r->attempt;
  }
  if (prefill >= 0) {
    const EndpointState& p = *endpoints_.find(prefill);
    r->prefill_endpoint = prefill;
    r->prefill_name = p.config.name;
    r->prefill_group = p.config.group;
    r->times.mark(Phase::kPrefillScheduled, now);
  }
  if (decode >= 0) {
    r->decode_endpoint = decode;
    r->decode_name = endpoints_.find(decode)->config.name;
    r->times.mark(Phase::kDecodeScheduled, now);
    if (topo_.mode == PdMode::kAggregated) r->times.mark(Phase::kPrefillScheduled, now);
  }
  // The leg that computes the prompt carries the policy's priority for it.
  auto prioritised = [&](const std::string& body) {
    return r->prefill_priority
               ? splice_fields(body, "\"priority\":" + std::to_string(*r->prefill_priority))
               : body;
  };
  switch (topo_.mode) {
    case PdMode::kAggregated:
      r->times.mark(Phase::kPrefilling, now);
      start_leg(r, decode, false, prioritised(r->body));
      break;
    case PdMode::kSequential:
      if (r->stage == Stage::kFirst) {
        reserve_decode(*r, r->prefill_group);
        r->times.mark(Phase::kPrefilling, now);
        start_leg(r, prefill, true, prioritised(r->prefill_body));
      } else {
        release_decode(*r);
        std::string body;
        {
          std::lock_guard lock(r->mutex);
          body = r->decode_body;
        }
        start_leg(r, decode, false, std::move(body));
      }
      break;
    case PdMode::kParallel: {
      const EndpointState& p = *endpoints_.find(prefill);
      const std::string members = api::bootstrap_members(p.config.host, p.config.bootstrap_port,
                                                         random_u64() & 0x7fffffffffffffffULL);
      const std::string body = splice_fields(r->body, members);
      r->times.mark(Phase::kPrefilling, now);
      start_leg(r, prefill, true,
                prioritised(r->prefill_asks_usage
                                ? splice_fields(r->body, members + ",\"stream_options\":{"
                                                                   "\"include_usage\":true}")
                                : body));
      start_leg(r, decode, false, body);
      break;
    }
  }
}

net::AsyncHttpRequest Dispatcher::upstream_request(const EndpointState& e, const Request& r,
                                                   std::string body,
                                                   std::chrono::milliseconds timeout) const {
  net::AsyncHttpRequest u;
  u.host = e.config.host;
  u.port = e.config.port;
  u.method = "POST";
  u.target = r.target;
  u.body = std::move(body);
  u.headers = r.headers;
  u.timeout = timeout;
  u.connect_timeout = topo_.timeouts.connect;
  return u;
}

// Registers and starts a leg unless the request already ended; the endpoint's load counts it
// until its on_done, which always comes, so the accounting cannot leak. A prefill leg must answer
// within the prefill timeout; the answering leg must bring its first token within first_token.
void Dispatcher::start_leg(const RequestPtr& r, int endpoint_id, bool prefill, std::string body) {
  EndpointState& e = *endpoints_.find(endpoint_id);
  const std::chrono::milliseconds deadline =
      prefill ? topo_.timeouts.prefill : topo_.timeouts.first_token;
  // A non-streaming answer comes whole: the first token's bound is its whole answer's, and one
  // cut at it is not retried (relay_done: another engine would take as long).
  const bool whole_answer = !prefill && !may_stream(*r);
  const char* what = prefill        ? "the prefill"
                     : whole_answer ? "the whole answer"
                                    : "the first token";
  auto leg = std::make_shared<Leg>();
  auto ref = std::make_shared<std::weak_ptr<Leg>>(leg);  // the call's callbacks find it here
  leg->endpoint = endpoint_id;
  leg->started = exec_.now();
  leg->attempt = r->attempt;
  leg->prefill = prefill;
  leg->prompt_tokens = r->prompt_tokens;
  if (prefill || topo_.mode == PdMode::kAggregated) leg->uncached = r->uncached;
  net::AsyncHttpHandlers h =
      prefill ? relay_.prefill_handlers(r, ref, r->attempt, endpoint_id, e.config.name)
              : relay_.answer_handlers(r, ref, r->attempt, endpoint_id, e.config.name);
  // The engine a decode leg takes its KV from (P/D modes; -1 otherwise), read here on the
  // scheduling thread, which alone sets it.
  const int kv_source = prefill ? -1 : r->prefill_endpoint;
  auto done = std::move(h.on_done);
  h.on_done = [this, r, leg, kv_source, done = std::move(done)](const std::string& error) {
    try {
      if (done) done(error);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tandem gateway: a leg's completion failed: %s\n", e.what());
    }
    const bool cancelled = leg->gateway_cancelled.load();
    // A call cut once the client had the whole answer, or the engine's error event (which
    // decided the request), is no failure of the engine's: the gateway's cut of an event too
    // large after it reads "cancelled", and a reset then changes nothing the client got.
    const bool decided = leg->stream_done || leg->error_event_sent;
    const bool fault =
        !leg->room_abandoned && !leg->kv_transfer_failed && !leg->kv_expired &&
        ((!error.empty() && !cancelled && !decided) || leg->status >= 500 || leg->engine_error);
    // Counted once: a leg the gateway gave up on had its pair's other leg fail first (counted),
    // or its client leave.
    const bool kv_source_failed = leg->kv_transfer_failed && !cancelled && kv_source >= 0;
    LegOutcome outcome = LegOutcome::kOk;
    if (leg->kv_transfer_busy) {
      // Its prefill engine had no transfer connection free for now (a 503 of its own engine's,
      // but no sign that engine is busy): neither engine's success nor failure.
      outcome = LegOutcome::kCancelled;
    } else if (leg->status == 429 || leg->status == 503) {
      outcome = LegOutcome::kBusy;
    } else if (fault) {
      std::lock_guard lock(r->mutex);  // cancel_reason: set by the deadline timer
      outcome = leg->cancel_reason.empty() ? LegOutcome::kFailed : LegOutcome::kTimedOut;
    } else if ((cancelled && leg->status == 0) || leg->kv_transfer_failed || leg->kv_expired) {
      // A decode leg that could not take its KV failed by its prefill engine, or found it gone:
      // no success of its own engine's (which reset its failure count), nor a failure.
      outcome = LegOutcome::kCancelled;
    }
    exec_.post_batched([this, r, leg, outcome, kv_source, kv_source_failed]() mutable {
      if (leg->ended_request) finished(r);
      if (leg->prefill && r->record_pending) {
        r->record_pending = false;
        recorder_.record(*r, exec_.now_ns());
      }
      bool blame_source = kv_source_failed;
      // Parallel mode: a leg whose pair's other leg ended with the client's error or a refusal
      // failed of it (Request::decided_attempt), as far as the gateway can tell: neither its
      // engine nor (its KV transfer failing) the prefill engine is blamed.
      const bool failed = outcome == LegOutcome::kFailed || outcome == LegOutcome::kTimedOut;
      if (topo_.mode == PdMode::kParallel && (failed || blame_source)) {
        std::lock_guard lock(r->mutex);
        if (r->decided_attempt == leg->attempt && r->decided_by != leg->endpoint) {
          if (failed) outcome = LegOutcome::kCancelled;
          blame_source = false;
        }
      }
      // One failure of the attempt's prefill engine counts once, whichever leg tells first.
      const bool prefill_failed =
          leg->prefill && (outcome == LegOutcome::kFailed || outcome == LegOutcome::kTimedOut);
      if (prefill_failed || blame_source) {
        if (r->prefill_blamed_attempt == leg->attempt) {
          if (prefill_failed) outcome = LegOutcome::kCancelled;  // told by its decode leg
          blame_source = false;                                  // told by its own leg
        }
        r->prefill_blamed_attempt = leg->attempt;
      }
      if (blame_source) prefill_engine_failed(kv_source, leg->started);
      // The request ended (finished() ran) while this decode leg could still take its KV (it was
      // connecting when cancelled): it did not, and was the last that could.
      if (leg->left_kv_untaken && r->booking == Booking::kOutside) release_unclaimed_kv(*r);
      leg_done(*leg, outcome);
    });
  };
  // The first token may take first_token_ms (a decode leg waits for its prefill, a queue); the
  // dispatcher's timer enforces that. The call's own per-piece bound must not be shorter, or a
  // stream that sent its head and waits for KV would be cut as idle.
  net::AsyncHttpRequest u = upstream_request(
      e, *r, std::move(body),
      prefill ? topo_.timeouts.prefill : std::max(topo_.timeouts.idle, topo_.timeouts.first_token));
  std::unique_lock lock(r->mutex);
  if (r->client == ClientState::kEnded) return;
  if (stopping_.load()) {  // shut_down: no leg starts, and the request must not wait for one
    lock.unlock();
    answer_shutting_down(r);
    return;
  }
  endpoints_.leg_started(e, *leg);
  leg->state = LegState::kRunning;
  r->legs.push_back(leg);
  leg->call = upstream_.start(std::move(u), std::move(h));
  leg->deadline = exec_.at(
      exec_.now() + deadline, [this, weak_r = std::weak_ptr<Request>(r),
                               weak_leg = std::weak_ptr<Leg>(leg), what, whole_answer, deadline] {
        const RequestPtr r = weak_r.lock();
        const std::shared_ptr<Leg> leg = weak_leg.lock();
        if (!r || !leg) return;
        Upstream::CallId call;
        {
          std::lock_guard lock(r->mutex);
          if (leg->state != LegState::kRunning) return;  // finished, or the client has its stream
          // Cut already (an ejection, the shut-down) and its call not yet ended: that reason
          // stands, and the cut's own handling (a retry, a 503) with it.
          if (!leg->cancel_reason.empty()) return;
          leg->cancel_reason =
              std::string(what) + " timed out after " + std::to_string(deadline.count()) + " ms";
          leg->whole_answer_timed_out = whole_answer;
          call = leg->call;
        }
        upstream_.cancel(call);
      });
}

void Dispatcher::leg_done(const Leg& leg, LegOutcome outcome) {
  exec_.cancel(leg.deadline);
  // The policy hears first (of every leg but a cancelled one, which tells nothing of its engine):
  // a drained engine is forgotten (by the policy too) as its last leg ends.
  if (outcome != LegOutcome::kCancelled && endpoints_.find(leg.endpoint))
    policy_.outcome(policy_state_, leg.endpoint, outcome == LegOutcome::kOk, exec_.now());
  endpoints_.leg_finished(leg, outcome);
  dispatch();
}

void Dispatcher::prefill_engine_failed(int endpoint_id, Clock::time_point since) {
  EndpointState* e = endpoints_.find(endpoint_id);
  if (!e) return;  // drained and gone since
  policy_.outcome(policy_state_, endpoint_id, false, exec_.now());
  endpoints_.failure_since(*e, since);
}

void Dispatcher::leg_failed(const RequestPtr& r, int attempt, int endpoint_id, int status,
                            std::string body, std::string message, Blame blame,
                            std::string retry_after) {
  // Parallel mode: the client's error or the engine's refusal decides the attempt (the first leg
  // to tell it, but the client's error over a refusal), marked before either report is handled;
  // not once its other leg's report was handled (attempt_failed), which cut this leg: an answer
  // that crossed the cut would make its pair's failure no failure of its engine's.
  if (topo_.mode == PdMode::kParallel && ((status >= 400 && status < 500) || status == 503)) {
    const bool client_error = is_client_error(status);
    std::lock_guard lock(r->mutex);
    if (r->handled_attempt != attempt &&
        (r->decided_attempt != attempt || (client_error && !r->decided_by_client_error))) {
      r->decided_attempt = attempt;
      r->decided_by = endpoint_id;
      r->decided_by_client_error = client_error;
    }
  }
  exec_.post_batched([this, r, attempt, endpoint_id, status, body = std::move(body),
                      message = std::move(message), blame,
                      retry_after = std::move(retry_after)]() mutable {
    attempt_failed(r, attempt, endpoint_id, status, std::move(body), std::move(message), blame,
                   std::move(retry_after));
  });
}

void Dispatcher::answer_refused(const RequestPtr& r, int attempt, int status, std::string message,
                                std::string code) {
  exec_.post_batched(
      [this, r, attempt, status, message = std::move(message), code = std::move(code)] {
        if (attempt != r->attempt) return;
        std::vector<Upstream::CallId> calls;
        {
          // As attempt_failed: checked, cancelled and answered under one lock, so no other leg of
          // the attempt can start the client's stream meanwhile.
          std::lock_guard lock(r->mutex);
          if (r->client != ClientState::kNothingSent) return;
          // Parallel mode: the other leg's client error came before this ran (leg_failed) and
          // decides the attempt, as it does over any failure of its pair's: its report follows,
          // and attempt_failed answers it.
          if (r->decided_attempt == attempt && r->decided_by_client_error) return;
          // Handled, as attempt_failed marks it: a client error or refusal that crosses this
          // cut decides nothing (leg_failed), and the failure answered here (a timed-out whole
          // answer) stays its engine's.
          r->handled_attempt = attempt;
          calls = mark_legs_cancelled(*r);
          r->client = ClientState::kAnswering;
          r->reply->send_error(status, message, "server_error", code);
        }
        cancel_calls(calls);
        end_request(r, {status, message});
      });
}

void Dispatcher::prefill_answered(const RequestPtr& r, int attempt, int endpoint_id,
                                  std::string params) {
  exec_.post_batched([this, r, attempt, endpoint_id, params = std::move(params)]() mutable {
    if (attempt != r->attempt || r->ended()) {
      // Its answer crossed the end of the attempt or of the request: no decode leg will come.
      release_held_kv(endpoint_id, params, r->headers);
      return;
    }
    {
      std::lock_guard lock(r->mutex);
      r->decode_body = splice_fields(r->body, params);
    }
    r->held_kv = std::move(params);
    r->held_kv_endpoint = endpoint_id;
    r->held_kv_attempt = attempt;
    r->stage = Stage::kDecode;
    r->kv_held_since = exec_.now();
    enqueue(r, true);  // it holds KV on the prefill engine: first in line
    dispatch();
  });
}

// An engine's own client error (4xx) goes to the client, without retry; anything else is retried
// on other engines while retries remain (the failed engine is avoided), then answered 502 (or the
// engine's 5xx OpenAI error). A 429 is no client error but the engine being full, as its 503:
// retried alike, and once retries are spent answered with its own status (a 503 too whatever its
// body, with the engine's Retry-After). Parallel mode: one leg's client error, else its refusal,
// decides its attempt, whatever its other leg did (Request::decided_attempt). An engine's error
// answer is relayed as it is only when it is an OpenAI error; any other body is quoted in the
// gateway's own. The decode leg of a sequential request that never reached its engine goes to
// another decode engine with the same kv_transfer_params (its KV is known to be held still); one
// whose prefill engine refused the pull for now (kNoEngineKvBusy) goes again with them too, to any
// decode engine, after the topology's retry_backoff, for as long as the prefill engine holds the
// KV (timeouts.decode_queue_ms; such a retry spends none of prefill_retries); any other failure
// of it before the client got anything (its engine died or hung, could not take the KV from the
// prefill engine (kPrefillEngine), or found it gone there (kNoEngineKvGone)) starts the request
// again from the prefill, as parallel mode retries its pair.
// What the engine said, relayed or not, goes to the access log (the outcome and retried_after).
void Dispatcher::attempt_failed(const RequestPtr& r, int attempt, int endpoint_id, int status,
                                std::string body, std::string message, Blame blame,
                                std::string retry_after) {
  if (attempt != r->attempt) return;
  const bool client_error = status >= 400 && status < 500;
  const bool retryable = !is_client_error(status);
  std::vector<Upstream::CallId> calls;
  {
    // Checked and cancelled under one lock: no leg of this attempt can start the stream after.
    std::lock_guard lock(r->mutex);
    if (r->client != ClientState::kNothingSent) return;
    // Parallel mode: the other leg of this attempt ended with the client's error or a refusal,
    // whose report follows this one (leg_failed) and decides, whichever leg told first: the client
    // gets its error with no retry (over its pair's refusal too), or the refusal is retried as
    // one (its backoff, its Retry-After).
    if (r->decided_attempt == attempt && r->decided_by != endpoint_id) return;
    r->handled_attempt = attempt;
    calls = mark_legs_cancelled(*r);
  }
  cancel_calls(calls);
  if (stopping_.load()) {  // no retry once the gateway shuts down (nor blame: shut_down's cancel)
    answer_shutting_down(r);
    return;
  }
  const bool sequential_decode = topo_.mode == PdMode::kSequential && r->stage == Stage::kDecode;
  // What the failed attempt's engine said goes to the access log, and the next attempt begins.
  auto begin_next_attempt = [&] {
    const EndpointState* e = endpoints_.find(endpoint_id);
    r->retried_after.push_back((e ? e->config.name : std::string("a removed engine")) + ": " +
                               (message.empty() ? engine_said(status, body) : message));
    ++r->attempt;
    metrics_.retries.inc();
  };
  const bool kv_busy = sequential_decode && blame == Blame::kNoEngineKvBusy;
  if (kv_busy && exec_.now() < r->kv_held_since + topo_.timeouts.decode_queue) {
    // Waiting for a transfer connection is no failure: it goes again for as long as the prefill
    // engine holds the KV, spending none of the retries (prefill_retries) that a failure may need
    // later. Past that hold the client gets the engine's 503, and the KV is let go of. Only the
    // first is recorded (retried_after, the retries metric): a prefill engine busy for the whole
    // hold sends a request again ~100 times, which would make its access-log line and the
    // dashboard's copy large; its record's attempts still count them all.
    if (r->busy_retries == 0)
      begin_next_attempt();
    else
      ++r->attempt;
    ++r->busy_retries;
    reserve_decode(*r, r->prefill_group);
    enqueue_after_backoff(r);  // at once, it would find the transfer connections as busy
    return;
  }
  if (retryable && !kv_busy && r->attempt - r->busy_retries < topo_.prefill_retries) {
    begin_next_attempt();
    // r->prefill_endpoint is this attempt's: the next one has not started.
    const bool prefill_failed = blame == Blame::kPrefillEngine && r->prefill_endpoint >= 0;
    if (blame != Blame::kNoEngineKvGone)
      r->excluded.push_back(prefill_failed ? r->prefill_endpoint : endpoint_id);
    const bool refused = status == 429 || status == 503;
    if (refused && !prefill_failed && blame != Blame::kNoEngineKvGone)
      r->refused_by.push_back(endpoint_id);
    // The same KV for another decode engine (waiting to decode again), or the request from its
    // start (which sets no decode room aside until it is prefilled again): a decode leg that
    // reached its engine may have taken the KV, which then is that engine's to hold or free.
    if (sequential_decode && blame == Blame::kItsEngineUnreached) {
      reserve_decode(*r, r->prefill_group);
    } else {
      r->stage = Stage::kFirst;
      release_decode(*r);
      {
        // The next prefill's answer makes it anew; held while the prompt waits and is prefilled
        // again, it would be memory the queue's byte bound does not count (body_bytes).
        std::lock_guard lock(r->mutex);
        std::string().swap(r->decode_body);
      }
      // The prompt is prefilled again: the prefill engine is told to let go of the KV the failed
      // decode leg was sent for, whatever that leg did (the last that could take it has ended). A
      // hold its engine pulled answers not_held, one being pulled is refused; and a pull that
      // failed naming no engine was refused for an allow list, a layout or a secret that do not
      // match, for which that decode engine's own release is refused too.
      if (!r->held_kv.empty())
        release_held_kv(r->held_kv_endpoint, std::exchange(r->held_kv, {}), r->headers);
    }
    // An engine's refusal (429, 503: its queue is full) retried where no engine is left that has
    // not refused or failed the request goes back to one of those (the policies fall back to
    // them): at once, it would meet the same full queue. It waits the topology's retry_backoff
    // first, longer at each such retry (counted from 1, as the busy retries: before(1) first).
    if (refused && only_tried_engines_left(*r, endpoint_id)) {
      enqueue_at(r,
                 exec_.now() + topo_.retry_backoff.jittered(++r->refusal_backoffs, random_u64()));
      return;
    }
    enqueue(r, true);
    dispatch();
    return;
  }
  // Sequential mode, a decode stage failed for good: the prefill engine is told to let go of the
  // prompt's KV it was sent for, whatever the leg did, as a retry from the prefill does (above):
  // the last leg that could take it has ended. A leg that failed naming no code (its engine died
  // mid-pull or mid-generation, its deadline) left the KV held until that engine's
  // --kv-transfer-timeout. A client error (4xx) is the decode engine's refusal of a body it read,
  // which lets go of the KV itself; one refused unread left it untaken (finished() frees it).
  if (sequential_decode && retryable && !r->held_kv.empty())
    release_held_kv(r->held_kv_endpoint, std::exchange(r->held_kv, {}), r->headers);
  const bool relay = !body.empty() && status >= 400 && read_engine_error(body).relay;
  if (message.empty()) {
    const EndpointState* e = endpoints_.find(endpoint_id);
    message = (e ? "engine " + e->config.name : std::string("a removed engine")) + " answered " +
              engine_said(status, body);
  }
  {
    std::lock_guard lock(r->mutex);
    // As in the first section: between the two, another leg may have begun answering.
    if (r->client != ClientState::kNothingSent) return;
    r->client = ClientState::kAnswering;
    // An error the gateway quotes is the engine's failure, 502, unless it was a refusal: a 503
    // stays one (with its Retry-After below), whatever body it came with (a proxy's page, text).
    if (!client_error && !relay && status != 503) status = 502;
    // The engine's refusal (429, 503) keeps its Retry-After: when to come back is its to say.
    if ((status == 429 || status == 503) && !retry_after.empty()) {
      net::HttpResponse response =
          relay ? net::HttpResponse{status, "application/json", body, {}}
                : api::openai_error_response(status, message, api::default_error_type(status), "");
      response.headers.set("Retry-After", retry_after);
      r->reply->respond_with_headers(std::move(response));
    } else if (relay) {
      r->reply->respond(status, body, "application/json");
    } else {  // an OpenAI error of our own: the engine's 4xx status, else 502
      r->reply->send_error(status, message, client_error ? "" : "server_error");
    }
  }
  end_request(r, {status, message});
}

void Dispatcher::enqueue_after_backoff(const RequestPtr& r) {
  // random_u64: repeatable under a simulation's seed (seed_random_ids), as its bootstrap rooms.
  enqueue_at(r, std::min(exec_.now() + topo_.retry_backoff.jittered(r->busy_retries, random_u64()),
                         r->kv_held_since + topo_.timeouts.decode_queue));
}

bool Dispatcher::only_tried_engines_left(const Request& r, int endpoint_id) const {
  const EndpointState* refused = endpoints_.find(endpoint_id);
  if (!refused) return false;  // removed: its pool may hold none it tried
  // As the policies see the pool (detail::candidates over the view): only engines that can serve
  // count (a prefill engine whose group has no eligible decode engine cannot), and a sequential
  // decode stage's engines only in its prefill's group. Counted as untried, such an engine sent
  // the retry at once to the policy, which falls back to the engines that refused it.
  const std::set<int> decoding = endpoints_.decoding_groups();
  const int group =
      topo_.mode == PdMode::kSequential && r.stage == Stage::kDecode ? r.prefill_group : -1;
  // A pool whose engines were all tried sends the retry back to one of them, maybe to a queue still
  // full where one of them refused it; one whose engines only failed it has no full queue to wait
  // for (a failure is no refusal: a parallel pair's prefill engine that failed the first attempt,
  // behind a decode engine that refused the second).
  auto all_tried_one_refused = [&](bool prefill) {
    bool refused_here = false;
    for (const auto& [id, e] : endpoints_.all()) {
      if (e.prefill != prefill || !EndpointTable::can_serve(e, decoding) ||
          (group >= 0 && e.config.group != group))
        continue;
      if (std::find(r.excluded.begin(), r.excluded.end(), id) == r.excluded.end()) return false;
      if (std::find(r.refused_by.begin(), r.refused_by.end(), id) != r.refused_by.end())
        refused_here = true;
    }
    return refused_here;
  };
  // A parallel retry is a pair: it goes back to an engine tried where either pool has no other,
  // whichever of the two refused (a decode engine still full, behind a fresh prefill engine).
  if (topo_.mode == PdMode::kParallel)
    return all_tried_one_refused(true) || all_tried_one_refused(false);
  return all_tried_one_refused(refused->prefill);
}

void Dispatcher::enqueue_at(const RequestPtr& r, Clock::time_point due) {
  // Weak: the timer must not keep a request that ended meanwhile alive (finished() accounted for
  // it, and let go of its KV).
  exec_.at(due, [this, weak = std::weak_ptr<Request>(r), attempt = r->attempt] {
    const RequestPtr r = weak.lock();
    if (!r || r->attempt != attempt || r->booking != Booking::kRunning || r->ended()) return;
    enqueue(r, true);
    dispatch();
  });
}

void Dispatcher::cancel_calls(const std::vector<Upstream::CallId>& calls) {
  for (auto c : calls) upstream_.cancel(c);
}

// ------------------------------------------------------------------------------ shutdown

void Dispatcher::when_idle(std::function<void()> idle) {
  if (active_.empty()) {
    idle();
    return;
  }
  idle_ = std::move(idle);
}

void Dispatcher::shut_down() {
  stopping_ = true;
  idle_ = nullptr;
  while (!waiting_.empty()) {
    const RequestPtr r = waiting_.front();
    remove_waiting(r);
    answer_shutting_down(r);
  }
  std::vector<RequestPtr> running;
  running.reserve(active_.size());
  for (const auto& [key, r] : active_) running.push_back(r);
  for (const RequestPtr& r : running) answer_shutting_down(r);
}

// The request ends as the gateway shuts down: its legs are cancelled with that reason (the
// gateway's cancel: no engine blamed); a client with nothing yet gets 503, and a stream is cut by
// its leg's relay (relay_done), which alone writes to it.
void Dispatcher::answer_shutting_down(const RequestPtr& r) {
  const std::string message(kShuttingDown);
  std::vector<Upstream::CallId> calls;
  bool answered = false;
  {
    std::lock_guard lock(r->mutex);
    if (r->client == ClientState::kEnded) return;
    for (const auto& l : r->legs)
      if (l->running()) {
        if (l->cancel_reason.empty()) l->cancel_reason = message;
        l->gateway_cancelled = true;
        calls.push_back(l->call);
      }
    if (r->client == ClientState::kNothingSent) {
      r->client = ClientState::kAnswering;
      r->reply->send_error(503, message, "server_error");
      answered = true;
    }
  }
  cancel_calls(calls);
  if (answered) end_request(r, {503, message});
}

// ------------------------------------------------------------------------------ ending

// Answers a request that never started (or whose attempts are over) with an OpenAI error.
void Dispatcher::answer_error(const RequestPtr& r, int status, const std::string& message) {
  {
    std::lock_guard lock(r->mutex);
    if (r->client == ClientState::kEnded) return;
    r->client = ClientState::kAnswering;
    // OpenAI answers rate limits with code rate_limit_exceeded.
    r->reply->send_error(status, message, {}, status == 429 ? "rate_limit_exceeded" : "");
  }
  end_request(r, {status, message});
}

void Dispatcher::answer_overload(const RequestPtr& r, int status, const std::string& message) {
  // OpenAI's own types: its rate limits' 429 is of type "requests" (or "tokens") with code
  // rate_limit_exceeded, its 5xx "server_error". Retry-After, in seconds, is what OpenAI's SDKs
  // wait before their retry; a second is a short wait the queue's state does not refine cheaply.
  net::HttpResponse response =
      api::openai_error_response(status, message, status == 429 ? "requests" : "server_error",
                                 status == 429 ? "rate_limit_exceeded" : "");
  response.headers.set("Retry-After", std::to_string(kOverloadRetryAfterSeconds));
  {
    std::lock_guard lock(r->mutex);
    if (r->client == ClientState::kEnded) return;
    r->client = ClientState::kAnswering;
    r->reply->respond_with_headers(std::move(response));
  }
  end_request(r, {status, message});
}

bool Dispatcher::end_request(const RequestPtr& r, Outcome outcome, Accounting accounting) {
  std::vector<Upstream::CallId> calls;
  {
    std::lock_guard lock(r->mutex);
    if (r->client == ClientState::kEnded) return false;
    r->client = ClientState::kEnded;
    // e.g. a parallel prefill leg after the client left or the decode leg failed
    if (outcome.status != 200) calls = mark_legs_cancelled(*r);
    r->outcome = std::move(outcome);
  }
  cancel_calls(calls);
  r->times.mark(Phase::kCompleted, exec_.now_ns());
  if (accounting == Accounting::kPosted) exec_.post_batched([this, r] { finished(r); });
  return true;
}

void Dispatcher::client_gone(const RequestPtr& r) {
  end_request(r, {499, "client closed the connection"});
}

void Dispatcher::finished(const RequestPtr& r) {
  if (r->booking == Booking::kQueued) remove_waiting(r);
  release_unclaimed_kv(*r);
  const bool freed_decode_place = release_decode(*r);
  if (r->booking == Booking::kRunning) {
    active_.erase(r.get());
    publish_counts();
    exec_.set_busy(!active_.empty());
    if (idle_ && active_.empty()) std::exchange(idle_, nullptr)();
  }
  r->booking = Booking::kOutside;
  // The pass that followed its last leg still counted the place (this runs after it): a prompt
  // waiting for it would wait for the next event, with every engine idle maybe.
  if (freed_decode_place) dispatch();
  // Parallel mode: the prefill leg may answer after the decode leg ended the request, and its
  // usage says what the prefill engine reused, so the record waits for it (bounded by the
  // prefill timeout); the start_leg completion records it then.
  if (topo_.mode == PdMode::kParallel && r->outcome.status == 200 && prefill_leg_running(*r)) {
    r->record_pending = true;
    return;
  }
  recorder_.record(*r, exec_.now_ns());
}

void Dispatcher::release_unclaimed_kv(Request& r) {
  if (r.held_kv.empty()) return;
  {
    std::lock_guard lock(r.mutex);
    // A decode leg sent with this KV that has not ended leaving it untaken may have reached its
    // engine, which pulls the KV or lets it go itself. One still running keeps held_kv: if it
    // ends leaving the KV untaken after all (it was still connecting), its completion calls this
    // again.
    for (const auto& l : r.legs)
      if (!l->prefill && l->attempt >= r.held_kv_attempt &&
          !(l->state == LegState::kFinished && l->left_kv_untaken))
        return;
  }
  release_held_kv(r.held_kv_endpoint, std::exchange(r.held_kv, {}), r.headers);
}

void Dispatcher::release_held_kv(int endpoint_id, const std::string& params,
                                 const net::Headers& headers) {
  const EndpointState* e = endpoints_.find(endpoint_id);
  // Not to an engine gone, nor to one known to be no Tandem engine (vLLM's and SGLang's have no
  // release route). An `auto` engine not yet known either way (it joined or was readmitted, and
  // its GET /load has not answered since) may be one that holds the KV: told all the same.
  if (!e || e->load_source == LoadSource::kOwnCounts) return;
  KvRelease release{endpoint_id, params, headers};
  if (kv_releases_ < kMaxKvReleases) {
    send_kv_release(std::move(release));
  } else if (kv_releases_waiting_.size() < kMaxQueuedKvReleases) {
    kv_releases_waiting_.push_back(std::move(release));
  } else {
    metrics_.kv_releases.labels({"dropped"}).inc();
  }
}

void Dispatcher::send_kv_release(KvRelease release) {
  const EndpointState* e = endpoints_.find(release.endpoint_id);
  if (!e) return;  // removed while the release waited its turn
  ++kv_releases_;
  const std::string& params = release.params;
  const net::Headers& headers = release.headers;
  net::AsyncHttpRequest u;
  u.host = e->config.host;
  u.port = e->config.port;
  u.method = "POST";
  u.target = "/v1/kv_transfer/release";
  u.body = "{" + params + "}";
  u.headers = headers;  // the client's API key, as its legs carry it
  u.timeout = topo_.timeouts.connect;
  u.connect_timeout = topo_.timeouts.connect;
  auto cut = std::make_shared<std::atomic<bool>>(false);  // by the bound below
  const Upstream::CallId call = whole_answer(
      upstream_, std::move(u), kMaxReleaseAnswerBytes,
      [this, name = e->config.name, cut](const EngineAnswer& a) {
        std::string result = "failed", why = a.error;
        // The call's own error ("cancelled") would not say that the engine was too slow.
        if (cut->load())
          why = "no answer within timeouts.connect_ms (" +
                std::to_string(topo_.timeouts.connect.count()) + " ms)";
        if (a.error.empty() && a.status == 200) {
          const json answer = json::parse(a.body, nullptr, false);
          const bool released =
              answer.is_object() && answer.contains("released") && answer["released"] == json(true);
          result = released ? "released" : "not_held";
        } else if (a.error.empty()) {
          why = engine_said(a.status, a.body);
        }
        exec_.post([this, name, result = std::move(result), why = std::move(why)] {
          --kv_releases_;
          if (!kv_releases_waiting_.empty()) {
            KvRelease next = std::move(kv_releases_waiting_.front());
            kv_releases_waiting_.pop_front();
            send_kv_release(std::move(next));
          }
          metrics_.kv_releases.labels({result}).inc();
          if (result != "failed") return;
          const std::optional<int64_t> held_back = kv_release_log_.admit(exec_.now());
          if (!held_back) return;
          const std::string more =
              *held_back > 0 ? " (and " + std::to_string(*held_back) + " more not logged)" : "";
          std::fprintf(stderr, "tandem gateway: releasing held KV on engine %s failed: %s%s\n",
                       name.c_str(), why.c_str(), more.c_str());
        });
      });
  // The whole call, not only each read, within the bound (an ended call's id is ignored).
  exec_.at(exec_.now() + topo_.timeouts.connect, [this, call, cut] {
    *cut = true;
    upstream_.cancel(call);
  });
}

bool Dispatcher::prefill_leg_running(Request& r) {
  std::lock_guard lock(r.mutex);
  for (const auto& l : r.legs)
    if (l->prefill && l->attempt == r.attempt && l->running()) return true;
  return false;
}

// ------------------------------------------------------------------------------ admin

std::string Dispatcher::add_endpoint(bool prefill, const Endpoint& endpoint, int* id) {
  if (auto why = endpoints_.admission_error(prefill, endpoint); !why.empty()) return why;
  int added = -1;
  try {
    added = endpoints_.add(prefill, endpoint);
  } catch (const std::exception& e) {
    return e.what();  // its KV-event consumer: nothing was added
  }
  if (id) *id = added;
  dispatch();
  return {};
}

bool Dispatcher::remove_endpoint(const std::string& name, int64_t* in_flight) {
  for (auto& [id, e] : endpoints_.all()) {
    if (e.config.name != name || e.draining) continue;
    if (in_flight) *in_flight = e.in_flight;
    endpoints_.drain(id);
    dispatch();  // requests waiting for this engine's group may now have none: 503
    return true;
  }
  return false;
}

EndpointTable::ReloadResult Dispatcher::reload(const Topology& next) {
  const EndpointTable::ReloadResult result = endpoints_.reload(next);
  dispatch();
  return result;
}

json Dispatcher::endpoints_json() const {
  json list = json::array();
  const auto now = exec_.now();
  for (const auto& [id, e] : endpoints_.all()) list.push_back(endpoints_.to_json(e, now));
  return {{"mode", mode_name(topo_.mode)}, {"policy", policy_.name()}, {"endpoints", list}};
}

namespace {

json histogram_json(const metrics::Histogram& h) {
  const auto s = h.snapshot();
  return {{"bounds", s.bounds}, {"cumulative", s.cumulative}, {"sum", s.sum}, {"count", s.count}};
}

}  // namespace

json Dispatcher::dashboard_state() {
  recorder_.watch(exec_.now_ns());
  json state = endpoints_json();
  for (auto& e : state["endpoints"])
    if (json reuse = recorder_.engine_reuse_json(e["name"].get<std::string>()); !reuse.is_null())
      e["reuse"] = std::move(reuse);
  state["time_unix_ms"] = exec_.unix_ms();
  state["waiting"] = waiting_.size();
  state["running"] = active_.size() - waiting_.size();
  state.update(recorder_.dashboard_json());
  state["histograms"] = {{"ttft", histogram_json(metrics_.ttft)},
                         {"tpot", histogram_json(metrics_.tpot)},
                         {"itl", histogram_json(metrics_.itl)},
                         {"e2e", histogram_json(metrics_.e2e)}};
  return state;
}

const EndpointState* Dispatcher::endpoint_named(const std::string& name) const {
  for (const auto& [id, e] : endpoints_.all())
    if (e.config.name == name && !e.draining) return &e;
  return nullptr;
}

json Dispatcher::endpoint_json(int id) const {
  const EndpointState* e = endpoints_.find(id);
  return e ? endpoints_.to_json(*e, exec_.now()) : json();
}

json Dispatcher::debug_requests() const {
  json list = json::array();
  const int64_t now = exec_.now_ns();
  for (const auto& [key, r] : active_) {
    json j = {{"request_id", r->id},
              {"path", r->path},
              {"phase", phase_name(r->times.current())},
              {"age_seconds", static_cast<double>(now - *r->times.at(Phase::kReceived)) * 1e-9},
              {"attempts", r->attempt + 1},
              {"phases", r->times.offsets()}};
    if (!r->prefill_name.empty()) j["prefill"] = r->prefill_name;
    if (!r->decode_name.empty()) j["decode"] = r->decode_name;
    list.push_back(std::move(j));
  }
  return {{"requests", list}, {"waiting", waiting_.size()}};
}

// One call, a small answer: no in-flight or load limit is weighed against it (a saturated pool
// would refuse it while every engine is up); the least busy engine that is up takes it.
// An engine that joined and has not passed its first check (EndpointState::unchecked) takes none,
// as it takes no request: it may serve another model, or be loading still.
const EndpointState* Dispatcher::models_endpoint() const {
  const EndpointState* best = nullptr;
  for (const auto& [id, e] : endpoints_.all())
    if (!e.prefill && e.eligible() && !e.unchecked && (!best || e.in_flight < best->in_flight))
      best = &e;
  return best;
}

}  // namespace tandem::gateway
