#pragma once
// Model configuration from a Hugging Face `config.json` of the DeepSeek-V2/V3 family
// (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tandem::model {

struct YarnScaling {
  double factor = 1.0;
  // DeepSeek's magnitude fields. Its code takes an absent mscale as 1; transformers' YaRN for
  // other models (Qwen3) uses the two only when both are given and non-zero.
  std::optional<double> mscale;
  double mscale_all_dim = 0.0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  // Absent: the family's default (DeepSeek's code: 4096; transformers' standardisation for other
  // models: max_position_embeddings).
  int64_t original_max_position_embeddings = 4096;
  // transformers' attention_factor: the multiplier of cos and sin, in place of the one derived
  // from factor (Qwen3-MoE; DeepSeek's path refuses it).
  std::optional<double> attention_factor;
  // Whether the correction range's ends are rounded out to whole dimensions (transformers'
  // default; false in gpt-oss-style configs).
  bool truncate = true;
  bool operator==(const YarnScaling&) const = default;
};

// FP8 checkpoints as DeepSeek-V3 ships them: quantization_config {"quant_method": "fp8", "fmt":
// "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]} (V3.1's "scale_fmt":
// "ue8m0" is accepted too). Every quantized linear `X` has X.weight (F8_E4M3, [out, in]) and
// X.weight_scale_inv (F32, [ceil(out/128), ceil(in/128)]); W = W_fp8 * scale_inv of its block.
struct Fp8Quantization {
  int64_t block_rows = 128, block_cols = 128;
  bool operator==(const Fp8Quantization&) const = default;
};

// W8A8 INT8 with per-output-channel weight scales, as in meituan/DeepSeek-R1-Channel-INT8 and
// SGLang's "w8a8_int8" method: quantization_config {"quant_method": "w8a8_int8"} (optional
// "activation_scheme": "dynamic", "is_dynamic": true, "ignore": ["lm_head"],
// "packed_modules_mapping"). Every quantized linear `X` has X.weight (I8, [out, in]) and
// X.weight_scale (F32, [out, 1]); W[r, :] = W_i8[r, :] * weight_scale[r] (symmetric,
// scale = amax(row) / 127). Activations are quantized per token at run time.
struct Int8Quantization {
  bool operator==(const Int8Quantization&) const = default;
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
  std::optional<int64_t> bos_token_id;
  // eos_token_id: one id or a list of them (transformers' Union[int, List[int]]); all are kept.
  std::vector<int64_t> eos_token_ids;
  std::string torch_dtype = "bfloat16";  // informational: "bfloat16", "float16" or "float32"
  std::optional<Fp8Quantization> fp8;
  std::optional<Int8Quantization> int8;

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool is_moe_layer(int64_t layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  // Softmax scale of attention, including YaRN's mscale correction.
  double softmax_scale() const;
  bool uses_correction_bias() const { return topk_method == "noaux_tc"; }
  bool quantized() const { return fp8.has_value() || int8.has_value(); }

  // Unknown fields, missing required fields, wrong types and contradictions (e.g. topk_group >
  // n_group, experts per token > routed experts, an unknown scoring_func) throw tandem::Error
  // naming `origin` and the field.
  static ModelConfig parse(const nlohmann::json& doc, const std::string& origin);
  static ModelConfig parse(const nlohmann::ordered_json& doc, const std::string& origin);
  static ModelConfig load(const std::filesystem::path& dir);  // DIR/config.json
  // The config.json a Hugging Face repository of this model would carry (keys sorted, as
  // transformers writes them); parse(to_json()) gives back an equal config.
  nlohmann::ordered_json to_json() const;

  bool operator==(const ModelConfig&) const = default;
};

}  // namespace tandem::model
