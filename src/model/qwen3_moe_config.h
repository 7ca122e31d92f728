#pragma once
// Model configuration from a Hugging Face `config.json` of the Qwen3-MoE family
// (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-480B-A35B).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"

namespace tandem::model {

struct Qwen3MoeConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP layers
  int64_t moe_intermediate_size = 0;  // each routed expert
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t num_experts = 0;  // 0: every layer dense
  int64_t num_experts_per_tok = 0;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  bool norm_topk_prob = true;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1e6;
  std::optional<YarnScaling> yarn;  // rope_scaling {"rope_type": "yarn", ...}
  int64_t max_position_embeddings = 32768;
  bool tie_word_embeddings = false;
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // eos_token_id: one id or a list of them
  std::string torch_dtype = "bfloat16";

  // As Qwen3-MoE's decoder layers choose: routed experts unless the layer is listed in
  // mlp_only_layers, on every decoder_sparse_step-th layer.
  bool is_moe_layer(int64_t layer) const;
  // Attention's softmax scale (1/sqrt(head_dim)) and YaRN's factor on cos and sin.
  double softmax_scale() const;
  double rope_mscale() const;

  // Unknown fields, missing required ones, wrong types and what this engine does not run
  // (sliding-window attention, attention biases, another activation) throw tandem::Error naming
  // `origin` and the field.
  static Qwen3MoeConfig parse(const nlohmann::json& doc, const std::string& origin);
  static Qwen3MoeConfig load(const std::filesystem::path& dir);  // DIR/config.json
  // The config.json of a Hugging Face repository of this model; parse(to_json()) == *this.
  nlohmann::ordered_json to_json() const;

  bool operator==(const Qwen3MoeConfig&) const = default;
};

inline constexpr const char* kQwen3MoeArchitecture = "Qwen3MoeForCausalLM";

// The architecture a model folder's config.json names (its "architectures"[0]); throws
// tandem::Error naming the file when it names none.
std::string architecture_of(const std::filesystem::path& dir);

}  // namespace tandem::model
