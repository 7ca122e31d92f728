#pragma once
// One engine of the cluster simulator: the serving engine itself (scheduler, paged KV blocks,
// prefix cache, KV events, load report) and its generation API (engine/generation_api.h), run in
// the simulator's virtual time instead of on a thread. The forward pass is the simulated
// executor's latency model: a step runs at once when it starts, its modelled time passes on the
// virtual clock, and what it produced (stream chunks, answers) reaches the gateway when it ends.
// The next step starts then if there is work. KV events go to the simulator's callback.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/executor/sim_executor.h"
#include "engine/generation_api.h"
#include "gateway/seams.h"
#include "net/async_http_client.h"
#include "net/reply.h"
#include "sim/virtual_kv_links.h"
#include "text/tokenizer.h"
#include "util/metrics.h"

namespace tandem::sim {

struct SimulatedEngineOptions {
  std::string name;                     // for errors and reports
  engine::EngineConfig config;          // scheduler, prefix caching (the clock is the simulator's)
  engine::SimExecutorOptions executor;  // the latency model (its wait is the simulator's)
};

class SimulatedEngine {
 public:
  // `clock`, `tokenizer` and `network` must outlive the engine. `events` receives its KV event
  // batches (empty: none are produced). An engine with config.transfer moves KV over `network`.
  SimulatedEngine(gateway::Executor& clock, std::shared_ptr<const text::Tokenizer> tokenizer,
                  SimulatedEngineOptions options, std::function<void(engine::KvEventBatch)> events,
                  VirtualKvNetwork* network = nullptr);
  ~SimulatedEngine();
  SimulatedEngine(const SimulatedEngine&) = delete;
  SimulatedEngine& operator=(const SimulatedEngine&) = delete;

  // One HTTP call of the gateway's, answered through `reply` as the engine's HTTP server would
  // answer it: GET /health, GET /load, and the generation routes; anything else is a 404.
  void call(const net::AsyncHttpRequest& request, std::shared_ptr<net::Reply> reply);
  // The engine dies (the fault the simulator injects): it never steps or answers again, and what
  // its running step produced is lost. Its transfers' peers learn it from the network.
  void kill();
  bool dead() const { return phase_ == Phase::kDead; }
  // The engine hangs until `until`, as a stuck engine loop would: no step ends or starts and no
  // call is answered before then; calls that arrive wait, and everything resumes in order
  // afterwards. A call whose caller gave up meanwhile (its reply closed: a timed-out probe or
  // poll) is dropped at once, as a live engine's server would find its connection gone: the
  // gateway polls a hung engine every 100 ms, and kept, those calls grew without bound over a
  // long stall. A time point, not seconds: an end in seconds that is no whole number of
  // nanoseconds was armed at the nanosecond before it, found the engine still stalled, and the
  // engine never woke.
  void stall(gateway::Executor::Clock::time_point until);
  bool stalled() const;
  // The epoch before any stall.
  gateway::Executor::Clock::time_point stalled_until() const { return stalled_until_; }
  // Nothing to do and nothing under way: no step, no work, no stall, nothing deferred.
  bool quiet() const;
  // What waits for the stall to end: calls and the engine's own deferred work.
  size_t deferred() const { return deferred_.size(); }

  const std::string& name() const { return name_; }
  const engine::Engine& engine() const { return *engine_; }
  const metrics::Registry& registry() const { return registry_; }
  // Steps run, and the virtual seconds they took.
  int64_t steps() const { return steps_; }
  double busy_seconds() const { return busy_seconds_; }

 private:
  void kick();  // a step starts now if there is work and none runs
  void wake();  // something arrived (a call, an abort, a transfer's outcome)
  void step();
  void end_step(bool ran);  // the running step's modelled time has passed
  double now() const;
  // True while stalled, after keeping `task` to run when the stall ends; a task for a call is
  // dropped if the call's reply closes first.
  bool defer_while_stalled(gateway::Executor::Task& task,
                           const std::shared_ptr<net::Reply>& reply = nullptr);
  void arm_resume();
  void resume();  // a stall's end: what waited runs, in the order it came

  gateway::Executor& clock_;
  std::string name_;
  metrics::Registry registry_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<engine::GenerationApi> api_;
  // Where the engine is between steps. kRunning: inside Engine::run_once(); kEnding: its step's
  // end is scheduled (after the modelled time, or at once when there is none).
  enum class Phase { kIdle, kPosted, kRunning, kEnding, kDead };
  Phase phase_ = Phase::kIdle;
  bool woken_ = false;  // something arrived while a step ran: look for work when it ends
  // The running step: its modelled seconds so far (the engine's clock reads the start plus them),
  // and the load report as the step began, set once modelled time passes (what a /load poll
  // during it sees).
  double step_offset_ = 0, step_started_ = 0;
  std::optional<engine::LoadReport> step_load_;
  // Rendering tasks of the running step's outputs, run when it ends.
  std::vector<std::function<void()>> rendered_at_end_;
  int64_t steps_ = 0, next_id_ = 0;
  double busy_seconds_ = 0;
  gateway::Executor::Clock::time_point stalled_until_{};
  // What waits for the stall's end, by arrival; a closed call's entry is erased by its reply.
  std::map<uint64_t, gateway::Executor::Task> deferred_;
  uint64_t next_deferred_ = 0;
  // A resume timer is armed for this stall end (a stall that is extended arms another).
  gateway::Executor::Clock::time_point resume_armed_for_{};
};

}  // namespace tandem::sim
