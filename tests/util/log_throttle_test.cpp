#include "util/log_throttle.h"

#include <gtest/gtest.h>

namespace tandem {
namespace {

using namespace std::chrono_literals;

TEST(LogThrottle, TheFirstEventIsLoggedAtOnce) {
  LogThrottle throttle(10s);
  EXPECT_EQ(throttle.admit(LogThrottle::Clock::time_point{} + 5s), 0);
}

TEST(LogThrottle, EventsWithinTheIntervalAreCountedAndReportedWithTheNextLine) {
  LogThrottle throttle(10s);
  const auto t0 = LogThrottle::Clock::time_point{} + 100s;
  ASSERT_EQ(throttle.admit(t0), 0);
  EXPECT_EQ(throttle.admit(t0 + 1s), std::nullopt);
  EXPECT_EQ(throttle.admit(t0 + 5s), std::nullopt);
  EXPECT_EQ(throttle.admit(t0 + 9999ms), std::nullopt);
  EXPECT_EQ(throttle.admit(t0 + 10s), 3);
  EXPECT_EQ(throttle.admit(t0 + 11s), std::nullopt);
  EXPECT_EQ(throttle.admit(t0 + 30s), 1);
}

}  // namespace
}  // namespace tandem
