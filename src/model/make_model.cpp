#include "model/make_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>

#include "model/layout.h"
#include "model/model_folder.h"
#include "model/quantize.h"
#include "model/qwen3_moe_config.h"
#include "model/safetensors.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/file.h"
#include "util/hash.h"

namespace tandem::model {
namespace fs = std::filesystem;
namespace {

constexpr size_t kTinyShardBytes = size_t{4} << 20;
constexpr size_t kBenchShardBytes = size_t{2} << 30;

// Scales of the random weights (see init_for). Inputs of every linear are RMS-normalised or of
// unit scale, so std = gain / sqrt(fan_in) gives outputs of about `gain` per element.
constexpr float kOutputGain = 0.5f;  // o_proj and down_proj: layers add less than the residual
constexpr float kRouterGain = 2.0f;  // router logits spread ~2: scores far apart vs BF16 rounding
constexpr float kBiasStd = 0.1f;     // e_score_correction_bias: changes some choices, not most
constexpr float kHeadGain = 3.0f;    // LM head: logits of std ~3, peaked but not one-hot
constexpr float kNormStd = 0.1f;     // RMSNorm weights 1 +- 0.1

ModelConfig tiny_v3() {
  ModelConfig c;
  c.architecture = "DeepseekV3ForCausalLM";
  c.vocab_size = 129280;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.moe_intermediate_size = 32;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.q_lora_rank = 48;
  c.kv_lora_rank = 64;  // a whole 64-row block per head: the packed W_UK copy runs (weights.h)
  c.qk_nope_head_dim = 16;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 16;
  c.n_routed_experts = 8;
  c.n_shared_experts = 1;
  c.num_experts_per_tok = 2;
  c.n_group = 4;
  c.topk_group = 2;
  c.scoring_func = "sigmoid";
  c.topk_method = "noaux_tc";
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 2.5;
  c.first_k_dense_replace = 1;
  c.moe_layer_freq = 1;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  c.yarn = YarnScaling{40.0, 1.0, 1.0, 32.0, 1.0, 4096};  // DeepSeek-V3's values
  c.max_position_embeddings = 163840;
  c.num_nextn_predict_layers = 1;
  return c;
}

ModelConfig tiny_v2_lite() {
  ModelConfig c;
  c.architecture = "DeepseekV2ForCausalLM";
  c.vocab_size = 129280;
  c.hidden_size = 96;  // not a power of two, so kernels meet ragged tails
  c.intermediate_size = 192;
  c.moe_intermediate_size = 48;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.q_lora_rank = 0;
  c.kv_lora_rank = 32;
  c.qk_nope_head_dim = 16;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 16;
  c.n_routed_experts = 8;
  c.n_shared_experts = 2;
  c.num_experts_per_tok = 2;
  c.n_group = 1;
  c.topk_group = 1;
  c.scoring_func = "softmax";
  c.topk_method = "greedy";
  c.norm_topk_prob = false;
  c.routed_scaling_factor = 1.0;
  c.first_k_dense_replace = 1;
  c.moe_layer_freq = 1;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  c.yarn = YarnScaling{40.0, 0.707, 0.707, 32.0, 1.0, 4096};  // DeepSeek-V2-Lite's values
  c.max_position_embeddings = 163840;
  return c;
}

// DeepSeek-V2-Lite's widths with 3 layers (1 dense + 2 MoE): about 3.6 GB in BF16.
// DeepSeek-V3 has 61; anything deeper is a typo, not a model.
constexpr int64_t kMaxLayers = 256;

ModelConfig bench() {
  ModelConfig c = tiny_v2_lite();
  c.hidden_size = 2048;
  c.intermediate_size = 10944;
  c.moe_intermediate_size = 1408;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 16;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.n_routed_experts = 64;
  c.n_shared_experts = 2;
  c.num_experts_per_tok = 6;
  return c;
}

// Qwen3-MoE: a tiny model with one dense layer (mlp_only_layers), and Qwen3-30B-A3B's widths.
Qwen3MoeConfig tiny_qwen3_moe() {
  Qwen3MoeConfig c;
  c.vocab_size = 151936;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.moe_intermediate_size = 32;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.mlp_only_layers = {0};
  c.norm_topk_prob = true;
  c.rope_theta = 1000000.0;
  c.max_position_embeddings = 40960;
  return c;
}

Qwen3MoeConfig bench_qwen3_moe() {
  Qwen3MoeConfig c;  // Qwen3-30B-A3B's config.json, with 2 of its 48 layers
  c.vocab_size = 151936;
  c.hidden_size = 2048;
  c.intermediate_size = 6144;
  c.moe_intermediate_size = 768;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.head_dim = 128;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.norm_topk_prob = true;
  c.rope_theta = 1000000.0;
  c.max_position_embeddings = 40960;
  return c;
}

struct Qwen3Preset {
  const char* name;
  Qwen3MoeConfig (*config)();
};
constexpr Qwen3Preset kQwen3Presets[] = {{"tiny-qwen3-moe", tiny_qwen3_moe},
                                         {"bench-qwen3-moe", bench_qwen3_moe}};

const Qwen3Preset* qwen3_preset(const std::string& name) {
  for (const auto& p : kQwen3Presets)
    if (name == p.name) return &p;
  return nullptr;
}

// The tensors of a Qwen3MoeForCausalLM checkpoint, as Hugging Face names and shapes them.
std::vector<TensorSpec> qwen3_moe_layout(const Qwen3MoeConfig& c, DType dtype) {
  std::vector<TensorSpec> specs;
  const int64_t h = c.hidden_size, hd = c.head_dim;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    specs.push_back({std::move(name), dtype, std::move(shape)});
  };
  add("model.embed_tokens.weight", {c.vocab_size, h});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i);
    add(p + ".input_layernorm.weight", {h});
    add(p + ".post_attention_layernorm.weight", {h});
    add(p + ".self_attn.q_proj.weight", {c.num_attention_heads * hd, h});
    add(p + ".self_attn.k_proj.weight", {c.num_key_value_heads * hd, h});
    add(p + ".self_attn.v_proj.weight", {c.num_key_value_heads * hd, h});
    add(p + ".self_attn.o_proj.weight", {h, c.num_attention_heads * hd});
    add(p + ".self_attn.q_norm.weight", {hd});
    add(p + ".self_attn.k_norm.weight", {hd});
    auto mlp = [&](const std::string& prefix, int64_t inter) {
      add(prefix + ".gate_proj.weight", {inter, h});
      add(prefix + ".up_proj.weight", {inter, h});
      add(prefix + ".down_proj.weight", {h, inter});
    };
    if (c.is_moe_layer(i)) {
      add(p + ".mlp.gate.weight", {c.num_experts, h});
      for (int64_t e = 0; e < c.num_experts; ++e)
        mlp(p + ".mlp.experts." + std::to_string(e), c.moe_intermediate_size);
    } else {
      mlp(p + ".mlp", c.intermediate_size);
    }
  }
  add("model.norm.weight", {h});
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, h});
  return specs;
}

// splitmix64's output function.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Element i of a stream: splitmix64 at counter i, turned into an approximately standard normal
// value by summing its four 16-bit lanes (Irwin-Hall, bounded at +-3.46). Plain integer and
// float arithmetic, no libm, so the bytes are the same on every machine.
inline float normalish(uint64_t key, uint64_t i) {
  const uint64_t r = mix64(key + (i + 1) * 0x9E3779B97F4A7C15ULL);
  const uint32_t sum =
      static_cast<uint32_t>((r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48));
  // Mean 4 * 32767.5, variance 4 * (65536^2 - 1) / 12.
  constexpr float kScale = 1.7320508f / 65536.0f;
  return (static_cast<float>(sum) - 131070.0f) * kScale;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// What the generator needs of a model: its width, whether the head is the embedding, and (in a
// DeepSeek config) how weights are quantized.
struct GeneratedModel {
  int64_t hidden_size = 0;
  bool tie_word_embeddings = false;
  ModelConfig quantization;  // only fp8 / int8 are read
};

class WeightGenerator {
 public:
  WeightGenerator(GeneratedModel c, uint64_t seed, const std::vector<TensorSpec>& specs)
      : c_(std::move(c)), seed_(seed) {
    for (const auto& s : specs) shapes_[s.name] = s.shape;
  }

  void fill(const TensorSpec& spec, std::span<std::byte> out) const {
    const std::string& name = spec.name;
    if (is_weight_scale(name)) {
      const std::string weight = name.substr(0, name.rfind('.')) + ".weight";
      std::vector<float> scales;
      quantize(weight, nullptr, scales);
      std::memcpy(out.data(), scales.data(), out.size());
      return;
    }
    if (spec.dtype == DType::kF8E4M3 || spec.dtype == DType::kI8) {
      std::vector<float> scales;
      quantize(name, out.data(), scales);
      return;
    }
    const Init init = init_for(name, spec.shape);
    const size_t n = out.size() / dtype_size(spec.dtype);
    constexpr size_t kChunk = size_t{1} << 16;
    std::vector<float> buf(std::min(n, kChunk));
    for (size_t begin = 0; begin < n; begin += kChunk) {
      const size_t len = std::min(kChunk, n - begin);
      generate(init, begin, len, buf.data());
      from_f32(spec.dtype, buf.data(), out.data() + begin * dtype_size(spec.dtype), len);
    }
  }

 private:
  struct Init {
    uint64_t key;
    float mean, std;
  };

  // How each kind of tensor is initialised; see the gains above for why.
  Init init_for(const std::string& name, const std::vector<int64_t>& shape) const {
    const float h = static_cast<float>(c_.hidden_size);
    // The MTP module's embedding and head are copies of the main model's, as in DeepSeek-V3.
    if (ends_with(name, "embed_tokens.weight")) return {key("model.embed_tokens.weight"), 0.f, 1.f};
    if (name == "lm_head.weight" || ends_with(name, "shared_head.head.weight")) {
      if (c_.tie_word_embeddings) return {key("model.embed_tokens.weight"), 0.f, 1.f};
      return {key("lm_head.weight"), 0.f, kHeadGain / std::sqrt(h)};
    }
    if (ends_with(name, "norm.weight")) return {key(name), 1.f, kNormStd};
    if (ends_with(name, ".e_score_correction_bias")) return {key(name), 0.f, kBiasStd};
    if (ends_with(name, ".mlp.gate.weight")) return {key(name), 0.f, kRouterGain / std::sqrt(h)};
    if (shape.size() != 2) throw Error("make-model: no initialisation rule for tensor " + name);
    const float fan_in = static_cast<float>(shape[1]);
    const bool output = ends_with(name, ".o_proj.weight") || ends_with(name, ".down_proj.weight");
    return {key(name), 0.f, (output ? kOutputGain : 1.f) / std::sqrt(fan_in)};
  }

  uint64_t key(const std::string& name) const { return hash_bytes(name, seed_); }

  static void generate(const Init& init, size_t begin, size_t n, float* out) {
    for (size_t i = 0; i < n; ++i) out[i] = init.mean + init.std * normalish(init.key, begin + i);
  }

  // Quantizes the weight `name` as the config says (quantize.h); writes the quantized bytes to
  // `q` when non-null and the scales to `scales`.
  void quantize(const std::string& name, std::byte* q, std::vector<float>& scales) const {
    const auto it = shapes_.find(name);
    if (it == shapes_.end() || it->second.size() != 2)
      throw Error("make-model: no 2-D weight " + name + " to quantize");
    const int64_t rows = it->second[0], cols = it->second[1];
    std::vector<float> w(static_cast<size_t>(rows * cols));
    generate(init_for(name, it->second), 0, w.size(), w.data());
    quantize_weight(c_.quantization, w, rows, cols, q, scales);
  }

  GeneratedModel c_;
  uint64_t seed_;
  std::map<std::string, std::vector<int64_t>> shapes_;
};

void write_json(const fs::path& path, const nlohmann::ordered_json& doc) {
  write_file_atomically(path, doc.dump(2) + "\n");
}

// The decoder layers to write: the preset's, or --layers when given (1..kMaxLayers).
int64_t layers_of(const MakeModelOptions& options, int64_t preset_layers) {
  if (options.layers < 0 || options.layers > kMaxLayers)
    throw Error("make-model: --layers " + std::to_string(options.layers) + ": expected 1.." +
                std::to_string(kMaxLayers) + " (or 0 for the preset's " +
                std::to_string(preset_layers) + ")");
  return options.layers > 0 ? options.layers : preset_layers;
}

// config.json's torch_dtype for unquantized weights; null for FP8 and INT8.
const char* unquantized_torch_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF8E4M3:
    case DType::kI8:
      break;
  }
  return nullptr;
}

// The output folder with the tokenizer in it, checked against the preset's vocabulary; the
// tokenizer's BOS and EOS ids, which the config records.
struct TokenIds {
  std::optional<int64_t> bos, eos;
};
TokenIds prepare_folder(const MakeModelOptions& options, int64_t vocab_size) {
  std::error_code ec;
  fs::create_directories(options.out, ec);
  if (ec) throw Error(options.out.string() + ": cannot create folder: " + ec.message());
  if (!fs::exists(options.tokenizer_dir / "tokenizer.json"))
    throw Error("make-model: no tokenizer.json in " + options.tokenizer_dir.string());
  copy_tokenizer_files(options.tokenizer_dir, options.out, false, "make-model");
  const auto tok = text::Tokenizer::from_dir(options.out);
  if (static_cast<int64_t>(tok.vocab_size()) > vocab_size)
    throw Error("make-model: the tokenizer in " + options.tokenizer_dir.string() +
                " has ids up to " + std::to_string(tok.vocab_size() - 1) + ", beyond preset " +
                options.preset + "'s vocab_size " + std::to_string(vocab_size));
  TokenIds ids;
  if (tok.bos_id()) ids.bos = *tok.bos_id();
  if (tok.eos_id()) ids.eos = *tok.eos_id();
  return ids;
}

}  // namespace

std::vector<std::string> model_presets() {
  std::vector<std::string> names = {"tiny-v3", "tiny-v2-lite", "bench"};
  for (const auto& p : kQwen3Presets) names.push_back(p.name);
  return names;
}

bool is_qwen3_moe_preset(const std::string& name) {
  return qwen3_preset(name) != nullptr;
}

Qwen3MoeConfig qwen3_moe_preset_config(const std::string& name) {
  if (const Qwen3Preset* p = qwen3_preset(name)) return p->config();
  throw Error("'" + name + "' is not a Qwen3-MoE preset");
}

Qwen3MoeConfig make_qwen3_moe_model(const MakeModelOptions& options,
                                    const std::function<void(size_t, size_t)>& progress) {
  Qwen3MoeConfig c = qwen3_moe_preset_config(options.preset);
  c.num_hidden_layers = layers_of(options, c.num_hidden_layers);
  std::erase_if(c.mlp_only_layers, [&](int64_t l) { return l >= c.num_hidden_layers; });
  if (const char* t = unquantized_torch_dtype(options.dtype)) {
    c.torch_dtype = t;
  } else {
    throw Error("make-model: " + options.preset +
                " is written in f32, bf16 or f16 (quantized Qwen3-MoE checkpoints are not "
                "supported yet)");
  }
  const TokenIds ids = prepare_folder(options, c.vocab_size);
  c.bos_token_id = ids.bos;
  if (ids.eos) c.eos_token_ids = {*ids.eos};
  if (!(Qwen3MoeConfig::parse(nlohmann::json::parse(c.to_json().dump()),
                              "preset " + options.preset) == c))
    throw Error("make-model: preset " + options.preset +
                " does not round-trip through config.json");
  const std::vector<TensorSpec> specs = qwen3_moe_layout(c, options.dtype);
  ModelConfig unquantized;
  const WeightGenerator gen(GeneratedModel{c.hidden_size, c.tie_word_embeddings, unquantized},
                            options.seed, specs);
  const size_t shard = options.max_shard_bytes               ? options.max_shard_bytes
                       : options.preset == "bench-qwen3-moe" ? kBenchShardBytes
                                                             : kTinyShardBytes;
  write_checkpoint(
      options.out, specs,
      [&](const TensorSpec& spec, std::span<std::byte> out) { gen.fill(spec, out); }, shard,
      progress);
  write_json(options.out / "config.json", c.to_json());
  nlohmann::ordered_json gen_config;  // as Qwen3-30B-A3B's generation_config.json
  if (c.bos_token_id) gen_config["bos_token_id"] = *c.bos_token_id;
  gen_config["do_sample"] = true;
  if (ids.eos) gen_config["eos_token_id"] = *ids.eos;
  gen_config["temperature"] = 0.6;
  gen_config["top_k"] = 20;
  gen_config["top_p"] = 0.95;
  gen_config["transformers_version"] = "4.51.0";
  write_json(options.out / "generation_config.json", gen_config);
  return c;
}

ModelConfig preset_config(const std::string& name) {
  if (name == "tiny-v3") return tiny_v3();
  if (name == "tiny-v2-lite") return tiny_v2_lite();
  if (name == "bench") return bench();
  std::string known;
  for (const auto& p : model_presets()) known += (known.empty() ? "" : ", ") + p;
  if (is_qwen3_moe_preset(name))
    throw Error("preset '" + name + "' is a Qwen3-MoE model (qwen3_moe_preset_config)");
  throw Error("unknown model preset '" + name + "' (presets: " + known + ")");
}

ModelConfig make_model(const MakeModelOptions& options,
                       const std::function<void(size_t, size_t)>& progress) {
  ModelConfig c = preset_config(options.preset);
  c.num_hidden_layers = layers_of(options, c.num_hidden_layers);
  if (const char* t = unquantized_torch_dtype(options.dtype))
    c.torch_dtype = t;
  else if (options.dtype == DType::kF8E4M3)
    c.fp8 = Fp8Quantization{};
  else
    c.int8 = Int8Quantization{};

  const TokenIds ids = prepare_folder(options, c.vocab_size);
  c.bos_token_id = ids.bos;
  if (ids.eos) c.eos_token_ids = {*ids.eos};
  // The config must survive a round trip through config.json exactly.
  if (!(ModelConfig::parse(c.to_json(), "preset " + options.preset) == c))
    throw Error("make-model: preset " + options.preset +
                " does not round-trip through config.json");

  const std::vector<TensorSpec> specs = checkpoint_layout(c, options.dtype);
  const WeightGenerator gen(GeneratedModel{c.hidden_size, c.tie_word_embeddings, c}, options.seed,
                            specs);
  const size_t shard = options.max_shard_bytes
                           ? options.max_shard_bytes
                           : (options.preset == "bench" ? kBenchShardBytes : kTinyShardBytes);
  write_checkpoint(
      options.out, specs,
      [&](const TensorSpec& spec, std::span<std::byte> out) { gen.fill(spec, out); }, shard,
      progress);

  write_json(options.out / "config.json", c.to_json());
  // As DeepSeek-V3's generation_config.json (keys sorted, as transformers writes them).
  nlohmann::ordered_json gen_config;
  gen_config["_from_model_config"] = true;
  if (c.bos_token_id) gen_config["bos_token_id"] = *c.bos_token_id;
  gen_config["do_sample"] = true;
  if (ids.eos) gen_config["eos_token_id"] = *ids.eos;
  gen_config["temperature"] = 0.6;
  gen_config["top_p"] = 0.95;
  gen_config["transformers_version"] = "4.46.3";
  write_json(options.out / "generation_config.json", gen_config);
  return c;
}

}  // namespace tandem::model
