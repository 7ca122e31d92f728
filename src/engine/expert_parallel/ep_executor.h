#pragma once
// The executor of `tandem engine --expert-parallel N`: one engine backed by N ranks on this host.
// Rank 0 runs inside the engine process; ranks 1..N-1 are `tandem ep-rank` child processes that
// map the engine's one shared segment (ep_segment.h). The scheduler, KV cache manager, KV events,
// KV transfer and API see an ordinary executor: the latent cache lives in the segment, so KV
// transfer reads and writes it as it does a single process's.
//
// Failure: when a rank dies (or a step fails on any rank) the executor aborts every wait, kills
// the other ranks and fails this and every later step with the reason, which failure() reports
// (the engine's /health then answers 503). So does a rank that is alive but stalled: one that
// has not reached an exchange the front has waited at for `stall_timeout`. The segment is a memfd:
// nothing outlives the processes, however they end; ranks die with the engine process
// (PR_SET_PDEATHSIG).
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/executor/cpu_executor.h"
#include "engine/expert_parallel/ep_rank.h"
#include "engine/expert_parallel/stall_watch.h"
#include "placement/placement.h"
#include "text/tokenizer.h"
#include "util/child_process.h"
#include "util/shared_memory.h"

namespace tandem::engine::ep {

struct EpExecutorOptions {
  int ranks = 2;
  std::filesystem::path model_dir;
  std::string model_name;
  kernels::MlaRescale mla_rescale = kernels::MlaRescale::kMultiply;
  CpuExecutorOptions cache;   // block size, budget or block count, cache type
  int64_t max_tokens = 2048;  // new tokens per step (the scheduler's budget)
  int64_t max_items = 64;     // sequences per step
  // Where the experts live; default: every expert once, rank r holding [r*E/N, (r+1)*E/N).
  std::optional<placement::Placement> placement;
  // Where `placement` came from (e.g. "--expert-placement plan.json"), to name in its errors.
  std::string placement_source;
  // Physical slots per layer the segment has room for, at least (segment_slots).
  int64_t max_slots = 0;
  // The `tandem` binary that runs `ep-rank` (default: this process's own executable).
  std::filesystem::path rank_program;
  int threads_per_rank = 0;  // 0: this machine's cores / ranks, at least 1
  // How long the front waits at one exchange for a rank that is alive but does not get there
  // before the engine fails (stall_watch.h). One exchange is one MoE layer of one step.
  std::chrono::milliseconds stall_timeout{300'000};
};

// Physical slots per layer the shared placement tables have room for, what a live remap may
// place at most: one copy of every expert on every rank, or the start placement's or
// `max_slots`' more (a placement holding an expert twice on one rank may have more).
int64_t segment_slots(const placement::Placement& start, int64_t experts, int ranks,
                      int64_t max_slots);

class EpExecutor final : public Executor {
 public:
  EpExecutor(const EpExecutorOptions& options, const text::Tokenizer& tokenizer);
  ~EpExecutor() override;  // asks the ranks to exit and waits for them

  const ExecutorInfo& info() const override { return info_; }
  ExecResult execute(std::span<const ExecItem> batch, const LayerHook& on_layer = {}) override;
  const std::byte* kv_bytes(int32_t block, int64_t layer) const override;
  void write_kv(int32_t block, int64_t layer, std::span<const std::byte> bytes) override;
  std::byte* kv_bytes_mutable(int32_t block, int64_t layer) override;
  SharedView kv_shared_memory() const override { return memory_.view(); }
  std::string failure() const override;
  std::optional<placement::Placement> expert_placement() const override;
  void stage_expert_placement(const placement::Placement& next,
                              std::function<void()> loaded) override;
  PlacementSwitch switch_expert_placement() override;
  std::vector<RankWork> rank_work() const override;
  void stop_background() override;

  int ranks() const { return int(children_.size()) + 1; }

 private:
  // Throws (after failing the executor) when a rank has died or stalled, or the segment says
  // abort. Called by rank 0 while it waits at barrier generation `waiting_at` (on the engine's
  // thread).
  void poll(uint32_t waiting_at);
  std::string stalled_ranks(uint32_t waiting_at);  // empty while none has stalled
  void fail(const std::string& why);
  void abort_waits() const;  // every rank's waits give up
  void post(Command command);
  // Posts `command` to ranks 1..N-1 and runs rank 0's part of it here; a failure anywhere fails
  // the executor.
  void collective(Command command, const std::function<void()>& rank0_part);
  void check_batch(std::span<const ExecItem> batch) const;

  std::shared_ptr<const model::DeepSeekModel> model_;
  SharedSegment memory_;
  std::optional<EpSegment> segment_;
  std::unique_ptr<EpRank> rank0_;
  ExecutorInfo info_;
  std::vector<int32_t> no_text_;
  int threads_ = 1;   // OpenMP threads of every rank, rank 0 included
  StallWatch stall_;  // the engine's thread only (poll)
  // children_ and failure_: health checks (other threads) reap ranks that died between steps.
  mutable std::mutex mutex_;
  mutable std::vector<std::unique_ptr<ChildProcess>> children_;
  mutable std::string failure_;
  std::vector<RankWork> rank_work_;  // under mutex_, copied from the segment after each step

  // A live placement change: staged (new copies loading in the background) -> loaded -> switched.
  enum class Remap { kNone, kLoading, kLoaded };
  mutable std::mutex remap_mutex_;  // the tables and these
  Remap remap_ = Remap::kNone;
  PlacementSwitch staged_;
  std::thread loader_;
  std::atomic<bool> stopping_{false};
};

}  // namespace tandem::engine::ep
