#include "model/qwen3_moe_config.h"

#include <algorithm>
#include <cmath>

#include "model/config_json.h"
#include "util/error.h"
#include "util/file.h"
#include "util/json.h"

namespace tandem::model {

using json = nlohmann::json;

Qwen3MoeConfig Qwen3MoeConfig::parse(const json& doc, const std::string& origin) {
  if (!doc.is_object()) throw Error(origin + ": expected a JSON object");
  auto f = Fields::strict(doc, origin);
  Qwen3MoeConfig c;
  const json& arch = f.need("architectures");
  if (!arch.is_array() || arch.size() != 1 || arch[0] != kQwen3MoeArchitecture)
    f.fail("architectures",
           std::string("must be [\"") + kQwen3MoeArchitecture + "\"], got " + json_excerpt(arch));
  if (f.present("model_type") && f.string("model_type") != "qwen3_moe")
    f.fail("model_type", one_of(doc["model_type"].get<std::string>(), {"qwen3_moe"}));
  f.ignore("model_type");
  c.vocab_size = f.integer("vocab_size");
  c.hidden_size = f.integer("hidden_size");
  c.intermediate_size = f.integer("intermediate_size");
  c.moe_intermediate_size = f.integer("moe_intermediate_size");
  c.num_hidden_layers = f.integer("num_hidden_layers");
  // Bounded before anything loops over the layers (mlp_only_layers, is_moe_layer below).
  f.positive_at_most("num_hidden_layers", c.num_hidden_layers, kMaxLayers);
  c.num_attention_heads = f.integer("num_attention_heads");
  c.num_key_value_heads = f.integer_or("num_key_value_heads", c.num_attention_heads);
  c.head_dim = f.integer_or("head_dim",
                            c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
  c.num_experts = f.integer_or("num_experts", 0);
  c.num_experts_per_tok = f.integer_or("num_experts_per_tok", 0);
  c.decoder_sparse_step = f.integer_or("decoder_sparse_step", 1);
  if (const json* m = f.get("mlp_only_layers")) {
    if (!m->is_array()) f.fail("mlp_only_layers", "must be a list of layer indices");
    std::vector<bool> listed(static_cast<size_t>(c.num_hidden_layers));
    for (const auto& v : *m) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c.num_hidden_layers)
        f.fail("mlp_only_layers", "must hold layer indices below num_hidden_layers (" +
                                      std::to_string(c.num_hidden_layers) + "), got " +
                                      json_excerpt(v));
      // A repeat would only lengthen is_moe_layer's search, which runs once per layer.
      if (listed[static_cast<size_t>(v.get<int64_t>())])
        f.fail("mlp_only_layers", "lists layer " + std::to_string(v.get<int64_t>()) + " twice");
      listed[static_cast<size_t>(v.get<int64_t>())] = true;
      c.mlp_only_layers.push_back(v.get<int64_t>());
    }
  }
  c.norm_topk_prob = f.boolean_or("norm_topk_prob", false);
  c.rms_norm_eps = f.number_or("rms_norm_eps", 1e-6);
  c.max_position_embeddings = f.integer_or("max_position_embeddings", 32768);
  c.tie_word_embeddings = f.boolean_or("tie_word_embeddings", false);
  c.bos_token_id = f.optional_integer("bos_token_id");
  c.eos_token_ids = f.integers("eos_token_id");
  c.torch_dtype = read_dtype_field(f, "bfloat16");
  // Without original_max_position_embeddings, transformers' YaRN takes max_position_embeddings.
  const RopeFields rope = read_rope_fields(f, c.max_position_embeddings);
  c.yarn = rope.yarn;
  c.rope_theta = rope.theta.value_or(10000.0);

  // What the engine does not run: refused by name rather than computed differently.
  if (f.boolean_or("use_sliding_window", false))
    f.fail("use_sliding_window", "is true: sliding-window attention is not supported");
  f.ignore("sliding_window");     // used only with use_sliding_window
  f.ignore("max_window_layers");  // likewise
  if (f.boolean_or("attention_bias", false))
    f.fail("attention_bias",
           "is true: Qwen3-MoE's attention has no biases and this engine "
           "runs none");
  if (f.present("hidden_act") && f.string("hidden_act") != "silu")
    f.fail("hidden_act", one_of(doc["hidden_act"].get<std::string>(), {"silu"}));
  f.ignore("hidden_act");
  if (f.present("quantization_config"))
    f.fail("quantization_config",
           "is not supported for Qwen3-MoE checkpoints yet (BF16, F16 or "
           "F32 weights)");
  // Training and bookkeeping.
  for (const char* k : {"attention_dropout", "initializer_range", "output_router_logits",
                        "router_aux_loss_coef", "transformers_version", "use_cache"})
    f.ignore(k);
  f.reject_unknown();

  auto positive = [&](const char* k, int64_t v) {
    if (v <= 0) f.fail(k, "must be positive, got " + std::to_string(v));
  };
  positive("vocab_size", c.vocab_size);
  positive("hidden_size", c.hidden_size);
  positive("num_attention_heads", c.num_attention_heads);
  positive("num_key_value_heads", c.num_key_value_heads);
  positive("head_dim", c.head_dim);
  for (const auto& [k, v] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                             {"hidden_size", c.hidden_size},
                             {"intermediate_size", c.intermediate_size},
                             {"moe_intermediate_size", c.moe_intermediate_size},
                             {"num_attention_heads", c.num_attention_heads},
                             {"num_key_value_heads", c.num_key_value_heads},
                             {"head_dim", c.head_dim}})
    f.at_most(k, v, kMaxDimension);
  // The attention's width is a dimension too (head_dim is free of hidden_size here, unlike
  // DeepSeek's): each factor within the limit, 2^24 heads of 2^24 made a KV-cache entry of 2^49
  // values, and a cache block's bytes (layers x block size x entry) overflowed 64 bits in the
  // engine's check of its KV budget. Both factors are below 2^24, so the product fits.
  if (c.num_attention_heads * c.head_dim > kMaxDimension)
    f.fail("head_dim", "(" + std::to_string(c.head_dim) + ") times num_attention_heads (" +
                           std::to_string(c.num_attention_heads) +
                           ") exceeds this engine's limit of " + std::to_string(kMaxDimension));
  check_shared_fields(f, {c.vocab_size, c.rms_norm_eps, c.rope_theta, c.yarn.has_value(),
                          c.max_position_embeddings, c.bos_token_id, c.eos_token_ids});
  if (c.head_dim % 2 != 0) f.fail("head_dim", "must be even (RoPE rotates pairs)");
  check_rope_numbers(f, Rope(c.head_dim, c.rope_theta, c.yarn, c.rope_mscale()), c.softmax_scale(),
                     rope.yarn_field);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    f.fail("num_key_value_heads", "must divide num_attention_heads (" +
                                      std::to_string(c.num_attention_heads) + "), got " +
                                      std::to_string(c.num_key_value_heads));
  if (c.decoder_sparse_step < 1) f.fail("decoder_sparse_step", "must be at least 1");
  if (c.num_experts < 0) f.fail("num_experts", "must not be negative");
  f.at_most("num_experts", c.num_experts, kMaxExperts);
  bool any_dense = false;
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_moe_layer(l))
      ++moe_layers;
    else
      any_dense = true;
  }
  const bool any_moe = moe_layers > 0;
  if (any_moe && moe_layers > kMaxExpertMlps / c.num_experts)
    f.fail("num_experts", "(" + std::to_string(c.num_experts) + ") times the " +
                              std::to_string(moe_layers) +
                              " MoE layers exceeds this engine's limit of " +
                              std::to_string(kMaxExpertMlps) + " routed experts in all");
  if (any_moe) {
    positive("moe_intermediate_size", c.moe_intermediate_size);
    if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_experts)
      f.fail("num_experts_per_tok", "must be between 1 and num_experts (" +
                                        std::to_string(c.num_experts) + "), got " +
                                        std::to_string(c.num_experts_per_tok));
  }
  if (any_dense) positive("intermediate_size", c.intermediate_size);
  return c;
}

Qwen3MoeConfig Qwen3MoeConfig::load(const std::filesystem::path& dir) {
  return parse(read_config_json(dir), (dir / "config.json").string());
}

bool Qwen3MoeConfig::is_moe_layer(int64_t layer) const {
  return num_experts > 0 &&
         std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) ==
             mlp_only_layers.end() &&
         (layer + 1) % decoder_sparse_step == 0;
}

double Qwen3MoeConfig::softmax_scale() const {
  return 1.0 / std::sqrt(static_cast<double>(head_dim));
}

double Qwen3MoeConfig::rope_mscale() const {
  // YaRN's attention temperature, folded into cos and sin (so q.k gains its square), as
  // transformers' _compute_yarn_parameters: the config's attention_factor, else mscale over
  // mscale_all_dim when both are given and non-zero, else 0.1 ln(factor) + 1.
  if (!yarn) return 1.0;
  if (yarn->attention_factor) return *yarn->attention_factor;
  if (yarn->mscale.value_or(0.0) != 0.0 && yarn->mscale_all_dim != 0.0)
    return yarn_get_mscale(yarn->factor, *yarn->mscale) /
           yarn_get_mscale(yarn->factor, yarn->mscale_all_dim);
  return yarn_get_mscale(yarn->factor);
}

nlohmann::ordered_json Qwen3MoeConfig::to_json() const {
  nlohmann::ordered_json j;
  j["architectures"] = {kQwen3MoeArchitecture};
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  if (bos_token_id) j["bos_token_id"] = *bos_token_id;
  j["decoder_sparse_step"] = decoder_sparse_step;
  if (eos_token_ids.size() == 1)
    j["eos_token_id"] = eos_token_ids[0];
  else if (!eos_token_ids.empty())
    j["eos_token_id"] = eos_token_ids;
  j["head_dim"] = head_dim;
  j["hidden_act"] = "silu";
  j["hidden_size"] = hidden_size;
  j["initializer_range"] = 0.02;
  j["intermediate_size"] = intermediate_size;
  j["max_position_embeddings"] = max_position_embeddings;
  j["max_window_layers"] = num_hidden_layers;
  j["mlp_only_layers"] = mlp_only_layers;
  j["model_type"] = "qwen3_moe";
  j["moe_intermediate_size"] = moe_intermediate_size;
  j["norm_topk_prob"] = norm_topk_prob;
  j["num_attention_heads"] = num_attention_heads;
  j["num_experts"] = num_experts;
  j["num_experts_per_tok"] = num_experts_per_tok;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_key_value_heads"] = num_key_value_heads;
  j["output_router_logits"] = false;
  j["rms_norm_eps"] = rms_norm_eps;
  if (yarn) {
    j["rope_scaling"] = {
        {"beta_fast", yarn->beta_fast},
        {"beta_slow", yarn->beta_slow},
        {"factor", yarn->factor},
        {"original_max_position_embeddings", yarn->original_max_position_embeddings},
        {"rope_type", "yarn"}};
    if (yarn->mscale) j["rope_scaling"]["mscale"] = *yarn->mscale;
    if (yarn->mscale_all_dim != 0.0) j["rope_scaling"]["mscale_all_dim"] = yarn->mscale_all_dim;
    if (yarn->attention_factor) j["rope_scaling"]["attention_factor"] = *yarn->attention_factor;
    if (!yarn->truncate) j["rope_scaling"]["truncate"] = false;
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["rope_theta"] = rope_theta;
  j["router_aux_loss_coef"] = 0.001;
  j["sliding_window"] = nullptr;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["torch_dtype"] = torch_dtype;
  j["transformers_version"] = "4.51.0";
  j["use_cache"] = true;
  j["use_sliding_window"] = false;
  j["vocab_size"] = vocab_size;
  return j;
}

std::string architecture_of(const std::filesystem::path& dir) {
  const json doc = read_config_json(dir);
  const std::string origin = (dir / "config.json").string();
  if (!doc.is_object()) throw Error(origin + ": expected a JSON object");
  // Lenient: the family's own parse judges every other field.
  auto f = Fields::lenient(doc, origin);
  const json& architectures = f.list("architectures");
  if (architectures.empty()) f.fail("architectures", "must name the model's architecture, got []");
  return f.as_string("architectures[0]", architectures[0]);
}

}  // namespace tandem::model
