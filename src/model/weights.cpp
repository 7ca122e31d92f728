#include "model/weights.h"

#include <cstring>

#include "kernels/cpu/bf16.h"
#include "model/layout.h"
#include "model/tensor_binder.h"
#include "util/error.h"

namespace tandem::model {
namespace {

// W_UK of every head transposed and packed (AttentionWeights::k_up_t): rows h * latent + c hold
// kv_b[h * (nope + v) + r, c] for r < nope, in BF16 (an INT8 kv_b's values times their row scale,
// rounded to BF16: a transposed INT8 copy would need a scale per column). The plain copy is
// dropped once packed (only the packed row kernels read it); empty where kv_b is F32 or the
// packed kernels do not apply.
Matrix transposed_key_up(const Matrix& kv_b, int64_t heads, int64_t nope, int64_t v, int64_t latent,
                         util::HugePageArena& arena) {
  const bool int8 = kv_b.type == kernels::WeightType::kI8;
  if ((kv_b.type != kernels::WeightType::kBF16 && !int8) ||
      latent % kernels::PackedLayout::kBlockRows != 0)
    return Matrix{};
  std::vector<uint8_t> plain(static_cast<size_t>(heads * latent * nope) * sizeof(uint16_t));
  auto* dst = reinterpret_cast<uint16_t*>(plain.data());
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < nope; ++r) {
      const int64_t row = h * (nope + v) + r;
      for (int64_t c = 0; c < latent; ++c) {
        const int64_t at = row * latent + c;
        dst[(h * latent + c) * nope + r] =
            int8 ? kernels::f32_to_bf16(static_cast<const int8_t*>(kv_b.data)[at] *
                                        kv_b.row_scales[row])
                 : static_cast<const uint16_t*>(kv_b.data)[at];
      }
    }
  Matrix t = kernels::matrix_view(heads * latent, nope, kernels::WeightType::kBF16, plain.data());
  if (!kernels::pack_for_gemm(t, &arena)) return Matrix{};
  t.data = nullptr;  // nothing reads the plain rows (see DeepSeekModel::attention)
  return t;
}

// The DeepSeek tensors of a checkpoint, by their Hugging Face names.
class Binder : public TensorBinder {
 public:
  Binder(const Checkpoint& ckpt, const ModelConfig& config,
         const std::function<void(size_t, size_t)>& progress, const WeightLoadOptions& options = {})
      : TensorBinder(ckpt, config.fp8, progress), config_(config), options_(options) {}

  MlpWeights expert(int64_t layer, int64_t e) {
    return mlp("model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(e),
               config_.hidden_size, config_.moe_intermediate_size);
  }

  LayerWeights layer(int64_t index, bool is_moe) {
    const ModelConfig& c = config_;
    const std::string p = "model.layers." + std::to_string(index);
    const int64_t h = c.hidden_size, heads = c.num_attention_heads;
    LayerWeights l;
    l.input_norm = vector(p + ".input_layernorm.weight", h);
    l.post_attention_norm = vector(p + ".post_attention_layernorm.weight", h);
    AttentionWeights& a = l.attn;
    if (c.q_lora_rank > 0) {
      a.q_a = packed_matrix(p + ".self_attn.q_a_proj", c.q_lora_rank, h);
      a.q_a_norm = vector(p + ".self_attn.q_a_layernorm.weight", c.q_lora_rank);
      a.q_b = packed_matrix(p + ".self_attn.q_b_proj", heads * c.qk_head_dim(), c.q_lora_rank);
    } else {
      a.q = packed_matrix(p + ".self_attn.q_proj", heads * c.qk_head_dim(), h);
    }
    a.kv_a =
        packed_matrix(p + ".self_attn.kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, h);
    a.kv_a_norm = vector(p + ".self_attn.kv_a_layernorm.weight", c.kv_lora_rank);
    a.kv_b = packed_matrix(p + ".self_attn.kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim),
                           c.kv_lora_rank, PlainRows::kKeep);
    a.k_up_t =
        transposed_key_up(a.kv_b, heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank, arena());
    a.o = packed_matrix(p + ".self_attn.o_proj", h, heads * c.v_head_dim);
    l.is_moe = is_moe;
    if (!is_moe) {
      l.dense = mlp(p + ".mlp", h, c.intermediate_size);
      return l;
    }
    MoeWeights& m = l.moe;
    m.router = router(p + ".mlp.gate", c.n_routed_experts, h);
    if (c.uses_correction_bias())
      m.correction_bias = vector(p + ".mlp.gate.e_score_correction_bias", c.n_routed_experts);
    for (int64_t e = 0; options_.routed_experts && e < c.n_routed_experts; ++e) {
      m.experts.push_back(expert(index, e));
      m.slot_of_expert.push_back(static_cast<int32_t>(e));
    }
    if (c.n_shared_experts > 0) {
      m.shared = mlp(p + ".mlp.shared_experts", h, c.moe_intermediate_size * c.n_shared_experts);
      m.has_shared = true;
    }
    return l;
  }

 private:
  const ModelConfig& config_;
  WeightLoadOptions options_;
};

}  // namespace

MlpWeights load_expert(const Checkpoint& checkpoint, const ModelConfig& config, int64_t layer,
                       int64_t expert) {
  if (layer < 0 || layer >= config.num_hidden_layers + config.num_nextn_predict_layers ||
      !config.is_moe_layer(layer) || expert < 0 || expert >= config.n_routed_experts)
    throw Error("load_expert: layer " + std::to_string(layer) + " has no routed expert " +
                std::to_string(expert));
  const std::function<void(size_t, size_t)> no_progress;  // the binder keeps a reference
  Binder b(checkpoint, config, no_progress);
  return b.expert(layer, expert);
}

Weights Weights::load(Checkpoint checkpoint, const ModelConfig& config,
                      const std::function<void(size_t, size_t)>& progress,
                      const WeightLoadOptions& options) {
  Weights w{std::move(checkpoint), {}, {}, {}, {}, {}, 0};
  validate_checkpoint(w.checkpoint, config);
  Binder b(w.checkpoint, config, progress, options);
  const int64_t h = config.hidden_size;
  w.embed = b.matrix("model.embed_tokens", config.vocab_size, h);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i)
    w.layers.push_back(b.layer(i, config.is_moe_layer(i)));
  w.final_norm = b.vector("model.norm.weight", h);
  // The LM head is packed like the layers' matrices (it is a quarter of what a decode token
  // reads), unless it is the embedding, whose rows the lookup reads.
  if (options.int8_lm_head) {
    w.lm_head = config.tie_word_embeddings
                    ? b.int8_matrix_of_embedding("model.embed_tokens", w.embed)
                    : b.int8_matrix("lm_head", config.vocab_size, h);
  } else if (config.tie_word_embeddings) {
    w.lm_head = tied_head(w.embed);
  } else {
    w.lm_head = b.packed_matrix("lm_head", config.vocab_size, h);
  }
  // A tied model ignores an lm_head in its file (is_tied_away_head).
  if (config.tie_word_embeddings) b.skip("lm_head.");
  for (int64_t k = 0; k < config.num_nextn_predict_layers; ++k) {
    const int64_t index = config.num_hidden_layers + k;
    const std::string p = "model.layers." + std::to_string(index);
    if (!options.mtp) {
      b.skip(p + ".");
      continue;
    }
    MtpWeights m;
    m.embed = b.matrix(p + ".embed_tokens", config.vocab_size, h);
    m.enorm = b.vector(p + ".enorm.weight", h);
    m.hnorm = b.vector(p + ".hnorm.weight", h);
    m.eh_proj = b.packed_matrix(p + ".eh_proj", h, 2 * h);
    m.layer = b.layer(index, config.is_moe_layer(index));
    m.final_norm = b.vector(p + ".shared_head.norm.weight", h);
    m.head = options.int8_lm_head ? b.int8_matrix(p + ".shared_head.head", config.vocab_size, h)
                                  : b.packed_matrix(p + ".shared_head.head", config.vocab_size, h);
    w.mtp.push_back(std::move(m));
  }
  w.packed_bytes = b.arena().carved();
  return w;
}

}  // namespace tandem::model
