// InlineTask: small closures live inside it, larger ones on the heap; both behave alike under
// moves, and what a closure captured is released exactly once, when the task goes.
#include "util/inline_task.h"

#include <gtest/gtest.h>

#include <array>
#include <memory>
#include <utility>
#include <vector>

namespace tandem::util {
namespace {

TEST(InlineTask, EmptyTaskIsFalse) {
  InlineTask t;
  EXPECT_FALSE(t);
  InlineTask n = nullptr;
  EXPECT_FALSE(n);
}

TEST(InlineTask, RunsSmallAndLargeClosures) {
  int calls = 0;
  InlineTask small = [&calls] { ++calls; };
  std::array<char, 200> big{};
  big[199] = 3;
  InlineTask large = [&calls, big] { calls += big[199]; };
  ASSERT_TRUE(small);
  ASSERT_TRUE(large);
  small();
  large();
  large();
  EXPECT_EQ(calls, 7);
}

// Captures are released once, whether the closure is inline or on the heap, moved or not.
template <size_t Pad>
void check_capture_lifetime() {
  auto owned = std::make_shared<int>(41);
  std::weak_ptr<int> watch = owned;
  std::array<char, Pad> pad{};
  {
    InlineTask a = [p = std::move(owned), pad] { ++*p; };
    a();
    InlineTask b = std::move(a);
    EXPECT_FALSE(a);  // NOLINT: moved-from is empty by contract
    b();
    EXPECT_EQ(*watch.lock(), 43);
    InlineTask c;
    c = std::move(b);
    EXPECT_FALSE(b);  // NOLINT
    EXPECT_FALSE(watch.expired());
    c = [] {};  // assigning over it releases the old closure
    EXPECT_TRUE(watch.expired());
  }
  EXPECT_TRUE(watch.expired());
}

TEST(InlineTask, ReleasesInlineCapturesOnce) {
  check_capture_lifetime<8>();
}

TEST(InlineTask, ReleasesHeapCapturesOnce) {
  check_capture_lifetime<256>();
}

TEST(InlineTask, SurvivesAVectorOfTasksGrowing) {
  std::vector<InlineTask> tasks;
  int sum = 0;
  for (int i = 0; i < 100; ++i) {
    auto p = std::make_shared<int>(i);
    tasks.emplace_back([p, &sum] { sum += *p; });
  }
  for (auto& t : tasks) t();
  EXPECT_EQ(sum, 4950);
}

}  // namespace
}  // namespace tandem::util
