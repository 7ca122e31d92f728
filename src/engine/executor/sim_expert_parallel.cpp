#include "engine/executor/sim_expert_parallel.h"

#include <algorithm>
#include <cmath>

#include "placement/eplb.h"
#include "util/error.h"

namespace tandem::engine {

namespace {

// The placement given, else every expert once, in order: checked here, before the members that
// follow it are made, so that a rank count the model's experts cannot fill is named by its flag.
placement::Placement placement_of(int64_t layers, int64_t experts,
                                  const SimExpertParallelOptions& o) {
  if (o.ranks < 1) throw Error("--sim-expert-parallel must be at least 1");
  if (o.placement) return *o.placement;
  try {
    return placement::no_redundancy(layers, experts, o.ranks);
  } catch (const Error& e) {
    throw Error("--sim-expert-parallel " + std::to_string(o.ranks) + ": " + e.what() +
                " (without --sim-placement every expert is placed once)");
  }
}

}  // namespace

SimExpertParallel::SimExpertParallel(int64_t layers, int64_t experts,
                                     const SimExpertParallelOptions& o)
    : placement_(placement_of(layers, experts, o)),
      skew_(layers, experts, o.skew),
      moe_share_(o.moe_share),
      ranks_(o.ranks),
      rng_(o.seed) {
  if (!(o.moe_share >= 0 && o.moe_share <= 1)) throw Error("--sim-moe-share must be in [0, 1]");
  if (placement_.ranks != o.ranks || placement_.experts != experts ||
      placement_.num_layers() != layers)
    throw Error("--sim-placement: the placement has " + std::to_string(placement_.num_layers()) +
                " layers of " + std::to_string(placement_.experts) + " experts on " +
                std::to_string(placement_.ranks) + " ranks; the simulated model has " +
                std::to_string(layers) + " MoE layers of " + std::to_string(experts) +
                " experts and --sim-expert-parallel is " + std::to_string(o.ranks));
  placement::validate(placement_, placement::kServable);
}

SimExpertParallel::Step SimExpertParallel::step(int64_t tokens) {
  Step s;
  if (tokens <= 0) return s;
  const int64_t group = tokens * ranks_;
  placement::ExpertLoads loads;
  if (group <= kSampleLimit) {
    loads = skew_.sample(group, rng_);
  } else {
    loads = skew_.expected(group);
    std::normal_distribution<double> noise(0.0, 1.0);
    for (double& v : loads.values) v = std::max(0.0, std::round(v + std::sqrt(v) * noise(rng_)));
  }
  s.imbalance = placement::evaluate(loads, placement_).step_proxy;
  s.factor = (1 - moe_share_) + moe_share_ * s.imbalance;
  s.routes.reserve(loads.values.size());
  for (double v : loads.values) s.routes.push_back(int64_t(std::llround(v)));
  return s;
}

}  // namespace tandem::engine
