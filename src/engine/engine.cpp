#include "engine/engine.h"

#include <chrono>
#include <random>

#include "util/error.h"

namespace tandem::engine {
namespace {

std::optional<KvEventsConfig> parse_events(const EngineConfig& config) {
  if (config.kv_events_config.empty()) return std::nullopt;
  return KvEventsConfig::parse(config.kv_events_config);
}

KvCacheOptions kv_options(const std::optional<KvEventsConfig>& events) {
  KvCacheOptions o;
  o.enable_events = events && events->enable_kv_cache_events;
  return o;
}

double unix_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

// vLLM's metric names, so dashboards built for vLLM work unchanged.
struct Engine::Metrics {
  metrics::Gauge& running;
  metrics::Gauge& waiting;
  metrics::Gauge& kv_usage;
  metrics::Gauge& gpu_usage;  // the pre-v1 name of the same figure
  metrics::IntCounter& prefix_queries;
  metrics::IntCounter& prefix_hits;
  metrics::Gauge& prefix_hit_rate;
  metrics::IntCounter& prompt_tokens;
  metrics::IntCounter& generation_tokens;
  metrics::IntCounter& preemptions;
  metrics::Family<metrics::IntCounter>& success;
  metrics::Histogram& ttft;
  metrics::Histogram& tpot;
  metrics::Histogram& e2e;
  metrics::Histogram& queue_time;
};

Engine::Engine(const EngineConfig& config, std::unique_ptr<Executor> executor,
               std::shared_ptr<const text::Tokenizer> tokenizer, std::vector<int32_t> eos_ids,
               metrics::Registry& registry)
    : config_(config),
      executor_(std::move(executor)),
      tokenizer_(std::move(tokenizer)),
      eos_ids_(std::move(eos_ids)),
      events_config_(parse_events(config)),
      kv_(executor_->info().num_blocks, executor_->info().block_size, config.enable_prefix_caching,
          kv_options(events_config_)),
      scheduler_(config.scheduler, kv_),
      seed_base_(std::random_device{}()) {
  if (events_config_ && events_config_->enable_kv_cache_events &&
      events_config_->publisher == "zmq")
    publisher_ = std::make_unique<ZmqKvEventPublisher>(*events_config_);
  const metrics::LabelPairs model = {{"model_name", executor_->info().model_name}};
  metrics_.reset(new Metrics{
      registry.gauge("vllm:num_requests_running", "Requests in the running batch", model),
      registry.gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", model),
      registry.gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100%)", model),
      registry.gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (1 = 100%), pre-v1 name", model),
      registry.int_counter("vllm:prefix_cache_queries_total",
                           "Prompt tokens looked up in the prefix cache", model),
      registry.int_counter("vllm:prefix_cache_hits_total",
                           "Prompt tokens found in the prefix cache", model),
      registry.gauge("vllm:gpu_prefix_cache_hit_rate",
                     "Prefix-cache hit rate since start (hits / queries, in tokens)", model),
      registry.int_counter("vllm:prompt_tokens_total", "Prompt tokens processed", model),
      registry.int_counter("vllm:generation_tokens_total", "Tokens generated", model),
      registry.int_counter("vllm:num_preemptions_total", "Sequences preempted (recomputed later)",
                           model),
      registry.int_counter_family("vllm:request_success_total", "Finished requests by reason",
                                  {"finished_reason"}, model),
      registry.histogram("vllm:time_to_first_token_seconds", "Time to first token",
                         metrics::vllm_ttft_buckets(), model),
      registry.histogram("vllm:time_per_output_token_seconds", "Time per output token",
                         metrics::vllm_tpot_buckets(), model),
      registry.histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency",
                         metrics::vllm_request_latency_buckets(), model),
      registry.histogram("vllm:request_queue_time_seconds", "Time from arrival to first scheduling",
                         metrics::vllm_request_latency_buckets(), model)});
  update_gauges();
}

Engine::~Engine() {
  stop();
}

void Engine::start() {
  std::lock_guard lock(mutex_);
  if (thread_.joinable() || stopping_) return;
  thread_ = std::thread([this] { loop(); });
}

void Engine::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Whatever never reached the loop, or was still in it, ends as aborted.
  std::vector<EngineRequest> left;
  {
    std::lock_guard lock(mutex_);
    left.swap(incoming_);
  }
  for (auto& r : left) {
    RequestOutput out;
    out.finished = true;
    out.finish_reason = "abort";
    if (r.on_output) r.on_output(out);
  }
  std::vector<Sequence*> live;
  for (auto& [id, seq] : sequences_) live.push_back(seq.get());
  for (auto* s : live) finish(s, "abort");
}

void Engine::submit(EngineRequest request) {
  const auto& info = executor_->info();
  if (request.prompt.empty()) throw Error("the prompt has no tokens");
  for (auto t : request.prompt)
    if (t < 0 || t >= info.vocab_size)
      throw Error("token id " + std::to_string(t) + " is outside the vocabulary of " +
                  std::to_string(info.vocab_size) + " ids");
  request.sampling.validate();
  const int64_t total = static_cast<int64_t>(request.prompt.size()) + request.sampling.max_tokens;
  if (total > info.max_model_len)
    throw Error("prompt (" + std::to_string(request.prompt.size()) + " tokens) plus max_tokens (" +
                std::to_string(request.sampling.max_tokens) +
                ") exceeds the model's maximum context length of " +
                std::to_string(info.max_model_len));
  // A request that cannot fit the whole cache alone would be preempted forever.
  if (total > info.num_blocks * info.block_size)
    throw Error("prompt plus max_tokens (" + std::to_string(total) +
                " tokens) exceeds the KV cache of this engine (" +
                std::to_string(info.num_blocks * info.block_size) + " tokens)");
  {
    std::lock_guard lock(mutex_);
    if (stopping_) throw Error("the engine is shutting down");
    if (!live_ids_.insert(request.id).second)
      throw Error("request id '" + request.id + "' is already in use");
    incoming_.push_back(std::move(request));
  }
  wake_.notify_one();
}

void Engine::abort(const std::string& id) {
  {
    std::lock_guard lock(mutex_);
    if (!live_ids_.count(id)) return;
    aborts_.push_back(id);
  }
  wake_.notify_one();
}

LoadReport Engine::load() const {
  std::lock_guard lock(load_mutex_);
  return load_;
}

std::string Engine::kv_events_endpoint() const {
  return publisher_ ? publisher_->endpoint() : std::string();
}
std::string Engine::kv_events_replay_endpoint() const {
  return publisher_ ? publisher_->replay_endpoint() : std::string();
}

void Engine::loop() {
  while (true) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] {
        return stopping_ || !incoming_.empty() || !aborts_.empty() || !sequences_.empty();
      });
      if (stopping_) return;
    }
    admit_incoming();
    if (!sequences_.empty()) step();
  }
}

void Engine::admit_incoming() {
  std::vector<EngineRequest> incoming;
  std::vector<std::string> aborts;
  {
    std::lock_guard lock(mutex_);
    incoming.swap(incoming_);
    aborts.swap(aborts_);
  }
  const double now = now_seconds();
  for (auto& r : incoming) {
    auto seq = std::make_unique<Sequence>();
    seq->tokens = r.prompt;
    seq->num_prompt = static_cast<int64_t>(r.prompt.size());
    seq->arrival_order = arrival_counter_++;
    seq->arrival_time = now;
    seq->sampler = std::make_unique<Sampler>(r.sampling, seed_base_ + seq->arrival_order);
    seq->output = std::make_unique<OutputProcessor>(*tokenizer_, r.sampling, eos_ids_);
    seq->request = std::move(r);
    Sequence* raw = seq.get();
    sequences_[raw->request.id] = std::move(seq);
    scheduler_.add(raw);
  }
  for (const auto& id : aborts) {
    auto it = sequences_.find(id);
    if (it != sequences_.end()) finish(it->second.get(), "abort");
  }
  if (!incoming.empty() || !aborts.empty()) update_gauges();
}

void Engine::step() {
  SchedulerOutput out = scheduler_.schedule();
  metrics_->preemptions.inc(out.preempted.size());
  if (out.empty()) {
    // Nothing fits right now (cannot happen while submit() checks that every request fits the
    // cache alone, but never spin): wait for the next submission or abort.
    std::unique_lock lock(mutex_);
    wake_.wait_for(lock, std::chrono::milliseconds(50));
    return;
  }
  const double now = now_seconds();
  std::vector<ExecItem> items;
  items.reserve(out.scheduled.size());
  for (const auto& s : out.scheduled) {
    Sequence* seq = s.seq;
    if (!seq->admitted_once) {
      seq->admitted_once = true;
      metrics_->queue_time.observe(now - seq->arrival_time);
    }
    ExecItem item;
    item.tokens = std::span<const int32_t>(seq->tokens)
                      .subspan(size_t(seq->num_computed), size_t(s.num_new_tokens));
    item.start = seq->num_computed;
    item.blocks = kv_.block_table(seq->request.id);
    item.sample = s.sample;
    item.sampler = seq->sampler.get();
    item.prompt = seq->prompt();
    item.generated = seq->generated();
    item.logprobs = seq->request.logprobs;
    items.push_back(item);
  }
  ExecResult result;
  try {
    result = executor_->execute(items);
  } catch (const std::exception& e) {
    // A failed step fails the requests in it, not the engine.
    for (const auto& s : out.scheduled) finish(s.seq, "error", e.what());
    publish_events();
    update_gauges();
    return;
  }
  scheduler_.step_done(out);
  const double done = now_seconds();
  for (size_t i = 0; i < out.scheduled.size(); ++i) {
    const auto& s = out.scheduled[i];
    Sequence* seq = s.seq;
    if (!s.sample) continue;
    const TokenLogprob& sampled = result.sampled[i];
    const bool first = seq->num_generated() == 0;
    seq->tokens.push_back(sampled.token);
    if (first) {
      seq->first_token_time = done;
      metrics_->ttft.observe(done - seq->arrival_time);
      metrics_->prompt_tokens.inc(static_cast<uint64_t>(seq->num_prompt));
    } else if (seq->last_token_time >= 0) {
      metrics_->tpot.observe(done - seq->last_token_time);
    }
    seq->last_token_time = done;
    metrics_->generation_tokens.inc();
    auto delta = seq->output->push(sampled.token);
    RequestOutput o;
    o.tokens.push_back(sampled.token);
    if (seq->request.logprobs >= 0) o.logprobs.push_back(sampled);
    o.text = std::move(delta.text);
    o.prompt_tokens = seq->num_prompt;
    o.completion_tokens = seq->num_generated();
    o.cached_tokens = seq->num_cached;
    if (delta.finished) {
      o.finished = true;
      o.finish_reason = delta.finish_reason;
    }
    if (seq->request.on_output) seq->request.on_output(o);
    if (delta.finished) finish(seq, delta.finish_reason, {}, /*notified=*/true);
  }
  publish_events();
  update_gauges();
}

void Engine::finish(Sequence* seq, const std::string& reason, const std::string& error,
                    bool notified) {
  scheduler_.remove(seq);
  if (!notified && seq->request.on_output) {
    RequestOutput o;
    o.finished = true;
    o.finish_reason = reason;
    o.error = error;
    o.prompt_tokens = seq->num_prompt;
    o.completion_tokens = seq->num_generated();
    o.cached_tokens = seq->num_cached;
    seq->request.on_output(o);
  }
  metrics_->success.labels({reason}).inc();
  metrics_->e2e.observe(now_seconds() - seq->arrival_time);
  const std::string id = seq->request.id;
  sequences_.erase(id);
  std::lock_guard lock(mutex_);
  live_ids_.erase(id);
}

void Engine::publish_events() {
  auto events = kv_.take_events();
  if (publisher_ && !events.empty()) publisher_->publish({unix_time(), std::move(events), {}});
}

void Engine::update_gauges() {
  const auto& info = executor_->info();
  LoadReport r;
  r.running = static_cast<int64_t>(scheduler_.running().size());
  r.waiting = static_cast<int64_t>(scheduler_.waiting().size());
  r.free_blocks = kv_.num_free_blocks();
  r.total_blocks = info.num_blocks;
  r.block_size = info.block_size;
  r.kv_usage = kv_.usage();
  r.cached_blocks = kv_.num_cached_blocks();
  for (const auto& [id, seq] : sequences_)
    r.tokens_in_flight += static_cast<int64_t>(seq->tokens.size());
  const PrefixCacheStats& stats = kv_.prefix_cache_stats();
  metrics_->prefix_queries.inc(static_cast<uint64_t>(stats.queries - reported_queries_));
  metrics_->prefix_hits.inc(static_cast<uint64_t>(stats.hits - reported_hits_));
  reported_queries_ = stats.queries;
  reported_hits_ = stats.hits;
  if (stats.queries > 0)
    metrics_->prefix_hit_rate.set(static_cast<double>(stats.hits) /
                                  static_cast<double>(stats.queries));
  metrics_->running.set(static_cast<double>(r.running));
  metrics_->waiting.set(static_cast<double>(r.waiting));
  metrics_->kv_usage.set(r.kv_usage);
  metrics_->gpu_usage.set(r.kv_usage);
  std::lock_guard lock(load_mutex_);
  r.steps = load_.steps + 1;
  load_ = r;
}

}  // namespace tandem::engine
