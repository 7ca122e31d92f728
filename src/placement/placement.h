#pragma once
// Where the physical expert slots of every MoE layer live, in the shapes DeepSeek's EPLB uses
// (phy2log, log2phy, logcnt), and how balanced a placement is under given loads.
//
// Physical slots of a layer are numbered rank-major: rank 0's slots, then rank 1's, and so on.
// A rank's slot count may differ from layer to layer (uneven redundancy); summed over layers
// every rank holds the same number of slots (equal expert memory per rank).
#include <cstdint>
#include <string>
#include <vector>

#include "placement/expert_loads.h"

namespace tandem::placement {

struct Placement {
  int ranks = 0;
  int64_t experts = 0;
  // layers[l][r] = the logical experts in rank r's slots of layer l, in slot order.
  std::vector<std::vector<std::vector<int32_t>>> layers;

  int64_t num_layers() const { return int64_t(layers.size()); }
  int64_t slots(int64_t layer) const;
  std::vector<int32_t> phy2log(int64_t layer) const;
  std::vector<int32_t> logcnt(int64_t layer) const;
  // The most copies any expert has in any layer: EPLB's log2phy is one tensor
  // [layers, experts, max_copies()], whatever each layer's own most copies.
  int32_t max_copies() const;
  // [experts][width], -1 past an expert's last copy (EPLB pads the same way); `width` is at
  // least the layer's most copies of an expert (max_copies() gives EPLB's shape).
  std::vector<std::vector<int32_t>> log2phy(int64_t layer, int32_t width) const;
  std::vector<int32_t> rank_of_slot(int64_t layer) const;
  // Slots of every rank summed over layers.
  std::vector<int64_t> slots_per_rank() const;
};

struct Constraints {
  bool distinct_on_rank =
      true;  // no two copies of one expert on one rank (EPLB does not promise it)
  bool equal_rank_memory = true;
};

// Throws tandem::Error naming the layer, rank or expert at fault: an expert with no copy, an id
// out of range, two copies on one rank, ranks holding different slot totals.
void validate(const Placement& placement, const Constraints& constraints = {});

// What a placement file may hold and the engine serves: any slot counts per rank (uneven, or
// none on a drained rank), and two copies of an expert on one rank, as EPLB packs them (the
// engine holds such an expert's weights once).
inline constexpr Constraints kServable{.distinct_on_rank = false, .equal_rank_memory = false};

struct LayerBalance {
  double max_rank_load = 0;   // the busiest rank: what the layer's step waits for
  double mean_rank_load = 0;  // total load over ranks
  double ratio() const { return mean_rank_load > 0 ? max_rank_load / mean_rank_load : 1.0; }
};

struct Balance {
  std::vector<LayerBalance> layers;
  double mean_ratio = 1;  // mean over layers of max/mean rank load
  double worst_ratio = 1;
  int64_t worst_layer = 0;
  // Sum over layers of the busiest rank's load over the sum of mean rank loads (1.0 = perfect):
  // how much longer the MoE part of a step takes than with perfect balance.
  double step_proxy = 1;
};

// Loads of an expert split evenly over its copies (how tokens are spread over replicas).
std::vector<double> rank_loads(const double* expert_loads,
                               const std::vector<std::vector<int32_t>>& ranks, int64_t experts);
LayerBalance layer_balance(const double* expert_loads,
                           const std::vector<std::vector<int32_t>>& ranks, int64_t experts);
Balance evaluate(const ExpertLoads& loads, const Placement& placement);

// Experts that must be loaded onto a rank that did not hold them (slot order within a rank is
// free): what a rebalance costs in weight transfers. Each (rank, expert) pair new to the rank
// counts once: a rank holds one set of an expert's weights for all its slots of the expert.
int64_t count_moves(const Placement& from, const Placement& to);
int64_t count_layer_moves(const std::vector<std::vector<int32_t>>& from,
                          const std::vector<std::vector<int32_t>>& to);

}  // namespace tandem::placement
