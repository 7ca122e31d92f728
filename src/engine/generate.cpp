#include "engine/generate.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>
#include <random>

#include "text/detokenizer.h"
#include "util/error.h"

namespace tandem::engine {
namespace {

// Bytes at the end of `text` that could still grow into a stop string; they are held back
// from the stream until the next token decides.
size_t stop_holdback(std::string_view text, const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (const auto& s : stops)
    for (size_t k = std::min(s.size() - 1, text.size()); k > hold; --k)
      if (text.substr(text.size() - k) == std::string_view(s).substr(0, k)) {
        hold = k;
        break;
      }
  return hold;
}

}  // namespace

GenerationResult generate(const model::DeepSeekModel& model, const text::Tokenizer& tokenizer,
                          std::span<const int32_t> prompt, const SamplingParams& params,
                          const std::function<void(std::string_view)>& on_text,
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

  std::vector<int32_t> stop_ids = params.stop_token_ids;
  if (!params.ignore_eos) {
    if (auto eos = tokenizer.eos_id()) stop_ids.push_back(*eos);
    if (config.eos_token_id) stop_ids.push_back(static_cast<int32_t>(*config.eos_token_id));
  }

  // Rows of the LM head beyond the tokenizer's ids (the vocabulary is padded, e.g. 129280 rows
  // for 128815 DeepSeek-V3 ids) can never be produced: they have no text.
  std::vector<int32_t> no_text;
  for (int64_t id = 0; id < config.vocab_size; ++id)
    if (!tokenizer.id_to_token(static_cast<int32_t>(id)))
      no_text.push_back(static_cast<int32_t>(id));
  Sampler sampler(params, std::random_device{}());
  text::IncrementalDetokenizer detok(tokenizer, /*skip_special_tokens=*/true);
  GenerationResult result;
  size_t emitted = 0;
  auto emit_until = [&](size_t end) {
    if (end > emitted && on_text)
      on_text(std::string_view(result.text).substr(emitted, end - emitted));
    emitted = std::max(emitted, end);
  };

  auto clock = std::chrono::steady_clock::now;
  auto t0 = clock();
  model::SequenceStep step{prompt, 0, table, false};
  auto out = model.forward(std::span(&step, 1), cache);
  result.prefill_seconds = std::chrono::duration<double>(clock() - t0).count();
  t0 = clock();
  int64_t position = static_cast<int64_t>(prompt.size());
  while (true) {
    for (auto id : no_text) out.logits[id] = -std::numeric_limits<float>::infinity();
    int32_t next = sampler.sample(out.logits, prompt, result.tokens);
    result.tokens.push_back(next);
    if (std::find(stop_ids.begin(), stop_ids.end(), next) != stop_ids.end()) {
      result.text += detok.finish();  // an unfinished character shows as U+FFFD, as in decode
      result.finish_reason = "stop";
      break;
    }
    result.text += detok.push(next);
    size_t hit = std::string::npos;
    for (const auto& s : params.stop) hit = std::min(hit, result.text.find(s));
    if (hit != std::string::npos) {
      result.text.resize(hit);
      result.finish_reason = "stop";
      break;
    }
    if (static_cast<int64_t>(result.tokens.size()) >= params.max_tokens) {
      result.text += detok.finish();
      result.finish_reason = "length";
      break;
    }
    emit_until(result.text.size() - stop_holdback(result.text, params.stop));
    std::span<const int32_t> one(&result.tokens.back(), 1);
    model::SequenceStep decode{one, position++, table, false};
    out = model.forward(std::span(&decode, 1), cache);
  }
  emit_until(result.text.size());
  result.decode_seconds = std::chrono::duration<double>(clock() - t0).count();
  return result;
}

}  // namespace tandem::engine
