#include "model/moe_routing.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace tandem::model {
namespace {

// Indices of the k largest values, largest first; ties go to the lower index (torch.topk on CPU
// does the same for the sizes that occur here).
std::vector<int32_t> top_k(const std::vector<float>& v, int64_t k) {
  std::vector<int32_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t a, int32_t b) { return v[a] != v[b] ? v[a] > v[b] : a < b; });
  idx.resize(k);
  return idx;
}

}  // namespace

Routing route_token(const ModelConfig& c, const float* logits, const float* bias) {
  const int64_t n = c.n_routed_experts;
  std::vector<float> scores(logits, logits + n);
  if (c.scoring_func == "sigmoid") {
    for (auto& s : scores) s = 1.0f / (1.0f + std::exp(-s));
  } else {
    float m = *std::max_element(scores.begin(), scores.end());
    double sum = 0;
    for (auto& s : scores) sum += (s = std::exp(s - m));
    for (auto& s : scores) s = static_cast<float>(s / sum);
  }
  std::vector<float> choice = scores;
  if (bias && c.uses_correction_bias())
    for (int64_t e = 0; e < n; ++e) choice[e] += bias[e];

  const bool softmax = c.scoring_func != "sigmoid";
  auto gap = [softmax](float chosen, float rejected) {
    if (!softmax) return chosen - rejected;
    return rejected > 0 ? std::log(chosen / rejected) : std::numeric_limits<float>::infinity();
  };
  float group_margin = std::numeric_limits<float>::infinity();
  if (c.n_group > 1 && c.topk_method != "greedy") {
    const int64_t per_group = n / c.n_group;
    std::vector<float> group_score(c.n_group);
    for (int64_t g = 0; g < c.n_group; ++g) {
      std::vector<float> members(choice.begin() + g * per_group,
                                 choice.begin() + (g + 1) * per_group);
      if (c.topk_method == "noaux_tc") {  // sum of the two best scores of the group
        auto best = top_k(members, std::min<int64_t>(2, per_group));
        group_score[g] = 0;
        for (auto i : best) group_score[g] += members[i];
      } else {  // group_limited_greedy: the best score of the group
        group_score[g] = *std::max_element(members.begin(), members.end());
      }
    }
    auto keep = top_k(group_score, c.topk_group + (c.topk_group < c.n_group ? 1 : 0));
    if (static_cast<int64_t>(keep.size()) > c.topk_group) {
      group_margin = gap(group_score[keep[c.topk_group - 1]], group_score[keep[c.topk_group]]);
      keep.pop_back();
    }
    std::vector<bool> kept(c.n_group, false);
    for (auto g : keep) kept[g] = true;
    for (int64_t e = 0; e < n; ++e)
      if (!kept[e / per_group]) choice[e] = -std::numeric_limits<float>::infinity();
  }

  Routing r;
  const int64_t k = c.num_experts_per_tok;
  r.experts = top_k(choice, std::min<int64_t>(k + 1, n));
  r.margin = group_margin;
  if (static_cast<int64_t>(r.experts.size()) > k) {
    r.margin = std::min(r.margin, gap(choice[r.experts[k - 1]], choice[r.experts[k]]));
    r.experts.pop_back();
  }
  for (auto e : r.experts) r.weights.push_back(scores[e]);
  if (c.num_experts_per_tok > 1 && c.norm_topk_prob) {
    double sum = 1e-20;
    for (float w : r.weights) sum += w;
    for (auto& w : r.weights) w = static_cast<float>(w / sum);
  }
  for (auto& w : r.weights) w = static_cast<float>(w * c.routed_scaling_factor);
  return r;
}

}  // namespace tandem::model
