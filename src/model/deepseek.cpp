#include "model/deepseek.h"

#include "model/moe_experts.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <type_traits>

#include "kernels/cpu/mla_attention.h"
#include "model/layout.h"
#include "model/moe_routing.h"
#include "util/error.h"

namespace tandem::model {

using kernels::matmul;
using kernels::rmsnorm;

namespace {
// DeepSeek's own code (inference/model.py and the Hugging Face modeling file) builds the q-LoRA
// and KV latent norms with the RMSNorm default eps of 1e-6, not the config's rms_norm_eps; vLLM
// uses rms_norm_eps. They agree for every published V2/V3 config; we follow DeepSeek.
constexpr double kLatentNormEps = 1e-6;
}  // namespace

DeepSeekModel::DeepSeekModel(ModelConfig config, Weights weights)
    : config_(std::move(config)), weights_(std::move(weights)), rope_(config_) {
  expert_counts_.assign(config_.num_hidden_layers + config_.num_nextn_predict_layers,
                        std::vector<uint64_t>(config_.n_routed_experts, 0));
}

DeepSeekModel DeepSeekModel::load(const std::filesystem::path& dir,
                                  const std::function<void(size_t, size_t)>& progress,
                                  const WeightLoadOptions& options) {
  ModelConfig config = ModelConfig::load(dir);
  Checkpoint checkpoint = Checkpoint::open(dir);
  if (const std::string warning = drop_absent_mtp_layers(checkpoint, config); !warning.empty()) {
    static std::atomic<bool> warned{false};  // once a process (an engine loads a model once)
    if (options.mtp && !warned.exchange(true))
      std::fprintf(stderr,
                   "tandem: warning: %s. Loading without MTP: speculative decoding "
                   "(--speculative-tokens) is not available\n",
                   warning.c_str());
  }
  Weights weights = Weights::load(std::move(checkpoint), config, progress, options);
  // Checked with its MTP tensors, run without them: no cache layer or expert counts for them.
  if (!options.mtp) config.num_nextn_predict_layers = 0;
  return DeepSeekModel(std::move(config), std::move(weights));
}

std::string DeepSeekModel::missing_mtp(const std::filesystem::path& dir) {
  ModelConfig config = ModelConfig::load(dir);
  if (config.num_nextn_predict_layers == 0)
    return (dir / "config.json").string() + " names no MTP layers (num_nextn_predict_layers)";
  return drop_absent_mtp_layers(Checkpoint::open(dir), config);
}

LatentType DeepSeekModel::default_cache_type() const {
  const auto& kv_b = weights_.layers.front().attn.kv_b;
  return kv_b.type == kernels::WeightType::kF32 ? LatentType::kF32 : LatentType::kBF16;
}

LatentCacheShape deepseek_cache_shape(const ModelConfig& c, int64_t block_size, LatentType type) {
  return LatentCacheShape{c.num_hidden_layers + c.num_nextn_predict_layers, block_size,
                          c.kv_lora_rank, c.qk_rope_head_dim, type};
}

LatentCacheShape DeepSeekModel::cache_shape(int64_t block_size,
                                            std::optional<LatentType> type) const {
  return deepseek_cache_shape(config_, block_size, type.value_or(default_cache_type()));
}

namespace {

void check_batch(const ModelConfig& c, std::span<const SequenceStep> batch,
                 const LatentCache& cache) {
  const int64_t bs = cache.shape().block_size;
  for (size_t s = 0; s < batch.size(); ++s) {
    const auto& step = batch[s];
    if (step.tokens.empty())
      throw Error("forward: sequence " + std::to_string(s) + " has no tokens");
    const int64_t end = step.start + static_cast<int64_t>(step.tokens.size());
    if (step.start < 0 || static_cast<int64_t>(step.blocks.size()) * bs < end)
      throw Error("forward: block table of sequence " + std::to_string(s) + " covers " +
                  std::to_string(step.blocks.size() * bs) + " positions, needs " +
                  std::to_string(end));
    for (auto b : step.blocks)
      if (b < 0 || b >= cache.num_blocks())
        throw Error("forward: block " + std::to_string(b) + " is outside the cache");
    for (auto t : step.tokens)
      if (t < 0 || t >= c.vocab_size)
        throw Error("forward: token id " + std::to_string(t) + " is outside the vocabulary");
  }
}

// x[i] += y[i] (the residual connections).
void add_to(float* x, const float* y, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// Values [first, first + count) of position `pos`'s cache entry, as float32.
void load_entry(const LatentCache& cache, const SequenceStep& step, int64_t layer, int64_t pos,
                int64_t first, int64_t count, float* out) {
  const int64_t bs = cache.shape().block_size;
  cache.load(step.blocks[pos / bs], layer, pos % bs, first, count, out);
}

// Expanded attention of one sequence's step: keys and values of every head rebuilt from the
// latents of the whole context, then per head two matrix products per block of queries (scores
// S = Q K^T, outputs O = P V). T is the products' element type: BF16 (uint16_t) for BF16 and
// INT8 checkpoints (keys, values, queries and probabilities rounded to BF16, float32 sums), float
// for float32 ones and on CPUs without BF16 GEMMs (where BF16 operands would only be widened). q is
// [count, heads, qk] after RoPE, out [count, heads, v_head_dim].
template <typename T>
void expanded_attention(const ModelConfig& c, const Matrix& kv_b, LatentCache& cache,
                        const SequenceStep& step, int64_t layer, const float* q, float* out) {
  const int64_t heads = c.num_attention_heads, nope = c.qk_nope_head_dim, rd = c.qk_rope_head_dim;
  const int64_t vd = c.v_head_dim, kvl = c.kv_lora_rank, qk = c.qk_head_dim();
  const int64_t head_rows = nope + vd;
  const int64_t count = static_cast<int64_t>(step.tokens.size()), context = step.start + count;
  const float scale = static_cast<float>(c.softmax_scale());
  constexpr bool bf16 = std::is_same_v<T, uint16_t>;
  auto convert = [](const float* x, int64_t n, T* y) {
    if constexpr (bf16)
      kernels::to_bf16(x, n, y);
    else
      std::copy_n(x, n, y);
  };
  auto gemm = [](int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
                 bool b_transposed, float* y, int64_t ldy) {
    if constexpr (bf16)
      kernels::gemm_bf16(m, n, k, a, lda, b, ldb, b_transposed, y, ldy);
    else
      kernels::gemm_f32(m, n, k, a, lda, b, ldb, b_transposed, y, ldy);
  };

  // Per-head keys [heads, context, qk] (the rope part is shared by all heads) and values
  // [heads, context, vd], written once in the products' type, each head's block contiguous.
  // Reused per thread: fresh buffers of megabytes cost page faults on every layer.
  thread_local std::vector<float> latents, rope_keys, kv;
  thread_local std::vector<T> keys, values, queries;
  latents.resize(context * kvl);
  rope_keys.resize(context * rd);
  kv.resize(context * heads * head_rows);
  keys.resize(heads * context * qk);
  values.resize(heads * context * vd);
  queries.resize(count * heads * qk);
  for (int64_t p = 0; p < context; ++p) {
    load_entry(cache, step, layer, p, 0, kvl, latents.data() + p * kvl);
    load_entry(cache, step, layer, p, kvl, rd, rope_keys.data() + p * rd);
  }
  matmul(kv_b, latents.data(), context, kv.data());
  // The parallel loops below see other threads' thread_local objects: they use these pointers.
  const float* kvp = kv.data();
  const float* rkp = rope_keys.data();
  T* kp = keys.data();
  T* vp = values.data();
  const T* qp = queries.data();
#pragma omp parallel for schedule(static) if (context > 16)
  for (int64_t p = 0; p < context; ++p) {
    const float* src = kvp + p * heads * head_rows;
    const float* rope_key = rkp + p * rd;
    for (int64_t hd = 0; hd < heads; ++hd) {
      T* key = kp + (hd * context + p) * qk;
      convert(src + hd * head_rows, nope, key);
      convert(rope_key, rd, key + nope);
      convert(src + hd * head_rows + nope, vd, vp + (hd * context + p) * vd);
    }
  }
  convert(q, count * heads * qk, queries.data());

  // One head per thread. Queries go in blocks that attend only to the keys their last query can
  // see, so the causal upper triangle is mostly skipped instead of computed and masked. The
  // products read queries, keys and values in place and write the output rows in place.
  constexpr int64_t kQueryBlock = 128;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t hd = 0; hd < heads; ++hd) {
    thread_local std::vector<float> scores;
    thread_local std::vector<T> probs;
    scores.resize(kQueryBlock * context);
    if constexpr (bf16) probs.resize(kQueryBlock * context);  // float32 products read `scores`
    const T* key = kp + hd * context * qk;
    const T* value = vp + hd * context * vd;
    for (int64_t b0 = 0; b0 < count; b0 += kQueryBlock) {
      const int64_t bn = std::min(kQueryBlock, count - b0);
      const int64_t visible_max = step.start + b0 + bn;  // keys the block's last query sees
      gemm(bn, visible_max, qk, qp + (b0 * heads + hd) * qk, heads * qk, key, qk,
           /*b_transposed=*/true, scores.data(), visible_max);
      for (int64_t i = 0; i < bn; ++i) {
        float* row = scores.data() + i * visible_max;
        const int64_t visible = step.start + b0 + i + 1;  // causal: up to this token
        if constexpr (bf16) {
          kernels::softmax_to_bf16(row, visible, scale, visible_max,
                                   probs.data() + i * visible_max);
        } else {
          for (int64_t p = 0; p < visible; ++p) row[p] *= scale;
          kernels::softmax(row, visible);
          std::fill(row + visible, row + visible_max, 0.0f);
        }
      }
      const T* p_rows;
      if constexpr (bf16)
        p_rows = probs.data();
      else
        p_rows = scores.data();
      gemm(bn, vd, visible_max, p_rows, visible_max, value, vd, /*b_transposed=*/false,
           out + (b0 * heads + hd) * vd, heads * vd);
    }
  }
}

}  // namespace

void DeepSeekModel::mlp(const MlpWeights& w, const float* xn, const uint16_t* xb, int64_t n,
                        float* out) const {
  swiglu(w, xn, xb, n, out);
}

void DeepSeekModel::expert_forward(const MlpWeights& e, const float* rows, int64_t m,
                                   float* out) const {
  // As the single-process MoE layer decides: BF16 activations where its BF16 GEMM takes them
  // (rounding is elementwise, so rounding the gathered rows equals gathering rounded rows).
  if (e.gate.type == kernels::WeightType::kBF16 && kernels::bf16_gemm_available() &&
      kernels::gemm_takes_bf16(e.gate, m)) {
    thread_local std::vector<uint16_t> in;
    in.resize(m * config_.hidden_size);
    kernels::to_bf16(rows, m * config_.hidden_size, in.data());
    mlp(e, nullptr, in.data(), m, out);
  } else {
    mlp(e, rows, nullptr, m, out);
  }
}

void DeepSeekModel::moe(const MoeWeights& w, int64_t layer, const std::vector<float>& xn, int64_t n,
                        std::vector<float>& out, std::vector<float>& margins,
                        ExpertExchange* exchange) const {
  const ModelConfig& c = config_;
  const int64_t h = c.hidden_size, e_count = c.n_routed_experts;
  std::optional<PartTimer> timer(std::in_place, profile_, StepPart::kRouting);
  std::vector<float> logits(n * e_count);
  kernels::matmul_f32_activations(w.router, xn.data(), n, logits.data());
  // Group the tokens by physical expert slot so each expert's weights are read once.
  std::vector<std::vector<std::pair<int64_t, float>>> by_slot(w.experts.size());
  const float* bias = w.correction_bias.empty() ? nullptr : w.correction_bias.data();
  std::vector<Routing> routes(n);
#pragma omp parallel for schedule(static) if (n > 16)
  for (int64_t t = 0; t < n; ++t) routes[t] = route_token(c, logits.data() + t * e_count, bias);
  for (int64_t t = 0; t < n; ++t) {
    const Routing& r = routes[t];
    margins[t] = std::min(margins[t], r.margin);
    for (size_t k = 0; k < r.experts.size(); ++k) {
      ++expert_counts_[layer][r.experts[k]];
      if (!exchange) by_slot[w.slot_of_expert[r.experts[k]]].emplace_back(t, r.weights[k]);
    }
  }
  timer.emplace(profile_, StepPart::kRoutedExperts);
  out.assign(n * h, 0.0f);
  if (exchange) {
    exchange->routed_experts(layer, xn.data(), n, routes, out.data());
    if (!w.has_shared) return;
    timer.emplace(profile_, StepPart::kSharedExperts);
    thread_local std::vector<float> shared_rows;
    shared_rows.resize(n * h);
    mlp(w.shared, xn.data(), nullptr, n, shared_rows.data());
    for (int64_t i = 0; i < n * h; ++i) out[i] += shared_rows[i];
    return;
  }
  if (w.experts.empty())
    throw Error("forward: layer " + std::to_string(layer) +
                " was loaded without its routed experts and runs without an expert exchange");
  thread_local std::vector<float> shared_buf;
  if (w.has_shared) {
    timer.emplace(profile_, StepPart::kSharedExperts);
    shared_buf.resize(n * h);
    mlp(w.shared, xn.data(), nullptr, n, shared_buf.data());
    timer.emplace(profile_, StepPart::kRoutedExperts);
  }
  routed_experts(w.experts, by_slot, xn.data(), n, h, w.has_shared ? shared_buf.data() : nullptr,
                 out.data());
}

void DeepSeekModel::attention(const AttentionWeights& w, int64_t layer,
                              std::span<const SequenceStep> batch,
                              const std::vector<TokenInfo>& tokens, const std::vector<float>& xn,
                              std::vector<float>& out, LatentCache& cache) const {
  const ModelConfig& c = config_;
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t heads = c.num_attention_heads, nope = c.qk_nope_head_dim, rd = c.qk_rope_head_dim;
  const int64_t vd = c.v_head_dim, kvl = c.kv_lora_rank, qk = c.qk_head_dim();
  const int64_t entry = kvl + rd, head_rows = nope + vd;
  const float scale = static_cast<float>(c.softmax_scale());

  std::optional<PartTimer> timer(std::in_place, profile_, StepPart::kAttentionProjections);
  // Queries: [n, heads, nope + rope]. Reused per thread (fresh buffers of megabytes cost page
  // faults on every layer); parallel loops use the pointers, not the thread_local objects.
  thread_local std::vector<float> q_buf, kva_buf;
  q_buf.resize(n * heads * qk);
  float* q = q_buf.data();
  if (c.q_lora_rank > 0) {
    std::vector<float> qa(n * c.q_lora_rank);
    matmul(w.q_a, xn.data(), n, qa.data());
    rmsnorm(qa.data(), w.q_a_norm.data(), n, c.q_lora_rank, kLatentNormEps, qa.data());
    matmul(w.q_b, qa.data(), n, q);
  } else {
    matmul(w.q, xn.data(), n, q);
  }
  // New latents and rope keys go to the cache before attending, so a token sees itself.
  kva_buf.resize(n * entry);
  float* kva = kva_buf.data();
  matmul(w.kv_a, xn.data(), n, kva);
  const int64_t bs = cache.shape().block_size;
#pragma omp parallel for schedule(static) if (n > 16)
  for (int64_t t = 0; t < n; ++t) {
    const auto& step = batch[tokens[t].sequence];
    float* entry_t = kva + t * entry;  // normalised latent and RoPE'd key, in place
    rmsnorm(entry_t, w.kv_a_norm.data(), 1, kvl, kLatentNormEps, entry_t);
    rope_.apply(entry_t + kvl, tokens[t].position);
    const int64_t pos = tokens[t].position;
    cache.store(step.blocks[pos / bs], layer, pos % bs, entry_t);
    rope_.apply(q + t * heads * qk + nope, qk, heads, tokens[t].position);
  }

  timer.emplace(profile_, StepPart::kAttentionCore);
  out.assign(n * heads * vd, 0.0f);
  // Absorbed form for short steps: W_UK folded into the query and W_UV applied after the
  // weighted sum, so attention runs directly over the cached latents (one shared KV head of
  // width kv_lora + rope) for all of a sequence's heads and query tokens at once.
  std::vector<const SequenceStep*> absorbed_steps;
  std::vector<int64_t> absorbed_tokens;  // indices of the tokens attended in absorbed form
  thread_local std::vector<float> q_abs_buf, o_lat_buf;
  int64_t first_token = 0;
  for (const auto& step : batch) {
    const int64_t count = static_cast<int64_t>(step.tokens.size());
    // Batch-invariant numerics: one form for every step, whatever its length.
    if (count <= kAbsorbedMaxTokens || kernels::batch_invariant()) {
      absorbed_steps.push_back(&step);
      for (int64_t i = 0; i < count; ++i) absorbed_tokens.push_back(first_token + i);
    } else if (w.kv_b.type == kernels::WeightType::kF32 || !kernels::bf16_gemm_available()) {
      expanded_attention<float>(c, w.kv_b, cache, step, layer, q + first_token * heads * qk,
                                out.data() + first_token * heads * vd);
    } else {
      expanded_attention<uint16_t>(c, w.kv_b, cache, step, layer, q + first_token * heads * qk,
                                   out.data() + first_token * heads * vd);
    }
    first_token += count;
  }
  if (absorbed_tokens.empty()) return;
  const auto na = static_cast<int64_t>(absorbed_tokens.size());
  q_abs_buf.resize(na * heads * entry);
  o_lat_buf.resize(na * heads * kvl);
  float* q_abs = q_abs_buf.data();
  float* o_lat = o_lat_buf.data();
  const int64_t* at = absorbed_tokens.data();
  // Heads outside, tokens inside: a head's W_UK (and below W_UV) rows stay in L2 for all tokens.
  // Threads claim heads one at a time (a vCPU slowed by its neighbours takes fewer).
  // W_UK from its transposed packed copy (the query rounded to BF16, as every BF16 product rounds
  // its activations); batch-invariant numerics keep the float32 product over kv_b's rows.
  const bool k_up_rows = w.k_up_t.packed && !kernels::batch_invariant();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t hd = 0; hd < heads; ++hd)
    for (int64_t i = 0; i < na; ++i) {
      const float* qh = q + (at[i] * heads + hd) * qk;
      float* dst = q_abs + (i * heads + hd) * entry;
      if (k_up_rows)
        kernels::matvec_rows(w.k_up_t, hd * kvl, kvl, qh, dst);
      else
        kernels::matvec_transposed(w.kv_b, hd * head_rows, nope, qh, dst);
      std::copy_n(qh + nope, rd, dst + kvl);
    }
  std::vector<kernels::MlaSequence> absorbed;
  std::vector<std::vector<const void*>> pages;
  int64_t row = 0;
  for (const SequenceStep* step : absorbed_steps) {
    const auto count = static_cast<int64_t>(step->tokens.size());
    const int64_t context = step->start + count;
    auto& table = pages.emplace_back((context + bs - 1) / bs);
    for (size_t b = 0; b < table.size(); ++b) table[b] = cache.block_layer(step->blocks[b], layer);
    absorbed.push_back(
        {q_abs + row * heads * entry, count, context, table.data(), o_lat + row * heads * kvl});
    row += count;
  }
  const kernels::MlaShape shape{heads, kvl, rd, bs, scale, cache.shape().type};
  kernels::MlaOptions mla{mla_rescale_};
  mla.fixed_chunks = kernels::batch_invariant();
  kernels::mla_decode(shape, absorbed, mla);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t hd = 0; hd < heads; ++hd)
    for (int64_t i = 0; i < na; ++i)
      kernels::matvec_rows(w.kv_b, hd * head_rows + nope, vd, o_lat + (i * heads + hd) * kvl,
                           out.data() + (at[i] * heads + hd) * vd);
}

void DeepSeekModel::layer_forward(const LayerWeights& w, int64_t cache_layer,
                                  std::span<const SequenceStep> batch,
                                  const std::vector<TokenInfo>& tokens, std::vector<float>& x,
                                  LatentCache& cache, std::vector<float>& margins,
                                  ExpertExchange* exchange) const {
  const int64_t n = static_cast<int64_t>(tokens.size()), h = config_.hidden_size;
  // Reused per thread: fresh buffers of megabytes cost page faults on every layer.
  thread_local std::vector<float> xn, attn, proj;
  xn.resize(n * h);
  proj.resize(n * h);
  rmsnorm(x.data(), w.input_norm.data(), n, h, config_.rms_norm_eps, xn.data());
  attention(w.attn, cache_layer, batch, tokens, xn, attn, cache);
  {
    PartTimer timer(profile_, StepPart::kAttentionProjections);
    matmul(w.attn.o, attn.data(), n, proj.data());
  }
  add_to(x.data(), proj.data(), n * h);

  rmsnorm(x.data(), w.post_attention_norm.data(), n, h, config_.rms_norm_eps, xn.data());
  if (w.is_moe) {
    moe(w.moe, cache_layer, xn, n, proj, margins, exchange);
  } else {
    PartTimer timer(profile_, StepPart::kDenseMlp);
    mlp(w.dense, xn.data(), nullptr, n, proj.data());
  }
  add_to(x.data(), proj.data(), n * h);
}

StepOutput DeepSeekModel::finish(std::span<const SequenceStep> batch, std::vector<float> x,
                                 std::vector<float> margins, const std::vector<float>& norm,
                                 const Matrix& head) const {
  PartTimer timer(profile_, StepPart::kLmHead);
  const int64_t h = config_.hidden_size;
  StepOutput out;
  std::vector<int64_t> rows;  // token indices whose logits are wanted
  int64_t t = 0;
  for (const auto& step : batch) {
    out.first_row.push_back(static_cast<int64_t>(rows.size()));
    const int64_t count = static_cast<int64_t>(step.tokens.size());
    const int64_t first = step.logits == LogitRows::kAll    ? 0
                          : step.logits == LogitRows::kLast ? count - 1
                                                            : count;
    for (int64_t i = first; i < count; ++i) rows.push_back(t + i);
    t += count;
  }
  std::vector<float> normed(rows.size() * h);
  for (size_t r = 0; r < rows.size(); ++r)
    rmsnorm(x.data() + rows[r] * h, norm.data(), 1, h, config_.rms_norm_eps, normed.data() + r * h);
  out.logits.resize(rows.size() * config_.vocab_size);
  matmul(head, normed.data(), static_cast<int64_t>(rows.size()), out.logits.data());
  out.hidden = std::move(x);
  out.routing_margin = std::move(margins);
  return out;
}

StepOutput DeepSeekModel::forward(std::span<const SequenceStep> batch, LatentCache& cache,
                                  const std::function<void(int64_t)>& after_layer,
                                  ExpertExchange* exchange) const {
  check_batch(config_, batch, cache);
  const int64_t h = config_.hidden_size;
  std::vector<TokenInfo> tokens;
  for (size_t s = 0; s < batch.size(); ++s)
    for (size_t i = 0; i < batch[s].tokens.size(); ++i)
      tokens.push_back({static_cast<int64_t>(s), batch[s].start + static_cast<int64_t>(i)});
  std::vector<float> x(tokens.size() * h);
  int64_t t = 0;
  for (const auto& step : batch)
    for (auto id : step.tokens) kernels::matrix_row(weights_.embed, id, x.data() + (t++) * h);
  std::vector<float> margins(tokens.size(), std::numeric_limits<float>::infinity());
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    layer_forward(weights_.layers[l], l, batch, tokens, x, cache, margins, exchange);
    if (after_layer) after_layer(l + 1);
  }
  return finish(batch, std::move(x), std::move(margins), weights_.final_norm, weights_.lm_head);
}

StepOutput DeepSeekModel::forward_mtp(std::span<const SequenceStep> batch, const float* hidden,
                                      LatentCache& cache, int64_t k) const {
  if (k < 0 || k >= static_cast<int64_t>(weights_.mtp.size()))
    throw Error("forward_mtp: the model has " + std::to_string(weights_.mtp.size()) +
                " MTP modules, asked for #" + std::to_string(k));
  check_batch(config_, batch, cache);
  const MtpWeights& m = weights_.mtp[k];
  const int64_t h = config_.hidden_size;
  std::vector<TokenInfo> tokens;
  for (size_t s = 0; s < batch.size(); ++s)
    for (size_t i = 0; i < batch[s].tokens.size(); ++i)
      tokens.push_back({static_cast<int64_t>(s), batch[s].start + static_cast<int64_t>(i)});
  const int64_t n = static_cast<int64_t>(tokens.size());
  // Input: eh_proj([enorm(embed(next token)) ; hnorm(hidden)]), embedding first.
  std::vector<float> cat(n * 2 * h), x(n * h);
  int64_t t = 0;
  for (const auto& step : batch) {
    for (auto id : step.tokens) {
      float* row = cat.data() + t * 2 * h;
      kernels::matrix_row(m.embed, id, row);
      rmsnorm(row, m.enorm.data(), 1, h, config_.rms_norm_eps, row);
      rmsnorm(hidden + t * h, m.hnorm.data(), 1, h, config_.rms_norm_eps, row + h);
      ++t;
    }
  }
  matmul(m.eh_proj, cat.data(), n, x.data());
  std::vector<float> margins(tokens.size(), std::numeric_limits<float>::infinity());
  layer_forward(m.layer, config_.num_hidden_layers + k, batch, tokens, x, cache, margins, nullptr);
  return finish(batch, std::move(x), std::move(margins), m.final_norm, m.head);
}

}  // namespace tandem::model
