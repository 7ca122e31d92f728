#pragma once
// Expert parallelism's seam in the forward pass. With an exchange, a MoE layer routes its tokens
// as usual and then hands the routed-expert part to the exchange, which runs each chosen expert
// wherever its weights live (dispatch) and brings the weighted results back (combine); the
// shared experts stay local. The forward pass never learns how many ranks there are.
#include <cstdint>
#include <span>

#include "model/moe_routing.h"

namespace tandem::model {

class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  // MoE layer `layer` (the model's layer index) for this rank's n tokens: xn [n, hidden] the
  // normalised inputs, routes[t] the chosen logical experts and weights. Writes into out
  // [n, hidden] (zero on entry) each token's routed experts' weighted sum, added in ascending
  // logical expert order over 256-column chunks: the single-process sum's order, so an expert's
  // result that is bitwise the same gives a bitwise-same sum. Every rank calls it for every MoE
  // layer of every step, n = 0 included, since the exchange is collective.
  virtual void routed_experts(int64_t layer, const float* xn, int64_t n,
                              std::span<const Routing> routes, float* out) = 0;
};

// Columns per chunk of the routed sum, shared by the single-process sum and every exchange.
inline constexpr int64_t kRoutedSumColumns = 256;

}  // namespace tandem::model
