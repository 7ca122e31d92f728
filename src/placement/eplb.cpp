#include "placement/eplb.h"

#include <algorithm>
#include <numeric>

#include "util/error.h"

namespace tandem::placement {
namespace {

struct Packing {
  std::vector<int64_t> pack, rank_in_pack;
};

// Items heaviest first, each to the lightest pack that still has room (n/m items per pack).
Packing pack_evenly(const std::vector<float>& weight, int64_t packs) {
  const int64_t n = int64_t(weight.size()), per_pack = n / packs;
  Packing out{std::vector<int64_t>(n), std::vector<int64_t>(n, 0)};
  if (per_pack == 1) {
    std::iota(out.pack.begin(), out.pack.end(), 0);
    return out;
  }
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return weight[a] > weight[b]; });
  std::vector<float> pack_weight(packs, 0.0f);
  std::vector<int64_t> pack_items(packs, 0);
  for (int64_t item : order) {
    int64_t best = -1;
    for (int64_t p = 0; p < packs; ++p)
      if (pack_items[p] < per_pack && (best < 0 || pack_weight[p] < pack_weight[best])) best = p;
    out.pack[item] = best;
    out.rank_in_pack[item] = pack_items[best]++;
    pack_weight[best] += weight[item];
  }
  return out;
}

struct Replication {
  std::vector<int64_t> phy2log, rank, logcnt;
};

// Each extra replica goes to the expert with the highest load per replica.
Replication add_replicas(const std::vector<float>& weight, int64_t num_phy) {
  const int64_t num_log = int64_t(weight.size());
  Replication out;
  out.phy2log.resize(num_phy);
  std::iota(out.phy2log.begin(), out.phy2log.begin() + num_log, 0);
  out.rank.assign(num_phy, 0);
  out.logcnt.assign(num_log, 1);
  for (int64_t i = num_log; i < num_phy; ++i) {
    int64_t best = 0;
    float best_value = weight[0] / float(out.logcnt[0]);
    for (int64_t e = 1; e < num_log; ++e) {
      const float v = weight[e] / float(out.logcnt[e]);
      if (v > best_value) best = e, best_value = v;
    }
    out.phy2log[i] = best;
    out.rank[i] = out.logcnt[best]++;
  }
  return out;
}

// position -> item for a permutation given as item -> position.
std::vector<int64_t> items_by_position(const std::vector<int64_t>& position_of) {
  std::vector<int64_t> item(position_of.size());
  for (size_t i = 0; i < position_of.size(); ++i) item[size_t(position_of[i])] = int64_t(i);
  return item;
}

// One layer of the hierarchical policy; returns the expert in each of gpus * slots_per_gpu slots.
std::vector<int64_t> rebalance_layer(const std::vector<float>& weight, const EplbOptions& o) {
  const int64_t experts = int64_t(weight.size()), group_size = experts / o.groups;
  const int64_t groups_per_node = o.groups / o.nodes, per_node = experts / o.nodes;
  const int64_t slots_per_node = o.replicas / o.nodes, gpus_per_node = o.gpus / o.nodes;
  const int64_t slots_per_gpu = o.replicas / o.gpus;

  // Whole expert groups go to nodes, balancing the nodes' loads; experts are then numbered
  // node by node (node_order[e]: expert e's place in that order).
  std::vector<float> group_load(o.groups, 0.0f);
  for (int64_t e = 0; e < experts; ++e) group_load[e / group_size] += weight[e];
  const Packing groups = pack_evenly(group_load, o.nodes);
  std::vector<int64_t> node_order(experts);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t g = e / group_size;
    node_order[e] =
        (groups.pack[g] * groups_per_node + groups.rank_in_pack[g]) * group_size + e % group_size;
  }
  const std::vector<int64_t> expert_at = items_by_position(node_order);

  std::vector<int64_t> slot_expert(o.replicas);
  for (int64_t node = 0; node < o.nodes; ++node) {
    // Within a node: extra copies for its heaviest experts, then the copies over its GPUs.
    std::vector<float> load(per_node);
    for (int64_t j = 0; j < per_node; ++j) load[j] = weight[expert_at[node * per_node + j]];
    const Replication copies = add_replicas(load, slots_per_node);
    std::vector<float> copy_load(slots_per_node);
    for (int64_t c = 0; c < slots_per_node; ++c)
      copy_load[c] = load[copies.phy2log[c]] / float(copies.logcnt[copies.phy2log[c]]);
    const Packing gpus = pack_evenly(copy_load, gpus_per_node);
    for (int64_t c = 0; c < slots_per_node; ++c) {
      const int64_t slot =
          node * slots_per_node + gpus.pack[c] * slots_per_gpu + gpus.rank_in_pack[c];
      slot_expert[slot] = expert_at[node * per_node + copies.phy2log[c]];
    }
  }
  return slot_expert;
}

}  // namespace

Placement eplb_rebalance(const ExpertLoads& loads, const EplbOptions& options) {
  validate(loads, "EPLB input");
  EplbOptions o = options;
  const std::string why = "EPLB: ";
  if (o.gpus <= 0 || o.replicas <= 0 || o.groups <= 0 || o.nodes <= 0)
    throw Error(why + "replicas, groups, nodes and gpus must be positive");
  if (o.replicas < loads.experts)
    throw Error(why + std::to_string(o.replicas) + " physical slots cannot hold " +
                std::to_string(loads.experts) + " experts");
  if (o.replicas > loads.experts * o.gpus)
    throw Error(
        why + std::to_string(o.replicas) + " physical slots per layer exceed one copy of each of " +
        std::to_string(loads.experts) + " experts on each of " + std::to_string(o.gpus) + " ranks");
  if (o.replicas % o.gpus != 0)
    throw Error(why + "physical slots per layer (" + std::to_string(o.replicas) +
                ") must be a multiple of the ranks (" + std::to_string(o.gpus) + ")");
  if (o.groups % o.nodes != 0) o.groups = o.nodes = 1;  // the global policy, as EPLB falls back
  if (loads.experts % o.groups != 0)
    throw Error(why + "experts (" + std::to_string(loads.experts) +
                ") must be a multiple of the expert groups (" + std::to_string(o.groups) + ")");
  if (o.gpus % o.nodes != 0)
    throw Error(why + "ranks (" + std::to_string(o.gpus) + ") must be a multiple of the nodes (" +
                std::to_string(o.nodes) + ")");
  Placement p{int(o.gpus), loads.experts, {}};
  const int64_t per_gpu = o.replicas / o.gpus;
  for (int64_t l = 0; l < loads.layers; ++l) {
    // The reference works on float32 loads.
    std::vector<float> weight(loads.row(l), loads.row(l) + loads.experts);
    const std::vector<int64_t> slot_expert = rebalance_layer(weight, o);
    std::vector<std::vector<int32_t>> ranks(o.gpus);
    for (int64_t s = 0; s < o.replicas; ++s) ranks[s / per_gpu].push_back(int32_t(slot_expert[s]));
    p.layers.push_back(std::move(ranks));
  }
  return p;
}

Placement no_redundancy(int64_t layers, int64_t experts, int ranks) {
  if (ranks <= 0 || experts < ranks)
    throw Error("placement: " + std::to_string(experts) + " experts cannot cover " +
                std::to_string(ranks) + " ranks (every rank needs at least one expert)");
  Placement p{ranks, experts, {}};
  std::vector<std::vector<int32_t>> layer(ranks);
  for (int64_t e = 0; e < experts; ++e) layer[e * ranks / experts].push_back(int32_t(e));
  p.layers.assign(layers, layer);
  return p;
}

}  // namespace tandem::placement
