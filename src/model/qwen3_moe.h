#pragma once
// The forward pass of Qwen3-MoE models on CPU (Qwen3MoeForCausalLM): embedding; grouped-query
// attention with RMSNorm on each query and key head before RoPE (rotate-half convention, YaRN
// when configured) over a paged K/V cache; feed-forward layers that are routed experts (softmax
// over all experts, top-k, renormalised when norm_topk_prob; no shared expert) or a dense SwiGLU
// MLP (mlp_only_layers, decoder_sparse_step); final norm; LM head or the tied embedding.
//
// The K/V cache is the paged cache the latent attention uses (model/latent_cache.h, one type for
// the prefix cache and KV transfer): each token's entry in a layer is its keys for every KV head,
// then its values, [K (kv_heads x head_dim) | V (kv_heads x head_dim)].
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "model/latent_cache.h"
#include "model/qwen3_moe_config.h"
#include "model/rope.h"
#include "model/safetensors.h"
#include "model/step.h"
#include "model/tensor_binder.h"

namespace tandem::model {

struct Qwen3LayerWeights {
  std::vector<float> input_norm, post_attention_norm;
  kernels::Matrix q, k, v, o;
  std::vector<float> q_norm, k_norm;  // [head_dim], shared by the heads
  bool is_moe = false;
  MlpWeights dense;
  kernels::Matrix router;  // [num_experts, hidden], float32
  std::vector<MlpWeights> experts;
};

// The cache a model of config `c` has, before its weights are loaded (cache_shape() below).
LatentCacheShape qwen3_cache_shape(const Qwen3MoeConfig& c, int64_t block_size,
                                   std::optional<LatentType> type = {});

class Qwen3MoeModel {
 public:
  // Checks every tensor's presence, shape and dtype against the config and binds them.
  static Qwen3MoeModel load(const std::filesystem::path& dir,
                            const std::function<void(size_t, size_t)>& progress = {});

  const Qwen3MoeConfig& config() const { return config_; }
  // The cache's shape: one entry of 2 x kv_heads x head_dim values per token and layer, of
  // `type` (default: float32 for float32 checkpoints, else BF16).
  LatentCacheShape cache_shape(int64_t block_size, std::optional<LatentType> type = {}) const;
  LatentType default_cache_type() const;

  // One step: logits for the rows the batch asks for. Positions up to each step's start must be
  // in the cache; the step's own keys and values are written to it.
  StepOutput forward(std::span<const SequenceStep> batch, LatentCache& cache) const;

  // Tokens routed to each expert since load, per layer (dense layers stay zero).
  const std::vector<std::vector<uint64_t>>& expert_counts() const { return expert_counts_; }

 private:
  Qwen3MoeModel(Qwen3MoeConfig config, Checkpoint checkpoint);
  void attention(const Qwen3LayerWeights& w, int64_t layer, std::span<const SequenceStep> batch,
                 const std::vector<int64_t>& positions, const float* x, LatentCache& cache,
                 float* out) const;
  // `margins[t]` becomes the smaller of itself and token t's routing margin in this layer.
  void feed_forward(const Qwen3LayerWeights& w, int64_t layer, const float* x, int64_t n,
                    float* out, float* margins) const;

  Qwen3MoeConfig config_;
  Checkpoint checkpoint_;  // keeps the mapped tensors alive
  kernels::Matrix embed, lm_head;
  std::vector<Qwen3LayerWeights> layers_;
  std::vector<float> final_norm_;
  Rope rope_;
  mutable std::vector<std::vector<uint64_t>> expert_counts_;
};

}  // namespace tandem::model
