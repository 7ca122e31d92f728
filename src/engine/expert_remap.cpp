#include "engine/expert_remap.h"

#include <cstdio>

#include "placement/planner.h"
#include "util/error.h"

namespace tandem::engine {

nlohmann::json ExpertRemapStatus::to_json() const {
  const char* state = failed ? "failed" : (loading ? "loading" : "idle");
  nlohmann::json j = {
      {"state", state}, {"remaps", remaps}, {"automatic_remaps", automatic}, {"last", nullptr}};
  if (last)
    j["last"] = {{"moves", last->moves},
                 {"load_seconds", last->load_seconds},
                 {"pause_seconds", last->pause_seconds}};
  if (!last_error.empty()) j["last_error"] = last_error;
  return j;
}

ExpertRemapper::ExpertRemapper(Executor& executor, int64_t rebalance_interval,
                               metrics::Registry& registry,
                               std::function<void(std::function<void()>)> post)
    : executor_(executor),
      interval_(rebalance_interval),
      post_(std::move(post)),
      remaps_(registry.int_counter("tandem:expert_remaps_total",
                                   "Live expert placement changes switched in")),
      pause_(registry.gauge("tandem:expert_remap_pause_seconds",
                            "What the last placement switch added between two steps")),
      load_(registry.gauge("tandem:expert_remap_load_seconds",
                           "How long the last placement's new copies took to load (background)")) {}

void ExpertRemapper::change(const placement::Placement& next) {
  stage(next, false);
}

void ExpertRemapper::stage(const placement::Placement& next, bool automatic) {
  // Before the check for a change underway: status_.loading of a change that a failure cut short
  // is never cleared.
  if (std::string why = executor_.failure(); !why.empty()) throw RemapUnavailable(why);
  {
    std::lock_guard lock(mutex_);
    if (status_.loading) throw RemapUnderway("a placement change is already underway");
    status_.loading = true;
  }
  try {
    executor_.stage_expert_placement(
        next, [this, automatic] { post_([this, automatic] { switch_now(automatic); }); });
  } catch (...) {
    {
      std::lock_guard lock(mutex_);
      status_.loading = false;
    }
    // The executor may have failed since the check above (a rank died): not the placement's fault.
    if (std::string why = executor_.failure(); !why.empty()) throw RemapUnavailable(why);
    throw;
  }
}

void ExpertRemapper::switch_now(bool automatic) {
  try {
    const PlacementSwitch s = executor_.switch_expert_placement();
    std::lock_guard lock(mutex_);
    status_.loading = false;
    status_.last = s;
    status_.last_error.clear();  // it was about an attempt before this one
    ++status_.remaps;
    if (automatic) ++status_.automatic;
    remaps_.inc();
    pause_.set(s.pause_seconds);
    load_.set(s.load_seconds);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "engine: expert placement switch failed: %s\n", e.what());
    std::lock_guard lock(mutex_);
    status_.loading = false;
    status_.last_error = e.what();
  }
}

void ExpertRemapper::after_step(uint64_t steps, const ExpertLoadStats& load) {
  if (interval_ <= 0 || steps % uint64_t(interval_) != 0) return;
  {
    std::lock_guard lock(mutex_);
    if (status_.loading) return;
  }
  // This runs on the engine thread outside any step: a planner that throws here would end the
  // engine. A plan that fails (or cannot be staged) leaves the placement in force and says why
  // in the status; the next interval tries again.
  try {
    const auto current = executor_.expert_placement();
    if (!current) return;
    const ExpertLoadSnapshot snap = load.snapshot();
    placement::ExpertLoads loads{int64_t(snap.layer_ids.size()), snap.experts,
                                 std::vector<double>(snap.window.begin(), snap.window.end())};
    const placement::IncrementalPlan plan = placement::plan_incremental(loads, *current, {});
    if (plan.moves == 0) return;
    stage(plan.placement, true);
  } catch (const RemapUnderway&) {
    // An operator's change began while this one was planned: it wins, and nothing failed.
  } catch (const std::exception& e) {
    const std::string why = std::string("automatic rebalance: ") + e.what();
    std::lock_guard lock(mutex_);
    // Every interval may fail the same way: the log gets each new reason once.
    if (why != status_.last_error)
      std::fprintf(stderr, "engine: expert placement %s\n", why.c_str());
    status_.last_error = why;
  }
}

ExpertRemapStatus ExpertRemapper::status() const {
  // Asked before mutex_ is taken: the executor's failure() takes its own locks.
  const std::string failure = executor_.failure();
  std::lock_guard lock(mutex_);
  ExpertRemapStatus s = status_;
  if (!failure.empty()) {
    // A failed executor's loader ends without calling back (EpExecutor: a rank died or aborted,
    // a copy failed to load), so a change loading now never switches. The failure is for good:
    // status_ is left as it is, and every later status() and change() sees the failure.
    s.failed = true;
    s.loading = false;
    s.last_error = failure;
  }
  return s;
}

}  // namespace tandem::engine
