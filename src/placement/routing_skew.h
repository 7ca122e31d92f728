#pragma once
// A model of skewed expert routing: each MoE layer has a Zipf popularity (exponent alpha) over a
// random order of its experts, and every token picks top_k experts by it. Layers differ
// in alpha (spread over [alpha_lo, alpha_hi] in random layer order), and the hot set can drift.
// The synthetic loads of the placement benchmark and the simulated executor's MoE step times
// both come from here. Deterministic for a seed.
#include <cstdint>
#include <random>
#include <vector>

#include "placement/expert_loads.h"

namespace tandem::placement {

struct SkewOptions {
  double alpha_lo = 1.0, alpha_hi = 1.0;
  int64_t top_k = 8;
  // A token's top_k experts are distinct, as routing picks them (an expert then gets at most
  // one route per token). False: every route is drawn on its own, so the loads follow the Zipf
  // law itself however hot the head is (the harder case for a planner).
  bool distinct = true;
  uint64_t seed = 1;
};

class RoutingSkew {
 public:
  RoutingSkew(int64_t layers, int64_t experts, const SkewOptions& options);

  int64_t layers() const { return layers_; }
  int64_t experts() const { return experts_; }
  double alpha(int64_t layer) const { return alpha_[layer]; }

  // Routes of `tokens` tokens, each to top_k distinct experts per layer.
  ExpertLoads sample(int64_t tokens, std::mt19937_64& rng) const;
  // The expected routes of `tokens` tokens (probability of each expert being among a token's
  // top_k, estimated once per layer), for steps too large to sample cheaply.
  ExpertLoads expected(int64_t tokens) const;
  // `share` of the `hot` most popular experts of every layer trade places with random colder ones.
  void drift(double share, int64_t hot, std::mt19937_64& rng);

 private:
  void build_cdf(int64_t layer);
  static constexpr int kMaxRedraws = 32;
  int64_t pick_untaken(int64_t layer, const std::vector<int64_t>& picked, double u) const;
  void estimate_expected();
  int64_t layers_, experts_, top_k_;
  bool distinct_;
  std::vector<double> alpha_;
  std::vector<std::vector<int32_t>> order_;  // [layer][popularity rank] = expert
  std::vector<std::vector<double>> cdf_;     // [layer][popularity rank]
  std::vector<std::vector<double>> share_;   // [layer][expert]: expected routes per token
};

}  // namespace tandem::placement
