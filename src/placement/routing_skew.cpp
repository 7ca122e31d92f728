#include "placement/routing_skew.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "util/error.h"

namespace tandem::placement {

RoutingSkew::RoutingSkew(int64_t layers, int64_t experts, const SkewOptions& o)
    : layers_(layers), experts_(experts), top_k_(o.top_k), distinct_(o.distinct) {
  if (layers < 1 || experts < 1) throw Error("routing skew: need at least one layer and expert");
  if (o.top_k < 1 || o.top_k > experts)
    throw Error("routing skew: top_k " + std::to_string(o.top_k) + " must be in [1, " +
                std::to_string(experts) + "]");
  if (!(o.alpha_lo >= 0) || !(o.alpha_hi >= o.alpha_lo))
    throw Error("routing skew: want 0 <= alpha_lo <= alpha_hi");
  std::mt19937_64 rng(o.seed);
  for (int64_t l = 0; l < layers; ++l)
    alpha_.push_back(layers == 1
                         ? o.alpha_lo
                         : o.alpha_lo + (o.alpha_hi - o.alpha_lo) * double(l) / double(layers - 1));
  std::shuffle(alpha_.begin(), alpha_.end(), rng);
  order_.resize(layers);
  cdf_.resize(layers);
  for (int64_t l = 0; l < layers; ++l) {
    order_[l].resize(experts);
    std::iota(order_[l].begin(), order_[l].end(), 0);
    std::shuffle(order_[l].begin(), order_[l].end(), rng);
    build_cdf(l);
  }
  estimate_expected();
}

void RoutingSkew::build_cdf(int64_t l) {
  cdf_[l].resize(experts_);
  double sum = 0;
  for (int64_t i = 0; i < experts_; ++i) cdf_[l][i] = sum += std::pow(double(i + 1), -alpha_[l]);
  for (double& c : cdf_[l]) c /= sum;
}

ExpertLoads RoutingSkew::sample(int64_t tokens, std::mt19937_64& rng) const {
  ExpertLoads out{layers_, experts_, std::vector<double>(layers_ * experts_, 0.0)};
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int64_t> picked;
  for (int64_t l = 0; l < layers_; ++l) {
    const std::vector<double>& cdf = cdf_[l];
    for (int64_t t = 0; t < tokens; ++t) {
      picked.clear();
      // Without replacement: draw again on a repeat (the hot experts repeat often, but a
      // token's top_k is small next to the experts); after kMaxRedraws repeats in a row the
      // next pick walks the probabilities left over (steep skews leave the tail nearly zero).
      int redraws = 0;
      while (int64_t(picked.size()) < top_k_) {
        int64_t r = std::min<int64_t>(
            experts_ - 1, std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin());
        const auto taken = [&](int64_t x) {
          return std::find(picked.begin(), picked.end(), x) != picked.end();
        };
        if (distinct_ && taken(r)) {
          if (++redraws < kMaxRedraws) continue;
          r = pick_untaken(l, picked, u(rng));
        }
        picked.push_back(r);
        redraws = 0;
      }
      for (int64_t r : picked) out.values[l * experts_ + order_[l][r]] += 1.0;
    }
  }
  return out;
}

int64_t RoutingSkew::pick_untaken(int64_t l, const std::vector<int64_t>& picked, double u) const {
  const std::vector<double>& cdf = cdf_[l];
  const auto p = [&](int64_t r) { return cdf[r] - (r ? cdf[r - 1] : 0.0); };
  double left = 0;
  int64_t last = -1;
  for (int64_t r = 0; r < experts_; ++r)
    if (std::find(picked.begin(), picked.end(), r) == picked.end()) left += p(r), last = r;
  double at = u * left;
  for (int64_t r = 0; r < experts_; ++r) {
    if (std::find(picked.begin(), picked.end(), r) != picked.end()) continue;
    at -= p(r);
    if (at < 0) return r;
  }
  return last;  // rounding left `at` a hair above zero: the last untaken one
}

void RoutingSkew::estimate_expected() {
  // Sampled once with a fixed seed: the inclusion probabilities of sampling without
  // replacement have no closed form.
  std::mt19937_64 rng(12345);
  const int64_t tokens = 4096;
  const ExpertLoads s = sample(tokens, rng);
  share_.assign(layers_, std::vector<double>(experts_));
  for (int64_t l = 0; l < layers_; ++l)
    for (int64_t e = 0; e < experts_; ++e) share_[l][e] = s.at(l, e) / double(tokens);
}

ExpertLoads RoutingSkew::expected(int64_t tokens) const {
  ExpertLoads out{layers_, experts_, std::vector<double>(layers_ * experts_)};
  for (int64_t l = 0; l < layers_; ++l)
    for (int64_t e = 0; e < experts_; ++e)
      out.values[l * experts_ + e] = share_[l][e] * double(tokens);
  return out;
}

void RoutingSkew::drift(double share, int64_t hot, std::mt19937_64& rng) {
  hot = std::min(hot, experts_ / 2);
  const int64_t moving = int64_t(std::lround(share * double(hot)));
  for (int64_t l = 0; l < layers_; ++l) {
    std::vector<int64_t> hot_ranks(hot);
    std::iota(hot_ranks.begin(), hot_ranks.end(), 0);
    std::shuffle(hot_ranks.begin(), hot_ranks.end(), rng);
    std::uniform_int_distribution<int64_t> cold(hot, experts_ - 1);
    for (int64_t i = 0; i < moving; ++i) std::swap(order_[l][hot_ranks[i]], order_[l][cold(rng)]);
  }
  estimate_expected();
}

}  // namespace tandem::placement
