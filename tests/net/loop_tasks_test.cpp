// net::LoopTasks: work and timers on a server's io thread. Only orders and lower bounds on timer
// times are asserted, never durations.
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "net/http_server.h"
#include "net/loop_tasks.h"
#include "util/bounded_wait.h"

namespace tandem::net {
namespace {

using Clock = std::chrono::steady_clock;
using tandem::testing::get_within;
using tandem::testing::kHangGuard;

struct Running {
  Running() {
    HttpServerOptions o;
    o.host = "127.0.0.1";
    o.threads = 1;
    server = std::make_unique<HttpServer>(o);
    tasks = std::make_unique<LoopTasks>(*server);
    server->start();
  }
  ~Running() {
    server->stop();
    tasks.reset();
  }
  std::unique_ptr<HttpServer> server;
  std::unique_ptr<LoopTasks> tasks;
};

TEST(LoopTasks, PostedTasksRunOnTheLoopInPostingOrder) {
  Running r;
  std::vector<int> order;
  std::promise<void> done;
  EXPECT_FALSE(r.tasks->in_loop());
  for (int i = 0; i < 100; ++i)
    r.tasks->post([&, i] {
      EXPECT_TRUE(r.tasks->in_loop());
      order.push_back(i);
      if (i == 99) done.set_value();
    });
  auto ran = done.get_future();
  get_within(ran, kHangGuard, "the last posted task never ran");
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST(LoopTasks, TimersFireInTimeOrderNeverEarlyAndCancelledOnesNever) {
  Running r;
  std::vector<int> fired;
  std::atomic<bool> cancelled_ran{false};
  std::promise<void> done;
  r.tasks->post([&] {
    const auto start = Clock::now();
    const auto late = start + std::chrono::milliseconds(30);
    const auto early = start + std::chrono::milliseconds(10);
    r.tasks->at(late, [&, late] {
      EXPECT_GE(Clock::now(), late);
      fired.push_back(2);
      done.set_value();
    });
    r.tasks->at(early, [&, early] {
      EXPECT_GE(Clock::now(), early);
      fired.push_back(1);
    });
    const auto when = start + std::chrono::milliseconds(20);
    const uint64_t id = r.tasks->at(when, [&] { cancelled_ran = true; });
    r.tasks->cancel(when, id);
  });
  auto fired_last = done.get_future();
  get_within(fired_last, kHangGuard, "the last timer never fired");
  EXPECT_EQ(fired, (std::vector<int>{1, 2}));
  EXPECT_FALSE(cancelled_ran.load());
}

// The gateway's scheduling runs on these tasks with one io thread: a throw must not rerun the
// tasks before it nor starve those after it, nor leave due timers unarmed.
TEST(LoopTasks, ATaskOrTimerThatThrowsIsDroppedAndTheOthersRunOnce) {
  Running r;
  std::vector<int> posted, timers;  // each in its own order: the two queues interleave freely
  std::promise<void> done;
  r.tasks->post([&] {
    // Posted from the loop: the three run as one batch.
    r.tasks->post([&] { posted.push_back(1); });
    r.tasks->post([] { throw std::runtime_error("a failing task"); });
    r.tasks->post([&] { posted.push_back(2); });
    const auto now = Clock::now();
    r.tasks->at(now, [] { throw std::runtime_error("a failing timer"); });
    r.tasks->at(now + std::chrono::milliseconds(1), [&] { timers.push_back(3); });
    r.tasks->at(now + std::chrono::milliseconds(20), [&] {
      timers.push_back(4);
      done.set_value();
    });
  });
  // Bounded waits: without the fix the due timers were never armed again.
  ASSERT_EQ(done.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  std::promise<void> after;
  r.tasks->post([&] { after.set_value(); });  // a later batch runs nothing twice
  ASSERT_EQ(after.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(posted, (std::vector<int>{1, 2}));
  EXPECT_EQ(timers, (std::vector<int>{3, 4}));
}

TEST(LoopTasks, PostsAfterTheServerStoppedAreDropped) {
  Running r;
  r.server->stop();
  bool ran = false;
  r.tasks->post([&] { ran = true; });
  EXPECT_FALSE(ran);
}

// Every post after the stop is dropped at once, with what it holds: the first failed hand-over
// left the queue marked as handed over, so later tasks piled up for ever.
TEST(LoopTasks, TasksPostedAfterTheServerStoppedAreNotKept) {
  Running r;
  r.server->stop();
  auto held = std::make_shared<int>(0);
  for (int i = 0; i < 1000; ++i) r.tasks->post([held] { ++*held; });
  EXPECT_EQ(held.use_count(), 1);
  EXPECT_EQ(*held, 0);
}

}  // namespace
}  // namespace tandem::net
