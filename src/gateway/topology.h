#pragma once
// What the gateway serves: its pools of prefill and decode engines and the settings around them,
// from flags or from a YAML file (`tandem gateway --config topology.yaml`). The file format is
// documented in docs/gateway.md; this header is the in-memory form both produce.
//
// Modes: aggregated (no prefill pool: every request goes to one decode engine as it is),
// sequential (vLLM's flow: prefill, then the decode engine pulls the KV) and parallel (SGLang's
// flow: both legs at once, meeting in a bootstrap room). A pool's dialect says what its engines
// speak: `vllm` engines only serve the sequential flow, `sglang` engines only the parallel one,
// `tandem` engines both and report their load at GET /load; `auto` (the default) asks each engine
// for its load report and treats one that has none as vLLM/SGLang does (docs/gateway.md). Groups: a
// decode engine of group G only serves requests whose prefill ran on an engine of group G.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "gateway/policy.h"

namespace tandem::gateway {

enum class PdMode { kAggregated, kSequential, kParallel };
enum class Dialect { kAuto, kTandem, kVllm, kSglang };

struct Endpoint {
  std::string name;  // unique within the topology; default "HOST:PORT"
  std::string host;
  uint16_t port = 0;
  uint16_t bootstrap_port = 0;  // parallel mode, prefill pool: the engine's KV transfer port
  int group = 0;
  int max_in_flight = 0;  // requests at once before more wait in the gateway; 0: the pool's
  // The engine's KV events (vLLM's ZMQ publisher), which feed the gateway's prefix index: the
  // PUB endpoint, e.g. "tcp://10.0.0.5:5557", and the replay ROUTER endpoint. Empty: none.
  std::string kv_events, kv_events_replay;
};

// The engine an entry names, as "host:port" with the host in lower case (DNS names are
// case-insensitive): two entries with one key are one engine, which twice in a pool would take
// twice its in-flight limit.
std::string address_key(const Endpoint& e);

struct Pool {
  Dialect dialect = Dialect::kAuto;
  // With a tokenizer configured: send token ids (a /v1/completions body with an id prompt)
  // instead of the client's body. Every dialect accepts id prompts on /v1/completions.
  bool tokens_in = true;
  int max_in_flight = 256;  // per endpoint, unless the endpoint says otherwise
  std::vector<Endpoint> endpoints;
};

struct HealthOptions {
  // Active probe: GET /health on every endpoint at this interval; a probe that fails or takes
  // longer than `probe_timeout` counts as a failure.
  std::chrono::milliseconds probe_interval = std::chrono::seconds(2);
  std::chrono::milliseconds probe_timeout = std::chrono::seconds(1);
  // Passive: this many consecutive failures (probes or requests) make an endpoint ineligible;
  // one successful probe makes it eligible again.
  int failures_to_eject = 3;
  // An engine readmitted after being ejected regains its in-flight limit over this time, from
  // one request (nginx's slow_start): a restarted engine is not flooded while it warms up. 0: at
  // once.
  std::chrono::milliseconds slow_start = std::chrono::seconds(10);
  bool operator==(const HealthOptions&) const = default;
};

// How the scheduling thread decides (docs/gateway.md, "Scheduling policies").
struct SchedulingOptions {
  QueueWeights queue;    // the order waiting requests are offered in (policies/queue_order.h)
  TandemOptions tandem;  // the tandem policy's limits and defaults
  CacheAwareOptions cache_aware;  // the cache_aware policy's thresholds (SGLang's)
  KvRouterOptions kv_router;      // the kv_router policy's weights (Dynamo's)
  // GET /load on tandem-dialect engines (and auto ones that answer it) at this interval (0: never):
  // their running sequences,
  // free KV, queued prefill and step durations (engine_load.h). Reports older than four
  // intervals are not used.
  std::chrono::milliseconds load_interval{100};
  bool operator==(const SchedulingOptions&) const = default;
};

struct Timeouts {
  // Waiting for a free engine. As long as a prefill leg may take: a request the scheduler holds
  // back from saturated engines must not fail sooner than it would have queued on one.
  std::chrono::milliseconds queue = std::chrono::seconds(300);
  std::chrono::milliseconds connect = std::chrono::seconds(5);        // per upstream call
  std::chrono::milliseconds prefill = std::chrono::seconds(300);      // a whole prefill leg
  std::chrono::milliseconds first_token = std::chrono::seconds(300);  // decode's response head
  std::chrono::milliseconds idle = std::chrono::seconds(120);  // between two pieces of a stream
  // Sequential mode: a prompt's wait for a decode engine after its prefill. The prefill engine
  // holds the KV only so long (Tandem's and vLLM's NIXL default: 120 s), and the decode engine
  // must still pull it: below that hold.
  std::chrono::milliseconds decode_queue = std::chrono::seconds(90);
  bool operator==(const Timeouts&) const = default;
};

// The wait before a request goes again where an immediate retry would meet the same limit: a
// sequential decode leg whose prefill engine refused the pull for now (api::kKvTransferBusyCode:
// every KV transfer connection it allows was in use), and a request an engine refused (429, 503:
// its queue is full) with no engine left that has not refused or failed it. `first` before the
// request's first such retry, doubled for each one after, at most `max` (Envoy's retry back-off:
// base and max interval); each kind counts its own retries. The file's `retry_backoff_ms` and
// `retry_backoff_max_ms` (when only the first is given, the max is ten times it, at least
// 1000 ms).
struct RetryBackoff {
  std::chrono::milliseconds first{50};
  std::chrono::milliseconds max{1000};

  // Before the request's retry number `retry` (1 for its first).
  std::chrono::milliseconds before(int retry) const;
  // The wait before(retry) jittered: from half of it to all of it, as `random` picks, so that legs
  // refused at the same instant do not all come back at one tick to meet the same limit again
  // (Envoy jitters its back-off too).
  std::chrono::milliseconds jittered(int retry, uint64_t random) const;
  bool operator==(const RetryBackoff&) const = default;
};

// Priority classes (docs/gateway.md, "Priority classes"): requests are queued by class, first
// class first, then by the queue's rule; each class has its own starvation bound.
struct PriorityClass {
  std::string name;
  int64_t priority = 0;  // what the engines get as the request's `priority` (lower runs first)
  // A request of this class that has waited this long goes before every request that has not
  // waited its own class's bound, whatever their class (policies/queue_order.h).
  std::chrono::milliseconds max_wait = std::chrono::seconds(2);
  // How long the tandem policy may hold a request of this class for the engines' queued-token
  // limits (policy.h RequestInfo::max_hold): 0 never; none: scheduling.max_hold_ms.
  std::optional<std::chrono::milliseconds> hold;
  bool operator==(const PriorityClass&) const = default;
};

struct PriorityClasses {
  std::vector<PriorityClass> classes;      // highest first; empty: no classes, `priority` as sent
  size_t default_class = 0;                // of requests with neither a priority nor a mapped key
  std::map<std::string, size_t> api_keys;  // API key -> its class

  bool enabled() const { return !classes.empty(); }
  bool operator==(const PriorityClasses&) const = default;
};

// The largest value of max_unsent_bytes and max_answer_bytes: each is memory held for one client,
// and a bound past what a machine gives one client is a typo or a unit mistake, not a setting.
inline constexpr size_t kMaxHeldBytesLimit = size_t{16} << 30;
// The longest duration a topology file or flag takes, in milliseconds: timers add durations to
// steady_clock's now(), and a duration past this would overflow that sum into a time already due
// (a probe re-armed for the past spins its thread, a first-token deadline in the past times every
// request out at once). 2^31 - 1 ms is about 24.8 days.
inline constexpr int64_t kMaxMilliseconds = 2147483647;
// The most io threads (listen.io_threads, --http-threads): each holds descriptors of its own, and
// past a machine's cores more only cost; a typo such as 100000 failed later, naming neither.
inline constexpr int kMaxIoThreads = 64;
// The most retries of one request's prefill (prefill_retries, --prefill-retries): each is an
// engine call for one client request, which an engine answering 503 at once turns into a loop.
inline constexpr int kMaxPrefillRetries = 16;
// The longest engine name (bytes) a topology file or the admin API accepts: the name labels the
// engine's metric series.
inline constexpr size_t kMaxEndpointNameBytes = 256;

struct Topology {
  std::string host = "0.0.0.0";
  uint16_t port = 8080;
  int io_threads = 2;       // 1 to kMaxIoThreads
  bool reuse_port = false;  // SO_REUSEPORT: replicas of this gateway may listen on the same port
  size_t max_body_bytes = size_t{8} << 20;
  // A request's body must be complete within this time of its head, however fast it comes, else
  // 408 (net::HttpServerOptions::max_body_time): the bound the server applies is this or the time
  // max_body_bytes takes at 28 KB/s, whichever is longer. The file's listen.max_body_time_ms,
  // --max-body-time-ms; 1 to kMaxMilliseconds.
  std::chrono::milliseconds max_body_time = std::chrono::minutes(5);
  // The stream high-water mark (net::HttpServerOptions::max_unsent_bytes): a streaming client
  // this far behind its stream is cut as stalled, and its engine legs cancelled. 1 to
  // kMaxHeldBytesLimit.
  size_t max_unsent_bytes = size_t{16} << 20;
  size_t max_connections = 0;  // client connections held at once; 0: 3/4 of the fd limit
  size_t max_connections_per_address = 0;  // of those, from one peer address; 0: no limit
  // CORS (net::HttpServerOptions::allowed_origins): the browser origins whose pages may call the
  // gateway; "*": any, as vLLM's default; empty: none. The file's listen.allowed_origins,
  // --allowed-origins.
  std::vector<std::string> allowed_origins = {"*"};

  PdMode mode = PdMode::kAggregated;
  Pool prefill, decode;

  std::string model;  // a model folder: the gateway tokenizes with its tokenizer; empty: no
  std::string served_model_name;      // the model id clients use; empty: the engines' own
  std::vector<std::string> api_keys;  // clients must send one as a Bearer token; empty: open
  // The operator's limits on max_tokens where the gateway tokenizes (`model`): the most a request
  // may ask for and the value when it gives none (0: none, the API's defaults). Give the engines
  // the same (`tandem engine --max-tokens-limit/--default-max-tokens`; `tandem serve` does).
  // The key engines started with --api-key expect; the gateway sends it on every call to them.
  std::string engine_api_key;
  int64_t max_tokens_limit = 0;
  int64_t default_max_tokens = 0;
  // Where the gateway tokenizes, the engines' generation config's max_new_tokens
  // (api::SamplingDefaults::max_tokens and max_tokens_cap): a chat's max_tokens when it gives none
  // (the room's if smaller), and a cap on every request's; 0: none. From --generation-config and
  // --override-generation-config, read as the engines read them; not a file's setting.
  int64_t generation_max_tokens = 0;
  int64_t generation_max_tokens_cap = 0;
  std::string admin_api_key;  // for /admin/*; empty: the admin API is off
  // For /metrics (which names every engine); empty: open, as vLLM's is.
  std::string metrics_api_key;

  size_t max_queue = 1024;  // requests waiting in the gateway; beyond: 429
  // The most bytes of request bodies the waiting requests hold (their body and prefill body, and a
  // sequential decode stage's decode body): an arrival past it gets max_queue's 429, unless nothing
  // waits or lower classes' waiting requests are shed for it (Dispatcher::make_room). max_queue
  // bounds the count only: its 1024 places at the 8 MiB bodies listen.max_body_bytes allows hold
  // 8 GiB. 1 GiB binds only where the waiting bodies average over 1 MiB (some 250k tokens of text
  // each). The file's max_queued_body_bytes, --max-queued-body-bytes; 0: no bound.
  size_t max_queued_body_bytes = size_t{1} << 30;
  // The largest non-streamed answer, or event of a stream, the gateway holds to relay (it buffers
  // a whole answer before any byte reaches the client, so a failure can still be retried); a
  // larger answer or first event is refused with a 502 that asks for stream: true, a larger later
  // event cuts the stream as the engine's failure. 1 to kMaxHeldBytesLimit.
  size_t max_answer_bytes = size_t{64} << 20;
  // Other prefill engines tried when one fails before any byte; 0 to kMaxPrefillRetries.
  int prefill_retries = 2;
  RetryBackoff retry_backoff;
  // The scheduling policy (policy.h make_policy): tandem, least_load, round_robin, cache_aware,
  // kv_router. Checked when the gateway is built.
  std::string policy = "tandem";
  SchedulingOptions scheduling;
  HealthOptions health;
  Timeouts timeouts;
  std::string access_log;  // a file path, "-" for standard output, empty for none
  PriorityClasses priority;
  // How long a stop (SIGTERM) lets the requests in flight finish before those left are answered
  // 503 (Gateway::stop); 0: no drain. The file's `shutdown_timeout`, in seconds; at most
  // 2^31 - 1 ms (about 24.8 days), as every duration.
  std::chrono::milliseconds shutdown_timeout = std::chrono::seconds(30);
  // Replicas that share a port (`tandem serve --gateways N`): each has its own counters, so a
  // scrape of the port reads one replica's. Non-empty: every /metrics sample carries
  // gateway_replica="<this>", which keeps each replica's series apart. Empty: no such label.
  std::string metrics_replica;
};

// "HOST:PORT", "http://HOST:PORT" or, for a parallel-mode prefill engine,
// "HOST:PORT@BOOTSTRAP_PORT". Throws tandem::Error naming the text otherwise, after `what` (the
// flag or key the text came from).
Endpoint parse_endpoint(const std::string& text, const std::string& what = "endpoint");
// "HOST:PORT" or "http://HOST:PORT": a server's address where no bootstrap port applies (bench's
// --base-url). Errors as parse_endpoint's, naming these forms.
Endpoint parse_server_address(const std::string& text, const std::string& what);
// One engine as an entry of a topology file's `endpoints` list (a string as above, or a mapping
// with url or host and port, bootstrap_port, group, name, max_in_flight, kv_events,
// kv_events_replay), from its YAML or JSON text (JSON is YAML): the admin API reads new engines
// with it, so they get the file's checks (ranges, unknown keys, the host's characters). `path`
// starts errors ("endpoint.port: expected a port 1..65535, got 65616"). Without a name it is
// "HOST:PORT".
Endpoint parse_endpoint_entry(const std::string& text, const std::string& path);
// "aggregated", "sequential" (alias "vllm") or "parallel" (alias "sglang"); errors start with
// `what`, as parse_endpoint's.
PdMode parse_mode(const std::string& text, const std::string& what = "mode");
// "auto", "tandem", "vllm" or "sglang".
Dialect parse_dialect(const std::string& text, const std::string& what = "dialect");
const char* mode_name(PdMode mode);
const char* dialect_name(Dialect dialect);

// Parses a topology file's text; `source` names it in errors, which also give the key path
// (e.g. "topology.yaml: prefill.endpoints[1].port: expected a port 1..65535, got 70000").
// Unknown keys are errors. The result is validated.
Topology parse_topology_yaml(const std::string& text, const std::string& source);
Topology load_topology(const std::string& path);
// A file holding the `priority_classes` section's mapping (`tandem gateway/serve
// --priority-classes`): classes, default, api_keys at its top level, or under a top-level
// `priority_classes:` as in a topology file.
PriorityClasses load_priority_classes(const std::string& path);

// The policies' options from the `scheduling` section. With priority classes each request's class
// is its `priority` on the engines, so the tandem policy sets no prefill deadlines (and holds
// requests for the engines' queued tokens, as for engines without deadlines).
PolicyOptions policy_options(const Topology& topology);

// Why POST /admin/reload cannot apply `next` to a gateway started with `current` (empty: it
// can): a different mode, or a pool's tokens_in (read as requests are prepared, at start). What
// a reload applies is each pool's engines, dialect and max_in_flight; other settings wait for a
// restart (docs/gateway.md, "Admin API").
std::string reload_refusal(const Topology& current, const Topology& next);

// Throws tandem::Error for an inconsistent topology: no decode engine; a prefill pool in
// aggregated mode or none in a P/D mode; a dialect that cannot serve the mode; a parallel-mode
// prefill engine without a bootstrap port; duplicate endpoint names; one HOST:PORT twice in a pool
// (under two names: twice its in-flight limit); non-positive limits; byte
// limits past kMaxHeldBytesLimit;
// priority classes with duplicate names or priorities, or keys the gateway does not accept.
// Endpoints without a name get "HOST:PORT".
void validate(Topology& topology);

// A key flag given with an empty value (`--admin-api-key "$UNSET"`): refused as an empty
// `--api-key` is (a gateway that looks guarded must not be meant open, nor an API meant on be
// off), where the topology's empty key would read as not given. Throws tandem::Error:
// "FIELD (OPTION): expected a non-empty key, got an empty key".
void check_key_option(const std::string& value, const std::string& field,
                      const std::string& option);

}  // namespace tandem::gateway
