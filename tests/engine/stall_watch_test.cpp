#include "engine/expert_parallel/stall_watch.h"

#include <gtest/gtest.h>

namespace tandem::engine::ep {
namespace {

using std::chrono::seconds;
const StallWatch::Clock::time_point t0{};

TEST(StallWatch, AWaitIsStalledOnlyOnceTheSameBarrierHasWaitedTheTimeout) {
  StallWatch watch(seconds(10));
  EXPECT_FALSE(watch.stalled(7, t0));
  EXPECT_FALSE(watch.stalled(7, t0 + seconds(9)));
  EXPECT_TRUE(watch.stalled(7, t0 + seconds(10)));
}

TEST(StallWatch, ABarrierThatCompletesStartsTheClockAgain) {
  StallWatch watch(seconds(10));
  EXPECT_FALSE(watch.stalled(7, t0));
  // Slow steps whose exchanges each complete are not stalls, however long the step.
  EXPECT_FALSE(watch.stalled(8, t0 + seconds(9)));
  EXPECT_FALSE(watch.stalled(9, t0 + seconds(18)));
  EXPECT_FALSE(watch.stalled(9, t0 + seconds(27)));
  EXPECT_TRUE(watch.stalled(9, t0 + seconds(28)));
}

TEST(StallWatch, ATimeoutOfZeroNeverStalls) {
  StallWatch watch(seconds(0));
  EXPECT_FALSE(watch.stalled(1, t0));
  EXPECT_FALSE(watch.stalled(1, t0 + seconds(100000)));
}

TEST(RanksBehind, AreTheRanksThatReachedFewerBarriersThanTheWaiter) {
  const std::vector<uint32_t> arrivals = {12, 12, 11, 12, 10};
  EXPECT_EQ(ranks_behind(arrivals, 0), (std::vector<int>{2, 4}));
  EXPECT_TRUE(ranks_behind(std::vector<uint32_t>{5, 5, 5}, 0).empty());
}

TEST(RanksBehind, CountersThatWrappedCompareByDifference) {
  // The waiter's counter wrapped past zero; a rank one barrier behind is still behind, and one
  // already at the same count is not.
  const std::vector<uint32_t> arrivals = {1, 0xffffffffu, 1};
  EXPECT_EQ(ranks_behind(arrivals, 0), (std::vector<int>{1}));
}

}  // namespace
}  // namespace tandem::engine::ep
