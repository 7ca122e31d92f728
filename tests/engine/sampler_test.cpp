// Sampling rules as properties: greedy picks the argmax, filters leave only the tokens they
// should, penalties move the logits they should, and a seed makes draws reproducible.
#include "engine/sampler.h"

#include <cmath>
#include <map>
#include <random>

#include <gtest/gtest.h>

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
    Sampler s(p, 42);
    for (int i = 0; i < 50; ++i) {
      auto l = logits_of({0.5f, 0.2f, 0.7f, 0.69f});
      ASSERT_EQ(s.sample(l, {}, {}), 2) << variant;
    }
  }
}

TEST(Sampler, TopKNeverLeavesTheKBest) {
  SamplingParams p;
  p.top_k = 2;
  Sampler s(p, 7);
  for (int i = 0; i < 500; ++i) {
    auto l = logits_of({1.0f, 0.9f, 3.0f, 2.8f, 0.0f});
    int t = s.sample(l, {}, {});
    ASSERT_TRUE(t == 2 || t == 3);
  }
}

TEST(Sampler, DrawsFollowTheSoftmax) {
  SamplingParams p;
  p.seed = 123;
  Sampler s(p, 0);
  std::map<int, int> counts;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    auto l = logits_of({0.0f, std::log(3.0f)});  // probabilities 1/4 and 3/4
    ++counts[s.sample(l, {}, {})];
  }
  EXPECT_NEAR(counts[1] / double(n), 0.75, 0.02);
}

TEST(Sampler, SeedMakesDrawsReproducible) {
  SamplingParams p;
  p.seed = 99;
  Sampler a(p, 1), b(p, 2);  // the request seed wins over the fallback
  for (int i = 0; i < 100; ++i) {
    auto la = logits_of({0.1f, 0.2f, 0.3f, 0.4f, 0.5f});
    auto lb = la;
    ASSERT_EQ(a.sample(la, {}, {}), b.sample(lb, {}, {}));
  }
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
}

}  // namespace
}  // namespace tandem::engine
