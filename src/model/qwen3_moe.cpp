#include "model/qwen3_moe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kernels/cpu/ops.h"
#include "model/dtype.h"
#include "model/moe_experts.h"
#include "util/error.h"
#include "util/utf8.h"

namespace tandem::model {
namespace {

// Query rows of a sequence from which attention runs as GEMMs rather than per-row dot products.
constexpr int64_t kGemmAttentionRows = 16;

}  // namespace

using kernels::Matrix;

Qwen3MoeModel::Qwen3MoeModel(Qwen3MoeConfig config, Checkpoint checkpoint)
    : config_(std::move(config)),
      checkpoint_(std::move(checkpoint)),
      rope_(config_.head_dim, config_.rope_theta, config_.yarn, config_.rope_mscale()) {}

Qwen3MoeModel Qwen3MoeModel::load(const std::filesystem::path& dir,
                                  const std::function<void(size_t, size_t)>& progress) {
  Qwen3MoeModel m(Qwen3MoeConfig::load(dir), Checkpoint::open(dir));
  const Qwen3MoeConfig& c = m.config_;
  // Tensors of the file that are never read (see each predicate).
  const auto unread = [&](const std::string& name) {
    return (c.tie_word_embeddings && is_tied_away_head(name)) || is_unused_rotary_buffer(name);
  };
  // The binder checks shapes only; a quantized tensor would be widened as if it were a float
  // (a norm) or taken for a scaled weight whose scales a Qwen3 checkpoint never has.
  for (const auto& [name, info] : m.checkpoint_.tensors())
    if (!is_float_dtype(info.dtype) && !unread(name))
      throw Error(m.checkpoint_.dir().string() + ": tensor " +
                  utf8::quote_escaped(name, kShownTensorNameBytes) + " in " + info.file + " is " +
                  std::string(dtype_name(info.dtype)) +
                  ", expected F32, BF16 or F16 (quantized Qwen3-MoE checkpoints are not "
                  "supported yet)");
  TensorBinder b(m.checkpoint_, std::nullopt, progress);
  const int64_t h = c.hidden_size, hd = c.head_dim;
  m.embed = b.matrix("model.embed_tokens", c.vocab_size, h);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i);
    Qwen3LayerWeights l;
    l.input_norm = b.vector(p + ".input_layernorm.weight", h);
    l.post_attention_norm = b.vector(p + ".post_attention_layernorm.weight", h);
    l.q = b.packed_matrix(p + ".self_attn.q_proj", c.num_attention_heads * hd, h);
    l.k = b.packed_matrix(p + ".self_attn.k_proj", c.num_key_value_heads * hd, h);
    l.v = b.packed_matrix(p + ".self_attn.v_proj", c.num_key_value_heads * hd, h);
    l.o = b.packed_matrix(p + ".self_attn.o_proj", h, c.num_attention_heads * hd);
    l.q_norm = b.vector(p + ".self_attn.q_norm.weight", hd);
    l.k_norm = b.vector(p + ".self_attn.k_norm.weight", hd);
    l.is_moe = c.is_moe_layer(i);
    if (l.is_moe) {
      l.router = b.router(p + ".mlp.gate", c.num_experts, h);
      for (int64_t e = 0; e < c.num_experts; ++e)
        l.experts.push_back(
            b.mlp(p + ".mlp.experts." + std::to_string(e), h, c.moe_intermediate_size));
    } else {
      l.dense = b.mlp(p + ".mlp", h, c.intermediate_size);
    }
    m.layers_.push_back(std::move(l));
  }
  m.final_norm_ = b.vector("model.norm.weight", h);
  m.lm_head =
      c.tie_word_embeddings ? tied_head(m.embed) : b.packed_matrix("lm_head", c.vocab_size, h);
  if (c.tie_word_embeddings) b.skip("lm_head.");
  // Every tensor of the checkpoint must have a place: another tensor means another model.
  for (const auto& [name, info] : m.checkpoint_.tensors())
    if (!b.taken(name) && !unread(name))
      throw Error(m.checkpoint_.dir().string() + ": tensor " +
                  utf8::quote_escaped(name, kShownTensorNameBytes) +
                  " is not part of a Qwen3-MoE model of this config");
  m.expert_counts_.assign(size_t(c.num_hidden_layers),
                          std::vector<uint64_t>(size_t(std::max<int64_t>(c.num_experts, 0)), 0));
  return m;
}

LatentType Qwen3MoeModel::default_cache_type() const {
  return qwen3_cache_shape(config_, 1).type;
}

LatentCacheShape qwen3_cache_shape(const Qwen3MoeConfig& c, int64_t block_size,
                                   std::optional<LatentType> type) {
  LatentCacheShape s;
  s.layers = c.num_hidden_layers;
  s.block_size = block_size;
  s.latent_dim = 2 * c.num_key_value_heads * c.head_dim;  // K | V
  s.rope_dim = 0;
  s.type = type.value_or(c.torch_dtype == "float32" ? LatentType::kF32 : LatentType::kBF16);
  return s;
}

LatentCacheShape Qwen3MoeModel::cache_shape(int64_t block_size,
                                            std::optional<LatentType> type) const {
  return qwen3_cache_shape(config_, block_size, type);
}

// Queries, keys and values of the step's tokens; keys and values go to the cache, then each
// token attends causally to its sequence's cached positions.
void Qwen3MoeModel::attention(const Qwen3LayerWeights& w, int64_t layer,
                              std::span<const SequenceStep> batch,
                              const std::vector<int64_t>& positions, const float* x,
                              LatentCache& cache, float* out) const {
  const Qwen3MoeConfig& c = config_;
  const int64_t n = static_cast<int64_t>(positions.size());
  const int64_t hd = c.head_dim, heads = c.num_attention_heads, kv = c.num_key_value_heads;
  const int64_t group = heads / kv, bs = cache.shape().block_size;
  // Reused per thread: fresh buffers would cost page faults on every layer.
  thread_local std::vector<float> q, k, v, keys, values;
  q.resize(size_t(n * heads * hd));
  k.resize(size_t(n * kv * hd));
  v.resize(size_t(n * kv * hd));
  kernels::matmul(w.q, x, n, q.data());
  kernels::matmul(w.k, x, n, k.data());
  kernels::matmul(w.v, x, n, v.data());
  // RMSNorm on every head, then RoPE.
  kernels::rmsnorm(q.data(), w.q_norm.data(), n * heads, hd, c.rms_norm_eps, q.data());
  kernels::rmsnorm(k.data(), w.k_norm.data(), n * kv, hd, c.rms_norm_eps, k.data());
  for (int64_t t = 0; t < n; ++t) {
    rope_.apply_halves(q.data() + t * heads * hd, hd, heads, positions[size_t(t)]);
    rope_.apply_halves(k.data() + t * kv * hd, hd, kv, positions[size_t(t)]);
  }
  // Store the step's keys and values, so every token reads its context from one place.
  int64_t row = 0;
  std::vector<float> entry(size_t(2 * kv * hd));
  for (const SequenceStep& s : batch)
    for (size_t i = 0; i < s.tokens.size(); ++i, ++row) {
      const int64_t pos = s.start + static_cast<int64_t>(i);
      std::copy_n(k.data() + row * kv * hd, kv * hd, entry.data());
      std::copy_n(v.data() + row * kv * hd, kv * hd, entry.data() + kv * hd);
      cache.store(s.blocks[size_t(pos / bs)], layer, pos % bs, entry.data());
    }
  const float scale = static_cast<float>(c.softmax_scale());
  row = 0;
  for (const SequenceStep& s : batch) {
    const int64_t len = s.start + static_cast<int64_t>(s.tokens.size());
    // The sequence's cached keys and values, [len, kv * hd] each.
    keys.resize(size_t(len * kv * hd));
    values.resize(size_t(len * kv * hd));
    for (int64_t p = 0; p < len; ++p) {
      const int32_t block = s.blocks[size_t(p / bs)];
      cache.load(block, layer, p % bs, 0, kv * hd, keys.data() + p * kv * hd);
      cache.load(block, layer, p % bs, kv * hd, kv * hd, values.data() + p * kv * hd);
    }
    const auto count = static_cast<int64_t>(s.tokens.size());
    if (count >= kGemmAttentionRows) {
      // Many queries (a prefill chunk): per head, scores Q K^T and outputs P V as GEMMs over the
      // group's K and V, the causal mask applied to the scores' rows.
      thread_local std::vector<float> probs;
      probs.resize(size_t(count * len));
      float* pp = probs.data();  // (the thread-local vector, not the workers' own)
      for (int64_t hq = 0; hq < heads; ++hq) {
        const int64_t g = hq / group;
        kernels::gemm_f32(count, len, hd, q.data() + (row * heads + hq) * hd, heads * hd,
                          keys.data() + g * hd, kv * hd, /*b_transposed=*/true, pp, len);
#pragma omp parallel for schedule(static) if (count * len > (1 << 14))
        for (int64_t i = 0; i < count; ++i) {
          float* r = pp + i * len;
          const int64_t visible = s.start + i + 1;
          for (int64_t j = 0; j < visible; ++j) r[j] *= scale;
          kernels::softmax(r, visible);
          std::fill(r + visible, r + len, 0.0f);
        }
        kernels::gemm_f32(count, hd, len, pp, len, values.data() + g * hd, kv * hd,
                          /*b_transposed=*/false, out + (row * heads + hq) * hd, heads * hd);
      }
      row += count;
      continue;
    }
    // Few queries (decode): every (token, query head) on its own over the group's K and V.
    // (Pointers, not the thread-local vectors: other threads have their own.)
    const float* qp = q.data();
    const float* kp = keys.data();
    const float* vp = values.data();
#pragma omp parallel for schedule(dynamic, 4) if (count * heads * len > (1 << 16))
    for (int64_t job = 0; job < count * heads; ++job) {
      const int64_t i = job / heads, hq = job % heads, g = hq / group;
      const int64_t visible = s.start + i + 1;  // causal
      thread_local std::vector<float> scores;
      scores.resize(size_t(visible));
      const float* qh = qp + ((row + i) * heads + hq) * hd;
      for (int64_t p = 0; p < visible; ++p)
        scores[size_t(p)] = kernels::dot(qh, kp + (p * kv + g) * hd, hd) * scale;
      kernels::softmax(scores.data(), visible);
      float* o = out + ((row + i) * heads + hq) * hd;
      std::fill(o, o + hd, 0.0f);
      for (int64_t p = 0; p < visible; ++p)
        kernels::axpy(scores[size_t(p)], vp + (p * kv + g) * hd, o, hd);
    }
    row += count;
  }
}

void Qwen3MoeModel::feed_forward(const Qwen3LayerWeights& w, int64_t layer, const float* x,
                                 int64_t n, float* out, float* margins) const {
  const Qwen3MoeConfig& c = config_;
  if (!w.is_moe) {
    swiglu(w.dense, x, nullptr, n, out);
    return;
  }
  const int64_t experts = c.num_experts, top = c.num_experts_per_tok;
  thread_local std::vector<float> logits;
  logits.resize(size_t(n * experts));
  kernels::matmul_f32_activations(w.router, x, n, logits.data());
  // Per expert, the rows routed to it and their weights.
  std::vector<std::vector<std::pair<int64_t, float>>> routed(static_cast<size_t>(experts));
  std::vector<int64_t> order(static_cast<size_t>(experts));
  for (int64_t t = 0; t < n; ++t) {
    float* p = logits.data() + t * experts;
    std::iota(order.begin(), order.end(), 0);
    const int64_t ranked = std::min(top + 1, experts);
    std::partial_sort(order.begin(), order.begin() + ranked, order.end(),
                      [&](int64_t a, int64_t b) { return p[a] != p[b] ? p[a] > p[b] : a < b; });
    // How far the choice is from going another way, in logit units (softmax keeps the order).
    if (top < experts)
      margins[t] = std::min(margins[t], p[order[size_t(top - 1)]] - p[order[size_t(top)]]);
    kernels::softmax(p, experts);
    double sum = 0;
    for (int64_t j = 0; j < top; ++j) sum += p[order[size_t(j)]];
    for (int64_t j = 0; j < top; ++j) {
      const int64_t e = order[size_t(j)];
      const float weight = c.norm_topk_prob ? static_cast<float>(p[e] / sum) : p[e];
      routed[size_t(e)].emplace_back(t, weight);
      ++expert_counts_[size_t(layer)][size_t(e)];
    }
  }
  routed_experts(w.experts, routed, x, n, c.hidden_size, nullptr, out);
}

StepOutput Qwen3MoeModel::forward(std::span<const SequenceStep> batch, LatentCache& cache) const {
  const Qwen3MoeConfig& c = config_;
  const int64_t h = c.hidden_size, bs = cache.shape().block_size;
  std::vector<int64_t> positions;
  std::vector<int32_t> ids;
  for (const SequenceStep& s : batch) {
    const int64_t end = s.start + static_cast<int64_t>(s.tokens.size());
    if (static_cast<int64_t>(s.blocks.size()) * bs < end)
      throw Error("forward: a block table of " + std::to_string(s.blocks.size()) +
                  " blocks cannot hold " + std::to_string(end) + " positions");
    for (size_t i = 0; i < s.tokens.size(); ++i) {
      const int32_t id = s.tokens[i];
      if (id < 0 || id >= c.vocab_size)
        throw Error("forward: token id " + std::to_string(id) + " is outside the vocabulary of " +
                    std::to_string(c.vocab_size));
      ids.push_back(id);
      positions.push_back(s.start + static_cast<int64_t>(i));
    }
  }
  const auto n = static_cast<int64_t>(ids.size());
  thread_local std::vector<float> x, normed, delta, attn;
  x.resize(size_t(n * h));
  normed.resize(size_t(n * h));
  delta.resize(size_t(n * h));
  attn.resize(size_t(n * c.num_attention_heads * c.head_dim));
  for (int64_t t = 0; t < n; ++t) kernels::matrix_row(embed, ids[size_t(t)], x.data() + t * h);
  StepOutput out;
  out.routing_margin.assign(size_t(n), std::numeric_limits<float>::infinity());
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const Qwen3LayerWeights& w = layers_[size_t(l)];
    kernels::rmsnorm(x.data(), w.input_norm.data(), n, h, c.rms_norm_eps, normed.data());
    attention(w, l, batch, positions, normed.data(), cache, attn.data());
    kernels::matmul(w.o, attn.data(), n, delta.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
    kernels::rmsnorm(x.data(), w.post_attention_norm.data(), n, h, c.rms_norm_eps, normed.data());
    feed_forward(w, l, normed.data(), n, delta.data(), out.routing_margin.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
  }
  // Logits for the rows each sequence asks for.
  out.hidden = x;
  std::vector<int64_t> rows;
  int64_t row = 0;
  for (const SequenceStep& s : batch) {
    const auto count = static_cast<int64_t>(s.tokens.size());
    out.first_row.push_back(static_cast<int64_t>(rows.size()));
    if (s.logits == LogitRows::kAll)
      for (int64_t i = 0; i < count; ++i) rows.push_back(row + i);
    else if (s.logits == LogitRows::kLast && count > 0)
      rows.push_back(row + count - 1);
    row += count;
  }
  const auto m = static_cast<int64_t>(rows.size());
  std::vector<float> picked(size_t(m * h));
  for (int64_t i = 0; i < m; ++i)
    kernels::rmsnorm(x.data() + rows[size_t(i)] * h, final_norm_.data(), 1, h, c.rms_norm_eps,
                     picked.data() + i * h);
  out.logits.resize(size_t(m * c.vocab_size));
  if (m > 0) kernels::matmul(lm_head, picked.data(), m, out.logits.data());
  return out;
}

}  // namespace tandem::model
