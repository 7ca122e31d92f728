#pragma once
// Token sampling with the parameters of the OpenAI and vLLM APIs. Order, as in vLLM: repetition
// penalty (prompt and output tokens), frequency and presence penalties (output tokens), then
// temperature; then top-k, top-p and min-p filtering; then a draw from the seeded generator.
// Temperature 0 is greedy (argmax, lowest id on ties).
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "api/output.h"
#include "api/sampling.h"

namespace tandem::engine {

using api::SamplingParams;

class Sampler {
 public:
  // `fallback_seed` seeds the generator when the request has no seed (callers pass a random one
  // unless they want unseeded runs to repeat).
  Sampler(const SamplingParams& params, uint64_t fallback_seed);

  // Picks the next token from logits[vocab] (modified in place).
  int32_t sample(std::span<float> logits, std::span<const int32_t> prompt,
                 std::span<const int32_t> output);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

}  // namespace tandem::engine

namespace tandem::engine {

using api::TokenLogprob;

// Log-probability of `token` under softmax(logits) and the `top` most likely tokens (highest
// first, lowest id on ties), from the model's raw logits as vLLM reports them by default.
TokenLogprob token_logprobs(std::span<const float> logits, int32_t token, int32_t top);

}  // namespace tandem::engine
