// Sampling rules as properties: greedy picks the argmax, filters leave only the tokens they
// should, penalties move the logits they should, and a draw is a function of the seed and the
// position it decides. One sampler draws one token per position, so draws of a distribution are
// taken over seeds (one sampler each) or over positions.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>

#include <gtest/gtest.h>

#include "structured/output_spec.h"
#include "util/error.h"

namespace tandem::engine {
namespace {

std::vector<float> logits_of(std::vector<float> v) {
  return v;
}

TEST(Sampler, GreedyIsArgmax) {
  SamplingParams p;
  p.temperature = 0;
  Sampler s(p, 1);
  auto l = logits_of({0.1f, 3.0f, -1.0f, 2.9f});
  EXPECT_EQ(s.sample(l, {}, {}), 1);
}

TEST(Sampler, TopKOneAndTinyTopPAndFullMinPAreGreedy) {
  for (int variant = 0; variant < 3; ++variant) {
    SamplingParams p;
    p.temperature = 1.5;
    if (variant == 0) p.top_k = 1;
    if (variant == 1) p.top_p = 1e-6;
    if (variant == 2) p.min_p = 1.0;
    for (int i = 0; i < 50; ++i) {
      Sampler s(p, 42 + i);
      auto l = logits_of({0.5f, 0.2f, 0.7f, 0.69f});
      ASSERT_EQ(s.sample(l, {}, {}), 2) << variant;
    }
  }
}

TEST(Sampler, TopKNeverLeavesTheKBest) {
  SamplingParams p;
  p.top_k = 2;
  for (int i = 0; i < 500; ++i) {
    Sampler s(p, 7 + i);
    auto l = logits_of({1.0f, 0.9f, 3.0f, 2.8f, 0.0f});
    int t = s.sample(l, {}, {});
    ASSERT_TRUE(t == 2 || t == 3);
  }
}

// Top-p sorts only a head of the vocabulary, growing it until it holds top_p of the mass: the
// nucleus must still be exactly the whole sort's. 600 equal tokens hold 93% of the mass (2400
// others share the rest), so top_p 0.9 keeps ids 0..579 (ties by lowest id), past the first head.
TEST(Sampler, TopPKeepsExactlyTheNucleusPastTheFirstSortedHead) {
  std::vector<float> logits(3000, -4.0f);
  std::fill(logits.begin(), logits.begin() + 600, 0.0f);
  SamplingParams p;
  p.top_p = 0.9;
  std::set<int32_t> drawn;
  for (int i = 0; i < 20000; ++i) {
    Sampler s(p, 1000 + i);
    auto l = logits;
    drawn.insert(s.sample(l, {}, {}));
  }
  EXPECT_EQ(*drawn.begin(), 0);
  EXPECT_EQ(*drawn.rbegin(), 579);  // the last of the nucleus is drawn, nothing after it
  EXPECT_GT(drawn.size(), 570u);
}

// vLLM V1's order: min-p (after temperature), then top-p over the mass of min-p's survivors,
// renormalised. The distribution a draw comes from is exact (propose() hands it over for an
// unseeded request): with min_p 0.5 and top_p 0.6 over [0.5, 0.3, 0.1, 0.05, 0.05], min-p keeps
// {0, 1} (0.625 and 0.375 renormalised) and top-p then token 0 alone; top-p first would keep
// {0, 1}.
TEST(Sampler, MinPFiltersBeforeTopPWhoseMassIsOverTheSurvivors) {
  struct Case {
    std::vector<double> probs;
    double min_p, top_p;
    std::vector<float> expected;
  };
  const Case cases[] = {
      {{0.5, 0.3, 0.1, 0.05, 0.05}, 0.5, 0.6, {1, 0, 0, 0, 0}},
      // min-p keeps {0, 1, 2} (4/9, 3/9, 2/9): top-p 0.75 needs 0 and 1 of them.
      {{0.4, 0.3, 0.2, 0.1}, 0.3, 0.75, {4.0f / 7, 3.0f / 7, 0, 0}},
  };
  for (const Case& c : cases) {
    std::vector<float> logits;
    for (double p : c.probs) logits.push_back(static_cast<float>(std::log(p)));
    SamplingParams p;
    p.min_p = c.min_p;
    p.top_p = c.top_p;
    Sampler s(p, 1);
    std::vector<float> q;
    auto l = logits;
    s.propose(l, {}, {}, q);
    ASSERT_EQ(q.size(), c.expected.size());
    for (size_t i = 0; i < q.size(); ++i)
      EXPECT_NEAR(q[i], c.expected[i], 1e-5) << "min_p " << c.min_p << " token " << i;
    // Seeded draws never leave the kept set.
    for (int seed = 0; seed < 500; ++seed) {
      p.seed = seed;
      Sampler seeded(p, 0);
      l = logits;
      const int32_t t = seeded.sample(l, {}, {});
      ASSERT_GT(c.expected[size_t(t)], 0.0f) << "min_p " << c.min_p << " seed " << seed;
    }
  }
}

TEST(Sampler, DrawsFollowTheSoftmaxOverSeedsAndOverPositions) {
  const int n = 20000;
  std::map<int, int> over_seeds, over_positions;
  SamplingParams p;
  for (int i = 0; i < n; ++i) {
    p.seed = 123 + i;
    Sampler s(p, 0);
    auto l = logits_of({0.0f, std::log(3.0f)});  // probabilities 1/4 and 3/4
    ++over_seeds[s.sample(l, {}, {})];
  }
  p.seed = 123;
  Sampler s(p, 0);
  std::vector<int32_t> output;
  for (int i = 0; i < n; ++i) {
    auto l = logits_of({0.0f, std::log(3.0f)});
    const int32_t t = s.sample(l, {}, output);
    ++over_positions[t];
    output.push_back(t);
  }
  EXPECT_NEAR(over_seeds[1] / double(n), 0.75, 0.02);
  EXPECT_NEAR(over_positions[1] / double(n), 0.75, 0.02);
}

TEST(Sampler, SeedMakesDrawsReproducible) {
  SamplingParams p;
  p.seed = 99;
  Sampler a(p, 1), b(p, 2);  // the request seed wins over the fallback
  std::vector<int32_t> output;
  for (int i = 0; i < 100; ++i) {
    auto la = logits_of({0.1f, 0.2f, 0.3f, 0.4f, 0.5f});
    auto lb = la;
    const int32_t t = a.sample(la, {}, output);
    ASSERT_EQ(t, b.sample(lb, {}, output));
    output.push_back(t);
  }
}

// What makes a seeded answer the same under any load: the token at a position is a function of
// the seed, the position and the logits, not of the draws before it (preemption, drafts verified,
// the other engine of a P/D pair).
TEST(Sampler, ADrawDependsOnItsSeedAndPositionNotOnTheDrawsBefore) {
  SamplingParams p;
  p.seed = 5;
  p.temperature = 1.0;
  const std::vector<float> flat = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.0f, 0.3f, 0.1f};
  Sampler in_order(p, 0);
  std::vector<int32_t> output;
  for (int i = 0; i < 64; ++i) {
    auto l = flat;
    output.push_back(in_order.sample(l, {}, output));
  }
  std::set<int32_t> seen(output.begin(), output.end());
  EXPECT_GT(seen.size(), 4u);  // the positions' draws are not one token
  for (size_t at : {size_t(0), size_t(17), size_t(63)}) {
    Sampler fresh(p, 0);  // draws nothing before `at`
    auto l = flat;
    EXPECT_EQ(fresh.sample(l, {}, std::span(output).first(at)), output[at]) << at;
    auto again = flat;  // and the same position asked twice answers the same
    EXPECT_EQ(fresh.sample(again, {}, std::span(output).first(at)), output[at]) << at;
  }
  p.seed = 6;
  Sampler other(p, 0);
  int differ = 0;
  for (size_t at = 0; at < output.size(); ++at) {
    auto l = flat;
    differ += other.sample(l, {}, std::span(output).first(at)) != output[at];
  }
  EXPECT_GT(differ, 16);  // another seed, other draws
}

TEST(Sampler, PenaltiesMoveTheRightLogits) {
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 2.0;
  Sampler s(p, 1);
  auto l = logits_of({2.0f, 1.5f, -1.0f});
  std::vector<int32_t> prompt = {0};
  EXPECT_EQ(s.sample(l, prompt, {}), 1);  // 2.0 / 2 = 1.0 < 1.5
  EXPECT_FLOAT_EQ(l[0], 1.0f);

  SamplingParams f;
  f.temperature = 0;
  f.frequency_penalty = 0.5;
  f.presence_penalty = 0.25;
  Sampler sf(f, 1);
  auto l2 = logits_of({2.0f, 1.5f});
  std::vector<int32_t> output = {0, 0};
  EXPECT_EQ(sf.sample(l2, {}, output), 1);
  EXPECT_FLOAT_EQ(l2[0], 2.0f - 0.5f * 2 - 0.25f);
}

// OpenAI's logit_bias: added to the raw logits, so it decides greedy choices, and a bias of -100
// keeps a token out of draws; penalties apply after it (vLLM's order).
TEST(Sampler, LogitBiasMovesGreedyChoicesAndDraws) {
  SamplingParams g;
  g.temperature = 0;
  g.logit_bias = {{2, 3.5f}};
  Sampler greedy(g, 1);
  auto l = logits_of({0.1f, 3.0f, -1.0f, 2.9f});
  EXPECT_EQ(greedy.sample(l, {}, {}), 1);  // -1 + 3.5 = 2.5 < 3.0
  EXPECT_FLOAT_EQ(l[2], 2.5f);
  l = logits_of({0.1f, 2.0f, -1.0f, 1.9f});
  EXPECT_EQ(greedy.sample(l, {}, {}), 2);  // 2.5 > 2.0

  SamplingParams d;
  d.temperature = 1.0;
  d.logit_bias = {{1, -100.0f}};
  for (int i = 0; i < 2000; ++i) {
    Sampler draws(d, 7 + i);
    auto ld = logits_of({0.0f, 5.0f, 0.0f});  // token 1 would be drawn 98% of the time
    ASSERT_NE(draws.sample(ld, {}, {}), 1);
  }

  SamplingParams r;
  r.temperature = 0;
  r.repetition_penalty = 2.0;
  r.logit_bias = {{0, 2.0f}};
  Sampler penalised(r, 1);
  l = logits_of({2.0f, 1.5f});
  const std::vector<int32_t> prompt = {0};
  EXPECT_EQ(penalised.sample(l, prompt, {}), 0);  // (2 + 2) / 2 = 2.0 > 1.5
  EXPECT_FLOAT_EQ(l[0], 2.0f);
}

// vLLM's min_tokens: EOS and stop_token_ids cannot be drawn before min_tokens tokens exist.
TEST(Sampler, EndTokensAreNotDrawnBeforeMinTokens) {
  SamplingParams p;
  p.temperature = 0;
  p.min_tokens = 2;
  p.stop_token_ids = {3};
  const std::vector<int32_t> eos = {1};
  Sampler s(p, 1, eos);
  const std::vector<float> ends_best = {0.0f, 5.0f, 1.0f, 4.0f};  // EOS, then the stop id
  auto l = ends_best;
  EXPECT_EQ(s.sample(l, {}, {}), 2);
  const std::vector<int32_t> one = {2}, two = {2, 2};
  l = ends_best;
  EXPECT_EQ(s.sample(l, {}, one), 2);
  l = ends_best;
  EXPECT_EQ(s.sample(l, {}, two), 1);  // min_tokens reached: EOS may come
  // ignore_eos: EOS ends nothing, but before min_tokens it is held back all the same, as vLLM
  // holds it: its min_tokens mask (v1 MinTokensLogitsProcessor, logits_processor/builtin.py) is
  // SamplingParams.all_stop_token_ids, to which update_from_generation_config adds the model's
  // EOS ids whatever ignore_eos says (vllm/sampling_params.py). Before, EOS could be drawn first.
  p.ignore_eos = true;
  Sampler keep_eos(p, 1, eos);
  l = ends_best;
  EXPECT_EQ(keep_eos.sample(l, {}, {}), 2);
  l = ends_best;
  EXPECT_EQ(keep_eos.sample(l, {}, one), 2);
  l = ends_best;
  EXPECT_EQ(keep_eos.sample(l, {}, two), 1);  // min_tokens reached: EOS is an ordinary token
}

// Logits of `vocab` ids drawn from a seeded generator (ties are improbable).
std::vector<float> random_logits(std::mt19937& gen, int vocab) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> l(static_cast<size_t>(vocab));
  for (auto& v : l) v = normal(gen);
  return l;
}

// vLLM's allowed_token_ids: draws, greedy or not, filtered or not, come from the list alone, even
// when logit_bias or penalties favour another id; greedy takes the best allowed id (found here by
// a scan of the raw logits).
TEST(Sampler, AllowedTokenIdsAreNeverViolated) {
  std::mt19937 gen(11);
  const int vocab = 40;
  for (int trial = 0; trial < 400; ++trial) {
    SamplingParams p;
    std::set<int32_t> allowed;
    const int count = 1 + trial % 5;
    while (static_cast<int>(allowed.size()) < count) allowed.insert(int32_t(gen() % vocab));
    p.allowed_token_ids.assign(allowed.begin(), allowed.end());
    p.temperature = trial % 4 == 0 ? 0.0 : 0.5 + trial % 3;
    p.top_k = trial % 3 == 0 ? 3 : 0;
    p.top_p = trial % 5 == 0 ? 0.5 : 1.0;
    p.logit_bias = {{int32_t(gen() % vocab), 100.0f}};
    p.seed = trial;
    Sampler s(p, trial);
    const std::vector<float> raw = random_logits(gen, vocab);
    auto l = raw;
    const int32_t t = s.sample(l, {}, {});
    ASSERT_TRUE(allowed.count(t)) << "trial " << trial << " drew " << t;
    ASSERT_TRUE(s.failure().empty());
    if (p.temperature == 0) {
      int32_t best = -1;
      for (int32_t id : allowed) {
        float v = raw[id];
        if (id == p.logit_bias[0].first) v += 100.0f;
        if (best < 0 || v > (best == p.logit_bias[0].first ? raw[best] + 100.0f : raw[best]))
          best = id;
      }
      EXPECT_EQ(t, best) << "trial " << trial;
    }
  }
}

// The ids banned after `output` by vLLM's rule, by brute force: t is banned when some word ends in
// t and the output ends in the word's other ids.
std::set<int32_t> banned_after(const std::vector<std::vector<int32_t>>& words,
                               const std::vector<int32_t>& output) {
  std::set<int32_t> out;
  for (const auto& w : words) {
    bool match = w.size() - 1 <= output.size();
    for (size_t k = 0; match && k + 1 < w.size(); ++k)
      match = output[output.size() - (w.size() - 1) + k] == w[k];
    if (match) out.insert(w.back());
  }
  return out;
}

// vLLM's bad_words: after any output, exactly the ids that would complete a word are masked
// (one-token words always, longer words after their prefix); the prompt does not count.
TEST(Sampler, BadWordsMaskExactlyTheIdsThatCompleteAWord) {
  std::mt19937 gen(5);
  const int vocab = 6;
  for (int trial = 0; trial < 500; ++trial) {
    SamplingParams p;
    p.temperature = 0;
    const int n = 1 + trial % 3;
    for (int i = 0; i < n; ++i) {
      std::vector<int32_t> w(1 + gen() % 3);
      for (auto& t : w) t = int32_t(gen() % vocab);
      p.bad_words_token_ids.push_back(w);
    }
    std::vector<int32_t> output(gen() % 5);
    for (auto& t : output) t = int32_t(gen() % vocab);
    const std::vector<int32_t> prompt = {int32_t(gen() % vocab), int32_t(gen() % vocab)};
    const std::set<int32_t> banned = banned_after(p.bad_words_token_ids, output);
    if (static_cast<int>(banned.size()) == vocab) continue;
    Sampler s(p, 1);
    std::vector<float> l(vocab, 1.0f);
    const int32_t t = s.sample(l, prompt, output);
    for (int32_t id = 0; id < vocab; ++id)
      ASSERT_EQ(std::isinf(l[id]) && l[id] < 0, banned.count(id) == 1)
          << "trial " << trial << " id " << id;
    EXPECT_FALSE(banned.count(t));
  }
}

// Over long sampled answers, no bad word (one or several tokens) ever appears whole, while its
// prefixes still do.
TEST(Sampler, SampledAnswersNeverHoldABadWord) {
  const std::vector<std::vector<int32_t>> words = {{2}, {0, 1}, {3, 3, 4}};
  bool prefix_seen = false;
  for (int seed = 0; seed < 40; ++seed) {
    SamplingParams p;
    p.temperature = 1.0;
    p.seed = seed;
    p.bad_words_token_ids = words;
    Sampler s(p, seed);
    std::mt19937 gen(seed);
    std::vector<int32_t> output;
    for (int i = 0; i < 200; ++i) {
      auto l = random_logits(gen, 5);
      l[2] += 3;  // the banned one-token word would be the likeliest
      output.push_back(s.sample(l, {}, output));
    }
    for (const auto& w : words)
      ASSERT_EQ(std::search(output.begin(), output.end(), w.begin(), w.end()), output.end())
          << "seed " << seed;
    const std::vector<int32_t> prefix = {3, 3};
    prefix_seen |=
        std::search(output.begin(), output.end(), prefix.begin(), prefix.end()) != output.end();
  }
  EXPECT_TRUE(prefix_seen);
}

// Masks that leave nothing (the only allowed id is EOS before min_tokens) fail the request with
// a reason naming the fields, rather than draw a token they exclude; propose() does not throw.
TEST(Sampler, MasksThatLeaveNoTokenFailTheRequest) {
  for (double temperature : {0.0, 1.0}) {
    SamplingParams p;
    p.temperature = temperature;
    p.allowed_token_ids = {1};
    p.min_tokens = 1;
    const std::vector<int32_t> eos = {1};
    Sampler s(p, 1, eos);
    std::vector<float> q;
    auto d = logits_of({0.0f, 1.0f, 2.0f});
    EXPECT_NO_THROW(s.propose(d, {}, {}, q));
    auto l = logits_of({0.0f, 1.0f, 2.0f});
    EXPECT_EQ(s.sample(l, {}, {}), 0);
    EXPECT_NE(s.failure().find("'allowed_token_ids', 'min_tokens'"), std::string::npos)
        << s.failure();
  }
}

// A sampler constrained to `spec` over a small vocabulary: "a", "{", "}", "\"", ":", " ", "1", and
// ids 7 and 8 without text (end ids).
struct Constrained {
  static constexpr int32_t kA = 0, kOpen = 1, kClose = 2, kSpace = 5, kEos = 7, kStop = 8,
                           kThinkEnd = 9, kVocab = 10;
  static std::shared_ptr<const structured::MaskVocabulary> vocabulary() {
    return std::make_shared<const structured::MaskVocabulary>(
        std::vector<std::string>{"a", "{", "}", "\"", ":", " ", "1", "", "", ""});
  }
  static Sampler make(SamplingParams p, structured::OutputSpec::Kind kind, std::string text) {
    p.structured_output = structured::OutputSpec{kind, std::move(text), "response_format"};
    const std::vector<int32_t> eos = {kEos};
    Sampler s(p, 1, eos);
    s.constrain(std::make_unique<structured::TokenConstraint>(
        structured::compile(*p.structured_output), std::make_shared<structured::MaskCache>(16),
        vocabulary()));
    return s;
  }
  // Logits that favour `best`, then `second` (if any), over every other token.
  static std::vector<float> favouring(int32_t best, int32_t second = -1) {
    std::vector<float> l(kVocab, 0.0f);
    l[best] = 30;
    if (second >= 0) l[second] = 20;
    return l;
  }
};

// allowed_token_ids and bad_words bind a structured answer too: when with the grammar they leave
// no token (a JSON object must open with '{' or white space: the only id allowed is "a", or both
// are bad words), the request fails naming the fields, rather than draw a token they exclude.
TEST(Sampler, MasksThatLeaveAGrammarNoTokenFailTheRequestNamingTheFields) {
  using K = structured::OutputSpec::Kind;
  for (double temperature : {0.0, 1.0}) {
    for (int variant = 0; variant < 2; ++variant) {
      SamplingParams p;
      p.temperature = temperature;
      if (variant == 0)
        p.allowed_token_ids = {Constrained::kA};
      else
        p.bad_words_token_ids = {{Constrained::kOpen}, {Constrained::kSpace}};
      Sampler s = Constrained::make(p, K::kJsonObject, "");
      std::vector<float> l(Constrained::kVocab, 0.0f);
      l[Constrained::kOpen] = 5;
      const int32_t t = s.sample(l, {}, {});
      const std::string field = variant == 0 ? "'allowed_token_ids'" : "'bad_words'";
      EXPECT_NE(s.failure().find(field + ", 'response_format'"), std::string::npos)
          << "temperature " << temperature << " drew " << t << "; failure: " << s.failure();
    }
  }
}

// min_tokens yields to a grammar whose answer is complete: the end ids come back with their own
// logits (the likelier end is chosen), never a token another mask excludes.
TEST(Sampler, ACompleteStructuredAnswerEndsBeforeMinTokensWithTheModelsLogits) {
  using K = structured::OutputSpec::Kind;
  SamplingParams p;
  p.temperature = 0;
  p.min_tokens = 4;
  p.stop_token_ids = {Constrained::kStop};
  Sampler s = Constrained::make(p, K::kRegex, "a");
  std::vector<float> l(Constrained::kVocab, 0.0f);
  l[Constrained::kStop] = 3;
  std::vector<int32_t> output = {s.sample(l, {}, {})};
  ASSERT_EQ(output[0], Constrained::kA);
  l.assign(Constrained::kVocab, 0.0f);
  l[Constrained::kStop] = 3;  // the stop id is likelier than EOS
  EXPECT_EQ(s.sample(l, {}, output), Constrained::kStop);
  EXPECT_TRUE(s.failure().empty()) << s.failure();
  // The same answer where allowed_token_ids excludes both ends: nothing is left.
  p.allowed_token_ids = {Constrained::kA, Constrained::kOpen};
  Sampler narrow = Constrained::make(p, K::kRegex, "a");
  l.assign(Constrained::kVocab, 0.0f);
  ASSERT_EQ(narrow.sample(l, {}, {}), Constrained::kA);
  l.assign(Constrained::kVocab, 0.0f);
  EXPECT_EQ(narrow.sample(l, {}, output), 0);
  EXPECT_NE(narrow.failure().find("'allowed_token_ids', 'min_tokens', 'response_format'"),
            std::string::npos)
      << narrow.failure();
}

// With a reasoning parser a structured output's grammar holds once the reasoning ended, as vLLM
// applies it after its reasoning parser's end token (</think>): the reasoning ("a", which cannot
// open a JSON object) and the end token (no text, which no grammar allows) are drawn unmasked and
// not fed to the grammar, which then holds from its start for what follows. In verify() (drafts)
// as in sample(). Without reasoning_end_token the grammar holds from the first token.
TEST(Sampler, AGrammarHoldsOnlyAfterTheReasoningEndToken) {
  using K = structured::OutputSpec::Kind;
  using C = Constrained;
  for (const bool drafts : {false, true}) {
    for (const double temperature : {0.0, 1.0}) {
      SCOPED_TRACE(std::string(drafts ? "verify" : "sample") + ", temperature " +
                   std::to_string(temperature));
      SamplingParams p;
      p.temperature = temperature;
      p.seed = 3;  // verify() couples a seeded draft: it answers what sample() draws
      p.reasoning_end_token = C::kThinkEnd;
      Sampler s = C::make(p, K::kJsonObject, "");
      std::vector<int32_t> output;
      const auto next = [&](std::vector<float> l, int32_t draft) {
        const int32_t t = drafts ? s.verify(l, {}, output, draft, {}) : s.sample(l, {}, output);
        output.push_back(t);
        return t;
      };
      EXPECT_EQ(next(C::favouring(C::kA, C::kOpen), C::kA), C::kA);
      EXPECT_EQ(next(C::favouring(C::kThinkEnd, C::kOpen), C::kThinkEnd), C::kThinkEnd);
      EXPECT_EQ(next(C::favouring(C::kA, C::kOpen), C::kA), C::kOpen);
      EXPECT_EQ(next(C::favouring(C::kA, C::kClose), C::kA), C::kClose);
      EXPECT_EQ(next(C::favouring(C::kA, C::kEos), C::kA), C::kEos);
      EXPECT_TRUE(s.failure().empty()) << s.failure();

      p.reasoning_end_token.reset();
      Sampler plain = C::make(p, K::kJsonObject, "");
      std::vector<float> l = C::favouring(C::kA, C::kOpen);
      EXPECT_EQ(drafts ? plain.verify(l, {}, {}, C::kA, {}) : plain.sample(l, {}, {}), C::kOpen);
    }
  }
}

// An unseeded request (what MTP verifies by default) checks a draft by rejection sampling, with
// the draft distribution q propose() handed over: across the reasoning end the target is masked
// only after it, so the reasoning's draft 'a' is accepted and the answer's 'a' is rejected for
// what the grammar allows.
TEST(Sampler, AnUnseededDraftIsVerifiedByRejectionWithTheGrammarOnlyAfterTheReasoningEnd) {
  using K = structured::OutputSpec::Kind;
  using C = Constrained;
  SamplingParams p;
  p.temperature = 1.0;
  p.reasoning_end_token = C::kThinkEnd;
  Sampler s = C::make(p, K::kJsonObject, "");
  std::vector<int32_t> output;
  const auto next = [&](int32_t drafted, std::vector<float> target) {
    std::vector<float> d = C::favouring(drafted), q;
    const int32_t draft = s.propose(d, {}, output, q);
    EXPECT_EQ(draft, drafted);
    EXPECT_EQ(q.size(), size_t(C::kVocab)) << "an unseeded draft hands over its distribution";
    const int32_t t = s.verify(target, {}, output, draft, q);
    output.push_back(t);
    return t;
  };
  EXPECT_EQ(next(C::kA, C::favouring(C::kA, C::kOpen)), C::kA);
  EXPECT_EQ(next(C::kThinkEnd, C::favouring(C::kThinkEnd, C::kOpen)), C::kThinkEnd);
  EXPECT_EQ(next(C::kA, C::favouring(C::kA, C::kOpen)), C::kOpen);
  EXPECT_EQ(next(C::kA, C::favouring(C::kA, C::kClose)), C::kClose);
  EXPECT_EQ(next(C::kA, C::favouring(C::kA, C::kEos)), C::kEos);
  EXPECT_TRUE(s.failure().empty()) << s.failure();
}

TEST(Sampler, InvalidParametersAreNamed) {
  auto error_of = [](SamplingParams p) {
    try {
      p.validate();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  SamplingParams p;
  p.top_p = 0;
  EXPECT_NE(error_of(p).find("top_p"), std::string::npos);
  p = {};
  p.temperature = -1;
  EXPECT_NE(error_of(p).find("temperature"), std::string::npos);
  p = {};
  p.max_tokens = 0;
  EXPECT_NE(error_of(p).find("max_tokens"), std::string::npos);
  p = {};
  p.stop = {""};
  EXPECT_NE(error_of(p).find("stop"), std::string::npos);
  // In-process requests (the engine's own check) are bounded as the API's are.
  p = {};
  p.stop_token_ids.assign(SamplingParams::kMaxStopTokenIds + 1, 3);
  EXPECT_NE(error_of(p).find("at most 1024 stop_token_ids"), std::string::npos) << error_of(p);
  p.stop_token_ids.pop_back();
  EXPECT_EQ(error_of(p), "");
  p = {};
  p.allowed_token_ids = {3, 2};
  EXPECT_NE(error_of(p).find("allowed_token_ids"), std::string::npos);
  p = {};
  p.bad_words_token_ids = {{}};
  EXPECT_NE(error_of(p).find("bad_words"), std::string::npos);
  p.bad_words_token_ids.assign(SamplingParams::kMaxBadWords + 1, {1});
  EXPECT_NE(error_of(p).find("bad_words"), std::string::npos);
  p.bad_words_token_ids.assign(2, std::vector<int32_t>(SamplingParams::kMaxBadWordsTotalTokens, 1));
  EXPECT_NE(error_of(p).find("bad_words"), std::string::npos);
}

// The end ids are sorted and each is kept once, so that a step looks a token up by binary search
// and masks a client's repeated ids once.
TEST(Sampler, EndTokenIdsAreSortedOnce) {
  SamplingParams p;
  p.stop_token_ids = {900, 5, 300, 5, 900, 2};
  const std::vector<int32_t> eos = {7, 2};
  EXPECT_EQ(end_token_ids(p, eos), (std::vector<int32_t>{2, 5, 7, 300, 900}));
  p.ignore_eos = true;
  EXPECT_EQ(end_token_ids(p, eos), (std::vector<int32_t>{2, 5, 300, 900}));
}

// Speculative sampling is lossless: a token proposed from a draft distribution and then verified
// (accepted or replaced) against the target logits is distributed as a plain draw from the target
// logits, with every filter and penalty. Two-sample chi-square over a small vocabulary, fixed
// seeds (deterministic); the bound is the 0.1% critical value for the bins' degrees of freedom.
double two_sample_chi_square(const std::vector<int64_t>& a, const std::vector<int64_t>& b,
                             int64_t& bins) {
  double chi = 0;
  bins = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] + b[i] == 0) continue;
    const double d = static_cast<double>(a[i] - b[i]);
    chi += d * d / static_cast<double>(a[i] + b[i]);
    ++bins;
  }
  return chi;
}

double chi_square_bound(int64_t degrees) {  // p = 0.001
  static const double kBound[] = {0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12};
  return kBound[std::clamp<int64_t>(degrees, 1, 8)];
}

struct SpeculativeCase {
  const char* name;
  SamplingParams params;
  std::vector<int32_t> prompt, output;
};

std::vector<SpeculativeCase> speculative_cases() {
  std::vector<SpeculativeCase> cases;
  SamplingParams p;
  p.temperature = 0.8;
  cases.push_back({"temperature", p, {}, {}});
  p.top_k = 4;
  cases.push_back({"top_k", p, {}, {}});
  p = {};
  p.top_p = 0.85;
  cases.push_back({"top_p", p, {}, {}});
  p = {};
  p.min_p = 0.08;
  p.temperature = 1.3;
  cases.push_back({"min_p", p, {}, {}});
  p = {};
  p.repetition_penalty = 1.7;
  p.frequency_penalty = 0.4;
  p.presence_penalty = 0.3;
  cases.push_back({"penalties", p, {1, 5}, {2, 2, 7}});
  return cases;
}

// Target and draft logits over 8 tokens: the draft agrees on some tokens, not on others.
const std::vector<float> kTarget = {1.0f, 2.5f, 0.2f, 2.0f, -1.0f, 1.7f, 0.5f, 2.2f};
const std::vector<float> kDraft = {2.0f, 1.0f, 0.2f, 3.0f, 0.5f, 1.7f, -2.0f, 0.1f};

// Draw i's sampler: unseeded requests get fallback seed `base + i` (rejection sampling);
// seeded ones seed `base + i` themselves (coupling).
Sampler sampler_for(SamplingParams params, bool seeded, uint64_t base, int64_t i) {
  if (seeded) params.seed = base + uint64_t(i);
  return Sampler(params, base + uint64_t(i));
}

std::vector<int64_t> plain_counts(const SpeculativeCase& c, int64_t draws) {
  std::vector<int64_t> counts(kTarget.size(), 0);
  for (int64_t i = 0; i < draws; ++i) {
    Sampler s = sampler_for(c.params, false, 1'000'000, i);
    auto l = kTarget;
    ++counts[size_t(s.sample(l, c.prompt, c.output))];
  }
  return counts;
}

// The keyed race itself against the softmax it must draw from (its pruning skips a logarithm
// only where a token cannot win): one-sample chi-square over 8 tokens at temperature 0.8.
TEST(SpeculativeSampling, PlainDrawsFollowTheTargetSoftmax) {
  const auto c = speculative_cases().front();  // temperature 0.8
  constexpr int64_t kDraws = 40000;
  const auto counts = plain_counts(c, kDraws);
  double z = 0;
  std::vector<double> p(kTarget.size());
  for (size_t i = 0; i < p.size(); ++i) z += p[i] = std::exp(kTarget[i] / 0.8);
  double chi = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double expected = kDraws * p[i] / z;
    chi += (counts[i] - expected) * (counts[i] - expected) / expected;
  }
  EXPECT_LT(chi, 24.32);  // p = 0.001 at 7 degrees of freedom
}

// Both ways of verifying: rejection sampling (unseeded) and coupling (seeded).
TEST(SpeculativeSampling, VerifiedDraftsAreDistributedAsPlainDraws) {
  constexpr int64_t kDraws = 40000;
  for (const bool seeded : {false, true}) {
    for (const auto& c : speculative_cases()) {
      std::vector<int64_t> counts(kTarget.size(), 0);
      int64_t accepted = 0;
      std::vector<float> q;
      for (int64_t i = 0; i < kDraws; ++i) {
        Sampler s = sampler_for(c.params, seeded, 23, i);
        auto d = kDraft;
        const int32_t draft = s.propose(d, c.prompt, c.output, q);
        EXPECT_EQ(q.empty(), seeded);  // coupling needs no draft distribution
        auto t = kTarget;
        const int32_t token = s.verify(t, c.prompt, c.output, draft, q);
        accepted += token == draft;
        ++counts[size_t(token)];
      }
      int64_t bins = 0;
      const double chi = two_sample_chi_square(plain_counts(c, kDraws), counts, bins);
      EXPECT_LT(chi, chi_square_bound(bins - 1)) << c.name << (seeded ? " seeded" : "");
      // The draft differs from the target: some drafts must have been rejected, most accepted.
      EXPECT_GT(accepted, kDraws / 4) << c.name << (seeded ? " seeded" : "");
      EXPECT_LT(accepted, kDraws) << c.name << (seeded ? " seeded" : "");
    }
  }
}

// Coupling: a seeded request's verified token is the one sample() draws at that position, so its
// answer does not depend on whether, or how many, drafts a step verified.
TEST(SpeculativeSampling, ASeededVerifyAnswersWhatSampleDrawsWhateverTheDraft) {
  for (const auto& c : speculative_cases()) {
    SamplingParams p = c.params;
    p.seed = 31;
    std::vector<int32_t> output = c.output;
    int64_t accepted = 0;
    for (int i = 0; i < 400; ++i) {
      Sampler plain(p, 0), speculating(p, 0);
      auto l = kTarget;
      const int32_t want = plain.sample(l, c.prompt, output);
      std::vector<float> q;
      auto d = kDraft;
      const int32_t draft = speculating.propose(d, c.prompt, output, q);
      auto t = kTarget;
      ASSERT_EQ(speculating.verify(t, c.prompt, output, draft, q), want) << c.name << " " << i;
      // Any other draft, too: the answer is the target's draw.
      auto t2 = kTarget;
      Sampler other(p, 0);
      ASSERT_EQ(other.verify(t2, c.prompt, output, (draft + 3) % 8, {}), want) << c.name;
      accepted += draft == want;
      output.push_back(want);
    }
    EXPECT_GT(accepted, 100) << c.name;
  }
}

TEST(SpeculativeSampling, TheChiSquareCheckRejectsDraftsTakenUnverified) {
  // The test above can fail: tokens drawn from the draft alone are told apart from the target's.
  const auto c = speculative_cases().front();
  constexpr int64_t kDraws = 40000;
  std::vector<int64_t> counts(kTarget.size(), 0);
  std::vector<float> q;
  for (int64_t i = 0; i < kDraws; ++i) {
    Sampler s = sampler_for(c.params, false, 23, i);
    auto d = kDraft;
    ++counts[size_t(s.propose(d, c.prompt, c.output, q))];
  }
  int64_t bins = 0;
  const double chi = two_sample_chi_square(plain_counts(c, kDraws), counts, bins);
  EXPECT_GT(chi, chi_square_bound(bins - 1));
}

TEST(SpeculativeSampling, GreedyAcceptsExactlyTheArgmax) {
  SamplingParams p;
  p.temperature = 0;
  Sampler s(p, 1);
  std::vector<float> q;
  auto d = kDraft;
  const int32_t draft = s.propose(d, {}, {}, q);
  EXPECT_EQ(draft, 3);
  EXPECT_TRUE(q.empty());
  auto t = kTarget;
  EXPECT_EQ(s.verify(t, {}, {}, draft, q), 1);  // rejected: the target's argmax replaces it
  t = kTarget;
  EXPECT_EQ(s.verify(t, {}, {}, 1, q), 1);  // accepted
}

// Drafts see the target's masks: a banned or disallowed draft is never accepted, greedy, seeded
// (coupled) or unseeded (rejection sampling, even when the draft distribution claims the
// banned id), and propose() never offers one.
TEST(SpeculativeSampling, DraftVerificationNeverAcceptsAMaskedToken) {
  const std::vector<int32_t> output = {0, 1};
  for (int variant = 0; variant < 2; ++variant) {
    for (int mode = 0; mode < 3; ++mode) {
      for (int i = 0; i < 300; ++i) {
        SamplingParams p;
        p.temperature = mode == 0 ? 0.0 : 1.0;
        if (mode == 1) p.seed = i;
        int32_t masked = 3;
        if (variant == 0)
          p.bad_words_token_ids = {{1, 3}};  // 3 completes a word after the output's 1
        else
          p.allowed_token_ids = {0, 1, 2};
        Sampler s(p, 100 + i);
        std::vector<float> q;
        auto d = kTarget;
        d[masked] += 5;  // the draft model would propose it
        ASSERT_NE(s.propose(d, {}, output, q), masked);
        // The draft given as the masked id, with a distribution that claims it.
        std::vector<float> claim(kTarget.size(), 0.0f);
        claim[masked] = 1.0f;
        auto t = kTarget;
        t[masked] += 5;  // and the target would take it too
        const int32_t answer = s.verify(t, {}, output, masked, claim);
        ASSERT_NE(answer, masked) << "variant " << variant << " mode " << mode << " i " << i;
        ASSERT_TRUE(s.failure().empty());
      }
    }
  }
}

TEST(SpeculativeSampling, AVerifyWithoutTheDraftDistributionIsAnError) {
  SamplingParams p;
  p.temperature = 1;
  Sampler s(p, 1);
  auto t = kTarget;
  EXPECT_THROW(s.verify(t, {}, {}, 2, {}), Error);
}

}  // namespace
}  // namespace tandem::engine
