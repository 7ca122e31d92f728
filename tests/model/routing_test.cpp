// Properties of DeepSeekMoE expert selection (route_token). The end-to-end numerics test checks
// routing against the PyTorch reference; these pin the rules one at a time.
#include "model/moe_routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include <gtest/gtest.h>

namespace tandem::model {
namespace {

ModelConfig v3_like() {
  ModelConfig c;
  c.n_routed_experts = 16;
  c.num_experts_per_tok = 4;
  c.n_group = 4;
  c.topk_group = 2;
  c.scoring_func = "sigmoid";
  c.topk_method = "noaux_tc";
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 2.5;
  return c;
}

std::vector<float> random_logits(std::mt19937& rng, int n) {
  std::normal_distribution<float> d(0, 2);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TEST(Routing, NormalisedWeightsSumToScalingFactor) {
  std::mt19937 rng(1);
  auto c = v3_like();
  for (int i = 0; i < 100; ++i) {
    auto logits = random_logits(rng, 16);
    auto r = route_token(c, logits.data(), nullptr);
    ASSERT_EQ(r.experts.size(), 4u);
    EXPECT_NEAR(std::accumulate(r.weights.begin(), r.weights.end(), 0.0), 2.5, 1e-5);
  }
}

TEST(Routing, ExpertsComeFromTheBestGroupsOnly) {
  std::mt19937 rng(2);
  auto c = v3_like();
  for (int i = 0; i < 100; ++i) {
    auto logits = random_logits(rng, 16);
    auto r = route_token(c, logits.data(), nullptr);
    std::set<int> groups;
    for (auto e : r.experts) groups.insert(e / 4);
    EXPECT_LE(groups.size(), 2u);
  }
}

TEST(Routing, SingleGroupIsPlainTopK) {
  std::mt19937 rng(3);
  auto c = v3_like();
  c.n_group = 1;
  c.topk_group = 1;
  for (int i = 0; i < 50; ++i) {
    auto logits = random_logits(rng, 16);
    auto r = route_token(c, logits.data(), nullptr);
    std::vector<int> order(16);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    std::vector<int32_t> expected(order.begin(), order.begin() + 4);
    EXPECT_EQ(r.experts, expected);
  }
}

TEST(Routing, CorrectionBiasChoosesButDoesNotWeigh) {
  auto c = v3_like();
  c.n_group = 1;
  c.topk_group = 1;
  c.num_experts_per_tok = 1;
  c.norm_topk_prob = false;
  c.routed_scaling_factor = 1.0;
  std::vector<float> logits(16, 0.0f), bias(16, 0.0f);
  logits[3] = 1.0f;
  bias[7] = 5.0f;  // expert 7 wins the choice through its bias alone
  auto r = route_token(c, logits.data(), bias.data());
  ASSERT_EQ(r.experts, std::vector<int32_t>{7});
  EXPECT_NEAR(r.weights[0], 0.5, 1e-6);  // sigmoid(0): the unbiased score
}

TEST(Routing, SoftmaxGreedyWithoutNormalisation) {
  ModelConfig c;
  c.n_routed_experts = 8;
  c.num_experts_per_tok = 2;
  c.scoring_func = "softmax";
  c.topk_method = "greedy";
  c.routed_scaling_factor = 1.0;
  std::vector<float> logits = {0, 1, 2, 3, 0, 0, 0, 0};
  auto r = route_token(c, logits.data(), nullptr);
  ASSERT_EQ(r.experts, (std::vector<int32_t>{3, 2}));
  double z = 5 + std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  EXPECT_NEAR(r.weights[0], std::exp(3.0) / z, 1e-6);
  EXPECT_NEAR(r.weights[1], std::exp(2.0) / z, 1e-6);
}

}  // namespace
}  // namespace tandem::model
