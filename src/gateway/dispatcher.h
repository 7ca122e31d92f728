#pragma once
// The gateway's decisions, on the scheduling thread: the waiting queue, the policy's picks, the
// legs it starts on engines (through the Upstream seam), their deadlines and retries, endpoint
// changes (admin, reload, drain) and the end of every request (end_request). Time comes from the
// Executor seam, so unit tests (and a virtual-time simulator) drive this code with a virtual
// clock and fake engines: tests/gateway/dispatcher_test.cpp.
//
// Threads: submit() and the admin operations run on the executor; end_request(), client_gone(),
// leg_failed() and prefill_answered() may be called from any thread (the relay's io threads).
#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "gateway/endpoints.h"
#include "gateway/gateway_metrics.h"
#include "gateway/lifecycle.h"
#include "gateway/policy.h"
#include "gateway/relay.h"
#include "gateway/request.h"
#include "gateway/request_record.h"
#include "gateway/seams.h"
#include "gateway/topology.h"
#include "util/log_throttle.h"

namespace tandem::gateway {

class AccessLog;

// What the requests a stopping gateway ends get (Dispatcher::shut_down): an OpenAI error, 503.
inline constexpr std::string_view kShuttingDown = "the gateway is shutting down";

class Dispatcher {
 public:
  // Everything is owned by the caller and outlives the dispatcher; `access_log` may be null.
  // `policy` is made with the topology's policy_options.
  Dispatcher(const Topology& topology, Executor& executor, Upstream& upstream, const Policy& policy,
             EndpointTable& endpoints, GatewayMetrics& metrics, AccessLog* access_log);
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  // ---- scheduling thread

  // A prepared request (front_end.h) joins the queue; it starts as soon as engines are free.
  void submit(const RequestPtr& r) { submit(std::span(&r, 1)); }
  // Requests admitted together, the choices of one client request (choice_fan_out.h): all join
  // the queue when it has a place free (made by shedding lower classes' waiting requests where it
  // must: make_room), or all are refused (429); a client never has some of its choices computed
  // and the rest refused. A group of n overshoots max_queue by at most n - 1; one larger than
  // max_queue is the client's error (400). Past Topology::max_queued_body_bytes an
  // arrival is refused (429) as at a full queue, unless shedding lower classes' requests frees the
  // bytes (make_room); one whose bodies alone are past it, while anything waits, sheds none.
  // Requests already ended are skipped.
  void submit(std::span<const RequestPtr> group);
  // Starts every waiting request an engine is free for (after anything that frees one).
  void dispatch();
  // The engines' health changed (HealthMonitor's `changed`): the legs of requests that sent their
  // client nothing, still running on an engine ejected and failing its health probes since the
  // last call, are cut as its failure and retried elsewhere (attempt_failed), since such an engine
  // (dead or hung) would hold them until their timeouts; one ejected for failed requests that
  // still answers its probes keeps them. A stream under way keeps its leg (its idle timeout bounds
  // it); a drained engine is not ejected: its legs finish. Then dispatch().
  void engines_changed();

  // Admin operations. add_endpoint returns why it cannot join (empty: added, as endpoint_json's
  // `*id`).
  std::string add_endpoint(bool prefill, const Endpoint& endpoint, int* id = nullptr);
  // Drains the endpoint of that name: false if there is none. `in_flight`: its requests then.
  bool remove_endpoint(const std::string& name, int64_t* in_flight);
  // Throws, changing nothing, when a new engine cannot join (EndpointTable::reload).
  EndpointTable::ReloadResult reload(const Topology& next);
  nlohmann::json endpoints_json() const;
  nlohmann::json endpoint_json(int id) const;  // null when there is none
  nlohmann::json debug_requests() const;
  // GET /dashboard/state (dashboard.h): endpoints_json() with each engine's reported reuse, the
  // queue, the recorder's recent requests and totals, and the latency histograms. Starts (or
  // extends) the recorder's watch, so the requests that end next are kept for it.
  nlohmann::json dashboard_state();
  // The engine of that name not being drained, or null.
  const EndpointState* endpoint_named(const std::string& name) const;
  // An engine to relay GET /v1/models, /tokenize and /detokenize to: the eligible decode engine
  // with the fewest requests in flight, however busy (no policy limit applies), or null. One that
  // joined and has not passed its first health check is none, as for requests.
  const EndpointState* models_endpoint() const;
  // Whether engines get the policy's prefill deadlines (Policy::prefill_deadline) in the field
  // `priority`, which the gateway then owns. The policy is made with policy_options(topology),
  // which turns deadlines off where priority classes set the field instead.
  bool sets_prefill_deadlines() const { return policy_.sets_prefill_deadlines(); }

  size_t waiting() const { return waiting_.size(); }
  size_t active() const { return active_.size(); }
  // Bytes of request bodies the waiting requests hold (Topology::max_queued_body_bytes).
  size_t queued_body_bytes() const { return queued_body_bytes_; }

  // ---- any thread

  enum class Accounting {
    kPosted,   // the scheduler accounts for it in a task of its own
    kWithLeg,  // the ending leg's completion accounts for it (one post instead of two)
  };
  // The one way a request ends: the first call records `outcome` (later ones return false), cuts
  // its running legs unless it succeeded, stamps `completed`, and has the scheduler account for
  // it (metrics, access log, the queue and books) as `accounting` says.
  bool end_request(const RequestPtr& r, Outcome outcome,
                   Accounting accounting = Accounting::kPosted);
  // The client went away (or the server is stopping): 499, as nginx logs it.
  void client_gone(const RequestPtr& r);
  // Whose failure a failed leg is: the engine the retry avoids.
  enum class Blame {
    kItsEngine,
    // Its engine, which it never reached (no connection was made): a sequential decode leg's
    // prompt KV is still held on the prefill engine, for another decode engine to take.
    kItsEngineUnreached,
    // The prefill engine of the attempt: the decode engine could not take the prompt's KV from
    // it (Leg::kv_transfer_failed), and only reported that.
    kPrefillEngine,
    // No engine: the prefill engine no longer held the prompt's KV when the decode engine came
    // for it (Leg::kv_expired). The request starts again from its prefill, avoiding no engine.
    kNoEngineKvGone,
    // No engine: the prefill engine refused the decode engine's pull for now, its KV transfer
    // connections all in use (Leg::kv_transfer_busy). The KV is still held there: a decode leg
    // goes again with it after the topology's retry_backoff, avoiding no engine and spending no
    // retry, until the hold's end (timeouts.decode_queue_ms).
    kNoEngineKvBusy,
  };
  // A leg of `attempt` failed before the client got anything (relay.h): retried elsewhere while
  // retries remain (avoiding the engine `blame` names; a sequential decode leg that reached its
  // engine starts again from the prefill), else answered with the engine's error or a 502.
  // `retry_after`: the engine's Retry-After on its refusal (429, 503), which the client gets with
  // that refusal once retries are spent.
  void leg_failed(const RequestPtr& r, int attempt, int endpoint_id, int status, std::string body,
                  std::string message, Blame blame = Blame::kItsEngine,
                  std::string retry_after = {});
  // A leg of `attempt` brought an answer the gateway will not relay (Topology::max_answer_bytes,
  // code answer_too_large), or none within the time it allows a whole answer (first_token_ms,
  // code timeout): no other engine is asked (each would compute the same answer as long); the
  // client gets `status` with `message` (an OpenAI error with `code`) unless it already has an
  // answer. Whether the engine is blamed is its leg's completion's to say.
  void answer_refused(const RequestPtr& r, int attempt, int status, std::string message,
                      std::string code);
  // Sequential mode: the prefill of `attempt` answered from engine `endpoint_id` with its KV's
  // whereabouts, `params` (the answer's `"kv_transfer_params":{...}` member): the decode leg goes
  // to the front of the queue. An answer for an attempt given up, or a request that ended, is of
  // KV nobody will pull: its engine is told to let go of it at once.
  void prefill_answered(const RequestPtr& r, int attempt, int endpoint_id, std::string params);

  // ---- shutdown (scheduling thread)

  // The drain of a gateway that stops: `idle` runs once no request is waiting or running (at
  // once when none is). Meanwhile requests go on as ever (legs start, failures are retried).
  void when_idle(std::function<void()> idle);
  // The drain is over: every request left ends now, the gateway's doing and no engine's (no
  // retry, no engine blamed). A client that has nothing yet gets 503 (kShuttingDown, an OpenAI
  // error); a stream is cut by its relay with that error event. Requests submitted after get 503
  // too, and no leg starts.
  void shut_down();

  Executor& executor() { return exec_; }
  const Topology& topology() const { return topo_; }

 private:
  RequestInfo info(const Request& r) const;
  void enqueue(const RequestPtr& r, bool front);
  void arm_queue_timeout(const RequestPtr& r);
  // An arrival of `arriving_class` (one request, or a group) holding `arriving_bytes` of bodies
  // needs one free place in the queue and room for its bytes (max_queued_body_bytes): where either
  // lacks, the newest waiting requests of the lowest classes ranking below it that were never sent
  // to an engine are shed until both fit, a group (Request::submitted_with) whole, each answered
  // 429; an arrival larger than max_queued_body_bytes by itself sheds none (it fits only an empty
  // queue). Empty when the arrival may join; else the 429's text.
  std::string make_room(int arriving_class, size_t arriving_bytes);
  void remove_waiting(const RequestPtr& r);
  // vllm:num_requests_waiting and vllm:num_requests_running (the active ones not waiting).
  void publish_counts();
  std::string pools_state(const Request& r) const;
  void dispatch(Clock::time_point now);
  // Sequential mode: a prompt being prefilled or waiting to decode sets aside room on a decode
  // engine of its prefill engine's group (decode_reserved_), so that no more prompts are
  // prefilled than the group can decode. Reserving again moves the reservation.
  void reserve_decode(Request& r, int group);
  bool release_decode(Request& r);  // whether `r` held a place
  // The reservations in `v`: its decode engines' in_flight counts them (add_decode_reservations).
  void add_decode_reservations(ClusterView& v) const;
  void start(const RequestPtr& r, int prefill, int decode);
  void start_leg(const RequestPtr& r, int endpoint_id, bool prefill, std::string body);
  net::AsyncHttpRequest upstream_request(const EndpointState& e, const Request& r, std::string body,
                                         std::chrono::milliseconds timeout) const;
  void leg_done(const Leg& leg, LegOutcome outcome);
  void attempt_failed(const RequestPtr& r, int attempt, int endpoint_id, int status,
                      std::string body, std::string message, Blame blame, std::string retry_after);
  // Whether every engine of the pool of `endpoint_id` (prefill or decode; in parallel mode, of
  // either pool, its retry being a pair) that the policy could pick for `r` (one that can serve;
  // of its prefill's group for a sequential decode stage) refused or failed it already
  // (Request::excluded), one of them refusing it (Request::refused_by): a retry can only go back
  // to one of them, and may meet a full queue again.
  bool only_tried_engines_left(const Request& r, int endpoint_id) const;
  // `r` joins the queue again (first in line) at `due`, unless it ended or moved on meanwhile.
  void enqueue_at(const RequestPtr& r, Clock::time_point due);
  // Sequential mode, a decode stage whose prefill engine refused the pull for now: it joins the
  // queue again (first in line) after the jittered backoff of its busy retry, never later than its
  // KV's hold allows (timeouts.decode_queue_ms), unless it ended meanwhile.
  void enqueue_after_backoff(const RequestPtr& r);
  // A decode leg sent at `since` could not take its KV from this prefill engine: its failure, for
  // the policy and its health, as a timed-out leg of its own would be (overload if it passed a
  // health probe since).
  void prefill_engine_failed(int endpoint_id, Clock::time_point since);
  void answer_error(const RequestPtr& r, int status, const std::string& message);
  // The gateway's own overload answer (a full queue's 429, a queue timeout's 503): as
  // answer_error, of a type that is no client error, with Retry-After.
  void answer_overload(const RequestPtr& r, int status, const std::string& message);
  static constexpr int kOverloadRetryAfterSeconds = 1;
  void finished(const RequestPtr& r);
  static bool prefill_leg_running(Request& r);
  void cancel_calls(const std::vector<Upstream::CallId>& calls);
  // Sequential mode, a request that ended or starts again from its prefill: when the prompt's KV
  // it holds on a prefill engine (Request::held_kv) was taken by no decode engine (every decode
  // leg sent with it left it untaken, or none was sent), that engine is told to let go, once: the
  // KV is no longer the request's either way.
  void release_unclaimed_kv(Request& r);
  // POST /v1/kv_transfer/release with `params` (a kv_transfer_params member) to the prefill engine
  // `endpoint_id`, unless it is known to be no Tandem engine (it does not report its load: vLLM's
  // have no such route, and free held KV at their own timeout), in the background: bounded by
  // timeouts.connect_ms as a whole and by kMaxKvReleases at once, never delaying an answer; its
  // outcome is counted in tandem:gateway_kv_releases_total, failures logged (at most one line per
  // 10 s). A burst (hundreds of clients leaving together) is sent in turn, as calls end, rather
  // than dropped: a dropped release holds the prefill engine's blocks until its
  // --kv-transfer-timeout, when it most needs them. Only past kMaxQueuedKvReleases waiting is one
  // dropped (and counted).
  void release_held_kv(int endpoint_id, const std::string& params, const net::Headers& headers);
  struct KvRelease {
    int endpoint_id;
    std::string params;  // the kv_transfer_params member
    net::Headers headers;
  };
  void send_kv_release(KvRelease release);
  static constexpr int64_t kMaxKvReleases = 64;
  static constexpr size_t kMaxQueuedKvReleases = 4096;
  void answer_shutting_down(const RequestPtr& r);

  const Topology& topo_;
  Executor& exec_;
  Upstream& upstream_;
  const Policy& policy_;
  PolicyState policy_state_;  // the policy's explicit state
  EndpointTable& endpoints_;
  GatewayMetrics& metrics_;
  Relay relay_;
  std::atomic<bool> stopping_{false};
  std::function<void()> idle_;  // when_idle's

  std::deque<RequestPtr> waiting_;
  // What waiting_ holds of bodies (body_bytes), for Topology::max_queued_body_bytes.
  size_t queued_body_bytes_ = 0;
  std::vector<RequestPtr> scratch_first_stage_, scratch_offer_;  // dispatch()'s, empty between
  std::unordered_map<const Request*, RequestPtr> active_;
  std::map<int, int64_t> decode_reserved_;  // sequential mode: requests per group (reserve_decode)
  std::vector<int> ejected_;  // engines ejected and failing probes at the last engines_changed()
  int64_t kv_releases_ = 0;   // release_held_kv calls under way
  std::deque<KvRelease> kv_releases_waiting_;  // their turn after those (release_held_kv)
  LogThrottle kv_release_log_{std::chrono::seconds(10)};
  RequestRecorder recorder_;
};

}  // namespace tandem::gateway
