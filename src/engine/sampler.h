#pragma once
// Token sampling with the parameters of the OpenAI and vLLM APIs. Order, as in vLLM's V1 sampler:
// on the raw logits the allowed_token_ids mask, the bad_words mask, logit_bias, a structured
// output's grammar mask and min_tokens' mask (masks and a finite bias commute: vLLM's order),
// repetition penalty (prompt and output tokens), frequency and presence penalties (output
// tokens), then temperature; then min-p (relative to the most likely token), top-k, and top-p
// over the mass of the tokens those two left, renormalised; then a draw. Temperature 0 is greedy
// (argmax, lowest id on ties). Masks leaving no token fail the request (failure()) rather
// than draw from nothing, with one exception: min_tokens yields to a grammar whose answer is
// complete and allows nothing but an end (the end ids keep their logits and the other masks).
//
// Logprobs are the model's raw ones (token_logprobs below), before any of these, as vLLM's
// default raw_logprobs: a token masked by allowed_token_ids or bad_words keeps its logprob among
// the alternatives, as one moved by logit_bias does.
//
// Draws are keyed, not streamed: the noise of a draw is a function of the seed, the output
// position it decides and the token (an exponential race, the Gumbel-max trick: the token that
// minimises E / p, with E exponential noise keyed by (seed, position, token), is a draw from p).
// So a seeded request's token at a position depends on its seed, that position and the logits,
// never on how many draws came before: not on preemption, on how many drafts the scheduler let a
// step verify, or on which engine of a P/D pair sampled the tokens before it.
//
// Speculative decoding (engine/speculative) uses the same transformed distribution twice: a
// draft token is proposed from the draft model's logits, then verified against the target
// model's logits. A seeded request verifies by coupling: the draft is the race over the draft
// distribution q with the position's noise, and the answer is the race over the target p with the
// same noise, which is what sample() would give; the draft is accepted exactly when the two agree.
// Its answer is then the plain run's, whatever the drafts, at a few points of acceptance. An
// unseeded request, which asks for no repeatability, verifies by rejection sampling (Leviathan et
// al. 2023, Chen et al. 2023), which accepts most: accepted with probability min(1, p(d) / q(d)),
// else replaced by a draw from max(0, p - q) renormalised, distributed exactly as sample() on the
// target logits. Greedy requests accept exactly when the draft is the argmax.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "api/output.h"
#include "api/sampling.h"
#include "structured/token_constraint.h"

namespace tandem::engine {

using api::SamplingParams;

// The ids that end a sequence: stop_token_ids, and the EOS ids unless ignore_eos (what the output
// processor stops on; before min_tokens the sampler holds them back, and the EOS ids with
// ignore_eos too). Sorted, each id once (OutputProcessor looks ids up by binary search).
std::vector<int32_t> end_token_ids(const SamplingParams& params, std::span<const int32_t> eos_ids);

class Sampler {
 public:
  // `fallback_seed` seeds the generator when the request has no seed (callers pass a random one
  // unless they want unseeded runs to repeat). `eos_ids`: the ids that end a sequence unless
  // ignore_eos; with stop_token_ids they are never drawn before min_tokens (with ignore_eos
  // either, as vLLM).
  Sampler(const SamplingParams& params, uint64_t fallback_seed,
          std::span<const int32_t> eos_ids = {});

  // Picks the next token from logits[vocab] (modified in place).
  int32_t sample(std::span<float> logits, std::span<const int32_t> prompt,
                 std::span<const int32_t> output);

  // Constrains the answer to a grammar (structured outputs): sample() and verify() mask the
  // logits with it, after allowed_token_ids, bad_words and logit_bias, and advance it by the
  // token they return. propose() ignores it: a draft it refuses has probability 0 in verify(),
  // which rejects it, so the answer is distributed as without speculation. With
  // params.reasoning_end_token the grammar starts after that token was returned: the tokens up to
  // it (the reasoning) are neither masked nor fed to it.
  void constrain(std::unique_ptr<structured::TokenConstraint> constraint);
  const structured::TokenConstraint* constraint() const { return constraint_.get(); }
  // Why the constraint could not go on, or why the masks (allowed_token_ids, bad_words,
  // min_tokens, the grammar) left no token (empty while it can). A failed sampler's sample() and
  // verify() return the stand-in token 0, which the engine drops: it ends the request with this
  // error rather than failing the step of every request batched with it.
  const std::string& failure() const { return failure_; }

  bool greedy() const { return params_.temperature < kGreedyTemperature; }
  // A draft token from draft logits[vocab] (modified in place) with the same transforms as
  // sample(), for the position after `output`; when verify() will need it (an unseeded sampled
  // request), `q` receives the whole distribution it was drawn from [vocab], else it is emptied.
  int32_t propose(std::span<float> logits, std::span<const int32_t> prompt,
                  std::span<const int32_t> output, std::vector<float>& q);
  // Verifies `draft` against target logits[vocab] (modified in place): returns `draft` when it is
  // accepted, else the token that replaces it. `q` is what propose() returned for it (unused when
  // greedy or seeded).
  int32_t verify(std::span<float> logits, std::span<const int32_t> prompt,
                 std::span<const int32_t> output, int32_t draft, std::span<const float> q);

  static constexpr double kGreedyTemperature = 1e-5;

 private:
  // The candidates sample() draws from: ids (best first when a filter needed the order) and
  // their probabilities, `keep` of them; empty for greedy requests, whose choice is `argmax`.
  struct Candidates {
    std::vector<int32_t> order;
    std::vector<double> probs;
    int64_t keep = 0;
    int32_t argmax = -1;
  };
  Candidates candidates(std::span<float> logits, std::span<const int32_t> prompt,
                        std::span<const int32_t> output, bool constrained) const;
  // Why candidates() found every id masked after `generated` tokens (names the request's fields
  // that masked).
  std::string nothing_left(bool constrained, size_t generated) const;
  // The token returned, after it advanced the constraint.
  int32_t commit(int32_t token);
  // sample() or verify(), with a constraint's error recorded as failure().
  template <typename Draw>
  int32_t guarded(Draw draw);
  // The keyed draw from the candidates for output position `position` (not greedy).
  int32_t draw_token(const Candidates& c, size_t position) const;
  // candidates() as a dense distribution over the vocabulary.
  static void dense(const Candidates& c, std::vector<float>& out);

  SamplingParams params_;
  std::vector<int32_t> end_ids_;  // masked while the output is shorter than min_tokens: stop, EOS
  std::vector<int32_t> grammar_end_ids_;  // what ends a constrained answer once it is complete
  std::unique_ptr<structured::TokenConstraint> constraint_;
  // Whether the constraint holds yet: from the start, or once reasoning_end_token was returned.
  bool reasoning_ended_;
  std::string failure_;
  uint64_t seed_;
  // Seeded: verify() couples (the answer is sample()'s whatever the draft), else rejection.
  bool coupled_;
};

}  // namespace tandem::engine

namespace tandem::engine {

using api::TokenLogprob;

// Log-probability of `token` under softmax(logits), its rank and the `top` most likely tokens
// (highest first, lowest id on ties), from the model's raw logits as vLLM reports them by default.
TokenLogprob token_logprobs(std::span<const float> logits, int32_t token, int32_t top);

}  // namespace tandem::engine
