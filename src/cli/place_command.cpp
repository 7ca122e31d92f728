#include "cli/place_command.h"

#include "cli/number_checks.h"
#include "placement/files.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>

#include "placement/eplb.h"
#include "placement/placement_format.h"
#include "placement/planner.h"
#include "util/error.h"
#include "util/file.h"
#include "util/npy.h"

namespace tandem::cli {
namespace {

namespace fs = std::filesystem;
using namespace tandem::placement;

struct Shape {
  int ranks = 0;
  int64_t slots = 0;       // physical slots per layer (EPLB's num_replicas); 0: experts
  int64_t redundant = -1;  // over all layers; -1: from slots
  int groups = 1;          // hosts
  int64_t expert_groups = 8;
};

std::vector<int> hosts_of(const Shape& s) {
  if (s.groups <= 1) return {};
  if (s.ranks % s.groups != 0)
    throw Error("--groups " + std::to_string(s.groups) + " does not divide --ranks " +
                std::to_string(s.ranks));
  std::vector<int> host(s.ranks);
  for (int r = 0; r < s.ranks; ++r) host[r] = r / (s.ranks / s.groups);
  return host;
}

// a * b, or INT64_MAX where that does not fit: a bound no int64 flag value can pass.
int64_t saturating_product(int64_t a, int64_t b) {
  int64_t out = 0;
  return __builtin_mul_overflow(a, b, &out) ? std::numeric_limits<int64_t>::max() : out;
}

// Checked against one copy of every expert on every rank before any product, which a huge
// flag value would otherwise wrap around into a small (or negative) budget.
int64_t redundant_total(const Shape& s, const ExpertLoads& loads) {
  const int64_t ranks = std::max(s.ranks, 1);
  if (s.redundant >= 0) {
    const int64_t most =
        saturating_product(saturating_product(loads.layers, loads.experts), ranks - 1);
    if (s.redundant > most)
      throw Error("--redundant " + std::to_string(s.redundant) +
                  " exceeds one copy of every expert on every rank (at most " +
                  std::to_string(most) + " for " + std::to_string(loads.layers) + " layers x " +
                  std::to_string(loads.experts) + " experts on " + std::to_string(ranks) +
                  " ranks)");
    return s.redundant;
  }
  const int64_t slots = s.slots > 0 ? s.slots : loads.experts;
  if (slots < loads.experts)
    throw Error("--slots " + std::to_string(slots) + " cannot hold the " +
                std::to_string(loads.experts) + " experts of a layer");
  const int64_t most = saturating_product(loads.experts, ranks);
  if (slots > most)
    throw Error("--slots " + std::to_string(slots) +
                " exceeds one copy of every expert on every rank (at most " + std::to_string(most) +
                " for " + std::to_string(loads.experts) + " experts on " + std::to_string(ranks) +
                " ranks)");
  return saturating_product(slots - loads.experts, loads.layers);
}

// One algorithm: the placement it makes for these loads.
using Planner = std::function<Placement(const ExpertLoads&, const Shape&)>;

Placement plan_omni(const ExpertLoads& loads, const Shape& s, Allocation allocation) {
  PlanOptions o;
  o.ranks = s.ranks;
  o.redundant_slots = redundant_total(s, loads);
  o.host_of_rank = hosts_of(s);
  o.allocation = allocation;
  return plan(loads, o).placement;
}

// An algorithm that places experts without regard to hosts refuses --groups rather than
// ignoring it.
void refuse_groups(const Shape& s, const std::string& algorithm, const std::string& instead) {
  if (s.groups > 1)
    throw Error("--groups " + std::to_string(s.groups) + ": --algorithm " + algorithm +
                " does not place by hosts" + instead);
}

Placement plan_eplb(const ExpertLoads& loads, const Shape& s, bool hierarchical) {
  if (!hierarchical) refuse_groups(s, "eplb", " (eplb-hierarchical does)");
  const int64_t total = redundant_total(s, loads);
  if (total % loads.layers != 0)
    throw Error("EPLB places the same slots in every layer: a redundant budget of " +
                std::to_string(total) + " does not divide over " + std::to_string(loads.layers) +
                " layers");
  EplbOptions o;
  o.replicas = loads.experts + total / loads.layers;
  o.gpus = s.ranks;
  if (hierarchical) {
    // EPLB falls back to its global policy (one group, one node) when the nodes do not divide
    // the expert groups: the hosts would be ignored, and this command refuses flags it ignores.
    if (s.expert_groups % s.groups != 0)
      throw Error("--groups " + std::to_string(s.groups) + " does not divide --expert-groups " +
                  std::to_string(s.expert_groups) +
                  ": --algorithm eplb-hierarchical packs whole expert groups onto hosts (EPLB "
                  "would fall back to its global policy and ignore the hosts)");
    if (loads.experts % s.expert_groups != 0)
      throw Error("--expert-groups " + std::to_string(s.expert_groups) + " does not divide the " +
                  std::to_string(loads.experts) + " experts of a layer");
    o.groups = s.expert_groups;
    o.nodes = s.groups;
  }
  return eplb_rebalance(loads, o);
}

const std::map<std::string, Planner>& planners() {
  static const std::map<std::string, Planner> table = {
      {"omni", [](const ExpertLoads& l,
                  const Shape& s) { return plan_omni(l, s, Allocation::kLayerWise); }},
      {"omni-even",
       [](const ExpertLoads& l, const Shape& s) { return plan_omni(l, s, Allocation::kEven); }},
      {"omni-worst-layers",
       [](const ExpertLoads& l, const Shape& s) {
         return plan_omni(l, s, Allocation::kWorstLayers);
       }},
      {"eplb", [](const ExpertLoads& l, const Shape& s) { return plan_eplb(l, s, false); }},
      {"eplb-hierarchical",
       [](const ExpertLoads& l, const Shape& s) { return plan_eplb(l, s, true); }},
      {"none",
       [](const ExpertLoads& l, const Shape& s) {
         refuse_groups(s, "none", "");
         if (const int64_t extra = redundant_total(s, l); extra > 0)
           throw Error("--algorithm none places every expert once: --slots/--redundant ask for " +
                       std::to_string(extra) + " redundant slots");
         return no_redundancy(l.layers, l.experts, s.ranks);
       }},
  };
  return table;
}

std::string algorithm_names() {
  std::string names;
  for (const auto& [name, fn] : planners()) {
    if (!names.empty()) names += ", ";
    names += name;
  }
  return names;
}

const Planner& planner(const std::string& name) {
  auto it = planners().find(name);
  if (it == planners().end())
    throw Error("--algorithm: '" + name + "' is not one of " + algorithm_names());
  return it->second;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

void print_balance_table(const Balance& before, const Balance& after, const Placement& from,
                         const Placement& to) {
  std::printf("%-6s %6s %16s %16s %6s\n", "layer", "slots", "before max/mean", "after max/mean",
              "moves");
  for (int64_t l = 0; l < to.num_layers(); ++l)
    std::printf("%-6lld %6lld %16.3f %16.3f %6lld\n", static_cast<long long>(l),
                static_cast<long long>(to.slots(l)), before.layers[l].ratio(),
                after.layers[l].ratio(),
                static_cast<long long>(count_layer_moves(from.layers[l], to.layers[l])));
}

void print_summary(const char* what, const Balance& b) {
  std::printf("%s: step proxy %.4f, mean max/mean %.4f, worst layer %lld at %.3f\n", what,
              b.step_proxy, b.mean_ratio, static_cast<long long>(b.worst_layer), b.worst_ratio);
}

void write_outputs(const Placement& p, const std::string& json_out, const std::string& npy_out) {
  // Both converted before either is written: a plan one format cannot hold (two copies of an
  // expert on one rank, in an Omni pattern) leaves no file behind.
  const std::string json = json_out.empty() ? "" : placement_to_json(p).dump() + "\n";
  const NpyArray a = npy_out.empty() ? NpyArray{} : placement_to_omni_pattern(p);
  if (!json_out.empty()) {
    write_file_atomically(json_out, json);
    std::printf("wrote %s (phy2log, log2phy, logcnt, rank_slots per layer)\n", json_out.c_str());
  }
  if (!npy_out.empty()) {
    write_npy(npy_out, a.shape, a.values, /*int32=*/true);
    std::printf("wrote %s (Omni pattern [%lld ranks, %lld layers, %lld experts] int32)\n",
                npy_out.c_str(), static_cast<long long>(a.shape[0]),
                static_cast<long long>(a.shape[1]), static_cast<long long>(a.shape[2]));
  }
}

struct PlanArgs {
  Shape shape;
  std::string loads, current, algorithm = "omni", out, omni_out;
  bool fresh = false;
};

// Incremental rebalancing keeps the slots every rank has in every layer of --current, so the
// slot budget and its spread over layers come from there: flags that ask for others are refused
// rather than ignored.
void check_keeps_current(const PlanArgs& a, const Placement& current) {
  int64_t slots = 0;
  for (int64_t l = 0; l < current.num_layers(); ++l) slots += current.slots(l);
  const int64_t redundant = slots - current.num_layers() * current.experts;
  const std::string keeps = " disagrees with --current " + a.current + ", which holds " +
                            std::to_string(redundant) + " redundant slots over its " +
                            std::to_string(current.num_layers()) +
                            " layers: rebalancing it incrementally keeps its slots (--fresh plans "
                            "anew)";
  if (a.shape.redundant >= 0 && a.shape.redundant != redundant)
    throw Error("--redundant " + std::to_string(a.shape.redundant) + keeps);
  if (a.shape.slots > 0 &&
      saturating_product(a.shape.slots - current.experts, current.num_layers()) != redundant)
    throw Error("--slots " + std::to_string(a.shape.slots) + keeps);
  if (a.algorithm != "omni")
    throw Error("--algorithm " + a.algorithm +
                " spreads the redundant slots over layers its own way, but rebalancing --current " +
                a.current +
                " incrementally keeps its slots: use --algorithm omni, or --fresh to plan anew");
}

void run_plan(const PlanArgs& a) {
  if (a.fresh && a.current.empty())
    throw Error(
        "--fresh plans anew instead of rebalancing --current incrementally: give "
        "--current too (without it every plan is fresh)");
  const ExpertLoads loads = read_loads(a.loads);
  const Planner& chosen = planner(a.algorithm);
  std::optional<Placement> current;
  if (!a.current.empty()) {
    // Checked as it is read (read_placement validates), before any planning, named as the flag.
    try {
      current = read_placement(a.current);
    } catch (const Error& e) {
      throw Error(std::string("--current ") + e.what());
    }
    if (current->num_layers() != loads.layers || current->experts != loads.experts ||
        current->ranks != a.shape.ranks)
      throw Error(a.current + ": the current placement has " +
                  std::to_string(current->num_layers()) + " layers of " +
                  std::to_string(current->experts) + " experts on " +
                  std::to_string(current->ranks) + " ranks; the loads are [" +
                  std::to_string(loads.layers) + ", " + std::to_string(loads.experts) +
                  "] and --ranks is " + std::to_string(a.shape.ranks));
  }
  const Placement before =
      current ? *current : no_redundancy(loads.layers, loads.experts, a.shape.ranks);
  const auto start = std::chrono::steady_clock::now();
  Placement after;
  int64_t moves = 0;
  const bool incremental = current && !a.fresh && a.algorithm.rfind("omni", 0) == 0;
  if (incremental) check_keeps_current(a, *current);
  if (incremental) {
    IncrementalPlan inc = plan_incremental(loads, *current, hosts_of(a.shape));
    after = std::move(inc.placement);
    moves = inc.moves;
  } else {
    after = chosen(loads, a.shape);
    moves = count_moves(before, after);
  }
  const double took = seconds_since(start);
  // By the rules its readers apply (place show, --current, the engine): a plan from a drained
  // or uneven --current, or `none` over ranks the experts do not divide, is written like any.
  validate(after, kServable);

  int64_t slots = 0;
  for (int64_t l = 0; l < after.num_layers(); ++l) slots += after.slots(l);
  const std::string hosts =
      a.shape.groups > 1 ? " in " + std::to_string(a.shape.groups) + " hosts" : "";
  std::printf(
      "place plan: %s%s, %lld layers x %lld experts on %d ranks%s, %lld slots over all "
      "layers (%lld redundant)\n",
      a.algorithm.c_str(), incremental ? " (incremental from --current)" : "",
      static_cast<long long>(loads.layers), static_cast<long long>(loads.experts), a.shape.ranks,
      hosts.c_str(), static_cast<long long>(slots),
      static_cast<long long>(slots - loads.layers * loads.experts));
  const Balance b0 = evaluate(loads, before), b1 = evaluate(loads, after);
  print_balance_table(b0, b1, before, after);
  print_summary(current ? "before (--current)" : "before (no redundancy)", b0);
  print_summary("after", b1);
  std::printf("moves: %lld experts loaded onto ranks that did not hold them\n",
              static_cast<long long>(moves));
  std::printf("planning time: %.2f ms\n", took * 1e3);
  write_outputs(after, a.out, a.omni_out);
}

struct ShowArgs {
  std::string placement, loads, out, omni_out;
};

void run_show(const ShowArgs& a) {
  const Placement p = read_placement(a.placement);
  std::printf("%s: %d ranks, %lld layers, %lld experts\n", a.placement.c_str(), p.ranks,
              static_cast<long long>(p.num_layers()), static_cast<long long>(p.experts));
  std::map<int64_t, std::vector<int64_t>> layers_by_slots;
  for (int64_t l = 0; l < p.num_layers(); ++l) layers_by_slots[p.slots(l)].push_back(l);
  for (const auto& [slots, layers] : layers_by_slots) {
    std::string list;
    for (int64_t l : layers) {
      if (!list.empty()) list += ',';
      list += std::to_string(l);
    }
    std::printf("  %zu layers with %lld slots (%lld redundant): %s\n", layers.size(),
                static_cast<long long>(slots), static_cast<long long>(slots - p.experts),
                list.c_str());
  }
  const std::vector<int64_t> per_rank = p.slots_per_rank();
  const auto [lo, hi] = std::minmax_element(per_rank.begin(), per_rank.end());
  std::printf("  expert slots per rank over all layers: %lld..%lld%s\n",
              static_cast<long long>(*lo), static_cast<long long>(*hi),
              *lo == *hi ? " (equal memory on every rank)" : "");
  int32_t most = 0;
  for (int64_t l = 0; l < p.num_layers(); ++l)
    for (int32_t c : p.logcnt(l)) most = std::max(most, c);
  std::printf("  copies per expert: at most %d\n", most);
  validate(p, kServable);
  if (!a.loads.empty()) {
    const ExpertLoads loads = read_loads(a.loads);
    if (loads.layers != p.num_layers() || loads.experts != p.experts)
      throw Error("--loads " + a.loads + ": the loads are [" + std::to_string(loads.layers) + ", " +
                  std::to_string(loads.experts) + "] but " + a.placement + " covers " +
                  std::to_string(p.num_layers()) + " layers of " + std::to_string(p.experts) +
                  " experts");
    const Balance none = evaluate(loads, no_redundancy(loads.layers, loads.experts, p.ranks));
    const Balance b = evaluate(loads, p);
    print_balance_table(none, b, p, p);
    print_summary("no redundancy", none);
    print_summary("this placement", b);
  }
  write_outputs(p, a.out, a.omni_out);
}

struct SimulateArgs {
  Shape shape;
  std::string loads, algorithm = "omni";
  int64_t every = 1;
  double min_gain = 0.02;
};

void run_simulate(const SimulateArgs& a) {
  // A share of the busiest rank's load: NaN would compare false everywhere and never rebalance.
  if (!(a.min_gain >= 0 && a.min_gain <= 1))
    throw Error("--min-gain: expected a share in 0..1, got " + std::to_string(a.min_gain));
  const std::vector<ExpertLoads> snaps = read_load_snapshots(a.loads);
  if (snaps.size() < 2) throw Error(a.loads + ": simulate needs at least two load snapshots");
  if (a.every < 1) throw Error("--every must be at least 1");
  const Planner& chosen = planner(a.algorithm);
  const std::vector<int> hosts = hosts_of(a.shape);
  // The placement of each period is planned from the snapshot before it (what a live system
  // knows), then judged on the loads the period actually had.
  const Placement initial = chosen(snaps[0], a.shape);
  Placement fixed = initial, fresh = initial, incremental = initial;
  int64_t fresh_moves = 0, aligned_moves = 0, incremental_moves = 0, rebalances = 0;
  double sum_fixed = 0, sum_fresh = 0, sum_incremental = 0, sum_none = 0;
  std::printf("%-9s %12s %12s %12s %12s %11s %13s %11s\n", "snapshot", "none", "static", "fresh",
              "incremental", "fresh moves", "aligned moves", "incr. moves");
  for (size_t t = 1; t < snaps.size(); ++t) {
    int64_t fm = 0, am = 0, im = 0;
    if ((t - 1) % size_t(a.every) == 0 && t > 1) {
      const ExpertLoads& seen = snaps[t - 1];
      Placement next = chosen(seen, a.shape);
      fm = count_moves(fresh, next);
      am = count_moves(fresh, align_to_current(fresh, next, hosts));
      fresh = std::move(next);
      IncrementalOptions io;
      io.min_gain = a.min_gain;
      IncrementalPlan inc = plan_incremental(seen, incremental, hosts, io);
      im = inc.moves;
      incremental = std::move(inc.placement);
      ++rebalances;
    }
    const double none =
        evaluate(snaps[t], no_redundancy(snaps[t].layers, snaps[t].experts, a.shape.ranks))
            .step_proxy;
    const double pf = evaluate(snaps[t], fixed).step_proxy;
    const double pr = evaluate(snaps[t], fresh).step_proxy;
    const double pi = evaluate(snaps[t], incremental).step_proxy;
    sum_none += none, sum_fixed += pf, sum_fresh += pr, sum_incremental += pi;
    fresh_moves += fm, aligned_moves += am, incremental_moves += im;
    std::printf("%-9zu %12.4f %12.4f %12.4f %12.4f %11lld %13lld %11lld\n", t, none, pf, pr, pi,
                static_cast<long long>(fm), static_cast<long long>(am), static_cast<long long>(im));
  }
  const double n = double(snaps.size() - 1);
  std::printf("mean step proxy: none %.4f, static %.4f, fresh %.4f, incremental %.4f\n",
              sum_none / n, sum_fixed / n, sum_fresh / n, sum_incremental / n);
  std::printf(
      "moves over %lld rebalances: fresh %lld (%lld with ranks relabeled), incremental %lld\n",
      static_cast<long long>(rebalances), static_cast<long long>(fresh_moves),
      static_cast<long long>(aligned_moves), static_cast<long long>(incremental_moves));
}

void add_shape_options(CLI::App* cmd, Shape& s) {
  cmd->add_option("--ranks", s.ranks, "expert-parallel ranks")
      ->required()
      ->check(CLI::Range(1, 1 << 16));
  auto* slots = cmd->add_option("--slots", s.slots,
                                "physical expert slots per layer, EPLB's num_replicas (default: "
                                "experts, no redundancy); the redundant ones may be spread "
                                "unevenly over layers")
                    ->check(non_negative_number());
  // Two budgets for one thing: given both, one would be ignored.
  cmd->add_option("--redundant", s.redundant,
                  "redundant slots over all layers (instead of --slots), e.g. 320 for the Omni "
                  "pattern's 10 layers x 32")
      ->check(non_negative_number())
      ->excludes(slots);
  cmd->add_option("--groups", s.groups,
                  "hosts: ranks split into this many equal groups (omni algorithms, "
                  "eplb-hierarchical; eplb and none refuse it)")
      ->capture_default_str()
      ->check(positive_number());
  cmd->add_option("--expert-groups", s.expert_groups,
                  "expert groups of group-limited routing, for eplb-hierarchical")
      ->capture_default_str()
      ->check(positive_number());
}

}  // namespace

void add_place_command(CLI::App& app) {
  auto* place = app.add_subcommand(
      "place", "Omni Placement: plan where experts live across expert-parallel ranks");
  place->require_subcommand(1);

  auto p = std::make_shared<PlanArgs>();
  auto* plan_cmd = place->add_subcommand(
      "plan", "Plan a placement for expert loads; print balance before and after, moves, time");
  plan_cmd
      ->add_option("--loads", p->loads,
                   "loads: .npy [layers, experts] (or [snapshots, layers, experts], summed), "
                   "an /expert_load JSON, or an --expert-load-dump folder")
      ->required();
  add_shape_options(plan_cmd, p->shape);
  plan_cmd
      ->add_option("--current", p->current,
                   "the placement in use (.json or Omni .npy): moves are counted from it; "
                   "--algorithm omni rebalances it incrementally, keeping every rank's slots "
                   "in every layer (--slots/--redundant must agree; omni-even and "
                   "omni-worst-layers need --fresh); eplb, eplb-hierarchical and none plan anew")
      ->check(CLI::ExistingFile);
  plan_cmd->add_flag("--fresh", p->fresh, "with --current: plan from scratch, not incrementally");
  plan_cmd->add_option("--algorithm", p->algorithm, "one of " + algorithm_names())
      ->capture_default_str();
  plan_cmd->add_option("--out", p->out, "write the placement as JSON (phy2log/log2phy/logcnt)");
  plan_cmd->add_option("--omni-out", p->omni_out,
                       "write the placement as Omni's [ranks, layers, experts] 0/1 .npy");
  plan_cmd->callback([p] { run_plan(*p); });

  auto s = std::make_shared<ShowArgs>();
  auto* show_cmd =
      place->add_subcommand("show", "Read a placement (.json or Omni .npy) and describe it");
  show_cmd->add_option("placement", s->placement, "placement file")
      ->required()
      ->check(CLI::ExistingFile);
  show_cmd->add_option("--loads", s->loads, "also show its balance under these loads");
  show_cmd->add_option("--out", s->out, "write it as JSON");
  show_cmd->add_option("--omni-out", s->omni_out, "write it as an Omni .npy pattern");
  show_cmd->callback([s] { run_show(*s); });

  auto m = std::make_shared<SimulateArgs>();
  auto* sim_cmd = place->add_subcommand(
      "simulate", "Replay load snapshots with periodic rebalancing: imbalance and moves over time");
  sim_cmd
      ->add_option("--loads", m->loads,
                   "snapshots: a folder of .npy files, or a .npy [snapshots, layers, experts]")
      ->required();
  add_shape_options(sim_cmd, m->shape);
  sim_cmd
      ->add_option("--algorithm", m->algorithm, "planner of the fresh plans: " + algorithm_names())
      ->capture_default_str();
  sim_cmd->add_option("--every", m->every, "rebalance every this many snapshots")
      ->capture_default_str();
  sim_cmd
      ->add_option("--min-gain", m->min_gain,
                   "incremental: leave a layer alone unless a fresh plan lowers its busiest "
                   "rank by more than this share")
      ->capture_default_str();
  sim_cmd->callback([m] { run_simulate(*m); });
}

}  // namespace tandem::cli
