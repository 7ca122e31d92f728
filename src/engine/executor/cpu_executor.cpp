#include "engine/executor/cpu_executor.h"

#include <cstring>

#include "engine/executor/model_executor.h"

#include "util/error.h"

namespace tandem::engine {
int64_t kv_blocks_for(const model::LatentCacheShape& shape, const CpuExecutorOptions& o) {
  if (o.block_size < 1) throw Error("block size must be at least 1");
  if (o.num_blocks > 0) return o.num_blocks;
  const auto block_bytes = static_cast<double>(shape.block_bytes());
  const auto n = static_cast<int64_t>(o.kv_cache_bytes / block_bytes);
  if (n < 1)
    throw Error("the KV cache budget of " + std::to_string(o.kv_cache_bytes) +
                " bytes holds no block of " + std::to_string(block_bytes) + " bytes");
  return n;
}

int64_t kv_blocks_for(const model::DeepSeekModel& m, const CpuExecutorOptions& o) {
  return kv_blocks_for(m.cache_shape(o.block_size, o.kv_cache_type), o);
}

CpuExecutor::CpuExecutor(std::shared_ptr<const model::DeepSeekModel> model,
                         const text::Tokenizer& tokenizer, std::string model_name,
                         const CpuExecutorOptions& options)
    : model_(std::move(model)),
      cache_(model_->cache_shape(options.block_size, options.kv_cache_type),
             kv_blocks_for(*model_, options)) {
  const auto& c = model_->config();
  info_ = model_executor_info(*model_, std::move(model_name), cache_.shape(), cache_.num_blocks());
  for (int64_t layer : info_.moe_layers)
    for (int64_t e = 0; e < info_.routed_experts; ++e)
      seen_.push_back(model_->expert_counts()[layer][e]);
  no_text_ = ids_without_text(tokenizer, c.vocab_size);
  if (options.speculative_tokens > 0) {
    drafter_.emplace(*model_, options.speculative_tokens, no_text_);
    info_.speculative_tokens = options.speculative_tokens;
    // The MTP layer's cache travels with the main layers' in P/D: a decode engine's drafts then
    // see the whole prompt. Both legs must speculate (the layouts say so when they do not).
    info_.kv_layout.layers += 1;
    info_.kv_layout.model += " with its MTP layer";
  }
}

const std::byte* CpuExecutor::kv_bytes(int32_t block, int64_t layer) const {
  return cache_.block_layer(block, layer);
}

std::byte* CpuExecutor::kv_bytes_mutable(int32_t block, int64_t layer) {
  return kv_block_or_null(cache_, info_, block, layer);
}

void CpuExecutor::write_kv(int32_t block, int64_t layer, std::span<const std::byte> bytes) {
  write_kv_block(cache_, info_, block, layer, bytes);
}

ExecResult CpuExecutor::execute(std::span<const ExecItem> batch, const LayerHook& on_layer) {
  std::vector<model::SequenceStep> steps;
  steps.reserve(batch.size());
  std::vector<std::vector<int32_t>> with_drafts(batch.size());  // tokens, then drafts
  for (size_t i = 0; i < batch.size(); ++i) {
    const ExecItem& item = batch[i];
    if (!item.drafts.empty() && !item.sample)
      throw Error("execute: item " + std::to_string(i) + " has drafts but samples nothing");
    if (!item.drafts.empty() && !drafter_)
      throw Error("execute: item " + std::to_string(i) +
                  " has drafts and the executor does not speculate");
    std::span<const int32_t> tokens = item.tokens;
    if (!item.drafts.empty()) {
      with_drafts[i].assign(item.tokens.begin(), item.tokens.end());
      with_drafts[i].insert(with_drafts[i].end(), item.drafts.begin(), item.drafts.end());
      tokens = with_drafts[i];
    }
    // Logits for each draft's verification, or only for the next token; none for prefill chunks
    // that stop short of their prompt's end.
    const auto rows = !item.sample          ? model::LogitRows::kNone
                      : item.drafts.empty() ? model::LogitRows::kLast
                                            : model::LogitRows::kAll;
    steps.push_back({tokens, item.start, item.blocks, rows});
  }
  auto out = model_->forward(steps, cache_, on_layer);
  const int64_t vocab = info_.vocab_size;
  ExecResult result;
  routes_this_step(model_->expert_counts(), info_, seen_, result.expert_tokens);
  sample_items(
      batch,
      [&](size_t i, size_t row) {
        return out.logits.data() + (out.first_row[i] + static_cast<int64_t>(row)) * vocab;
      },
      vocab, no_text_, result.sampled);
  if (drafter_) drafter_->run(batch, out, cache_, result.sampled);
  return result;
}

}  // namespace tandem::engine
