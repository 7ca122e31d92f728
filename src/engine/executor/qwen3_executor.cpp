#include "engine/executor/qwen3_executor.h"

#include "engine/executor/model_executor.h"
#include "util/error.h"

namespace tandem::engine {

Qwen3Executor::Qwen3Executor(std::shared_ptr<const model::Qwen3MoeModel> model,
                             const text::Tokenizer& tokenizer, std::string model_name,
                             const CpuExecutorOptions& options)
    : model_(std::move(model)),
      cache_(
          model_->cache_shape(options.block_size, options.kv_cache_type),
          kv_blocks_for(model_->cache_shape(options.block_size, options.kv_cache_type), options)) {
  if (options.speculative_tokens > 0)
    throw Error("--speculative-tokens: Qwen3-MoE has no MTP module to draft with");
  const auto& c = model_->config();
  const auto& shape = cache_.shape();
  info_.model_name = std::move(model_name);
  info_.vocab_size = c.vocab_size;
  info_.max_model_len = c.max_position_embeddings;
  info_.num_blocks = cache_.num_blocks();
  info_.block_size = shape.block_size;
  // The layout says which cache this is: a decode engine of another model or cache refuses it.
  info_.kv_layout = {"qwen3_moe(layers " + std::to_string(c.num_hidden_layers) + ", hidden " +
                         std::to_string(c.hidden_size) + ", vocab " + std::to_string(c.vocab_size) +
                         ", K|V " + std::to_string(c.num_key_value_heads) + "x" +
                         std::to_string(c.head_dim) + " " + model::latent_type_name(shape.type) +
                         ")",
                     c.num_hidden_layers, shape.block_size, shape.entry_bytes()};
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer)
    if (c.is_moe_layer(layer)) info_.moe_layers.push_back(layer);
  if (!info_.moe_layers.empty()) info_.routed_experts = c.num_experts;
  no_text_ = ids_without_text(tokenizer, c.vocab_size);
}

const std::byte* Qwen3Executor::kv_bytes(int32_t block, int64_t layer) const {
  return cache_.block_layer(block, layer);
}

std::byte* Qwen3Executor::kv_bytes_mutable(int32_t block, int64_t layer) {
  return kv_block_or_null(cache_, info_, block, layer);
}

void Qwen3Executor::write_kv(int32_t block, int64_t layer, std::span<const std::byte> bytes) {
  write_kv_block(cache_, info_, block, layer, bytes);
}

ExecResult Qwen3Executor::execute(std::span<const ExecItem> batch, const LayerHook& on_layer) {
  std::vector<model::SequenceStep> steps;
  steps.reserve(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const ExecItem& item = batch[i];
    if (!item.drafts.empty())
      throw Error("execute: item " + std::to_string(i) +
                  " has drafts and the executor does not speculate");
    steps.push_back({item.tokens, item.start, item.blocks, logit_rows(item)});
  }
  auto out = model_->forward(steps, cache_);
  // The whole step is in the cache now: streaming KV transfers may send every layer.
  if (on_layer) on_layer(info_.kv_layout.layers);
  const int64_t vocab = info_.vocab_size;
  ExecResult result;
  routes_this_step(model_->expert_counts(), info_, seen_, result.expert_tokens);
  auto row_of = [&](size_t i, size_t row) {
    return out.logits.data() + (out.first_row[i] + static_cast<int64_t>(row)) * vocab;
  };
  score_prompts(batch, row_of, vocab, no_text_, result.sampled);
  sample_items(batch, row_of, vocab, no_text_, result.sampled);
  return result;
}

}  // namespace tandem::engine
