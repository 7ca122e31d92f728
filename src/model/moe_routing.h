#pragma once
// DeepSeekMoE expert selection for one token: scores from the router logits (softmax or
// sigmoid), optional correction bias used only to choose, group-limited top-k, weights from the
// unbiased scores, optional normalisation, routed scaling.
#include <cstdint>
#include <vector>

#include "model/config.h"

namespace tandem::model {

struct Routing {
  std::vector<int32_t> experts;  // logical expert ids, in selection order
  std::vector<float> weights;
  // How far the choice was from going another way: the smallest gap between the last chosen and
  // the first rejected selection score (and group score, with groups). Sigmoid scores are
  // compared as they are; softmax scores as log-ratios, i.e. in router-logit units, since
  // probabilities of many experts are all small. Perturbations below this cannot change the
  // chosen experts.
  float margin = 0;
};

// `logits` has n_routed_experts entries; `bias` is null or has as many.
Routing route_token(const ModelConfig& config, const float* logits, const float* bias);

}  // namespace tandem::model
