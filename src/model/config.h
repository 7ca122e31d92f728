#pragma once
// Model configuration from a Hugging Face `config.json` of the DeepSeek-V2/V3 family
// (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace tandem::model {

struct YarnScaling {
  double factor = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  int64_t original_max_position_embeddings = 4096;
};

// FP8 checkpoints (quant_method "fp8", fmt "e4m3", weight_block_size [128, 128]).
struct Fp8Quantization {
  int64_t block_rows = 128, block_cols = 128;
};

struct ModelConfig {
  std::string architecture;  // "DeepseekV3ForCausalLM" or "DeepseekV2ForCausalLM"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP layers
  int64_t moe_intermediate_size = 0;  // each routed / shared expert
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t q_lora_rank = 0;  // 0: no q-LoRA (q_proj), as in V2-Lite
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t n_routed_experts = 0;  // 0: every layer dense
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  std::string scoring_func = "softmax";  // or "sigmoid"
  std::string topk_method = "greedy";    // "greedy", "group_limited_greedy" or "noaux_tc"
  bool norm_topk_prob = false;
  double routed_scaling_factor = 1.0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<YarnScaling> yarn;  // rope_scaling {"type": "yarn", ...}; others are errors
  int64_t max_position_embeddings = 4096;
  int64_t num_nextn_predict_layers = 0;
  bool tie_word_embeddings = false;
  std::optional<int64_t> bos_token_id, eos_token_id;
  std::optional<Fp8Quantization> fp8;

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool is_moe_layer(int64_t layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  // Softmax scale of attention, including YaRN's mscale correction.
  double softmax_scale() const;
  bool uses_correction_bias() const { return topk_method == "noaux_tc"; }

  // Unknown fields, missing required fields, wrong types and contradictions (e.g. topk_group >
  // n_group, experts per token > routed experts, an unknown scoring_func) throw tandem::Error
  // naming `origin` and the field.
  static ModelConfig parse(const nlohmann::json& doc, const std::string& origin);
  static ModelConfig load(const std::filesystem::path& dir);  // DIR/config.json
  // The config.json a Hugging Face repository of this model would carry.
  nlohmann::ordered_json to_json() const;
};

}  // namespace tandem::model
