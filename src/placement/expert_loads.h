#pragma once
// Tokens routed to each (MoE layer, logical expert): the input of every placement planner.
#include <cstdint>
#include <string>
#include <vector>

#include "util/npy.h"

namespace tandem::placement {

struct ExpertLoads {
  int64_t layers = 0;
  int64_t experts = 0;
  std::vector<double> values;  // [layers, experts], row-major

  double at(int64_t layer, int64_t expert) const { return values[layer * experts + expert]; }
  const double* row(int64_t layer) const { return values.data() + layer * experts; }
};

// Checks shape and values (finite, non-negative); throws tandem::Error naming `source`.
void validate(const ExpertLoads& loads, const std::string& source);

// A 2-D integer array [layers, experts]; throws naming `source` for any other shape or a
// negative count.
ExpertLoads loads_from_npy(const NpyArray& array, const std::string& source);

// The engine's /expert_load JSON (or a file written by --expert-load-dump): the array "kind"
// names ("window" or "cumulative"; the cumulative dump says "cumulative"), without "kind" the
// "window" counts when present, else "cumulative"; or a bare [[...], ...] array.
ExpertLoads loads_from_json(const std::string& text, const std::string& source);

}  // namespace tandem::placement
