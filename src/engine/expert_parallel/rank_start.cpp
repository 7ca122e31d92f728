#include "engine/expert_parallel/rank_start.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "util/error.h"

namespace tandem::engine::ep {

void await_ranks_ready(std::span<const std::unique_ptr<ChildProcess>> ranks,
                       std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const bool forever = timeout.count() <= 0;
  const Clock::time_point deadline = Clock::now() + timeout;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const std::string name = "expert parallelism: rank " + std::to_string(i + 1);
    std::optional<std::string> line;
    if (forever) {
      line = ranks[i]->read_line();
    } else {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
      line = ranks[i]->poll_line(std::max(left, std::chrono::milliseconds(0)));
    }
    if (!line) {
      ranks[i]->stop(std::chrono::milliseconds(0));  // SIGKILL: a stopped rank ignores SIGTERM
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%.1f", timeout.count() / 1000.0);
      throw Error(name + " did not say it was ready within " + seconds +
                  " s of starting (--expert-parallel-stall-timeout, at least 60, plus the engine's "
                  "own model load once per rank); it was killed");
    }
    if (line->rfind("ready", 0) != 0) {
      const int status = ranks[i]->stop();
      throw Error(name + " did not start (exit status " + std::to_string(status) +
                  "; its messages are above)");
    }
  }
}

}  // namespace tandem::engine::ep
