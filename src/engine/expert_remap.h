#pragma once
// Live expert remapping for engines whose executor places experts (expert parallelism): a new
// placement from an operator (POST /admin/expert_placement) or from the engine's own expert load
// every --rebalance-interval steps (the Omni planner's incremental mode, which moves as few
// copies as it can). New copies load in the background; the switch runs on the engine thread
// between two steps; the pause it adds is reported.
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/executor/executor.h"
#include "engine/expert_load.h"
#include "util/error.h"
#include "util/metrics.h"

namespace tandem::engine {

struct ExpertRemapStatus {
  bool loading = false;   // a staged placement's copies are loading
  bool failed = false;    // the executor has failed: no step nor placement change runs again
  int64_t remaps = 0;     // switches done
  int64_t automatic = 0;  // of them, planned by the engine itself
  std::optional<PlacementSwitch> last;
  // Why the last attempt failed (the executor's failure when `failed`); a switch clears it.
  std::string last_error;
  nlohmann::json to_json() const;  // "state": "failed", "loading" or "idle"
};

// change() refused for the engine's sake, not the placement's: the executor has failed (the API
// answers 503, not 400).
class RemapUnavailable : public Error {
 public:
  using Error::Error;
};

// change() refused because another change is loading (an operator's, or the engine's own
// rebalance that began meanwhile): nothing wrong with the placement (the API answers 409).
class RemapUnderway : public Error {
 public:
  using Error::Error;
};

class ExpertRemapper {
 public:
  // `post` runs a task on the engine thread between steps.
  ExpertRemapper(Executor& executor, int64_t rebalance_interval, metrics::Registry& registry,
                 std::function<void(std::function<void()>)> post);

  // Any thread. Checks `next` and starts loading it (throws tandem::Error naming what does not
  // fit; RemapUnderway when a change is loading; RemapUnavailable when the executor has failed;
  // the placement in force stays).
  void change(const placement::Placement& next);
  // Engine thread, after a step's routes were recorded (`steps` so far): every
  // rebalance_interval steps, plans from the load window and stages the plan when it moves
  // any copy. Never throws: a plan that fails is the status's last_error, the placement stays.
  void after_step(uint64_t steps, const ExpertLoadStats& load);
  // Any thread. A change whose load an executor failure cut short reports failed: the
  // executor's loader ends without calling back then, and the executor runs no step again.
  ExpertRemapStatus status() const;

 private:
  void stage(const placement::Placement& next, bool automatic);
  void switch_now(bool automatic);  // engine thread

  Executor& executor_;
  const int64_t interval_;
  std::function<void(std::function<void()>)> post_;
  metrics::IntCounter& remaps_;
  metrics::Gauge& pause_;
  metrics::Gauge& load_;
  mutable std::mutex mutex_;
  ExpertRemapStatus status_;
};

}  // namespace tandem::engine
