// Placement planners: EPLB reproduced from its README, constraints and balance properties of the
// Omni planner on random loads, incremental rebalancing, the file formats.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>

#include "engine/expert_load.h"
#include "placement/eplb.h"
#include "placement/files.h"
#include "placement/placement_format.h"
#include "placement/planner.h"
#include "placement/routing_skew.h"
#include "util/error.h"
#include "util/file.h"
#include "util/npy.h"

namespace tandem::placement {
namespace {

ExpertLoads zipf_loads(int64_t layers, int64_t experts, uint32_t seed, double alpha_lo,
                       double alpha_hi) {
  std::mt19937 rng(seed);
  ExpertLoads loads{layers, experts, {}};
  for (int64_t l = 0; l < layers; ++l) {
    const double alpha =
        alpha_lo + (alpha_hi - alpha_lo) * double(l) / double(std::max<int64_t>(1, layers - 1));
    std::vector<int64_t> perm(experts);
    for (int64_t e = 0; e < experts; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<double> row(experts);
    for (int64_t e = 0; e < experts; ++e)
      row[perm[e]] = std::floor(10000.0 / std::pow(double(e + 1), alpha));
    loads.values.insert(loads.values.end(), row.begin(), row.end());
  }
  return loads;
}

TEST(Eplb, ReproducesTheReadmeExample) {
  const ExpertLoads loads{2, 12, {90, 132, 40,  61, 104, 165, 39,  4,   73,  56, 183, 86,
                                  20, 107, 104, 64, 19,  197, 187, 157, 172, 86, 16,  27}};
  const Placement p = eplb_rebalance(loads, {.replicas = 16, .groups = 4, .nodes = 2, .gpus = 8});
  EXPECT_EQ(p.phy2log(0),
            (std::vector<int32_t>{5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1}));
  EXPECT_EQ(p.phy2log(1), (std::vector<int32_t>{7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1}));
  EXPECT_EQ(p.logcnt(0), (std::vector<int32_t>{1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1}));
}

TEST(Eplb, FallsBackToTheGlobalPolicyWhenNodesDoNotDivideGroups) {
  const ExpertLoads loads = zipf_loads(3, 24, 7, 1.0, 1.0);
  const Placement global =
      eplb_rebalance(loads, {.replicas = 32, .groups = 3, .nodes = 2, .gpus = 8});
  const Placement one = eplb_rebalance(loads, {.replicas = 32, .groups = 1, .nodes = 1, .gpus = 8});
  EXPECT_EQ(global.layers, one.layers);
  validate(global, Constraints{.distinct_on_rank = false});
}

TEST(Eplb, RejectsSlotsThatDoNotDivideOverRanks) {
  const ExpertLoads loads = zipf_loads(1, 16, 1, 1.0, 1.0);
  EXPECT_THROW(eplb_rebalance(loads, {.replicas = 18, .gpus = 4}), Error);
  EXPECT_THROW(eplb_rebalance(loads, {.replicas = 8, .gpus = 4}), Error);
}

TEST(Planner, EveryAllocationKeepsTheConstraintsOnRandomLoads) {
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    const ExpertLoads loads = zipf_loads(6, 64, seed, 0.4, 1.6);
    for (Allocation a : {Allocation::kLayerWise, Allocation::kEven, Allocation::kWorstLayers}) {
      const int ranks = seed % 2 ? 8 : 16;
      const Plan plan_result = plan(
          loads, {.ranks = ranks, .redundant_slots = 3 * ranks + ranks / 2 * 2, .allocation = a});
      SCOPED_TRACE("seed " + std::to_string(seed) + " allocation " + std::to_string(int(a)));
      EXPECT_NO_THROW(validate(plan_result.placement));
      int64_t total = 0;
      for (int64_t r : plan_result.redundant_per_layer) total += r;
      EXPECT_EQ(total, 3 * ranks + ranks / 2 * 2);
      const Balance none = evaluate(loads, no_redundancy(6, 64, ranks));
      EXPECT_LE(evaluate(loads, plan_result.placement).step_proxy, none.step_proxy);
    }
  }
}

TEST(Planner, UnevenLayerSlotsStillGiveEveryRankTheSameMemory) {
  const ExpertLoads loads = zipf_loads(5, 32, 3, 0.5, 1.5);
  // 5 * 32 + 12 = 172 slots over 4 ranks: some layers have slots that do not divide evenly.
  const Plan p = plan(loads, {.ranks = 4, .redundant_slots = 12});
  const std::vector<int64_t> per_rank = p.placement.slots_per_rank();
  for (int64_t s : per_rank) EXPECT_EQ(s, 43);
  EXPECT_NO_THROW(validate(p.placement));
}

TEST(Planner, LayerWiseAllocationGivesTheSkewedLayersTheBudget) {
  ExpertLoads loads = zipf_loads(4, 32, 5, 0.0, 0.0);  // flat layers
  const ExpertLoads hot = zipf_loads(1, 32, 9, 1.4, 1.4);
  std::copy(hot.values.begin(), hot.values.end(), loads.values.begin() + 2 * 32);
  const Plan p = plan(loads, {.ranks = 8, .redundant_slots = 16});
  EXPECT_EQ(p.redundant_per_layer[2], 16);
  const Plan even =
      plan(loads, {.ranks = 8, .redundant_slots = 16, .allocation = Allocation::kEven});
  EXPECT_LT(evaluate(loads, p.placement).step_proxy, evaluate(loads, even.placement).step_proxy);
}

TEST(Planner, NeverWorseThanEvenOnUniformSkew) {
  const ExpertLoads loads = zipf_loads(8, 64, 11, 1.0, 1.0);
  const Plan wise = plan(loads, {.ranks = 8, .redundant_slots = 64});
  const Plan even =
      plan(loads, {.ranks = 8, .redundant_slots = 64, .allocation = Allocation::kEven});
  EXPECT_LE(evaluate(loads, wise.placement).step_proxy,
            evaluate(loads, even.placement).step_proxy * 1.005);
}

TEST(Planner, HostsGetDistinctCopiesFirst) {
  const ExpertLoads loads = zipf_loads(2, 32, 4, 1.5, 1.5);
  const std::vector<int> hosts = {0, 0, 0, 0, 1, 1, 1, 1};
  const Plan p = plan(loads, {.ranks = 8, .redundant_slots = 16, .host_of_rank = hosts});
  int doubled = 0;
  for (const auto& layer : p.placement.layers)
    for (int32_t e = 0; e < 32; ++e) {
      int copies = 0, host0 = 0;
      for (int r = 0; r < 8; ++r)
        for (int32_t x : layer[r])
          if (x == e) ++copies, host0 += hosts[r] == 0;
      if (copies == 2) {
        EXPECT_EQ(host0, 1) << "expert " << e;
        ++doubled;
      }
    }
  EXPECT_GT(doubled, 0);
}

TEST(Planner, IsDeterministic) {
  const ExpertLoads loads = zipf_loads(6, 64, 21, 0.6, 1.4);
  const PlanOptions o{.ranks = 16, .redundant_slots = 32};
  EXPECT_EQ(plan(loads, o).placement.layers, plan(loads, o).placement.layers);
}

TEST(Planner, MatchesEplbBalanceWithTheSameSlotsPerLayer) {
  const ExpertLoads loads = zipf_loads(10, 64, 2, 0.6, 1.4);
  const Placement eplb = eplb_rebalance(loads, {.replicas = 80, .gpus = 16});
  const Plan ours =
      plan(loads, {.ranks = 16, .redundant_slots = 160, .allocation = Allocation::kEven});
  EXPECT_LE(evaluate(loads, ours.placement).step_proxy, evaluate(loads, eplb).step_proxy * 1.01);
}

TEST(Planner, RefusesLoadsWhoseSumIsNotFiniteNamingTheSource) {
  // Every load finite, their sum not: the knapsack once compared inf against inf and said the
  // budget "cannot be allocated".
  ExpertLoads huge{2, 4, {1e308, 1e308, 1, 1, 1, 1, 1, 1}};
  try {
    validate(huge, "loads.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("loads.json: expert loads up to layer 0 sum past the "
                                         "largest double"),
              std::string::npos)
        << e.what();
  }
  huge.values = {1e308, 1, 1, 1, 1e308, 1, 1, 1};
  EXPECT_THROW(validate(huge, "loads.json"), Error);
  try {
    plan(huge, {.ranks = 2, .redundant_slots = 2});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sum past the largest double"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(validate(ExpertLoads{1, 2, {1e307, 1e307}}, "loads.json"));
}

TEST(Planner, RejectsBadInputNamingTheField) {
  const ExpertLoads loads = zipf_loads(2, 16, 1, 1.0, 1.0);
  EXPECT_THROW(plan(loads, {.ranks = 32}), Error);                       // more ranks than experts
  EXPECT_THROW(plan(loads, {.ranks = 4, .redundant_slots = 3}), Error);  // uneven rank memory
  ExpertLoads negative = loads;
  negative.values[5] = -1;
  try {
    plan(negative, {.ranks = 4});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert 5"), std::string::npos) << e.what();
  }
  ExpertLoads short_loads = loads;
  short_loads.values.pop_back();
  EXPECT_THROW(plan(short_loads, {.ranks = 4}), Error);
  // A budget past one copy everywhere is named as such, not wrapped into a negative slot total.
  try {
    plan(loads, {.ranks = 2, .redundant_slots = std::numeric_limits<int64_t>::max()});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exceed one copy of every expert on every rank (at most "
                                         "32)"),
              std::string::npos)
        << e.what();
  }
}

// The layer-wise knapsack's size depends on the budget, the ranks and the layers alone: a budget
// too large for it is refused up front (not after every layer's cost curve, a minute for
// DeepSeek-V3's 58 layers on 256 ranks), naming the flags that set the budget and the largest
// that fits.
TEST(Planner, ABudgetTooLargeForTheLayerWiseAllocationIsRefusedNamingTheFlags) {
  const ExpertLoads loads = zipf_loads(58, 256, 3, 0.8, 1.2);
  const int64_t budget = 58 * (1024 - 256);  // --slots 1024
  try {
    plan(loads, {.ranks = 256, .redundant_slots = budget});
    FAIL() << "a budget of " << budget << " was planned layer-wise";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("44544 slots"), std::string::npos) << what;
    EXPECT_NE(what.find("--redundant"), std::string::npos) << what;
    EXPECT_NE(what.find("--slots"), std::string::npos) << what;
    EXPECT_NE(what.find("omni-even"), std::string::npos) << what;
    // The values named are ones the ranks take: 58 layers' slots divide over 256 ranks.
    const auto named = [&](const std::string& flag) {
      const size_t at = what.find(flag + " ");
      return at == std::string::npos ? -1 : std::stoll(what.substr(at + flag.size() + 1));
    };
    const int64_t redundant = named("--redundant"), slots = named("--slots");
    EXPECT_EQ((58 * 256 + redundant) % 256, 0) << what;
    EXPECT_EQ(58 * slots % 256, 0) << what;
    EXPECT_LE(58 * (slots - 256), redundant) << what;
  }
}

TEST(Incremental, MovesNoMoreThanAFreshPlanAndStaysWithinTolerance) {
  for (uint32_t seed = 1; seed <= 5; ++seed) {
    const ExpertLoads before = zipf_loads(6, 64, seed, 0.6, 1.4);
    const ExpertLoads after = zipf_loads(6, 64, seed + 100, 0.6, 1.4);
    const PlanOptions o{.ranks = 16, .redundant_slots = 6 * 16, .allocation = Allocation::kEven};
    const Placement current = plan(before, o).placement;
    const Placement fresh = plan(after, o).placement;
    const IncrementalPlan inc = plan_incremental(after, current, {});
    EXPECT_NO_THROW(validate(inc.placement));
    EXPECT_EQ(inc.moves, count_moves(current, inc.placement));
    EXPECT_LE(inc.moves, count_moves(current, fresh));
    EXPECT_GT(inc.layers_changed, 0);
    const Balance b = evaluate(after, inc.placement), f = evaluate(after, fresh);
    for (int64_t l = 0; l < 6; ++l)
      EXPECT_LE(b.layers[l].max_rank_load, f.layers[l].max_rank_load * 1.021) << "layer " << l;
  }
}

TEST(Incremental, LeavesABalancedPlacementAlone) {
  const ExpertLoads loads = zipf_loads(4, 32, 3, 1.0, 1.0);
  const Placement current = plan(loads, {.ranks = 8, .redundant_slots = 32}).placement;
  const IncrementalPlan inc = plan_incremental(loads, current, {});
  EXPECT_EQ(inc.moves, 0);
  EXPECT_EQ(inc.placement.layers, current.layers);
}

// A random placement an engine accepts: distinct experts per rank, every expert somewhere, and
// slot counts per rank that differ rank by rank and layer by layer (drained ranks included).
Placement random_valid_placement(std::mt19937& rng, int ranks, int64_t experts, int64_t layers) {
  Placement p{ranks, experts, {}};
  std::uniform_int_distribution<int64_t> cap_of(0, experts);
  for (int64_t l = 0; l < layers; ++l) {
    std::vector<int64_t> cap(ranks);
    int64_t total = 0;
    do {
      total = 0;
      for (int64_t& c : cap) total += c = cap_of(rng);
    } while (total < experts);
    std::vector<std::vector<int32_t>> layer(ranks);
    std::vector<int32_t> order(experts);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int32_t e : order) {  // one copy of each expert, on a random rank with room
      std::vector<int> room;
      for (int r = 0; r < ranks; ++r)
        if (int64_t(layer[r].size()) < cap[r]) room.push_back(r);
      layer[room[rng() % room.size()]].push_back(e);
    }
    for (int r = 0; r < ranks; ++r) {  // the rest of each rank's slots: experts it lacks
      std::shuffle(order.begin(), order.end(), rng);
      for (int32_t e : order)
        if (int64_t(layer[r].size()) < cap[r] &&
            std::find(layer[r].begin(), layer[r].end(), e) == layer[r].end())
          layer[r].push_back(e);
    }
    p.layers.push_back(std::move(layer));
  }
  return p;
}

TEST(Incremental, PlansEveryValidPlacementWithUnevenSlotsPerRank) {
  // What the incremental planner promises for any slot counts: distinct copies on every rank
  // (the engine would also serve two on one rank, as EPLB packs them).
  const Constraints engine{.distinct_on_rank = true, .equal_rank_memory = false};
  std::mt19937 rng(7);
  int changed = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    const int ranks = 2 + int(rng() % 7);
    const int64_t experts = 1 + int64_t(rng() % 12);
    const int64_t layers = 1 + int64_t(rng() % 3);
    const Placement current = random_valid_placement(rng, ranks, experts, layers);
    ASSERT_NO_THROW(validate(current, engine));
    ExpertLoads loads = zipf_loads(layers, experts, rng(), 0.0, 2.5);
    if (trial % 5 == 0) loads.values.assign(loads.values.size(), 0.0);
    std::vector<int> hosts;
    if (trial % 3 == 0)
      for (int r = 0; r < ranks; ++r) hosts.push_back(r % 2);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + std::to_string(ranks) + " ranks, " +
                 std::to_string(experts) + " experts");
    IncrementalPlan inc;
    ASSERT_NO_THROW(inc = plan_incremental(loads, current, hosts));
    ASSERT_NO_THROW(validate(inc.placement, engine));
    ASSERT_EQ(inc.placement.num_layers(), layers);
    for (int64_t l = 0; l < layers; ++l)
      for (int r = 0; r < ranks; ++r)
        ASSERT_EQ(inc.placement.layers[l][r].size(), current.layers[l][r].size())
            << "layer " << l << " rank " << r;
    EXPECT_EQ(inc.moves, count_moves(current, inc.placement));
    // No layer ends busier than it was.
    const Balance before = evaluate(loads, current), after = evaluate(loads, inc.placement);
    for (int64_t l = 0; l < layers; ++l)
      EXPECT_LE(after.layers[l].max_rank_load, before.layers[l].max_rank_load * (1 + 1e-9))
          << "layer " << l;
    changed += inc.moves > 0;
  }
  EXPECT_GT(changed, 100);  // the loads left most placements room to improve
}

TEST(Placement, ChecksAndMoveCountsFollowEveryCopy) {
  // A second copy far from the first on its rank is found; on another rank it is allowed.
  Placement p{2, 4, {{{0, 1, 2, 0}, {3, 0}}}};
  EXPECT_THROW(validate(p), Error);
  EXPECT_NO_THROW(validate(p, {.distinct_on_rank = false, .equal_rank_memory = false}));
  p.layers[0][0].back() = 3;
  EXPECT_NO_THROW(validate(p, {.distinct_on_rank = true, .equal_rank_memory = false}));
  // Slot order is free; an expert new to a rank counts once however many copies of it the rank
  // gets, and a further copy of one the rank holds counts none: the engine holds one set of an
  // expert's weights per rank (EpRank::prepare_placement loads it once). A rank the old
  // placement lacks loads everything it holds.
  const std::vector<std::vector<int32_t>> from = {{0, 1, 1}, {2, 3}};
  EXPECT_EQ(count_layer_moves(from, {{1, 0, 1}, {3, 2}}), 0);
  EXPECT_EQ(count_layer_moves(from, {{1, 1, 1}, {3, 2}}), 0);
  EXPECT_EQ(count_layer_moves(from, {{0, 0, 1}, {3, 2}}), 0);
  EXPECT_EQ(count_layer_moves(from, {{0, 1, 1}, {2, 3, 0, 0}}), 1);
  EXPECT_EQ(count_layer_moves(from, {{0, 2, 3}, {2, 3}}), 2);
  EXPECT_EQ(count_layer_moves(from, {{0, 1, 1}, {2, 3}, {0, 1}}), 2);
  EXPECT_EQ(count_layer_moves({{0}, {1}}, {{1}, {0}}), 2);
}

TEST(Placement, LargeLayersAreCheckedInLinearTime) {
  // One rank holding 2^20 experts (an Omni pattern of one rank): a search per copy over the
  // rank's copies so far would not finish within the test's time limit.
  const int64_t experts = int64_t(1) << 20;
  std::vector<int32_t> all(experts);
  std::iota(all.begin(), all.end(), 0);
  Placement p{1, experts, {{all}}};
  EXPECT_NO_THROW(validate(p));
  std::vector<int32_t> reversed(all.rbegin(), all.rend());
  EXPECT_EQ(count_layer_moves(p.layers[0], {reversed}), 0);
  // A second copy of an expert the rank holds loads nothing; from a rank holding only expert 0
  // (now gone), experts 1..E-1 load once each, E-1 twice as it is.
  reversed.back() = reversed.front();
  EXPECT_EQ(count_layer_moves(p.layers[0], {reversed}), 0);
  EXPECT_EQ(count_layer_moves({{0}}, {reversed}), experts - 1);
  p.layers[0][0].push_back(experts / 2);
  EXPECT_THROW(validate(p, {.distinct_on_rank = true, .equal_rank_memory = false}), Error);
}

TEST(Format, JsonRoundTripsWithEplbShapes) {
  const ExpertLoads loads = zipf_loads(3, 16, 8, 1.2, 1.2);
  const Placement p = plan(loads, {.ranks = 4, .redundant_slots = 4}).placement;
  const nlohmann::json j = placement_to_json(p);
  EXPECT_EQ(j["phy2log"][0].size(), size_t(p.slots(0)));
  EXPECT_EQ(j["logcnt"][1].size(), 16u);
  const Placement back = placement_from_json(j.dump(), "test.json");
  EXPECT_EQ(back.layers, p.layers);
  // log2phy lists every copy's slot, padded with -1.
  const auto log2phy = p.log2phy(0, p.max_copies());
  const auto phy2log = p.phy2log(0);
  for (int32_t e = 0; e < 16; ++e)
    for (int32_t s : log2phy[e])
      if (s >= 0) {
        EXPECT_EQ(phy2log[s], e);
      }
}

// EPLB's log2phy is one [layers, experts, max copies] tensor padded with -1; under uneven
// redundancy a layer with fewer copies is padded to the placement's most copies, not its own.
// phy2log stays ragged: each layer lists its own slots.
TEST(Format, Log2phyIsPaddedToOneWidthOverLayers) {
  const Placement p{2, 4, {{{0, 1, 3}, {2, 3, 0}}, {{0, 1}, {2, 3}}}};
  const nlohmann::json j = placement_to_json(p);
  for (size_t l = 0; l < 2; ++l)
    for (size_t e = 0; e < 4; ++e) EXPECT_EQ(j["log2phy"][l][e].size(), 2u) << l << " " << e;
  EXPECT_EQ(j["log2phy"][1][2], nlohmann::json::parse("[2, -1]"));
  EXPECT_EQ(j["phy2log"][0].size(), 6u);
  EXPECT_EQ(j["phy2log"][1].size(), 4u);
  EXPECT_EQ(placement_from_json(j.dump(), "p.json").layers, p.layers);
}

TEST(Format, JsonErrorsNameTheField) {
  const auto message = [](const std::string& text) {
    try {
      placement_from_json(text, "p.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(R"({"ranks":2,"experts":4})").find("phy2log"), std::string::npos);
  EXPECT_NE(message(R"({"ranks":2,"experts":4,"phy2log":[[0,1,2,2]]})").find("expert 3"),
            std::string::npos);
  EXPECT_NE(message(R"({"ranks":2,"experts":4,"phy2log":[[0,1,2,9]]})").find("expert id 9"),
            std::string::npos);
  EXPECT_NE(message(R"({"ranks":2,"experts":2,"phy2log":[[0,1,1]]})").find("do not divide"),
            std::string::npos);
  EXPECT_NE(message(R"({"ranks":2,"experts":4,"phy2log":[[0,1,2]]})").find("3 slots for 4 experts"),
            std::string::npos);
  EXPECT_NE(
      message(R"({"ranks":2,"experts":2,"phy2log":[[0,1]],"rank_slots":[[9223372036854775807,2]]})")
          .find("rank_slots"),
      std::string::npos);
  // Hostile sizes are refused before anything is allocated for them.
  EXPECT_NE(message(R"({"ranks":100000000,"experts":4,"phy2log":[[0]]})").find("\"ranks\""),
            std::string::npos);
  EXPECT_NE(message(R"({"ranks":4,"experts":4000000000,"phy2log":[[0]]})").find("\"experts\""),
            std::string::npos);
}

TEST(Format, ManyCopiesOfOneExpertAreRefusedBeforeLog2phyIsPadded) {
  // Under 8 MB of JSON: 65536 experts, then 3 million more slots of expert 0. log2phy padded to
  // expert 0's copies for every expert is 65536 x 3M entries (~800 GB); the check against it
  // built that table. In a child with its address space bounded, so that the old allocation
  // fails there rather than on the machine.
  const int64_t experts = 65536, extra = 3'000'000;
  std::string body = R"({"ranks":1,"experts":65536,"phy2log":[[)";
  for (int64_t e = 0; e < experts; ++e) body += std::to_string(e) + ",";
  for (int64_t k = 0; k < extra; ++k) body += k + 1 < extra ? "0," : "0";
  body += R"(]],"log2phy":[[)";
  for (int64_t e = 0; e < experts; ++e) body += e + 1 < experts ? "[]," : "[]";
  body += "]]}";
  ASSERT_LT(body.size(), size_t(8) << 20);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The cap keeps the old code's allocation from taking the machine. Sanitizers map terabytes
    // of shadow memory, which the cap would refuse: there the refusal alone is tested.
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
    const rlimit memory{size_t(4) << 30, size_t(4) << 30};
    ::setrlimit(RLIMIT_AS, &memory);
#endif
    try {
      placement_from_json(body, "p.json");
    } catch (const Error& e) {
      const std::string why = e.what();
      ::_exit(why.find("p.json: layer 0 of \"phy2log\" holds 3000001 copies of expert 0") !=
                      std::string::npos
                  ? 0
                  : 2);
    } catch (...) {
      ::_exit(3);  // the allocation failed
    }
    ::_exit(1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "ended by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: accepted, 2: another error, 3: allocation failed";
}

TEST(Format, OmniPatternRoundTripsThroughNpy) {
  const ExpertLoads loads = zipf_loads(3, 16, 8, 1.2, 1.2);
  const Placement p = plan(loads, {.ranks = 4, .redundant_slots = 8}).placement;
  const NpyArray a = placement_to_omni_pattern(p);
  const NpyArray parsed = parse_npy(encode_npy(a.shape, a.values, true), "p.npy");
  EXPECT_EQ(parsed.dtype, "<i4");
  const Placement back = placement_from_omni_pattern(parsed, "p.npy");
  for (int64_t l = 0; l < 3; ++l)
    for (int r = 0; r < 4; ++r) {
      auto a_sorted = p.layers[l][r], b_sorted = back.layers[l][r];
      std::sort(a_sorted.begin(), a_sorted.end());
      EXPECT_EQ(a_sorted, b_sorted);
    }
}

TEST(Format, OmniPatternErrorsNameTheCell) {
  NpyArray a{{2, 1, 2}, {1, 0, 0, 0}, "<i4"};  // expert 1 nowhere
  EXPECT_THROW(placement_from_omni_pattern(a, "p.npy"), Error);
  a.values = {1, 2, 0, 1};
  try {
    placement_from_omni_pattern(a, "p.npy");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert 1 holds 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(placement_from_omni_pattern({{4, 2}, std::vector<int64_t>(8, 1), "<i4"}, "p.npy"),
               Error);
}

// The pattern Omni Placement produced for DeepSeek-V3 GSM8K decode on 32 dies (see
// tests/data/placement/README.md): 10 layers carry 32 redundant experts, one per rank.
TEST(Format, ReadsTheOmniDeepSeekV3Pattern) {
  const std::filesystem::path path = std::filesystem::path(TANDEM_SOURCE_DIR) /
                                     "tests/data/placement" / "omni_dsv3_gsm8k_decode_32ranks.npy";
  const Placement p = placement_from_omni_pattern(read_npy(path), path.string());
  EXPECT_EQ(p.ranks, 32);
  EXPECT_EQ(p.experts, 256);
  ASSERT_EQ(p.num_layers(), 58);
  std::vector<int64_t> redundant_layers;
  for (int64_t l = 0; l < 58; ++l) {
    if (p.slots(l) == 288)
      redundant_layers.push_back(l);
    else
      EXPECT_EQ(p.slots(l), 256);
    for (int r = 0; r < 32; ++r) EXPECT_EQ(int64_t(p.layers[l][r].size()), p.slots(l) / 32);
  }
  EXPECT_EQ(redundant_layers, (std::vector<int64_t>{0, 1, 2, 4, 8, 12, 24, 45, 47, 55}));
  EXPECT_NO_THROW(validate(p));
}

// `tandem place plan --loads p.npy` with the Omni pattern `--omni-out` wrote (int32 0/1 [ranks,
// layers, experts]) read it as load snapshots and planned for them without a word.
TEST(Format, AnOmniPlacementPatternGivenAsLoadsIsRefusedNamingTheFile) {
  const auto file = std::filesystem::temp_directory_path() /
                    ("tandem-omni-as-loads-" + std::to_string(::getpid()) + ".npy");
  write_npy(file, {2, 1, 4}, {1, 1, 0, 0, 0, 0, 1, 1}, true);
  try {
    read_loads(file);
    ADD_FAILURE() << "a placement pattern was read as loads";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(file.string() + ": an int32 array of 0/1 [2, 1, 4], an "
                                                         "Omni placement pattern"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("[layers, experts]"), std::string::npos) << e.what();
  }
  // The same shape as int64 routed tokens (as --expert-load-dump writes) stays loads.
  write_npy(file, {2, 1, 4}, {1, 1, 0, 0, 0, 0, 1, 1});
  EXPECT_EQ(read_load_snapshots(file).size(), 2u);
  std::filesystem::remove(file);
}

// An engine's GET /admin/expert_placement answer (the placement in "placement", beside the ranks'
// work) saved to a file is a placement for --current: it was refused for having no "experts".
TEST(Format, AnEnginesAdminPlacementAnswerIsReadAsItsPlacement) {
  const auto file = std::filesystem::temp_directory_path() /
                    ("tandem-admin-placement-" + std::to_string(::getpid()) + ".json");
  const Placement p{2, 4, {{{0, 1}, {2, 3}}, {{3, 1}, {2, 0}}}};
  const nlohmann::json answer = {{"placement", placement_to_json(p)},
                                 {"ranks", {{{"expert_rows", 5}}, {{"expert_rows", 7}}}},
                                 {"remaps", 0}};
  std::ofstream(file) << answer.dump();
  const Placement read = read_placement(file);
  EXPECT_EQ(read.ranks, 2);
  EXPECT_EQ(read.experts, 4);
  EXPECT_EQ(read.layers, p.layers);
  std::filesystem::remove(file);
}

// vLLM's EPLB keeps expert_load_window as int32 [window, layers, experts]: at concurrency 1 each
// step routes one token per layer to each of top-k experts, so every value is 0 or 1, and an idle
// window is all 0. Neither reads as a servable placement pattern (experts held by no rank), so
// both are loads; a pattern that serves is still refused.
TEST(Format, Int32LoadsOfZerosAndOnesThatAreNoPlacementPatternAreLoads) {
  const auto file = std::filesystem::temp_directory_path() /
                    ("tandem-int32-loads-" + std::to_string(::getpid()) + ".npy");
  std::vector<int64_t> one_per_row(4 * 2 * 8, 0);
  for (int64_t row = 0; row < 4 * 2; ++row) one_per_row[size_t(row * 8 + (row * 3) % 8)] = 1;
  for (const auto& values : {one_per_row, std::vector<int64_t>(4 * 2 * 8, 0)}) {
    write_npy(file, {4, 2, 8}, values, true);
    const std::vector<ExpertLoads> snapshots = read_load_snapshots(file);
    ASSERT_EQ(snapshots.size(), 4u);
    const ExpertLoads loads = read_loads(file);
    EXPECT_EQ(loads.layers, 2);
    EXPECT_EQ(loads.experts, 8);
    int64_t total = 0;
    for (auto v : loads.values) total += int64_t(v);
    EXPECT_EQ(total, std::accumulate(values.begin(), values.end(), int64_t{0}));
    const Plan p = plan(loads, {.ranks = 4});
    EXPECT_NO_THROW(validate(p.placement));
  }
  // What --omni-out writes for a servable placement is refused, saying how to give such loads.
  const Placement served{
      4, 8, {{{0, 1}, {2, 3}, {4, 5}, {6, 7}}, {{7, 6}, {5, 4}, {3, 2}, {1, 0}}}};
  const NpyArray pattern = placement_to_omni_pattern(served);
  write_npy(file, pattern.shape, pattern.values, true);
  try {
    read_loads(file);
    ADD_FAILURE() << "a placement pattern was read as loads";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Omni placement pattern"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("if these are routed-token counts, save them as int64"),
              std::string::npos)
        << e.what();
  }
  std::filesystem::remove(file);
}

TEST(Format, LoadSnapshotsOfAnotherShapeAreRefusedNamingTheFile) {
  // `place simulate` compares each snapshot with the one before, expert by expert.
  const auto dir =
      std::filesystem::temp_directory_path() / ("tandem-snapshots-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  write_npy(dir / "expert_load_0001.npy", {2, 4}, std::vector<int64_t>(8, 1));
  write_npy(dir / "expert_load_0002.npy", {2, 4}, std::vector<int64_t>(8, 2));
  EXPECT_EQ(read_load_snapshots(dir).size(), 2u);
  write_npy(dir / "expert_load_0003.npy", {3, 4}, std::vector<int64_t>(12, 3));
  try {
    read_load_snapshots(dir);
    ADD_FAILURE() << "snapshots of two shapes were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find((dir / "expert_load_0003.npy").string() +
                                         ": a load snapshot of 3 layers x 4 experts, but "),
              std::string::npos)
        << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(Format, DumpSnapshotsAreReadInStepOrderPastEightDigits) {
  // `--expert-load-dump` names snapshots expert_load_%08llu.npy: step 100000000 has nine digits,
  // so by name it would sort before step 99999998.
  const auto dir =
      std::filesystem::temp_directory_path() / ("tandem-steps-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  write_npy(dir / "expert_load_100000000.npy", {1, 2}, {3, 3});
  write_npy(dir / "expert_load_99999999.npy", {1, 2}, {2, 2});
  write_npy(dir / "expert_load_99999998.npy", {1, 2}, {1, 1});
  write_npy(dir / "expert_load_00000007.npy", {1, 2}, {0, 0});
  write_npy(dir / "expert_load_cumulative.npy", {1, 2}, {9, 9});
  const std::vector<ExpertLoads> snaps = read_load_snapshots(dir);
  ASSERT_EQ(snaps.size(), 4u);
  for (size_t i = 0; i < snaps.size(); ++i) EXPECT_EQ(snaps[i].values[0], double(i)) << i;
  std::filesystem::remove_all(dir);
}

// README calls expert_load_cumulative.npy/.json "the input of tandem place": both files of the
// pair are the cumulative counts, though the JSON of a window dump (and /expert_load) plans from
// the window.
TEST(Format, TheCumulativeDumpsJsonAndNpyHoldTheSameLoads) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("tandem-cumulative-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  // A window of 8 steps after 16: the window holds the last 8, the cumulative counts all 16.
  engine::ExpertLoadStats stats({1, 2}, 4, 8);
  for (int64_t step = 0; step < 16; ++step)
    stats.record(std::vector<int64_t>{step < 8 ? 5 : 0, 1, 1, 1, 1, 1, 1, step < 8 ? 7 : 0});
  const engine::ExpertLoadSnapshot snap = stats.snapshot();
  snap.write(dir / "expert_load_cumulative", true);
  snap.write(dir / "expert_load_00000016");
  const ExpertLoads npy = read_loads(dir / "expert_load_cumulative.npy");
  const ExpertLoads json = read_loads(dir / "expert_load_cumulative.json");
  EXPECT_EQ(npy.values, (std::vector<double>{40, 16, 16, 16, 16, 16, 16, 56}));
  EXPECT_EQ(json.values, npy.values);
  // A window dump's pair holds the window, as before.
  const ExpertLoads window = read_loads(dir / "expert_load_00000016.json");
  EXPECT_EQ(window.values, read_loads(dir / "expert_load_00000016.npy").values);
  EXPECT_EQ(window.values, (std::vector<double>{0, 8, 8, 8, 8, 8, 8, 0}));
  // A "kind" that names neither array is refused, naming the field.
  try {
    loads_from_json(R"({"kind":"total","window":[[1]],"cumulative":[[2]]})", "l.json");
    ADD_FAILURE() << "an unknown kind was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("l.json: \"kind\""), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(Format, JsonFieldsThatContradictPhy2logAreRefusedNamingTheField) {
  const auto message = [](const nlohmann::json& j) {
    try {
      placement_from_json(j.dump(), "p.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  Placement p{2, 4, {{{0, 1, 3}, {2, 3}}, {{0, 1}, {2, 3}}}};
  const nlohmann::json good = placement_to_json(p);
  EXPECT_EQ(message(good), "no error");
  nlohmann::json j = good;
  j["layers"] = 3;
  EXPECT_NE(message(j).find("p.json: \"layers\" is 3"), std::string::npos) << message(j);
  j = good;
  j["logcnt"][0] = {1, 1, 1, 1};
  EXPECT_NE(message(j).find("p.json: layer 0 of \"logcnt\""), std::string::npos) << message(j);
  j = good;
  j["logcnt"] = {{1, 1, 1, 2}};
  EXPECT_NE(message(j).find("\"logcnt\" must have one entry per layer"), std::string::npos)
      << message(j);
  j = good;
  j["log2phy"][0][3] = {2, 3};  // expert 3's copies are slots 2 and 4; slot 3 holds expert 2
  EXPECT_NE(message(j).find("p.json: layer 0 of \"log2phy\", expert 3"), std::string::npos)
      << message(j);
  // EPLB pads log2phy wider, with -1, and may list an expert's copies in another order.
  j = good;
  j["log2phy"][0] = {{0, -1, -1}, {1, -1, -1}, {3, -1, -1}, {4, 2, -1}};
  EXPECT_EQ(message(j), "no error");
}

TEST(RoutingSkew, SteepSkewsStillPickDistinctExperts) {
  // Alpha 30: past the first few experts the popularity is below double rounding, so redrawing
  // alone would never find an eighth distinct expert.
  RoutingSkew skew(2, 16, {.alpha_lo = 30, .alpha_hi = 30, .top_k = 8, .seed = 1});
  std::mt19937_64 rng(2);
  const ExpertLoads one = skew.sample(1, rng);
  for (int64_t l = 0; l < 2; ++l) {
    double routes = 0;
    for (int64_t e = 0; e < 16; ++e) {
      EXPECT_LE(one.at(l, e), 1.0);
      routes += one.at(l, e);
    }
    EXPECT_EQ(routes, 8.0);
  }
}

TEST(Npy, RejectsShapesWhoseElementCountWouldWrapAround) {
  // 2^32 x 2^32 elements wrap a 64-bit count to 0, which an empty data section would match.
  const std::string header =
      "{'descr': '<i8', 'fortran_order': False, 'shape': (4294967296, 4294967296), }\n";
  std::string bytes = std::string("\x93NUMPY\x01\x00", 8);
  bytes += char(header.size() & 0xff);
  bytes += char(header.size() >> 8);
  bytes += header;
  try {
    parse_npy(bytes, "a.npy");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("too large"), std::string::npos) << e.what();
  }
}

// A .npy of int64 zeros whose header's shape is written as `dims` (the text between the
// parentheses), with as many values as `elements`.
std::string npy_with_shape(const std::string& dims, size_t elements) {
  const std::string header =
      "{'descr': '<i8', 'fortran_order': False, 'shape': (" + dims + "), }\n";
  std::string bytes = std::string("\x93NUMPY\x01\x00", 8);
  bytes += char(header.size() & 0xff);
  bytes += char(header.size() >> 8);
  return bytes + header + std::string(elements * 8, '\0');
}

TEST(Npy, ShapesAreTuplesOfNonNegativeIntegers) {
  for (const auto& [dims, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"3,", {3}}, {"3", {3}}, {"2, 4", {2, 4}}, {" 2 ,4 , ", {2, 4}}, {"", {}}}) {
    size_t elements = 1;
    for (int64_t d : shape) elements *= size_t(d);
    EXPECT_EQ(parse_npy(npy_with_shape(dims, elements), "a.npy").shape, shape) << dims;
  }
  // A sign was skipped: (2, -4) read as (2, 4).
  for (const std::string dims : {"2, -4", "-8,", "2,,4", ",", "2 4", "2, 4L", "1e3,", "+8,"}) {
    try {
      parse_npy(npy_with_shape(dims, 8), "a.npy");
      ADD_FAILURE() << dims << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("a.npy: .npy 'shape' (" + dims + ") is not a tuple"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(Npy, RejectsOtherDtypesAndTruncation) {
  std::string bytes = encode_npy({2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(parse_npy(bytes, "a.npy").values, (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  std::string f = bytes;
  f.replace(f.find("<i8"), 3, "<f8");
  EXPECT_THROW(parse_npy(f, "a.npy"), Error);
  EXPECT_THROW(parse_npy(bytes.substr(0, bytes.size() - 1), "a.npy"), Error);
  EXPECT_THROW(parse_npy("hello", "a.npy"), Error);
  EXPECT_EQ(bytes.find('\n') + 1, 128u);  // data 64-byte aligned, as NumPy writes it
}

}  // namespace
}  // namespace tandem::placement
