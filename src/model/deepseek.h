#pragma once
// The forward pass of DeepSeek-V2/V3-family models on CPU: embedding, MLA attention over the
// paged latent cache, dense and MoE feed-forward layers, final norm, LM head, and the MTP module.
//
// One step takes a batch in which every sequence contributes any number of new tokens (a prefill
// chunk, one decode token, or a token plus speculative drafts) and returns logits for the
// positions asked for. Attention uses the absorbed form (MQA over the cached latents) for short
// steps and the expanded form (MHA with keys and values rebuilt from the latents) for long ones;
// both read the cache through the sequence's block table.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "kernels/cpu/mla_attention.h"
#include "model/config.h"
#include "model/expert_exchange.h"
#include "model/latent_cache.h"
#include "model/rope.h"
#include "model/step.h"
#include "model/step_profile.h"
#include "model/weights.h"
#include "util/uninitialized_vector.h"

namespace tandem::model {

// The cache a model of config `c` has, before its weights are loaded (cache_shape() below).
LatentCacheShape deepseek_cache_shape(const ModelConfig& c, int64_t block_size, LatentType type);

class DeepSeekModel {
 public:
  DeepSeekModel(ModelConfig config, Weights weights);
  // DIR's config and weights. A checkpoint without any of the MTP layers its config names loads
  // without MTP (config().num_nextn_predict_layers 0; drop_absent_mtp_layers), warning once on
  // stderr; so does any checkpoint with `options.mtp` false, without the warning.
  static DeepSeekModel load(const std::filesystem::path& dir,
                            const std::function<void(size_t, size_t)>& progress = {},
                            const WeightLoadOptions& options = {});

  // Why DIR has no MTP module to draft with ("" when it has one), from its config and tensor
  // names alone: checked before a load that needs it.
  static std::string missing_mtp(const std::filesystem::path& dir);

  const ModelConfig& config() const { return config_; }
  const Weights& weights() const { return weights_; }
  // Layers of the cache: the main layers, then one per MTP module. Values are of `type`, by
  // default default_cache_type().
  LatentCacheShape cache_shape(int64_t block_size, std::optional<LatentType> type = {}) const;
  // float32 for float32 checkpoints, BF16 for the others (BF16, INT8, FP8).
  LatentType default_cache_type() const;

  // `after_layer(n)`, when given, runs once layers [0, n) of every step are in the cache. With an
  // `exchange` (expert parallelism), MoE layers run their routed experts through it; the model's
  // own routed experts may then be absent (WeightLoadOptions::routed_experts).
  StepOutput forward(std::span<const SequenceStep> batch, LatentCache& cache,
                     const std::function<void(int64_t)>& after_layer = {},
                     ExpertExchange* exchange = nullptr) const;
  // One routed expert on m gathered rows [m, hidden] of normalised inputs: out [m, hidden]. The
  // same arithmetic as the expert's part of a single-process MoE layer on the same rows.
  void expert_forward(const MlpWeights& expert, const float* rows, int64_t m, float* out) const;

  // MTP module `k`: step i of a sequence predicts the token after next. `tokens` of each step
  // are the next tokens (t[i+1]) of positions start..; `hidden` holds the main model's hidden
  // states for those positions, rows in batch order, as forward() returned them.
  StepOutput forward_mtp(std::span<const SequenceStep> batch, const float* hidden,
                         LatentCache& cache, int64_t k = 0) const;

  // Tokens routed to each logical expert, per layer (MoE layers only have non-zero counts).
  const std::vector<std::vector<uint64_t>>& expert_counts() const { return expert_counts_; }

  // Short steps (decode, drafts) use the absorbed attention form; longer ones expand K/V.
  static constexpr int64_t kAbsorbedMaxTokens = 4;
  // How the absorbed-form kernel rescales its running sums (kernels/cpu/mla_attention.h).
  void set_mla_rescale(kernels::MlaRescale r) { mla_rescale_ = r; }
  // Adds every later step's time per part to `profile` (null: off). For benchmarks: the model
  // must then not run steps from several threads at once.
  void set_profile(StepProfile* profile) { profile_ = profile; }

 private:
  struct TokenInfo {
    int64_t sequence, position;
  };
  void layer_forward(const LayerWeights& w, int64_t cache_layer,
                     std::span<const SequenceStep> batch, const std::vector<TokenInfo>& tokens,
                     std::vector<float>& x, LatentCache& cache, std::vector<float>& margins,
                     ExpertExchange* exchange) const;
  void attention(const AttentionWeights& w, int64_t cache_layer,
                 std::span<const SequenceStep> batch, const std::vector<TokenInfo>& tokens,
                 const std::vector<float>& xn, std::vector<float>& out, LatentCache& cache) const;
  void moe(const MoeWeights& w, int64_t layer, const std::vector<float>& xn, int64_t n,
           std::vector<float>& out, std::vector<float>& margins, ExpertExchange* exchange) const;
  // `xb`, when not null, holds xn rounded to BF16 (used where the products run in BF16).
  void mlp(const MlpWeights& w, const float* xn, const uint16_t* xb, int64_t n, float* out) const;
  StepOutput finish(std::span<const SequenceStep> batch, std::vector<float> x,
                    std::vector<float> margins, const std::vector<float>& norm,
                    const Matrix& head) const;

  ModelConfig config_;
  Weights weights_;
  Rope rope_;
  mutable std::vector<std::vector<uint64_t>> expert_counts_;
  kernels::MlaRescale mla_rescale_ = kernels::MlaRescale::kMultiply;
  StepProfile* profile_ = nullptr;
};

}  // namespace tandem::model
