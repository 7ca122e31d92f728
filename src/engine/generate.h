#pragma once
// Generation for one prompt on the CPU model: prefill, then decode token by token with
// sampling, stop tokens, stop strings and max_tokens, streaming text as it becomes final. The
// serving engine's scheduler replaces this loop for batched serving; this is what
// `tandem generate` and the numerics tests use.
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/sampler.h"
#include "model/deepseek.h"
#include "text/tokenizer.h"

namespace tandem::engine {

struct GenerationResult {
  std::vector<int32_t> tokens;  // generated ids (a stop token is included, its text is not)
  std::string text;
  std::string finish_reason;  // "stop" or "length"
  double prefill_seconds = 0, decode_seconds = 0;
};

// `eos_token_ids`: the ids that end the answer besides the tokenizer's EOS, as the engine takes
// them from the generation config (cli::load_generation_config); none given, config.json's
// eos_token_id.
GenerationResult generate(const model::DeepSeekModel& model, const text::Tokenizer& tokenizer,
                          std::span<const int32_t> prompt, const SamplingParams& params,
                          const std::function<void(std::string_view)>& on_text = {},
                          const std::optional<std::vector<int32_t>>& eos_token_ids = std::nullopt,
                          int64_t block_size = 16);

}  // namespace tandem::engine
