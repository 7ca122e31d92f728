#pragma once
// Waits that fail a test instead of hanging it when the code under test never gets there: a
// hang hides the failure that caused it and holds CI until ctest's timeout (15 minutes).
//
// A wait that runs out ends the whole test binary (abort) after recording the failure: returning
// would leave the test to its destructors, which wait too (a std::async future's waits for its
// thread, a server's stop for the requests it holds), so the run would hang there instead.
#include <gtest/gtest.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <source_location>
#include <string>
#include <string_view>
#include <thread>

#include "util/thread_state.h"

namespace tandem::testing {

// How long a test waits for what should come at once before it fails: generous, for a loaded
// machine, as it only turns a hang into a failure. The sanitizer build (-O0 with ASan) computes
// a tiny model's steps 20-30 times slower, so it waits longer.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr std::chrono::seconds kHangGuard{300};
#else
inline constexpr std::chrono::seconds kHangGuard{60};
#endif

// Records `what` as the failure of the test's line `where`, then ends the run (see above).
[[noreturn]] inline void fail_hung(std::string_view what, std::chrono::seconds limit,
                                   const std::source_location& where) {
  ADD_FAILURE_AT(where.file_name(), where.line())
      << what << " (not within " << limit.count() << " s; ending the run, not hanging)";
  std::fflush(stdout);
  std::abort();
}

// `future`'s value, once ready within `limit`.
template <class T>
T get_within(std::future<T>& future, std::chrono::seconds limit = kHangGuard,
             std::string_view what = "the future was not ready",
             const std::source_location& where = std::source_location::current()) {
  if (future.wait_for(limit) != std::future_status::ready) fail_hung(what, limit, where);
  return future.get();
}

// Calls `step` until it returns true, for at most `limit` (a test's busy-wait: a condition it
// polls, an engine it steps until an answer is out).
template <class Step>
void repeat_until(Step&& step, std::chrono::seconds limit, std::string_view what,
                  const std::source_location& where = std::source_location::current()) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!step()) {
    if (std::chrono::steady_clock::now() > deadline) fail_hung(what, limit, where);
    std::this_thread::yield();  // a polled condition waits for another thread, on 2 cores maybe
  }
}

// Returns once thread `tid` of this process sleeps in the kernel (in a blocking call: a read, an
// accept, a futex wait) or has ended: how a test lets another thread reach the call it blocks in
// before acting, where either order must work but the blocked one is the order worth testing, or
// before checking what that thread must not have done yet. It waits on the thread's state
// (/proc/self/task/TID/stat), not for a guessed time. A thread is taken to have ended only when
// its entry is gone from a /proc/self/task that can be read; a state it cannot read (no /proc,
// a sandbox that hides it) fails the test, rather than passing it for a thread that never ran.
inline void wait_until_asleep(pid_t tid, std::string_view what = "the thread never blocked",
                              std::chrono::seconds limit = kHangGuard,
                              const std::source_location& where = std::source_location::current()) {
  const std::string stat = "/proc/self/task/" + std::to_string(tid) + "/stat";
  repeat_until(
      [&] {
        const ProcStat s = read_proc_stat(stat);
        // ended (ESRCH: it ended between the open and the read of its stat)
        if ((s.error == ENOENT || s.error == ESRCH) && ::access("/proc/self/task", R_OK) == 0)
          return true;
        if (s.error != 0) {
          ADD_FAILURE_AT(where.file_name(), where.line())
              << what << ": cannot observe thread state (" << stat << ": " << std::strerror(s.error)
              << ")";
          std::fflush(stdout);
          std::abort();  // as fail_hung: the test's destructors may wait for that thread
        }
        return s.state == 'S' || s.state == 'D' || s.state == 'Z' || s.state == 'X';
      },
      limit, what, where);
}

}  // namespace tandem::testing
