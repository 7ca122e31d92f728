#pragma once
// A long stop (a drain) that an operator may cut short with a second stop signal: the one loop
// that `tandem engine`'s stop and the gateways' stops (gateway::stop_together) share.
#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

namespace tandem::util {

// Runs `work` on a thread of its own and meanwhile asks `interrupted(wait)` again and again: it
// waits up to `wait` for a reason to cut the work short and says whether one came. At the first
// yes, `cut` runs (it must make `work` end soon) and nothing more is asked. Returns once `work`
// has. Without `interrupted`, nothing can cut the work: it runs on the calling thread.
inline void run_interruptibly(
    const std::function<void()>& work,
    const std::function<bool(std::chrono::milliseconds wait)>& interrupted,
    const std::function<void()>& cut) {
  if (!interrupted) return work();
  // How long one wait for an interruption lasts: how late, at most, the end of `work` is seen.
  constexpr auto kLook = std::chrono::milliseconds(50);
  std::atomic<bool> done{false};
  std::thread worker([&] {
    work();
    done = true;
  });
  while (!done.load()) {
    if (interrupted(kLook)) {
      cut();
      break;
    }
  }
  worker.join();
}

}  // namespace tandem::util
