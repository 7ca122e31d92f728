// TaskThread: tasks run in the order posted, all of them before stop() returns, on the thread (not
// the poster's) while it runs and on the poster's once it stopped; a task that throws does not
// stop the ones after it.
#include "util/task_thread.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <memory>
#include <thread>
#include <vector>

namespace tandem::util {
namespace {

TEST(TaskThread, RunsEveryTaskInPostedOrderBeforeStopReturns) {
  TaskThread t("test");
  t.start();
  std::vector<int> seen;  // written by the task thread only, read after stop()
  for (int i = 0; i < 10000; ++i) t.post([&seen, i] { seen.push_back(i); });
  t.stop();
  ASSERT_EQ(seen.size(), 10000u);
  for (int i = 0; i < 10000; ++i) ASSERT_EQ(seen[i], i);
}

TEST(TaskThread, TasksRunOnItsThreadWhileItRunsAndOnThePostersAfterStop) {
  TaskThread t("test");
  t.start();
  std::atomic<bool> on_poster{true};
  const auto poster = std::this_thread::get_id();
  t.post([&] { on_poster = std::this_thread::get_id() == poster; });
  t.stop();
  EXPECT_FALSE(on_poster.load());
  bool ran = false;
  t.post([&] { ran = std::this_thread::get_id() == poster; });
  EXPECT_TRUE(ran);  // at once, here: nothing is left unrun
}

TEST(TaskThread, AThrowingTaskDoesNotStopTheOthers) {
  TaskThread t("test");
  t.start();
  int after = 0;
  t.post([] { throw std::runtime_error("boom"); });
  t.post([&after] { after = 1; });
  t.stop();
  EXPECT_EQ(after, 1);
}

// A task's captures are let go as soon as it has run, before the next task runs: the thread took
// every task posted meanwhile at once and kept them all until the last had run, so what one held
// (a request counted as waiting in the engine's /load, a reply) outlived it by the whole batch.
TEST(TaskThread, ATasksCapturesAreReleasedBeforeTheNextTaskRuns) {
  TaskThread t("test");
  t.start();
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  t.post([released] { released.wait(); });  // the two below are posted meanwhile: one batch
  auto token = std::make_shared<int>(0);
  std::weak_ptr<int> watched = token;
  t.post([token = std::move(token)] {});
  bool released_before_next = false;
  t.post([&] { released_before_next = watched.expired(); });
  release.set_value();
  t.stop();
  EXPECT_TRUE(released_before_next);
}

}  // namespace
}  // namespace tandem::util
