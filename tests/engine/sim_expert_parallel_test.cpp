// The simulated executor's expert parallelism: a step's factor follows the busiest rank's routes
// under the placement, a placement planned for the skew beats experts in order, routes add up.
#include <gtest/gtest.h>

#include "engine/executor/sim_expert_parallel.h"
#include "placement/eplb.h"
#include "placement/planner.h"
#include "util/error.h"

namespace tandem::engine {
namespace {

SimExpertParallelOptions skewed(int ranks) {
  SimExpertParallelOptions o;
  o.ranks = ranks;
  o.skew.alpha_lo = 0.8;
  o.skew.alpha_hi = 1.4;
  o.skew.top_k = 4;
  o.skew.seed = 3;
  return o;
}

TEST(SimExpertParallel, StepFactorIsTheMoeShareScaledByTheImbalance) {
  SimExpertParallelOptions o = skewed(8);
  o.moe_share = 0.4;
  SimExpertParallel ep(4, 32, o);
  const auto s = ep.step(64);  // 512 tokens over the group: sampled
  EXPECT_GT(s.imbalance, 1.0);
  EXPECT_DOUBLE_EQ(s.factor, 0.6 + 0.4 * s.imbalance);
  ASSERT_EQ(s.routes.size(), 4u * 32u);
  for (int l = 0; l < 4; ++l) {
    int64_t sum = 0;
    for (int e = 0; e < 32; ++e) sum += s.routes[l * 32 + e];
    EXPECT_EQ(sum, 64 * 4 * 8) << "layer " << l;  // the group's: 8 ranks of 64 tokens
  }
  EXPECT_EQ(ep.step(0).factor, 1.0);
}

TEST(SimExpertParallel, APlacementForTheSkewShortensSteps) {
  const SimExpertParallelOptions o = skewed(8);
  // Plan from a large window of the same routing model.
  placement::RoutingSkew window_model(4, 32, o.skew);
  std::mt19937_64 rng(1);
  const placement::ExpertLoads window = window_model.sample(20000, rng);
  SimExpertParallelOptions planned = o;
  planned.placement = placement::plan(window, {.ranks = 8, .redundant_slots = 32}).placement;
  SimExpertParallelOptions eplb = o;
  eplb.placement = placement::eplb_rebalance(window, {.replicas = 40, .gpus = 8});
  SimExpertParallel none(4, 32, o), omni(4, 32, planned), by_eplb(4, 32, eplb);
  double f_none = 0, f_omni = 0, f_eplb = 0;
  for (int i = 0; i < 20; ++i) {
    f_none += none.step(2048).factor;  // expected routes with noise
    f_omni += omni.step(2048).factor;
    f_eplb += by_eplb.step(2048).factor;
  }
  EXPECT_LT(f_omni, f_none);
  EXPECT_LT(f_eplb, f_none);
  EXPECT_LT(f_omni / 20, 1.05);
}

TEST(SimExpertParallel, RejectsAPlacementOfAnotherShape) {
  SimExpertParallelOptions o = skewed(8);
  o.placement = placement::no_redundancy(3, 32, 8);
  EXPECT_THROW(SimExpertParallel(4, 32, o), Error);
  o.placement = placement::no_redundancy(4, 32, 4);
  EXPECT_THROW(SimExpertParallel(4, 32, o), Error);
  o.placement.reset();
  o.moe_share = 1.5;
  EXPECT_THROW(SimExpertParallel(4, 32, o), Error);
}

}  // namespace
}  // namespace tandem::engine
