#pragma once
// The simulated executor: everything of the engine stays real (scheduler, KV blocks, prefix
// cache, events, API) except the forward pass, which is replaced by a latency model
// (engine/executor/sim_latency.h): a step sleeps for the time the modelled hardware would take
// and then emits deterministic tokens. Sleeping, not spinning, lets many simulated engines share
// a small machine.
//
// Tokens: the next token of a sequence is a fixed function of the seed, its position and the
// previous token, drawn from the tokenizer's ordinary (non-special) tokens, so the same prompt
// always continues the same way and a generation never ends early on EOS: requests end at
// max_tokens or a stop string/id. Logprobs are placeholders (0 for the sampled token, -1, -2, ...
// for the alternatives) since there is no model distribution.
//
// Multi-token prediction (SimMtpOptions) is an acceptance model: the executor proposes drafts,
// each of which is the token the sequence will continue with (with the draft position's
// acceptance probability, given the drafts before it were) or another one, decided from the seed.
// Verification accepts drafts up to the first wrong one, so answers are exactly those without
// speculation and only the tokens per step change.
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "engine/executor/executor.h"
#include "engine/executor/sim_expert_parallel.h"
#include "engine/executor/sim_latency.h"
#include "text/tokenizer.h"

namespace tandem::engine {

struct SimMtpOptions {
  int64_t drafts = 0;  // draft tokens per sampled sequence and step (0: no speculation)
  // Per draft position, the probability that the draft is right given that the ones before it
  // were; positions past the list repeat its last value. DeepSeek-V3's report: 0.85-0.9 for the
  // second token (the first draft).
  std::vector<double> acceptance = {0.85};
  // A step that drafts costs this share of its modelled time more per draft pass (the MTP module
  // is one more transformer layer next to DeepSeek-V3's 61).
  double draft_pass_share = 1.0 / 61;
};

struct SimExecutorOptions {
  std::string preset;  // a SimLatencyModel preset name, or a path to a fitted model JSON
  std::string model_name;
  int64_t block_size = 16;
  int64_t num_blocks = 0;     // 0: the preset's KV capacity
  int64_t max_model_len = 0;  // 0: the preset's
  uint64_t seed = 0;
  double time_scale = 1.0;  // multiplies every step's modelled time (0: do not sleep)
  // Bytes per token and layer that KV transfers move; 0: the preset model's real size. Smaller
  // values let many simulated engines share one machine's loopback (scheduling experiments).
  int64_t kv_token_bytes = 0;
  // Expert parallelism (ranks > 0): a step's MoE time follows the busiest rank's routes under
  // a placement; the executor then also reports its routes (GET /expert_load).
  SimExpertParallelOptions expert_parallel;
  SimMtpOptions mtp;
  // How a step's modelled time passes: empty, the step sleeps it; set, it is called with the
  // seconds instead (the cluster simulator advances its virtual clock by them).
  std::function<void(double seconds)> wait;
};

// An engine's KV with these options, as SimExecutor sizes it: its blocks and the bytes per token
// and layer, the options' or (at 0) those of the latency model's preset. Reads the latency model
// (a fitted one is a file); throws tandem::Error as the constructor does for an unknown one, a
// block size below 1 or negative bytes. For checking what many engines would take beforehand.
struct SimKvSize {
  int64_t num_blocks = 0, token_bytes = 0;
};
SimKvSize sim_kv_size(const SimExecutorOptions& options);

class SimExecutor : public Executor {
 public:
  SimExecutor(const text::Tokenizer& tokenizer, const SimExecutorOptions& options);
  const ExecutorInfo& info() const override { return info_; }
  ExecResult execute(std::span<const ExecItem> batch, const LayerHook& on_layer = {}) override;
  // No cache memory: reads see a fixed pattern, writes are dropped (transfers still move the
  // modelled model's number of bytes).
  const std::byte* kv_bytes(int32_t block, int64_t layer) const override;
  SharedView kv_shared_memory() const override { return pattern_.shared(); }
  void write_kv(int32_t block, int64_t layer, std::span<const std::byte> bytes) override;
  const SimLatencyModel& latency_model() const { return model_; }

 private:
  // The token the sequence continues with at `position` after `previous`, as an index into
  // ordinary_.
  size_t next_token(uint64_t position, int32_t previous) const;
  // Appends ordinary_[index] to `out`, with the placeholder logprobs when `logprobs` > 0.
  void emit(size_t index, int32_t logprobs, StepTokens& out) const;
  // Placeholder prompt logprobs for the positions `item` scores.
  void score_prompt(const ExecItem& item, StepTokens& out) const;
  // Drafts for the positions after `position` (where `last` is), per the acceptance model.
  void propose_drafts(uint64_t position, int32_t last, int64_t count, StepTokens& out) const;

  SimLatencyModel model_;
  ExecutorInfo info_;
  SimExecutorOptions options_;
  std::vector<int32_t> ordinary_;  // ids the simulated model emits
  // What kv_bytes() shows for every block and layer; shared, so that a decode engine on this
  // host copies it in place as it would a real cache.
  SharableBuffer pattern_;
  std::optional<SimExpertParallel> expert_parallel_;
};

}  // namespace tandem::engine
