#pragma once
// The serving engine: one thread that loops schedule -> execute -> stream outputs, fed by
// submit()/abort() from any thread (the HTTP server's). It owns the scheduler, the KV-cache
// manager (paged blocks, prefix cache, KV events) and the executor, and keeps the metrics and the
// load report up to date.
#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "api/load_report.h"
#include "api/prefill_work.h"
#include "api/request.h"
#include "engine/executor/executor.h"
#include "engine/expert_load.h"
#include "engine/expert_remap.h"
#include "engine/kv/kv_cache_manager.h"
#include "engine/kv/kv_events.h"
#include "engine/scheduler/scheduler.h"
#include "engine/scheduler/sequence.h"
#include "engine/transfer/kv_transfer.h"
#include "engine/transfer/pd_coordinator.h"
#include "structured/token_constraint.h"
#include "text/tokenizer.h"
#include "util/metrics.h"

namespace tandem::engine {

// The engine's part in prefill/decode disaggregation: both (a whole request), the prefill leg (the
// prompt, its KV handed to a decode engine) or the decode leg (the KV received, then the tokens).
enum class EngineRole { kBoth, kPrefill, kDecode };
// "both", "prefill" or "decode"; anything else throws tandem::Error naming the valid roles.
EngineRole parse_engine_role(std::string_view text);
const char* engine_role_name(EngineRole role);

struct EngineConfig {
  SchedulerConfig scheduler;
  // The operator's limits on a request's max_tokens (api::ModelLimits): the most it may ask
  // for, and what it gets when it asks for nothing (0: none; the API's defaults).
  int64_t max_tokens_limit = 0;
  int64_t default_max_tokens = 0;
  // --reasoning-parser: chat answers' reasoning read apart (api/reasoning.h).
  api::ReasoningFormat reasoning = api::ReasoningFormat::kNone;
  // The model's generation config (--generation-config): what requests that omit a sampling
  // field get.
  api::SamplingDefaults sampling_defaults;
  // The longest sequence (prompt plus output) a request may ask for; 0: the model's context.
  // Either way no longer than the KV cache holds (max_model_len() below).
  int64_t max_model_len = 0;
  bool enable_prefix_caching = true;
  std::string kv_events_config;  // vLLM's --kv-events-config JSON; empty: no events
  // KV transfer runs when `transfer` is set (with a server unless its port is -1).
  EngineRole role = EngineRole::kBoth;
  std::optional<KvTransferConfig> transfer;
  // Expert load statistics (executors that report routing): the sliding window in steps, and a
  // folder that receives a snapshot every window (expert_load_<steps>.npy/.json) and the
  // cumulative counts at stop (expert_load_cumulative.npy/.json); empty: no files.
  int64_t expert_load_window = 1024;
  std::filesystem::path expert_load_dump;
  // Executors that place experts: every this many steps, re-plan from the load window and switch
  // live when the plan moves anything (0: only on request).
  int64_t rebalance_interval = 0;
  // Seams for running the engine in virtual time (the cluster simulator, sim/): the monotonic
  // clock, in seconds, that every timestamp of the engine reads (empty: the steady clock), and
  // where KV event batches go instead of a ZMQ publisher (set: events are on, whatever
  // kv_events_config says).
  std::function<double()> clock;
  std::function<void(KvEventBatch)> kv_event_sink;
  // With `transfer`: what moves KV instead of a KvTransferAgent over TCP or shared memory (the
  // simulator's virtual links), made with the executor and the engine's Post.
  std::function<std::unique_ptr<KvTransfers>(Executor&, KvTransfers::Post)> make_transfers;
};

// A snapshot for the gateway's load-aware routing (JSON at /load).
using api::LoadReport;
using api::StepRecord;

class Engine final : private PdHost {
 public:
  Engine(const EngineConfig& config, std::unique_ptr<Executor> executor,
         std::shared_ptr<const text::Tokenizer> tokenizer, std::vector<int32_t> eos_ids,
         metrics::Registry& registry);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  void start();
  void stop();  // aborts what is still queued or running (callbacks get "abort")
  // Virtual time, instead of start() (the cluster simulator): takes what was submitted, aborted
  // or posted, and runs one step when a sequence can make progress. Returns whether a step ran;
  // its outputs have then been handed to their callbacks. Never blocks.
  bool run_once();
  // Whether run_once() has anything to do (a submission, abort or task, or a sequence in the
  // scheduler that is not receiving its KV: a decode leg waiting for blocks counts).
  bool has_work() const;
  // Engine thread. After a pass that scheduled nothing, when the loop runs again without an
  // event (a submission, an abort, a posted task: outside a step only these free blocks): when
  // the first decode leg's wait for blocks runs out (the engine's clock); +infinity when none
  // waits for blocks.
  double wakes_by_itself_at() const;

  // Thread-safe. What can be checked up front about a request alone (ids in the vocabulary,
  // prompt plus max_tokens within the model's length and the KV cache, a KV transfer this engine
  // can serve): throws tandem::Error with a client-facing message when it cannot be served. For
  // an HTTP answer that must still be able to say 400 (before a stream starts).
  void check(const EngineRequest& request) const;
  // Thread-safe. check(), then queues the request (throws too when the engine is stopping or the
  // id is live). Its outputs arrive through request.on_output on the engine thread. Request ids
  // must be unique among live requests; a finished P/D request whose blocks are parked for a
  // transfer (a pull, a room) stays live until the transfer lets go of them.
  void submit(EngineRequest request);
  // Thread-safe. Finishes the request with "abort" and frees its blocks; unknown ids are ignored.
  void abort(const std::string& id);
  // Thread-safe. Runs `callback` once no request is live (submit's sense: a finished P/D
  // request whose blocks wait for a pull or a room still is): at once, on this thread, when none
  // is; else on the thread that lets the last one go (the engine thread). For a drain, which
  // lets a prefill's held KV be taken before the engine stops.
  void when_idle(std::function<void()> callback);

  LoadReport load() const;
  // `snapshot` (a report taken earlier in this step) plus the prompts submitted since, which the
  // engine has not admitted yet: what load() adds to the step's own snapshot. Thread-safe.
  LoadReport with_incoming(LoadReport snapshot) const;
  // Thread-safe. Tokens routed per (MoE layer, expert); nullopt when the executor reports none.
  std::optional<ExpertLoadSnapshot> expert_load() const;
  // Thread-safe. A new expert placement, switched in live once its copies are loaded (throws
  // tandem::Error naming what does not fit, or when the executor places no experts).
  void change_expert_placement(const placement::Placement& next);
  // Where experts live and the state of live changes; nullopt when the executor places none.
  std::optional<placement::Placement> expert_placement() const {
    return executor_->expert_placement();
  }
  std::optional<ExpertRemapStatus> expert_remap_status() const;
  std::vector<RankWork> rank_work() const { return executor_->rank_work(); }
  const ExecutorInfo& executor_info() const { return executor_->info(); }
  // What a request is validated against: the model's and the operator's limits.
  api::ModelLimits request_limits() const {
    const ExecutorInfo& info = executor_->info();
    return {info.model_name,
            max_model_len_,
            info.vocab_size,
            config_.max_tokens_limit,
            config_.default_max_tokens,
            config_.reasoning,
            config_.sampling_defaults};
  }
  // The longest sequence a request may ask for: the model's context, the operator's
  // --max-model-len and the KV cache's size, whichever is least. A request that cannot fit the
  // whole cache alone would be preempted forever; and a chat request without max_tokens, whose
  // default is what is left of this length, would be refused for a cache smaller than the
  // model's context (the 163,840 tokens of DeepSeek-V3 are ~11 GiB of BF16 latents).
  int64_t max_model_len() const { return max_model_len_; }
  // Thread-safe. Why the executor can no longer run steps (empty while it can).
  std::string executor_failure() const { return executor_->failure(); }
  const text::Tokenizer& tokenizer() const { return *tokenizer_; }
  EngineRole role() const { return config_.role; }
  // Whether waiting prompts are ordered by the requests' `priority` (--scheduling-policy).
  bool schedules_by_priority() const { return scheduler_.config().priority; }
  // Thread-safe. Tells a prefill engine to free a transfer this engine will not pull (its
  // decode leg was refused); best effort, in the background. No-op without KV transfer.
  void release_remote_kv(const std::string& host, uint16_t port, const std::string& engine_id,
                         const std::string& transfer_id, std::vector<int32_t> blocks);
  // Thread-safe. Tells a prefill engine that the decode leg of `room`, for `prompt`, will not
  // join it (it was refused), so that the room's prefill leg fails now or is refused when it
  // comes; best effort, in the background. No-op without KV transfer.
  void abandon_remote_room(const std::string& host, uint16_t port, uint64_t room,
                           std::span<const int32_t> prompt, const std::string& reason);
  // Thread-safe. Frees a transfer this engine holds for a decode engine's pull whose request
  // ended before any decode engine took it (KvTransfers::release_held): false when none is held
  // by that id, a decode engine is pulling it, or the engine has no KV transfer.
  bool release_held_kv(const std::string& transfer_id) {
    return agent_ && agent_->release_held(transfer_id);
  }
  // KV transfer (null when not configured): engine id, advertised host and port.
  const KvTransfers* transfer() const { return agent_.get(); }
  // Where KV events go, when enabled (the bound endpoints, for tests and logs).
  std::string kv_events_endpoint() const;
  std::string kv_events_replay_endpoint() const;

 private:
  struct Metrics;
  void loop();
  void admit_incoming();
  bool step();  // false when nothing could be scheduled
  double now() const;
  void finish(Sequence* seq, const std::string& reason, const std::string& error = {},
              bool notified = false, int error_status = 500, const std::string& error_code = {});
  // The per-request histograms of a sequence that finished (finish()).
  void observe_finished(const Sequence& seq);
  void publish_events();
  void update_gauges();
  void record_expert_load(std::span<const int64_t> step);
  void count_speculation(const SchedulerOutput& out, std::span<const StepTokens> sampled);
  // Posted by KV transfer threads, run on the engine thread.
  void post(std::function<void()> task);
  // PdHost: what the P/D coordinator does to sequences (engine thread).
  Sequence* find_sequence(const std::string& id) override;
  void fail(Sequence* seq, const std::string& error, int status, const std::string& code) override;
  void drop(const std::string& id) override;
  void release_id(const std::string& id) override;

  EngineConfig config_;
  std::unique_ptr<Executor> executor_;
  std::shared_ptr<const text::Tokenizer> tokenizer_;
  std::vector<int32_t> eos_ids_;
  structured::StructuredOutputs structured_outputs_;  // grammars and masks, shared by requests
  std::optional<KvEventsConfig> events_config_;       // parsed --kv-events-config, if any
  KvCacheManager kv_;
  Scheduler scheduler_;
  std::unique_ptr<ZmqKvEventPublisher> publisher_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<ExpertLoadStats> expert_load_;
  std::vector<metrics::Gauge*> expert_imbalance_;  // per MoE layer
  std::unique_ptr<ExpertRemapper> remapper_;       // executors that place experts
  uint64_t expert_load_steps_ = 0;                 // engine thread
  static constexpr uint64_t kExpertGaugeSteps = 8;

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<EngineRequest> incoming_;
  std::vector<std::string> aborts_;
  std::vector<std::function<void()>> tasks_;  // posted by KV transfer threads
  // Submitted and not finished, or finished with blocks parked under the id (under mutex_).
  std::unordered_set<std::string> live_ids_;
  std::atomic<int64_t> incoming_prompt_tokens_{0};  // prompt tokens in incoming_ (under mutex_)
  std::atomic<int64_t> incoming_prompt_pairs_{0};   // their attention pairs, as if uncached
  // when_idle's callbacks, until live_ids_ empties (under mutex_).
  std::vector<std::function<void()>> idle_callbacks_;
  bool stopping_ = false;
  std::thread thread_;

  // Engine-thread state.
  std::unordered_map<std::string, std::unique_ptr<Sequence>> sequences_;
  uint64_t arrival_counter_ = 0;
  uint64_t seed_base_;
  int64_t max_model_len_ = 0;
  std::string max_model_len_source_;  // why it is what it is, for the errors that cite it
  int64_t reported_queries_ = 0, reported_hits_ = 0;  // prefix-cache stats already in metrics

  std::unique_ptr<KvTransfers> agent_;  // stop() ends it before the members it posts into
  std::unique_ptr<PdCoordinator> pd_;   // with agent_: every P/D state of every sequence

  // Load snapshot, written by the engine thread before and after each step.
  mutable std::mutex load_mutex_;
  // Pairs are counted from the start (a report's -1 would mean "not reported").
  LoadReport load_ = [] {
    LoadReport r;
    r.prefill_pairs = r.step_prefill_pairs = 0;
    return r;
  }();
  double step_started_ = 0;                 // now_seconds() when the running step began
  std::vector<StepRecord> recent_steps_;    // engine thread; copied into load_
  api::PrefillWork queued_prefill() const;  // engine thread: prompt work not yet computed
};

}  // namespace tandem::engine
