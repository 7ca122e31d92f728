#include "model/layout.h"

#include <functional>
#include <set>

#include "model/tensor_binder.h"
#include "util/error.h"
#include "util/utf8.h"

namespace tandem::model {
namespace {

std::string describe(DType dtype, const std::vector<int64_t>& shape) {
  return std::string(dtype_name(dtype)) + " " + shape_string(shape);
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Produces the layout one tensor at a time, so that checking a checkpoint against it needs no
// list of every expected tensor: memory follows the checkpoint, not what the config claims.
class Builder {
 public:
  using Sink = std::function<void(TensorSpec&&)>;
  Builder(const ModelConfig& c, DType weight_dtype, Sink sink)
      : c_(c),
        weight_(weight_dtype),
        other_(c.quantized() ? DType::kBF16 : weight_dtype),
        sink_(std::move(sink)) {}

  void build() {
    const int64_t h = c_.hidden_size;
    add("model.embed_tokens.weight", other_, {c_.vocab_size, h});
    for (int64_t i = 0; i < c_.num_hidden_layers; ++i) layer(i);
    add("model.norm.weight", other_, {h});
    if (!c_.tie_word_embeddings) add("lm_head.weight", other_, {c_.vocab_size, h});
    for (int64_t k = 0; k < c_.num_nextn_predict_layers; ++k) {
      const int64_t index = c_.num_hidden_layers + k;
      const std::string p = "model.layers." + std::to_string(index);
      add(p + ".embed_tokens.weight", other_, {c_.vocab_size, h});
      add(p + ".enorm.weight", other_, {h});
      add(p + ".hnorm.weight", other_, {h});
      // eh_proj is a plain nn.Linear in the releases' MTP module: never quantized.
      add(p + ".eh_proj.weight", other_, {h, 2 * h});
      layer(index);
      add(p + ".shared_head.norm.weight", other_, {h});
      add(p + ".shared_head.head.weight", other_, {c_.vocab_size, h});
    }
  }

 private:
  void add(std::string name, DType dtype, std::vector<int64_t> shape) {
    sink_(TensorSpec{std::move(name), dtype, std::move(shape)});
  }

  // A linear layer that the checkpoint's quantization applies to.
  void linear(const std::string& prefix, int64_t out, int64_t in) {
    add(prefix + ".weight", weight_, {out, in});
    if (c_.fp8) {
      add(prefix + ".weight_scale_inv", DType::kF32,
          {ceil_div(out, c_.fp8->block_rows), ceil_div(in, c_.fp8->block_cols)});
    } else if (c_.int8) {
      add(prefix + ".weight_scale", DType::kF32, {out, 1});
    }
  }

  void mlp(const std::string& prefix, int64_t inter) {
    const int64_t h = c_.hidden_size;
    linear(prefix + ".gate_proj", inter, h);
    linear(prefix + ".up_proj", inter, h);
    linear(prefix + ".down_proj", h, inter);
  }

  void layer(int64_t index) {
    const std::string p = "model.layers." + std::to_string(index);
    const int64_t h = c_.hidden_size, heads = c_.num_attention_heads;
    add(p + ".input_layernorm.weight", other_, {h});
    const std::string a = p + ".self_attn";
    if (c_.q_lora_rank > 0) {
      linear(a + ".q_a_proj", c_.q_lora_rank, h);
      add(a + ".q_a_layernorm.weight", other_, {c_.q_lora_rank});
      linear(a + ".q_b_proj", heads * c_.qk_head_dim(), c_.q_lora_rank);
    } else {
      linear(a + ".q_proj", heads * c_.qk_head_dim(), h);
    }
    linear(a + ".kv_a_proj_with_mqa", c_.kv_lora_rank + c_.qk_rope_head_dim, h);
    add(a + ".kv_a_layernorm.weight", other_, {c_.kv_lora_rank});
    linear(a + ".kv_b_proj", heads * (c_.qk_nope_head_dim + c_.v_head_dim), c_.kv_lora_rank);
    linear(a + ".o_proj", h, heads * c_.v_head_dim);
    add(p + ".post_attention_layernorm.weight", other_, {h});
    const std::string m = p + ".mlp";
    if (!c_.is_moe_layer(index)) {
      mlp(m, c_.intermediate_size);
      return;
    }
    add(m + ".gate.weight", other_, {c_.n_routed_experts, h});  // the router: never quantized
    if (c_.uses_correction_bias())
      add(m + ".gate.e_score_correction_bias", DType::kF32, {c_.n_routed_experts});
    for (int64_t e = 0; e < c_.n_routed_experts; ++e)
      mlp(m + ".experts." + std::to_string(e), c_.moe_intermediate_size);
    if (c_.n_shared_experts > 0)
      mlp(m + ".shared_experts", c_.moe_intermediate_size * c_.n_shared_experts);
  }

  const ModelConfig& c_;
  DType weight_, other_;
  Sink sink_;
};

void check_weight_dtype(const ModelConfig& config, DType weight_dtype) {
  const std::string dt(dtype_name(weight_dtype));
  if (config.fp8 && weight_dtype != DType::kF8E4M3)
    throw Error("checkpoint layout: the config's quantization_config is fp8, but the weights are " +
                dt + " (expected F8_E4M3)");
  if (config.int8 && weight_dtype != DType::kI8)
    throw Error(
        "checkpoint layout: the config's quantization_config is w8a8_int8, but the "
        "weights are " +
        dt + " (expected I8)");
  if (!config.quantized() && !is_float_dtype(weight_dtype))
    throw Error("checkpoint layout: " + dt + " weights need a quantization_config in config.json " +
                "(fp8 for F8_E4M3, w8a8_int8 for I8)");
}

}  // namespace

std::vector<TensorSpec> checkpoint_layout(const ModelConfig& config, DType weight_dtype) {
  check_weight_dtype(config, weight_dtype);
  std::vector<TensorSpec> out;
  Builder(config, weight_dtype, [&](TensorSpec&& s) { out.push_back(std::move(s)); }).build();
  return out;
}

DType checkpoint_weight_dtype(const Checkpoint& checkpoint, const ModelConfig& config) {
  if (config.fp8) return DType::kF8E4M3;
  if (config.int8) return DType::kI8;
  const std::string name = "model.embed_tokens.weight";
  const TensorInfo* embed = checkpoint.find(name);
  if (!embed)
    throw Error("checkpoint " + checkpoint.dir().string() + ": missing tensor '" + name +
                "' (expected " + describe(DType::kBF16, {config.vocab_size, config.hidden_size}) +
                ")");
  if (!is_float_dtype(embed->dtype))
    throw Error("checkpoint " + checkpoint.dir().string() + ": tensor '" + name + "' in " +
                embed->file + " has dtype " + std::string(dtype_name(embed->dtype)) +
                ", expected F32, BF16 or F16");
  return embed->dtype;
}

std::string drop_absent_mtp_layers(const Checkpoint& checkpoint, ModelConfig& config) {
  const int64_t first = config.num_hidden_layers, count = config.num_nextn_predict_layers;
  const auto& tensors = checkpoint.tensors();
  for (int64_t k = 0; k < count; ++k) {
    const std::string prefix = "model.layers." + std::to_string(first + k) + ".";
    for (auto it = tensors.lower_bound(prefix);
         it != tensors.end() && it->first.starts_with(prefix); ++it)
      if (!is_unused_rotary_buffer(it->first)) return "";  // an inv_freq alone is no MTP layer
  }
  if (count <= 0) return "";
  config.num_nextn_predict_layers = 0;
  const std::string layers = count == 1 ? "model.layers." + std::to_string(first) + ".*"
                                        : "model.layers." + std::to_string(first) + "-" +
                                              std::to_string(first + count - 1) + ".*";
  return (checkpoint.dir() / "config.json").string() +
         " says num_nextn_predict_layers: " + std::to_string(count) +
         ", but the checkpoint has no MTP tensors (" + layers + "; derived checkpoints strip them)";
}

void validate_checkpoint(const Checkpoint& checkpoint, const ModelConfig& config) {
  const DType weight_dtype = checkpoint_weight_dtype(checkpoint, config);
  check_weight_dtype(config, weight_dtype);
  // The first few problems are kept for the message and the rest only counted, so a config that
  // expects millions of tensors the checkpoint lacks costs time, not memory.
  constexpr size_t kShown = 4;
  std::vector<std::string> problems;
  size_t problem_count = 0;
  auto problem = [&](std::string msg) {
    if (problems.size() < kShown) problems.push_back(std::move(msg));
    ++problem_count;
  };
  std::set<const TensorInfo*> expected;
  Builder(config, weight_dtype, [&](TensorSpec&& s) {
    const TensorInfo* t = checkpoint.find(s.name);
    const std::string want = describe(s.dtype, s.shape);
    if (!t) {
      problem("missing tensor '" + s.name + "' (expected " + want + ")");
      return;
    }
    expected.insert(t);
    const bool dtype_ok =
        t->dtype == s.dtype || (is_float_dtype(t->dtype) && is_float_dtype(s.dtype));
    if (t->shape != s.shape || !dtype_ok) {
      std::string msg = "tensor '" + s.name + "' in " + t->file + " is " +
                        describe(t->dtype, t->shape) + ", expected " + want;
      if (!dtype_ok && !config.quantized() && !is_float_dtype(t->dtype))
        msg += " (config.json has no quantization_config)";
      problem(msg);
    }
  }).build();
  for (const auto& [name, t] : checkpoint.tensors()) {
    if (expected.count(&t)) continue;
    if (config.tie_word_embeddings && is_tied_away_head(name)) continue;
    if (is_unused_rotary_buffer(name)) continue;
    // The name is the file's: quoted escaped and cut, as the safetensors reader quotes names.
    problem("unexpected tensor " + utf8::quote_escaped(name, kShownTensorNameBytes) + " in " +
            t.file + " (not part of a " + config.architecture + " checkpoint with " +
            std::to_string(config.num_hidden_layers) + " layers, " +
            std::to_string(config.num_nextn_predict_layers) + " MTP layers" +
            (config.tie_word_embeddings ? ", tied embeddings" : "") + " and " +
            std::string(dtype_name(weight_dtype)) + " weights)");
  }
  if (problems.empty()) return;
  std::string msg = "checkpoint " + checkpoint.dir().string() + ": " + problems.front();
  if (problem_count > 1) {
    msg += "; " + std::to_string(problem_count - 1) + " more problem" +
           (problem_count > 2 ? "s" : "") + ", e.g. ";
    for (size_t i = 1; i < problems.size() && i < 4; ++i) msg += (i > 1 ? "; " : "") + problems[i];
  }
  throw Error(msg);
}

}  // namespace tandem::model
