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
};

// `logits` has n_routed_experts entries; `bias` is null or has as many.
Routing route_token(const ModelConfig& config, const float* logits, const float* bias);

}  // namespace tandem::model
