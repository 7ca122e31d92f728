#include "sim/cluster_simulation.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <numeric>
#include <optional>

#include "api/error.h"
#include "bench/driver.h"
#include "bench/stream_measure.h"
#include "engine/kv/kv_events.h"
#include "gateway/access_log.h"
#include "gateway/dispatcher.h"
#include "gateway/endpoints.h"
#include "gateway/front_end.h"
#include "gateway/gateway_metrics.h"
#include "gateway/health.h"
#include "gateway/kv_events_consumer.h"
#include "gateway/policy.h"
#include "gateway/prefix_index.h"
#include "gateway/priority.h"
#include "gateway/tokens_in.h"
#include "gateway/virtual_executor.h"
#include "sim/event_clock.h"
#include "sim/simulated_engine.h"
#include "sim/virtual_kv_links.h"
#include "sim/virtual_time.h"
#include "sim/virtual_upstream.h"
#include "util/error.h"
#include "util/metrics.h"
#include "util/random_id.h"

namespace tandem::sim {
namespace {

using Clock = gateway::Executor::Clock;

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// Every call to an engine that failed: the gateway's failures_total (legs, and probes while the
// engine is in routing) and the probes it failed once out of routing, which the gateway counts
// apart so that its failure rate stands still while an engine is simply down.
int64_t failed_calls(const gateway::EndpointState& e) {
  return static_cast<int64_t>(e.failures_total->value()) + e.failed_probes_while_out_total;
}

// A client of the gateway: it streams its answer and measures it as `tandem bench` does; it never
// goes away before the answer is complete.
class MeasuredClient final : public gateway::ClientReply {
 public:
  MeasuredClient(gateway::Executor& clock, Clock::time_point origin, int64_t prompt_tokens,
                 std::function<void(bench::RequestResult)> finished)
      : clock_(clock),
        origin_(origin),
        measure_(seconds_between(origin, clock.now()), prompt_tokens),
        finished_(std::move(finished)) {}

  bool respond(int status, std::string body, std::string) override {
    if (done_) return false;
    measure_.head(status);
    measure_.body(body, now());
    finish({});
    return true;
  }
  bool send_error(int status, std::string_view message, std::string_view type,
                  std::string_view code) override {
    return respond_with_error(*this, status, message, type, code);
  }
  bool start_stream(int status, std::string) override {
    if (done_) return false;
    measure_.head(status);
    return true;
  }
  bool write(std::string_view chunk) override {
    if (done_) return false;
    measure_.body(chunk, now());
    return true;
  }
  bool end() override {
    if (done_) return false;
    finish({});
    return true;
  }
  void abort() override {
    if (!done_) finish("the gateway cut the response");
  }
  void on_close(std::function<void()>) override {}  // the client stays to the end

 private:
  double now() const { return seconds_between(origin_, clock_.now()); }
  void finish(const std::string& error) {
    done_ = true;
    finished_(measure_.done(error, now(), 0));
  }

  gateway::Executor& clock_;
  Clock::time_point origin_;
  bench::StreamMeasurement measure_;
  std::function<void(bench::RequestResult)> finished_;
  bool done_ = false;
};

// The simulator's engines get made-up addresses: the name is the host, all on one port, and a
// prefill engine's KV transfer server on another.
constexpr uint16_t kEnginePort = 8000;
constexpr uint16_t kTransferPort = 9000;

}  // namespace

SimulationRun simulate(const std::vector<bench::BenchRequest>& requests,
                       const SimulationOptions& options,
                       std::shared_ptr<const text::Tokenizer> tokenizer) {
  return simulate(bench::lazy(requests), options, std::move(tokenizer));
}

namespace {

// The gateway's topology with the made-up engines.
gateway::Topology simulated_topology(const SimulationOptions& options) {
  gateway::Topology topo = options.gateway;
  topo.decode.dialect = topo.prefill.dialect = gateway::Dialect::kTandem;
  topo.decode.endpoints.clear();
  topo.prefill.endpoints.clear();
  for (int i = 0; i < options.prefill; ++i) {
    gateway::Endpoint e;
    e.name = e.host = "prefill-" + std::to_string(i);
    e.port = kEnginePort;
    if (topo.mode == gateway::PdMode::kParallel) e.bootstrap_port = kTransferPort;
    topo.prefill.endpoints.push_back(e);
  }
  for (int i = 0; i < options.decode; ++i) {
    gateway::Endpoint e;
    e.name = e.host = "decode-" + std::to_string(i);
    e.port = kEnginePort;
    topo.decode.endpoints.push_back(e);
  }
  return topo;
}

}  // namespace

void check_options(const SimulationOptions& options) {
  if (options.decode < 1) throw Error("the simulated cluster needs at least one decode engine");
  if (options.prefill < 0) throw Error("--prefill: expected 0 or more engines");
  if (options.prefill > kMaxEngines || options.decode > kMaxEngines)
    throw Error("the simulated cluster has at most " + std::to_string(kMaxEngines) +
                " prefill and as many decode engines, got " + std::to_string(options.prefill) +
                " and " + std::to_string(options.decode));
  const bool pd = options.gateway.mode != gateway::PdMode::kAggregated;
  if (pd && options.prefill < 1)
    throw Error(std::string("the ") + gateway::mode_name(options.gateway.mode) +
                " mode needs at least one prefill engine (--prefill)");
  if (!pd && options.prefill > 0)
    throw Error(
        "the aggregated mode has no prefill engines (--prefill 0, or --mode sequential "
        "or parallel)");
  gateway::Topology topo = simulated_topology(options);
  gateway::validate(topo);
  gateway::make_policy(topo.policy, gateway::policy_options(topo));  // an unknown name
  for (const auto& f : options.faults) {
    const auto named = [&](const std::vector<gateway::Endpoint>& pool) {
      return std::any_of(pool.begin(), pool.end(),
                         [&](const gateway::Endpoint& e) { return e.name == f.engine; });
    };
    if (!named(topo.prefill.endpoints) && !named(topo.decode.endpoints))
      throw Error("fault: no engine named '" + f.engine + "' among " +
                  std::to_string(options.prefill) + " prefill and " +
                  std::to_string(options.decode) + " decode engines (prefill-0.., decode-0..)");
    if (!(f.at_s >= 0 && f.at_s <= bench::kMaxArrivalSeconds))
      throw Error("fault: " + f.engine + "'s fault starts at " + std::to_string(f.at_s) +
                  " s; expected 0.." + std::to_string(int64_t(bench::kMaxArrivalSeconds)) + " s");
    if (!(f.duration_s >= 0 && f.duration_s <= bench::kMaxArrivalSeconds))
      throw Error("fault: " + f.engine + "'s fault lasts " + std::to_string(f.duration_s) +
                  " s; expected 0.." + std::to_string(int64_t(bench::kMaxArrivalSeconds)) + " s");
    if (f.kind == SimulationOptions::Fault::Kind::kSlowLink &&
        !(f.factor >= 1 && f.factor <= kMaxSlowdown))
      throw Error("fault: " + f.engine + "'s links can only slow down, by a factor in 1.." +
                  std::to_string(int64_t(kMaxSlowdown)));
    // It would do nothing: no run should report a fault that was not there.
    if (f.kind == SimulationOptions::Fault::Kind::kSlowLink && !pd)
      throw Error("fault: --slow-link on " + f.engine +
                  ": the aggregated mode moves no KV between engines (--mode sequential or "
                  "parallel)");
  }
  // Named by their flags here, before a workload is read; the scheduler names its fields.
  if (options.scheduler.max_num_seqs < 1)
    throw Error("--max-num-seqs: expected at least 1, got " +
                std::to_string(options.scheduler.max_num_seqs));
  if (options.scheduler.max_num_batched_tokens < 1)
    throw Error("--max-num-batched-tokens: expected at least 1, got " +
                std::to_string(options.scheduler.max_num_batched_tokens));
  const engine::SimExecutorOptions& x = options.executor;
  if (x.block_size < 1 || x.block_size > kMaxBlockSize)
    throw Error("--block-size: expected 1.." + std::to_string(kMaxBlockSize) + " tokens, got " +
                std::to_string(x.block_size));
  if (x.kv_token_bytes < 0 || x.kv_token_bytes > kMaxKvTokenBytes)
    throw Error("--sim-kv-token-bytes: expected 0 (the model's) .. " +
                std::to_string(kMaxKvTokenBytes) + " bytes per token and layer, got " +
                std::to_string(x.kv_token_bytes));
  if (x.num_blocks < 0 || x.num_blocks > kMaxNumBlocks)
    throw Error("--num-kv-blocks: expected 0 (the preset's) .. " + std::to_string(kMaxNumBlocks) +
                ", got " + std::to_string(x.num_blocks));
  // What each engine will hold, 0 meaning the model's or the preset's as the executor takes it;
  // every factor is bounded above (the presets' sizes too), so the products fit in int64.
  const engine::SimKvSize kv = engine::sim_kv_size(x);
  const int64_t engines_total = int64_t{options.prefill} + options.decode;
  if (kv.token_bytes * x.block_size * engines_total > kMaxKvBytesAllEngines)
    throw Error("--sim-kv-token-bytes " + std::to_string(x.kv_token_bytes) +
                (x.kv_token_bytes == 0 ? " (the model's " + std::to_string(kv.token_bytes) + ")"
                                       : std::string()) +
                " x --block-size " + std::to_string(x.block_size) + " x " +
                std::to_string(engines_total) +
                " engines: every engine holds a block's bytes of a layer, " +
                std::to_string(kMaxKvBytesAllEngines >> 30) + " GiB at most in all");
  if (kv.num_blocks * engines_total > kMaxNumBlocksAllEngines)
    throw Error("--num-kv-blocks " + std::to_string(x.num_blocks) +
                (x.num_blocks == 0 ? " (the preset's " + std::to_string(kv.num_blocks) +
                                         " at --block-size " + std::to_string(x.block_size) + ")"
                                   : std::string()) +
                " x " + std::to_string(engines_total) +
                " engines: every engine keeps a record per block, " +
                std::to_string(kMaxNumBlocksAllEngines) + " blocks at most in all");
  const double gb_per_s = options.kv_link.bytes_per_s / 1e9;
  if (!(gb_per_s >= kMinLinkGbPerS && gb_per_s <= kMaxLinkGbPerS))
    throw Error("--kv-link-gb-per-s: expected " + std::to_string(kMinLinkGbPerS) + ".." +
                std::to_string(int64_t(kMaxLinkGbPerS)) + " GB/s, got " + std::to_string(gb_per_s));
  const double latency_us = options.kv_link.latency_s * 1e6;
  if (!(latency_us >= 0 && latency_us <= kMaxLinkLatencyUs))
    throw Error("--kv-link-latency-us: expected 0.." + std::to_string(int64_t(kMaxLinkLatencyUs)) +
                " microseconds, got " + std::to_string(latency_us));
  for (const auto& [flag, seconds] :
       {std::pair{"--kv-transfer-timeout", options.kv_transfer_timeout_s},
        std::pair{"--kv-transfer-handshake-timeout", options.kv_transfer_handshake_timeout_s}})
    if (!(seconds >= kMinKvTransferTimeoutS && seconds <= kMaxKvTransferTimeoutS)) {
      char text[128];
      std::snprintf(text, sizeof text, "%s: expected %g..%.10g seconds, got %g", flag,
                    kMinKvTransferTimeoutS, kMaxKvTransferTimeoutS, seconds);
      throw Error(text);
    }
}

SimulationRun simulate(const bench::LazyWorkload& workload, const SimulationOptions& options,
                       std::shared_ptr<const text::Tokenizer> tokenizer) {
  check_options(options);
  const bool pd = options.gateway.mode != gateway::PdMode::kAggregated;
  gateway::Topology topo = simulated_topology(options);

  // The gateway's random ids (request ids, bootstrap rooms) are made on this thread.
  seed_random_ids(options.executor.seed);
  EventClock clock;
  const Clock::time_point origin = clock.now();
  VirtualUpstream upstream(clock, options.body_bytes_per_s);
  gateway::PrefixIndex index;
  metrics::Registry registry;
  gateway::GatewayMetrics gateway_metrics(registry);
  const std::unique_ptr<gateway::Policy> policy =
      gateway::make_policy(topo.policy, gateway::policy_options(topo));
  std::unique_ptr<gateway::PromptTokenizer> prompt_tokenizer;
  if (!topo.model.empty())
    prompt_tokenizer = std::make_unique<gateway::PromptTokenizer>(
        topo.model, topo.served_model_name, 0, tokenizer);  // the engines' (the same folder)
  gateway::EndpointTable endpoints(topo, gateway_metrics, index);
  // The topology's access log, as the live gateway writes it (times are virtual): how each
  // request was routed, for comparing a simulated run with a live one line by line.
  const std::unique_ptr<gateway::AccessLog> access_log =
      topo.access_log.empty() ? nullptr
                              : std::make_unique<gateway::AccessLog>(
                                    topo.access_log, &gateway_metrics.access_log_dropped);
  gateway::Dispatcher dispatcher(topo, clock, upstream, *policy, endpoints, gateway_metrics,
                                 access_log.get());
  // As the live gateway wires it (gateway.cpp): an ejection by failed probes cuts the legs that
  // sent their client nothing, so a hung engine's requests are retried elsewhere at once.
  gateway::HealthMonitor health(topo, clock, upstream, endpoints,
                                [&] { dispatcher.engines_changed(); });
  gateway::FrontEnd front_end(topo, clock, upstream, dispatcher, endpoints, registry,
                              prompt_tokenizer.get());

  // The engines, each publishing its KV events to the index under its endpoint id, and moving KV
  // over the virtual links.
  VirtualKvNetwork network(clock, options.kv_link);
  std::vector<std::unique_ptr<SimulatedEngine>> engines;
  std::vector<int> endpoint_ids;  // the gateway's id of each engine
  auto add_engine = [&](bool prefill, const gateway::Endpoint& e) {
    const int id = endpoints.add(prefill, e);
    endpoint_ids.push_back(id);
    endpoints.events_fed_externally(id);
    SimulatedEngineOptions eo;
    eo.name = e.name;
    eo.config.scheduler = options.scheduler;
    // Engines schedule by the priority the gateway sends them, as `tandem serve` starts them.
    if (gateway::engine_schedules_by_priority(topo.priority, *policy, prefill || !pd))
      eo.config.scheduler.priority = true;
    eo.config.enable_prefix_caching = options.prefix_caching;
    if (pd) {
      eo.config.role = prefill ? engine::EngineRole::kPrefill : engine::EngineRole::kDecode;
      engine::KvTransferConfig t;
      t.engine_id = e.name;
      t.advertise_host = e.host;
      t.port = prefill ? kTransferPort : -1;
      t.timeout_s = options.kv_transfer_timeout_s;
      t.handshake_timeout_s = options.kv_transfer_handshake_timeout_s;
      eo.config.transfer = t;
    }
    eo.executor = options.executor;
    eo.executor.model_name = options.executor.preset;
    // Every engine serves the same model (the same hot experts: the skew's seed), with routes of
    // its own steps drawn on their own.
    eo.executor.expert_parallel.seed =
        options.executor.expert_parallel.seed + 1000003 * uint64_t(engines.size());
    auto events = [&clock, &index, id,
                   delay = duration_of(options.kv_event_delay_s)](engine::KvEventBatch batch) {
      // In the engines' wire format, as the ZMQ consumer receives it.
      std::string payload = engine::encode_kv_event_batch(batch);
      clock.at(clock.now() + delay, [&index, id, payload = std::move(payload)] {
        gateway::apply_kv_event_batch(index, id, gateway::decode_kv_event_payload(payload));
      });
    };
    engines.push_back(std::make_unique<SimulatedEngine>(clock, tokenizer, eo, events, &network));
    upstream.add(e.host, e.port, engines.back().get());
  };
  for (const gateway::Endpoint& e : topo.prefill.endpoints) add_engine(true, e);
  for (const gateway::Endpoint& e : topo.decode.endpoints) add_engine(false, e);
  clock.post([&] { health.start(); });

  // The faults, at their times. An engine's name is also its host (the made-up addresses).
  auto time_of = [&](double s) { return origin + duration_of(s); };
  for (const auto& f : options.faults) {
    auto it = std::find_if(engines.begin(), engines.end(),
                           [&](const auto& e) { return e->name() == f.engine; });
    SimulatedEngine* engine = it->get();  // there is one: check_options
    switch (f.kind) {
      case SimulationOptions::Fault::Kind::kDeath:
        clock.schedule(time_of(f.at_s), [&, engine] {
          engine->kill();
          upstream.kill(engine->name(), kEnginePort);
          network.kill(engine->name());
        });
        break;
      case SimulationOptions::Fault::Kind::kStall:
        // The engine and its KV side (frozen whole, as SIGSTOP freezes a live one).
        clock.schedule(time_of(f.at_s), [&, engine, end = time_of(f.at_s + f.duration_s)] {
          engine->stall(end);
          network.stall(engine->name(), end);
        });
        break;
      case SimulationOptions::Fault::Kind::kSlowLink:
        // Each fault ends its own factor: faults on one engine that overlap, or meet at an
        // instant in either order, leave the slowest under way in force.
        clock.schedule(time_of(f.at_s),
                       [&, engine, factor = f.factor] { network.slow(engine->name(), factor); });
        clock.schedule(time_of(f.at_s + f.duration_s), [&, engine, factor = f.factor] {
          network.end_slow(engine->name(), factor);
        });
        break;
    }
  }

  // The clients, each at its arrival time; a request is made when it is sent. Arrivals are armed
  // one at a time, in time order (equal times in workload order), each as the one before it
  // fires: the schedule's timers come first at equal times, as when all were armed at the start.
  const size_t n = workload.size();
  SimulationRun run;
  for (size_t i = 0; i < n; ++i) {
    const double at = workload.arrival_s[i];
    if (!(at >= 0 && at <= bench::kMaxArrivalSeconds))
      throw Error("request " + std::to_string(i) + ": arrival time " + std::to_string(at) +
                  " s is not a time from the start (0.." +
                  std::to_string(int64_t(bench::kMaxArrivalSeconds)) + " s)");
  }
  std::vector<size_t> order;  // empty: the workload's own (already in time order)
  if (!std::is_sorted(workload.arrival_s.begin(), workload.arrival_s.end())) {
    order.resize(n);
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return workload.arrival_s[a] < workload.arrival_s[b];
    });
  }
  run.results.resize(n);
  size_t sent = 0, finished = 0;
  Clock::time_point last_answer = origin;
  const bench::DriverOptions& body_options = options.client;
  BodyLine client_line(options.body_bytes_per_s);  // the clients' sending thread
  std::function<void(size_t)> arm_arrival = [&](size_t k) {
    if (k >= n) return;
    const size_t i = order.empty() ? k : order[k];
    clock.schedule(origin + duration_of(workload.arrival_s[i]), [&, k, i] {
      arm_arrival(k + 1);
      ++sent;
      const bench::BenchRequest request = workload.make(i);
      net::HttpRequest req;
      req.method = "POST";
      req.target = req.path = body_options.endpoint;
      req.headers.set("Content-Type", "application/json");
      req.headers.set("X-Request-Id", "sim-" + std::to_string(i));
      req.body = bench::request_body(request, body_options);
      auto client = std::make_shared<MeasuredClient>(
          clock, origin, bench::sent_prompt_tokens(request, body_options),
          [&, i](bench::RequestResult r) {
            run.results[i] = std::move(r);
            ++finished;
            last_answer = std::max(last_answer, clock.now());
          });
      // The body reaches the gateway after those sent before it and its own bytes.
      const Clock::time_point arrives = client_line.done_at(clock.now(), req.body.size());
      auto prepare = [&, req = std::move(req), client] {
        if (gateway::RequestPtr r = front_end.prepare(req, client)) dispatcher.submit(r);
      };
      if (arrives > clock.now())
        clock.at(arrives, std::move(prepare));
      else
        prepare();
    });
  };
  arm_arrival(0);

  // Virtual time runs until every request has its answer and every live engine that is not
  // stalled has let go of its requests, then on while blocks are held for transfers (a hold or a
  // bootstrap room whose other leg never came ends by the transfer timeout), for at most that
  // timeout: a stalled engine that wakes by then finds the gateway's aborts and lets go of its
  // requests too. A longer stall is not waited out: the gateway probes and polls a hung engine
  // for as long as it hangs, and a stall of 10^6 s took 1.5 million calls to simulate for no
  // answer (that engine then ends with its blocks in use). The gateway's own timers never stop,
  // so the end is that, not an empty queue.
  auto engines_busy = [&] {
    return std::any_of(engines.begin(), engines.end(), [](const auto& e) {
      return !e->dead() && !e->stalled() && e->engine().has_work();
    });
  };
  auto blocks_held = [&] {
    return std::any_of(engines.begin(), engines.end(), [](const auto& e) {
      const engine::LoadReport l = e->engine().load();
      return !e->dead() && l.free_blocks < l.total_blocks;
    });
  };
  // An idle gap (no request in flight, every engine idle, only the gateway's probes and polls
  // repeating) is not run timer by timer: a Mooncake trace spanning 10^6 s took 46 s of 100 ms
  // polls. One period of those timers runs as usual; if it changed nothing but counters and the
  // timers after it are those before it, a period apart, the clock skips whole periods, leaving
  // at least one to run before the next arrival or fault, so that the timers are where they
  // would be. What was skipped would only have repeated that period: its calls, timeouts and
  // failures (probes to a killed engine) are counted as if run.
  const Clock::duration period = [&]() -> Clock::duration {
    const int64_t probe = topo.health.probe_interval.count();
    const int64_t load = topo.scheduling.load_interval.count();
    if (probe <= 0) return {};
    const int64_t ms = load > 0 ? std::lcm(probe, load) : probe;
    return ms <= 3600 * 1000 ? std::chrono::milliseconds(ms) : Clock::duration{};
  }();
  auto engines_quiet = [&] {
    return std::all_of(engines.begin(), engines.end(),
                       [](const auto& e) { return e->dead() || e->quiet(); });
  };
  struct Counts {
    std::vector<Clock::duration> timers;
    std::vector<bool> healthy;
    std::vector<int64_t> failures;  // by engine
    int64_t calls = 0, timeouts = 0, transfers = 0;
    double retries = 0;
  };
  auto counts = [&] {
    Counts c;
    c.timers = clock.pattern();
    for (int id : endpoint_ids) {
      const gateway::EndpointState* seen = endpoints.find(id);
      c.healthy.push_back(seen->healthy);
      c.failures.push_back(failed_calls(*seen));
    }
    c.calls = upstream.calls();
    c.timeouts = upstream.timeouts();
    c.transfers = network.transfers();
    c.retries = gateway_metrics.retries.value();
    return c;
  };
  int64_t skipped_calls = 0, skipped_timeouts = 0, skipped_failures = 0;
  // The engine failures of a period that repeat, or none when one counts towards ejecting an
  // engine the gateway still takes as healthy: that is no repetition. Failures repeat only once
  // it is ejected (a killed engine's probes).
  auto repeated_failures = [](const Counts& before, const Counts& after) -> std::optional<int64_t> {
    int64_t failures = 0;
    for (size_t i = 0; i < after.failures.size(); ++i) {
      const int64_t more = after.failures[i] - before.failures[i];
      if (more > 0 && after.healthy[i]) return std::nullopt;
      failures += more;
    }
    return failures;
  };
  // Periods skipped count as run: their calls, timeouts and failures.
  auto count_skipped = [&](int64_t periods, const Counts& before, const Counts& after,
                           int64_t failures) {
    run.skipped_s += std::chrono::duration<double>(periods * period).count();
    skipped_calls += periods * (after.calls - before.calls);
    skipped_timeouts += periods * (after.timeouts - before.timeouts);
    skipped_failures += periods * failures;
  };
  auto run_or_skip_a_period = [&](Clock::time_point until) {
    const Counts before = counts();
    clock.advance_to(clock.now() + period);
    if (sent != finished || clock.pending_tasks() > 0 || !engines_quiet()) return;
    const Counts after = counts();
    if (after.timers != before.timers || after.healthy != before.healthy ||
        after.transfers != before.transfers || after.retries != before.retries)
      return;
    const std::optional<int64_t> failures = repeated_failures(before, after);
    if (!failures) return;
    const int64_t periods = (until - clock.now()) / period - 1;
    if (periods < 1) return;
    clock.skip(periods * period);
    count_skipped(periods, before, after, *failures);
  };

  // The same with requests in flight that nothing can move: every engine is idle, dead or
  // stalled (a request waits on a hung engine, or in the queue for one), and the gateway's timers
  // that would end the wait (its timeouts) or the stall's end are far off. With 1 ms probes and
  // timeouts of 2^31 ms that wait was run one probe at a time, for hours. Timers armed before
  // the period and still pending after it (a request's timeout, a stall's end) stay where they
  // are; the skip ends a period before the first of them. The period runs timer by timer, and
  // stops as the loop below would when a request ends, so that what follows is the same. It also
  // takes an idle gap with an engine stalled in it: that engine is not quiet (the stall's end,
  // the probes it holds), so the skip above does not apply, and the gap ran probe by probe.
  auto engines_frozen = [&] {
    return std::all_of(engines.begin(), engines.end(),
                       [](const auto& e) { return e->dead() || e->quiet() || e->stalled(); });
  };
  auto deferred = [&] {
    std::vector<size_t> d;
    for (const auto& e : engines) d.push_back(e->deferred());
    return d;
  };
  auto run_or_skip_a_period_in_flight = [&](Clock::time_point until) {
    const auto timers_before = clock.timers_from_now();
    const uint64_t armed_before = clock.sequence();
    const Counts before = counts();
    const std::vector<size_t> deferred_before = deferred();
    const size_t finished_before = finished;
    const Clock::time_point end = clock.now() + period;
    Clock::time_point t;
    while (clock.next_timer(&t) && t <= end) {
      clock.advance_to(t);
      if (finished != finished_before || !engines_frozen()) return;
    }
    // The clock stays at the period's last timer unless it skips: as the loop below leaves it.
    const Clock::duration to_end = end - clock.now();
    if (clock.pending_tasks() > 0) return;
    const Counts after = counts();
    if (after.healthy != before.healthy || after.transfers != before.transfers ||
        after.retries != before.retries || deferred() != deferred_before)
      return;
    const std::optional<int64_t> failures = repeated_failures(before, after);
    if (!failures) return;
    // The timers of the period that fired must have been armed again, a period on; those older
    // than the period that are still pending bound the skip, as a stall's end does.
    const auto timers_after = clock.timers_from_now();
    std::vector<uint64_t> pending;
    for (const auto& [in, seq] : timers_after) pending.push_back(seq);
    std::sort(pending.begin(), pending.end());
    std::vector<Clock::duration> fired, armed;
    for (const auto& [in, seq] : timers_before)
      if (!std::binary_search(pending.begin(), pending.end(), seq)) fired.push_back(in);
    for (const auto& [in, seq] : timers_after) {
      if (seq > armed_before)
        armed.push_back(in - to_end);
      else
        until = std::min(until, clock.now() + in);
    }
    if (fired != armed) return;
    for (const auto& e : engines)
      if (e->stalled()) until = std::min(until, e->stalled_until());
    if (until == Clock::time_point::max()) return;  // nothing would ever end the wait
    const int64_t periods = (until - end) / period - 1;
    if (periods < 1) return;
    clock.advance_to(end);  // no timer is left before it
    clock.skip(periods * period, armed_before);
    count_skipped(periods, before, after, *failures);
  };

  clock.run_ready();
  Clock::time_point next, scheduled;
  while ((finished < n || engines_busy()) && clock.next_timer(&next)) {
    // Cheap tests first: this runs before every timer.
    if (options.skip_idle && period.count() > 0 && sent == finished && next > clock.now() &&
        clock.next_scheduled(&scheduled) && scheduled - clock.now() >= 3 * period &&
        engines_quiet()) {
      run_or_skip_a_period(scheduled);
      continue;
    }
    if (options.skip_idle && period.count() > 0 && next > clock.now() &&
        clock.pending_tasks() == 0 && (sent != finished || !engines_quiet()) && engines_frozen()) {
      if (!clock.next_scheduled(&scheduled)) scheduled = Clock::time_point::max();
      if (scheduled - clock.now() >= 3 * period) {
        run_or_skip_a_period_in_flight(scheduled);
        continue;
      }
    }
    clock.advance_to(next);
  }
  const Clock::time_point holds_end = clock.now() + duration_of(options.kv_transfer_timeout_s + 1);
  while (blocks_held() && clock.next_timer(&next) && next <= holds_end) clock.advance_to(next);
  if (finished < n)
    throw Error("the simulation stopped with " + std::to_string(n - finished) +
                " requests unanswered and nothing left to happen");

  run.duration_s = seconds_between(origin, last_answer);
  run.virtual_end_s = seconds_between(origin, clock.now());
  run.upstream_calls = upstream.calls() + skipped_calls;
  run.retries = static_cast<int64_t>(gateway_metrics.retries.value());
  run.timeouts = upstream.timeouts() + skipped_timeouts;
  run.engine_failures = skipped_failures;
  run.indexed_blocks = index.stats().blocks;
  run.kv_transfers = network.transfers();
  run.kv_transfer_bytes = network.bytes();
  for (size_t i = 0; i < engines.size(); ++i) {
    const SimulatedEngine& e = *engines[i];
    const gateway::EndpointState* seen = endpoints.find(endpoint_ids[i]);
    EngineSummary s;
    s.healthy = seen->healthy;
    s.ejections = static_cast<int64_t>(seen->ejections_total->value());
    run.engine_failures += failed_calls(*seen);
    s.name = e.name();
    s.prefill = e.engine().role() == engine::EngineRole::kPrefill;
    s.steps = e.steps();
    s.busy_s = e.busy_seconds();
    const std::string metrics = e.registry().render();
    if (auto c = bench::parse_prefix_cache_counters(metrics)) {
      s.prefix_queries = c->queries;
      s.prefix_hits = c->hits;
    }
    s.draft_tokens = bench::metric_sum(metrics, "vllm:spec_decode_num_draft_tokens").value_or(0);
    s.accepted_tokens =
        bench::metric_sum(metrics, "vllm:spec_decode_num_accepted_tokens").value_or(0);
    run.draft_tokens += s.draft_tokens;
    run.accepted_tokens += s.accepted_tokens;
    const engine::LoadReport load = e.engine().load();
    s.blocks_in_use = load.total_blocks - load.free_blocks;
    s.died = e.dead();
    s.stalled = e.stalled();
    // The engines that compute prompts: the prefill pool in P/D (a decode leg's lookups find the
    // KV it is about to receive), every engine when aggregated.
    if (s.prefill || !pd) {
      run.prefix_queries += s.prefix_queries;
      run.prefix_hits += s.prefix_hits;
    }
    run.engines.push_back(s);
  }
  dispatcher.shut_down();
  front_end.stop();
  return run;
}

}  // namespace tandem::sim
