// Automatic expert rebalancing: a plan that fails is reported in the remap status and leaves the
// placement in force; it never escapes into the engine thread that asked for it.
#include <gtest/gtest.h>

#include "engine/expert_parallel/ep_executor.h"
#include "engine/expert_parallel/ep_segment.h"
#include "engine/expert_remap.h"
#include "placement/eplb.h"
#include "util/error.h"

namespace tandem::engine {
namespace {

// An executor that places experts, counts the placements staged on it and keeps the `loaded`
// callback for the test to call (or not: a failed executor's loader never calls it).
class PlacingExecutor : public Executor {
 public:
  explicit PlacingExecutor(placement::Placement p) : placement_(std::move(p)) {}
  const ExecutorInfo& info() const override { return info_; }
  ExecResult execute(std::span<const ExecItem>, const LayerHook&) override { return {}; }
  const std::byte* kv_bytes(int32_t, int64_t) const override { return nullptr; }
  void write_kv(int32_t, int64_t, std::span<const std::byte>) override {}
  std::string failure() const override { return failed; }
  std::optional<placement::Placement> expert_placement() const override {
    if (on_placement_read) on_placement_read();
    return placement_;
  }
  void stage_expert_placement(const placement::Placement&, std::function<void()> done) override {
    // As EpExecutor: a failed executor refuses, naming its failure.
    if (!failed.empty()) throw Error(failed);
    ++staged;
    loaded = std::move(done);
  }
  PlacementSwitch switch_expert_placement() override { return {3, 0.5, 0.01}; }
  int staged = 0;
  std::function<void()> loaded;
  std::string failed;
  std::function<void()> on_placement_read;  // e.g. another change arriving then

 private:
  ExecutorInfo info_;
  placement::Placement placement_;
};

TEST(ExpertRemap, APlanThatFailsIsReportedAndThePlacementStays) {
  // Loads of two MoE layers against a placement of three: the planner refuses the pair.
  const std::vector<int32_t> all = {0, 1, 2, 3};
  PlacingExecutor executor({2, 4, {{all, {}}, {all, {}}, {all, {}}}});
  metrics::Registry registry;
  ExpertRemapper remapper(executor, 1, registry, [](std::function<void()> task) { task(); });
  ExpertLoadStats load({1, 2}, 4, 8);
  load.record(std::vector<int64_t>{9, 1, 1, 1, 9, 1, 1, 1});
  EXPECT_NO_THROW(remapper.after_step(1, load));
  const ExpertRemapStatus status = remapper.status();
  EXPECT_NE(status.last_error.find("automatic rebalance"), std::string::npos) << status.last_error;
  EXPECT_NE(status.last_error.find("3 layers"), std::string::npos) << status.last_error;
  EXPECT_FALSE(status.loading);
  EXPECT_EQ(status.remaps, 0);
  EXPECT_EQ(executor.staged, 0);
  EXPECT_EQ(status.to_json()["last_error"], status.last_error);
  // The next interval tries again, and fails the same way without ending anything.
  load.record(std::vector<int64_t>{9, 1, 1, 1, 9, 1, 1, 1});
  EXPECT_NO_THROW(remapper.after_step(2, load));
}

// The executor fails while a change loads (a rank dies, a copy fails to load): its loader ends
// without calling `loaded`, so the change never switches. The status says failed, with the
// executor's reason, not loading for ever, and a further change is refused for the engine's
// sake (the API's 503), not as a bad placement.
TEST(ExpertRemap, AChangeCutShortByAnExecutorFailureIsReportedFailed) {
  const std::vector<int32_t> all = {0, 1, 2, 3};
  const placement::Placement p{2, 4, {{all, {}}}};
  PlacingExecutor executor(p);
  metrics::Registry registry;
  ExpertRemapper remapper(executor, 0, registry, [](std::function<void()> task) { task(); });
  remapper.change(p);
  EXPECT_EQ(remapper.status().to_json()["state"], "loading");
  executor.failed = "expert-parallel rank 1 exited (status 9)";
  const ExpertRemapStatus status = remapper.status();
  EXPECT_FALSE(status.loading);
  EXPECT_EQ(status.to_json()["state"], "failed");
  EXPECT_NE(status.last_error.find("rank 1 exited"), std::string::npos) << status.last_error;
  try {
    remapper.change(p);
    ADD_FAILURE() << "a failed executor took a placement change";
  } catch (const RemapUnavailable& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 exited"), std::string::npos) << e.what();
  }
  EXPECT_EQ(executor.staged, 1);
}

// A change while another loads is refused as underway (the API's 409), whether the other is an
// operator's or the engine's own rebalance, and not as a bad placement (400).
TEST(ExpertRemap, AChangeWhileAnotherLoadsIsRefusedAsUnderway) {
  const std::vector<int32_t> all = {0, 1, 2, 3};
  const placement::Placement p{2, 4, {{all, {}}}};
  PlacingExecutor executor(p);
  metrics::Registry registry;
  ExpertRemapper remapper(executor, 0, registry, [](std::function<void()> task) { task(); });
  remapper.change(p);
  EXPECT_THROW(remapper.change(p), RemapUnderway);
  EXPECT_EQ(executor.staged, 1);
  executor.loaded();
  EXPECT_NO_THROW(remapper.change(p));  // the first switched: the next may load
  EXPECT_EQ(executor.staged, 2);
}

// An operator's change that begins while the engine plans its own rebalance (after the
// rebalance found none loading) wins: the rebalance leaves it alone and reports no error.
TEST(ExpertRemap, ARebalanceThatFindsAChangeBegunWhileItPlannedLeavesIt) {
  const placement::Placement p{2, 4, {{{0, 1}, {2, 3}}}};
  PlacingExecutor executor(p);
  metrics::Registry registry;
  ExpertRemapper remapper(executor, 1, registry, [](std::function<void()> task) { task(); });
  executor.on_placement_read = [&, once = true]() mutable {
    if (once) remapper.change(p);
    once = false;
  };
  ExpertLoadStats load({1}, 4, 8);
  load.record(std::vector<int64_t>{90, 80, 1, 1});  // rank 0 holds both hot experts
  EXPECT_NO_THROW(remapper.after_step(1, load));
  const ExpertRemapStatus status = remapper.status();
  EXPECT_EQ(executor.staged, 1);  // the operator's
  EXPECT_TRUE(status.loading);
  EXPECT_EQ(status.last_error, "");
}

// last_error is about the last attempt: a switch that succeeds after a failed plan clears it.
TEST(ExpertRemap, ASwitchThatSucceedsClearsTheLastError) {
  const std::vector<int32_t> all = {0, 1, 2, 3};
  const placement::Placement three_layers{2, 4, {{all, {}}, {all, {}}, {all, {}}}};
  PlacingExecutor executor(three_layers);
  metrics::Registry registry;
  ExpertRemapper remapper(executor, 1, registry, [](std::function<void()> task) { task(); });
  ExpertLoadStats load({1, 2}, 4, 8);  // two layers against three: the plan fails
  load.record(std::vector<int64_t>{9, 1, 1, 1, 9, 1, 1, 1});
  remapper.after_step(1, load);
  ASSERT_FALSE(remapper.status().last_error.empty());
  remapper.change(three_layers);
  ASSERT_TRUE(executor.loaded);
  executor.loaded();  // the copies are in: the switch runs (posted, here at once)
  const ExpertRemapStatus status = remapper.status();
  EXPECT_EQ(status.remaps, 1);
  EXPECT_EQ(status.last->moves, 3);
  EXPECT_EQ(status.last_error, "");
  EXPECT_FALSE(status.to_json().contains("last_error"));
  EXPECT_EQ(status.to_json()["state"], "idle");
}

// The placement tables of an expert-parallel engine's segment, laid out as EpExecutor lays them
// out for its start placement.
struct PlacementTables {
  PlacementTables(const placement::Placement& start, int64_t experts, int ranks) {
    shape.ranks = ranks;
    shape.hidden = shape.top_k = 1;
    shape.experts = experts;
    shape.moe_layers = start.num_layers();
    shape.max_tokens = shape.max_items = shape.max_block_refs = shape.vocab = 1;
    shape.max_slots = ep::segment_slots(start, experts, ranks, 0);
    shape.block_size = shape.cache_blocks = shape.cache_block_bytes = 1;
    memory = SharedSegment::create(ep::EpSegment::bytes(shape), "expert-remap-test");
    segment.emplace(ep::EpSegment::format(memory, shape));
    ep::write_placement(segment->table(0), shape, start);
  }
  // What a live remap does with a POSTed placement (EpExecutor::stage_expert_placement).
  void stage(const placement::Placement& next) const {
    ep::write_placement(segment->table(1), shape, next);
  }
  ep::EpShape shape;
  SharedSegment memory;
  std::optional<ep::EpSegment> segment;
};

// `tandem place plan` writes up to one copy of every expert on every rank in a layer (--slots at
// most experts x ranks, and the layer-wise planners may give one layer that many): an engine
// started without redundancy takes such a plan live, as it would at start.
TEST(ExpertRemap, AnEngineTakesLiveAnyPlanForItsRanks) {
  const int64_t experts = 8;
  const int ranks = 4;
  PlacementTables tables(placement::no_redundancy(2, experts, ranks), experts, ranks);
  const std::vector<int32_t> all = {0, 1, 2, 3, 4, 5, 6, 7};
  const placement::Placement every_copy{
      ranks, experts, {{{0, 1}, {2, 3}, {4, 5}, {6, 7}}, {all, all, all, all}}};
  ASSERT_EQ(every_copy.slots(1), experts * ranks);
  EXPECT_NO_THROW(tables.stage(every_copy));
  EXPECT_EQ(ep::read_placement(tables.segment->table(1), tables.shape).layers, every_copy.layers);
}

// Only a hand-written placement holding an expert twice on one rank goes past that; the refusal
// says how to make room.
TEST(ExpertRemap, APlacementPastTheSegmentsSlotsIsRefusedSayingHowToMakeRoom) {
  const int64_t experts = 4;
  const int ranks = 3;
  PlacementTables tables(placement::no_redundancy(1, experts, ranks), experts, ranks);
  const placement::Placement twice{ranks, experts, {{{0, 1, 2, 3, 0}, {0, 1, 2, 3}, {0, 1, 2, 3}}}};
  try {
    tables.stage(twice);
    ADD_FAILURE() << "a placement of 13 slots fit a segment of 12";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("layer 0 has 13 slots, at most 12 fit"), std::string::npos) << what;
    EXPECT_NE(what.find("--expert-placement"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace tandem::engine
