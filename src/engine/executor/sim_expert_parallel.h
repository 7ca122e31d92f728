#pragma once
// Expert parallelism in the simulated executor: the MoE part of a step waits for the busiest
// expert-parallel rank, so a step's modelled time grows with the imbalance of that step's routes
// under the placement in use. A simulated engine stands for one attention-data-parallel rank
// whose peers run similar batches, so a step's routes are those of `ranks` times its tokens (the
// whole group's). Routes come from a routing-skew model (placement/routing_skew.h): sampled
// token by token for small steps, expected counts plus Gaussian noise of the same variance
// (multinomial counts' normal approximation) for large ones.
//
//   time = t_balanced * ((1 - moe_share) + moe_share * imbalance)
//   imbalance = sum over MoE layers of the busiest rank's routes / sum of the mean rank's routes
//
// t_balanced is the latency model's step time (a balanced expert-parallel deployment);
// moe_share is the part of it the MoE layers take (dispatch, expert GEMMs, combine).
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "placement/placement.h"
#include "placement/routing_skew.h"

namespace tandem::engine {

struct SimExpertParallelOptions {
  int ranks = 0;                // expert-parallel ranks; 0: off
  double moe_share = 0.5;       // share of a balanced step that MoE layers take
  placement::SkewOptions skew;  // routing skew of every MoE layer
  // Where experts live; nullopt: every expert once, in order (no redundancy).
  std::optional<placement::Placement> placement;
  uint64_t seed = 0;
};

class SimExpertParallel {
 public:
  // `layers` x `experts` routed experts, `top_k` per token (the simulated model's MoE shape).
  // Throws tandem::Error when the placement does not match the shape or the ranks.
  SimExpertParallel(int64_t layers, int64_t experts, const SimExpertParallelOptions& options);

  struct Step {
    double factor = 1;            // multiplies the balanced step time
    double imbalance = 1;         // busiest rank over mean rank, summed over layers
    std::vector<int64_t> routes;  // [layers, experts]: the group's routes in this step
  };
  // The step of `tokens` new tokens of this rank (drafts included).
  Step step(int64_t tokens);

  const placement::Placement& placement() const { return placement_; }

 private:
  static constexpr int64_t kSampleLimit = 512;  // larger steps use expected routes
  placement::Placement placement_;
  placement::RoutingSkew skew_;
  double moe_share_;
  int ranks_;
  std::mt19937_64 rng_;
};

}  // namespace tandem::engine
