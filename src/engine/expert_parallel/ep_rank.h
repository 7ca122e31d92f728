#pragma once
// One rank of an expert-parallel engine: the model's attention, dense and shared-expert weights,
// the routed experts of the physical slots the placement in force gives it, and its part of every
// step. The front runs rank 0 inside the engine process; ranks 1..N-1 are `tandem ep-rank`
// processes (rank_process.h). All of them map the same segment (ep_segment.h).
//
// Attention is data-parallel: the front gives each rank a contiguous run of the step's sequences
// (about equal new tokens), so rank order is batch order. At every MoE layer each rank routes its
// own tokens and the exchange below runs them through the experts wherever they live:
//   dispatch  - the rank writes its tokens' normalised rows once and one entry per (token, expert);
//               barrier
//   experts   - every rank derives from all ranks' entries the copy each entry runs on (an even
//               share of each expert's tokens per copy, slots_for_entries); each gathers, per
//               expert it holds, the rows sent to its copies (in rank order, hence in batch
//               order, as the single process gathers them), runs the expert
//               and writes the results into its own area, telling each sender where;  barrier
//   combine   - each rank sums its tokens' results in ascending expert order.
// Ranks without tokens in a step still take part in every exchange.
//
// What a network transport would need to replace the segment: every rank's tokens per expert
// (all-gather, for slots_for_entries' split), the dispatch entries and rows sent to the rank
// owning each slot (all-to-all), the results sent back (all-to-all), a barrier per
// phase (or per-peer completion counters), a per-rank KV cache with sticky sequence ownership
// (here every rank maps one cache, so a step may give a sequence to any rank), and the step's
// command broadcast from the front.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "engine/executor/executor.h"
#include "engine/expert_parallel/ep_segment.h"
#include "model/deepseek.h"

namespace tandem::engine::ep {

// The physical slot each dispatch entry of one MoE layer's step runs on, per sending rank.
// `experts_sent[q]` holds rank q's entries' logical experts in entry order; `copies` maps a
// logical expert to its slots (two slots on one rank count twice). An expert's t entries, in rank
// order then entry order, are cut into as many contiguous runs as it has copies, of floor(t/c) or
// ceil(t/c) entries, on consecutive copies: every copy gets an equal share of the expert's tokens
// whichever ranks sent them, as the planner (placement::evaluate) and the simulated executor
// assume. `dispatched` (per logical expert, the layer's tokens dispatched since the placement was
// installed; advanced here) picks the copy the first run starts on, so that over steps the shares
// stay within one token even when a step brings an expert a single token (one decode). Every rank
// calls this for every step with the same entries, so every rank's `dispatched` and answer are
// the same. A rank's own copy is not preferred: in the shared segment a row costs the same copy
// whichever rank reads it.
std::vector<std::vector<int32_t>> slots_for_entries(
    std::span<const std::vector<int32_t>> experts_sent,
    const std::vector<std::vector<int32_t>>& copies, std::vector<int64_t>& dispatched);

class EpRank final : public model::ExpertExchange {
 public:
  EpRank(const EpSegment& segment, int rank, std::shared_ptr<const model::DeepSeekModel> model);

  // Loads the routed experts of this rank's slots in the placement table in force.
  void load_placement();
  // Loads the experts placement table `table` gives this rank that it does not hold yet, beside
  // the ones in use (may run on another thread while steps run; not beside switch_placement).
  void prepare_placement(uint32_t table);
  // Installs table `table`: keeps the experts this rank holds in both, takes the prepared ones,
  // frees the rest. Between steps.
  void switch_placement(uint32_t table);
  // switch_placement, then the barrier every rank's switch ends with.
  void switch_placement_with_all(uint32_t table);
  // Called while waiting at a barrier, with the barrier's generation that the wait is for (see
  // SharedBarrier); throws to abandon the step.
  void set_poll(std::function<void(uint32_t waiting_at)> poll) { poll_ = std::move(poll); }
  // This rank's part of the step the front posted: its sequences' forward pass, their sampled
  // rows' logits and the step's routes into the segment, then the end-of-step barrier. Rank 0
  // hears through `on_layer` when layers [0, n) of every rank's sequences are in the cache.
  void run_step(const LayerHook& on_layer = {});

  void routed_experts(int64_t layer, const float* xn, int64_t n,
                      std::span<const model::Routing> routes, float* out) override;

  const model::LatentCache& cache() const { return cache_; }
  model::LatentCache& cache() { return cache_; }

 private:
  struct LayerSlots {
    std::vector<int32_t> slot_rank;            // every slot of the layer -> its rank
    std::vector<std::vector<int32_t>> copies;  // logical expert -> its slots
    // Logical expert -> its tokens dispatched (by all ranks) since this placement was installed.
    std::vector<int64_t> dispatched;
    // slot -> index in `weights`, -1 elsewhere; every copy of an expert on this rank has one.
    std::vector<int32_t> local;
    std::vector<int32_t> held;               // the first slot of each expert on this rank
    std::vector<int32_t> held_expert;        // their logical experts, each once
    std::vector<model::MlpWeights> weights;  // their weights
  };
  void barrier();

  EpSegment segment_;
  int rank_;
  std::shared_ptr<const model::DeepSeekModel> model_;
  model::LatentCache cache_;
  std::vector<int64_t> moe_index_;  // model layer -> MoE layer index, -1 for dense layers
  std::vector<int64_t> moe_layers_;
  std::vector<LayerSlots> layers_;
  // Per MoE layer, experts loaded for the next placement: (logical expert, weights).
  std::vector<std::vector<std::pair<int32_t, model::MlpWeights>>> prepared_;
  std::vector<uint64_t> seen_;  // the model's route counts after the previous step
  std::function<void(uint32_t waiting_at)> poll_;
  const LayerHook* on_layer_ = nullptr;
  int64_t layers_reported_ = 0;
  RankWork work_;
};

}  // namespace tandem::engine::ep
