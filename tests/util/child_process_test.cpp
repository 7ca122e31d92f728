#include "util/child_process.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "engine/engine_http.h"

namespace tandem {
namespace {

using testing::eventually;

// A supervisor reads a child's lines as they come: a whole line once it is there, nothing (at
// once) while the child has printed only part of one, however long the child then runs.
TEST(ChildProcess, PollLineGivesWholeLinesAndNeverWaitsForTheRest) {
  ChildProcess child("/bin/sh", {"sh", "-c", "printf 'one\\ntw'; exec sleep 1000"});
  std::optional<std::string> line;
  ASSERT_TRUE(eventually([&] { return (line = child.poll_line()).has_value(); }));
  EXPECT_EQ(*line, "one\n");
  // "tw" came without its newline: not a line yet, and the call returns without one.
  EXPECT_EQ(child.poll_line(std::chrono::milliseconds(50)), std::nullopt);
  EXPECT_EQ(child.stop(), 128 + SIGTERM);
  EXPECT_EQ(child.poll_line(), "");  // stopped: the end of its output
}

// read_line blocks for a whole line as before; a last line without its newline comes as it is,
// then the end.
TEST(ChildProcess, ReadLineGivesEveryLineThenTheEnd) {
  ChildProcess child("/bin/sh", {"sh", "-c", "printf 'a\\nb\\nlast'"});
  EXPECT_EQ(child.read_line(), "a\n");
  EXPECT_EQ(child.poll_line(std::chrono::milliseconds(-1)), "b\n");
  EXPECT_EQ(child.read_line(), "last");
  EXPECT_EQ(child.read_line(), "");
  EXPECT_EQ(child.stop(), 0);
}

// A child that does not act on SIGTERM (it ignores it, or is stopped) is killed after the grace
// period instead of holding its parent's shutdown forever.
TEST(ChildProcess, StopKillsAChildThatOutlivesItsGracePeriod) {
  ChildProcess deaf("/bin/sh", {"sh", "-c", "trap '' TERM; echo ready; while :; do sleep 1; done"});
  ASSERT_EQ(deaf.read_line(), "ready\n");
  EXPECT_EQ(deaf.stop(std::chrono::milliseconds(100)), 128 + SIGKILL);
  EXPECT_EQ(deaf.stop(), 128 + SIGKILL);  // idempotent

  // Stopped with a SIGTERM handler, as an engine has one (a signal it would die of unhandled
  // ends even a stopped process).
  ChildProcess stopped("/bin/sh",
                       {"sh", "-c", "trap 'exit 0' TERM; echo ready; while :; do sleep 1; done"});
  ASSERT_EQ(stopped.read_line(), "ready\n");
  stopped.signal(SIGSTOP);
  EXPECT_EQ(stopped.stop(std::chrono::milliseconds(100)), 128 + SIGKILL);
}

// A child started later does not inherit an earlier child's pipe (it would keep the earlier
// child writing into a pipe nobody reads after its parent stopped reading).
TEST(ChildProcess, ALaterChildDoesNotHoldAnEarlierChildsPipe) {
  ChildProcess first("/bin/sh", {"sh", "-c", "echo ready; exec sleep 1000"});
  ASSERT_EQ(first.read_line(), "ready\n");
  std::error_code ec;
  const std::string pipe =
      std::filesystem::read_symlink("/proc/" + std::to_string(first.pid()) + "/fd/1", ec).string();
  ASSERT_FALSE(ec);
  ASSERT_EQ(pipe.rfind("pipe:", 0), 0u) << pipe;
  ChildProcess second("/bin/sh",
                      {"sh", "-c", "for f in /proc/$$/fd/*; do readlink $f; done; echo end"});
  std::string held;
  for (std::string line = second.read_line(); line != "end\n" && !line.empty();
       line = second.read_line())
    held += line;
  EXPECT_EQ(held.find(pipe), std::string::npos) << held;
}

// `tandem` ignores SIGPIPE; the programs it starts get the default action back.
TEST(ChildProcess, AChildGetsTheDefaultSigpipeEvenWhenItsParentIgnoresIt) {
  const auto before = ::signal(SIGPIPE, SIG_IGN);
  ChildProcess child("/bin/cat", {"cat", "/proc/self/status"});
  ::signal(SIGPIPE, before);
  uint64_t ignored = ~uint64_t{0};
  for (std::string line = child.read_line(); !line.empty(); line = child.read_line())
    if (line.rfind("SigIgn:", 0) == 0) ignored = std::stoull(line.substr(7), nullptr, 16);
  ASSERT_NE(ignored, ~uint64_t{0}) << "no SigIgn line";
  EXPECT_EQ(ignored & (uint64_t{1} << (SIGPIPE - 1)), 0u);
}

// A program that cannot be run ends its child with 127, as a shell reports it, and says why on
// standard error: a supervisor's "its messages are above" must point at something.
TEST(ChildProcess, AProgramThatCannotBeRunIsNamedOnStandardErrorWithWhy) {
  int errors[2];
  ASSERT_EQ(pipe2(errors, O_CLOEXEC), 0);
  {
    ChildProcess child("/nonexistent/tandem", {"tandem", "engine"},
                       [&errors] { ::dup2(errors[1], STDERR_FILENO); });
    EXPECT_EQ(child.read_line(), "");
    EXPECT_EQ(child.stop(), 127);
  }
  ::close(errors[1]);
  std::string said;
  char chunk[256];
  for (ssize_t n; (n = ::read(errors[0], chunk, sizeof chunk)) > 0;) said.append(chunk, size_t(n));
  ::close(errors[0]);
  EXPECT_EQ(said, "cannot execute /nonexistent/tandem: No such file or directory\n");
}

}  // namespace
}  // namespace tandem
