#include "util/restart_backoff.h"

#include <gtest/gtest.h>

#include <vector>

namespace tandem {
namespace {

using namespace std::chrono_literals;

TEST(RestartBackoff, AChildThatKeepsDyingAtStartWaitsTwiceAsLongEachTimeUpToTheMaximum) {
  const RestartBackoff backoff{1s, 30s, 60s};
  int quick_deaths = 0;
  std::vector<std::chrono::milliseconds> delays;
  for (int i = 0; i < 8; ++i) delays.push_back(backoff.next_delay(200ms, quick_deaths));
  const std::vector<std::chrono::milliseconds> expected = {1s, 2s, 4s, 8s, 16s, 30s, 30s, 30s};
  EXPECT_EQ(delays, expected);
}

TEST(RestartBackoff, AChildThatRanLongEnoughIsRestartedAfterTheFirstDelayAgain) {
  const RestartBackoff backoff{1s, 30s, 60s};
  int quick_deaths = 0;
  for (int i = 0; i < 4; ++i) backoff.next_delay(1s, quick_deaths);
  EXPECT_EQ(backoff.next_delay(60s, quick_deaths), 1s);
  EXPECT_EQ(backoff.next_delay(5s, quick_deaths), 2s);
}

}  // namespace
}  // namespace tandem
