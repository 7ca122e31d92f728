#pragma once
// Omni Placement's planner: hot experts get extra copies, layers that need them get more of the
// redundant-slot budget (layer-wise, uneven redundancy), copies are packed onto ranks so the
// busiest rank of each layer is as light as possible, and a rebalance while serving moves as few
// experts as it can. Pure functions of their inputs; deterministic.
#include <cstdint>
#include <vector>

#include "placement/expert_loads.h"
#include "placement/placement.h"

namespace tandem::placement {

// How the redundant-slot budget is spread over layers.
enum class Allocation {
  kLayerWise,    // where it lowers the sum over layers of the busiest rank's load most
  kEven,         // the same number in every layer, as far as the budget divides
  kWorstLayers,  // one slot per rank to each of the layers most imbalanced without redundancy
};

struct PlanOptions {
  int ranks = 1;
  int64_t redundant_slots = 0;  // over all layers; (layers * experts + this) % ranks == 0
  // Host of each rank (empty: one host). Copies of an expert go to different hosts first.
  std::vector<int> host_of_rank = {};
  Allocation allocation = Allocation::kLayerWise;
  // Polish each layer with pairwise swaps off the busiest rank (LPT alone otherwise).
  bool refine = true;
};

struct Plan {
  Placement placement;
  std::vector<int64_t> redundant_per_layer;
};

Plan plan(const ExpertLoads& loads, const PlanOptions& options);

// The redundant slots each layer gets under `options.allocation` (sums to the budget).
std::vector<int64_t> allocate_redundancy(const ExpertLoads& loads, const PlanOptions& options);

// One layer: copies per expert for `capacity` slots per rank (any counts, each at most the
// experts), packed onto ranks with distinct copies on every rank.
std::vector<std::vector<int32_t>> plan_layer(const double* loads, int64_t experts,
                                             const std::vector<int64_t>& capacity,
                                             const std::vector<int>& host_of_rank, bool refine);

struct IncrementalOptions {
  // A layer is re-planned only when a fresh plan lowers its busiest rank by more than this share.
  double min_gain = 0.02;
  // A repaired layer is accepted once its busiest rank is within this share of the fresh plan's.
  double tolerance = 0.01;
};

struct IncrementalPlan {
  Placement placement;
  int64_t moves = 0;           // experts loaded onto ranks that did not hold them (count_moves)
  int64_t layers_changed = 0;  // layers with at least one move
};

// `fresh` with its ranks relabeled (within equal slot counts and hosts) to keep as many of
// `current`'s copies where they are as it can: ranks are interchangeable to a plan, not to the
// weights already loaded.
Placement align_to_current(const Placement& current, Placement fresh,
                           const std::vector<int>& host_of_rank = {});

// Starts from `current` (same ranks and slots per rank and layer) and changes as few slots as it
// can to come within `tolerance` of a fresh plan of every layer worth changing. Any slot counts
// per rank are planned (drained ranks, uneven ones), never with two copies of an expert on one
// rank; a layer no such plan fits (a rank with more slots than experts) stays as it is.
IncrementalPlan plan_incremental(const ExpertLoads& loads, const Placement& current,
                                 const std::vector<int>& host_of_rank,
                                 const IncrementalOptions& options = {});

}  // namespace tandem::placement
