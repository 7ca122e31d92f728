#include "gateway/endpoints.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include <nlohmann/json.hpp>

#include "gateway/kv_events_consumer.h"
#include "gateway/prefix_index.h"
#include "gateway/request.h"
#include "net/http.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;

LoadSource initial_load_source(Dialect d) {
  switch (d) {
    case Dialect::kAuto:
      return LoadSource::kAsking;
    case Dialect::kTandem:
      return LoadSource::kReports;
    case Dialect::kVllm:
    case Dialect::kSglang:
      break;
  }
  return LoadSource::kOwnCounts;
}

bool same_endpoint(const Endpoint& a, const Endpoint& b) {
  return a.name == b.name && a.host == b.host && a.port == b.port &&
         a.bootstrap_port == b.bootstrap_port && a.group == b.group &&
         a.max_in_flight == b.max_in_flight && a.kv_events == b.kv_events &&
         a.kv_events_replay == b.kv_events_replay;
}

}  // namespace

const char* load_source_name(LoadSource s) {
  switch (s) {
    case LoadSource::kAsking:
      return "asking";
    case LoadSource::kReports:
      return "reports";
    case LoadSource::kOwnCounts:
      return "own_counts";
  }
  return "unknown";
}

LoadAnswer read_load_answer(const std::string& error, int status, const std::string& body) {
  LoadAnswer a;
  if (!error.empty() || status == 0 || status >= 500) return a;
  a.kind = LoadAnswer::Kind::kNoReport;
  if (status != 200) {
    a.why = "it answered HTTP " + std::to_string(status);
    return a;
  }
  try {
    a.report = api::parse_load_report(body);
  } catch (const std::exception& err) {
    a.why = err.what();
    return a;
  }
  if (!api::describes_an_engine(a.report)) {
    a.why = "its answer names no KV cache (total_blocks, block_size)";
    return a;
  }
  a.kind = LoadAnswer::Kind::kReport;
  return a;
}

EndpointTable::EndpointTable(const Topology& topology, GatewayMetrics& metrics, PrefixIndex& index)
    : topo_(topology),
      prefill_pool_(settings_of(topology.prefill)),
      decode_pool_(settings_of(topology.decode)),
      metrics_(metrics),
      prefix_index_(index) {}

EndpointTable::~EndpointTable() = default;

std::unique_ptr<KvEventsConsumer> EndpointTable::consumer_for(int id, const Endpoint& endpoint) {
  if (endpoint.kv_events.empty()) return nullptr;
  KvEventsConsumerOptions o;
  o.engine = id;
  o.endpoint = endpoint.kv_events;
  o.replay_endpoint = endpoint.kv_events_replay;
  try {
    return std::make_unique<KvEventsConsumer>(prefix_index_, o);
  } catch (...) {
    prefix_index_.remove_engine(id);  // the constructor registered it before it failed
    throw;
  }
}

int EndpointTable::add(bool prefill, Endpoint endpoint) {
  // The consumer first: the one step that can fail, before any metric series is labelled with
  // the engine's name or an id is spent on it.
  auto consumer = consumer_for(next_id_, endpoint);
  const int id = next_id_++;
  join(prefill, std::move(endpoint), id, std::move(consumer));
  return id;
}

void EndpointTable::join(bool prefill, Endpoint endpoint, int id,
                         std::unique_ptr<KvEventsConsumer> consumer, bool replaces_checked) {
  EndpointState s;
  s.id = id;
  s.prefill = prefill;
  const PoolSettings& pool = prefill ? prefill_pool_ : decode_pool_;
  s.max_in_flight = limit_of(endpoint, pool);
  s.dialect = pool.dialect;
  s.load_source = initial_load_source(pool.dialect);
  s.config = std::move(endpoint);
  s.unchecked = on_join_ && !replaces_checked;
  s.admitted = !s.unchecked;
  const std::vector<std::string> labels = {prefill ? "prefill" : "decode", s.config.name};
  // An engine of this name still draining gives its gauges up to the newcomer (the series are
  // the name's) and writes to a gauge of its own from now on.
  for (auto& [other_id, other] : endpoints_)
    if (other.draining && other.prefill == prefill && other.config.name == s.config.name) {
      other.healthy_gauge = &detached_gauge_;
      other.in_flight_gauge = &detached_gauge_;
      other.draining_gauge = &detached_gauge_;
    }
  s.in_flight_gauge = &metrics_.endpoint_in_flight.labels(labels);
  s.healthy_gauge = &metrics_.endpoint_healthy.labels(labels);
  s.requests_total = &metrics_.endpoint_requests.labels(labels);
  s.failures_total = &metrics_.endpoint_failures.labels(labels);
  s.overloaded_total = &metrics_.endpoint_overloaded.labels(labels);
  s.draining_gauge = &metrics_.endpoint_draining.labels(labels);
  s.ejections_total = &metrics_.endpoint_ejections.labels(labels);
  s.readmissions_total = &metrics_.endpoint_readmissions.labels(labels);
  s.healthy_gauge->set(1);
  s.draining_gauge->set(0);
  s.in_flight_gauge->set(0);
  if (consumer) consumers_[id] = std::move(consumer);
  endpoints_.emplace(id, std::move(s));
  update_ready();
  if (on_join_) on_join_(id);
}

EndpointState* EndpointTable::find(int id) {
  auto it = endpoints_.find(id);
  return it == endpoints_.end() ? nullptr : &it->second;
}

const EndpointState* EndpointTable::find(int id) const {
  auto it = endpoints_.find(id);
  return it == endpoints_.end() ? nullptr : &it->second;
}

bool EndpointTable::ready() const {
  return ready_.load();
}

int64_t EndpointTable::max_model_len() const {
  return max_model_len_.load();
}

std::set<int> EndpointTable::decoding_groups() const {
  std::set<int> groups;
  for (const auto& [id, e] : endpoints_)
    if (!e.prefill && e.eligible()) groups.insert(e.config.group);
  return groups;
}

bool EndpointTable::can_serve(const EndpointState& e, const std::set<int>& decoding_groups) {
  return e.eligible() && (!e.prefill || decoding_groups.count(e.config.group) > 0);
}

int64_t EndpointTable::in_flight_limit(const EndpointState& e, Clock::time_point now) const {
  if (e.unchecked) return 0;
  return e.readmitted == Clock::time_point{}
             ? e.max_in_flight
             : ramped_in_flight_limit(e.max_in_flight, now - e.readmitted, topo_.health.slow_start);
}

// Also the engines' longest sequence, which changes with the same events (an engine joins,
// leaves, is ejected or readmitted) and with their answers to GET /v1/models.
void EndpointTable::update_ready() {
  bool p = topo_.mode == PdMode::kAggregated, d = false;
  int64_t length = 0;
  const std::set<int> decoding = decoding_groups();
  for (const auto& [id, e] : endpoints_) {
    if (!can_serve(e, decoding)) continue;
    (e.prefill ? p : d) = true;
    if (e.max_model_len > 0) length = length ? std::min(length, e.max_model_len) : e.max_model_len;
  }
  ready_ = p && d;
  max_model_len_ = length;
}

ClusterView EndpointTable::view(Clock::time_point now, const PolicyState* state) const {
  ClusterView v;
  v.state = state;
  const auto max_age = 4 * topo_.scheduling.load_interval;
  const std::set<int> decoding = decoding_groups();
  for (const auto& [id, e] : endpoints_) {
    EndpointLoad l{e.id,        e.config.group,          can_serve(e, decoding),
                   e.in_flight, in_flight_limit(e, now), e.tokens_in_flight};
    fill_load(l, e.load, e.counts, now, max_age);
    // Aggregated mode: the engine decodes its requests too, and those it has started running no
    // longer wait in its prefill queue (EndpointLoad::queued_prefill_seqs).
    if (topo_.mode == PdMode::kAggregated)
      l.queued_prefill_seqs = queued_prefill_seqs(e.load, e.counts, e.in_flight, now, max_age);
    l.recently_failed = state && recently_failed(*state, e.id, now);
    (e.prefill ? v.prefill : v.decode).push_back(l);
  }
  // An engine without observations yet (new, or just restarted) borrows the learned batch
  // times of the engine of its pool with the most: one pool runs one model on like hardware,
  // and the prior would make it look faster or slower than its peers until it has run.
  for (auto* pool : {&v.prefill, &v.decode}) {
    const BatchTimeEstimator* best = nullptr;
    for (const auto& l : *pool)
      if (l.batch_time && (!best || l.batch_time->observations > best->observations))
        best = l.batch_time;
    for (auto& l : *pool)
      if (!l.batch_time) l.batch_time = best;
  }
  return v;
}

void EndpointTable::fill_cached_tokens(ClusterView& v, const std::vector<int32_t>& prompt_ids,
                                       std::optional<uint64_t> cache_salt) const {
  const bool known = !prompt_ids.empty() && (!consumers_.empty() || !external_events_.empty());
  std::vector<PrefixMatch> matches;
  if (known) matches = prefix_index_.match(prompt_ids, cache_salt);
  for (auto* pool : {&v.prefill, &v.decode})
    for (auto& e : *pool) {
      e.cached_tokens = -1;
      if (!known || !has_events(e.id)) continue;
      e.cached_tokens = 0;
      for (const auto& m : matches)
        if (m.engine == e.id) e.cached_tokens = m.tokens;
    }
}

std::string EndpointTable::pools_state(const std::vector<bool>& prefill_pools,
                                       Clock::time_point now) const {
  std::string out;
  const std::set<int> decoding = decoding_groups();
  // Parallel mode pairs a decode engine with an eligible prefill engine of its group: without
  // one, it cannot serve however idle it is.
  std::set<int> pairing;
  for (const auto& [id, e] : endpoints_)
    if (e.prefill && can_serve(e, decoding)) pairing.insert(e.config.group);
  const bool pairs = topo_.mode == PdMode::kParallel;
  for (const bool prefill : prefill_pools) {
    int total = 0, ejected = 0, other_model = 0, draining = 0, not_admitted = 0, unchecked = 0,
        at_limit = 0, no_decode = 0, no_prefill = 0, busy = 0;
    for (const auto& [id, e] : endpoints_) {
      if (e.prefill != prefill) continue;
      ++total;
      if (e.draining)
        ++draining;
      else if (!e.not_serving.empty() && !e.probe_failed)  // alive: no failure to look for
        ++other_model;
      else if (!e.admitted && !e.healthy)  // new, never took a request: no failure to look for
        ++not_admitted;
      else if (!e.healthy)
        ++ejected;
      else if (!can_serve(e, decoding))
        ++no_decode;
      else if (e.unchecked)
        ++unchecked;
      else if (e.in_flight >= in_flight_limit(e, now))  // a readmitted engine's ramp included
        ++at_limit;
      else if (pairs && !prefill && pairing.count(e.config.group) == 0)
        ++no_prefill;
      else
        ++busy;
    }
    if (!out.empty()) out += "; ";
    out += std::string(prefill ? "prefill" : "decode") + " pool: " + std::to_string(total) +
           (total == 1 ? " engine" : " engines");
    auto part = [&out](int n, const char* what) {
      if (n > 0) out += ", " + std::to_string(n) + " " + what;
    };
    part(ejected, "ejected after failing requests or health checks");
    part(other_model, "serving another model (their GET /v1/models lacks served_model_name)");
    part(draining, "draining");
    part(not_admitted, "not admitted yet (new, its health probe failed; probed each interval)");
    part(unchecked, "not yet checked (new, its first health check under way)");
    part(at_limit, "at the in-flight limit");
    part(no_decode, "whose group has no eligible decode engine");
    part(no_prefill, "with no eligible prefill engine in their group to pair with");
    part(busy, "over the policy's load limits (queued prefill work or free KV)");
  }
  return out;
}

void EndpointTable::leg_started(EndpointState& e, const Leg& leg) {
  ++e.in_flight;
  e.tokens_in_flight += leg.prompt_tokens;
  e.counts.uncached_in_flight += leg.uncached;
  e.counts.launched_total += leg.uncached;
  ++e.counts.legs_launched;
  e.in_flight_gauge->set(static_cast<double>(e.in_flight));
  e.requests_total->inc();
}

void EndpointTable::leg_finished(const Leg& leg, LegOutcome outcome) {
  EndpointState* e = find(leg.endpoint);
  if (!e) return;
  --e->in_flight;
  e->tokens_in_flight -= leg.prompt_tokens;
  e->counts.uncached_in_flight -= leg.uncached;
  e->in_flight_gauge->set(static_cast<double>(e->in_flight));
  switch (outcome) {
    case LegOutcome::kOk:
      e->consecutive_failures = 0;
      break;
    case LegOutcome::kBusy:
      e->overloaded_total->inc();
      break;
    case LegOutcome::kTimedOut:
      failure_since(*e, leg.started);
      break;
    case LegOutcome::kFailed:
      failure(*e);
      break;
    case LegOutcome::kCancelled:
      break;
  }
  if (e->draining && e->in_flight == 0) forget(leg.endpoint);
}

void EndpointTable::failure_since(EndpointState& e, Clock::time_point since) {
  if (e.probe_passed > since) {
    e.overloaded_total->inc();
  } else {
    failure(e, "a request that timed out");
  }
}

void EndpointTable::failure(EndpointState& e, const char* what) {
  e.failures_total->inc();
  if (!e.healthy) return;
  if (++e.consecutive_failures >= topo_.health.failures_to_eject) {
    // Said, as nginx says "upstream server temporarily disabled": an operator sees when and why
    // an engine stopped taking requests, and when it came back.
    // With its address: an engine removed and added again under the same name at another
    // address is told apart.
    std::fprintf(stderr,
                 "tandem gateway: engine %s (%s) ejected after %d %s (the last: %s); "
                 "a passing health probe readmits it\n",
                 e.config.name.c_str(), address_key(e.config).c_str(), e.consecutive_failures,
                 e.consecutive_failures == 1 ? "failure" : "failures in a row", what);
    e.healthy = false;
    e.healthy_gauge->set(0);
    e.ejections_total->inc();
    update_ready();
  }
}

bool EndpointTable::checked(EndpointState& e) {
  return std::exchange(e.unchecked, false);
}

bool EndpointTable::probe_result(int id, bool ok, Clock::time_point now, const std::string& why) {
  EndpointState* e = find(id);
  if (!e) return false;
  e->probing = false;
  if (!ok) {
    const bool was_healthy = e->healthy, was_failing = e->probe_failed;
    e->probe_failed = true;
    if (e->unchecked && e->healthy) {
      // A new engine that fails its first probe (one still loading its model refuses
      // connections) is not admitted: with its limit it would take requests that fail until
      // failures_to_eject. Out of routing (not healthy, but never ejected: it took nothing), it
      // is probed at each interval; one that passes stays held until its model list answered.
      // The line says so: "ejected" or a failure count would send an operator looking for an
      // engine that failed requests.
      std::fprintf(stderr,
                   "tandem gateway: engine %s (%s) not admitted: %s (%s); it takes no requests "
                   "until a later probe passes (one every %lld ms) and its model list has been "
                   "asked\n",
                   e->config.name.c_str(), address_key(e->config).c_str(),
                   e->probe_passed == Clock::time_point{}
                       ? "its first health probe failed"
                       : "its health probe failed before its model list answered",
                   why.empty() ? "no reason given" : why.c_str(),
                   static_cast<long long>(topo_.health.probe_interval.count()));
      e->healthy = false;
      e->healthy_gauge->set(0);
      update_ready();
    }
    if (e->healthy) {
      failure(*e, "a failed health probe");
    } else {
      ++e->failed_probes_while_out;
      ++e->failed_probes_while_out_total;
    }
    return !e->healthy && (was_healthy || !was_failing);
  }
  const int failed_probes = e->failed_probes_while_out;
  e->probe_failed = false;
  e->probe_passed = now;
  e->consecutive_failures = 0;
  e->failed_probes_while_out = 0;
  if (!e->not_serving.empty()) {
    // Alive, but serving another model: its model list is asked again (it may have restarted
    // with the right one), and that answer readmits it.
    if (e->length_query != LengthQuery::kAsking) e->length_query = LengthQuery::kToAsk;
    return false;
  }
  if (e->healthy) return false;
  if (e->unchecked)
    std::fprintf(stderr,
                 "tandem gateway: engine %s (%s) passed a health probe after %d failed %s; its "
                 "model list is asked before it takes requests\n",
                 e->config.name.c_str(), address_key(e->config).c_str(), failed_probes,
                 failed_probes == 1 ? "probe" : "probes");
  else
    std::fprintf(stderr, "tandem gateway: engine %s (%s) %s: its health probe passed\n",
                 e->config.name.c_str(), address_key(e->config).c_str(),
                 e->admitted ? "readmitted" : "admitted");
  readmit(*e, now);
  return true;
}

void EndpointTable::readmit(EndpointState& e, Clock::time_point now) {
  e.healthy = true;
  // The slow-start ramp is for an engine coming back from an ejection: one that joined and is
  // admitted for the first time takes its whole limit, as the topology's engines and a joining
  // engine whose first probe passed do (it was held, limit 0, until now), and so does one refused
  // at its first check (its probes failed, or it served another model) that now passes.
  if (e.admitted) {
    e.readmitted = now;
    e.readmissions_total->inc();
  }
  if (!e.unchecked) e.admitted = true;
  // Whatever answered at its address before its probes failed may be gone, an engine that joined
  // too (a process at that address still running when it was added, then restarted): entries
  // its consumer took from it would point at a cache the new process does not hold.
  if (readmission_is_the_only_restart_signal(e))
    forget_cached_prefixes(e, e.unchecked ? "passed a health probe after failing (it may have "
                                            "restarted since it joined)"
                                          : "was readmitted (it may have restarted)");
  // What answers there now may be another server: an auto engine is asked again, and so is
  // every engine's longest sequence.
  if (e.dialect == Dialect::kAuto) {
    e.load_source = LoadSource::kAsking;
    e.load_trouble.clear();  // said again if the new server has it too
  }
  e.length_query = LengthQuery::kToAsk;
  e.max_model_len = 0;
  e.healthy_gauge->set(1);
  update_ready();
}

bool EndpointTable::models_result(int id, std::optional<int64_t> max_model_len,
                                  std::string not_serving, Clock::time_point now) {
  EndpointState* e = find(id);
  if (!e || e->length_query != LengthQuery::kAsking) return false;  // readmitted: asked again
  // Its first check ends with any answer, or none (an engine without GET /v1/models, or whose
  // call failed, is admitted as it always was; its next probe asks again).
  const bool held = checked(*e);
  if (!max_model_len) {
    e->length_query = LengthQuery::kToAsk;
    if (e->healthy) e->admitted = true;
    return held;
  }
  bool changed = held;
  if (!not_serving.empty()) {
    // An engine held for its first check took no request: it is not admitted, not ejected.
    if (not_serving != e->not_serving)
      std::fprintf(stderr, "tandem gateway: engine %s (%s) %s: %s\n", e->config.name.c_str(),
                   address_key(e->config).c_str(), e->admitted ? "ejected" : "not admitted",
                   not_serving.c_str());
    changed = changed || e->healthy;
    if (e->healthy && e->admitted) e->ejections_total->inc();
    e->healthy = false;
    e->healthy_gauge->set(0);
    e->not_serving = std::move(not_serving);
  } else if (!e->not_serving.empty()) {
    std::fprintf(stderr, "tandem gateway: engine %s (%s) %s: it serves the model now\n",
                 e->config.name.c_str(), address_key(e->config).c_str(),
                 e->admitted ? "readmitted" : "admitted");
    e->not_serving.clear();
    readmit(*e, now);
    changed = true;
  }
  e->length_query = LengthQuery::kAnswered;
  e->max_model_len = *max_model_len;
  if (e->healthy) e->admitted = true;  // its first check passed
  update_ready();
  return changed;
}

bool EndpointTable::load_result(int id, LaunchedAtPoll launched_at_poll, LoadAnswer answer,
                                Clock::time_point now) {
  EndpointState* e = find(id);
  if (!e) return false;
  e->load_polling = false;
  if (answer.kind == LoadAnswer::Kind::kNoAnswer) return false;
  if (answer.kind == LoadAnswer::Kind::kNoReport) {
    if (e->load_source == LoadSource::kAsking) {
      // A vLLM or SGLang engine: routed by the gateway's own counts, never waiting for reports
      // (nor polled again, so no trouble is left standing for /admin/endpoints to show). Where a
      // Tandem engine reported before, another server answers there now: the prefixes the index
      // holds for that address were the old one's (its readmission left them to the reports).
      if (e->load.known) forget_cached_prefixes(*e, "no longer sends load reports (replaced?)");
      e->load = {};  // the old server's: neither shown nor compared with a later report
      e->load_source = LoadSource::kOwnCounts;
      e->load_trouble.clear();
      std::fprintf(stderr,
                   "tandem gateway: engine %s has no Tandem load report at GET /load (%s): "
                   "routing it by the gateway's own counts\n",
                   e->config.name.c_str(), answer.why.c_str());
    } else if (answer.why != e->load_trouble) {
      // Asked on every poll (its reports may come back; meanwhile its report grows stale and the
      // gateway's own counts stand in), but said only when the reason is new: a `tandem` engine
      // without GET /load used to log this line on every poll.
      std::fprintf(stderr,
                   "tandem gateway: engine %s answered GET /load without a Tandem load report "
                   "(%s): routing it by the gateway's own counts until its reports resume\n",
                   e->config.name.c_str(), answer.why.c_str());
      e->load_trouble = std::move(answer.why);
    }
    return false;
  }
  if (!e->load_trouble.empty()) {
    std::fprintf(stderr, "tandem gateway: engine %s reports its load again at GET /load\n",
                 e->config.name.c_str());
    e->load_trouble.clear();
  }
  e->load_source = LoadSource::kReports;
  if (reports_a_restart(e->load, answer.report))
    forget_cached_prefixes(*e, "restarted (its load report shows another process)");
  e->load = absorb(std::move(e->load), std::move(answer.report), launched_at_poll.work, now,
                   topo_.scheduling.tandem.prior);
  e->load.finished_at_report = e->counts.launched_total - e->counts.uncached_in_flight;
  e->load.legs_launched_at_poll = launched_at_poll.legs;
  return true;
}

bool EndpointTable::readmission_is_the_only_restart_signal(const EndpointState& e) const {
  // Most ejections are no restart (three failed legs of one failed step, probes timed out during
  // a pause): clearing on each dropped a cache the engine still held, and its consumer's replay
  // from seq 0 reaches back only buffer_steps batches, so its oldest, hottest prefixes never came
  // back. The simulator's engines never restart.
  if (external_events_.count(e.id)) return false;
  // Its load reports tell (another process instance, or steps that went back) where the gateway
  // polls them (while it is ejected too) and has taken one to compare with: a `tandem` engine, or
  // an `auto` engine asked again since an earlier readmission. With polling off (load_interval 0),
  // or no report taken yet, nothing else would ever tell.
  const bool reports_tell = topo_.scheduling.load_interval.count() > 0 && e.load.known;
  if (reports_tell &&
      (e.load_source == LoadSource::kReports || e.load_source == LoadSource::kAsking))
    return false;
  return true;
}

void EndpointTable::forget_cached_prefixes(EndpointState& e, const char* why) {
  if (!has_events(e.id)) return;
  std::fprintf(stderr,
               "tandem gateway: engine %s %s: its cached prefixes are dropped from the prefix "
               "index until its KV events name them again\n",
               e.config.name.c_str(), why);
  const auto consumer = consumers_.find(e.id);
  if (consumer == consumers_.end()) {
    prefix_index_.clear(e.id);
    return;
  }
  // The old consumer stops first, so no batch of the old stream is applied after the clear; the
  // new one clears the engine's entries as it starts and warms up from the new process's replay
  // buffer (a clear here, after it started, could drop what that replay applied).
  consumer->second.reset();
  try {
    consumer->second = consumer_for(e.id, e.config);
  } catch (const std::exception& err) {
    // It was built from the same endpoint before, so this is not expected; without a consumer
    // the engine's cached prefixes are unknown rather than stale.
    consumers_.erase(consumer);
    std::fprintf(stderr, "tandem gateway: engine %s: its KV-event consumer cannot be rebuilt: %s\n",
                 e.config.name.c_str(), err.what());
  }
}

void EndpointTable::forget(int id) {
  if (const EndpointState* e = find(id)) {
    // The engine's series go with it, unless an engine of the same pool and name (one added
    // while it drained) holds them: a name that comes back later starts its series at 0.
    const bool shared = std::any_of(endpoints_.begin(), endpoints_.end(), [&](const auto& kv) {
      return kv.first != id && kv.second.prefill == e->prefill &&
             kv.second.config.name == e->config.name;
    });
    if (!shared) {
      const std::vector<std::string> labels = {e->prefill ? "prefill" : "decode", e->config.name};
      metrics_.endpoint_in_flight.remove(labels);
      metrics_.endpoint_healthy.remove(labels);
      metrics_.endpoint_draining.remove(labels);
      metrics_.endpoint_ejections.remove(labels);
      metrics_.endpoint_readmissions.remove(labels);
      metrics_.endpoint_requests.remove(labels);
      metrics_.endpoint_failures.remove(labels);
      metrics_.endpoint_overloaded.remove(labels);
    }
  }
  endpoints_.erase(id);
  consumers_.erase(id);  // before the index forgets the engine: no event re-adds it
  external_events_.erase(id);
  prefix_index_.remove_engine(id);
  if (on_forget_) on_forget_(id);
}

bool EndpointTable::drain(int id) {
  EndpointState* e = find(id);
  if (!e || e->draining) return false;
  e->draining = true;
  e->draining_gauge->set(1);  // its health stays as checked: a planned drain is no outage
  // Its in-flight gauge keeps counting the legs that still run, down to 0 as they end, unless
  // the name comes back (admin add, reload) before it leaves: join() then gives the labelled
  // gauges to the newcomer.
  if (e->in_flight == 0) forget(id);
  update_ready();
  return true;
}

std::string EndpointTable::admission_error(bool prefill, const Endpoint& e) const {
  if (prefill && topo_.mode == PdMode::kAggregated) return "aggregated mode has no prefill pool";
  if (prefill && topo_.mode == PdMode::kParallel && e.bootstrap_port == 0)
    return "a parallel-mode prefill engine needs bootstrap_port";
  for (const auto& [id, x] : endpoints_)
    if (!x.draining && x.config.name == e.name) return "an endpoint named '" + e.name + "' exists";
  for (const auto& [id, x] : endpoints_)
    if (!x.draining && x.prefill == prefill && address_key(x.config) == address_key(e))
      return "endpoint.url: " + net::url_host(e.host) + ":" + std::to_string(e.port) +
             " is already in the " + (prefill ? "prefill" : "decode") + " pool, as '" +
             x.config.name + "'";
  // A prefill engine's requests decode in its group: without a decode engine there, each would
  // be prefilled for nothing. A decode engine may come first (a new group starts with it).
  if (prefill && topo_.mode != PdMode::kAggregated &&
      std::none_of(endpoints_.begin(), endpoints_.end(), [&](const auto& kv) {
        return !kv.second.prefill && !kv.second.draining && kv.second.config.group == e.group;
      }))
    return "group " + std::to_string(e.group) +
           " has no decode engine; add one to the group before its prefill engines";
  return {};
}

EndpointTable::ReloadResult EndpointTable::reload(const Topology& next) {
  // Planned, and every new engine's consumer built, before anything changes: a consumer that
  // cannot be built (an endpoint ZMQ refuses) used to throw after the engines it replaced were
  // drained, leaving none.
  struct Joining {
    bool prefill;
    Endpoint endpoint;
    int id;
    std::unique_ptr<KvEventsConsumer> consumer;
    bool replaces_checked = false;  // an engine at its name and address that passed its checks
  };
  std::vector<int> drop;
  std::vector<Joining> joining;
  const int first_id = next_id_;
  try {
    for (bool prefill : {true, false}) {
      const Pool& next_pool = prefill ? next.prefill : next.decode;
      const PoolSettings pool = settings_of(next_pool);
      const auto& wanted = next_pool.endpoints;
      // What the engine would be if it joined now: a new pool dialect or limit changes it too.
      auto same = [&](const Endpoint& w, const EndpointState& e) {
        return same_endpoint(w, e.config) && e.dialect == pool.dialect &&
               e.max_in_flight == limit_of(w, pool);
      };
      for (const auto& [id, e] : endpoints_) {
        if (e.prefill != prefill || e.draining) continue;
        const bool keep = std::any_of(wanted.begin(), wanted.end(),
                                      [&](const Endpoint& w) { return same(w, e); });
        if (!keep) drop.push_back(id);
      }
      for (const auto& w : wanted) {
        const bool have = std::any_of(endpoints_.begin(), endpoints_.end(), [&](const auto& kv) {
          return kv.second.prefill == prefill && !kv.second.draining && same(w, kv.second);
        });
        if (have) continue;
        // The same engine (name and address) under the pool's new settings was checked already,
        // unless it was ejected or its own first check is still under way.
        const bool replaces_checked =
            std::any_of(endpoints_.begin(), endpoints_.end(), [&](const auto& kv) {
              const EndpointState& e = kv.second;
              return e.prefill == prefill && !e.draining && e.config.name == w.name &&
                     address_key(e.config) == address_key(w) && e.healthy && !e.unchecked;
            });
        const int id = next_id_++;
        joining.push_back({prefill, w, id, nullptr, replaces_checked});
        joining.back().consumer = consumer_for(id, w);
      }
    }
  } catch (...) {
    for (auto& j : joining) {
      j.consumer.reset();
      prefix_index_.remove_engine(j.id);
    }
    next_id_ = first_id;
    throw;
  }
  prefill_pool_ = settings_of(next.prefill);
  decode_pool_ = settings_of(next.decode);
  // Drained before the newcomers join: one with a leaving engine's name takes over its gauges.
  ReloadResult result;
  for (int id : drop) result.removed += drain(id) ? 1 : 0;
  for (auto& j : joining) {
    join(j.prefill, std::move(j.endpoint), j.id, std::move(j.consumer), j.replaces_checked);
    ++result.added;
  }
  return result;
}

json EndpointTable::to_json(const EndpointState& e, Clock::time_point now) const {
  json j = {{"name", e.config.name},
            {"pool", e.prefill ? "prefill" : "decode"},
            {"host", e.config.host},
            {"port", e.config.port},
            {"group", e.config.group},
            {"healthy", e.healthy},
            {"draining", e.draining},
            {"in_flight", e.in_flight},
            {"max_in_flight", e.max_in_flight},
            {"consecutive_failures", e.consecutive_failures},
            {"failed_probes_while_out", e.failed_probes_while_out},
            {"load_source", load_source_name(e.load_source)}};
  if (!e.not_serving.empty()) j["unhealthy_reason"] = e.not_serving;
  if (e.unchecked) j["unchecked"] = true;
  if (!e.load_trouble.empty()) j["load_error"] = e.load_trouble;
  if (e.max_model_len > 0) j["max_model_len"] = e.max_model_len;
  if (has_events(e.id)) j["prefix_blocks"] = prefix_index_.num_blocks(e.id);
  j["uncached_tokens_in_flight"] = e.counts.uncached_in_flight.tokens;
  if (e.load.known) {
    const LoadReport& r = e.load.report;
    j["load"] = {
        {"running", r.running},
        {"waiting", r.waiting},
        {"free_blocks", r.free_blocks},
        {"total_blocks", r.total_blocks},
        {"prefill_tokens", r.prefill_tokens},
        {"age_ms", std::chrono::duration<double, std::milli>(now - e.load.received).count()},
        {"batch_observations", e.load.batch_time.observations}};
  }
  if (e.config.bootstrap_port) j["bootstrap_port"] = e.config.bootstrap_port;
  return j;
}

}  // namespace tandem::gateway
