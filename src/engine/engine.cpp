#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <random>

#include "api/error.h"
#include "util/duration.h"
#include "util/error.h"

namespace tandem::engine {
namespace {

std::optional<KvEventsConfig> parse_events(const EngineConfig& config) {
  if (config.kv_events_config.empty()) return std::nullopt;
  return KvEventsConfig::parse(config.kv_events_config);
}

KvCacheOptions kv_options(const EngineConfig& config, const std::optional<KvEventsConfig>& events,
                          const ExecutorInfo& info) {
  KvCacheOptions o;
  o.enable_events = (events && events->enable_kv_cache_events) || config.kv_event_sink;
  o.recompute_last_hit_block = info.speculative_tokens > 0;
  return o;
}

double unix_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
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
  // Per finished request that got a token, as vLLM V1 splits it: first scheduled to first token,
  // first token to last token, first scheduled to last token.
  metrics::Histogram& prefill_time;
  metrics::Histogram& decode_time;
  metrics::Histogram& inference_time;
  // vLLM's newer name: one observation per decode step of a request, its whole gap since the
  // request's previous tokens (tpot above splits a step's gap over the tokens it yielded).
  metrics::Histogram& itl;
  // Per step, as vLLM counts one: the prompts that got their first token plus the tokens
  // generated (so its sum is vllm:prompt_tokens_total plus vllm:generation_tokens_total).
  metrics::Histogram& iteration_tokens;
  // Per finished request.
  metrics::Histogram& request_prompt_tokens;
  metrics::Histogram& request_generation_tokens;
  metrics::Histogram& max_tokens_param;
  // Per prompt, once all its choices (the API's n) finished.
  metrics::Histogram& n_param;
  metrics::Histogram& max_generation_tokens;
  metrics::Gauge& waiting_for_kv;
  // Speculative decoding, as vLLM names it.
  metrics::IntCounter& spec_drafts;
  metrics::IntCounter& spec_draft_tokens;
  metrics::IntCounter& spec_accepted_tokens;
  metrics::Family<metrics::IntCounter>& spec_accepted_per_position;
};

namespace {

constexpr std::pair<EngineRole, const char*> kRoles[] = {{EngineRole::kBoth, "both"},
                                                         {EngineRole::kPrefill, "prefill"},
                                                         {EngineRole::kDecode, "decode"}};

// The executor's draft passes need room past a sampled sequence's tokens.
SchedulerConfig scheduler_config(SchedulerConfig c, const ExecutorInfo& info) {
  c.speculative_lookahead = info.speculative_lookahead();
  return c;
}

}  // namespace

EngineRole parse_engine_role(std::string_view text) {
  for (const auto& [role, name] : kRoles)
    if (text == name) return role;
  throw Error("role: expected prefill, decode or both, got '" + std::string(text) + "'");
}

const char* engine_role_name(EngineRole role) {
  for (const auto& [r, name] : kRoles)
    if (r == role) return name;
  return "unknown";
}

Engine::Engine(const EngineConfig& config, std::unique_ptr<Executor> executor,
               std::shared_ptr<const text::Tokenizer> tokenizer, std::vector<int32_t> eos_ids,
               metrics::Registry& registry)
    : config_(config),
      executor_(std::move(executor)),
      tokenizer_(std::move(tokenizer)),
      eos_ids_(std::move(eos_ids)),
      structured_outputs_(tokenizer_),
      events_config_(parse_events(config)),
      kv_(executor_->info().num_blocks, executor_->info().block_size, config.enable_prefix_caching,
          kv_options(config, events_config_, executor_->info())),
      scheduler_(scheduler_config(config.scheduler, executor_->info()), kv_),
      seed_base_(std::random_device{}()) {
  {
    const ExecutorInfo& info = executor_->info();
    max_model_len_ = info.max_model_len;
    max_model_len_source_ = "the model's maximum context length";
    if (config_.max_model_len > 0 && config_.max_model_len < max_model_len_) {
      max_model_len_ = config_.max_model_len;
      max_model_len_source_ = "this engine's --max-model-len";
    }
    if (const int64_t cache = info.num_blocks * info.block_size; cache < max_model_len_) {
      max_model_len_ = cache;
      max_model_len_source_ = "this engine's KV cache (--kv-cache-gb, --num-kv-blocks)";
    }
  }
  if (events_config_ && events_config_->enable_kv_cache_events &&
      events_config_->publisher == "zmq")
    publisher_ = std::make_unique<ZmqKvEventPublisher>(*events_config_);
  const metrics::LabelPairs model = {{"model_name", executor_->info().model_name}};
  // Token counts per request, as vLLM buckets them: 1, 2, 5, 10, ... up to the longest sequence.
  const std::vector<double> token_buckets = metrics::buckets_1_2_5(double(max_model_len_));
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
      registry.histogram("vllm:request_queue_time_seconds",
                         "Time from the engine loop taking it in to first scheduling",
                         metrics::vllm_request_latency_buckets(), model),
      registry.histogram("vllm:request_prefill_time_seconds",
                         "Time from first scheduling to the first token",
                         metrics::vllm_request_latency_buckets(), model),
      registry.histogram("vllm:request_decode_time_seconds",
                         "Time from the first token to the last",
                         metrics::vllm_request_latency_buckets(), model),
      registry.histogram("vllm:request_inference_time_seconds",
                         "Time from first scheduling to the last token",
                         metrics::vllm_request_latency_buckets(), model),
      registry.histogram("vllm:inter_token_latency_seconds",
                         "Gap between a request's consecutive outputs (one per decode step)",
                         metrics::vllm_tpot_buckets(), model),
      registry.histogram("vllm:iteration_tokens_total",
                         "Tokens per engine step: prompts completed plus tokens generated",
                         metrics::vllm_iteration_tokens_buckets(), model),
      registry.histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request",
                         token_buckets, model),
      registry.histogram("vllm:request_generation_tokens", "Generated tokens per finished request",
                         token_buckets, model),
      registry.histogram("vllm:request_params_max_tokens",
                         "The max_tokens parameter of finished requests", token_buckets, model),
      registry.histogram("vllm:request_params_n",
                         "The n parameter (choices per prompt) of finished requests",
                         metrics::vllm_n_buckets(), model),
      registry.histogram("vllm:request_max_num_generation_tokens",
                         "Most tokens generated by one choice of a finished request's prompt",
                         token_buckets, model),
      registry.gauge("tandem:num_requests_waiting_for_kv",
                     "Decode requests waiting for their prompt's KV from a prefill engine", model),
      registry.int_counter("vllm:spec_decode_num_drafts_total",
                           "Speculative steps: a sequence's drafts verified together", model),
      registry.int_counter("vllm:spec_decode_num_draft_tokens_total", "Draft tokens verified",
                           model),
      registry.int_counter("vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted",
                           model),
      registry.int_counter_family("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                  "Draft tokens accepted, by position in their step's drafts",
                                  {"position"}, model)});
  // Every series a dashboard may rate() exists from the start, at 0, as vLLM creates them: a
  // series born at its first increment loses that increment to rate() and increase(). The
  // finished reasons are vLLM's FinishReason strings (Tandem never ends one for "repetition").
  for (const char* reason : {"stop", "length", "abort", "error", "repetition"})
    metrics_->success.labels({reason});
  for (int64_t k = 0; k < executor_->info().speculative_tokens; ++k)
    metrics_->spec_accepted_per_position.labels({std::to_string(k)});
  // The role, for dashboards to count a P/D request once: its prefill and decode legs both count
  // its prompt and finish (deploy/grafana/tandem.json joins on it by job and instance).
  registry
      .gauge_family("tandem:engine_info", "This engine's P/D role, in the label", {"role"}, model)
      .labels({engine_role_name(config_.role)})
      .set(1);
  // vLLM's info metric: a gauge of 1 whose labels are the cache's configuration (those of vLLM's
  // CacheConfig fields that Tandem has, its values written as Python writes them).
  registry
      .gauge_family("vllm:cache_config_info", "The KV cache's configuration, in the labels",
                    {"block_size", "num_gpu_blocks", "enable_prefix_caching"}, model)
      .labels({std::to_string(executor_->info().block_size),
               std::to_string(executor_->info().num_blocks),
               config_.enable_prefix_caching ? "True" : "False"})
      .set(1);
  const ExecutorInfo& info = executor_->info();
  if (info.routed_experts > 0) {
    expert_load_ = std::make_unique<ExpertLoadStats>(info.moe_layers, info.routed_experts,
                                                     config_.expert_load_window);
    auto& family = registry.gauge_family(
        "tandem:expert_load_imbalance",
        "Busiest expert's routed tokens over the mean, per MoE layer, in the expert-load window",
        {"layer"}, model);
    for (int64_t layer : info.moe_layers)
      expert_imbalance_.push_back(&family.labels({std::to_string(layer)}));
    if (executor_->expert_placement())
      remapper_ = std::make_unique<ExpertRemapper>(
          *executor_, config_.rebalance_interval, registry,
          [this](std::function<void()> task) { post(std::move(task)); });
    else if (config_.rebalance_interval > 0)
      throw Error("--rebalance-interval needs an engine that places experts (--expert-parallel N)");
    if (!config_.expert_load_dump.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(config_.expert_load_dump, ec);
      if (ec)
        throw Error("--expert-load-dump: cannot create " + config_.expert_load_dump.string() +
                    ": " + ec.message());
    }
  }
  if (config_.transfer) {
    KvTransfers::Post to_engine = [this](std::function<void()> t) { this->post(std::move(t)); };
    if (config_.make_transfers) {
      agent_ = config_.make_transfers(*executor_, std::move(to_engine));
    } else {
      TcpTransportOptions tcp;
      tcp.io_timeout = milliseconds_of(config_.transfer->timeout_s);
      auto transport = config_.transfer->transport == KvTransportKind::kTcp
                           ? make_tcp_transport(tcp)
                           : make_shm_transport(tcp);
      agent_ = std::make_unique<KvTransferAgent>(
          *config_.transfer, *executor_, std::move(transport), registry, std::move(to_engine));
    }
    PdHost& host = *this;  // a private base: converted here, where it is accessible
    pd_ = std::make_unique<PdCoordinator>(*agent_, kv_, host, config_.transfer->timeout_s);
  }
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
  const bool was_running = thread_.joinable();
  if (was_running) thread_.join();
  executor_->stop_background();  // a placement loading must not post to an engine that is going
  if (was_running && expert_load_ && !config_.expert_load_dump.empty()) {
    try {
      expert_load_->snapshot().write(config_.expert_load_dump / "expert_load_cumulative", true);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "engine: expert load dump: %s\n", e.what());
    }
  }
  // Transfers end first (their tasks are dropped): nothing touches the cache after this, and
  // nothing is left to wait for.
  agent_.reset();
  if (pd_) pd_->transfers_ended(sequences_);
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
  for (auto& [id, seq] : sequences_)
    if (seq->kv_state != KvTransferState::kFetchCancelled) live.push_back(seq.get());
  for (auto* s : live) finish(s, "abort");
}

void Engine::check(const EngineRequest& request) const {
  const auto& info = executor_->info();
  if (request.prompt.empty()) throw Error("the prompt has no tokens");
  for (auto t : request.prompt)
    if (t < 0 || t >= info.vocab_size)
      throw Error("token id " + std::to_string(t) + " is outside the vocabulary of " +
                  std::to_string(info.vocab_size) + " ids");
  request.sampling.validate();
  // Compared without adding: max_tokens near 2^63 made the sum wrap negative and pass, and the
  // request then grew until it filled the cache.
  const auto prompt = static_cast<int64_t>(request.prompt.size());
  const int64_t max_tokens = request.sampling.max_tokens;
  if (max_tokens > max_model_len_ - prompt)
    throw Error("prompt (" + std::to_string(prompt) + " tokens) plus max_tokens (" +
                std::to_string(max_tokens) + ") exceeds " + max_model_len_source_ + " of " +
                std::to_string(max_model_len_) + " tokens");
  const KvTransferSpec& kt = request.kv_transfer;
  if (kt.mode != KvTransferSpec::Mode::kNone && !agent_)
    throw Error("this engine was started without KV transfer (--role both/prefill/decode)");
  if (kt.prefill() && !agent_->serving())
    throw Error("this engine has no KV transfer server, so it cannot serve prefill legs");
  if (request.prompt_logprobs >= 0) {
    // The prompt's logprobs come from its logits, which only the engine computing the prompt has.
    const bool handed =
        kt.mode == KvTransferSpec::Mode::kDecodeByPull && !request.known_prompt_logprobs.empty();
    if (!info.scores_prompts && !handed)
      throw Error(
          "prompt logprobs are not computed by an expert-parallel engine (--expert-parallel): ask "
          "without 'prompt_logprobs' (and without 'echo' with 'logprobs')");
    // A decode leg handed none computes them itself (PdCoordinator); a wrong count is no
    // prefill answer for this prompt.
    const size_t known = request.known_prompt_logprobs.size();
    if (known > 0 && known + 1 != request.prompt.size())
      throw Error("kv_transfer_params.prompt_logprobs holds " + std::to_string(known) +
                  " entries for a " + std::to_string(request.prompt.size()) +
                  "-token prompt: one per prompt token after the first");
  }
}

void Engine::submit(EngineRequest request) {
  check(request);
  if (request.kv_transfer.prefill()) request.sampling.limit_to_prefill_leg();
  {
    request.arrival_time = now();
    std::lock_guard lock(mutex_);
    if (stopping_) throw Error("the engine is shutting down");
    if (!live_ids_.insert(request.id).second)
      throw Error("request id '" + request.id + "' is already in use");
    // A decode leg's prompt is received from its prefill engine, not computed here.
    const auto prompt =
        request.kv_transfer.decode() ? 0 : static_cast<int64_t>(request.prompt.size());
    incoming_prompt_tokens_ += prompt;
    incoming_prompt_pairs_ += api::causal_pairs(0, prompt);
    incoming_.push_back(std::move(request));
  }
  wake_.notify_one();
}

void Engine::release_remote_kv(const std::string& host, uint16_t port, const std::string& engine_id,
                               const std::string& transfer_id, std::vector<int32_t> blocks) {
  if (agent_) agent_->release_remote(host, port, engine_id, transfer_id, std::move(blocks));
}

void Engine::abandon_remote_room(const std::string& host, uint16_t port, uint64_t room,
                                 std::span<const int32_t> prompt, const std::string& reason) {
  if (agent_)
    agent_->abandon_room(host, port, room, kv_prompt_hash(prompt), int64_t(prompt.size()), reason);
}

void Engine::post(std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    tasks_.push_back(std::move(task));
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
  LoadReport r;
  {
    std::lock_guard lock(load_mutex_);
    r = load_;
    if (r.step_seqs > 0) r.step_running_for_s = std::max(now() - step_started_, 0.0);
  }
  return with_incoming(std::move(r));
}

LoadReport Engine::with_incoming(LoadReport snapshot) const {
  // Requests submitted since the snapshot (it is written between steps, and a step may take
  // seconds) are queued prefill work already: a router must not see the engine as idle.
  snapshot.prefill_tokens += incoming_prompt_tokens_.load();
  snapshot.prefill_pairs += incoming_prompt_pairs_.load();
  return snapshot;
}

// Prompt work this engine still has to do for a sequence (none while a decode leg waits for
// its KV, which a prefill engine computed). One never admitted counts without the prefix its
// cache held on arrival: a router reading the load must see a cached continuation as the little
// work it is.
static api::PrefillWork uncomputed_prompt(const Sequence& seq) {
  if (seq.status == SequenceStatus::kFinished || seq.awaiting_kv()) return {};
  const int64_t done =
      seq.admitted_once ? seq.num_computed : std::max(seq.num_computed, seq.cached_on_arrival);
  return api::PrefillWork::of_prompt(done, seq.num_prompt);
}

api::PrefillWork Engine::queued_prefill() const {
  api::PrefillWork n;
  for (const auto& [id, seq] : sequences_) n += uncomputed_prompt(*seq);
  return n;
}

std::string Engine::kv_events_endpoint() const {
  return publisher_ ? publisher_->endpoint() : std::string();
}
std::string Engine::kv_events_replay_endpoint() const {
  return publisher_ ? publisher_->replay_endpoint() : std::string();
}

double Engine::now() const {
  if (config_.clock) return config_.clock();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool Engine::has_work() const {
  std::lock_guard lock(mutex_);
  return !incoming_.empty() || !aborts_.empty() || !tasks_.empty() || scheduler_.has_schedulable();
}

void Engine::loop() {
  while (true) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] {
        return stopping_ || !incoming_.empty() || !aborts_.empty() || !tasks_.empty() ||
               scheduler_.has_schedulable();
      });
      if (stopping_) return;
    }
    if (run_once()) continue;
    // Nothing could be scheduled: what waits needs blocks that KV transfers or legs receiving
    // their KV hold. A pass with nothing new would schedule nothing again: sleep until an event
    // or a leg's wait for blocks runs out, not a 50 ms poll (a full pass each time).
    if (scheduler_.has_schedulable()) {
      const double until = wakes_by_itself_at();
      std::unique_lock lock(mutex_);
      auto event = [&] {
        return stopping_ || !incoming_.empty() || !aborts_.empty() || !tasks_.empty();
      };
      if (until == std::numeric_limits<double>::infinity()) {
        wake_.wait(lock, event);
      } else {
        // A millisecond past it: a wait rounded to before it would find no leg overdue yet.
        const double left = std::max(until - now(), 0.0);
        wake_.wait_for(lock, milliseconds_of(left) + std::chrono::milliseconds(1), event);
      }
    }
  }
}

double Engine::wakes_by_itself_at() const {
  return pd_ ? pd_->next_overdue() : std::numeric_limits<double>::infinity();
}

bool Engine::run_once() {
  admit_incoming();
  if (pd_ && pd_->fail_overdue(now()) > 0) update_gauges();
  const bool ran = scheduler_.has_schedulable() && step();
  // What the cache recorded is published at the end of every pass, as vLLM publishes each
  // scheduler iteration's events, whether a step ran or not: blocks evicted for a decode leg's
  // KV, or by a step that only preempted, must not look cached to routers until some later step.
  publish_events();
  return ran;
}

void Engine::admit_incoming() {
  std::vector<EngineRequest> incoming;
  std::vector<std::string> aborts;
  std::vector<std::function<void()>> tasks;
  {
    std::lock_guard lock(mutex_);
    incoming.swap(incoming_);
    incoming_prompt_tokens_ = 0;
    incoming_prompt_pairs_ = 0;
    aborts.swap(aborts_);
    tasks.swap(tasks_);
  }
  const double now = this->now();
  for (auto& t : tasks) t();
  for (auto& r : incoming) {
    // The grammar the API compiled goes to the cache, if it has none for the spec, and nowhere
    // else: each copy of the sampling parameters below (sampler, output processor, the request)
    // would keep it alive for as long as the request runs, ~30 MB each for a large one.
    std::shared_ptr<const structured::Grammar> compiled;
    if (r.sampling.structured_output)
      compiled = std::exchange(r.sampling.structured_output->compiled, nullptr);
    auto seq = Sequence::of(std::move(r));
    const EngineRequest& request = seq->request;
    seq->arrival_order = arrival_counter_++;
    seq->arrival_time = request.arrival_time;
    seq->queued_time = now;
    seq->sampler =
        std::make_unique<Sampler>(request.sampling, seed_base_ + seq->arrival_order, eos_ids_);
    seq->output = std::make_unique<OutputProcessor>(*tokenizer_, request.sampling, eos_ids_);
    seq->prompt_logprobs = std::move(seq->request.known_prompt_logprobs);
    Sequence* raw = seq.get();
    sequences_[raw->request.id] = std::move(seq);

    if (const auto& spec = raw->request.sampling.structured_output) {
      try {
        if (!executor_->info().samples)
          throw Error("structured outputs ('" + spec->field +
                      "') need a model: a simulated engine's tokens are stand-ins");
        raw->sampler->constrain(structured_outputs_.start(*spec, std::move(compiled)));
      } catch (const Error& e) {
        finish(raw, "error", e.what(), false, 400);
        continue;
      }
    }
    // As structured outputs: token masks mean nothing to stand-in tokens, and an answer that
    // ignored them would look like one that honoured them.
    if (!executor_->info().samples) {
      const auto& s = raw->request.sampling;
      const char* masked = !s.allowed_token_ids.empty()     ? "allowed_token_ids"
                           : !s.bad_words_token_ids.empty() ? "bad_words"
                                                            : nullptr;
      if (masked) {
        finish(raw, "error",
               std::string("'") + masked + "' needs a model: a simulated engine's tokens are " +
                   "stand-ins",
               false, 400);
        continue;
      }
    }
    if (pd_ && pd_->admit(raw) == PdCoordinator::Admission::kRefused) continue;
    // A prompt to be scored is computed whole (Scheduler): its cached prefix is no less work. A
    // decode leg's is received (uncomputed_prompt()).
    raw->cached_on_arrival =
        raw->scoring_prompt() || raw->awaiting_kv()
            ? 0
            : kv_.find_cached_prefix(raw->tokens, raw->request.cache_salt).num_tokens;
    scheduler_.add(raw);
  }
  for (const auto& id : aborts) {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) {
      // A live id without a sequence is parked (finish()): a room's prefill leg whose answer
      // waits for its transfer lets the room go rather than hold its blocks for a client that
      // left.
      if (pd_) pd_->abort_parked(id);
    } else if (it->second->kv_state != KvTransferState::kFetchCancelled) {
      finish(it->second.get(), "abort");
    }
  }
  if (!incoming.empty() || !aborts.empty() || !tasks.empty()) update_gauges();
}

bool Engine::step() {
  SchedulerOutput out = scheduler_.schedule();
  metrics_->preemptions.inc(out.preempted.size());
  // Decode legs the scheduler gave blocks start receiving their KV.
  if (pd_) pd_->start_fetches(out.fetches);
  if (out.empty()) {
    // A step that only preempted (a lone sequence giving way to blocks held elsewhere, and what
    // waits does not fit either: the scheduler admitted what did) moved sequences back to
    // waiting, or one that only started fetches took blocks: the gauges say so, though nothing
    // ran.
    if (!out.preempted.empty() || !out.fetches.empty()) update_gauges();
    return false;
  }
  const double now = this->now();
  std::vector<ExecItem> items;
  items.reserve(out.scheduled.size());
  for (const auto& s : out.scheduled) {
    Sequence* seq = s.seq;
    if (!seq->admitted_once) {
      seq->admitted_once = true;
      seq->first_scheduled_time = now;
      metrics_->queue_time.observe(now - seq->queued_time);
    }
    ExecItem item;
    item.tokens = std::span<const int32_t>(seq->tokens)
                      .subspan(size_t(seq->num_computed), size_t(s.num_new_tokens - s.num_drafts));
    item.start = seq->num_computed;
    item.blocks = kv_.block_table(seq->request.id);
    item.sample = s.sample;
    item.sampler = seq->sampler.get();
    item.prompt = seq->prompt();
    item.generated = seq->generated();
    item.logprobs = seq->request.logprobs;
    if (seq->scoring_prompt()) {
      item.prompt_logprobs = seq->request.prompt_logprobs;
      item.prompt_logprobs_from = static_cast<int64_t>(seq->prompt_logprobs.size()) + 1;
    }
    item.drafts = std::span<const int32_t>(seq->drafts).first(size_t(s.num_drafts));
    item.draft_probs = seq->draft_probs;
    items.push_back(item);
  }
  // Prefills for a bootstrap room that complete their prompt in this step stream each layer to
  // the decode engine as soon as the forward pass has written it.
  const LayerHook on_layer = pd_ ? pd_->begin_step(out) : LayerHook{};
  int64_t step_tokens = 0;
  api::PrefillWork step_prefill;
  for (const auto& s : out.scheduled) {
    step_tokens += s.num_new_tokens;
    const int64_t done = s.seq->num_computed;
    if (done < s.seq->num_prompt)
      step_prefill += api::PrefillWork::of_prompt(
          done, done + std::min(s.num_new_tokens, s.seq->num_prompt - done));
  }
  {
    // What the gateway's expected-finish-time routing reads while this step runs.
    const api::PrefillWork queued = queued_prefill() - step_prefill;
    std::lock_guard lock(load_mutex_);
    ++load_.steps;  // this one, as it runs: /load's steps counts executed steps only
    load_.step_seqs = static_cast<int64_t>(out.scheduled.size());
    load_.step_tokens = step_tokens;
    load_.step_prefill_pairs = step_prefill.pairs;
    load_.prefill_tokens = std::max<int64_t>(queued.tokens, 0);
    load_.prefill_pairs = std::max<int64_t>(queued.pairs, 0);
    step_started_ = now;
  }
  ExecResult result;
  try {
    result = executor_->execute(items, on_layer);
    if (pd_) pd_->end_step(executor_->info().kv_layout.layers);
  } catch (const std::exception& e) {
    // A failed step fails the requests in it, not the engine.
    for (const auto& s : out.scheduled) finish(s.seq, "error", e.what());
    update_gauges();
    return true;
  }
  const double done = this->now();
  if (expert_load_) record_expert_load(result.expert_tokens);
  count_speculation(out, result.sampled);
  std::vector<SequenceUpdate> updates = scheduler_.update_from_output(out, result.sampled, done);
  const uint64_t index = recent_steps_.empty() ? 1 : recent_steps_.back().index + 1;
  recent_steps_.push_back({index, static_cast<int64_t>(out.scheduled.size()), step_tokens,
                           done - now, step_prefill.pairs});
  if (recent_steps_.size() > LoadReport::kRecentSteps) recent_steps_.erase(recent_steps_.begin());
  int64_t iteration_tokens = 0;
  bool any_output = false;
  for (SequenceUpdate& u : updates) {
    Sequence* seq = u.seq;
    RequestOutput& o = u.output;
    if (const std::string& why = seq->sampler->failure(); !why.empty()) {
      // Its format could not go on (its tokens this step are stand-ins): a 400 for it alone.
      finish(seq, "error", why, /*notified=*/false, 400);
      continue;
    }
    if (u.first_token) {
      metrics_->ttft.observe(done - seq->arrival_time);
      metrics_->prompt_tokens.inc(static_cast<uint64_t>(seq->num_prompt));
      iteration_tokens += seq->num_prompt;
    } else if (u.since_last_token_s >= 0) {
      // A step that yields several tokens (accepted drafts) spent its time on all of them.
      for (size_t k = 0; k < o.tokens.size(); ++k)
        metrics_->tpot.observe(u.since_last_token_s / double(o.tokens.size()));
      metrics_->itl.observe(u.since_last_token_s);
    }
    metrics_->generation_tokens.inc(o.tokens.size());
    iteration_tokens += static_cast<int64_t>(o.tokens.size());
    any_output = true;
    const std::string reason = o.finish_reason;
    if (o.finished && pd_ && pd_->defer_final_output(seq, o)) {
      finish(seq, reason, {}, /*notified=*/true);  // answered when its room's transfer ends
      continue;
    }
    if (!o.finished) {
      if (seq->request.on_output) seq->request.on_output(o);
      continue;
    }
    // Counted before it is answered (finish may drop the sequence, so its callback is kept).
    const auto on_output = seq->request.on_output;
    finish(seq, reason, {}, /*notified=*/true);
    if (on_output) on_output(o);
  }
  if (any_output) metrics_->iteration_tokens.observe(double(iteration_tokens));
  update_gauges();
  return true;
}

void Engine::count_speculation(const SchedulerOutput& out, std::span<const StepTokens> sampled) {
  for (size_t i = 0; i < out.scheduled.size(); ++i) {
    const int64_t drafts = out.scheduled[i].num_drafts;
    if (drafts == 0) continue;
    const auto accepted = static_cast<int64_t>(sampled[i].tokens.size()) - 1;
    metrics_->spec_drafts.inc();
    metrics_->spec_draft_tokens.inc(uint64_t(drafts));
    metrics_->spec_accepted_tokens.inc(uint64_t(accepted));
    for (int64_t k = 0; k < accepted; ++k)
      metrics_->spec_accepted_per_position.labels({std::to_string(k)}).inc();
  }
}

void Engine::finish(Sequence* seq, const std::string& reason, const std::string& error,
                    bool notified, int error_status, const std::string& error_code) {
  // Blocks a transfer still reads or writes stay until it reports back.
  const bool keep_blocks = pd_ && pd_->ending(seq, error.empty() ? reason : error);
  scheduler_.remove(seq, keep_blocks);
  // Counted before the answer is posted: a client that reads /metrics once answered sees it.
  // A prefill leg failed because its decode leg abandoned the room (its client left, most often)
  // is no failure of this engine's: counted as vLLM counts a request given up, while its answer
  // keeps the error that tells the gateway so.
  metrics_->success.labels({error_code == api::kRoomAbandonedCode ? "abort" : reason}).inc();
  metrics_->e2e.observe(now() - seq->arrival_time);
  // vLLM's intervals need a first scheduling and a first token: one without either (refused,
  // aborted while waiting) has none to observe.
  if (seq->first_scheduled_time >= 0 && seq->first_token_time >= 0) {
    metrics_->prefill_time.observe(seq->first_token_time - seq->first_scheduled_time);
    metrics_->decode_time.observe(seq->last_token_time - seq->first_token_time);
    metrics_->inference_time.observe(seq->last_token_time - seq->first_scheduled_time);
  }
  observe_finished(*seq);
  if (!notified && seq->request.on_output) {
    RequestOutput o;
    o.finished = true;
    o.finish_reason = reason;
    o.error = error;
    o.error_status = error_status;
    o.error_code = error_code;
    o.prompt_tokens = seq->num_prompt;
    o.completion_tokens = seq->num_generated();
    o.cached_tokens = seq->num_cached;
    seq->request.on_output(o);
  }
  if (pd_ && pd_->outlives_end(seq)) return;  // its fetch still runs: dropped when it ends
  if (seq->kv_state == KvTransferState::kParked) {
    // The cache keeps the parked blocks under this id, and the transfer frees them by it: a new
    // request with the same id would have them in its block table, and lose its own blocks
    // when the transfer ends. The id stays taken until then (release_id).
    const std::string key = seq->request.id;
    sequences_.erase(key);
    return;
  }
  drop(seq->request.id);
}

void Engine::observe_finished(const Sequence& seq) {
  const int64_t generated = seq.num_generated();
  metrics_->request_prompt_tokens.observe(double(seq.num_prompt));
  metrics_->request_generation_tokens.observe(double(generated));
  if (seq.request.sampling.max_tokens > 0)
    metrics_->max_tokens_param.observe(double(seq.request.sampling.max_tokens));
  // A prompt's choices count once, when the last finishes (alone: at once, n = 1).
  int64_t n = 1, most = generated;
  if (ChoiceGroup* group = seq.request.choices.get()) {
    group->max_generated = std::max(group->max_generated, generated);
    if (--group->unfinished > 0) return;
    n = group->n;
    most = group->max_generated;
  }
  metrics_->n_param.observe(double(n));
  metrics_->max_generation_tokens.observe(double(most));
}

Sequence* Engine::find_sequence(const std::string& id) {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : it->second.get();
}

void Engine::fail(Sequence* seq, const std::string& error, int status, const std::string& code) {
  finish(seq, "error", error, false, status, code);
}

void Engine::drop(const std::string& id) {
  const std::string key = id;  // `id` may be the sequence's own, gone with it
  sequences_.erase(key);
  release_id(key);
}

void Engine::release_id(const std::string& id) {
  std::vector<std::function<void()>> idle;
  {
    std::lock_guard lock(mutex_);
    live_ids_.erase(id);
    if (live_ids_.empty()) idle.swap(idle_callbacks_);
  }
  for (auto& callback : idle) callback();
}

void Engine::when_idle(std::function<void()> callback) {
  {
    std::lock_guard lock(mutex_);
    if (!live_ids_.empty()) {
      idle_callbacks_.push_back(std::move(callback));
      return;
    }
  }
  callback();
}

void Engine::publish_events() {
  auto events = kv_.take_events();
  if (events.empty()) return;
  if (config_.kv_event_sink)
    config_.kv_event_sink({unix_time(), std::move(events), {}});
  else if (publisher_)
    publisher_->publish({unix_time(), std::move(events), {}});
}

void Engine::record_expert_load(std::span<const int64_t> step) {
  expert_load_->record(step);
  ++expert_load_steps_;
  if (remapper_) remapper_->after_step(expert_load_steps_, *expert_load_);
  const bool dump = !config_.expert_load_dump.empty() &&
                    expert_load_steps_ % uint64_t(expert_load_->window_steps()) == 0;
  // The gauges every few steps: a snapshot copies [layers, experts] twice.
  if (!dump && expert_load_steps_ % kExpertGaugeSteps != 0 &&
      expert_load_steps_ > kExpertGaugeSteps)
    return;
  const ExpertLoadSnapshot s = expert_load_->snapshot();
  const std::vector<double> imbalance = s.window_imbalance();
  for (size_t i = 0; i < imbalance.size(); ++i) expert_imbalance_[i]->set(imbalance[i]);
  if (!dump) return;
  char name[64];
  std::snprintf(name, sizeof name, "expert_load_%08llu", static_cast<unsigned long long>(s.steps));
  try {
    s.write(config_.expert_load_dump / name);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "engine: expert load dump: %s\n", e.what());
  }
}

void Engine::change_expert_placement(const placement::Placement& next) {
  if (!remapper_)
    throw Error("this engine does not place experts (start it with --expert-parallel N)");
  remapper_->change(next);
}

std::optional<ExpertRemapStatus> Engine::expert_remap_status() const {
  if (!remapper_) return std::nullopt;
  return remapper_->status();
}

std::optional<ExpertLoadSnapshot> Engine::expert_load() const {
  if (!expert_load_) return std::nullopt;
  return expert_load_->snapshot();
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
  api::PrefillWork queued;
  for (const auto& [id, seq] : sequences_) {
    r.tokens_in_flight += static_cast<int64_t>(seq->tokens.size());
    queued += uncomputed_prompt(*seq);
  }
  r.prefill_tokens = queued.tokens;
  r.prefill_pairs = queued.pairs;
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
  if (pd_) metrics_->waiting_for_kv.set(static_cast<double>(pd_->waiting_for_kv()));
  metrics_->kv_usage.set(r.kv_usage);
  metrics_->gpu_usage.set(r.kv_usage);
  r.max_batch_tokens = scheduler_.config().max_num_batched_tokens;
  r.schedules_by_priority = scheduler_.config().priority;
  r.recent_steps = recent_steps_;
  std::lock_guard lock(load_mutex_);
  r.steps = load_.steps;  // counted by step(), not here: this also runs between steps
  load_ = std::move(r);
}

}  // namespace tandem::engine
