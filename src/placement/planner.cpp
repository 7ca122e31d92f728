#include "placement/planner.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <queue>

#include "placement/eplb.h"
#include "util/error.h"

namespace tandem::placement {
namespace {

using RankLists = std::vector<std::vector<int32_t>>;

// Copies per expert: each extra slot goes to the expert with the highest load per copy (lower
// id on ties), as long as the copies can still sit on the ranks with at most one copy of an
// expert per rank. Kept as a heap so cost curves can add one at a time.
//
// Copies fit the ranks' slots exactly when, for every k, the k largest ranks' slots are at most
// the sum over experts of min(copies, k) (Gale-Ryser). With m copies still to add, spreading
// them over the experts with the fewest copies raises that sum by m for every k that needs it,
// so slack[k] = sum min(copies, k) + m - (k largest ranks' slots) >= 0 for all k says the copies
// so far can be completed. Another copy of an expert that has c lowers slack[1..c] by one.
class Replicator {
 public:
  Replicator(const double* loads, int64_t experts, const std::vector<int64_t>& capacity)
      : loads_(loads), count_(experts, 1) {
    set_capacity(capacity);
  }
  // The slots per rank the copies must fit (the total may grow between add_one calls).
  void set_capacity(std::vector<int64_t> capacity) {
    std::sort(capacity.begin(), capacity.end(), std::greater<>());
    while (!capacity.empty() && capacity.back() == 0) capacity.pop_back();
    const int64_t experts = int64_t(count_.size());
    int64_t slots = 0, copies = 0;
    for (int64_t c : capacity) slots += c;
    for (int32_t c : count_) copies += c;
    // Copies beyond one per rank with slots, or a rank with more slots than there are experts,
    // leave no slack: nothing more is added.
    const size_t ranks = capacity.size();
    slack_.assign(ranks + 1, 0);
    std::vector<int64_t> at_least(ranks + 2, 0);  // experts with at least k copies
    for (int32_t c : count_) ++at_least[std::min<size_t>(size_t(c), ranks + 1)];
    for (size_t k = ranks; k-- > 0;) at_least[k] += at_least[k + 1];
    int64_t sum_min = 0, largest = 0;
    feasible_ = slots >= copies && (capacity.empty() || capacity.front() <= experts);
    for (size_t k = 1; k <= ranks; ++k) {
      sum_min += at_least[k];
      largest += capacity[k - 1];
      slack_[k] = sum_min + (slots - copies) - largest;
      feasible_ = feasible_ && slack_[k] >= 0;
    }
    heap_ = {};
    for (int64_t e = 0; e < experts; ++e) heap_.push({loads_[e] / double(count_[e]), -e});
  }
  // Whether the copies so far fit the slots (with those still to add).
  bool feasible() const { return feasible_; }
  bool add_one() {
    if (!feasible_) return false;
    while (!heap_.empty()) {
      const int64_t e = -heap_.top().second;
      heap_.pop();
      // Slack only shrinks, so an expert refused here stays refused until the slots change.
      const int32_t c = count_[e];
      if (size_t(c) >= slack_.size()) continue;
      if (*std::min_element(slack_.begin() + 1, slack_.begin() + c + 1) < 1) continue;
      for (int32_t k = 1; k <= c; ++k) --slack_[k];
      ++count_[e];
      heap_.push({loads_[e] / double(count_[e]), -e});
      return true;
    }
    return false;
  }
  const std::vector<int32_t>& count() const { return count_; }

 private:
  const double* loads_;
  std::vector<int32_t> count_;
  std::vector<int64_t> slack_;  // [1, ranks with slots]; index 0 unused
  bool feasible_ = false;
  std::priority_queue<std::pair<double, int64_t>> heap_;
};

// A layer being packed: which rank holds which copies, and each rank's load.
struct LayerState {
  const double* loads;
  int64_t experts;
  std::vector<int64_t> capacity;
  const std::vector<int>& host_of_rank;
  std::vector<int32_t> count;
  std::vector<double> weight;  // per copy: an expert's load over its copies
  RankLists ranks;
  std::vector<double> rank_load;
  std::vector<uint8_t> holds;         // [rank, expert]
  std::vector<uint16_t> host_copies;  // [host, expert], with hosts only

  LayerState(const double* l, int64_t e, std::vector<int64_t> cap, const std::vector<int>& hosts,
             std::vector<int32_t> c)
      : loads(l),
        experts(e),
        capacity(std::move(cap)),
        host_of_rank(hosts),
        count(std::move(c)),
        ranks(capacity.size()),
        rank_load(capacity.size(), 0.0),
        holds(capacity.size() * size_t(e), 0) {
    weight.resize(e);
    for (int64_t x = 0; x < e; ++x) weight[x] = loads[x] / double(count[x]);
    if (!host_of_rank.empty())
      host_copies.assign(
          size_t(*std::max_element(host_of_rank.begin(), host_of_rank.end()) + 1) * e, 0);
  }

  int num_ranks() const { return int(capacity.size()); }
  double per_copy(int32_t e) const { return weight[e]; }
  bool has(int r, int32_t e) const { return holds[size_t(r) * experts + e] != 0; }
  int host(int r) const { return host_of_rank.empty() ? 0 : host_of_rank[r]; }
  bool host_has(int h, int32_t e) const {
    return !host_copies.empty() && host_copies[size_t(h) * experts + e] > 0;
  }
  void put(int r, int32_t e) {
    ranks[r].push_back(e);
    rank_load[r] += per_copy(e);
    holds[size_t(r) * experts + e] = 1;
    if (!host_copies.empty()) ++host_copies[size_t(host(r)) * experts + e];
  }
  void take(int r, int32_t e) {
    auto it = std::find(ranks[r].begin(), ranks[r].end(), e);
    ranks[r].erase(it);
    rank_load[r] -= per_copy(e);
    holds[size_t(r) * experts + e] = 0;
    if (!host_copies.empty()) --host_copies[size_t(host(r)) * experts + e];
  }
  void recompute_loads() {
    std::fill(rank_load.begin(), rank_load.end(), 0.0);
    for (int r = 0; r < num_ranks(); ++r)
      for (int32_t e : ranks[r]) rank_load[r] += per_copy(e);
  }
  double max_load() const { return *std::max_element(rank_load.begin(), rank_load.end()); }

  // The least loaded rank with room that lacks `e`, on a host without `e` when one has room.
  int choose_rank(int32_t e) const {
    int best = -1, best_spread = -1;
    for (int r = 0; r < num_ranks(); ++r) {
      if (int64_t(ranks[r].size()) >= capacity[r] || has(r, e)) continue;
      const int spread = host_of_rank.empty() ? 0 : (host_has(host(r), e) ? 0 : 1);
      if (best < 0 || spread > best_spread ||
          (spread == best_spread && rank_load[r] < rank_load[best])) {
        best = r;
        best_spread = spread;
      }
    }
    return best;
  }

  // Every rank with room already holds `e`: move another copy off a rank without `e` into
  // the room, and put `e` where it was (the move that leaves that rank lightest); when no single
  // move does, a chain of moves through several ranks.
  void place_by_displacing(int32_t e) {
    int room = -1;
    for (int r = 0; r < num_ranks() && room < 0; ++r)
      if (int64_t(ranks[r].size()) < capacity[r]) room = r;
    if (room < 0)
      throw Error("placement: no rank has room for another copy of expert " + std::to_string(e));
    int best_rank = -1;
    int32_t best_item = -1;
    double best_load = std::numeric_limits<double>::infinity();
    for (int r = 0; r < num_ranks(); ++r) {
      if (r == room || has(r, e)) continue;
      for (int32_t y : ranks[r]) {
        if (has(room, y)) continue;
        const double after = rank_load[r] - per_copy(y) + per_copy(e);
        if (after < best_load) best_load = after, best_rank = r, best_item = y;
      }
    }
    if (best_rank >= 0) {
      take(best_rank, best_item);
      put(room, best_item);
      put(best_rank, e);
      return;
    }
    if (!place_by_chain(e))
      throw Error("placement: no rank can take another copy of expert " + std::to_string(e));
  }

  // A shortest chain: `e` onto a rank r0 without it, a copy y1 of r0 onto r1 without y1, ... a
  // copy yk onto rk, which has room. Such a chain (an augmenting path of the copies-to-ranks
  // flow) exists whenever the copy counts fit the slots with distinct copies on every rank,
  // whatever the copies placed so far.
  bool place_by_chain(int32_t e) {
    const int n = num_ranks();
    std::vector<int> parent(n, -2);  // -2 not reached, -1 a start (lacks `e`)
    std::vector<int32_t> arrives(n, -1);
    std::vector<int> queue;
    const auto finish = [&](int to) {
      for (; parent[to] != -1; to = parent[to]) {
        take(parent[to], arrives[to]);
        put(to, arrives[to]);
      }
      put(to, e);
    };
    for (int r = 0; r < n; ++r)
      if (!has(r, e)) {
        parent[r] = -1;
        if (int64_t(ranks[r].size()) < capacity[r]) {
          finish(r);
          return true;
        }
        queue.push_back(r);
      }
    int found = -1;
    for (size_t head = 0; head < queue.size() && found < 0; ++head) {
      const int r = queue[head];
      for (size_t i = 0; i < ranks[r].size() && found < 0; ++i)
        for (int to = 0; to < n && found < 0; ++to) {
          const int32_t y = ranks[r][i];
          if (parent[to] != -2 || has(to, y)) continue;
          parent[to] = r;
          arrives[to] = y;
          if (int64_t(ranks[to].size()) < capacity[to])
            found = to;
          else
            queue.push_back(to);
        }
    }
    if (found < 0) return false;
    finish(found);
    return true;
  }

  void place(int32_t e) {
    const int r = choose_rank(e);
    if (r >= 0)
      put(r, e);
    else
      place_by_displacing(e);
  }

  // Whether moving `e` from rank `from` to rank `to` keeps host spreading no worse.
  bool host_allows(int32_t e, int from, int to) const {
    if (host_of_rank.empty() || host(from) == host(to)) return true;
    return !host_has(host(to), e);
  }

  // Pairwise swaps between the busiest rank and lighter ones while the busier of the two
  // gets lighter: LPT leaves a few percent that such swaps recover.
  // Stops within kRefineSlack of the lower bound (the mean rank load, or the heaviest copy),
  // where further swaps buy nothing a step would notice.
  static constexpr double kRefineSlack = 1e-3;
  static constexpr size_t kFirstLook = 8;
  std::vector<int> lightest_first_;
  void refine(double stop_at = 0) {
    double total = 0, heaviest = 0;
    for (int r = 0; r < num_ranks(); ++r)
      for (int32_t e : ranks[r]) total += per_copy(e), heaviest = std::max(heaviest, per_copy(e));
    const double mean = total / num_ranks();
    stop_at = std::max(stop_at, std::max(mean, heaviest) * (1 + kRefineSlack));
    // A swap must lower the busiest rank by a visible amount, not by rounding dust.
    const double step = kRefineSlack * mean;
    for (int iteration = 0; iteration < 4 * num_ranks(); ++iteration) {
      const int m = int(std::max_element(rank_load.begin(), rank_load.end()) - rank_load.begin());
      const double top = rank_load[m];
      if (top <= stop_at) return;
      double best_max = top - step;
      int best_s = -1;
      int32_t best_x = -1, best_y = -1;
      const uint8_t* on_m = holds.data() + size_t(m) * experts;
      // Only the kFirstLook lightest ranks: the best swap is almost always with one of them,
      // and searching all ranks doubles the planning time for a few hundredths of a percent.
      std::vector<int>& order = lightest_first_;
      order.resize(num_ranks());
      std::iota(order.begin(), order.end(), 0);
      const auto lighter = [&](int a, int b) {
        return rank_load[a] < rank_load[b] || (rank_load[a] == rank_load[b] && a < b);
      };
      const size_t first = std::min(kFirstLook, order.size());
      std::partial_sort(order.begin(), order.begin() + first, order.end(), lighter);
      for (size_t i = 0; i < order.size(); ++i) {
        if (i == first) break;
        const int s = order[i];
        // Only a rank lighter by more than a step can take load off the busiest one.
        if (s == m || rank_load[s] >= top - step) break;
        const uint8_t* on_s = holds.data() + size_t(s) * experts;
        const double gap = top - rank_load[s];
        for (int32_t x : ranks[m]) {
          if (on_s[x]) continue;
          const double a = weight[x];
          for (int32_t y : ranks[s]) {
            const double d = a - weight[y];  // load moved from m to s
            if (d <= 0 || d >= gap || on_m[y]) continue;
            const double after = std::max(top - d, rank_load[s] + d);
            if (after < best_max && host_allows(x, m, s) && host_allows(y, s, m)) {
              best_max = after;
              best_s = s, best_x = x, best_y = y;
            }
          }
        }
      }
      if (best_s < 0) return;
      take(m, best_x);
      take(best_s, best_y);
      put(m, best_y);
      put(best_s, best_x);
    }
  }
};

std::vector<std::pair<double, int32_t>> copies_heaviest_first(const LayerState& s) {
  std::vector<std::pair<double, int32_t>> items;
  for (int64_t e = 0; e < s.experts; ++e)
    for (int32_t c = 0; c < s.count[e]; ++c) items.push_back({s.per_copy(int32_t(e)), int32_t(e)});
  std::stable_sort(items.begin(), items.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  return items;
}

LayerState pack(const double* loads, int64_t experts, const std::vector<int64_t>& capacity,
                const std::vector<int>& hosts, std::vector<int32_t> count, bool refine) {
  LayerState s(loads, experts, capacity, hosts, std::move(count));
  if (!hosts.empty()) {
    for (const auto& [load, e] : copies_heaviest_first(s)) s.place(e);
  } else {
    // Without hosts the lightest rank with room comes off a heap (ties to the lower rank, as
    // the scan in choose_rank would pick); ranks already holding the expert are set aside.
    using Entry = std::pair<double, int>;
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> lightest;
    for (int r = 0; r < s.num_ranks(); ++r)
      if (capacity[r] > 0) lightest.push({0.0, r});
    std::vector<Entry> aside;
    for (const auto& [load, e] : copies_heaviest_first(s)) {
      while (!lightest.empty() && s.has(lightest.top().second, e)) {
        aside.push_back(lightest.top());
        lightest.pop();
      }
      if (lightest.empty()) {
        s.place_by_displacing(e);
        // Displacing changed two ranks' loads: rebuild the heap.
        lightest = {};
        aside.clear();
        for (int r = 0; r < s.num_ranks(); ++r)
          if (int64_t(s.ranks[r].size()) < capacity[r]) lightest.push({s.rank_load[r], r});
        continue;
      }
      const int r = lightest.top().second;
      lightest.pop();
      s.put(r, e);
      if (int64_t(s.ranks[r].size()) < capacity[r]) lightest.push({s.rank_load[r], r});
      for (const Entry& x : aside) lightest.push(x);
      aside.clear();
    }
  }
  if (refine) s.refine();
  return s;
}

std::vector<int64_t> even_capacity(int64_t slots, int ranks) {
  std::vector<int64_t> cap(ranks, slots / ranks);
  for (int64_t r = 0; r < slots % ranks; ++r) ++cap[r];
  return cap;
}

// Busiest rank's load for 0..max_extra redundant slots (LPT only, no swaps: a cost curve).
std::vector<double> cost_curve(const double* loads, int64_t experts, int ranks, int64_t max_extra,
                               const std::vector<int>& hosts) {
  std::vector<double> curve;
  Replicator rep(loads, experts, even_capacity(experts, ranks));
  double total = 0;
  for (int64_t e = 0; e < experts; ++e) total += loads[e];
  const double floor = total / ranks * (1 + 1e-3);
  for (int64_t r = 0; r <= max_extra; ++r) {
    // Past balance (or past one copy per rank) more slots buy nothing.
    if (r > 0) rep.set_capacity(even_capacity(experts + r, ranks));
    if ((r > 0 && !rep.add_one()) || (!curve.empty() && curve.back() <= floor)) {
      curve.resize(max_extra + 1, curve.back());
      break;
    }
    LayerState s =
        pack(loads, experts, even_capacity(experts + r, ranks), hosts, rep.count(), false);
    curve.push_back(s.max_load());
  }
  return curve;
}

// A layer being packed keeps a byte per (rank, expert).
constexpr int64_t kMaxRankExperts = int64_t(1) << 28;

void check_options(const ExpertLoads& loads, const PlanOptions& o) {
  validate(loads, "expert loads");
  if (o.ranks <= 0) throw Error("placement: ranks must be positive");
  if (o.redundant_slots < 0) throw Error("placement: redundant slots must not be negative");
  if (loads.experts < o.ranks)
    throw Error("placement: " + std::to_string(loads.experts) + " experts cannot fill " +
                std::to_string(o.ranks) + " ranks (every rank needs an expert in every layer)");
  if (int64_t(o.ranks) * loads.experts > kMaxRankExperts)
    throw Error("placement: " + std::to_string(o.ranks) + " ranks x " +
                std::to_string(loads.experts) + " experts is more than the planner handles");
  for (int h : o.host_of_rank)
    if (h < 0 || h >= o.ranks)
      throw Error("placement: host ids must be in [0, ranks), got " + std::to_string(h));
  if (!o.host_of_rank.empty() && int(o.host_of_rank.size()) != o.ranks)
    throw Error("placement: hosts are given for " + std::to_string(o.host_of_rank.size()) +
                " ranks, want " + std::to_string(o.ranks));
  // Bounded before the sum below, which a huge budget would wrap around.
  int64_t most = 0;
  if (__builtin_mul_overflow(loads.layers * loads.experts, int64_t(o.ranks) - 1, &most))
    most = std::numeric_limits<int64_t>::max();
  if (o.redundant_slots > most)
    throw Error("placement: " + std::to_string(o.redundant_slots) +
                " redundant slots exceed one copy of every expert on every rank (at most " +
                std::to_string(most) + ")");
  const int64_t total = loads.layers * loads.experts + o.redundant_slots;
  if (total % o.ranks != 0)
    throw Error("placement: " + std::to_string(total) +
                " expert slots over all layers do not divide over " + std::to_string(o.ranks) +
                " ranks (every rank needs the same expert memory); use a "
                "redundant budget that makes layers x experts + budget a multiple of the ranks");
}

}  // namespace

std::vector<std::vector<int32_t>> plan_layer(const double* loads, int64_t experts,
                                             const std::vector<int64_t>& capacity,
                                             const std::vector<int>& host_of_rank, bool refine) {
  const int ranks = int(capacity.size());
  const int64_t slots = std::accumulate(capacity.begin(), capacity.end(), int64_t(0));
  if (slots < experts)
    throw Error("placement: " + std::to_string(slots) + " slots cannot hold " +
                std::to_string(experts) + " experts");
  for (int64_t c : capacity)
    if (c > experts)
      throw Error("placement: a rank with " + std::to_string(c) + " slots cannot hold " +
                  std::to_string(c) + " distinct experts of " + std::to_string(experts));
  Replicator rep(loads, experts, capacity);
  for (int64_t i = experts; i < slots; ++i)
    if (!rep.add_one())
      throw Error("placement: " + std::to_string(slots) + " slots exceed one copy of each of " +
                  std::to_string(experts) + " experts on each of " + std::to_string(ranks) +
                  " ranks");
  return pack(loads, experts, capacity, host_of_rank, rep.count(), refine).ranks;
}

std::vector<int64_t> allocate_redundancy(const ExpertLoads& loads, const PlanOptions& o) {
  check_options(loads, o);
  const int64_t layers = loads.layers, budget = o.redundant_slots;
  const int64_t per_layer_cap = loads.experts * (int64_t(o.ranks) - 1);
  std::vector<int64_t> out(layers, 0);
  switch (o.allocation) {
    case Allocation::kEven:
      for (int64_t l = 0; l < layers; ++l) out[l] = budget / layers + (l < budget % layers ? 1 : 0);
      return out;
    case Allocation::kWorstLayers: {
      std::vector<double> ratio(layers);
      for (int64_t l = 0; l < layers; ++l) {
        const auto ranks = plan_layer(loads.row(l), loads.experts,
                                      even_capacity(loads.experts, o.ranks), o.host_of_rank, false);
        ratio[l] = layer_balance(loads.row(l), ranks, loads.experts).ratio();
      }
      std::vector<int64_t> order(layers);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return ratio[a] > ratio[b]; });
      int64_t left = budget;
      for (int64_t pass = 0; left > 0; ++pass)
        for (int64_t i = 0; i < layers && left > 0; ++i) {
          const int64_t give = std::min<int64_t>({left, o.ranks, per_layer_cap - out[order[i]]});
          out[order[i]] += give;
          left -= give;
        }
      return out;
    }
    case Allocation::kLayerWise: {
      // Minimise the sum over layers of the busiest rank's load with exactly `budget` extra
      // slots: a knapsack over per-layer cost curves.
      const auto cap_for = [&](int64_t b) {
        const int64_t even = (b + layers - 1) / layers;
        return std::min({b, per_layer_cap, std::max<int64_t>(4 * o.ranks, 8 * even)});
      };
      // The knapsack's steps (and choices kept); it grows with the budget.
      const auto fits = [&](int64_t b) {
        return double(layers) * double(b + 1) * double(cap_for(b) + 1) <= 4e9;
      };
      // Checked before the cost curves, which take minutes for such budgets.
      if (!fits(budget)) {
        int64_t most = 0, over = budget;
        while (over - most > 1) {
          const int64_t mid = most + (over - most) / 2;
          (fits(mid) ? most : over) = mid;
        }
        // The flags' values that fit and that the ranks take: every layer's slots together
        // must divide over the ranks (see the check of the options).
        const int64_t base = layers * loads.experts;
        const int64_t redundant = most - (base + most) % o.ranks;
        int64_t slots = loads.experts + most / layers;
        while (slots > loads.experts && (layers * slots) % o.ranks != 0) --slots;
        std::string fit;
        if (redundant > 0) fit += ": --redundant " + std::to_string(redundant);
        if (slots > loads.experts)
          fit += (fit.empty() ? ": --slots " : " or --slots ") + std::to_string(slots);
        throw Error("placement: a redundant budget of " + std::to_string(budget) +
                    " slots is too large for the layer-wise allocation (at most " +
                    std::to_string(most) + " over " + std::to_string(layers) + " layers" + fit +
                    "); use a smaller --slots or --redundant, or --algorithm omni-even");
      }
      const int64_t cap = cap_for(budget);
      std::vector<std::vector<double>> curve(layers);
      for (int64_t l = 0; l < layers; ++l)
        curve[l] = cost_curve(loads.row(l), loads.experts, o.ranks, cap, o.host_of_rank);
      const double inf = std::numeric_limits<double>::infinity();
      std::vector<double> best(budget + 1, inf), next(budget + 1);
      best[0] = 0;
      std::vector<std::vector<int32_t>> choice(layers, std::vector<int32_t>(budget + 1, -1));
      for (int64_t l = 0; l < layers; ++l) {
        std::fill(next.begin(), next.end(), inf);
        for (int64_t b = 0; b <= budget; ++b) {
          if (best[b] == inf) continue;
          for (int64_t r = 0; r <= cap && b + r <= budget; ++r) {
            const double v = best[b] + curve[l][r];
            if (v < next[b + r]) {
              next[b + r] = v;
              choice[l][b + r] = int32_t(r);
            }
          }
        }
        best.swap(next);
      }
      if (best[budget] == inf) throw Error("placement: the redundant budget cannot be allocated");
      for (int64_t l = layers - 1, b = budget; l >= 0; --l) {
        out[l] = choice[l][b];
        b -= out[l];
      }
      return out;
    }
  }
  return out;
}

namespace {

Plan plan_allocation(const ExpertLoads& loads, const PlanOptions& o,
                     std::vector<int64_t> allocation) {
  Plan result;
  result.redundant_per_layer = std::move(allocation);
  Placement& p = result.placement;
  p.ranks = o.ranks;
  p.experts = loads.experts;
  // The extra slot of a layer whose slots do not divide over the ranks goes to the next ranks in
  // turn, so every rank ends with the same total.
  int64_t cursor = 0;
  for (int64_t l = 0; l < loads.layers; ++l) {
    const int64_t slots = loads.experts + result.redundant_per_layer[l];
    std::vector<int64_t> capacity(o.ranks, slots / o.ranks);
    for (int64_t i = 0; i < slots % o.ranks; ++i) ++capacity[(cursor + i) % o.ranks];
    cursor = (cursor + slots % o.ranks) % o.ranks;
    p.layers.push_back(plan_layer(loads.row(l), loads.experts, capacity, o.host_of_rank, o.refine));
  }
  return result;
}

double sum_of_busiest(const ExpertLoads& loads, const Placement& p) {
  double sum = 0;
  for (const LayerBalance& b : evaluate(loads, p).layers) sum += b.max_rank_load;
  return sum;
}

}  // namespace

Plan plan(const ExpertLoads& loads, const PlanOptions& o) {
  Plan chosen = plan_allocation(loads, o, allocate_redundancy(loads, o));
  if (o.allocation != Allocation::kLayerWise) return chosen;
  // The knapsack works on cost curves without swaps; the even spread is kept when its
  // finished plan turns out no worse, so layer-wise never loses to it.
  PlanOptions even = o;
  even.allocation = Allocation::kEven;
  Plan other = plan_allocation(loads, o, allocate_redundancy(loads, even));
  return sum_of_busiest(loads, other.placement) < sum_of_busiest(loads, chosen.placement) ? other
                                                                                          : chosen;
}

namespace {

// Relabels the ranks of `fresh` (within capacity and host) so it keeps as much of `current` as
// it can: ranks are interchangeable to a plan, not to the weights already loaded.
RankLists align_to(const RankLists& current, RankLists fresh, const std::vector<int>& hosts,
                   int64_t experts) {
  const int n = int(current.size());
  std::vector<std::tuple<int, int, int>> pairs;  // (-overlap, fresh rank, current rank)
  for (int f = 0; f < n; ++f) {
    std::vector<uint8_t> in(experts, 0);
    for (int32_t e : fresh[f]) in[e] = 1;
    for (int c = 0; c < n; ++c) {
      if (current[c].size() != fresh[f].size()) continue;
      if (!hosts.empty() && hosts[c] != hosts[f]) continue;
      int overlap = 0;
      for (int32_t e : current[c]) overlap += in[e];
      pairs.push_back({-overlap, f, c});
    }
  }
  std::sort(pairs.begin(), pairs.end());
  std::vector<int> target(n, -1);
  std::vector<uint8_t> taken(n, 0);
  for (const auto& [neg, f, c] : pairs)
    if (target[f] < 0 && !taken[c]) target[f] = c, taken[c] = 1;
  // Slot counts that differ rank by rank (another allocation) leave no relabeling to make.
  if (std::find(target.begin(), target.end(), -1) != target.end()) return fresh;
  RankLists out(n);
  for (int f = 0; f < n; ++f) out[target[f]] = std::move(fresh[f]);
  return out;
}

}  // namespace

Placement align_to_current(const Placement& current, Placement fresh,
                           const std::vector<int>& host_of_rank) {
  if (current.num_layers() != fresh.num_layers() || current.ranks != fresh.ranks)
    throw Error("placement: cannot align plans of different layers or ranks");
  if (!host_of_rank.empty() && int(host_of_rank.size()) != fresh.ranks)
    throw Error("placement: hosts are given for " + std::to_string(host_of_rank.size()) +
                " ranks, want " + std::to_string(fresh.ranks));
  for (int64_t l = 0; l < fresh.num_layers(); ++l)
    fresh.layers[l] =
        align_to(current.layers[l], std::move(fresh.layers[l]), host_of_rank, fresh.experts);
  return fresh;
}

IncrementalPlan plan_incremental(const ExpertLoads& loads, const Placement& current,
                                 const std::vector<int>& hosts, const IncrementalOptions& o) {
  validate(loads, "expert loads");
  validate(current, kServable);
  if (loads.layers != current.num_layers() || loads.experts != current.experts)
    throw Error("placement: the loads are [" + std::to_string(loads.layers) + ", " +
                std::to_string(loads.experts) + "] but the current placement has " +
                std::to_string(current.num_layers()) + " layers of " +
                std::to_string(current.experts) + " experts");
  for (int h : hosts)
    if (h < 0 || h >= current.ranks)
      throw Error("placement: host ids must be in [0, ranks), got " + std::to_string(h));
  if (!hosts.empty() && int(hosts.size()) != current.ranks)
    throw Error("placement: hosts are given for " + std::to_string(hosts.size()) + " ranks, want " +
                std::to_string(current.ranks));
  if (int64_t(current.ranks) * current.experts > kMaxRankExperts)
    throw Error("placement: " + std::to_string(current.ranks) + " ranks x " +
                std::to_string(current.experts) + " experts is more than the planner handles");
  IncrementalPlan result{current, 0, 0};
  for (int64_t l = 0; l < loads.layers; ++l) {
    const RankLists& now = current.layers[l];
    std::vector<int64_t> capacity;
    for (const auto& r : now) capacity.push_back(int64_t(r.size()));
    // A rank with more slots than there are experts (copies doubled up, as EPLB may) cannot
    // hold distinct copies: no plan keeps its slots, so the layer stays as it is.
    if (*std::max_element(capacity.begin(), capacity.end()) > loads.experts) continue;
    const RankLists fresh = plan_layer(loads.row(l), loads.experts, capacity, hosts, true);
    const double fresh_max = layer_balance(loads.row(l), fresh, loads.experts).max_rank_load;
    const double now_max = layer_balance(loads.row(l), now, loads.experts).max_rank_load;
    // A layer with two copies of one expert on a rank (an EPLB plan) is always repaired.
    bool doubled = false;
    std::vector<int32_t> seen_on(loads.experts, -1);
    for (int32_t r = 0; r < int32_t(now.size()); ++r)
      for (int32_t e : now[r]) {
        doubled = doubled || seen_on[e] == r;
        seen_on[e] = r;
      }
    if (!doubled && (now_max <= fresh_max || (now_max - fresh_max) <= o.min_gain * now_max))
      continue;

    // Repair: keep every copy the fresh plan's copy counts still want, drop the surplus from
    // the busiest ranks, place the missing copies, then swap off the busiest rank.
    std::vector<int32_t> want(loads.experts, 0);
    for (const auto& r : fresh)
      for (int32_t e : r) ++want[e];
    LayerState s(loads.row(l), loads.experts, capacity, hosts, want);
    std::vector<int32_t> have(loads.experts, 0);
    for (int r = 0; r < int(now.size()); ++r)
      for (int32_t e : now[r])
        if (!s.has(r, e)) {  // a second copy on one rank (EPLB allows it) is dropped
          s.put(r, e);
          ++have[e];
        }
    for (int64_t e = 0; e < loads.experts; ++e) {
      for (int32_t extra = have[e] - want[e]; extra > 0; --extra) {
        int from = -1;
        for (int r = 0; r < s.num_ranks(); ++r)
          if (s.has(r, int32_t(e)) && (from < 0 || s.rank_load[r] > s.rank_load[from])) from = r;
        s.take(from, int32_t(e));
      }
    }
    std::vector<std::pair<double, int32_t>> missing;
    for (int64_t e = 0; e < loads.experts; ++e) {
      int32_t placed = 0;
      for (int r = 0; r < s.num_ranks(); ++r) placed += s.has(r, int32_t(e));
      for (int32_t c = placed; c < want[e]; ++c)
        missing.push_back({s.per_copy(int32_t(e)), int32_t(e)});
    }
    std::stable_sort(missing.begin(), missing.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    for (const auto& [load, e] : missing) s.place(e);
    s.recompute_loads();
    s.refine(fresh_max * (1 + o.tolerance));
    const int64_t repair_moves = count_layer_moves(now, s.ranks);
    const bool repaired_ok = s.max_load() <= fresh_max * (1 + o.tolerance);

    RankLists aligned = align_to(now, fresh, hosts, loads.experts);
    const int64_t fresh_moves = count_layer_moves(now, aligned);
    RankLists& chosen = result.placement.layers[l];
    if (repaired_ok && repair_moves <= fresh_moves) {
      chosen = s.ranks;
      result.moves += repair_moves;
    } else {
      chosen = std::move(aligned);
      result.moves += fresh_moves;
    }
    if (count_layer_moves(now, chosen) > 0) ++result.layers_changed;
  }
  return result;
}

}  // namespace tandem::placement
