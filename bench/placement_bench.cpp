// Omni Placement next to DeepSeek's EPLB at DeepSeek-V3's shape (58 MoE layers x 256 experts,
// 8 routed per token), driven by bench/placement.sh in three phases:
//   --phase write:  load sets (.npy) and the EPLB cases (cases.json) into --dir;
//   --phase time:   this library's planning times for every case (tandem_round_<K>.json), run
//                   alternately with DeepSeek's eplb.py (bench/eplb_reference.py);
//   --phase report: the tables: same slots per layer as EPLB (balance, plan time, agreement with
//                   eplb.py), the same total memory spread layer-wise / evenly / to the worst
//                   layers, and rebalancing under drift (moves and balance, incremental vs fresh).
// Metrics: mean over layers of max/mean rank load, the worst layer, the step proxy (sum over
// layers of the busiest rank's load over the sum of mean rank loads; 1.0 is perfect).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <random>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "engine/executor/sim_expert_parallel.h"
#include "engine/executor/sim_latency.h"
#include "placement/eplb.h"
#include "placement/files.h"
#include "placement/placement_format.h"
#include "placement/planner.h"
#include "placement/routing_skew.h"
#include "util/error.h"
#include "util/file.h"
#include "util/npy.h"

namespace {

namespace fs = std::filesystem;
using namespace tandem;
using namespace tandem::placement;
using nlohmann::json;

constexpr int64_t kLayers = 58, kExperts = 256, kTopK = 8, kTokens = 8192, kDriftEvery = 4;

struct LoadSet {
  std::string name, what;
};
// Token routes drawn from per-layer Zipf popularities: "routed" sets pick a token's 8 experts
// distinct (as routing does, so an expert gets at most one route per token); "zipf" sets draw
// every route on its own, so the loads follow the Zipf law however hot its head (strongly skewed).
const LoadSet kLoadSets[] = {
    {"zipf-by-layer", "Zipf alpha 0.6..1.4 differing by layer, routes drawn independently"},
    {"zipf-uniform", "Zipf alpha 1.0 in every layer, routes drawn independently"},
    {"routed-by-layer", "Zipf alpha 0.6..1.4 differing by layer, 8 distinct experts per token"},
    {"routed-uniform", "Zipf alpha 1.0 in every layer, 8 distinct experts per token"},
};

struct Shape {
  int ranks;
  int64_t redundant_per_layer;
};
const Shape kShapes[] = {{32, 32}, {32, 64}, {64, 64}};

std::vector<int64_t> rounded(const ExpertLoads& l) {
  std::vector<int64_t> v;
  for (double x : l.values) v.push_back(int64_t(std::llround(x)));
  return v;
}

void write_loads(const fs::path& path, const ExpertLoads& l) {
  write_npy(path, {l.layers, l.experts}, rounded(l));
}

SkewOptions skew_of(const std::string& set, uint64_t seed) {
  SkewOptions o;
  o.top_k = kTopK;
  o.seed = seed;
  if (set.find("by-layer") != std::string::npos) o.alpha_lo = 0.6, o.alpha_hi = 1.4;
  o.distinct = set.rfind("routed", 0) == 0;
  return o;
}

std::vector<std::string> load_set_names(const fs::path& dir) {
  std::vector<std::string> sets;
  for (const LoadSet& s : kLoadSets) sets.push_back(s.name);
  if (fs::exists(dir / "recorded.npy")) sets.push_back("recorded");
  return sets;
}

struct EplbCase {
  std::string name, loads;
  int64_t replicas, groups, nodes, gpus;
};

std::vector<EplbCase> eplb_cases(const fs::path& dir) {
  std::vector<EplbCase> cases;
  for (const std::string& set : load_set_names(dir))
    for (const Shape& s : kShapes) {
      const std::string base =
          set + "/" + std::to_string(s.ranks) + "r+" + std::to_string(s.redundant_per_layer);
      const std::string loads = (dir / (set + ".npy")).string();
      const int64_t experts = set == "recorded" ? read_loads(loads).experts : kExperts;
      const int64_t replicas = experts + s.redundant_per_layer;
      if (replicas % s.ranks) continue;
      cases.push_back({base + "/global", loads, replicas, 1, 1, s.ranks});
      if (experts % 8 == 0)
        cases.push_back({base + "/hierarchical", loads, replicas, 8, s.ranks / 8, s.ranks});
    }
  return cases;
}

Placement run_ours(const EplbCase& c, const ExpertLoads& loads) {
  return eplb_rebalance(loads, {c.replicas, c.groups, c.nodes, c.gpus});
}

Placement run_omni_even(const EplbCase& c, const ExpertLoads& loads) {
  PlanOptions o;
  o.ranks = int(c.gpus);
  o.redundant_slots = (c.replicas - loads.experts) * loads.layers;
  o.allocation = Allocation::kEven;
  return plan(loads, o).placement;
}

template <class F>
double median_seconds(int runs, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < runs; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void phase_write(const fs::path& dir, const std::string& recorded) {
  fs::create_directories(dir);
  for (const LoadSet& set : kLoadSets) {
    RoutingSkew skew(kLayers, kExperts, skew_of(set.name, 7));
    std::mt19937_64 rng(11);
    write_loads(dir / (set.name + ".npy"), skew.sample(kTokens, rng));
  }
  // Drift: 24 snapshots (rebalancing periods); every kDriftEvery of them, a quarter of the 32
  // hottest experts of every layer trade places with colder ones.
  RoutingSkew skew(kLayers, kExperts, skew_of("routed-by-layer", 9));
  std::mt19937_64 rng(13);
  std::vector<int64_t> all;
  const int64_t snapshots = 24;
  for (int64_t t = 0; t < snapshots; ++t) {
    if (t > 0 && t % kDriftEvery == 0) skew.drift(0.25, 32, rng);
    const std::vector<int64_t> v = rounded(skew.sample(kTokens, rng));
    all.insert(all.end(), v.begin(), v.end());
  }
  write_npy(dir / "drift.npy", {snapshots, kLayers, kExperts}, all);
  if (!recorded.empty())
    fs::copy_file(recorded, dir / "recorded.npy", fs::copy_options::overwrite_existing);
  json cases = json::array();
  for (const EplbCase& c : eplb_cases(dir))
    cases.push_back({{"name", c.name},
                     {"loads", c.loads},
                     {"replicas", c.replicas},
                     {"groups", c.groups},
                     {"nodes", c.nodes},
                     {"gpus", c.gpus}});
  write_file_atomically(dir / "cases.json", json{{"cases", cases}}.dump(1));
  std::printf("wrote load sets and %zu EPLB cases to %s\n", cases.size(), dir.c_str());
}

void phase_time(const fs::path& dir, int round) {
  json out = json::object();
  for (const EplbCase& c : eplb_cases(dir)) {
    const ExpertLoads loads = read_loads(c.loads);
    out[c.name] = {{"eplb", median_seconds(5, [&] { run_ours(c, loads); })},
                   {"omni_even", median_seconds(5, [&] { run_omni_even(c, loads); })}};
  }
  write_file_atomically(dir / ("tandem_round_" + std::to_string(round) + ".json"), out.dump(1));
}

double median(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

Placement from_phy2log(const json& rows, int ranks, int64_t experts) {
  Placement p{ranks, experts, {}};
  for (const auto& row : rows) {
    std::vector<std::vector<int32_t>> layer(ranks);
    const size_t per = row.size() / size_t(ranks);
    for (size_t s = 0; s < row.size(); ++s) layer[s / per].push_back(row[s].get<int32_t>());
    p.layers.push_back(std::move(layer));
  }
  return p;
}

void report_same_slots(const fs::path& dir) {
  // Rounds of both sides, medians.
  std::map<std::string, std::vector<double>> ours_eplb, ours_omni, theirs;
  std::map<std::string, json> their_plans;
  int eplb_rounds = 0;
  std::string torch;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("tandem_round_", 0) == 0) {
      const json j = json::parse(read_file(entry.path()));
      for (const auto& [k, v] : j.items()) {
        ours_eplb[k].push_back(v["eplb"]);
        ours_omni[k].push_back(v["omni_even"]);
      }
    } else if (name.rfind("eplb_round_", 0) == 0) {
      ++eplb_rounds;
      const json j = json::parse(read_file(entry.path()));
      torch = j.value("torch", "");
      for (const auto& c : j["cases"]) {
        theirs[c["name"]].push_back(c["seconds"]);
        their_plans[c["name"]] = c["phy2log"];
      }
    }
  }
  std::printf(
      "\n## Same slots in every layer as EPLB (planning times: medians of alternating rounds)\n");
  if (eplb_rounds == 0)
    std::printf(
        "EPLB REFERENCE ABSENT: no eplb.py results (see bench/placement.sh); rows marked "
        "eplb.py are missing\n");
  else
    std::printf("eplb.py: %d rounds, PyTorch %s, one thread\n", eplb_rounds, torch.c_str());
  std::printf("%-34s %-22s %10s %10s %8s %10s %9s %9s\n", "case", "planner", "step proxy",
              "mean max/m", "worst", "plan ms", "speedup", "agree");
  for (const EplbCase& c : eplb_cases(dir)) {
    const ExpertLoads loads = read_loads(c.loads);
    const Balance none = evaluate(loads, no_redundancy(loads.layers, loads.experts, int(c.gpus)));
    const Placement ours = run_ours(c, loads), omni = run_omni_even(c, loads);
    const auto row = [&](const char* who, const Balance& b, double ms, const std::string& speed,
                         const std::string& agree) {
      std::printf("%-34s %-22s %10.4f %10.4f %8.3f %10s %9s %9s\n", c.name.c_str(), who,
                  b.step_proxy, b.mean_ratio, b.worst_ratio,
                  ms < 0 ? "-" : (std::to_string(ms).substr(0, 7)).c_str(), speed.c_str(),
                  agree.c_str());
    };
    row("none", none, -1, "", "");
    const double their_ms = median(theirs[c.name]) * 1e3;
    std::optional<Placement> ref;
    if (their_plans.count(c.name)) {
      ref = from_phy2log(their_plans[c.name], int(c.gpus), loads.experts);
      row("eplb.py (DeepSeek)", evaluate(loads, *ref), their_ms, "1.0x", "");
    }
    // Agreement: layers whose ranks carry the same loads (sorted). phy2log itself differs where
    // PyTorch's unstable sort orders experts of equal load differently; the loads do not.
    std::string agree = "-";
    if (ref) {
      int same = 0;
      for (int64_t l = 0; l < loads.layers; ++l) {
        std::vector<double> a = rank_loads(loads.row(l), ours.layers[l], loads.experts);
        std::vector<double> b = rank_loads(loads.row(l), ref->layers[l], loads.experts);
        std::sort(a.begin(), a.end());
        std::sort(b.begin(), b.end());
        bool equal = true;
        for (size_t i = 0; i < a.size(); ++i) equal &= std::abs(a[i] - b[i]) <= 1e-6 * (1 + b[i]);
        same += equal;
      }
      agree = std::to_string(same) + "/" + std::to_string(loads.layers);
    }
    const double eplb_ms = median(ours_eplb[c.name]) * 1e3,
                 omni_ms = median(ours_omni[c.name]) * 1e3;
    const auto speed = [&](double ms) {
      if (!ref || ms <= 0) return std::string("-");
      char b[32];
      std::snprintf(b, sizeof b, "%.0fx", their_ms / ms);
      return std::string(b);
    };
    row("EPLB in C++ (ours)", evaluate(loads, ours), eplb_ms, speed(eplb_ms), agree);
    const Balance bo = evaluate(loads, omni);
    row("omni, same slots", bo, omni_ms, speed(omni_ms), "");
    if (ref)
      std::printf(
          "%-34s omni / eplb.py step proxy %.4f (target <= 1.01), plan %.2f ms (target <= 10)\n",
          "", bo.step_proxy / evaluate(loads, *ref).step_proxy, omni_ms);
  }
}

void report_layer_wise(const fs::path& dir) {
  std::printf(
      "\n## Same total memory: the redundant budget layer-wise, evenly, or to the worst layers\n");
  std::printf("%-16s %5s %8s %6s %12s %12s %12s %10s %10s %8s\n", "loads", "ranks", "budget",
              "share", "even", "worst-layers", "layer-wise", "vs even", "vs worst", "plan ms");
  for (const std::string& set : load_set_names(dir)) {
    const ExpertLoads loads = read_loads(dir / (set + ".npy"));
    const int64_t base = loads.layers * loads.experts;
    for (int ranks : {32, 64})
      for (double share : {0.02, 0.05, 0.10, 0.20}) {
        // Rounded to whole slots per rank (equal expert memory on every rank).
        int64_t budget = int64_t(std::llround(share * double(base) / ranks)) * ranks;
        budget -= (base + budget) % ranks;
        if (share == 0.02 && ranks == 32 && loads.experts == kExperts)
          budget = 320;  // Omni's pattern
        PlanOptions o;
        o.ranks = ranks;
        o.redundant_slots = budget;
        double proxy[3], ms = 0;
        const Allocation order[3] = {Allocation::kEven, Allocation::kWorstLayers,
                                     Allocation::kLayerWise};
        for (int i = 0; i < 3; ++i) {
          o.allocation = order[i];
          Placement p;
          const double t = median_seconds(i == 2 ? 3 : 1, [&] { p = plan(loads, o).placement; });
          if (i == 2) ms = t * 1e3;
          validate(p);
          proxy[i] = evaluate(loads, p).step_proxy;
        }
        std::printf("%-16s %5d %8lld %5.1f%% %12.4f %12.4f %12.4f %9.1f%% %9.1f%% %8.1f\n",
                    set.c_str(), ranks, static_cast<long long>(budget),
                    100.0 * double(budget) / double(base), proxy[0], proxy[1], proxy[2],
                    100.0 * (1 - proxy[2] / proxy[0]), 100.0 * (1 - proxy[2] / proxy[1]), ms);
      }
  }
  std::printf(
      "(vs even / vs worst: how much lower the layer-wise step proxy is; target >= 5%% on "
      "skew that differs by layer, >= 0 on uniform skew)\n");
}

void report_drift(const fs::path& dir) {
  std::printf(
      "\n## Rebalancing under drift (routed-by-layer loads, 24 snapshots; every %lld, a "
      "quarter of the 32 hottest experts of each layer change; each period is planned from "
      "the snapshot before it)\n",
      static_cast<long long>(kDriftEvery));
  const std::vector<ExpertLoads> snaps = read_load_snapshots(dir / "drift.npy");
  std::printf("%5s %8s %12s %12s %12s %12s %14s %12s\n", "ranks", "budget", "proxy fresh",
              "proxy incr.", "moves fresh", "moves relab.", "moves incr.", "fewer moves");
  for (int ranks : {32, 64}) {
    PlanOptions o;
    o.ranks = ranks;
    o.redundant_slots = 32 * kLayers;
    o.allocation = Allocation::kEven;
    Placement fresh = plan(snaps[0], o).placement, inc = fresh;
    double pf = 0, pi = 0;
    int64_t mf = 0, ma = 0, mi = 0;
    for (size_t t = 1; t + 1 < snaps.size(); ++t) {
      Placement next = plan(snaps[t], o).placement;
      mf += count_moves(fresh, next);
      Placement aligned = align_to_current(fresh, next);
      ma += count_moves(fresh, aligned);
      fresh = std::move(aligned);
      IncrementalPlan ip = plan_incremental(snaps[t], inc, {});
      mi += ip.moves;
      inc = std::move(ip.placement);
      pf += evaluate(snaps[t + 1], fresh).step_proxy;
      pi += evaluate(snaps[t + 1], inc).step_proxy;
    }
    const double n = double(snaps.size() - 2);
    std::printf("%5d %8lld %12.4f %12.4f %12lld %12lld %14lld %11.0f%%\n", ranks,
                static_cast<long long>(o.redundant_slots), pf / n, pi / n,
                static_cast<long long>(mf), static_cast<long long>(ma), static_cast<long long>(mi),
                100.0 * (1 - double(mi) / double(mf)));
  }
  std::printf(
      "(target: >= 50%% fewer moves than re-planning from scratch, proxy no more than 1%% "
      "worse; 'relab.' is the fresh plan with its ranks relabeled to keep what they hold)\n");
}

void report_simulated_decode() {
  std::printf(
      "\n## Simulated decode step (sim:deepseek-v3-h800, 32 expert-parallel ranks of 64 sequences "
      "at 4K context, MoE half of a balanced step)\n");
  const auto model = tandem::engine::SimLatencyModel::preset("deepseek-v3-h800");
  tandem::engine::StepShape shape;
  shape.decode_seqs = shape.decode_tokens = 64;
  shape.decode_context_tokens = 64 * 4096;
  const double balanced = model.step_seconds(shape);
  std::printf("%-16s %-44s %10s %10s\n", "skew", "placement", "step ms", "imbalance");
  for (const char* set : {"zipf-by-layer", "routed-by-layer"}) {
    // Placements planned from a window of 8192 tokens of the skew, judged on 100 decode steps
    // of fresh routes (the group's 32 x 64 tokens each).
    const SkewOptions skew = skew_of(set, 21);
    RoutingSkew window_model(kLayers, kExperts, skew);
    std::mt19937_64 rng(5);
    const ExpertLoads window = window_model.sample(kTokens, rng);
    const auto omni = [&](int64_t redundant) {
      PlanOptions o;
      o.ranks = 32;
      o.redundant_slots = redundant;
      return plan(window, o).placement;
    };
    const std::pair<const char*, std::optional<Placement>> placements[] = {
        {"none (experts in order)", std::nullopt},
        {"EPLB, 256 slots per layer (rearranged)",
         eplb_rebalance(window, {.replicas = 256, .gpus = 32})},
        {"Omni, 320 redundant slots in all (2.2%)", omni(320)},
        {"EPLB, 288 slots per layer (1856 redundant)",
         eplb_rebalance(window, {.replicas = 288, .gpus = 32})},
        {"Omni, 1856 redundant slots in all", omni(32 * kLayers)},
    };
    for (const auto& [name, p] : placements) {
      tandem::engine::SimExpertParallelOptions o;
      o.ranks = 32;
      o.skew = skew;
      o.placement = p;
      tandem::engine::SimExpertParallel ep(kLayers, kExperts, o);
      double factor = 0, imbalance = 0;
      const int steps = 100;
      for (int i = 0; i < steps; ++i) {
        const auto s = ep.step(64);
        factor += s.factor;
        imbalance += s.imbalance;
      }
      std::printf("%-16s %-44s %10.2f %10.3f\n", set, name, 1e3 * balanced * factor / steps,
                  imbalance / steps);
    }
  }
  std::printf(
      "(balanced step: %.2f ms; a step's routes are the group's, 32 ranks x 64 tokens x 8, "
      "with the noise of multinomial counts)\n",
      1e3 * balanced);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Omni Placement next to DeepSeek's EPLB (see bench/placement.sh)"};
  std::string dir, phase, recorded;
  int round = 1;
  app.add_option("--dir", dir, "work folder for load sets and results")->required();
  app.add_option("--phase", phase, "write, time or report")->required();
  app.add_option("--recorded", recorded, "with write: loads recorded from Tandem's engine (.npy)");
  app.add_option("--round", round, "with time: the round number");
  CLI11_PARSE(app, argc, argv);
  try {
    if (phase == "write")
      phase_write(dir, recorded);
    else if (phase == "time")
      phase_time(dir, round);
    else if (phase == "report") {
      report_same_slots(dir);
      report_layer_wise(dir);
      report_drift(dir);
      report_simulated_decode();
    } else
      throw tandem::Error("--phase: want write, time or report");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem-bench-placement: %s\n", e.what());
    return 1;
  }
  return 0;
}
