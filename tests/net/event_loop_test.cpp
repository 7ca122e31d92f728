// The event loop under the HTTP stack: tasks posted from other threads run on the loop in order,
// deferred work runs once per iteration, timers fire (and re-armed or disarmed ones do not), fds
// report readiness edge-triggered, and stop() runs what was posted before it.
#include "net/event_loop.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "util/bounded_wait.h"

namespace tandem::net::detail {
namespace {

using namespace std::chrono_literals;
using tandem::testing::get_within;
using tandem::testing::kHangGuard;

// A loop on its own thread for the length of a test.
class RunningLoop {
 public:
  RunningLoop() : thread_([this] { loop.run(); }) {}
  ~RunningLoop() {
    loop.stop();
    thread_.join();
  }
  // Runs `f` on the loop and waits for it. The posted task refers to this frame (`f`, `done`):
  // a wait that runs out ends the run (bounded_wait.h), as returning would let the loop run the
  // task on a frame that is gone.
  template <class F>
  void on_loop(F f) {
    std::promise<void> done;
    loop.post([&] {
      f();
      done.set_value();
    });
    auto ran = done.get_future();
    get_within(ran, kHangGuard, "the task posted to the loop never ran");
  }

  EventLoop loop;

 private:
  std::thread thread_;
};

struct Counter : Task {
  std::vector<int> seen;
  std::thread::id thread;
  void run(int op) override {
    seen.push_back(op);
    thread = std::this_thread::get_id();
  }
};

TEST(EventLoop, PostsFromManyThreadsRunOnTheLoopInOrderPerThread) {
  RunningLoop l;
  constexpr int kThreads = 4, kPosts = 2000;
  std::vector<std::vector<int>> seen(kThreads);
  std::atomic<int> ran{0};
  std::promise<std::thread::id> loop_thread;
  l.loop.post([&] { loop_thread.set_value(std::this_thread::get_id()); });
  auto loop_thread_id = loop_thread.get_future();
  const std::thread::id id = get_within(loop_thread_id, kHangGuard, "the loop ran no task");
  std::vector<std::thread> posters;
  for (int t = 0; t < kThreads; ++t) {
    posters.emplace_back([&, t] {
      for (int i = 0; i < kPosts; ++i) {
        l.loop.post([&, t, i] {
          EXPECT_EQ(std::this_thread::get_id(), id);
          EXPECT_TRUE(l.loop.in_loop_thread());
          seen[t].push_back(i);  // only the loop thread touches `seen`
          ++ran;
        });
      }
    });
  }
  for (auto& p : posters) p.join();
  l.on_loop([] {});
  EXPECT_EQ(ran.load(), kThreads * kPosts);
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(seen[t].size(), size_t{kPosts});
    for (int i = 0; i < kPosts; ++i) ASSERT_EQ(seen[t][i], i);
  }
  EXPECT_FALSE(l.loop.in_loop_thread());
}

TEST(EventLoop, TaskObjectsCarryTheirOperation) {
  RunningLoop l;
  auto counter = std::make_shared<Counter>();
  l.loop.post(counter, 7);
  l.loop.post(counter, 8);
  l.on_loop([&] {
    EXPECT_EQ(counter->seen, (std::vector<int>{7, 8}));
    EXPECT_EQ(counter->thread, std::this_thread::get_id());
  });
}

struct Flush : Deferred {
  int runs = 0;
  void run_deferred() override { ++runs; }
};

TEST(EventLoop, DeferredWorkRunsOncePerIteration) {
  RunningLoop l;
  Flush flush;
  l.on_loop([&] {
    l.loop.defer(&flush);
    l.loop.defer(&flush);  // coalesced
    EXPECT_EQ(flush.runs, 0);
  });
  l.on_loop([&] { EXPECT_EQ(flush.runs, 1); });
}

struct Alarm : Timer::Target {
  std::atomic<int> fired{0};
  std::promise<void> first;
  void on_timer() override {
    if (fired++ == 0) first.set_value();
  }
};

TEST(EventLoop, TimersFireAndRearmingMovesThem) {
  RunningLoop l;
  Alarm early, moved, disarmed;
  std::unique_ptr<Timer> t1, t2, t3;
  const auto start = std::chrono::steady_clock::now();
  l.on_loop([&] {
    t1 = std::make_unique<Timer>(l.loop, early);
    t2 = std::make_unique<Timer>(l.loop, moved);
    t3 = std::make_unique<Timer>(l.loop, disarmed);
    t1->arm(20ms);
    t2->arm(20ms);
    t2->arm(60ms);  // later: only a store, the queued entry re-queues it
    t3->arm(20ms);
    t3->disarm();
    EXPECT_TRUE(t1->armed());
    EXPECT_FALSE(t3->armed());
  });
  auto early_fired = early.first.get_future(), moved_fired = moved.first.get_future();
  get_within(early_fired, kHangGuard, "the timer armed for 20 ms never fired");
  get_within(moved_fired, kHangGuard, "the timer moved to 60 ms never fired");
  EXPECT_GE(std::chrono::steady_clock::now() - start, 50ms);  // not at the first deadline
  l.on_loop([&] {
    EXPECT_EQ(early.fired.load(), 1);
    EXPECT_EQ(moved.fired.load(), 1);
    EXPECT_EQ(disarmed.fired.load(), 0);
    EXPECT_FALSE(t1->armed());
    // Re-armed earlier than a queued deadline: fires at the earlier one.
    t3->arm(1h);
    t3->arm(10ms);
  });
  auto rearmed_fired = disarmed.first.get_future();
  get_within(rearmed_fired, kHangGuard, "the timer re-armed for 10 ms never fired");
  l.on_loop([&] {
    t1.reset();
    t2.reset();
    t3.reset();
  });
}

TEST(EventLoop, DestroyedTimerNeverFires) {
  RunningLoop l;
  Alarm a, b;
  std::unique_ptr<Timer> ta, tb;
  l.on_loop([&] {
    ta = std::make_unique<Timer>(l.loop, a);
    ta->arm(10ms);
    ta.reset();
    // Its slot is reused by the next timer; the old queued entry must not fire it.
    tb = std::make_unique<Timer>(l.loop, b);
    tb->arm(50ms);
  });
  auto b_fired = b.first.get_future();
  get_within(b_fired, kHangGuard, "the timer in the reused slot never fired");
  EXPECT_EQ(a.fired.load(), 0);
  EXPECT_EQ(b.fired.load(), 1);
  l.on_loop([&] { tb.reset(); });
}

struct Reader : IoHandler {
  int fd = -1;
  std::atomic<int> events{0};
  std::string got;
  std::promise<void> saw_hello;
  void on_io(uint32_t) override {
    ++events;
    char buf[64];
    for (;;) {
      ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n <= 0) break;
      got.append(buf, static_cast<size_t>(n));
    }
    if (got == "hello") saw_hello.set_value();
  }
};

TEST(EventLoop, SocketsReportReadinessOnce) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, pair), 0);
  RunningLoop l;
  Reader reader;
  reader.fd = pair[0];
  l.on_loop([&] { l.loop.add(pair[0], &reader); });
  ASSERT_EQ(::send(pair[1], "hello", 5, 0), 5);
  auto hello = reader.saw_hello.get_future();
  get_within(hello, kHangGuard, "the reader never saw \"hello\"");
  const int after = reader.events.load();
  // Edge-triggered: with nothing new, a few loop iterations bring no further events.
  for (int i = 0; i < 5; ++i) l.on_loop([] {});
  EXPECT_EQ(reader.events.load(), after);
  l.on_loop([&] { EXPECT_EQ(reader.got, "hello"); });
  ::close(pair[1]);
  ::close(pair[0]);
}

TEST(EventLoop, StopRunsWhatWasPostedBeforeAndRefusesLaterPosts) {
  EventLoop loop;
  std::atomic<int> ran{0};
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(loop.post([&] { ++ran; }));
  std::thread t([&] { loop.run(); });
  loop.stop();
  t.join();
  EXPECT_EQ(ran.load(), 10);
  EXPECT_FALSE(loop.post([&] { ++ran; }));
  EXPECT_EQ(ran.load(), 10);
}

TEST(EventLoop, AnExceptionInACallbackIsReportedAndTheLoopGoesOn) {
  EventLoop loop;
  std::vector<std::string> logged;
  loop.set_error_log([&](const std::string& m) { logged.push_back(m); });
  std::thread t([&] { loop.run(); });
  std::promise<void> after;
  loop.post([] { throw std::runtime_error("boom"); });
  loop.post([&] { after.set_value(); });
  // Bounded, and ending the run when it runs out: an ASSERT's return would destroy `t` joinable
  // (std::terminate, the failure unreported).
  auto went_on = after.get_future();
  get_within(went_on, kHangGuard, "the task after the throwing one never ran");
  loop.stop();
  t.join();
  ASSERT_EQ(logged.size(), 1u);
  EXPECT_NE(logged[0].find("boom"), std::string::npos);
}

}  // namespace
}  // namespace tandem::net::detail
