#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>

#include "kernels/cpu/ops.h"
#include "util/error.h"

namespace tandem::engine {

std::vector<int32_t> end_token_ids(const SamplingParams& params, std::span<const int32_t> eos_ids) {
  std::vector<int32_t> ids = params.stop_token_ids;
  if (!params.ignore_eos) ids.insert(ids.end(), eos_ids.begin(), eos_ids.end());
  // Sorted once per request: each generated token is then looked up by binary search, and a
  // client's repeated ids are masked once per step, not once per repetition.
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

Sampler::Sampler(const SamplingParams& params, uint64_t fallback_seed,
                 std::span<const int32_t> eos_ids)
    : params_(params), rng_(params.seed.value_or(fallback_seed)) {
  params_.validate();
  if (params_.min_tokens > 0) end_ids_ = end_token_ids(params_, eos_ids);
  grammar_end_ids_ = end_token_ids(params_, eos_ids);
  // With ignore_eos and no stop ids nothing ends the answer; EOS still marks a complete one.
  if (grammar_end_ids_.empty()) grammar_end_ids_.assign(eos_ids.begin(), eos_ids.end());
}

void Sampler::constrain(std::unique_ptr<structured::TokenConstraint> constraint) {
  constraint_ = std::move(constraint);
}

int32_t Sampler::commit(int32_t token) {
  if (constraint_) constraint_->accept(token, grammar_end_ids_);
  return token;
}

Sampler::Candidates Sampler::candidates(std::span<float> logits, std::span<const int32_t> prompt,
                                        std::span<const int32_t> output, bool constrained) const {
  const auto vocab = static_cast<int64_t>(logits.size());
  for (auto ids : {prompt, output})
    for (auto t : ids)
      if (t < 0 || t >= vocab)
        throw Error("sampler: token id " + std::to_string(t) + " is outside the vocabulary of " +
                    std::to_string(vocab));
  if (static_cast<int64_t>(output.size()) < params_.min_tokens) {
    // As vLLM does: the first min_tokens tokens cannot end the sequence.
    for (int32_t id : end_ids_)
      if (id >= 0 && id < vocab) logits[id] = -std::numeric_limits<float>::infinity();
  }
  // As vLLM: the bias goes on the raw logits, before penalties and temperature.
  for (const auto& [id, bias] : params_.logit_bias)
    if (id < vocab) logits[id] += bias;
  if (constrained && constraint_) constraint_->mask(logits, grammar_end_ids_);
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
  Candidates c;
  if (greedy()) {
    c.argmax = static_cast<int32_t>(kernels::argmax(logits.data(), vocab));
    return c;
  }
  const auto inv_t = static_cast<float>(1.0 / params_.temperature);
  for (auto& l : logits) l *= inv_t;

  // Candidates, best first when a filter needs the order: top-k keeps a sorted prefix, top-p
  // sorts; plain temperature sampling (and min-p, which needs only the maximum) skips the sort,
  // which would otherwise cost more than the rest of a small model's step.
  std::vector<int32_t>& order = c.order;
  order.resize(vocab);
  std::iota(order.begin(), order.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  };
  if (params_.top_k > 0 && params_.top_k < vocab) {
    std::partial_sort(order.begin(), order.begin() + params_.top_k, order.end(), by_logit);
    order.resize(params_.top_k);
  } else if (params_.top_p < 1.0) {
    std::sort(order.begin(), order.end(), by_logit);
  }
  int64_t& keep = c.keep;
  keep = static_cast<int64_t>(order.size());
  std::vector<double>& probs = c.probs;
  probs.resize(keep);
  float top = -std::numeric_limits<float>::infinity();
  for (auto id : order) top = std::max(top, logits[id]);
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
    // Relative to the most likely token, whose probability is exp(0) / sum.
    const double floor = params_.min_p / sum;
    int64_t w = 0;
    for (int64_t i = 0; i < keep; ++i) {
      if (probs[i] >= floor) {
        probs[w] = probs[i];
        order[w++] = order[i];
      }
    }
    keep = w;
  }
  return c;
}

template <typename Draw>
int32_t Sampler::guarded(Draw draw) {
  if (!failure_.empty()) return 0;
  try {
    return draw();
  } catch (const structured::ConstraintError& e) {
    failure_ = e.what();
    return 0;
  }
}

int32_t Sampler::sample(std::span<float> logits, std::span<const int32_t> prompt,
                        std::span<const int32_t> output) {
  return guarded([&] {
    const Candidates c = candidates(logits, prompt, output, true);
    if (greedy()) return commit(c.argmax);
    std::discrete_distribution<int64_t> pick(c.probs.begin(), c.probs.begin() + c.keep);
    return commit(static_cast<int32_t>(c.order[pick(rng_)]));
  });
}

void Sampler::dense(const Candidates& c, std::vector<float>& out) {
  std::fill(out.begin(), out.end(), 0.0f);
  double sum = 0;
  for (int64_t i = 0; i < c.keep; ++i) sum += c.probs[i];
  for (int64_t i = 0; i < c.keep; ++i) out[c.order[i]] = static_cast<float>(c.probs[i] / sum);
}

int32_t Sampler::propose(std::span<float> logits, std::span<const int32_t> prompt,
                         std::span<const int32_t> output, std::vector<float>& q) {
  const Candidates c = candidates(logits, prompt, output, false);
  if (greedy()) return c.argmax;
  q.resize(logits.size());
  dense(c, q);
  // Drawn from q itself (not from c.probs), so the token and the q verify() divides by agree
  // to the last bit.
  std::discrete_distribution<int64_t> pick(q.begin(), q.end());
  return static_cast<int32_t>(pick(rng_));
}

int32_t Sampler::verify(std::span<float> logits, std::span<const int32_t> prompt,
                        std::span<const int32_t> output, int32_t draft, std::span<const float> q) {
  return guarded([&]() -> int32_t {
    const Candidates c = candidates(logits, prompt, output, true);
    if (greedy()) return commit(c.argmax);
    const auto vocab = static_cast<int64_t>(logits.size());
    if (draft < 0 || draft >= vocab || static_cast<int64_t>(q.size()) != vocab || !(q[draft] > 0))
      throw Error("sampler: draft token " + std::to_string(draft) +
                  " comes without the distribution it was drawn from");
    std::vector<float> p(static_cast<size_t>(vocab));
    dense(c, p);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    if (unit(rng_) * q[draft] < p[draft]) return commit(draft);  // u < p(d) / q(d)
    // Rejected: p(d) < q(d) here, so the residual gives d no mass.
    std::vector<double> residual(static_cast<size_t>(vocab));
    double mass = 0;
    for (int64_t i = 0; i < vocab; ++i) mass += (residual[i] = std::max(0.0f, p[i] - q[i]));
    if (!(mass > 0)) {
      // p equals q (up to rounding) everywhere but at d: draw from p without d.
      p[draft] = 0;
      std::discrete_distribution<int64_t> pick(p.begin(), p.end());
      return commit(static_cast<int32_t>(pick(rng_)));
    }
    std::discrete_distribution<int64_t> pick(residual.begin(), residual.end());
    return commit(static_cast<int32_t>(pick(rng_)));
  });
}

}  // namespace tandem::engine

namespace tandem::engine {

TokenLogprob token_logprobs(std::span<const float> logits, int32_t token, int32_t top) {
  float m = -std::numeric_limits<float>::infinity();
  for (float v : logits) m = std::max(m, v);
  double sum = 0;
  for (float v : logits) sum += std::exp(static_cast<double>(v) - m);
  const double log_z = m + std::log(sum);
  TokenLogprob out;
  out.token = token;
  out.logprob = static_cast<float>(logits[token] - log_z);
  if (top > 0) {
    const auto k = std::min<size_t>(static_cast<size_t>(top), logits.size());
    std::vector<int32_t> ids(logits.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
      return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
    });
    for (size_t i = 0; i < k; ++i)
      out.top.emplace_back(ids[i], static_cast<float>(logits[ids[i]] - log_z));
  }
  return out;
}

}  // namespace tandem::engine
