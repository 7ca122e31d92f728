#include "engine/expert_parallel/stall_watch.h"

#include <gtest/gtest.h>

#include <vector>

#include "util/shared_memory.h"

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

// The front's poll asks its StallWatch about the barrier it waits at. It read the barrier's live
// generation, so a peer that completed the barrier just before a poll had the watch start timing
// the NEXT barrier; after an idle spell of the timeout, the first poll of the next step's wait
// found that barrier "waited" the whole spell and failed every rank. The poll is now told the
// generation its waiter waits at: here the other party arrives from inside the first poll,
// completing the barrier, and the watch still times only the wait that was polled.
TEST(StallWatch, APollIsAboutTheBarrierItsWaiterWaitsAtNotTheNextOne) {
  SharedBarrier barrier;
  barrier.generation = 41;
  StallWatch watch(seconds(300));
  std::vector<uint32_t> polled;
  barrier.arrive_and_wait(2, [&](uint32_t waiting_at) {
    polled.push_back(waiting_at);
    EXPECT_FALSE(watch.stalled(waiting_at, t0));
    if (polled.size() == 1) barrier.arrive_and_wait(2, {});  // the last party: completes it
  });
  EXPECT_EQ(polled, std::vector<uint32_t>{41});
  EXPECT_EQ(barrier.generation.load(), 42u);
  // The engine idles past the timeout; the next step's first poll waits at 42, for 20 ms.
  EXPECT_FALSE(watch.stalled(42, t0 + seconds(301)));
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
