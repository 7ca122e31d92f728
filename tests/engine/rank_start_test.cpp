// The front's wait for its expert-parallel ranks to say "ready": real child processes (shell
// one-liners standing in for `tandem ep-rank`), so an exit, a wrong first line and a rank that
// never answers are each seen as the engine would see them.
#include "engine/expert_parallel/rank_start.h"

#include <gtest/gtest.h>

#include "util/error.h"

namespace tandem::engine::ep {
namespace {

using std::chrono::milliseconds;

std::vector<std::unique_ptr<ChildProcess>> ranks(const std::vector<std::string>& scripts) {
  std::vector<std::unique_ptr<ChildProcess>> out;
  for (const auto& s : scripts)
    out.push_back(
        std::make_unique<ChildProcess>("/bin/sh", std::vector<std::string>{"sh", "-c", s}));
  return out;
}

std::string error_of(const std::vector<std::unique_ptr<ChildProcess>>& r, milliseconds timeout) {
  try {
    await_ranks_ready(r, timeout);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(AwaitRanksReady, ReturnsOnceEveryRankSaidReady) {
  const auto r = ranks({"echo ready; exec sleep 30", "sleep 0.1; echo ready; exec sleep 30"});
  EXPECT_EQ(error_of(r, milliseconds(0)), "");
  EXPECT_FALSE(r[0]->exited());
  EXPECT_FALSE(r[1]->exited());
}

TEST(AwaitRanksReady, ARankThatExitsFirstIsNamedWithItsStatus) {
  const auto r = ranks({"echo ready; exec sleep 30", "echo loading failed >&2; exit 3"});
  const std::string e = error_of(r, milliseconds(0));
  EXPECT_NE(e.find("rank 2 did not start (exit status 3"), std::string::npos) << e;
}

TEST(AwaitRanksReady, ARankThatNeverAnswersIsNamedAndKilledAtTheDeadline) {
  // Alive, silent, and deaf to SIGTERM, like a stopped or frozen rank. It is the first one read:
  // a rank that answers before it would have to do so within the deadline, however slowly a
  // loaded machine starts its shell.
  const auto r = ranks({"trap '' TERM; exec sleep 30", "echo ready; exec sleep 30"});
  const std::string e = error_of(r, milliseconds(300));
  EXPECT_NE(e.find("rank 1 did not say it was ready within 0.3 s"), std::string::npos) << e;
  EXPECT_NE(e.find("--expert-parallel-stall-timeout"), std::string::npos) << e;
  EXPECT_TRUE(r[0]->exited());  // killed, not left behind
}

TEST(AwaitRanksReady, ALineOtherThanReadyIsNotReady) {
  const auto r = ranks({"echo hello; exec sleep 30"});
  const std::string e = error_of(r, milliseconds(0));
  EXPECT_NE(e.find("rank 1 did not start"), std::string::npos) << e;
}

}  // namespace
}  // namespace tandem::engine::ep
