#include "engine/generate.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>
#include <random>

#include "engine/output_processor.h"
#include "text/token_text.h"
#include "util/error.h"

namespace tandem::engine {

GenerationResult generate(const model::DeepSeekModel& model, const text::Tokenizer& tokenizer,
                          std::span<const int32_t> prompt, const SamplingParams& params,
                          const std::function<void(std::string_view)>& on_text,
                          const std::optional<std::vector<int32_t>>& eos_token_ids,
                          int64_t block_size) {
  params.validate();
  if (prompt.empty()) throw Error("generate: the prompt has no tokens");
  const auto& config = model.config();
  const int64_t total = static_cast<int64_t>(prompt.size()) + params.max_tokens;
  if (total > config.max_position_embeddings)
    throw Error("generate: prompt (" + std::to_string(prompt.size()) +
                " tokens) plus max_tokens (" + std::to_string(params.max_tokens) +
                ") exceeds the model's context of " +
                std::to_string(config.max_position_embeddings));
  const int64_t blocks = (total + block_size - 1) / block_size;
  model::LatentCache cache(model.cache_shape(block_size), blocks);
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0);

  // Rows of the LM head beyond the tokenizer's ids (the vocabulary is padded, e.g. 129280 rows
  // for 128815 DeepSeek-V3 ids) can never be produced: they have no text.
  const std::vector<int32_t> no_text = text::ids_without_text(tokenizer, config.vocab_size);
  std::vector<int32_t> config_eos;
  for (const int64_t id : config.eos_token_ids) config_eos.push_back(static_cast<int32_t>(id));
  const std::vector<int32_t> eos = eos_ids(tokenizer, eos_token_ids.value_or(config_eos));
  Sampler sampler(params, std::random_device{}(), eos);
  OutputProcessor output(tokenizer, params, eos);
  GenerationResult result;

  auto clock = std::chrono::steady_clock::now;
  auto t0 = clock();
  model::SequenceStep step{prompt, 0, table};
  auto out = model.forward(std::span(&step, 1), cache);
  result.prefill_seconds = std::chrono::duration<double>(clock() - t0).count();
  t0 = clock();
  int64_t position = static_cast<int64_t>(prompt.size());
  while (true) {
    for (auto id : no_text) out.logits[id] = -std::numeric_limits<float>::infinity();
    int32_t next = sampler.sample(out.logits, prompt, result.tokens);
    result.tokens.push_back(next);
    auto delta = output.push(next);
    if (!delta.text.empty() && on_text) on_text(delta.text);
    if (delta.finished) {
      result.finish_reason = delta.finish_reason;
      break;
    }
    std::span<const int32_t> one(&result.tokens.back(), 1);
    model::SequenceStep decode{one, position++, table};
    out = model.forward(std::span(&decode, 1), cache);
  }
  result.text = output.text();
  result.decode_seconds = std::chrono::duration<double>(clock() - t0).count();
  return result;
}

}  // namespace tandem::engine
