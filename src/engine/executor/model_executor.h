#pragma once
// What the executors that run the real model share: the ExecutorInfo a DeepSeek model and its
// cache give, the tokens a padded vocabulary has no text for, and sampling a step's items from
// their logits rows.
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "engine/executor/executor.h"
#include "model/deepseek.h"
#include "text/token_text.h"
#include "text/tokenizer.h"

namespace tandem::engine {

ExecutorInfo model_executor_info(const model::DeepSeekModel& model, std::string model_name,
                                 const model::LatentCacheShape& cache, int64_t num_blocks);

// KV transfer's access to a latent cache (Executor::kv_bytes_mutable and write_kv): the block
// and layer's bytes, or nullptr / tandem::Error naming them when they are outside the cache
// (write_kv_block also when the bytes are not a whole number of tokens of one block).
std::byte* kv_block_or_null(model::LatentCache& cache, const ExecutorInfo& info, int32_t block,
                            int64_t layer);
void write_kv_block(model::LatentCache& cache, const ExecutorInfo& info, int32_t block,
                    int64_t layer, std::span<const std::byte> bytes);

// The tokens routed to each expert of each MoE layer in the step just run, [moe layers, experts]
// into `out`: a model counts routes since it was loaded (`counts`, [layers][experts]), so a step's
// are the difference from `seen` (the counts after the previous step, updated here).
void routes_this_step(const std::vector<std::vector<uint64_t>>& counts, const ExecutorInfo& info,
                      std::vector<uint64_t>& seen, std::vector<int64_t>& out);

// Vocabulary ids of LM-head rows without a token (padded vocabularies); never sampled.
using text::ids_without_text;
// Sets those ids' logits to -inf, so neither sampling nor a draft proposal picks them.
void mask_ids_without_text(std::span<float> logits, std::span<const int32_t> no_text);

// The logit rows an item needs from the model: one per new token (and draft) when it verifies
// drafts or scores prompt tokens, the last one when it only samples, none for a prefill chunk that
// stops short of its prompt's end.
model::LogitRows logit_rows(const ExecItem& item);

// Scores the prompt positions of the items with prompt_logprobs into sampled[item].prompt, from
// their rows logits_of(item, j) (row j predicts position start + j + 1) with the ids without text
// masked, as sampled tokens' logprobs are: a scored answer has the logprobs it was generated with.
// Call before sample_items(), which masks rows in place.
void score_prompts(std::span<const ExecItem> batch,
                   const std::function<const float*(size_t item, size_t row)>& logits_of,
                   int64_t vocab, std::span<const int32_t> no_text,
                   std::vector<StepTokens>& sampled);

// Verifies and samples every item with sample = true. Its rows logits_of(item, r + j), j =
// 0..drafts, with r its last new token's row (0 unless logit_rows() is kAll), (vocab floats each,
// changed in place: ids without text are masked first) predict the token after its last new token
// and after each of its drafts: drafts are taken while the sampler accepts them, then one token
// is sampled (the first rejected draft's replacement, or the token after the last draft).
// Logprobs, when the item asks for them, come from each row's raw logits.
void sample_items(std::span<const ExecItem> batch,
                  const std::function<float*(size_t item, size_t row)>& logits_of, int64_t vocab,
                  std::span<const int32_t> no_text, std::vector<StepTokens>& sampled);

}  // namespace tandem::engine
