#include "cli/engine_child.h"

#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/engine_http.h"
#include "net/scripted_server.h"
#include "text/oracle_support.h"
#include "util/error.h"

namespace tandem::cli {
namespace {

using tandem::testing::eventually;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

TEST(EngineChildLines, PortsAreReadAfterIpv4AndIpv6Hosts) {
  EXPECT_EQ(engine_line_port("tandem engine: listening on http://127.0.0.1:8000 (model m)\n",
                             "listening on http://"),
            8000);
  EXPECT_EQ(engine_line_port("tandem engine: listening on http://[::1]:44879 (model m)\n",
                             "listening on http://"),
            44879);
  // Engines before the brackets printed IPv6 hosts bare: the port follows the last ':'.
  EXPECT_EQ(engine_line_port("tandem engine: listening on http://::1:44879 (model m)\n",
                             "listening on http://"),
            44879);
  EXPECT_EQ(engine_line_port("tandem engine: role prefill, KV transfer on ::1:5555 (advertised as "
                             "::1), engine id e\n",
                             "KV transfer on "),
            5555);
  EXPECT_EQ(engine_line_port("listening on http://h:65535", "listening on http://"), 65535);
}

TEST(EngineChildLines, ALineWithoutAPortIsAnErrorQuotingIt) {
  for (const std::string line :
       {"tandem engine: listening on http://::1:x (model m)\n", "listening on http://[::1] (m)",
        "listening on http://h:70000 (m)", "listening on http://h: (m)",
        "listening on http://h:0 (m)", "listening on http://8000"}) {
    try {
      engine_line_port(line, "listening on http://");
      ADD_FAILURE() << "no error for: " << line;
    } catch (const Error& e) {
      std::string quoted = line;
      if (quoted.back() == '\n') quoted.pop_back();
      EXPECT_THAT(e.what(), HasSubstr("'" + quoted + "' (expected HOST:PORT or [IPV6]:PORT)"));
    }
  }
}

// A fake engine (sh) that names its ports at its first start; a restart (its marker file exists)
// hangs before naming any, as an engine whose load never ends.
struct FakeEngine {
  std::filesystem::path marker = test::temp_path("fake-engine-started");
  ~FakeEngine() { std::filesystem::remove(marker); }
  EngineChild::Args args() const {
    return [m = marker.string()](const EnginePorts&) {
      return std::vector<std::string>{
          "sh", "-c",
          "if [ -e \"$1\" ]; then exec sleep 1000; fi; : > \"$1\"; "
          "echo 'tandem engine: listening on http://[::1]:4321 (model fake)'; "
          "echo 'tandem engine: role both'; exec sleep 1000",
          "sh", m};
    };
  }
};

EngineChild::Options options(std::chrono::milliseconds start_timeout) {
  EngineChild::Options o;
  o.name = "decode engine";
  o.program = "/bin/sh";
  o.start_timeout = start_timeout;
  return o;
}

// Supervises the engine at `now` until serve has seen its process end: its restart backs off.
bool backs_off(EngineChild& child, EngineChild::Clock::time_point now) {
  return eventually([&] {
    child.supervise(now);
    return child.state() == EngineChild::State::kBackingOff;
  });
}

// Kills the running engine (SIGKILL, as a crash would end it) and supervises it until it backs off.
::testing::AssertionResult killed_and_backing_off(EngineChild& child,
                                                  EngineChild::Clock::time_point now) {
  const pid_t pid = child.pid();
  if (::kill(pid, SIGKILL) != 0) return ::testing::AssertionFailure() << "cannot kill pid " << pid;
  if (!backs_off(child, now)) return ::testing::AssertionFailure() << "not backing off";
  return ::testing::AssertionSuccess();
}

char process_state(pid_t pid) {  // /proc/PID/stat's third field: R, S, T (stopped), Z (zombie)
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), {});
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? '?' : stat[paren + 2];
}

// A restart starts the engine and returns: its lines are read on later ticks. One that names no
// ports by its deadline (the clock is the caller's) is killed, stopped or not, and backs off.
TEST(EngineChild, ARestartDoesNotWaitForTheEngineAndEndsAtItsDeadline) {
  const StopSignals signals;
  FakeEngine fake;
  const auto t0 = EngineChild::Clock::now();
  EngineChild child(options(5min), fake.args(), signals);
  ASSERT_EQ(child.state(), EngineChild::State::kRunning);
  EXPECT_EQ(child.ports().http, 4321);
  const pid_t first = child.pid();

  ASSERT_TRUE(killed_and_backing_off(child, t0));
  EXPECT_EQ(child.pid(), -1);
  child.supervise(t0 + 1h);  // the back-off is over: starts it, and returns
  ASSERT_EQ(child.state(), EngineChild::State::kStarting);
  const pid_t stuck = child.pid();
  ASSERT_GT(stuck, 0);
  EXPECT_NE(stuck, first);
  child.supervise(t0 + 1h + 4min);  // within its deadline
  EXPECT_EQ(child.state(), EngineChild::State::kStarting);
  ASSERT_EQ(::kill(stuck, SIGSTOP), 0);  // SIGTERM would not end it now
  child.supervise(t0 + 1h + 5min);
  EXPECT_EQ(child.state(), EngineChild::State::kBackingOff);
  EXPECT_EQ(child.pid(), -1);
  EXPECT_EQ(::kill(stuck, 0), -1) << "not killed and reaped at its deadline";

  // terminate() while it starts: SIGKILL, which ends a stopped engine too (the destructor waits).
  child.supervise(t0 + 2h);
  ASSERT_EQ(child.state(), EngineChild::State::kStarting);
  const pid_t starting = child.pid();
  ASSERT_EQ(::kill(starting, SIGSTOP), 0);
  child.terminate();
  EXPECT_TRUE(eventually([&] { return process_state(starting) == 'Z'; }))
      << "state " << process_state(starting);
}

// A running engine whose /health goes unanswered (this one is stopped with SIGSTOP, and the
// probe, which serve runs over HTTP, answers as it would) is killed once unanswered for the hang
// timeout, and restarted on its ports. An answer in between starts the count over, and so does
// a long pause of serve's own (Ctrl-Z): the count starts at an unanswered probe's start.
TEST(EngineChild, AnEngineWhoseHealthGoesUnansweredForTheHangTimeoutIsKilledAndRestarted) {
  const StopSignals signals;
  const auto args = [](const EnginePorts&) {
    return std::vector<std::string>{
        "sh", "-c",
        "echo 'tandem engine: listening on http://[::1]:4321 (model fake)'; "
        "echo 'tandem engine: role both'; exec sleep 1000"};
  };
  bool answering = true;
  int probes = 0;
  EngineChild::Options o = options(5min);
  o.hang_timeout = 30s;
  o.probe_interval = 5s;
  o.probe = [&](const EnginePorts& ports) {
    ++probes;
    EXPECT_EQ(ports.http, 4321);
    std::promise<bool> answer;
    answer.set_value(answering);
    return answer.get_future();
  };
  EngineChild child(o, args, signals);
  ASSERT_EQ(child.state(), EngineChild::State::kRunning);
  const pid_t first = child.pid();
  const auto t0 = EngineChild::Clock::now();  // after it started: its first probe is due at 5 s
  const auto at = [&](std::chrono::seconds s) {
    child.supervise(t0 + s);
    return child.state();
  };

  EXPECT_EQ(at(5s), EngineChild::State::kRunning);
  EXPECT_EQ(probes, 1);
  answering = false;
  EXPECT_EQ(at(10s), EngineChild::State::kRunning);  // unanswered since 10 s
  answering = true;
  EXPECT_EQ(at(35s), EngineChild::State::kRunning);  // answered: the count starts over
  answering = false;
  EXPECT_EQ(at(300s), EngineChild::State::kRunning) << "serve paused is no hang of the engine's";

  ASSERT_EQ(::kill(first, SIGSTOP), 0);
  EXPECT_EQ(at(329s), EngineChild::State::kRunning);  // unanswered for 29 s
  EXPECT_EQ(at(333s), EngineChild::State::kRunning);  // no probe due: nothing new known
  EXPECT_EQ(probes, 5);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(at(334s), EngineChild::State::kBackingOff);  // unanswered for 34 s
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "tandem serve: decode engine on port 4321 (pid " + std::to_string(first) +
                ") is hung: its /health has not answered for 34.0 s (--engine-hang-seconds: "
                "30.0 s); killed it (SIGKILL), restarting it in 1.0 s\n");
  EXPECT_EQ(child.pid(), -1);
  EXPECT_EQ(::kill(first, 0), -1) << "not killed and reaped: state " << process_state(first);

  answering = true;
  EXPECT_NE(at(1h), EngineChild::State::kBackingOff);  // the back-off is over: started again
  EXPECT_TRUE(eventually([&] { return at(1h) == EngineChild::State::kRunning; }));
  EXPECT_NE(child.pid(), first);
  EXPECT_EQ(child.ports().http, 4321);
  const int before = probes;
  EXPECT_EQ(at(1h + 5s), EngineChild::State::kRunning);
  EXPECT_EQ(probes, before + 1) << "the restarted engine is probed as the first was";
}

// The fake engine of the probe tests: names its ports and runs until killed.
std::vector<std::string> running_engine(const EnginePorts&) {
  return {"sh", "-c",
          "echo 'tandem engine: listening on http://[::1]:4321 (model fake)'; "
          "echo 'tandem engine: role both'; exec sleep 1000"};
}

// serve's probes wait at most half the hang timeout: one that serve reads as failed long after
// it started (an answer slower than that under load, or a late tick of serve's) is no hang. The
// engine is killed only once a second probe goes unanswered too.
TEST(EngineChild, OneUnansweredProbeNeverKillsTheEngineHoweverLongItTook) {
  const StopSignals signals;
  std::vector<std::promise<bool>> answers;
  EngineChild::Options o = options(5min);
  o.hang_timeout = 1s;
  o.probe_interval = 333ms;
  o.probe = [&](const EnginePorts&) {
    answers.emplace_back();
    return answers.back().get_future();
  };
  EngineChild child(o, running_engine, signals);
  ASSERT_EQ(child.state(), EngineChild::State::kRunning);
  const pid_t pid = child.pid();
  const auto t0 = EngineChild::Clock::now();
  child.supervise(t0 + 1s);  // the first probe starts
  ASSERT_EQ(answers.size(), 1u);
  answers[0].set_value(false);
  child.supervise(t0 + 10s);  // read 9 s after it started
  EXPECT_EQ(child.state(), EngineChild::State::kRunning) << "one slow probe killed the engine";
  EXPECT_EQ(child.pid(), pid);

  child.supervise(t0 + 10s + 1ms);  // the second probe starts
  ASSERT_EQ(answers.size(), 2u);
  answers[1].set_value(false);
  ::testing::internal::CaptureStderr();
  child.supervise(t0 + 10s + 2ms);
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(child.state(), EngineChild::State::kBackingOff);
  EXPECT_THAT(said, HasSubstr("is hung: its /health has not answered for 9.0 s"));
}

// serve runs each probe on a thread of its own (std::async): with no thread to be had, that probe
// is skipped and said, and serve goes on supervising (and probes again when the next one is due).
TEST(EngineChild, AProbeWithNoThreadForItIsSkippedAndServeGoesOn) {
  const StopSignals signals;
  int probes = 0;
  EngineChild::Options o = options(5min);
  o.hang_timeout = 30s;
  o.probe_interval = 5s;
  o.probe = [&](const EnginePorts&) {
    if (++probes == 1)
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                              "thread");
    std::promise<bool> answer;
    answer.set_value(true);
    return answer.get_future();
  };
  EngineChild child(o, running_engine, signals);
  ASSERT_EQ(child.state(), EngineChild::State::kRunning);
  const auto t0 = EngineChild::Clock::now();
  ::testing::internal::CaptureStderr();
  EXPECT_NO_THROW(child.supervise(t0 + 5s));
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("tandem serve: decode engine on port 4321: cannot probe its /health now "
                        "(thread: "));
  EXPECT_EQ(child.state(), EngineChild::State::kRunning);
  child.supervise(t0 + 10s);
  EXPECT_EQ(probes, 2);
  EXPECT_EQ(child.state(), EngineChild::State::kRunning);
}

// A restart whose process cannot be started at all (fork fails; here its command line cannot be
// made) says which ports it tries again and how often, as a restart whose engine fails does.
TEST(EngineChild, ARestartWhoseProcessCannotStartSaysWhichPortsItTriesAgainAndHowOften) {
  const StopSignals signals;
  int starts = 0;
  const auto args = [&](const EnginePorts& ports) {
    if (++starts > 1) throw Error("cannot fork");
    return running_engine(ports);
  };
  EngineChild child(options(5min), args, signals);
  ASSERT_EQ(child.state(), EngineChild::State::kRunning);
  const auto t0 = EngineChild::Clock::now();
  ASSERT_TRUE(killed_and_backing_off(child, t0));
  ::testing::internal::CaptureStderr();
  child.supervise(t0 + 1h);
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(child.state(), EngineChild::State::kBackingOff);
  EXPECT_EQ(said,
            "tandem serve: decode engine on port 4321 did not restart (cannot fork); trying again "
            "on its ports (HTTP 4321) in 2.0 s, then every 30.0 s at most while it fails\n");
}

// serve's probe: an engine at its --max-connections cap accepts a connection and closes it (or
// resets it) at once, a busy engine that is alive; only one that never answers (this listener
// accepts nothing: the kernel completes the handshake, as for a stopped engine) is unanswered.
TEST(EngineHealthProbe, OnlyAnEngineThatNeverAnswersIsUnanswered) {
  net::ScriptedServer closes([](int&, int) {});  // closed unread when the script returns
  net::ScriptedServer resets([](int& fd, int) {
    const linger reset{.l_onoff = 1, .l_linger = 0};
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
    ::close(fd);
    fd = -1;
  });
  net::ScriptedServer answers([](int& fd, int) {
    std::string buffer;
    net::ScriptedServer::read_head(fd, buffer);
    net::ScriptedServer::write(fd, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n");
  });
  // A wait no passing test waits for: these answer at once.
  const auto on = [](uint16_t port) {
    EnginePorts ports;
    ports.http = port;
    return ports;
  };
  const auto probe = engine_health_probe("127.0.0.1", 60s);
  EXPECT_TRUE(probe(on(closes.port())).get()) << "closed at once";
  EXPECT_TRUE(probe(on(resets.port())).get()) << "reset at once";
  EXPECT_TRUE(probe(on(answers.port())).get()) << "answered 503";

  uint16_t port = 0;
  const int silent = net::listen_on_loopback(port);
  EXPECT_FALSE(engine_health_probe("127.0.0.1", 50ms)(on(port)).get());
  ::close(silent);
}

// A restart that fails because another process took the engine's port since (the engine says
// so and exits) is tried again on those very ports: serve's line says which, and how often.
TEST(EngineChild, ARestartThatFailsSaysWhichPortsItTriesAgainAndHowOften) {
  const StopSignals signals;
  const std::filesystem::path marker = test::temp_path("fake-engine-started");
  const auto args = [m = marker.string()](const EnginePorts&) {
    return std::vector<std::string>{
        "sh", "-c",
        "if [ -e \"$1\" ]; then echo 'tandem: error: --port 4321: in use' >&2; exit 1; fi; "
        ": > \"$1\"; echo 'tandem engine: listening on http://[::1]:4321 (model fake)'; "
        "echo 'tandem engine: role prefill, KV transfer on [::1]:5555 (advertised as ::1)'; "
        "exec sleep 1000",
        "sh", m};
  };
  EngineChild child(options(5min), args, signals);
  ASSERT_EQ(child.state(), EngineChild::State::kRunning);
  const auto t0 = EngineChild::Clock::now();
  ASSERT_TRUE(killed_and_backing_off(child, t0));
  ::testing::internal::CaptureStderr();
  child.supervise(t0 + 1h);  // starts it again: it fails at once
  const bool backed_off = backs_off(child, t0 + 1h);
  const std::string said = ::testing::internal::GetCapturedStderr();
  std::filesystem::remove(marker);
  ASSERT_TRUE(backed_off) << said;
  EXPECT_THAT(said, HasSubstr("tandem: error: --port 4321: in use"));
  EXPECT_THAT(said, HasSubstr("tandem serve: decode engine on port 4321 (pid "));
  EXPECT_THAT(said, HasSubstr("did not restart (its output ended before it named its ports (see "
                              "its messages above)); trying again on its ports (HTTP 4321, KV "
                              "transfer 5555) in 2.0 s, then every 30.0 s at most while it "
                              "fails\n"));
}

// At serve's stop a running engine gets SIGTERM; one that does not act on it (it ignores it
// here, as a hung one would) is killed at the deadline instead of holding serve's shutdown.
TEST(EngineChild, ARunningEngineThatIgnoresTheStopIsKilledAtTheDeadline) {
  const StopSignals signals;
  const auto args = [](const EnginePorts&) {
    return std::vector<std::string>{
        "sh", "-c",
        "trap '' TERM; echo 'tandem engine: listening on http://[::1]:4321 (model fake)'; "
        "echo 'tandem engine: role both'; while :; do sleep 1; done"};
  };
  EngineChild child(options(5min), args, signals);
  ASSERT_EQ(child.state(), EngineChild::State::kRunning);
  const pid_t pid = child.pid();
  child.terminate();
  child.wait_until(EngineChild::Clock::now() + std::chrono::milliseconds(100));
  EXPECT_EQ(::kill(pid, 0), -1) << "still there: state " << process_state(pid);
}

// At serve's stop a running engine gets one SIGTERM and the rest of the grace to drain. A second
// one (ChildProcess::stop's, after terminate()'s) is an engine's order to cut its drain: every
// Ctrl-C of serve printed "the requests left are cut", and an --engine-arg=--shutdown-timeout
// was cut short. This engine drains until a second SIGTERM comes (the deadline's SIGKILL ends
// it otherwise).
TEST(EngineChild, ARunningEngineGetsOneStopSignalAndItsGraceToDrain) {
  const StopSignals signals;
  const std::filesystem::path seen = test::temp_path("engine-stop-signals");
  const auto args = [f = seen.string()](const EnginePorts&) {
    return std::vector<std::string>{
        "sh", "-c",
        "n=0; trap 'n=$((n+1)); echo TERM >> \"$1\"' TERM; "
        "echo 'tandem engine: listening on http://[::1]:4321 (model fake)'; "
        "echo 'tandem engine: role both'; while [ $n -lt 2 ]; do sleep 0.01 & wait $!; done",
        "sh", f};
  };
  const auto signals_seen = [&] {
    std::ifstream in(seen);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EngineChild child(options(5min), args, signals);
  ASSERT_EQ(child.state(), EngineChild::State::kRunning);
  child.terminate();
  // Told apart from what wait_until may send: two signals pending at once would count as one.
  ASSERT_TRUE(eventually([&] { return signals_seen() == "TERM\n"; })) << signals_seen();
  child.wait_until(EngineChild::Clock::now() + std::chrono::milliseconds(300));
  EXPECT_EQ(signals_seen(), "TERM\n");
  std::filesystem::remove(seen);
}

// An engine given a drain longer than the default grace (--engine-arg=--shutdown-timeout 60)
// is not killed in the middle of it: serve waits for the drain and a margin.
TEST(EngineStopGrace, IsTheEnginesDrainAndAMarginWhenThatIsLongerThanTheDefault) {
  EXPECT_EQ(engine_stop_grace(0ms), ChildProcess::kStopGrace);
  EXPECT_EQ(engine_stop_grace(5s), ChildProcess::kStopGrace);
  EXPECT_GT(engine_stop_grace(60s), 60s);
  EXPECT_GT(engine_stop_grace(ChildProcess::kStopGrace), ChildProcess::kStopGrace);
}

// A fake engine for the stop tests: says what serve waits for, then runs `trap` and `loop` in
// sh, with "$1" the file it writes the signals it saw to (read back by file_text).
auto fake_engine(const std::filesystem::path& seen, const std::string& trap,
                 const std::string& loop) {
  return [f = seen.string(), trap, loop](const EnginePorts&) {
    return std::vector<std::string>{
        "sh", "-c",
        trap +
            "; echo 'tandem engine: listening on http://[::1]:4321 (model fake)'; "
            "echo 'tandem engine: role both'; " +
            loop,
        "sh", f};
  };
}

std::string file_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A second Ctrl-C while serve waits for its engines to drain cuts their drain, as it cuts the
// gateways': each engine gets its second SIGTERM and ends now, not at the deadline's SIGKILL.
// This engine drains until a second SIGTERM comes, then says it ended by itself.
TEST(EngineChild, AnotherStopSignalWhileTheEnginesDrainSendsEachItsSecondSigterm) {
  const StopSignals signals;
  const std::filesystem::path seen = test::temp_path("engine-stop-signals");
  const auto args =
      fake_engine(seen, "n=0; trap 'n=$((n+1)); echo TERM >> \"$1\"' TERM",
                  "while [ $n -lt 2 ]; do sleep 0.01 & wait $!; done; echo END >> \"$1\"");
  const auto signals_seen = [&] { return file_text(seen); };
  std::vector<std::unique_ptr<EngineChild>> engines;
  engines.push_back(std::make_unique<EngineChild>(options(5min), args, signals));
  ASSERT_EQ(engines[0]->state(), EngineChild::State::kRunning);
  // The second Ctrl-C, once the engine drains after the first SIGTERM (two pending at once would
  // count as one); to this thread, which alone waits for it (StopSignals blocked it here).
  const pthread_t waiting = ::pthread_self();
  std::thread second_ctrl_c([&] {
    if (eventually([&] { return signals_seen() == "TERM\n"; })) ::pthread_kill(waiting, SIGINT);
  });
  // A grace no passing test waits for: the engine ends long before it, or is killed at it (no END).
  stop_engines(engines, 2min, signals, "test");
  second_ctrl_c.join();
  EXPECT_EQ(signals_seen(), "TERM\nTERM\nEND\n");
  std::filesystem::remove(seen);
}

// Once a second Ctrl-C cuts the drain, the long grace a drain was given
// (--engine-arg=--shutdown-timeout 1800) no longer holds: an engine that ignores even its second
// SIGTERM is killed after the short grace, not half an hour later.
TEST(EngineChild, AnEngineHungAfterTheCutIsKilledAtTheShortGraceNotTheDrains) {
  const StopSignals signals;
  const std::filesystem::path seen = test::temp_path("engine-stop-hung");
  const auto args = fake_engine(seen, "trap 'echo TERM >> \"$1\"' TERM",
                                "while :; do sleep 0.01 & wait $!; done");
  const auto signals_seen = [&] { return file_text(seen); };
  std::vector<std::unique_ptr<EngineChild>> engines;
  engines.push_back(std::make_unique<EngineChild>(options(5min), args, signals));
  ASSERT_EQ(engines[0]->state(), EngineChild::State::kRunning);
  const pid_t engine = engines[0]->pid();
  const pthread_t waiting = ::pthread_self();
  std::atomic<bool> stopped = false;
  bool killed_after_the_cut = false;
  std::thread second_ctrl_c([&] {
    if (!eventually([&] { return signals_seen() == "TERM\n"; })) return;
    ::pthread_kill(waiting, SIGINT);
    killed_after_the_cut = eventually([&] { return stopped.load(); });
    if (!killed_after_the_cut) ::kill(engine, SIGKILL);  // so that the test fails, not hangs
  });
  stop_engines(engines, engine_stop_grace(1800s), signals, "test", 0ms);
  stopped = true;
  second_ctrl_c.join();
  EXPECT_TRUE(killed_after_the_cut);  // this engine never ends by itself
  EXPECT_TRUE(engines[0]->ended());
  std::filesystem::remove(seen);
}

// The first start fails with an error naming the engine and the line it could not read, rather
// than an exception from deep inside (std::stoi's "stoi"), and leaves no engine behind.
TEST(EngineChild, AnUnreadablePortLineFailsTheStartQuotingIt) {
  const StopSignals signals;
  const auto args = [](const EnginePorts&) {
    return std::vector<std::string>{
        "sh", "-c", "echo 'tandem engine: listening on http://::1:x (model m)'; exec sleep 1000"};
  };
  try {
    EngineChild child(options(5min), args, signals);
    ADD_FAILURE() << "started";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("serve: decode engine did not start: cannot read a port"));
    EXPECT_THAT(e.what(), HasSubstr("'tandem engine: listening on http://::1:x (model m)'"));
  }
}

// An engine that names no ports within its start timeout at the first start fails it.
TEST(EngineChild, AFirstStartPastItsTimeoutFails) {
  const StopSignals signals;
  const auto args = [](const EnginePorts&) {
    return std::vector<std::string>{"sh", "-c", "exec sleep 1000"};
  };
  try {
    EngineChild child(options(100ms), args, signals);
    ADD_FAILURE() << "started";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("decode engine did not start: it named no ports within 0.1 s "
                                    "(--engine-start-timeout)"));
  }
}

}  // namespace
}  // namespace tandem::cli
