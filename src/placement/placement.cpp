#include "placement/placement.h"

#include <algorithm>

#include "util/error.h"

namespace tandem::placement {

int64_t Placement::slots(int64_t layer) const {
  int64_t n = 0;
  for (const auto& r : layers[layer]) n += int64_t(r.size());
  return n;
}

std::vector<int32_t> Placement::phy2log(int64_t layer) const {
  std::vector<int32_t> out;
  for (const auto& r : layers[layer]) out.insert(out.end(), r.begin(), r.end());
  return out;
}

std::vector<int32_t> Placement::logcnt(int64_t layer) const {
  std::vector<int32_t> count(experts, 0);
  for (const auto& r : layers[layer])
    for (int32_t e : r) ++count[e];
  return count;
}

int32_t Placement::max_copies() const {
  int32_t most = 0;
  for (int64_t l = 0; l < num_layers(); ++l)
    for (int32_t c : logcnt(l)) most = std::max(most, c);
  return most;
}

std::vector<std::vector<int32_t>> Placement::log2phy(int64_t layer, int32_t width) const {
  const std::vector<int32_t> count = logcnt(layer);
  const int32_t most = count.empty() ? 0 : *std::max_element(count.begin(), count.end());
  if (width < most)
    throw Error("placement layer " + std::to_string(layer) + ": log2phy of width " +
                std::to_string(width) + " cannot hold an expert's " + std::to_string(most) +
                " copies");
  std::vector<std::vector<int32_t>> out(experts, std::vector<int32_t>(width, -1));
  std::vector<int32_t> filled(experts, 0);
  int32_t slot = 0;
  for (const auto& r : layers[layer])
    for (int32_t e : r) out[e][filled[e]++] = slot++;
  return out;
}

std::vector<int32_t> Placement::rank_of_slot(int64_t layer) const {
  std::vector<int32_t> out;
  for (size_t r = 0; r < layers[layer].size(); ++r)
    out.insert(out.end(), layers[layer][r].size(), int32_t(r));
  return out;
}

std::vector<int64_t> Placement::slots_per_rank() const {
  std::vector<int64_t> out(ranks, 0);
  for (const auto& layer : layers)
    for (size_t r = 0; r < layer.size() && r < out.size(); ++r) out[r] += int64_t(layer[r].size());
  return out;
}

void validate(const Placement& p, const Constraints& constraints) {
  if (p.ranks <= 0) throw Error("placement: ranks must be positive");
  if (p.experts <= 0) throw Error("placement: experts must be positive");
  for (size_t l = 0; l < p.layers.size(); ++l) {
    const auto& layer = p.layers[l];
    const std::string where = "placement layer " + std::to_string(l);
    if (int64_t(layer.size()) != p.ranks)
      throw Error(where + " has " + std::to_string(layer.size()) + " ranks, want " +
                  std::to_string(p.ranks));
    std::vector<int32_t> count(p.experts, 0);
    // The last rank each expert was seen on: ranks are walked in order, so a second copy on one
    // rank finds its own rank here (a search per copy made large layers quadratic).
    std::vector<int64_t> last_rank(p.experts, -1);
    for (size_t r = 0; r < layer.size(); ++r) {
      for (int32_t e : layer[r]) {
        if (e < 0 || e >= p.experts)
          throw Error(where + ", rank " + std::to_string(r) + ": expert id " + std::to_string(e) +
                      " is outside [0, " + std::to_string(p.experts) + ")");
        if (constraints.distinct_on_rank && last_rank[e] == int64_t(r))
          throw Error(where + ", rank " + std::to_string(r) + " holds two copies of expert " +
                      std::to_string(e));
        last_rank[e] = int64_t(r);
        ++count[e];
      }
    }
    for (int64_t e = 0; e < p.experts; ++e)
      if (count[e] == 0)
        throw Error(where + ": expert " + std::to_string(e) + " has no copy on any rank");
  }
  if (constraints.equal_rank_memory && !p.layers.empty()) {
    const std::vector<int64_t> per_rank = p.slots_per_rank();
    for (int r = 1; r < p.ranks; ++r)
      if (per_rank[r] != per_rank[0])
        throw Error("placement: rank " + std::to_string(r) + " holds " +
                    std::to_string(per_rank[r]) + " expert slots over all layers, rank 0 holds " +
                    std::to_string(per_rank[0]) + " (every rank needs the same expert memory)");
  }
}

std::vector<double> rank_loads(const double* expert_loads,
                               const std::vector<std::vector<int32_t>>& ranks, int64_t experts) {
  std::vector<int32_t> count(experts, 0);
  for (const auto& r : ranks)
    for (int32_t e : r) ++count[e];
  std::vector<double> out(ranks.size(), 0.0);
  for (size_t r = 0; r < ranks.size(); ++r)
    for (int32_t e : ranks[r]) out[r] += expert_loads[e] / count[e];
  return out;
}

LayerBalance layer_balance(const double* expert_loads,
                           const std::vector<std::vector<int32_t>>& ranks, int64_t experts) {
  const std::vector<double> loads = rank_loads(expert_loads, ranks, experts);
  LayerBalance b;
  double total = 0;
  for (int64_t e = 0; e < experts; ++e) total += expert_loads[e];
  b.max_rank_load = loads.empty() ? 0 : *std::max_element(loads.begin(), loads.end());
  b.mean_rank_load = ranks.empty() ? 0 : total / double(ranks.size());
  return b;
}

Balance evaluate(const ExpertLoads& loads, const Placement& p) {
  if (loads.layers != p.num_layers() || loads.experts != p.experts)
    throw Error("expert loads are [" + std::to_string(loads.layers) + ", " +
                std::to_string(loads.experts) + "] but the placement covers " +
                std::to_string(p.num_layers()) + " layers of " + std::to_string(p.experts) +
                " experts");
  Balance b;
  double sum_max = 0, sum_mean = 0, sum_ratio = 0;
  b.worst_ratio = 0;
  for (int64_t l = 0; l < loads.layers; ++l) {
    b.layers.push_back(layer_balance(loads.row(l), p.layers[l], p.experts));
    const LayerBalance& lb = b.layers.back();
    sum_max += lb.max_rank_load;
    sum_mean += lb.mean_rank_load;
    sum_ratio += lb.ratio();
    if (lb.ratio() > b.worst_ratio) {
      b.worst_ratio = lb.ratio();
      b.worst_layer = l;
    }
  }
  b.mean_ratio = loads.layers ? sum_ratio / double(loads.layers) : 1.0;
  b.step_proxy = sum_mean > 0 ? sum_max / sum_mean : 1.0;
  return b;
}

int64_t count_layer_moves(const std::vector<std::vector<int32_t>>& from,
                          const std::vector<std::vector<int32_t>>& to) {
  // A rank holds one set of an expert's weights however many of its slots name the expert
  // (EpRank::prepare_placement loads it once, switch_placement shares it), so a move is a
  // (rank, expert) pair the rank did not hold. held[e] is the last rank (+1) known to hold e:
  // marked from `from`'s copies, then by each copy of `to` counted, with no clearing per rank
  // (linear in the slots; a search per copy made large layers quadratic).
  int32_t ids = 0;
  for (const auto* side : {&from, &to})
    for (const auto& r : *side)
      for (int32_t e : r) {
        if (e < 0) throw Error("placement: expert id " + std::to_string(e) + " is negative");
        ids = std::max(ids, e + 1);
      }
  std::vector<int64_t> held(size_t(ids), 0);
  int64_t moves = 0;
  for (size_t r = 0; r < to.size(); ++r) {
    const int64_t mark = int64_t(r) + 1;
    if (r < from.size())
      for (int32_t e : from[r]) held[e] = mark;
    for (int32_t e : to[r])
      if (held[e] != mark) {
        held[e] = mark;
        ++moves;
      }
  }
  return moves;
}

int64_t count_moves(const Placement& from, const Placement& to) {
  int64_t moves = 0;
  for (int64_t l = 0; l < to.num_layers(); ++l)
    moves += count_layer_moves(
        l < from.num_layers() ? from.layers[l] : std::vector<std::vector<int32_t>>{}, to.layers[l]);
  return moves;
}

}  // namespace tandem::placement
