#pragma once
// The executor runs one engine step: a batch in which every sequence contributes some new tokens
// (a prefill chunk, one decode token, later speculative drafts) at positions it names, reading
// and writing the paged latent cache through its block table; for the sequences whose step ends
// at their last known token it samples the next one. Two implementations: the CPU model and a
// simulated executor (a latency model and deterministic tokens) that lets one small machine
// stand in for a cluster of large GPUs. The scheduler, cache, events and API are the same for both.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine/sampler.h"
#include "engine/scheduler/sequence.h"
#include "placement/placement.h"
#include "util/shared_memory.h"

namespace tandem::engine {

struct ExecItem {
  std::span<const int32_t> tokens;  // the new tokens
  int64_t start = 0;                // position of tokens[0]
  std::span<const int32_t> blocks;  // block table covering start + tokens.size() positions
  bool sample = false;              // sample a token after the last new one
  // For sampling: the sequence's sampler and history (penalties look at both).
  Sampler* sampler = nullptr;
  std::span<const int32_t> prompt, generated;
  int32_t logprobs = -1;  // -1: none, else also return the k most likely tokens
  // Speculative decoding: draft tokens that follow `tokens` (which end at the sequence's last
  // known token), verified in this step; only with sample = true. `draft_probs` holds the
  // distribution each was drawn from, [drafts, vocab] (empty for greedy requests).
  std::span<const int32_t> drafts;
  std::span<const float> draft_probs;
  // Prompt logprobs (-1: none; k >= 0: each scored prompt token's logprob, rank and the k most
  // likely tokens): every prompt position p in (start, start + tokens.size()] with p >=
  // prompt_logprobs_from is scored from the logits of the token before it. Only without drafts.
  int32_t prompt_logprobs = -1;
  int64_t prompt_logprobs_from = 1;
  // The prompt positions the item scores in this step: [first, second); empty when none.
  std::pair<int64_t, int64_t> scored_prompt() const {
    if (prompt_logprobs < 0) return {0, 0};
    const int64_t first = std::max<int64_t>(start + 1, prompt_logprobs_from);
    const int64_t end = std::min<int64_t>(start + static_cast<int64_t>(tokens.size()) + 1,
                                          static_cast<int64_t>(prompt.size()));
    return {first, std::max(first, end)};
  }
};

// What one item yields in a step.
struct StepTokens {
  // The accepted drafts, then one sampled token (the first rejected draft's replacement, or the
  // token after the last accepted one); each with its logprobs when the item asked for them.
  std::vector<TokenLogprob> tokens;
  // Executors that speculate: drafts for the next step, after tokens.back(), and their
  // distributions [drafts, vocab] (empty for greedy requests).
  std::vector<int32_t> drafts;
  std::vector<float> draft_probs;
  // Items with prompt_logprobs: the prompt positions scored in this step, from `prompt_at` on.
  std::vector<TokenLogprob> prompt;
  int64_t prompt_at = 0;
};

struct ExecResult {
  // Per item, in batch order: what it sampled (when sample = true) and scored.
  std::vector<StepTokens> sampled;
  // Tokens routed to each (MoE layer, logical expert) in this step, [moe layers, experts]
  // row-major; empty when the executor has no expert routing to report.
  std::vector<int64_t> expert_tokens;
};

// How an executor's KV cache looks to KV transfer: `layers` layers of `token_bytes` bytes per
// token, `block_size` tokens per block. Two engines exchange KV only when all four agree.
struct KvLayout {
  std::string model;  // identifies the architecture and sizes (not the served name)
  int64_t layers = 0;
  int64_t block_size = 0;
  int64_t token_bytes = 0;
};

// Called from inside execute() with n when layers [0, n) of every sequence in the batch are in
// the cache (KV transfer streams them while later layers still compute).
using LayerHook = std::function<void(int64_t layers_done)>;

// What a live change of expert placement did.
struct PlacementSwitch {
  int64_t moves = 0;         // experts loaded onto ranks that did not hold them
  double load_seconds = 0;   // from staging until every rank held its new copies (background)
  double pause_seconds = 0;  // what the switch itself added between two steps
};

// One expert-parallel rank's work since start: routed rows its experts computed, and the time its
// MoE layers spent in the exchange's copies, waiting at its barriers and in its experts.
struct RankWork {
  int64_t expert_rows = 0;
  int64_t moe_layers = 0;      // MoE layers it went through (all steps)
  int64_t exchange_bytes = 0;  // rows it dispatched plus results it gathered
  double copy_seconds = 0, wait_seconds = 0, expert_seconds = 0;
};

struct ExecutorInfo {
  std::string model_name;
  int64_t vocab_size = 0;
  int64_t max_model_len = 0;
  int64_t num_blocks = 0;  // KV blocks the executor's cache holds
  int64_t block_size = 0;
  KvLayout kv_layout;
  // The model layer index of each MoE layer whose routing execute() reports, and the routed
  // experts per layer (both empty/0 when it reports none).
  std::vector<int64_t> moe_layers;
  int64_t routed_experts = 0;
  // Draft tokens it proposes per sampled item (speculative decoding with the model's MTP
  // module); 0: none. Items then need blocks for speculative_lookahead() positions past their
  // new tokens and drafts.
  int64_t speculative_tokens = 0;
  int64_t speculative_lookahead() const { return std::max<int64_t>(speculative_tokens - 1, 0); }
  // Whether tokens come from the model's logits through each item's sampler; the simulator's
  // stand-in tokens do not (so it cannot honour structured outputs).
  bool samples = true;
  // Whether execute() honours ExecItem::prompt_logprobs.
  bool scores_prompts = true;
};

class Executor {
 public:
  virtual ~Executor() = default;
  virtual const ExecutorInfo& info() const = 0;
  virtual ExecResult execute(std::span<const ExecItem> batch, const LayerHook& on_layer = {}) = 0;
  // KV transfer's access to the cache: the block_size * token_bytes bytes of one block and
  // layer. Other threads call these for blocks the engine holds for them (no step touches those).
  virtual const std::byte* kv_bytes(int32_t block, int64_t layer) const = 0;
  // Stores the first bytes of one block and layer (a whole number of tokens).
  virtual void write_kv(int32_t block, int64_t layer, std::span<const std::byte> bytes) = 0;
  // Where write_kv would store them, for receiving in place; nullptr when the executor has no
  // such memory (then KV transfer receives into a buffer and calls write_kv).
  virtual std::byte* kv_bytes_mutable(int32_t, int64_t) { return nullptr; }
  // The shared-memory segment kv_bytes() points into, if the cache lives in one: a decode engine
  // on this host may then read a prompt's KV straight from it (KvTransport::listen). Empty: none.
  virtual SharedView kv_shared_memory() const { return {}; }
  // Empty while the executor can run steps; else why it cannot (a rank process died). Thread-safe;
  // the engine then reports unhealthy.
  virtual std::string failure() const { return {}; }

  // Expert placement, for executors that run experts on several ranks (nullopt: not one).
  // Thread-safe.
  virtual std::optional<placement::Placement> expert_placement() const { return std::nullopt; }
  // Checks `next` against the executor (throws tandem::Error naming what does not fit; the
  // current placement stays) and starts loading its new expert copies in the background;
  // `loaded` runs (on another thread) once every rank holds them. Any thread; one change at a
  // time (throws while one is underway).
  virtual void stage_expert_placement(const placement::Placement& next,
                                      std::function<void()> loaded);
  // Engine thread, between steps, after `loaded`: every rank switches to the staged placement
  // and frees the copies it no longer holds.
  virtual PlacementSwitch switch_expert_placement();
  // Ends background work (a placement loading) and waits for it: no callback runs after this.
  // The engine calls it when it stops, before its own members go.
  virtual void stop_background() {}
  // Thread-safe. Per rank, as of the last step; empty for executors without ranks.
  virtual std::vector<RankWork> rank_work() const { return {}; }
};

}  // namespace tandem::engine
