#include "model/weights.h"

#include <cstring>

#include "model/layout.h"
#include "model/quantize.h"
#include "util/error.h"

namespace tandem::model {
namespace {

class Binder {
 public:
  Binder(const Checkpoint& ckpt, const ModelConfig& config,
         const std::function<void(size_t, size_t)>& progress, const WeightLoadOptions& options = {})
      : ckpt_(ckpt),
        config_(config),
        progress_(progress),
        options_(options),
        total_(ckpt.tensors().size()) {}

  std::vector<float> vector(const std::string& name, int64_t n) {
    const TensorInfo& t = take(name, {n});
    std::vector<float> out(n);
    to_f32(t.dtype, t.data, out.data(), n);
    return out;
  }

  Matrix matrix(const std::string& name, int64_t rows, int64_t cols) {
    const TensorInfo& t = take(name + ".weight", {rows, cols});
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    switch (t.dtype) {
      case DType::kF32:
        m.type = kernels::WeightType::kF32;
        m.data = t.data;
        break;
      case DType::kBF16:
        m.type = kernels::WeightType::kBF16;
        m.data = t.data;
        break;
      case DType::kF16: {
        m.type = kernels::WeightType::kF32;
        m.storage.resize(static_cast<size_t>(rows * cols) * 4);
        to_f32(t.dtype, t.data, reinterpret_cast<float*>(m.storage.data()), rows * cols);
        m.data = m.storage.data();
        break;
      }
      case DType::kF8E4M3:
        dequantize_fp8(name, t, m);
        break;
      case DType::kI8: {
        m.type = kernels::WeightType::kI8;
        m.data = t.data;
        const TensorInfo& s = take(name + ".weight_scale", {rows, 1});
        m.row_scales.resize(rows);
        to_f32(s.dtype, s.data, m.row_scales.data(), rows);
        kernels::set_int8_row_sums(m);
        break;
      }
    }
    return m;
  }

  // Every matrix of a layer is packed (kernels::pack_for_gemm): an expert sees a few dozen tokens
  // of a prompt (oneDNN would repack its weights on every call), the dense and attention
  // matrices a whole prompt (exact-shape kernels on packed weights run at 93-97% of peak there,
  // the runtime-shape gemm on plain weights at 76-91%), and decode reads the same copy. The
  // plain rows in the mapped checkpoint are then given back, so the model is resident once,
  // unless something still reads them: `kKeep` matrices (absorbed attention's row ranges of
  // kv_b) and batch-invariant numerics (row kernels for every product).
  enum class PlainRows { kRelease, kKeep };

  Matrix packed_matrix(const std::string& name, int64_t rows, int64_t cols,
                       PlainRows plain = PlainRows::kRelease) {
    Matrix m = matrix(name, rows, cols);
    pack(m, plain);
    return m;
  }

  void pack(Matrix& m, PlainRows plain) {
    if (!kernels::pack_for_gemm(m)) return;
    // Converted weights (FP8 dequantised to BF16) live in `storage`, not in the mapping; they
    // stay, as both copies of an FP8 checkpoint's matrices do.
    if (plain == PlainRows::kRelease && m.storage.empty() && !kernels::batch_invariant())
      release_pages(m.data, m.bytes());
  }

  // The weight `name` quantized to INT8 with one scale per row (the W8A8 rule of
  // model/quantize.h), in chunks of rows so no float32 copy of a whole head is ever made.
  Matrix int8_matrix(const std::string& name, int64_t rows, int64_t cols,
                     PlainRows plain = PlainRows::kRelease) {
    const TensorInfo& t = take(name + ".weight", {rows, cols});
    if (t.dtype != DType::kBF16 && t.dtype != DType::kF32 && t.dtype != DType::kF16)
      throw Error(name + ".weight: INT8 quantization at load needs BF16, F16 or F32 weights, not " +
                  std::string(dtype_name(t.dtype)));
    ModelConfig rule = config_;
    rule.fp8.reset();
    rule.int8 = Int8Quantization{};
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    m.type = kernels::WeightType::kI8;
    m.storage.resize(static_cast<size_t>(rows * cols));
    m.row_scales.resize(static_cast<size_t>(rows));
    constexpr int64_t kChunkRows = 1024;
    std::vector<float> wide, scales;
    const size_t element = dtype_size(t.dtype);
    for (int64_t r0 = 0; r0 < rows; r0 += kChunkRows) {
      const int64_t n = std::min(kChunkRows, rows - r0);
      wide.resize(static_cast<size_t>(n * cols));
      to_f32(t.dtype, t.data + static_cast<size_t>(r0 * cols) * element, wide.data(), n * cols);
      quantize_weight(rule, wide, n, cols,
                      reinterpret_cast<std::byte*>(m.storage.data()) + r0 * cols, scales);
      std::copy(scales.begin(), scales.end(), m.row_scales.begin() + r0);
    }
    m.data = m.storage.data();
    kernels::set_int8_row_sums(m);
    // The INT8 rows stay beside the packed copy (products oneDNN has no kernel for read them);
    // the source rows in the mapping are not read again, unless they are a tied embedding's.
    kernels::pack_for_gemm(m);
    if (plain == PlainRows::kRelease) release_pages(t.data, t.nbytes);
    return m;
  }

  MlpWeights mlp(const std::string& prefix, int64_t inter) {
    const int64_t h = config_.hidden_size;
    MlpWeights m{packed_matrix(prefix + ".gate_proj", inter, h),
                 packed_matrix(prefix + ".up_proj", inter, h),
                 packed_matrix(prefix + ".down_proj", h, inter)};
    return m;
  }

  MlpWeights expert(int64_t layer, int64_t e) {
    return mlp("model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(e),
               config_.moe_intermediate_size);
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
    a.o = packed_matrix(p + ".self_attn.o_proj", h, heads * c.v_head_dim);
    l.is_moe = is_moe;
    if (!is_moe) {
      l.dense = mlp(p + ".mlp", c.intermediate_size);
      return l;
    }
    MoeWeights& m = l.moe;
    m.router = matrix(p + ".mlp.gate", c.n_routed_experts, h);
    // The router runs on float32 activations (its top-k must not flip on rounding); float32
    // weights let a prompt's routing logits come from oneDNN's float32 GEMM instead of row dots
    // (exact widening; 4 bytes per weight of a small matrix).
    if (m.router.type == kernels::WeightType::kBF16) {
      // A new buffer: the BF16 bytes may live in `storage` (dequantised at load).
      std::vector<uint8_t> wide(static_cast<size_t>(m.router.rows * m.router.cols) * 4);
      to_f32(DType::kBF16, m.router.data, reinterpret_cast<float*>(wide.data()),
             static_cast<size_t>(m.router.rows * m.router.cols));
      m.router.storage = std::move(wide);
      m.router.data = m.router.storage.data();
      m.router.type = kernels::WeightType::kF32;
    }
    if (c.uses_correction_bias())
      m.correction_bias = vector(p + ".mlp.gate.e_score_correction_bias", c.n_routed_experts);
    for (int64_t e = 0; options_.routed_experts && e < c.n_routed_experts; ++e) {
      m.experts.push_back(expert(index, e));
      m.slot_of_expert.push_back(static_cast<int32_t>(e));
    }
    if (c.n_shared_experts > 0) {
      m.shared = mlp(p + ".mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts);
      m.has_shared = true;
    }
    return l;
  }

 private:
  const TensorInfo& take(const std::string& name, const std::vector<int64_t>& shape) {
    const TensorInfo& t = ckpt_.get(name, shape);
    if (progress_) progress_(++done_, total_);
    return t;
  }

  // W = W_fp8 * scale_inv[r / 128, c / 128], stored as BF16.
  void dequantize_fp8(const std::string& name, const TensorInfo& t, Matrix& m) {
    const int64_t br = config_.fp8 ? config_.fp8->block_rows : 128;
    const int64_t bc = config_.fp8 ? config_.fp8->block_cols : 128;
    const int64_t sr = (m.rows + br - 1) / br, sc = (m.cols + bc - 1) / bc;
    const TensorInfo& s = take(name + ".weight_scale_inv", {sr, sc});
    std::vector<float> scales(sr * sc);
    to_f32(s.dtype, s.data, scales.data(), sr * sc);
    m.type = kernels::WeightType::kBF16;
    m.storage.resize(static_cast<size_t>(m.rows * m.cols) * 2);
    auto* out = reinterpret_cast<uint16_t*>(m.storage.data());
    const auto* in = reinterpret_cast<const uint8_t*>(t.data);
    for (int64_t r = 0; r < m.rows; ++r)
      for (int64_t col = 0; col < m.cols; ++col)
        out[r * m.cols + col] =
            f32_to_bf16(f8e4m3_to_f32(in[r * m.cols + col]) * scales[(r / br) * sc + col / bc]);
    m.data = m.storage.data();
  }

  const Checkpoint& ckpt_;
  const ModelConfig& config_;
  const std::function<void(size_t, size_t)>& progress_;
  WeightLoadOptions options_;
  size_t done_ = 0, total_;
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

Weights Weights::load(const std::filesystem::path& dir, const ModelConfig& config,
                      const std::function<void(size_t, size_t)>& progress,
                      const WeightLoadOptions& options) {
  Weights w{Checkpoint::open(dir), {}, {}, {}, {}, {}};
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
    // A tied embedding still looks its rows up in the mapping.
    w.lm_head = config.tie_word_embeddings ? b.int8_matrix("model.embed_tokens", config.vocab_size,
                                                           h, Binder::PlainRows::kKeep)
                                           : b.int8_matrix("lm_head", config.vocab_size, h);
  } else if (config.tie_word_embeddings) {
    w.lm_head = b.matrix("model.embed_tokens", config.vocab_size, h);
  } else {
    w.lm_head = b.packed_matrix("lm_head", config.vocab_size, h);
  }
  for (int64_t k = 0; k < config.num_nextn_predict_layers; ++k) {
    const int64_t index = config.num_hidden_layers + k;
    const std::string p = "model.layers." + std::to_string(index);
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
  return w;
}

}  // namespace tandem::model
