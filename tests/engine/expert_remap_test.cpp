// Automatic expert rebalancing: a plan that fails is reported in the remap status and leaves the
// placement in force; it never escapes into the engine thread that asked for it.
#include <gtest/gtest.h>

#include "engine/expert_remap.h"
#include "util/error.h"

namespace tandem::engine {
namespace {

// An executor that places experts and counts the placements staged on it.
class PlacingExecutor : public Executor {
 public:
  explicit PlacingExecutor(placement::Placement p) : placement_(std::move(p)) {}
  const ExecutorInfo& info() const override { return info_; }
  ExecResult execute(std::span<const ExecItem>, const LayerHook&) override { return {}; }
  const std::byte* kv_bytes(int32_t, int64_t) const override { return nullptr; }
  void write_kv(int32_t, int64_t, std::span<const std::byte>) override {}
  std::optional<placement::Placement> expert_placement() const override { return placement_; }
  void stage_expert_placement(const placement::Placement&, std::function<void()>) override {
    ++staged;
  }
  int staged = 0;

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

}  // namespace
}  // namespace tandem::engine
