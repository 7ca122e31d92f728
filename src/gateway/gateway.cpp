#include "gateway/gateway.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "api/block_hash.h"
#include "api/disaggregation.h"
#include "api/error.h"
#include "api/prefill_work.h"
#include "gateway/access_log.h"
#include "gateway/answer_text.h"
#include "gateway/engine_load.h"
#include "gateway/kv_events_consumer.h"
#include "gateway/lifecycle.h"
#include "gateway/policies/queue_order.h"
#include "gateway/policy.h"
#include "gateway/prefix_index.h"
#include "gateway/scheduling_thread.h"
#include "gateway/tokens_in.h"
#include "net/async_http_client.h"
#include "net/http_server.h"
#include "net/sse.h"
#include "util/error.h"
#include "util/json.h"
#include "util/metrics.h"
#include "util/random_id.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;
using CallId = net::AsyncHttpClient::CallId;

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string address(const Endpoint& e) {
  std::string s = e.host;
  s += ':';
  s += std::to_string(e.port);
  return s;
}

// Prompt blocks the gateway hashes its ids in (api/block_hash.h): the policies' prompt identity
// (tandem's miss spreading). The prefix index learns each engine's own block size from its events.
constexpr int64_t kPrefixBlockTokens = 16;

// A /load answer is a few kilobytes; anything far larger is not one.
constexpr size_t kMaxLoadReportBytes = size_t{1} << 20;

// Where the gateway learns an engine's load: its GET /load reports (Tandem engines), or nothing
// but the gateway's own counts (vLLM and SGLang engines, and engines of an `auto` pool that turned
// out to have no reports). An `auto` engine is asked until it answers either way.
enum class LoadSource { kAsking, kReports, kOwnCounts };

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

// An engine the gateway sends requests to, as the scheduling thread keeps it.
struct EndpointState {
  int id = 0;
  bool prefill = false;
  Endpoint config;
  int64_t max_in_flight = 0;
  bool healthy = true, draining = false, probing = false;
  Clock::time_point readmitted{};  // when a probe last readmitted it (its limit ramps up since)
  int consecutive_failures = 0;
  int64_t in_flight = 0, tokens_in_flight = 0;
  GatewayCounts counts;  // uncached prompt work launched / in flight (prefill)
  EngineLoadState load;  // its GET /load reports (tandem engines)
  LoadSource load_source = LoadSource::kOwnCounts;
  bool load_polling = false;
  PrefillWork launched_at_last_poll;  // counts.launched_total when the last poll left
  metrics::Gauge* in_flight_gauge = nullptr;
  metrics::Gauge* healthy_gauge = nullptr;
  metrics::IntCounter* requests_total = nullptr;
  metrics::IntCounter* failures_total = nullptr;
};

enum class Stage { kFirst, kDecode };  // kDecode: sequential mode after the prefill answered

struct Leg {
  int endpoint = -1;
  int attempt = 0;
  bool prefill = false;
  CallId call = 0;
  bool started = false, finished = false;
  std::string cancel_reason;  // why the gateway cancelled it (a timeout), for the error message
  // Cancelled for a reason that is not the engine's fault (the client left, the other leg
  // failed): not counted against the engine's health.
  std::atomic<bool> gateway_cancelled{false};
  bool engine_error = false;  // an error event, or a prefill answer without kv_transfer_params
  // Its completion ended the request: the request's accounting (finished) runs in the same
  // scheduler task as the leg's, one post per request end instead of two.
  bool ended_request = false;
  // What it counts for on its endpoint until it finishes (set before it starts).
  int64_t prompt_tokens = 0;
  PrefillWork uncached;                // prefill work there: the prefill leg, or the aggregated one
  SchedulingThread::TimerId deadline;  // scheduling thread only: cancelled when the leg ends
  // The relay's view of the answer.
  int status = 0;
  bool streaming = false, first_event = false;
  std::string body;  // a non-streaming answer, or a stream's first event when it is an error
  net::SseParser parser;
  // A verbatim relay (no translation): the stream's bytes before its first event completed,
  // held back until that event shows it is no error.
  std::string held;
};

// One client request, from the io thread that received it to its access log line.
struct Request {
  // Set on the io thread before it reaches the scheduler, then read-only.
  std::string id, method, path, target, model;
  bool stream = false;
  std::shared_ptr<net::Exchange> exchange;
  net::Headers headers;      // for the engines
  std::string body;          // aggregated or decode leg (parallel: without bootstrap fields)
  std::string prefill_body;  // sequential prefill leg
  int64_t prompt_tokens = 0;
  bool tokens_known = false;
  std::vector<int32_t> prompt_ids;     // when the gateway tokenized it
  std::vector<uint64_t> block_hashes;  // of the prompt's ids, when the gateway tokenized it
  std::unique_ptr<ResponseTranslator> translator;  // tokens-in: the engine's answer -> client's
  int64_t received_unix_ms = 0;
  PhaseTimes times;

  // Scheduling thread only.
  Stage stage = Stage::kFirst;
  int attempt = 0;  // current attempt; legs of older attempts are ignored
  std::vector<int> excluded;
  std::vector<std::string> retried_after;  // why each earlier attempt failed (access log)
  int prefill_endpoint = -1, decode_endpoint = -1, prefill_group = 0;
  PrefillWork uncached;  // the prompt work the engine chosen to prefill it lacks in cache
  std::string prefill_name, decode_name;
  SchedulingThread::TimerId queue_timer;  // cancelled when it leaves the queue
  bool queued = false, registered = false;
  Clock::time_point queued_at;

  // Shared by the io, client and scheduling threads, under `mutex`.
  std::mutex mutex;
  std::vector<std::shared_ptr<Leg>> legs;
  std::string decode_body;  // sequential: body plus the prefill's kv_transfer_params
  bool answered = false;    // a response or a stream's head went to the client
  bool ended = false;       // the client's response is complete or failed; nothing more starts
  int status = 0;           // what the client got
  std::string error;        // why it failed, if it did
  int64_t output_events = 0, first_token_ns = 0, last_token_ns = 0;
  int64_t completion_tokens = -1;  // from a usage object, when one was seen
  std::vector<double> itl;         // inter-token gaps, seconds
};

using RequestPtr = std::shared_ptr<Request>;

struct Metrics {
  explicit Metrics(metrics::Registry& r)
      : phase_seconds(r.histogram_family("tandem:gateway_phase_seconds",
                                         "Seconds requests spent in each lifecycle phase.",
                                         {"phase"}, metrics::vllm_request_latency_buckets())),
        ttft(r.histogram("vllm:time_to_first_token_seconds",
                         "Time to first token (streaming requests), seen at the gateway.",
                         metrics::vllm_ttft_buckets())),
        tpot(r.histogram("vllm:time_per_output_token_seconds",
                         "Time per output token after the first (streaming requests).",
                         metrics::vllm_tpot_buckets())),
        itl(r.histogram("vllm:inter_token_latency_seconds",
                        "Gaps between streamed token events, seen at the gateway.",
                        metrics::vllm_tpot_buckets())),
        e2e(r.histogram("vllm:e2e_request_latency_seconds",
                        "End-to-end request latency at the gateway.",
                        metrics::vllm_request_latency_buckets())),
        queue_time(r.histogram("vllm:request_queue_time_seconds",
                               "Seconds requests waited in the gateway for a free engine.",
                               metrics::vllm_request_latency_buckets())),
        running(r.gauge("vllm:num_requests_running", "Requests being served by engines.")),
        waiting(r.gauge("vllm:num_requests_waiting", "Requests waiting in the gateway queue.")),
        requests(r.int_counter_family("tandem:gateway_requests_total",
                                      "Requests answered, by HTTP status.", {"status"})),
        retries(r.int_counter("tandem:gateway_retries_total",
                              "Attempts started again on other engines after a failure.")),
        endpoint_in_flight(r.gauge_family("tandem:gateway_endpoint_in_flight",
                                          "Requests in flight per engine.", {"pool", "endpoint"})),
        endpoint_healthy(r.gauge_family(
            "tandem:gateway_endpoint_healthy",
            "1 while an engine is eligible, 0 while ejected or removed.", {"pool", "endpoint"})),
        endpoint_requests(r.int_counter_family("tandem:gateway_endpoint_requests_total",
                                               "Legs sent per engine.", {"pool", "endpoint"})),
        endpoint_failures(r.int_counter_family("tandem:gateway_endpoint_failures_total",
                                               "Failed legs and health probes per engine.",
                                               {"pool", "endpoint"})) {}

  metrics::Family<metrics::Histogram>& phase_seconds;
  metrics::Histogram &ttft, &tpot, &itl, &e2e, &queue_time;
  metrics::Gauge &running, &waiting;
  metrics::Family<metrics::IntCounter>& requests;
  metrics::IntCounter& retries;
  metrics::Family<metrics::Gauge>& endpoint_in_flight;
  metrics::Family<metrics::Gauge>& endpoint_healthy;
  metrics::Family<metrics::IntCounter>& endpoint_requests;
  metrics::Family<metrics::IntCounter>& endpoint_failures;
};

}  // namespace

class Gateway::Impl {
 public:
  Impl(Topology topology, std::string config_path)
      : topo_(std::move(topology)),
        config_path_(std::move(config_path)),
        policy_(make_policy(topo_.policy, {topo_.scheduling.tandem, topo_.scheduling.cache_aware,
                                           topo_.scheduling.kv_router})),
        metrics_(registry_),
        server_(server_options()),
        client_(std::make_unique<net::AsyncHttpClient>(server_)) {
    validate(topo_);
    if (!topo_.model.empty())
      tokenizer_ = std::make_unique<PromptTokenizer>(topo_.model, topo_.served_model_name);
    if (!topo_.access_log.empty()) access_log_ = std::make_unique<AccessLog>(topo_.access_log);
    for (int p = 0; p < kPhaseCount; ++p)
      phase_histograms_[p] = &metrics_.phase_seconds.labels({phase_name(static_cast<Phase>(p))});
    for (const auto& e : topo_.prefill.endpoints) add_endpoint(true, e);
    for (const auto& e : topo_.decode.endpoints) add_endpoint(false, e);
    routes();
  }

  void start() {
    server_.start();  // first: the client runs on its threads
    sched_.start();
    sched_.post([this] { probe_all(); });
    if (topo_.scheduling.load_interval.count() > 0) sched_.post([this] { poll_loads(); });
  }
  uint16_t port() const { return server_.port(); }
  void stop() {
    stopping_ = true;  // new requests get 503 and no new leg starts
    // The client runs on the server's io threads: its calls end (cancelled, their callbacks
    // reporting to the scheduler) before the server stops those threads. Then the server closes
    // the clients' connections, and the scheduler finishes what was posted.
    client_->shutdown();
    server_.stop();
    sched_.stop();
    consumers_.clear();
  }

 private:
  // ---------------------------------------------------------------- front end (io threads)

  net::HttpServerOptions server_options() const {
    net::HttpServerOptions o;
    o.host = topo_.host;
    o.port = topo_.port;
    o.threads = topo_.io_threads;
    o.max_body_bytes = topo_.max_body_bytes;
    o.error_response = api::openai_error_response;
    return o;
  }

  void routes() {
    server_.route("GET", "/health", [this](const net::HttpRequest&, auto ex) {
      if (ready_.load())
        ex->respond(200, "", "text/plain");
      else
        ex->send_error(503, "no eligible engine", "server_error");
    });
    server_.route("GET", "/metrics", [this](const net::HttpRequest&, auto ex) {
      ex->respond(200, registry_.render(), std::string(metrics::Registry::kContentType));
    });
    server_.route("GET", "/v1/models", [this](const net::HttpRequest& req, auto ex) {
      if (!authorized(req, *ex)) return;
      if (!topo_.served_model_name.empty()) {
        json m = {{"id", topo_.served_model_name},
                  {"object", "model"},
                  {"created", unix_ms() / 1000},
                  {"owned_by", "tandem"}};
        ex->respond(200, json{{"object", "list"}, {"data", json::array({m})}}.dump());
        return;
      }
      net::Headers headers;  // only what identifies the caller: no hop-by-hop fields
      if (const auto* a = req.headers.find("Authorization")) headers.set("Authorization", *a);
      sched_.post([this, ex, headers] { relay_models(ex, headers); });
    });
    auto generation = [this](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
      receive(req, std::move(ex));
    };
    server_.route("POST", "/v1/completions", generation);
    server_.route("POST", "/v1/chat/completions", generation);
    server_.route("GET", "/debug/requests", [this](const net::HttpRequest& req, auto ex) {
      if (!admin_authorized(req, *ex)) return;
      sched_.post([this, ex] {
        ex->respond(200, debug_requests().dump(-1, ' ', false, json::error_handler_t::replace));
      });
    });
    server_.route("GET", "/admin/endpoints", [this](const net::HttpRequest& req, auto ex) {
      if (!admin_authorized(req, *ex)) return;
      sched_.post([this, ex] { ex->respond(200, endpoints_json().dump()); });
    });
    server_.route("POST", "/admin/endpoints", [this](const net::HttpRequest& req, auto ex) {
      if (!admin_authorized(req, *ex)) return;
      admin_add(req, ex);
    });
    server_.route("POST", "/admin/endpoints/remove", [this](const net::HttpRequest& req, auto ex) {
      if (!admin_authorized(req, *ex)) return;
      admin_remove(req, ex);
    });
    server_.route("POST", "/admin/reload", [this](const net::HttpRequest& req, auto ex) {
      if (!admin_authorized(req, *ex)) return;
      admin_reload(ex);
    });
  }

  static std::string bearer(const net::HttpRequest& req) {
    const std::string auth = req.headers.get("Authorization");
    if (auth.size() > 7 && net::iequals(std::string_view(auth).substr(0, 7), "Bearer "))
      return auth.substr(7);
    return {};
  }

  bool authorized(const net::HttpRequest& req, net::Exchange& ex) const {
    if (topo_.api_keys.empty()) return true;
    const std::string key = bearer(req);
    if (std::find(topo_.api_keys.begin(), topo_.api_keys.end(), key) != topo_.api_keys.end())
      return true;
    ex.send_error(401, "invalid or missing API key (Authorization: Bearer KEY)",
                  "invalid_request_error", "invalid_api_key");
    return false;
  }

  bool admin_authorized(const net::HttpRequest& req, net::Exchange& ex) const {
    if (topo_.admin_api_key.empty()) {
      ex.send_error(404, "the admin API is off (set admin_api_key)");
      return false;
    }
    if (bearer(req) == topo_.admin_api_key) return true;
    ex.send_error(401, "invalid or missing admin API key", "invalid_request_error",
                  "invalid_api_key");
    return false;
  }

  // Everything that can be done before the scheduler sees the request: the client's errors are
  // answered here, and the legs' bodies are built once.
  void receive(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
    if (stopping_.load()) {
      ex->send_error(503, "the gateway is shutting down", "server_error");
      return;
    }
    auto r = std::make_shared<Request>();
    r->times.mark(Phase::kReceived);
    r->received_unix_ms = unix_ms();
    r->method = req.method;
    r->path = req.path;
    r->target = req.target;
    r->exchange = ex;
    r->id = req.headers.get("X-Request-Id");
    // Honoured when it is a plain token (it goes into logs, JSON and engine headers).
    const bool printable =
        std::all_of(r->id.begin(), r->id.end(), [](char c) { return c > 0x20 && c < 0x7f; });
    if (r->id.empty() || r->id.size() > 256 || !printable) r->id = random_hex(2);
    r->headers.set("X-Request-Id", r->id);
    if (const auto* auth = req.headers.find("Authorization"))
      r->headers.set("Authorization", *auth);
    if (!authorized(req, *ex)) return finish_early(r, 401, "unauthorized");

    r->times.mark(Phase::kTokenizing);
    const bool needs_json = topo_.mode != PdMode::kAggregated || tokenizer_;
    json body;
    if (needs_json) {
      try {
        body = parse_untrusted_json(req.body);
        if (!body.is_object()) throw Error("the request body must be a JSON object");
      } catch (const std::exception& e) {
        ex->send_error(400, std::string("invalid JSON body: ") + e.what());
        return finish_early(r, 400, "invalid JSON body");
      }
      if (auto st = body.find("stream"); st != body.end() && !st->is_boolean() && !st->is_null()) {
        ex->send_error(400, "stream: expected a boolean", "invalid_request_error");
        return finish_early(r, 400, "stream: expected a boolean");
      }
      r->stream = body.value("stream", false) == true;
      if (auto m = body.find("model"); m != body.end() && m->is_string()) r->model = *m;
    }
    // Without a tokenizer the prompt's length is estimated from the body's size (about four
    // bytes per token in English text).
    r->prompt_tokens = static_cast<int64_t>(req.body.size() / 4);
    bool rewritten = false;
    if (tokenizer_) {
      try {
        if (auto t = tokenizer_->tokenize(req.path, body)) {
          const Pool& first = topo_.mode == PdMode::kAggregated ? topo_.decode : topo_.prefill;
          r->prompt_tokens = static_cast<int64_t>(t->ids.size()) * t->n;
          r->tokens_known = true;
          r->times.mark(Phase::kPrefixMatching);
          r->block_hashes = api::block_hashes(t->ids, kPrefixBlockTokens);
          r->prompt_ids = t->ids;
          if (first.tokens_in && topo_.decode.tokens_in) {
            r->translator = std::make_unique<ResponseTranslator>(t->client_kind);
            body = tokens_in_body(body, *t);
            r->target = "/v1/completions";
            rewritten = true;
          }
        }
      } catch (const api::ApiError& e) {
        std::string message = e.message;
        if (!e.param.empty()) message += " (param: " + e.param + ")";
        ex->send_error(e.status, message, e.type);
        return finish_early(r, e.status, message);
      } catch (const std::exception& e) {
        ex->send_error(400, std::string("cannot tokenize the request: ") + e.what());
        return finish_early(r, 400, e.what());
      }
    }
    r->times.mark(Phase::kPrefixMatching);

    switch (topo_.mode) {
      case PdMode::kAggregated:
        r->body = rewritten ? body.dump() : req.body;  // else verbatim: the engine parses it
        break;
      case PdMode::kSequential:
        api::strip_disaggregation_fields(body);
        r->prefill_body = api::prefill_leg_body(body).dump();
        r->body = body.dump();
        break;
      case PdMode::kParallel:
        api::strip_disaggregation_fields(body);
        r->body = body.dump();
        break;
    }
    ex->on_close([this, r] { client_gone(r); });
    sched_.post_batched([this, r] { submit(r); });
  }

  // A request answered before it reached the scheduler still gets its log line and metrics.
  void finish_early(const RequestPtr& r, int status, std::string error) {
    {
      std::lock_guard lock(r->mutex);
      r->answered = r->ended = true;
      r->status = status;
      r->error = std::move(error);
    }
    r->times.mark(Phase::kCompleted);
    sched_.post_batched([this, r] { finished(r); });
  }

  // The client went away (or the server is stopping): nothing more starts, running legs are
  // cancelled (engines abort and free what the request held).
  void client_gone(const RequestPtr& r) {
    std::vector<CallId> calls;
    {
      std::lock_guard lock(r->mutex);
      if (r->ended) return;
      r->ended = true;
      r->status = 499;  // as nginx logs it, also when the client left mid-stream
      r->error = "client closed the connection";
      calls = mark_legs_cancelled(*r);
    }
    cancel_calls(calls);
    r->times.mark(Phase::kCompleted);
    sched_.post_batched([this, r] { finished(r); });
  }

  // ---------------------------------------------------------------- scheduling thread

  void add_endpoint(bool prefill, Endpoint e) {
    EndpointState s;
    s.id = next_endpoint_id_++;
    s.prefill = prefill;
    const Pool& pool = prefill ? topo_.prefill : topo_.decode;
    s.max_in_flight = e.max_in_flight > 0 ? e.max_in_flight : pool.max_in_flight;
    s.load_source = initial_load_source(pool.dialect);
    s.config = std::move(e);
    const std::vector<std::string> labels = {prefill ? "prefill" : "decode", s.config.name};
    s.in_flight_gauge = &metrics_.endpoint_in_flight.labels(labels);
    s.healthy_gauge = &metrics_.endpoint_healthy.labels(labels);
    s.requests_total = &metrics_.endpoint_requests.labels(labels);
    s.failures_total = &metrics_.endpoint_failures.labels(labels);
    s.healthy_gauge->set(1);
    s.in_flight_gauge->set(0);
    const int id = s.id;
    const Endpoint& c = s.config;
    if (!c.kv_events.empty()) {
      KvEventsConsumerOptions o;
      o.engine = id;
      o.endpoint = c.kv_events;
      o.replay_endpoint = c.kv_events_replay;
      consumers_[id] = std::make_unique<KvEventsConsumer>(prefix_index_, o);
    }
    endpoints_.emplace(id, std::move(s));
    update_ready();
  }

  bool eligible(const EndpointState& e) const { return e.healthy && !e.draining; }

  void update_ready() {
    bool p = topo_.mode == PdMode::kAggregated, d = false;
    for (const auto& [id, e] : endpoints_) {
      if (!eligible(e)) continue;
      (e.prefill ? p : d) = true;
    }
    ready_ = p && d;
  }

  ClusterView view(Clock::time_point now) const {
    ClusterView v;
    v.state = &policy_state_;
    const auto max_age = 4 * topo_.scheduling.load_interval;
    for (const auto& [id, e] : endpoints_) {
      const int64_t limit = e.readmitted == Clock::time_point{}
                                ? e.max_in_flight
                                : ramped_in_flight_limit(e.max_in_flight, now - e.readmitted,
                                                         topo_.health.slow_start);
      EndpointLoad l{e.id, e.config.group, eligible(e), e.in_flight, limit, e.tokens_in_flight};
      fill_load(l, e.load, e.counts, now, max_age);
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

  RequestInfo info(const Request& r) const {
    RequestInfo ri;
    ri.prompt_tokens = r.prompt_tokens;
    ri.arrived = Clock::time_point(std::chrono::nanoseconds(*r.times.at(Phase::kReceived)));
    ri.excluded = r.excluded;
    ri.prompt_ids = r.prompt_ids;
    ri.block_hashes = r.block_hashes;
    return ri;
  }

  bool ended(Request& r) {
    std::lock_guard lock(r.mutex);
    return r.ended;
  }

  void submit(const RequestPtr& r) {
    if (ended(*r)) return;
    if (waiting_.size() >= topo_.max_queue) {
      answer_error(r, 429,
                   "the gateway queue is full (" + std::to_string(topo_.max_queue) +
                       " requests waiting); retry later");
      return;
    }
    active_.emplace(r.get(), r);
    r->registered = true;
    metrics_.running.set(static_cast<double>(active_.size()));
    sched_.set_busy(true);
    enqueue(r, false);
    dispatch(r->queued_at);
  }

  void enqueue(const RequestPtr& r, bool front) {
    // One clock read for the phase stamps and the queue (same steady clock).
    r->queued_at = Clock::now();
    const int64_t ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(r->queued_at.time_since_epoch())
            .count();
    r->times.mark(Phase::kPrefillWaiting, ns);
    if (topo_.mode != PdMode::kSequential || r->stage == Stage::kDecode)
      r->times.mark(Phase::kDecodeWaiting, ns);
    r->queued = true;
    if (front)
      waiting_.push_front(r);
    else
      waiting_.push_back(r);
    metrics_.waiting.set(static_cast<double>(waiting_.size()));
    // Its queue timeout is armed by dispatch() if it is still waiting after the pass that
    // follows: most requests start at once, and a timer armed and cancelled per request costs.
  }

  void arm_queue_timeout(const RequestPtr& r) {
    // Weak: a timer must not keep a finished request (and its bodies) alive until it fires.
    r->queue_timer =
        sched_.at(r->queued_at + topo_.timeouts.queue, [this, weak = std::weak_ptr<Request>(r)] {
          const RequestPtr r = weak.lock();
          // Cancelled whenever it leaves the queue: a timer that fires belongs to this wait.
          if (!r || !r->queued) return;
          remove_waiting(r);
          answer_error(r, 503,
                       "no engine was free within " + std::to_string(topo_.timeouts.queue.count()) +
                           " ms (queue timeout): " + pools_state(*r));
        });
  }

  // What the engines of the pools a request needs were doing, for the 503 that says why none
  // took it: e.g. "decode pool: 2 engines, 1 ejected after failures, 1 at its in-flight limit".
  std::string pools_state(const Request& r) const {
    std::vector<bool> pools;  // prefill?
    if (topo_.mode == PdMode::kAggregated || r.stage == Stage::kDecode) {
      pools = {false};
    } else if (topo_.mode == PdMode::kSequential) {
      pools = {true};
    } else {
      pools = {true, false};
    }
    std::string out;
    for (const bool prefill : pools) {
      int total = 0, ejected = 0, draining = 0, at_limit = 0, busy = 0;
      for (const auto& [id, e] : endpoints_) {
        if (e.prefill != prefill) continue;
        ++total;
        if (e.draining)
          ++draining;
        else if (!e.healthy)
          ++ejected;
        else if (e.in_flight >= e.max_in_flight)
          ++at_limit;
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
      part(draining, "draining");
      part(at_limit, "at the in-flight limit");
      part(busy, "over the policy's load limits (queued prefill work or free KV)");
    }
    return out;
  }

  void remove_waiting(const RequestPtr& r) {
    waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), r), waiting_.end());
    r->queued = false;
    sched_.cancel(r->queue_timer);
    r->queue_timer = {};
    metrics_.waiting.set(static_cast<double>(waiting_.size()));
  }

  // Starts every waiting request an engine is free for. Offers the waiting requests to the
  // policy: first those whose prefill is done (they hold KV on a prefill engine), then the others
  // in the policy's queue order (prompt length and waiting time, with a starvation bound:
  // policies/queue_order.h). A request that must wait (its engines are saturated) does not block
  // the ones behind it that could go elsewhere.
  void dispatch() {
    if (!waiting_.empty()) dispatch(Clock::now());  // most calls under load: nobody waits
  }
  void dispatch(Clock::time_point now) {
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
      for (const auto& r : first_stage) queued.push_back({r->prompt_tokens, info(*r).arrived});
      for (size_t i : order(queued, now, topo_.scheduling.queue)) offer.push_back(first_stage[i]);
    }
    first_stage.clear();

    ClusterView v = view(now);  // kept current below as requests start
    for (const RequestPtr& r : offer) {
      if (ended(*r)) {
        remove_waiting(r);
        continue;
      }
      const RequestInfo ri = info(*r);
      fill_cached_tokens(v, *r);
      int prefill = -1, decode = -1;
      Choice::Kind kind = Choice::Kind::kChosen;
      if (topo_.mode == PdMode::kAggregated) {
        const Choice c = policy_->choose_decode(v, ri, -1, now);
        kind = c.kind;
        decode = c.endpoint;
      } else if (topo_.mode == PdMode::kParallel) {
        const PairChoice c = policy_->choose_together(v, ri, now);
        kind = c.kind;
        prefill = c.prefill;
        decode = c.decode;
      } else if (r->stage == Stage::kFirst) {
        const Choice c = policy_->choose_prefill(v, ri, now);
        kind = c.kind;
        prefill = c.endpoint;
      } else {
        // The prefill engine's group, remembered: the engine may have left (drained) since.
        const Choice c = policy_->choose_decode(v, ri, r->prefill_group, now);
        kind = c.kind;
        decode = c.endpoint;
      }
      if (kind == Choice::Kind::kSaturated) continue;
      remove_waiting(r);
      if (kind == Choice::Kind::kNoneEligible) {
        answer_error(r, 503, "no healthy engine can serve this request: " + pools_state(*r));
        continue;
      }
      metrics_.queue_time.observe(std::chrono::duration<double>(now - r->queued_at).count());
      // The engine that computes the prompt: the prefill engine, or an aggregated decode engine.
      const int computes =
          prefill >= 0 ? prefill : (topo_.mode == PdMode::kAggregated ? decode : -1);
      r->uncached = {};
      for (const auto* pool : {&v.prefill, &v.decode})
        for (const auto& e : *pool)
          if (e.id == computes)
            r->uncached = PrefillWork::of_prompt(e.cached_tokens, r->prompt_tokens);
      start(r, prefill, decode);
      policy_->record(policy_state_, ri, prefill, decode, now);
      apply_choice(v, ri, prefill, decode);
    }
    offer.clear();
    for (const auto& r : waiting_)
      if (r->queue_timer.seq == 0) arm_queue_timeout(r);
  }

  // Each engine's cached prefix of this prompt from the KV-event index: tokens it will not
  // recompute (0 when it holds none); -1 (unknown) without a tokenized prompt or an index.
  void fill_cached_tokens(ClusterView& v, const Request& r) {
    const bool known = !r.prompt_ids.empty() && !consumers_.empty();
    std::vector<PrefixMatch> matches;
    if (known) matches = prefix_index_.match(r.prompt_ids);
    for (auto* pool : {&v.prefill, &v.decode})
      for (auto& e : *pool) {
        e.cached_tokens = -1;
        if (!known || !consumers_.count(e.id)) continue;
        e.cached_tokens = 0;
        for (const auto& m : matches)
          if (m.engine == e.id) e.cached_tokens = m.tokens;
      }
  }

  EndpointState* endpoint(int id) {
    auto it = endpoints_.find(id);
    return it == endpoints_.end() ? nullptr : &it->second;
  }

  void start(const RequestPtr& r, int prefill, int decode) {
    const int64_t now = steady_now_ns();
    if (prefill >= 0) {
      r->prefill_endpoint = prefill;
      r->prefill_name = endpoint(prefill)->config.name;
      r->prefill_group = endpoint(prefill)->config.group;
      r->times.mark(Phase::kPrefillScheduled, now);
    }
    if (decode >= 0) {
      r->decode_endpoint = decode;
      r->decode_name = endpoint(decode)->config.name;
      r->times.mark(Phase::kDecodeScheduled, now);
      if (topo_.mode == PdMode::kAggregated) r->times.mark(Phase::kPrefillScheduled, now);
    }
    switch (topo_.mode) {
      case PdMode::kAggregated:
        r->times.mark(Phase::kPrefilling, now);
        start_relay(r, decode, r->body);
        break;
      case PdMode::kSequential:
        if (r->stage == Stage::kFirst) {
          r->times.mark(Phase::kPrefilling);
          start_prefill(r, prefill, r->prefill_body);
        } else {
          std::string body;
          {
            std::lock_guard lock(r->mutex);
            body = r->decode_body;
          }
          start_relay(r, decode, std::move(body));
        }
        break;
      case PdMode::kParallel: {
        const EndpointState& p = *endpoint(prefill);
        const std::string body =
            splice_fields(r->body, api::bootstrap_members(p.config.host, p.config.bootstrap_port,
                                                          random_u64() & 0x7fffffffffffffffULL));
        r->times.mark(Phase::kPrefilling);
        start_prefill(r, prefill, body);
        start_relay(r, decode, body);
        break;
      }
    }
  }

  net::AsyncHttpRequest upstream(const EndpointState& e, const Request& r, std::string body,
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
  // until its on_done, which always comes, so the accounting cannot leak.
  void launch(const RequestPtr& r, int endpoint_id, bool prefill,
              const std::shared_ptr<std::weak_ptr<Leg>>& ref, net::AsyncHttpRequest u,
              net::AsyncHttpHandlers h, std::chrono::milliseconds deadline, const char* what) {
    EndpointState* e = endpoint(endpoint_id);
    auto leg = std::make_shared<Leg>();
    *ref = leg;  // before the call starts: its callbacks find the leg through `ref`
    leg->endpoint = endpoint_id;
    leg->attempt = r->attempt;
    leg->prefill = prefill;
    leg->prompt_tokens = r->prompt_tokens;
    if (prefill || topo_.mode == PdMode::kAggregated) leg->uncached = r->uncached;
    auto done = std::move(h.on_done);
    h.on_done = [this, r, leg, done](const std::string& error) {
      try {
        if (done) done(error);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "tandem gateway: a leg's completion failed: %s\n", e.what());
      }
      const bool fault = (!error.empty() && !leg->gateway_cancelled.load()) || leg->status >= 500 ||
                         leg->engine_error;
      sched_.post_batched([this, r, leg, fault] {
        if (leg->ended_request) finished(r);
        leg_finished(*leg, !fault);
      });
    };
    std::lock_guard lock(r->mutex);
    if (r->ended || stopping_.load()) return;
    ++e->in_flight;
    e->tokens_in_flight += leg->prompt_tokens;
    e->counts.uncached_in_flight += leg->uncached;
    e->counts.launched_total += leg->uncached;
    e->in_flight_gauge->set(static_cast<double>(e->in_flight));
    e->requests_total->inc();
    leg->started = true;
    r->legs.push_back(leg);
    leg->call = client_->start(std::move(u), std::move(h));
    leg->deadline =
        sched_.at(Clock::now() + deadline, [this, weak_r = std::weak_ptr<Request>(r),
                                            weak_leg = std::weak_ptr<Leg>(leg), what, deadline] {
          const RequestPtr r = weak_r.lock();
          const std::shared_ptr<Leg> leg = weak_leg.lock();
          if (!r || !leg) return;
          std::lock_guard lock(r->mutex);
          if (leg->finished || (!leg->prefill && leg->first_event)) return;
          leg->cancel_reason =
              std::string(what) + " timed out after " + std::to_string(deadline.count()) + " ms";
          client_->cancel(leg->call);
        });
  }

  void leg_finished(const Leg& leg, bool ok) {
    sched_.cancel(leg.deadline);
    EndpointState* e = endpoint(leg.endpoint);
    if (!e) return;
    --e->in_flight;
    e->tokens_in_flight -= leg.prompt_tokens;
    e->counts.uncached_in_flight -= leg.uncached;
    e->in_flight_gauge->set(static_cast<double>(e->in_flight));
    if (ok)
      e->consecutive_failures = 0;
    else
      passive_failure(*e);
    if (e->draining && e->in_flight == 0) forget_endpoint(leg.endpoint);
    dispatch();
  }

  void passive_failure(EndpointState& e) {
    e.failures_total->inc();
    if (++e.consecutive_failures >= topo_.health.failures_to_eject && e.healthy) {
      e.healthy = false;
      e.healthy_gauge->set(0);
      update_ready();
    }
  }

  // The sequential prefill leg (answer collected) and the parallel one (drained).
  void start_prefill(const RequestPtr& r, int endpoint_id, std::string body) {
    const EndpointState& e = *endpoint(endpoint_id);
    const int attempt = r->attempt;
    auto leg_ref = std::make_shared<std::weak_ptr<Leg>>();
    net::AsyncHttpHandlers h;
    h.on_head = [leg_ref](int status, const net::Headers&) {
      if (auto l = leg_ref->lock()) l->status = status;
    };
    h.on_body = [leg_ref, keep = topo_.mode == PdMode::kSequential](std::string_view piece) {
      auto l = leg_ref->lock();
      if (l && (keep || l->status != 200) && l->body.size() < (size_t{16} << 20)) l->body += piece;
      return true;
    };
    const std::string where = e.config.name;
    h.on_done = [this, r, leg_ref, attempt, where, endpoint_id](const std::string& error) {
      auto l = leg_ref->lock();
      if (!l) return;
      std::string reason;
      {
        std::lock_guard lock(r->mutex);
        l->finished = true;
        reason = l->cancel_reason.empty() ? error : l->cancel_reason;
      }
      if (reason.empty() && l->status == 200) {
        r->times.mark_prefill_done(steady_now_ns());
        if (topo_.mode == PdMode::kSequential) prefill_answered(r, *l, attempt, where, endpoint_id);
        return;
      }
      if (!reason.empty())
        sched_.post_batched(
            [this, r, attempt, endpoint_id, m = "prefill engine " + where + " failed: " + reason] {
              attempt_failed(r, attempt, endpoint_id, 502, {}, m);
            });
      else
        sched_.post_batched([this, r, attempt, endpoint_id, s = l->status, b = l->body] {
          attempt_failed(r, attempt, endpoint_id, s, b, {});
        });
    };
    launch(r, endpoint_id, true, leg_ref, upstream(e, *r, std::move(body), topo_.timeouts.prefill),
           std::move(h), topo_.timeouts.prefill, "the prefill");
  }

  void prefill_answered(const RequestPtr& r, Leg& leg, int attempt, const std::string& where,
                        int endpoint_id) {
    std::string params;
    try {
      params = api::kv_transfer_params_member(leg.body);
    } catch (const std::exception&) {
      leg.engine_error = true;
      sched_.post_batched([this, r, attempt, endpoint_id,
                           m = "prefill engine " + where + " answered without kv_transfer_params"] {
        attempt_failed(r, attempt, endpoint_id, 502, {}, m);
      });
      return;
    }
    {
      std::lock_guard lock(r->mutex);
      r->decode_body = splice_fields(r->body, params);
    }
    sched_.post_batched([this, r, attempt] {
      if (attempt != r->attempt || ended(*r)) return;
      r->stage = Stage::kDecode;
      enqueue(r, true);  // it holds KV on the prefill engine: first in line
      dispatch();
    });
  }

  // The leg whose answer goes to the client. Its head is held back until the first event (or
  // the whole answer) arrived, so a failure before any token can still be retried elsewhere.
  void start_relay(const RequestPtr& r, int endpoint_id, std::string body) {
    const EndpointState& e = *endpoint(endpoint_id);
    const int attempt = r->attempt;
    auto leg_ref = std::make_shared<std::weak_ptr<Leg>>();
    net::AsyncHttpHandlers h;
    h.on_head = [leg_ref](int status, const net::Headers& hs) {
      auto l = leg_ref->lock();
      if (!l) return;
      l->status = status;
      l->streaming = status == 200 && hs.get("Content-Type").rfind("text/event-stream", 0) == 0;
    };
    h.on_body = [this, r, leg_ref](std::string_view piece) {
      return relay_piece(r, leg_ref, piece);
    };
    const std::string where = e.config.name;
    h.on_done = [this, r, leg_ref, attempt, where, endpoint_id](const std::string& error) {
      auto l = leg_ref->lock();
      if (!l) return;
      relay_done(r, *l, attempt, where, endpoint_id, error);
    };
    // The first token may take first_token_ms (a decode leg waits for its prefill, a queue);
    // the scheduler's timer enforces that. The client's own per-piece bound must not be
    // shorter, or a stream that sent its head and waits for KV would be cut as idle.
    auto u =
        upstream(e, *r, std::move(body), std::max(topo_.timeouts.idle, topo_.timeouts.first_token));
    launch(r, endpoint_id, false, leg_ref, std::move(u), std::move(h), topo_.timeouts.first_token,
           "the first token");
  }

  bool relay_piece(const RequestPtr& r, const std::shared_ptr<std::weak_ptr<Leg>>& leg_ref,
                   std::string_view piece) {
    auto l = leg_ref->lock();
    if (!l) return false;
    if (!l->streaming) {
      if (l->body.size() + piece.size() > (size_t{64} << 20)) return false;
      l->body += piece;
      return true;
    }
    // Without a translator the client gets the engine's bytes as they are, once the first event
    // has shown the stream is no error; with one, the translated events.
    const bool verbatim = !r->translator;
    const bool started = l->first_event;
    std::string out;
    if (!verbatim) out.reserve(piece.size() + 16);
    const int64_t now = steady_now_ns();
    int64_t token_events = 0;
    bool refused = false;  // the stream must not go on (an error first, a leg given up)
    l->parser.feed(piece, [&](std::string_view data) {
      if (refused) return;
      if (!l->first_event) {
        if (is_error_event(data)) {  // failed before any token: the client has seen nothing
          l->body = std::string(data);
          l->engine_error = true;
          refused = true;
          return;
        }
        std::lock_guard lock(r->mutex);
        // A leg the gateway gave up on (a timeout, a retry) must not start the client's stream.
        if (r->ended || l->gateway_cancelled.load() || !l->cancel_reason.empty()) {
          l->gateway_cancelled = true;
          refused = true;
          return;
        }
        l->first_event = true;
        r->answered = true;
        r->status = 200;
        r->exchange->start_stream(200, "text/event-stream");
      }
      if (carries_tokens(data)) ++token_events;
      if (verbatim) return;
      if (!is_error_event(data)) {
        for (const auto& d : r->translator->event(data)) {
          out += "data: ";
          out += d;
          out += "\n\n";
        }
        return;
      }
      out += "data: ";
      out += data;
      out += "\n\n";
    });
    if (refused) return false;
    if (token_events > 0) {
      // One lock per piece: the events a piece completes arrived together (gaps of 0).
      std::lock_guard lock(r->mutex);
      if (r->output_events == 0) {
        r->first_token_ns = now;
        r->times.mark(Phase::kDecoding, now);
        if (topo_.mode == PdMode::kAggregated) r->times.mark_prefill_done(now);
      } else {
        r->itl.push_back(static_cast<double>(now - r->last_token_ns) * 1e-9);
      }
      r->itl.insert(r->itl.end(), static_cast<size_t>(token_events - 1), 0.0);
      r->last_token_ns = now;
      r->output_events += token_events;
    }
    if (verbatim) {
      if (!l->first_event) {  // no complete event yet: hold the bytes
        l->held += piece;
        return l->held.size() <= (size_t{64} << 20);
      }
      if (!started) {
        l->held += piece;
        out = std::move(l->held);
        l->held = {};
      }
    }
    const std::string_view bytes = verbatim && started ? piece : std::string_view(out);
    if (bytes.empty()) return true;
    if (r->exchange->write(bytes)) return true;
    l->gateway_cancelled = true;  // the client is gone
    return false;
  }

  void relay_done(const RequestPtr& r, Leg& l, int attempt, const std::string& where,
                  int endpoint_id, const std::string& error) {
    std::string reason;
    bool streamed;
    {
      std::lock_guard lock(r->mutex);
      l.finished = true;
      reason = l.cancel_reason.empty() ? error : l.cancel_reason;
      streamed = l.first_event;
    }
    if (streamed) {  // the client has the head: finish or cut the stream, no retry possible
      // Once streaming, the gateway cancels the leg only because the client left (a failed
      // write, or its connection closed): 499 however that news arrived first.
      const bool client_left = l.gateway_cancelled.load();
      const int status = reason.empty() ? 200 : client_left ? 499 : 502;
      std::string error = reason.empty() ? ""
                          : client_left  ? "client closed the connection"
                                         : where + ": " + reason;
      // Recorded first: cutting the stream closes the exchange, which reports a client gone.
      l.ended_request = end_request(r, status, std::move(error));
      if (reason.empty())
        r->exchange->end();
      else
        r->exchange->abort();
      return;
    }
    if (l.engine_error && l.streaming && !l.body.empty()) {  // a stream that began with an error
      const std::string message =
          "engine " + where + " failed: " + api::openai_error_message(l.body).value_or(l.body);
      sched_.post_batched([this, r, attempt, endpoint_id, message] {
        attempt_failed(r, attempt, endpoint_id, 502, {}, message);
      });
      return;
    }
    if (reason.empty() && l.status == 200 && !l.streaming) {
      const int64_t now = steady_now_ns();
      r->times.mark(Phase::kDecoding, now);
      if (topo_.mode == PdMode::kAggregated) r->times.mark_prefill_done(now);
      // The answer is relayed as the engine sent it; the gateway only checks it is a JSON
      // object and reads the completion tokens for its statistics (a full parse would cost
      // more than the rest of the relay).
      if (!looks_like_json_object(l.body)) {
        l.engine_error = true;
        sched_.post_batched(
            [this, r, attempt, endpoint_id,
             m = "engine " + where + " sent a malformed answer (not a JSON object)"] {
              attempt_failed(r, attempt, endpoint_id, 502, {}, m);
            });
        return;
      }
      const int64_t tokens = usage_completion_tokens(l.body);
      {
        std::lock_guard lock(r->mutex);
        if (r->ended) return;
        r->answered = true;
        r->status = 200;
        r->completion_tokens = tokens;
        r->exchange->respond(200, r->translator ? r->translator->body(l.body) : std::move(l.body),
                             "application/json");
      }
      l.ended_request = end_request(r, 200, {});
      return;
    }
    if (reason.empty() && l.streaming) {  // a stream that ended without any event
      reason = "the stream ended without an answer";
    }
    if (!reason.empty())
      sched_.post_batched(
          [this, r, attempt, endpoint_id, m = "engine " + where + " failed: " + reason] {
            attempt_failed(r, attempt, endpoint_id, 502, {}, m);
          });
    else
      sched_.post_batched([this, r, attempt, endpoint_id, s = l.status, b = std::move(l.body)] {
        attempt_failed(r, attempt, endpoint_id, s, b, {});
      });
  }

  // A leg of the current attempt failed before the client got anything: an engine's own client
  // error (4xx) goes to the client as it is; anything else is retried on other engines while
  // retries remain (the failed engine is avoided), then answered 502 (or the engine's 5xx).
  void attempt_failed(const RequestPtr& r, int attempt, int endpoint_id, int status,
                      std::string body, std::string message) {
    if (attempt != r->attempt) return;
    std::vector<CallId> calls;
    {
      // Checked and cancelled under one lock: no leg of this attempt can start the stream after.
      std::lock_guard lock(r->mutex);
      if (r->ended || r->answered) return;
      calls = mark_legs_cancelled(*r);
    }
    cancel_calls(calls);
    const bool client_error = status >= 400 && status < 500;
    const bool retryable =
        !client_error && !(topo_.mode == PdMode::kSequential && r->stage == Stage::kDecode);
    if (retryable && r->attempt < topo_.prefill_retries) {
      const EndpointState* e = endpoint(endpoint_id);
      r->retried_after.push_back((e ? e->config.name : std::string("a removed engine")) + ": " +
                                 (message.empty() ? "HTTP " + std::to_string(status) : message));
      ++r->attempt;
      metrics_.retries.inc();
      r->excluded.push_back(endpoint_id);
      r->stage = Stage::kFirst;
      enqueue(r, true);
      dispatch();
      return;
    }
    if (!body.empty() && status >= 400) {
      std::lock_guard lock(r->mutex);
      if (r->ended) return;
      r->answered = true;
      r->exchange->respond(status, body, "application/json");
    } else {  // an OpenAI error of our own: the engine's 4xx status, else 502
      if (message.empty()) message = "engine answered HTTP " + std::to_string(status);
      if (!client_error) status = 502;
      std::lock_guard lock(r->mutex);
      if (r->ended) return;
      r->answered = true;
      r->exchange->send_error(status, message, client_error ? "" : "server_error");
    }
    complete(r, status, message.empty() ? "engine error" : message);
  }

  // The one way legs are cancelled: under the request's lock its running legs are marked as
  // cancelled by the gateway (not the engine's fault) and their calls taken; the calls are
  // cancelled after the lock is released (a cancel may report back at once).
  static std::vector<CallId> mark_legs_cancelled(Request& r) {
    std::vector<CallId> calls;
    for (const auto& l : r.legs)
      if (l->started && !l->finished) {
        l->gateway_cancelled = true;
        calls.push_back(l->call);
      }
    return calls;
  }
  void cancel_calls(const std::vector<CallId>& calls) {
    for (auto c : calls) client_->cancel(c);
  }
  void cancel_legs(const RequestPtr& r) {
    std::vector<CallId> calls;
    {
      std::lock_guard lock(r->mutex);
      calls = mark_legs_cancelled(*r);
    }
    cancel_calls(calls);
  }

  // Answers a request that never started (or whose attempts are over) with an OpenAI error.
  void answer_error(const RequestPtr& r, int status, const std::string& message) {
    {
      std::lock_guard lock(r->mutex);
      if (r->ended) return;
      r->answered = true;
      // OpenAI answers rate limits with code rate_limit_exceeded.
      r->exchange->send_error(status, message, {}, status == 429 ? "rate_limit_exceeded" : "");
    }
    complete(r, status, message);
  }

  // The client's response is complete (or failed): stamp it, then account on the scheduler.
  void complete(const RequestPtr& r, int status, std::string error) {
    if (end_request(r, status, std::move(error))) sched_.post_batched([this, r] { finished(r); });
  }

  // Stamps the request's end; true when this call ended it, and finished() is then due.
  bool end_request(const RequestPtr& r, int status, std::string error) {
    {
      std::lock_guard lock(r->mutex);
      if (r->ended) return false;
      r->ended = true;
      r->status = status;
      r->error = std::move(error);
    }
    r->times.mark(Phase::kCompleted);
    return true;
  }

  void finished(const RequestPtr& r) {
    if (r->queued) remove_waiting(r);
    if (r->registered) {
      active_.erase(r.get());
      r->registered = false;
      metrics_.running.set(static_cast<double>(active_.size()));
      sched_.set_busy(!active_.empty());
    }
    int status;
    int64_t events, first_ns, last_ns, completion_tokens;
    std::vector<double> itl;
    std::string error;
    {
      std::lock_guard lock(r->mutex);
      status = r->status;
      events = r->output_events;
      first_ns = r->first_token_ns;
      last_ns = r->last_token_ns;
      completion_tokens = r->completion_tokens;
      itl = std::move(r->itl);
      error = r->error;
    }
    if (status != 200) cancel_legs(r);  // e.g. a parallel prefill leg after the client left
    auto counter = status_counters_.find(status);
    if (counter == status_counters_.end())
      counter =
          status_counters_.emplace(status, &metrics_.requests.labels({std::to_string(status)}))
              .first;
    counter->second->inc();
    const int64_t received = *r->times.at(Phase::kReceived);
    const std::optional<int64_t> stamped = r->times.at(Phase::kCompleted);
    const int64_t completed = stamped ? *stamped : steady_now_ns();
    for (int p = 0; p < kPhaseCount; ++p)
      if (auto s = r->times.seconds_in(static_cast<Phase>(p))) phase_histograms_[p]->observe(*s);
    if (status == 200) {
      metrics_.e2e.observe(static_cast<double>(completed - received) * 1e-9);
      if (events > 0) metrics_.ttft.observe(static_cast<double>(first_ns - received) * 1e-9);
      if (events > 1)
        metrics_.tpot.observe(static_cast<double>(last_ns - first_ns) * 1e-9 /
                              static_cast<double>(events - 1));
      for (double g : itl) metrics_.itl.observe(g);
    }
    if (!access_log_) return;
    json line = {{"time_unix_ms", r->received_unix_ms},
                 {"request_id", r->id},
                 {"method", r->method},
                 {"path", r->path},
                 {"status", status},
                 {"mode", mode_name(topo_.mode)},
                 {"stream", r->stream},
                 {"attempts", r->attempt + 1},
                 {"prompt_tokens", r->prompt_tokens},
                 {"prompt_tokens_estimated", !r->tokens_known},
                 {"phases", r->times.offsets()},
                 {"e2e_seconds", static_cast<double>(completed - received) * 1e-9}};
    if (!r->model.empty()) line["model"] = r->model;
    if (!r->prefill_name.empty()) line["prefill"] = r->prefill_name;
    if (!r->decode_name.empty()) line["decode"] = r->decode_name;
    if (!r->retried_after.empty()) line["retried_after"] = r->retried_after;
    if (events > 0) {
      line["output_events"] = events;
      line["ttft_seconds"] = static_cast<double>(first_ns - received) * 1e-9;
    }
    if (completion_tokens >= 0) line["completion_tokens"] = completion_tokens;
    if (!error.empty()) line["error"] = error;
    access_log_->add(std::move(line));
  }

  // ---------------------------------------------------------------- health

  // A GET of the gateway's own (health, load) to an engine, bounded by the probe timeout.
  net::AsyncHttpRequest engine_get(const EndpointState& e, const char* target) const {
    net::AsyncHttpRequest u;
    u.host = e.config.host;
    u.port = e.config.port;
    u.target = target;
    u.timeout = topo_.health.probe_timeout;
    u.connect_timeout = std::min(topo_.timeouts.connect, topo_.health.probe_timeout);
    return u;
  }

  void probe_all() {
    for (auto& [id, e] : endpoints_) {
      if (e.probing || e.draining) continue;
      e.probing = true;
      net::AsyncHttpRequest u = engine_get(e, "/health");
      auto status = std::make_shared<int>(0);
      net::AsyncHttpHandlers h;
      h.on_head = [status](int s, const net::Headers&) { *status = s; };
      h.on_done = [this, status, id = id](const std::string& error) {
        const bool ok = error.empty() && *status == 200;
        sched_.post([this, id, ok] { probe_result(id, ok); });
      };
      client_->start(std::move(u), std::move(h));
    }
    sched_.at(Clock::now() + topo_.health.probe_interval, [this] { probe_all(); });
  }

  // GET /load of every engine that reports its load, or may (engine_load.h); one poll per engine
  // at a time.
  void poll_loads() {
    for (auto& [id, e] : endpoints_) {
      if (e.load_source == LoadSource::kOwnCounts || e.load_polling || e.draining) continue;
      e.load_polling = true;
      net::AsyncHttpRequest u = engine_get(e, "/load");
      struct Reply {
        int status = 0;
        std::string body;
      };
      auto reply = std::make_shared<Reply>();
      net::AsyncHttpHandlers h;
      h.on_head = [reply](int s, const net::Headers&) { reply->status = s; };
      h.on_body = [reply](std::string_view piece) {
        reply->body.append(piece);
        return reply->body.size() <= kMaxLoadReportBytes;
      };
      // A leg launched shortly before this poll may still be on its way into the engine when it
      // answers: the report is taken to know only the legs launched before the previous poll.
      const PrefillWork launched = e.launched_at_last_poll;
      e.launched_at_last_poll = e.counts.launched_total;
      h.on_done = [this, reply, id = id, launched](const std::string& error) {
        LoadAnswer answer = read_load_answer(error, reply->status, reply->body);
        sched_.post([this, id, launched, answer = std::move(answer)]() mutable {
          load_result(id, launched, std::move(answer));
        });
      };
      client_->start(std::move(u), std::move(h));
    }
    sched_.at(Clock::now() + topo_.scheduling.load_interval, [this] { poll_loads(); });
  }

  // What one GET /load told about the engine.
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

  static LoadAnswer read_load_answer(const std::string& error, int status,
                                     const std::string& body) {
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

  void load_result(int id, PrefillWork launched_at_poll, LoadAnswer answer) {
    EndpointState* e = endpoint(id);
    if (!e) return;
    e->load_polling = false;
    if (answer.kind == LoadAnswer::Kind::kNoAnswer) return;
    if (answer.kind == LoadAnswer::Kind::kNoReport) {
      if (e->load_source == LoadSource::kAsking) {
        // A vLLM or SGLang engine: routed by the gateway's own counts, never waiting for reports.
        e->load_source = LoadSource::kOwnCounts;
        std::fprintf(stderr,
                     "tandem gateway: engine %s has no Tandem load report at GET /load (%s): "
                     "routing it by the gateway's own counts\n",
                     e->config.name.c_str(), answer.why.c_str());
      } else {
        std::fprintf(stderr, "tandem gateway: ignoring a load report of %s: %s\n",
                     e->config.name.c_str(), answer.why.c_str());
      }
      return;
    }
    e->load_source = LoadSource::kReports;
    e->load = absorb(std::move(e->load), std::move(answer.report), launched_at_poll, Clock::now(),
                     topo_.scheduling.tandem.prior);
    e->load.finished_at_report = e->counts.launched_total - e->counts.uncached_in_flight;
    if (!waiting_.empty()) dispatch();  // a shorter queue may free an engine for them
  }

  void probe_result(int id, bool ok) {
    EndpointState* e = endpoint(id);
    if (!e) return;
    e->probing = false;
    if (ok) {
      e->consecutive_failures = 0;
      if (!e->healthy) {
        e->healthy = true;
        e->readmitted = Clock::now();
        // What answers there now may be another server: an auto engine is asked again.
        const Pool& pool = e->prefill ? topo_.prefill : topo_.decode;
        if (pool.dialect == Dialect::kAuto) e->load_source = LoadSource::kAsking;
        if (!e->draining) e->healthy_gauge->set(1);
        update_ready();
        dispatch();
      }
    } else {
      passive_failure(*e);
    }
  }

  // ---------------------------------------------------------------- admin and debug

  json endpoint_json(const EndpointState& e) const {
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
              {"load_source", load_source_name(e.load_source)}};
    if (consumers_.count(e.id)) j["prefix_blocks"] = prefix_index_.num_blocks(e.id);
    j["uncached_tokens_in_flight"] = e.counts.uncached_in_flight.tokens;
    if (e.load.known) {
      const LoadReport& r = e.load.report;
      j["load"] = {
          {"running", r.running},
          {"waiting", r.waiting},
          {"free_blocks", r.free_blocks},
          {"total_blocks", r.total_blocks},
          {"prefill_tokens", r.prefill_tokens},
          {"age_ms",
           std::chrono::duration<double, std::milli>(Clock::now() - e.load.received).count()},
          {"batch_observations", e.load.batch_time.observations}};
    }
    if (e.config.bootstrap_port) j["bootstrap_port"] = e.config.bootstrap_port;
    return j;
  }

  json endpoints_json() const {
    json list = json::array();
    for (const auto& [id, e] : endpoints_) list.push_back(endpoint_json(e));
    return {{"mode", mode_name(topo_.mode)}, {"policy", policy_->name()}, {"endpoints", list}};
  }

  json debug_requests() const {
    json list = json::array();
    const int64_t now = steady_now_ns();
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

  // Checks an endpoint to be added to a pool against the rules of validate().
  std::string admission_error(bool prefill, const Endpoint& e) const {
    if (prefill && topo_.mode == PdMode::kAggregated) return "aggregated mode has no prefill pool";
    if (prefill && topo_.mode == PdMode::kParallel && e.bootstrap_port == 0)
      return "a parallel-mode prefill engine needs bootstrap_port";
    for (const auto& [id, x] : endpoints_)
      if (!x.draining && x.config.name == e.name)
        return "an endpoint named '" + e.name + "' exists";
    return {};
  }

  static Endpoint endpoint_from_json(const json& j) {
    if (j.is_string()) return parse_endpoint(j.get<std::string>());
    if (!j.is_object()) throw Error("endpoint: expected \"HOST:PORT[@BOOTSTRAP]\" or an object");
    Endpoint e;
    if (auto u = j.find("url"); u != j.end()) e = parse_endpoint(u->get<std::string>());
    if (auto h = j.find("host"); h != j.end()) e.host = h->get<std::string>();
    if (auto p = j.find("port"); p != j.end()) e.port = p->get<uint16_t>();
    if (auto b = j.find("bootstrap_port"); b != j.end()) e.bootstrap_port = b->get<uint16_t>();
    e.group = j.value("group", 0);
    e.max_in_flight = j.value("max_in_flight", 0);
    e.name = j.value("name", std::string());
    if (e.host.empty() || e.port == 0) throw Error("endpoint: host and port are required");
    if (e.name.empty()) e.name = address(e);
    return e;
  }

  void admin_add(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
    bool prefill = false;
    Endpoint e;
    try {
      const json body = parse_untrusted_json(req.body);
      const std::string pool = body.at("pool").get<std::string>();
      if (pool != "prefill" && pool != "decode") throw Error("pool: expected prefill or decode");
      prefill = pool == "prefill";
      e = endpoint_from_json(body.at("endpoint"));
    } catch (const std::exception& err) {
      ex->send_error(400, std::string("admin: ") + err.what());
      return;
    }
    sched_.post([this, ex, prefill, e] {
      if (auto why = admission_error(prefill, e); !why.empty()) {
        ex->send_error(400, "admin: " + why);
        return;
      }
      add_endpoint(prefill, e);
      for (const auto& [id, x] : endpoints_)
        if (x.config.name == e.name && !x.draining) ex->respond(201, endpoint_json(x).dump());
      sched_.post([this] { dispatch(); });
    });
  }

  // Draining: no new requests; it leaves once its last leg finished.
  void forget_endpoint(int id) {
    endpoints_.erase(id);
    consumers_.erase(id);  // before the index forgets the engine: no event re-adds it
    prefix_index_.remove_engine(id);
    policy_state_.prefill_tree.remove_tenant(id);
    policy_state_.decode_tree.remove_tenant(id);
  }

  bool drain_endpoint(int id) {
    EndpointState* e = endpoint(id);
    if (!e || e->draining) return false;
    e->draining = true;
    e->healthy_gauge->set(0);
    e->in_flight_gauge->set(0);
    // The name may come back (admin add, reload) before this one leaves: the labelled gauges
    // then belong to the newcomer, so a draining engine writes to a gauge of its own.
    e->healthy_gauge = &detached_gauge_;
    e->in_flight_gauge = &detached_gauge_;
    if (e->in_flight == 0) forget_endpoint(id);
    update_ready();
    return true;
  }

  void admin_remove(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
    std::string name;
    try {
      name = parse_untrusted_json(req.body).at("name").get<std::string>();
    } catch (const std::exception& err) {
      ex->send_error(400, std::string("admin: expected {\"name\": ...}: ") + err.what());
      return;
    }
    sched_.post([this, ex, name] {
      for (auto& [id, e] : endpoints_) {
        if (e.config.name != name || e.draining) continue;
        const int64_t in_flight = e.in_flight;
        drain_endpoint(id);
        ex->respond(200, json{{"removed", name}, {"draining_requests", in_flight}}.dump());
        dispatch();  // requests waiting for this engine's group may now have none: 503
        return;
      }
      ex->send_error(404, "admin: no endpoint named '" + name + "'");
    });
  }

  void admin_reload(std::shared_ptr<net::Exchange> ex) {
    if (config_path_.empty()) {
      ex->send_error(400, "admin: the gateway was not started with --config; nothing to reload");
      return;
    }
    Topology next;
    try {
      next = load_topology(config_path_);
      if (next.mode != topo_.mode)
        throw Error("reload cannot change the mode (restart the gateway for that)");
    } catch (const std::exception& err) {
      ex->send_error(400, std::string("admin: reload failed, topology unchanged: ") + err.what());
      return;
    }
    sched_.post([this, ex, next] { apply_reload(next, ex); });
  }

  // Endpoints are matched by name: unchanged ones stay as they are (with their load), changed or
  // missing ones are drained, new ones are added.
  void apply_reload(const Topology& next, const std::shared_ptr<net::Exchange>& ex) {
    int added = 0, removed = 0;
    auto same = [](const Endpoint& a, const Endpoint& b) {
      return a.name == b.name && a.host == b.host && a.port == b.port &&
             a.bootstrap_port == b.bootstrap_port && a.group == b.group &&
             a.max_in_flight == b.max_in_flight;
    };
    for (bool prefill : {true, false}) {
      const auto& wanted = (prefill ? next.prefill : next.decode).endpoints;
      std::vector<int> drop;
      for (const auto& [id, e] : endpoints_) {
        if (e.prefill != prefill || e.draining) continue;
        const bool keep = std::any_of(wanted.begin(), wanted.end(),
                                      [&](const Endpoint& w) { return same(w, e.config); });
        if (!keep) drop.push_back(id);
      }
      for (int id : drop) removed += drain_endpoint(id) ? 1 : 0;
      for (const auto& w : wanted) {
        const bool have = std::any_of(endpoints_.begin(), endpoints_.end(), [&](const auto& kv) {
          return kv.second.prefill == prefill && !kv.second.draining && same(w, kv.second.config);
        });
        if (!have) {
          add_endpoint(prefill, w);
          ++added;
        }
      }
    }
    dispatch();
    ex->respond(200, json{{"added", added}, {"removed", removed}}.dump());
  }

  void relay_models(std::shared_ptr<net::Exchange> ex, net::Headers headers) {
    const auto now = Clock::now();
    const Choice c = policy_->choose_decode(view(now), {}, -1, now);
    EndpointState* e = c.endpoint >= 0 ? endpoint(c.endpoint) : nullptr;
    if (!e) {
      ex->send_error(503, "no healthy engine", "server_error");
      return;
    }
    net::AsyncHttpRequest u;
    u.host = e->config.host;
    u.port = e->config.port;
    u.target = "/v1/models";
    u.headers = std::move(headers);
    u.timeout = topo_.timeouts.connect;
    auto answer = std::make_shared<std::pair<int, std::string>>();
    net::AsyncHttpHandlers h;
    h.on_head = [answer](int s, const net::Headers&) { answer->first = s; };
    h.on_body = [answer](std::string_view p) {
      answer->second += p;
      return true;
    };
    h.on_done = [ex, answer](const std::string& error) {
      if (error.empty())
        ex->respond(answer->first, answer->second, "application/json");
      else
        ex->send_error(502, "engine failed: " + error, "server_error");
    };
    client_->start(std::move(u), std::move(h));
  }

  Topology topo_;
  std::string config_path_;
  std::unique_ptr<Policy> policy_;
  PolicyState policy_state_;  // the policy's explicit state (scheduling thread only)
  // The engines' cached prefixes, fed by one KV-event consumer per engine that publishes them
  // (their threads write the index; the scheduling thread reads it).
  PrefixIndex prefix_index_;
  std::map<int, std::unique_ptr<KvEventsConsumer>> consumers_;
  metrics::Registry registry_;
  Metrics metrics_;
  std::unique_ptr<AccessLog> access_log_;  // its own writer thread
  std::atomic<bool> ready_{false}, stopping_{false};
  std::unique_ptr<PromptTokenizer> tokenizer_;

  // Scheduling thread only (and the constructor, before it starts).
  std::map<int, EndpointState> endpoints_;
  int next_endpoint_id_ = 0;
  std::deque<RequestPtr> waiting_;
  std::vector<RequestPtr> scratch_first_stage_, scratch_offer_;  // dispatch()'s, empty between
  std::unordered_map<const Request*, RequestPtr> active_;
  std::array<metrics::Histogram*, kPhaseCount> phase_histograms_{};
  metrics::Gauge detached_gauge_;  // written by draining engines, never rendered
  std::unordered_map<int, metrics::IntCounter*> status_counters_;

  // Destroyed in reverse: the client (on the server's io threads) goes first, then the server,
  // then the scheduler (everything posts to it).
  SchedulingThread sched_;
  net::HttpServer server_;
  std::unique_ptr<net::AsyncHttpClient> client_;
};

Gateway::Gateway(Topology topology, std::string config_path)
    : impl_(std::make_unique<Impl>(std::move(topology), std::move(config_path))) {}
Gateway::~Gateway() {
  stop();
}
void Gateway::start() {
  impl_->start();
}
uint16_t Gateway::port() const {
  return impl_->port();
}
void Gateway::stop() {
  impl_->stop();
}

}  // namespace tandem::gateway
