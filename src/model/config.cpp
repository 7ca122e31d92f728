#include "model/config.h"

#include "model/config_json.h"

#include <cmath>
#include <set>

#include "util/error.h"
#include "util/file.h"
#include "util/json.h"
#include "util/utf8.h"

namespace tandem::model {
namespace {

using json = nlohmann::json;

constexpr const char* kV3 = "DeepseekV3ForCausalLM";
constexpr const char* kV2 = "DeepseekV2ForCausalLM";

// `f`: the fields of quantization_config.
void parse_quantization(Fields f, ModelConfig& c) {
  const std::string method = f.string("quant_method");
  if (method == "fp8") {
    if (f.present("fmt") && f.string("fmt") != "e4m3")
      f.fail("fmt", one_of(f.string("fmt"), {"e4m3"}));
    f.ignore("fmt");
    if (f.present("activation_scheme") && f.string("activation_scheme") != "dynamic")
      f.fail("activation_scheme",
             "must be \"dynamic\" (static activation scales are not supported)");
    f.ignore("activation_scheme");
    if (f.present("scale_fmt") && f.string("scale_fmt") != "ue8m0")
      f.fail("scale_fmt", "must be \"ue8m0\" when given");
    f.ignore("scale_fmt");  // power-of-two scales, still stored as F32 weight_scale_inv
    const json* block = f.get("weight_block_size");
    if (!block)
      f.fail("weight_block_size",
             "is required (per-tensor FP8 is not supported, only block scales)");
    if (!block->is_array() || block->size() != 2 || !(*block)[0].is_number_integer() ||
        !(*block)[1].is_number_integer() || (*block)[0].get<int64_t>() <= 0 ||
        (*block)[1].get<int64_t>() <= 0 || (*block)[0].get<int64_t>() > kMaxDimension ||
        (*block)[1].get<int64_t>() > kMaxDimension)
      f.fail("weight_block_size", "must be two positive integers up to " +
                                      std::to_string(kMaxDimension) + ", got " +
                                      json_excerpt(*block));
    c.fp8 = Fp8Quantization{(*block)[0].get<int64_t>(), (*block)[1].get<int64_t>()};
  } else if (method == "w8a8_int8") {
    if (f.present("activation_scheme") && f.string("activation_scheme") != "dynamic")
      f.fail("activation_scheme",
             "must be \"dynamic\" (static activation scales are not supported)");
    f.ignore("activation_scheme");
    if (!f.boolean_or("is_dynamic", true))
      f.fail("is_dynamic", "must be true (static activation scales are not supported)");
    if (const json* ignore = f.get("ignore")) {
      if (!ignore->is_array()) f.fail("ignore", "must be a list");
      for (const auto& m : *ignore)
        if (!m.is_string() || m.get<std::string>() != "lm_head")
          f.fail("ignore",
                 "may only list \"lm_head\" (which is never quantized); got " + json_excerpt(m));
    }
    if (const json* packed = f.get("packed_modules_mapping"); packed && !packed->is_object())
      f.fail("packed_modules_mapping", "must be an object");
    if (f.present("quant_description"))
      f.fail("quant_description", "(per-module mixed precision) is not supported");
    c.int8 = Int8Quantization{};
  } else {
    f.fail("quant_method",
           "must be \"fp8\" (128x128 block FP8) or \"w8a8_int8\" (per-channel "
           "INT8); got \"" +
               method + "\"");
  }
  f.reject_unknown();
}

}  // namespace

ModelConfig ModelConfig::parse(const nlohmann::json& doc, const std::string& origin) {
  if (!doc.is_object()) throw Error(origin + ": expected a JSON object");
  auto f = Fields::strict(doc, origin);
  ModelConfig c;

  const json& archs = f.need("architectures");
  if (!archs.is_array() || archs.size() != 1 || !archs[0].is_string())
    f.fail("architectures", "must be a list with one name, got " + json_excerpt(archs));
  c.architecture = archs[0].get<std::string>();
  if (c.architecture != kV3 && c.architecture != kV2)
    f.fail("architectures", one_of(c.architecture, {kV3, kV2}));
  const bool v3 = c.architecture == kV3;
  if (f.present("model_type")) {
    const std::string mt = f.string("model_type");
    if (mt != (v3 ? "deepseek_v3" : "deepseek_v2"))
      f.fail("model_type",
             "\"" + utf8::clip(mt) + "\" contradicts architectures " + c.architecture);
  }
  f.ignore("model_type");

  auto positive = [&](const std::string& key, int64_t limit = kMaxDimension) {
    const int64_t v = f.integer(key);
    f.positive_at_most(key, v, limit);
    return v;
  };
  c.vocab_size = positive("vocab_size");
  c.hidden_size = positive("hidden_size");
  c.num_hidden_layers = positive("num_hidden_layers", kMaxLayers);
  c.num_attention_heads = positive("num_attention_heads");
  c.kv_lora_rank = positive("kv_lora_rank");
  c.qk_nope_head_dim = positive("qk_nope_head_dim");
  c.qk_rope_head_dim = positive("qk_rope_head_dim");
  if (c.qk_rope_head_dim % 2 != 0) f.fail("qk_rope_head_dim", "must be even (RoPE rotates pairs)");
  c.v_head_dim = positive("v_head_dim");
  c.max_position_embeddings = positive("max_position_embeddings", kMaxPositions);
  if (!f.present("q_lora_rank") && !doc.contains("q_lora_rank"))
    f.fail("q_lora_rank", "is required (null when queries have no low-rank projection)");
  c.q_lora_rank = f.integer_or("q_lora_rank", int64_t{0});
  if (f.present("q_lora_rank") && c.q_lora_rank <= 0)
    f.fail("q_lora_rank", "must be positive, or null for no q-LoRA");
  f.at_most("q_lora_rank", c.q_lora_rank, kMaxDimension);
  c.intermediate_size = f.integer("intermediate_size");
  if (c.intermediate_size < 0) f.fail("intermediate_size", "must not be negative");
  f.at_most("intermediate_size", c.intermediate_size, kMaxDimension);
  c.rms_norm_eps = f.number("rms_norm_eps");
  c.tie_word_embeddings = f.boolean_or("tie_word_embeddings", false);
  c.num_nextn_predict_layers = f.integer_or("num_nextn_predict_layers", int64_t{0});
  if (c.num_nextn_predict_layers < 0) f.fail("num_nextn_predict_layers", "must not be negative");
  // MTP layers are decoder layers too (numbered after the others), so they share the limit.
  f.at_most("num_nextn_predict_layers", c.num_nextn_predict_layers,
            kMaxLayers - c.num_hidden_layers);
  c.bos_token_id = f.optional_integer("bos_token_id");
  c.eos_token_ids = f.integers("eos_token_id");

  // RoPE: rope_theta + rope_scaling (transformers v4), or rope_parameters (v5).
  // DeepSeek's code defaults original_max_position_embeddings to 4096.
  const RopeFields rope = read_rope_fields(f, 4096);
  if (!rope.theta) f.fail("rope_theta", "is required");
  c.rope_theta = *rope.theta;
  c.yarn = rope.yarn;
  // DeepSeek's magnitude comes from mscale and mscale_all_dim; vLLM's deepseek_yarn ignores an
  // attention_factor where transformers would apply it, so no answer would be both.
  if (c.yarn && c.yarn->attention_factor)
    f.fail(rope.yarn_field + ".attention_factor",
           "is not read by DeepSeek's YaRN (its magnitude comes from mscale and mscale_all_dim)");
  // Likewise vLLM's deepseek_yarn always rounds the correction range outwards.
  if (c.yarn && !c.yarn->truncate)
    f.fail(
        rope.yarn_field + ".truncate",
        "is false, which DeepSeek's YaRN does not read (its correction range is always rounded)");
  check_shared_fields(f, {c.vocab_size, c.rms_norm_eps, c.rope_theta, c.yarn.has_value(),
                          c.max_position_embeddings, c.bos_token_id, c.eos_token_ids});
  check_rope_numbers(f, Rope(c), c.softmax_scale(), rope.yarn_field);

  // Mixture of experts.
  c.n_routed_experts = f.integer_or("n_routed_experts", int64_t{0});
  if (!f.present("n_routed_experts") && !doc.contains("n_routed_experts"))
    f.fail("n_routed_experts", "is required (null for a dense model)");
  if (c.n_routed_experts < 0) f.fail("n_routed_experts", "must not be negative");
  f.at_most("n_routed_experts", c.n_routed_experts, kMaxExperts);
  const bool moe = c.n_routed_experts > 0;
  auto moe_integer = [&](const std::string& key, int64_t fallback) {
    return moe ? f.integer(key) : f.integer_or(key, fallback);
  };
  c.num_experts_per_tok = moe_integer("num_experts_per_tok", 0);
  c.moe_intermediate_size = moe_integer("moe_intermediate_size", 0);
  c.n_shared_experts = f.integer_or("n_shared_experts", int64_t{0});
  if (moe && !doc.contains("n_shared_experts"))
    f.fail("n_shared_experts", "is required (null or 0 for none)");
  c.first_k_dense_replace = moe_integer("first_k_dense_replace", 0);
  c.moe_layer_freq = f.integer_or("moe_layer_freq", int64_t{1});
  // Hugging Face's defaults for the routing fields differ between V2 and V3, so a MoE config
  // must state them rather than have one guessed.
  c.scoring_func = moe ? f.string("scoring_func") : f.string_or("scoring_func", "softmax");
  c.topk_method = moe ? f.string("topk_method") : f.string_or("topk_method", "greedy");
  c.norm_topk_prob = moe ? f.boolean("norm_topk_prob") : f.boolean_or("norm_topk_prob", false);
  c.routed_scaling_factor =
      moe ? f.number("routed_scaling_factor") : f.number_or("routed_scaling_factor", 1.0);
  c.n_group = f.integer_or("n_group", int64_t{1});
  c.topk_group = f.integer_or("topk_group", int64_t{1});
  if (moe) {
    if (c.num_experts_per_tok <= 0 || c.num_experts_per_tok > c.n_routed_experts)
      f.fail("num_experts_per_tok", "must be between 1 and n_routed_experts (" +
                                        std::to_string(c.n_routed_experts) + "), got " +
                                        std::to_string(c.num_experts_per_tok));
    f.positive_at_most("moe_intermediate_size", c.moe_intermediate_size, kMaxDimension);
    if (c.n_shared_experts < 0) f.fail("n_shared_experts", "must not be negative");
    f.at_most("n_shared_experts", c.n_shared_experts, kMaxExperts);
    if (c.first_k_dense_replace < 0 || c.first_k_dense_replace > c.num_hidden_layers)
      f.fail("first_k_dense_replace", "must be between 0 and num_hidden_layers (" +
                                          std::to_string(c.num_hidden_layers) + ")");
    if (c.moe_layer_freq < 1) f.fail("moe_layer_freq", "must be at least 1");
    if (c.scoring_func != "softmax" && c.scoring_func != "sigmoid")
      f.fail("scoring_func", one_of(c.scoring_func, {"softmax", "sigmoid"}));
    if (c.topk_method != "greedy" && c.topk_method != "group_limited_greedy" &&
        c.topk_method != "noaux_tc")
      f.fail("topk_method", one_of(c.topk_method, {"greedy", "group_limited_greedy", "noaux_tc"}));
    if (!(c.routed_scaling_factor > 0)) f.fail("routed_scaling_factor", "must be positive");
    if (c.n_group < 1) f.fail("n_group", "must be at least 1");
    if (c.topk_group < 1 || c.topk_group > c.n_group)
      f.fail("topk_group", "must be between 1 and n_group (" + std::to_string(c.n_group) +
                               "), got " + std::to_string(c.topk_group));
    if (c.n_routed_experts % c.n_group != 0)
      f.fail("n_group", "must divide n_routed_experts (" + std::to_string(c.n_routed_experts) +
                            "), got " + std::to_string(c.n_group));
    const int64_t per_group = c.n_routed_experts / c.n_group;
    if (c.topk_method == "greedy") {
      if (c.n_group != 1 || c.topk_group != 1)
        f.fail("topk_method", "\"greedy\" ignores expert groups, which contradicts n_group " +
                                  std::to_string(c.n_group) + " / topk_group " +
                                  std::to_string(c.topk_group) +
                                  " (use \"group_limited_greedy\" or \"noaux_tc\")");
    } else if (c.num_experts_per_tok > c.topk_group * per_group) {
      f.fail("num_experts_per_tok", "exceeds the " + std::to_string(c.topk_group * per_group) +
                                        " experts in the topk_group groups kept");
    }
    if (c.topk_method == "noaux_tc" && c.n_group > 1 && per_group < 2)
      f.fail("n_group",
             "leaves fewer than 2 experts per group, but noaux_tc scores a group by "
             "its top-2 experts");
    int64_t moe_layers = 0;
    for (int64_t l = 0; l < c.num_hidden_layers + c.num_nextn_predict_layers; ++l)
      moe_layers += c.is_moe_layer(l);
    if (moe_layers > kMaxExpertMlps / c.n_routed_experts)
      f.fail("n_routed_experts", "(" + std::to_string(c.n_routed_experts) + ") times the " +
                                     std::to_string(moe_layers) +
                                     " MoE layers exceeds this engine's limit of " +
                                     std::to_string(kMaxExpertMlps) + " routed experts in all");
    const bool has_dense = c.first_k_dense_replace > 0 || c.moe_layer_freq > 1;
    if (has_dense && c.intermediate_size <= 0)
      f.fail("intermediate_size", "must be positive: some layers are dense");
  } else {
    if (c.num_experts_per_tok > 0)
      f.fail("num_experts_per_tok", "is set but n_routed_experts is 0 or null");
    if (c.intermediate_size <= 0) f.fail("intermediate_size", "must be positive");
    c.n_shared_experts = 0;
  }

  // Fields that must hold the values this model family uses.
  if (f.present("hidden_act") && f.string("hidden_act") != "silu")
    f.fail("hidden_act",
           "must be \"silu\" (DeepSeek's SwiGLU); got " + json_excerpt(doc["hidden_act"]));
  f.ignore("hidden_act");
  if (f.boolean_or("attention_bias", false)) f.fail("attention_bias", "must be false");
  if (f.boolean_or("mlp_bias", false)) f.fail("mlp_bias", "must be false");
  if (!f.boolean_or("rope_interleave", true))
    f.fail("rope_interleave", "must be true (DeepSeek rotates interleaved pairs)");
  if (const auto kv = f.optional_integer("num_key_value_heads"); kv && *kv != c.num_attention_heads)
    f.fail("num_key_value_heads", "must equal num_attention_heads (" +
                                      std::to_string(c.num_attention_heads) + ") under MLA, got " +
                                      std::to_string(*kv));
  // transformers v5 records head_dim as the rotary width.
  if (const auto hd = f.optional_integer("head_dim"); hd && *hd != c.qk_rope_head_dim)
    f.fail("head_dim", "must equal qk_rope_head_dim (" + std::to_string(c.qk_rope_head_dim) +
                           "), got " + std::to_string(*hd));
  c.torch_dtype = read_dtype_field(f, c.torch_dtype);
  if (f.get("quantization_config")) parse_quantization(f.nested("quantization_config"), c);

  // Training and bookkeeping fields of real config.json files; they do not change inference.
  for (const char* key : {"auto_map", "transformers_version", "initializer_range", "ep_size",
                          "aux_loss_alpha", "seq_aux", "pretraining_tp", "use_cache",
                          "attention_dropout", "pad_token_id", "_name_or_path"})
    f.ignore(key);
  f.reject_unknown();
  return c;
}

ModelConfig ModelConfig::parse(const nlohmann::ordered_json& doc, const std::string& origin) {
  return parse(nlohmann::json::parse(doc.dump()), origin);
}

ModelConfig ModelConfig::load(const std::filesystem::path& dir) {
  return parse(read_config_json(dir), (dir / "config.json").string());
}

double ModelConfig::softmax_scale() const {
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  // As DeepSeek's Hugging Face code: the YaRN attention temperature from mscale_all_dim.
  if (yarn && yarn->mscale_all_dim != 0.0 && yarn->factor > 1.0) {
    const double m = 0.1 * yarn->mscale_all_dim * std::log(yarn->factor) + 1.0;
    scale *= m * m;
  }
  return scale;
}

nlohmann::ordered_json ModelConfig::to_json() const {
  json j;  // std::map keeps keys sorted, as transformers' to_json_string(sort_keys=True)
  const bool v3 = architecture == kV3;
  j["architectures"] = {architecture};
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["aux_loss_alpha"] = 0.001;
  if (bos_token_id) j["bos_token_id"] = *bos_token_id;
  if (eos_token_ids.size() == 1)
    j["eos_token_id"] = eos_token_ids[0];
  else if (!eos_token_ids.empty())
    j["eos_token_id"] = eos_token_ids;
  j["ep_size"] = 1;
  j["first_k_dense_replace"] = first_k_dense_replace;
  j["hidden_act"] = "silu";
  j["hidden_size"] = hidden_size;
  j["initializer_range"] = 0.02;
  j["intermediate_size"] = intermediate_size;
  j["kv_lora_rank"] = kv_lora_rank;
  j["max_position_embeddings"] = max_position_embeddings;
  j["model_type"] = v3 ? "deepseek_v3" : "deepseek_v2";
  j["moe_intermediate_size"] = moe_intermediate_size;
  j["moe_layer_freq"] = moe_layer_freq;
  j["n_group"] = n_group;
  j["n_routed_experts"] = n_routed_experts > 0 ? json(n_routed_experts) : json(nullptr);
  j["n_shared_experts"] = n_shared_experts;
  j["norm_topk_prob"] = norm_topk_prob;
  j["num_attention_heads"] = num_attention_heads;
  j["num_experts_per_tok"] = num_experts_per_tok;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_key_value_heads"] = num_attention_heads;
  if (v3 || num_nextn_predict_layers > 0) j["num_nextn_predict_layers"] = num_nextn_predict_layers;
  j["pretraining_tp"] = 1;
  j["q_lora_rank"] = q_lora_rank > 0 ? json(q_lora_rank) : json(nullptr);
  j["qk_nope_head_dim"] = qk_nope_head_dim;
  j["qk_rope_head_dim"] = qk_rope_head_dim;
  if (fp8) {
    j["quantization_config"] = {{"activation_scheme", "dynamic"},
                                {"fmt", "e4m3"},
                                {"quant_method", "fp8"},
                                {"weight_block_size", {fp8->block_rows, fp8->block_cols}}};
  } else if (int8) {
    j["quantization_config"] = {{"activation_scheme", "dynamic"}, {"quant_method", "w8a8_int8"}};
  }
  j["rms_norm_eps"] = rms_norm_eps;
  if (yarn) {
    j["rope_scaling"] = {
        {"beta_fast", yarn->beta_fast},
        {"beta_slow", yarn->beta_slow},
        {"factor", yarn->factor},
        {"mscale_all_dim", yarn->mscale_all_dim},
        {"original_max_position_embeddings", yarn->original_max_position_embeddings},
        {"type", "yarn"}};
    if (yarn->mscale) j["rope_scaling"]["mscale"] = *yarn->mscale;
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["rope_theta"] = rope_theta;
  j["routed_scaling_factor"] = routed_scaling_factor;
  j["scoring_func"] = scoring_func;
  j["seq_aux"] = true;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["topk_group"] = topk_group;
  j["topk_method"] = topk_method;
  j["torch_dtype"] = torch_dtype;
  j["transformers_version"] = "4.46.3";
  j["use_cache"] = true;
  j["v_head_dim"] = v_head_dim;
  j["vocab_size"] = vocab_size;
  return nlohmann::ordered_json::parse(j.dump());
}

}  // namespace tandem::model
