#pragma once
// The engines the gateway sends requests to, as the scheduling thread keeps them: their
// configuration, what is in flight there, their health and load reports, and the changes the
// admin API and reloads make. Scheduling thread only (no locks); the clock is passed in.
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "gateway/engine_load.h"
#include "gateway/gateway_metrics.h"
#include "gateway/policy.h"
#include "gateway/topology.h"

namespace tandem::gateway {

class PrefixIndex;
class KvEventsConsumer;
struct Leg;

// How a leg ended, for the engine's health: an overloaded engine is alive, and ejecting it would
// only pile its load onto the others (and under enough load eject every engine).
enum class LegOutcome {
  kOk,
  kFailed,    // a transport error, a 5xx other than 503, an error event, a malformed answer
  kBusy,      // the engine answered 429 or 503: it is full
  kTimedOut,  // the gateway gave up waiting (prefill or first token)
  // The gateway gave the leg up (its client left, its pair's other leg failed) before the engine
  // answered: nothing learned. Counted as a success, it wiped the failures before it: a hung
  // prefill engine, its legs cancelled as their decode legs failed, was never ejected by them.
  kCancelled,
};

// Where the gateway learns an engine's load: its GET /load reports (Tandem engines), or nothing
// but the gateway's own counts (vLLM and SGLang engines, and engines of an `auto` pool that turned
// out to have no reports). An `auto` engine is asked until it answers either way.
enum class LoadSource { kAsking, kReports, kOwnCounts };
const char* load_source_name(LoadSource source);

// Where the gateway stands on an engine's longest sequence, its GET /v1/models' max_model_len
// (api/model_list.h): asked once the engine passes a health probe, and again after every
// readmission (what answers there may have restarted with other settings). An engine whose call
// failed is asked at its next probe; one that answered without the field is not asked again.
enum class LengthQuery { kToAsk, kAsking, kAnswered };

struct EndpointState {
  int id = 0;
  bool prefill = false;
  Endpoint config;
  // Its pool's dialect when it joined (a reload that changes the pool's replaces it).
  Dialect dialect = Dialect::kAuto;
  int64_t max_in_flight = 0;
  bool healthy = true, draining = false, probing = false;
  // It joined once the health checks ran (an engine added or changed since the gateway started)
  // and its first check has not ended: its health probe, and once that passed its model list.
  // Until then its in-flight limit is 0: requests wait for it or take another engine, so an
  // engine the check ejects (serving another model) takes no requests first. Each call of the
  // check is cut at health.probe_timeout, so once its probe passed this ends within that
  // timeout, whatever the list call answers (a model list that is no answer ends it too). One
  // whose first probe fails is out of routing meanwhile (not healthy), said "not admitted", not
  // ejected; once admitted it takes its whole limit (no slow start: it is no engine coming back).
  bool unchecked = false;
  // Its last health probe failed: an ejected engine that also fails its probes is unresponsive
  // (dead or hung), not merely failing requests under load (Dispatcher::engines_changed).
  bool probe_failed = false;
  // It has been in routing (checked and healthy): the topology's engines from the start, a
  // joining one once its first check passed. Only such an engine is ejected and readmitted; one
  // refused before (its probe failed, or it serves another model) is admitted when that ends,
  // with its whole limit.
  bool admitted = false;
  // When a probe last readmitted it after an ejection (its limit ramps up since).
  Clock::time_point readmitted{};
  Clock::time_point probe_passed{};  // when a health probe last passed
  // Failures in a row while it was in routing, legs and probes: the run that ejects it at
  // health.failures_to_eject. Frozen while it is out (the run that ejected it, as the ejection's
  // line says), reset by a passing probe or a leg that succeeds.
  int consecutive_failures = 0;
  // Health probes failed in a row while it was out of routing (ejected, not admitted): counted
  // apart, as no request or failure of an engine in service is (failures_total stays still while
  // an engine is simply down). Reset by a passing probe.
  int failed_probes_while_out = 0;
  // Every such probe since it joined, never reset: with failures_total, every failed call to it
  // (the simulator's count of failed engine calls; no metric, as failures_total stays still).
  int64_t failed_probes_while_out_total = 0;
  int64_t in_flight = 0, tokens_in_flight = 0;
  GatewayCounts counts;  // uncached prompt work launched / in flight (prefill)
  EngineLoadState load;  // its GET /load reports (tandem engines)
  LoadSource load_source = LoadSource::kOwnCounts;
  bool load_polling = false;
  // Why its polls answer without a report although it is to report (a `tandem` engine, or an
  // `auto` one that reported): said once per change of reason, cleared when a report comes.
  std::string load_trouble;
  LaunchedAtPoll launched_at_last_poll;  // counts when the last poll left
  LengthQuery length_query = LengthQuery::kToAsk;
  int64_t max_model_len = 0;  // what its GET /v1/models said; 0: not known
  // Why it serves none of the gateway's model (its GET /v1/models lists other names, so every
  // request would be answered 404); non-empty: kept unhealthy until a later answer lists it.
  std::string not_serving;
  metrics::Gauge* in_flight_gauge = nullptr;
  metrics::Gauge* healthy_gauge = nullptr;
  metrics::Gauge* draining_gauge = nullptr;
  metrics::IntCounter* ejections_total = nullptr;
  metrics::IntCounter* readmissions_total = nullptr;
  metrics::IntCounter* requests_total = nullptr;
  metrics::IntCounter* failures_total = nullptr;
  metrics::IntCounter* overloaded_total = nullptr;

  bool eligible() const { return healthy && !draining; }
};

// What one GET /load told about an engine.
struct LoadAnswer {
  enum class Kind {
    kReport,    // a report of a Tandem engine
    kNoReport,  // the engine answered, with something that is not one (no /load, another API)
    kNoAnswer,  // no answer (down, a timeout, a 5xx): nothing learned
  };
  Kind kind = Kind::kNoAnswer;
  LoadReport report;
  std::string why;  // for kNoReport
};
// Reads a /load call's outcome: its transport error (empty: none), status and body.
LoadAnswer read_load_answer(const std::string& error, int status, const std::string& body);

class EndpointTable {
 public:
  // `index`: the global prefix index the engines' KV-event consumers feed (kept by the caller).
  EndpointTable(const Topology& topology, GatewayMetrics& metrics, PrefixIndex& index);
  ~EndpointTable();
  EndpointTable(const EndpointTable&) = delete;
  EndpointTable& operator=(const EndpointTable&) = delete;

  // Called with an engine's id when it leaves (after its drain), so policy state can forget it.
  void on_forget(std::function<void(int id)> callback) { on_forget_ = std::move(callback); }
  // From now on an engine that joins is held out of routing until its first health check ended
  // (EndpointState::unchecked), and `joined` gets its id (the health monitor checks it at once).
  // Those that joined before (the topology's, as the gateway starts) take requests from the
  // start: their first probes leave with the gateway's start, as before.
  void check_joining_engines(std::function<void(int id)> joined) { on_join_ = std::move(joined); }

  // With the pool's dialect and max_in_flight as last loaded (the topology's, or a reload's).
  // Throws (changing nothing: no engine, metric series or id) when its KV-event consumer cannot
  // be built, e.g. an endpoint ZMQ refuses.
  int add(bool prefill, Endpoint endpoint);
  // The engine's KV events reach the prefix index some other way (the cluster simulator applies
  // them itself): its cached prefixes are known, as for an engine with a consumer.
  void events_fed_externally(int id) { external_events_.insert(id); }
  EndpointState* find(int id);
  const EndpointState* find(int id) const;
  std::map<int, EndpointState>& all() { return endpoints_; }
  const std::map<int, EndpointState>& all() const { return endpoints_; }

  // Each pool the mode needs has an engine that can serve (can_serve). Any thread.
  bool ready() const;
  // The least longest sequence of the eligible engines that said theirs (LengthQuery); 0: none
  // did. Any thread.
  int64_t max_model_len() const;

  // The policy's view at `now` (slow-start limits, load reports no older than four polls). Only
  // engines that can serve (can_serve) are eligible in it.
  ClusterView view(Clock::time_point now, const PolicyState* state) const;
  // The groups with an eligible decode engine.
  std::set<int> decoding_groups() const;
  // Eligible, and for a prefill engine, its group is one of `decoding_groups`: a prompt
  // prefilled where no engine can decode it would hold its KV for nothing.
  static bool can_serve(const EndpointState& e, const std::set<int>& decoding_groups);
  // Each engine's cached prefix of `prompt_ids` from the KV-event index: tokens it will not
  // recompute (0 when it holds none); -1 (unknown) without a prompt or for engines without events.
  // Blocks cached under another cache salt than the request's (`cache_salt`, hashed as the
  // engines hash it) do not count: the engine would not reuse them for it.
  void fill_cached_tokens(ClusterView& view, const std::vector<int32_t>& prompt_ids,
                          std::optional<uint64_t> cache_salt = std::nullopt) const;
  // What the engines of the named pools were doing at `now`, for the 503 that says why none took
  // a request: e.g. "decode pool: 2 engines, 1 ejected after failures, 1 at its in-flight limit"
  // (an engine that joined and failed its probe is "not admitted yet", not ejected: it failed no
  // request; one whose model list lacks the gateway's model is "serving another model", alive;
  // a readmitted engine's limit as it ramps up; a prefill engine whose group cannot
  // decode, and in parallel mode a decode engine whose group has no eligible prefill engine to
  // pair with, said so). An engine free by all of these is left to the policy's own load limits.
  std::string pools_state(const std::vector<bool>& prefill_pools, Clock::time_point now) const;

  // A leg starts or ends there: its request, prompt tokens and uncached work count until it ends
  // (an engine already gone after its drain is skipped).
  void leg_started(EndpointState& e, const Leg& leg);
  // A busy engine (429/503), or one whose leg timed out but whose probe passed since the leg was
  // sent, is overloaded: counted, never ejected for it. Other failures count toward ejection.
  void leg_finished(const Leg& leg, LegOutcome outcome);
  // A failed leg or probe (`what`, for the stderr line of an ejection: "a failed request"):
  // ejects the engine after health.failures_to_eject in a row. A leg of an engine already out
  // (one in flight at its ejection) counts in failures_total only: its run ended it already.
  void failure(EndpointState& e, const char* what = "a failed request");
  // A failure that may be load: an engine that passed a health probe since `since` is alive and
  // counts as overloaded, else as failing (towards ejection).
  void failure_since(EndpointState& e, Clock::time_point since);

  // Health probe and load poll results; true when the engine's state changed so that waiting
  // requests may now start (readmitted, or a fresher load report) or have no engine left
  // (ejected by its probes, or an unchecked engine's first probe failed), or an ejected engine's
  // probes began to fail: the caller dispatches again (engines_changed). `why`: how a failed
  // probe failed ("connect: Connection refused"), for the line that says an engine is not
  // admitted.
  bool probe_result(int id, bool ok, Clock::time_point now, const std::string& why = {});
  bool load_result(int id, LaunchedAtPoll launched_at_poll, LoadAnswer answer,
                   Clock::time_point now);
  // What an engine's GET /v1/models told: nullopt when it did not answer (a transport error, a
  // 5xx), else its max_model_len (0: an answer without one), and `not_serving`, why it serves
  // none of the gateway's model (empty: it serves it, or cannot tell). An engine that does not is
  // ejected (said on stderr); one that does again is readmitted. True when that changed it, or
  // ended an unchecked engine's first check (either way: it is no longer held).
  bool models_result(int id, std::optional<int64_t> max_model_len, std::string not_serving,
                     Clock::time_point now);

  // Draining: no new requests; it leaves once its last leg finished. False if unknown/draining.
  bool drain(int id);
  // Why `endpoint` cannot join a pool now (empty: it can), by the rules of validate().
  std::string admission_error(bool prefill, const Endpoint& endpoint) const;
  // Endpoints are matched by name and settings (their own, and their pool's dialect and
  // max_in_flight as they apply to them): unchanged ones stay (with their load), changed or
  // missing ones are drained, new ones are added. The pools' settings apply to later adds too.
  // Throws, changing nothing, when a new engine's KV-event consumer cannot be built.
  struct ReloadResult {
    int added = 0, removed = 0;
  };
  ReloadResult reload(const Topology& next);

  nlohmann::json to_json(const EndpointState& e, Clock::time_point now) const;

 private:
  void forget(int id);
  void update_ready();
  // Its first health check ended (EndpointState::unchecked): true when it was unchecked.
  static bool checked(EndpointState& e);
  // Eligible again (a probe passed, or its model list names the model again); an engine held for
  // its first check is still held, and gets no slow start.
  void readmit(EndpointState& e, Clock::time_point now);
  // Its in-flight limit at `now`: the slow-start ramp after a readmission.
  int64_t in_flight_limit(const EndpointState& e, Clock::time_point now) const;
  bool has_events(int id) const { return consumers_.count(id) || external_events_.count(id); }
  // A readmitted engine may be a new process, but only an engine with no load reports (vLLM,
  // SGLang) has no better sign of it; an engine whose events are fed externally never restarts.
  bool readmission_is_the_only_restart_signal(const EndpointState& e) const;
  // What answers at the engine's address may be a new process (its load report showed a restart,
  // or, for an engine without reports, it was readmitted after an ejection): its prefix cache is
  // gone, so its entries leave the prefix index, and its KV-event consumer is recreated to follow
  // the new process's stream from seq 0 (one whose first seqs are not lower than the old stream's
  // last cannot tell). `why` completes the log line "engine <name> ...".
  void forget_cached_prefixes(EndpointState& e, const char* why);

  // A pool's settings that apply to its engines as they join.
  struct PoolSettings {
    Dialect dialect = Dialect::kAuto;
    int64_t max_in_flight = 0;
  };
  static PoolSettings settings_of(const Pool& pool) { return {pool.dialect, pool.max_in_flight}; }
  // The KV-event consumer engine `id` would have (null without kv_events). Throws when it cannot
  // be built, leaving the index without the engine.
  std::unique_ptr<KvEventsConsumer> consumer_for(int id, const Endpoint& endpoint);
  // Adds an engine whose consumer, if any, is built already. `replaces_checked`: it replaces an
  // engine of the same name and address that passed its checks (a reload that changed the pool's
  // limit or dialect), so it is not held for a first check (EndpointState::unchecked).
  void join(bool prefill, Endpoint endpoint, int id, std::unique_ptr<KvEventsConsumer> consumer,
            bool replaces_checked = false);
  static int64_t limit_of(const Endpoint& e, const PoolSettings& pool) {
    return e.max_in_flight > 0 ? e.max_in_flight : pool.max_in_flight;
  }

  const Topology& topo_;
  PoolSettings prefill_pool_, decode_pool_;
  GatewayMetrics& metrics_;
  PrefixIndex& prefix_index_;
  std::function<void(int)> on_forget_;
  std::function<void(int)> on_join_;
  std::map<int, EndpointState> endpoints_;
  // One KV-event consumer per engine that publishes events (their threads write the index).
  std::map<int, std::unique_ptr<KvEventsConsumer>> consumers_;
  std::set<int> external_events_;
  int next_id_ = 0;
  std::atomic<bool> ready_{false};         // read by the io threads (GET /health)
  std::atomic<int64_t> max_model_len_{0};  // read by the io threads (tokens-in requests)
  metrics::Gauge detached_gauge_;          // written by draining engines, never rendered
};

}  // namespace tandem::gateway
