#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>

#include "util/error.h"

namespace tandem::engine {

void SamplingParams::validate() const {
  auto fail = [](const std::string& m) { throw Error(m); };
  if (!(temperature >= 0) || !std::isfinite(temperature)) fail("temperature must be >= 0");
  if (top_k < -1) fail("top_k must be -1, 0 (off) or positive");
  if (!(top_p > 0 && top_p <= 1)) fail("top_p must be in (0, 1]");
  if (!(min_p >= 0 && min_p <= 1)) fail("min_p must be in [0, 1]");
  if (!(repetition_penalty > 0) || !std::isfinite(repetition_penalty))
    fail("repetition_penalty must be > 0");
  if (!(presence_penalty >= -2 && presence_penalty <= 2))
    fail("presence_penalty must be in [-2, 2]");
  if (!(frequency_penalty >= -2 && frequency_penalty <= 2))
    fail("frequency_penalty must be in [-2, 2]");
  if (max_tokens < 1) fail("max_tokens must be at least 1");
  for (const auto& s : stop)
    if (s.empty()) fail("stop strings must not be empty");
}

Sampler::Sampler(const SamplingParams& params, uint64_t fallback_seed)
    : params_(params), rng_(params.seed.value_or(fallback_seed)) {
  params_.validate();
}

int32_t Sampler::sample(std::span<float> logits, std::span<const int32_t> prompt,
                        std::span<const int32_t> output) {
  const auto vocab = static_cast<int64_t>(logits.size());
  for (auto ids : {prompt, output})
    for (auto t : ids)
      if (t < 0 || t >= vocab)
        throw Error("sampler: token id " + std::to_string(t) + " is outside the vocabulary of " +
                    std::to_string(vocab));
  if (params_.repetition_penalty != 1.0) {
    std::vector<bool> seen(vocab, false);
    for (auto t : prompt) seen[t] = true;
    for (auto t : output) seen[t] = true;
    const auto p = static_cast<float>(params_.repetition_penalty);
    for (int64_t i = 0; i < vocab; ++i)
      if (seen[i]) logits[i] = logits[i] > 0 ? logits[i] / p : logits[i] * p;
  }
  if (params_.frequency_penalty != 0 || params_.presence_penalty != 0) {
    std::unordered_map<int32_t, int64_t> counts;
    for (auto t : output) ++counts[t];
    for (auto [t, n] : counts)
      logits[t] -= static_cast<float>(params_.frequency_penalty * n + params_.presence_penalty);
  }
  if (params_.temperature < 1e-5) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  const auto inv_t = static_cast<float>(1.0 / params_.temperature);
  for (auto& l : logits) l *= inv_t;

  // Candidates sorted by logit, best first; filters cut the tail.
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  int64_t keep = vocab;
  if (params_.top_k > 0) keep = std::min(keep, params_.top_k);
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  };
  if (keep < vocab) {
    std::partial_sort(order.begin(), order.begin() + keep, order.end(), by_logit);
  } else {
    std::sort(order.begin(), order.end(), by_logit);
  }
  order.resize(keep);
  std::vector<double> probs(keep);
  const double top = logits[order[0]];
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) sum += (probs[i] = std::exp(logits[order[i]] - top));
  for (auto& p : probs) p /= sum;
  if (params_.top_p < 1.0) {
    // Keep the smallest prefix whose mass reaches top_p (at least one token).
    double mass = 0;
    int64_t cut = 0;
    while (cut < keep && mass < params_.top_p) mass += probs[cut++];
    keep = std::max<int64_t>(cut, 1);
  }
  if (params_.min_p > 0) {
    const double floor = params_.min_p * probs[0];
    int64_t cut = 1;
    while (cut < keep && probs[cut] >= floor) ++cut;
    keep = cut;
  }
  std::discrete_distribution<int64_t> pick(probs.begin(), probs.begin() + keep);
  return order[pick(rng_)];
}

}  // namespace tandem::engine
