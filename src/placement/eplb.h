#pragma once
// Baseline planners: DeepSeek's EPLB (reimplemented from its published description and README
// example, github.com/deepseek-ai/EPLB) and no redundancy at all.
#include <cstdint>

#include "placement/expert_loads.h"
#include "placement/placement.h"

namespace tandem::placement {

struct EplbOptions {
  int64_t replicas = 0;  // physical slots per layer, a multiple of gpus
  int64_t groups = 1;    // expert groups (DeepSeek-V3's group-limited routing has 8)
  int64_t nodes = 1;     // hosts; gpus are split evenly over them
  int64_t gpus = 1;      // ranks
};

// EPLB's rebalance_experts: hierarchical (pack expert groups to nodes, replicate within nodes,
// pack replicas to GPUs) when nodes divide groups, else global (one group, one node). Loads are
// rounded to float32 as in the reference; ties go to the lower index (the reference's unstable
// sort may order experts of equal load otherwise: the ranks then carry the same loads).
// EPLB may put two copies of one expert on one GPU; validate such plans with
// Constraints{.distinct_on_rank = false}.
Placement eplb_rebalance(const ExpertLoads& loads, const EplbOptions& options);

// Every expert once, in order: rank r holds experts [r*E/R, (r+1)*E/R).
Placement no_redundancy(int64_t layers, int64_t experts, int ranks);

}  // namespace tandem::placement
