#include "engine/executor/model_executor.h"

#include <cstring>
#include <limits>

#include "util/error.h"

namespace tandem::engine {

ExecutorInfo model_executor_info(const model::DeepSeekModel& model, std::string model_name,
                                 const model::LatentCacheShape& shape, int64_t num_blocks) {
  const auto& c = model.config();
  ExecutorInfo info;
  info.model_name = std::move(model_name);
  info.vocab_size = c.vocab_size;
  info.max_model_len = c.max_position_embeddings;
  info.num_blocks = num_blocks;
  info.block_size = shape.block_size;
  // Only the main layers; an executor that runs the MTP module adds its layer.
  info.kv_layout = {
      "deepseek(" + c.architecture + ", layers " + std::to_string(c.num_hidden_layers) +
          ", hidden " + std::to_string(c.hidden_size) + ", vocab " + std::to_string(c.vocab_size) +
          ", latent " + std::to_string(shape.latent_dim) + "+" + std::to_string(shape.rope_dim) +
          " " + model::latent_type_name(shape.type) + ")",
      c.num_hidden_layers, shape.block_size, shape.entry_bytes()};
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer)
    if (c.is_moe_layer(layer)) info.moe_layers.push_back(layer);
  if (!info.moe_layers.empty()) info.routed_experts = c.n_routed_experts;
  return info;
}

void routes_this_step(const std::vector<std::vector<uint64_t>>& counts, const ExecutorInfo& info,
                      std::vector<uint64_t>& seen, std::vector<int64_t>& out) {
  const int64_t experts = info.routed_experts;
  if (experts == 0) return;
  const size_t n = info.moe_layers.size() * size_t(experts);
  seen.resize(n, 0);
  out.resize(n);
  for (size_t i = 0; i < info.moe_layers.size(); ++i)
    for (int64_t e = 0; e < experts; ++e) {
      const uint64_t now = counts[size_t(info.moe_layers[i])][size_t(e)];
      uint64_t& before = seen[i * size_t(experts) + size_t(e)];
      out[i * size_t(experts) + size_t(e)] = int64_t(now - before);
      before = now;
    }
}

std::byte* kv_block_or_null(model::LatentCache& cache, const ExecutorInfo& info, int32_t block,
                            int64_t layer) {
  if (block < 0 || block >= info.num_blocks || layer < 0 || layer >= info.kv_layout.layers)
    return nullptr;
  return cache.block_layer(block, layer);
}

void write_kv_block(model::LatentCache& cache, const ExecutorInfo& info, int32_t block,
                    int64_t layer, std::span<const std::byte> bytes) {
  const auto& k = info.kv_layout;
  if (block < 0 || block >= info.num_blocks || layer < 0 || layer >= k.layers ||
      bytes.size() > size_t(k.block_size * k.token_bytes) || bytes.size() % k.token_bytes != 0)
    throw Error("write_kv: block " + std::to_string(block) + " layer " + std::to_string(layer) +
                " of " + std::to_string(bytes.size()) + " bytes is outside the cache");
  std::memcpy(cache.block_layer(block, layer), bytes.data(), bytes.size());
}

void mask_ids_without_text(std::span<float> logits, std::span<const int32_t> no_text) {
  for (auto id : no_text) logits[size_t(id)] = -std::numeric_limits<float>::infinity();
}

model::LogitRows logit_rows(const ExecItem& item) {
  const auto [first, end] = item.scored_prompt();
  if (!item.drafts.empty() || first < end) return model::LogitRows::kAll;
  return item.sample ? model::LogitRows::kLast : model::LogitRows::kNone;
}

void score_prompts(std::span<const ExecItem> batch,
                   const std::function<const float*(size_t item, size_t row)>& logits_of,
                   int64_t vocab, std::span<const int32_t> no_text,
                   std::vector<StepTokens>& sampled) {
  sampled.resize(batch.size());
  std::vector<float> row;
  for (size_t i = 0; i < batch.size(); ++i) {
    const ExecItem& item = batch[i];
    const auto [first, end] = item.scored_prompt();
    if (first >= end) continue;
    if (!item.drafts.empty())
      throw Error("execute: item " + std::to_string(i) + " scores its prompt and has drafts");
    StepTokens& out = sampled[i];
    out.prompt_at = first;
    for (int64_t p = first; p < end; ++p) {
      const float* logits = logits_of(i, size_t(p - item.start - 1));
      row.assign(logits, logits + vocab);
      mask_ids_without_text(row, no_text);
      out.prompt.push_back(token_logprobs(row, item.prompt[size_t(p)], item.prompt_logprobs));
    }
  }
}

void sample_items(std::span<const ExecItem> batch,
                  const std::function<float*(size_t item, size_t row)>& logits_of, int64_t vocab,
                  std::span<const int32_t> no_text, std::vector<StepTokens>& sampled) {
  sampled.resize(batch.size());
  std::vector<float> raw;
  std::vector<int32_t> output;  // generated tokens with the ones accepted in this step
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto& item = batch[i];
    if (!item.sample) continue;
    const size_t drafts = item.drafts.size();
    if (!item.draft_probs.empty() && item.draft_probs.size() != drafts * size_t(vocab))
      throw Error("sample: item " + std::to_string(i) + " has " + std::to_string(drafts) +
                  " drafts and " + std::to_string(item.draft_probs.size()) +
                  " draft probabilities");
    if (drafts > 0) output.assign(item.generated.begin(), item.generated.end());
    auto& tokens = sampled[i].tokens;
    const size_t first_row =
        logit_rows(item) == model::LogitRows::kAll ? item.tokens.size() - 1 : 0;
    for (size_t j = 0; j <= drafts; ++j) {
      std::span<float> logits(logits_of(i, first_row + j), size_t(vocab));
      mask_ids_without_text(logits, no_text);
      if (item.logprobs >= 0) raw.assign(logits.begin(), logits.end());
      const std::span<const int32_t> history = drafts > 0 ? output : item.generated;
      const int32_t token =
          j < drafts ? item.sampler->verify(
                           logits, item.prompt, history, item.drafts[j],
                           item.draft_probs.empty()
                               ? std::span<const float>()
                               : item.draft_probs.subspan(j * size_t(vocab), size_t(vocab)))
                     : item.sampler->sample(logits, item.prompt, history);
      if (item.logprobs >= 0)
        tokens.push_back(token_logprobs(raw, token, item.logprobs));
      else
        tokens.push_back({token, 0, {}});
      if (j == drafts || token != item.drafts[j] || !item.sampler->failure().empty()) break;
      output.push_back(token);
    }
  }
}

}  // namespace tandem::engine
