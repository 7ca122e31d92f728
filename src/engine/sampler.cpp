#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>

#include "kernels/cpu/ops.h"
#include "util/error.h"
#include "util/hash.h"

namespace tandem::engine {
namespace {

// What a keyed draw decides at an output position: the token, or (rejection sampling) whether
// a draft is accepted, or the token that replaces a rejected one.
enum class Draw : uint64_t { kToken = 0, kAccept = 1, kResidual = 2 };

uint64_t draw_key(uint64_t seed, size_t position, Draw draw) {
  return hash_u64(hash_u64(seed) + uint64_t(position) * 4 + static_cast<uint64_t>(draw));
}

// Uniform in (0, 1), never 0 or 1, from 64 random bits.
double unit(uint64_t bits) {
  return (static_cast<double>(bits >> 11) + 0.5) * 0x1p-53;
}

double noise_unit(uint64_t key, int32_t token) {
  return unit(hash_u64(key + static_cast<uint64_t>(token) * 0x9E3779B97F4A7C15ULL));
}

// The index i minimising E_i / weights[i], E_i = -log(u_i) with u_i keyed by (key, id of i): a
// draw with probabilities proportional to `weights` (an exponential race) in which a token's noise
// depends on the key and the token alone, not on which others compete or in what order. `ids`
// empty: index i is token i. Zero weights never win; at least one weight must be positive.
int64_t race(std::span<const int32_t> ids, std::span<const double> weights, uint64_t key) {
  auto id = [&](int64_t i) { return ids.empty() ? static_cast<int32_t>(i) : ids[size_t(i)]; };
  const auto n = static_cast<int64_t>(weights.size());
  // The heaviest first: its score bounds the others, most of which then need no logarithm.
  const int64_t first = std::max_element(weights.begin(), weights.end()) - weights.begin();
  int64_t best = first;
  double bound = -std::log(noise_unit(key, id(first))) / weights[size_t(first)];
  for (int64_t i = 0; i < n; ++i) {
    const double w = weights[size_t(i)];
    if (i == first || !(w > 0)) continue;
    const double u = noise_unit(key, id(i));
    // E_i >= bound * w when u <= 1 - bound * w (as exp(-x) >= 1 - x): it cannot win.
    if (u <= 1 - bound * w) continue;
    const double score = -std::log(u) / w;
    if (score < bound) {
      bound = score;
      best = i;
    }
  }
  return best;
}

}  // namespace

namespace {

// The stop ids, and the EOS ids when `with_eos`. Sorted once per request: each generated token is
// then looked up by binary search, and a client's repeated ids are masked once per step, not once
// per repetition.
std::vector<int32_t> stop_ids(const SamplingParams& params, std::span<const int32_t> eos_ids,
                              bool with_eos) {
  std::vector<int32_t> ids = params.stop_token_ids;
  if (with_eos) ids.insert(ids.end(), eos_ids.begin(), eos_ids.end());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

}  // namespace

std::vector<int32_t> end_token_ids(const SamplingParams& params, std::span<const int32_t> eos_ids) {
  return stop_ids(params, eos_ids, !params.ignore_eos);
}

Sampler::Sampler(const SamplingParams& params, uint64_t fallback_seed,
                 std::span<const int32_t> eos_ids)
    : params_(params),
      reasoning_ended_(!params.reasoning_end_token),
      seed_(params.seed.value_or(fallback_seed)),
      coupled_(params.seed.has_value()) {
  params_.validate();
  // min_tokens holds the EOS ids back with ignore_eos too, as vLLM does: its mask is
  // SamplingParams.all_stop_token_ids, to which update_from_generation_config adds the model's
  // EOS ids whatever ignore_eos says (vllm/sampling_params.py, v1 MinTokensLogitsProcessor).
  if (params_.min_tokens > 0) end_ids_ = stop_ids(params_, eos_ids, /*with_eos=*/true);
  grammar_end_ids_ = end_token_ids(params_, eos_ids);
  // With ignore_eos and no stop ids nothing ends the answer; EOS still marks a complete one.
  if (grammar_end_ids_.empty()) grammar_end_ids_.assign(eos_ids.begin(), eos_ids.end());
}

void Sampler::constrain(std::unique_ptr<structured::TokenConstraint> constraint) {
  constraint_ = std::move(constraint);
}

int32_t Sampler::commit(int32_t token) {
  if (!reasoning_ended_)
    reasoning_ended_ = token == params_.reasoning_end_token;
  else if (constraint_)
    constraint_->accept(token, grammar_end_ids_);
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
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  if (const auto& allowed = params_.allowed_token_ids; !allowed.empty()) {
    // As vLLM, first of all: every id outside the list is out, whatever its bias.
    auto next = allowed.begin();
    for (int32_t id = 0; id < vocab; ++id) {
      while (next != allowed.end() && *next < id) ++next;
      if (next == allowed.end() || *next != id) logits[id] = kMasked;
    }
  }
  // As vLLM: a bad word's last id is out when the output (not the prompt) ends in the ids before
  // it, so a one-token word is never drawn and a longer one never completed.
  for (const auto& word : params_.bad_words_token_ids) {
    const size_t before = word.size() - 1;
    if (before > output.size() || word.back() >= vocab) continue;
    if (std::equal(word.begin(), word.end() - 1, output.end() - before))
      logits[word.back()] = kMasked;
  }
  // As vLLM: the bias goes on the raw logits, before penalties and temperature.
  for (const auto& [id, bias] : params_.logit_bias)
    if (id < vocab) logits[id] += bias;
  const bool grammar = constrained && constraint_ && reasoning_ended_;
  if (grammar) constraint_->mask(logits, grammar_end_ids_);
  if (static_cast<int64_t>(output.size()) < params_.min_tokens) {
    // As vLLM does: the first min_tokens tokens cannot end the sequence. (After the bias and the
    // grammar, as masks and a finite bias commute: vLLM's order.)
    std::vector<std::pair<int32_t, float>> held;
    for (int32_t id : end_ids_) {
      if (id < 0 || id >= vocab) continue;
      held.emplace_back(id, logits[id]);
      logits[id] = kMasked;
    }
    // A grammar whose answer is complete and allows nothing more but an end wins: the ends come
    // back as they were (masked still where allowed_token_ids or bad_words masked them).
    if (grammar && std::none_of(logits.begin(), logits.end(), [](float v) { return v > kMasked; }))
      for (const auto& [id, logit] : held) logits[id] = logit;
  }
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
    if (!(logits[c.argmax] > kMasked))
      throw structured::ConstraintError(nothing_left(constrained, output.size()));
    return c;
  }
  const auto inv_t = static_cast<float>(1.0 / params_.temperature);
  for (auto& l : logits) l *= inv_t;

  // Candidates, best first when a filter needs the order: top-k keeps a sorted prefix, top-p a
  // sorted head long enough to hold its mass; plain temperature sampling (and min-p, which needs
  // only the maximum) skips the sort. A whole vocabulary's sort would cost more than the rest of
  // a small model's step (~20 ms for 129k ids).
  std::vector<int32_t>& order = c.order;
  order.resize(vocab);
  std::iota(order.begin(), order.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  };
  const bool sorted = params_.top_k > 0 && params_.top_k < vocab;
  if (sorted) {
    std::partial_sort(order.begin(), order.begin() + params_.top_k, order.end(), by_logit);
    order.resize(params_.top_k);
  }
  float top = -std::numeric_limits<float>::infinity();
  for (auto id : order) top = std::max(top, logits[id]);
  // Every id masked: the probabilities below would be NaN, and any token a violation.
  if (!(top > kMasked)) throw structured::ConstraintError(nothing_left(constrained, output.size()));
  if (params_.min_p > 0) {
    // As vLLM V1, before top-p: out when less likely than min_p times the most likely token
    // (whose logit is `top`, top-k or not). Both keep a prefix of the logits' order, so top-k's
    // sorted prefix stays sorted.
    order.erase(
        std::remove_if(order.begin(), order.end(),
                       [&](int32_t id) { return std::exp(logits[id] - top) < params_.min_p; }),
        order.end());
  }
  const auto left = static_cast<int64_t>(order.size());
  // The probabilities' denominator: over the tokens top-k and min-p left (top-p's mass is theirs,
  // renormalised, as vLLM's).
  double sum = 0;
  for (auto id : order) sum += std::exp(logits[id] - top);
  if (params_.top_p < 1.0 && !sorted) {
    // The head the top-p cut can reach, found by sorting ever longer heads (the same order as a
    // whole sort: by_logit is a strict total order).
    auto head = std::min<int64_t>(left, 256);
    for (;;) {
      std::partial_sort(order.begin(), order.begin() + head, order.end(), by_logit);
      double mass = 0;
      for (int64_t i = 0; i < head; ++i) mass += std::exp(logits[order[i]] - top) / sum;
      if (mass >= params_.top_p || head == left) break;
      head = std::min<int64_t>(left, head * 8);
    }
    order.resize(head);
  }
  int64_t& keep = c.keep;
  keep = static_cast<int64_t>(order.size());
  std::vector<double>& probs = c.probs;
  probs.resize(keep);
  for (int64_t i = 0; i < keep; ++i) probs[i] = std::exp(logits[order[i]] - top) / sum;
  if (params_.top_p < 1.0) {
    // Keep the smallest prefix whose mass reaches top_p (at least one token).
    double mass = 0;
    int64_t cut = 0;
    while (cut < keep && mass < params_.top_p) mass += probs[cut++];
    keep = std::max<int64_t>(cut, 1);
  }
  return c;
}

std::string Sampler::nothing_left(bool constrained, size_t generated) const {
  std::string why;
  auto add = [&](const std::string& name) { why += (why.empty() ? "'" : ", '") + name + "'"; };
  if (!params_.allowed_token_ids.empty()) add("allowed_token_ids");
  if (!params_.bad_words_token_ids.empty()) add("bad_words");
  if (static_cast<int64_t>(generated) < params_.min_tokens && !end_ids_.empty()) add("min_tokens");
  if (constrained && constraint_ && reasoning_ended_ && params_.structured_output)
    add(params_.structured_output->field);
  return "no token can be sampled: " + (why.empty() ? std::string("the model's logits") : why) +
         " exclude every token of the vocabulary (or every one with text)";
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
    return commit(draw_token(c, output.size()));
  });
}

int32_t Sampler::draw_token(const Candidates& c, size_t position) const {
  const auto keep = static_cast<size_t>(c.keep);
  const int64_t i = race(std::span(c.order).first(keep), std::span(c.probs).first(keep),
                         draw_key(seed_, position, Draw::kToken));
  return c.order[size_t(i)];
}

void Sampler::dense(const Candidates& c, std::vector<float>& out) {
  std::fill(out.begin(), out.end(), 0.0f);
  double sum = 0;
  for (int64_t i = 0; i < c.keep; ++i) sum += c.probs[i];
  for (int64_t i = 0; i < c.keep; ++i) out[c.order[i]] = static_cast<float>(c.probs[i] / sum);
}

int32_t Sampler::propose(std::span<float> logits, std::span<const int32_t> prompt,
                         std::span<const int32_t> output, std::vector<float>& q) {
  q.clear();
  Candidates c;
  try {
    c = candidates(logits, prompt, output, false);
  } catch (const structured::ConstraintError&) {
    // Nothing is allowed here: verify() sees the same masks (and maybe the grammar's) at this
    // position and fails the request; any draft stands in until then.
    if (!greedy() && !coupled_) {
      q.assign(logits.size(), 0.0f);
      q[0] = 1;
    }
    return 0;
  }
  if (greedy()) return c.argmax;
  // With the noise sample() and verify() use at this position: a coupled draft is what the
  // target's race picks whenever the two distributions agree enough.
  const int32_t draft = draw_token(c, output.size());
  if (!coupled_) {
    q.resize(logits.size());
    dense(c, q);
  }
  return draft;
}

int32_t Sampler::verify(std::span<float> logits, std::span<const int32_t> prompt,
                        std::span<const int32_t> output, int32_t draft, std::span<const float> q) {
  return guarded([&]() -> int32_t {
    const Candidates c = candidates(logits, prompt, output, true);
    if (greedy()) return commit(c.argmax);
    // Coupled: the answer is sample()'s; the draft is accepted when it is that token.
    if (coupled_) return commit(draw_token(c, output.size()));
    const auto vocab = static_cast<int64_t>(logits.size());
    if (draft < 0 || draft >= vocab || static_cast<int64_t>(q.size()) != vocab || !(q[draft] > 0))
      throw Error("sampler: draft token " + std::to_string(draft) +
                  " comes without the distribution it was drawn from");
    std::vector<float> p(static_cast<size_t>(vocab));
    dense(c, p);
    const size_t position = output.size();
    const double u = unit(hash_u64(draw_key(seed_, position, Draw::kAccept)));
    if (u * q[draft] < p[draft]) return commit(draft);  // u < p(d) / q(d)
    // Rejected: p(d) < q(d) here, so the residual gives d no mass.
    std::vector<double> residual(static_cast<size_t>(vocab));
    double mass = 0;
    for (int64_t i = 0; i < vocab; ++i) mass += (residual[i] = std::max(0.0f, p[i] - q[i]));
    if (!(mass > 0)) {
      // p equals q (up to rounding) everywhere but at d: draw from p without d.
      for (int64_t i = 0; i < vocab; ++i) residual[i] = i == draft ? 0.0 : p[i];
    }
    return commit(
        static_cast<int32_t>(race({}, residual, draw_key(seed_, position, Draw::kResidual))));
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
  out.rank = 1 + static_cast<int32_t>(std::count_if(logits.begin(), logits.end(),
                                                    [&](float v) { return v > logits[token]; }));
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
