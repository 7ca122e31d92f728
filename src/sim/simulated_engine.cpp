#include "sim/simulated_engine.h"

#include <algorithm>

#include "api/error.h"
#include "api/load_report.h"
#include "api/model_list.h"
#include "engine/output_processor.h"
#include "sim/virtual_time.h"
#include "util/error.h"

namespace tandem::sim {
namespace {

// The generation routes, as the engine's HTTP server routes them (api_server.cpp).
constexpr std::pair<const char*, api::ApiKind> kGenerationRoutes[] = {
    {"/v1/completions", api::ApiKind::kCompletion},
    {"/v1/chat/completions", api::ApiKind::kChat},
    {"/generate", api::ApiKind::kGenerate}};

}  // namespace

SimulatedEngine::SimulatedEngine(gateway::Executor& clock,
                                 std::shared_ptr<const text::Tokenizer> tokenizer,
                                 SimulatedEngineOptions options,
                                 std::function<void(engine::KvEventBatch)> events,
                                 VirtualKvNetwork* network)
    : clock_(clock), name_(options.name) {
  engine::SimExecutorOptions x = options.executor;
  x.wait = [this](double s) {
    if (!step_load_) step_load_ = engine_->load();  // as the step starts
    step_offset_ += s;
  };
  engine::EngineConfig config = options.config;
  config.clock = [this] { return now(); };
  config.kv_event_sink = std::move(events);
  if (config.transfer) {
    if (!network) throw Error(name_ + ": KV transfer needs the simulator's network");
    config.make_transfers = [this, network, transfer = *config.transfer](
                                engine::Executor& executor, engine::KvTransfers::Post post) {
      return network->make(
          transfer, executor, std::move(post), [this] { return now(); }, [this] { wake(); });
    };
  }
  auto executor = std::make_unique<engine::SimExecutor>(*tokenizer, x);
  const std::vector<int32_t> eos = engine::eos_ids(*tokenizer, {});
  engine_ =
      std::make_unique<engine::Engine>(config, std::move(executor), tokenizer, eos, registry_);
  api_ = std::make_unique<engine::GenerationApi>(
      *engine_,
      [this](std::function<void()> task) {
        // Outputs of a step's forward pass reach the gateway when the step ends. What the engine
        // answers before its forward pass (a prefill whose KV transfer finished, an abort) goes
        // now, as a live engine's loop sends it before it runs the pass.
        if (phase_ == Phase::kDead) return;
        if (phase_ == Phase::kEnding || (phase_ == Phase::kRunning && step_load_))
          rendered_at_end_.push_back(std::move(task));  // run by the step's end
        else
          clock_.post([this, task = std::move(task)]() mutable {
            if (phase_ == Phase::kDead) return;
            gateway::Executor::Task run = std::move(task);
            if (!defer_while_stalled(run)) run();
          });
      },
      [this] { return name_ + "-" + std::to_string(next_id_++); },
      // created: the virtual time the request came, read as Unix time (Executor::unix_ms), so
      // that the same inputs give the same answers.
      [this] { return clock_.unix_ms() / 1000; });
}

SimulatedEngine::~SimulatedEngine() {
  // The engine ends what it still holds (a run may end with a stalled engine's aborted requests
  // in it), reporting to the API, which must still be there; nothing it posts runs any more.
  phase_ = Phase::kDead;
  engine_.reset();
}

double SimulatedEngine::now() const {
  return seconds_of(clock_.now()) + step_offset_;
}

bool SimulatedEngine::stalled() const {
  return clock_.now() < stalled_until_;
}

bool SimulatedEngine::quiet() const {
  return phase_ == Phase::kIdle && !stalled() && deferred_.empty() && !engine_->has_work();
}

bool SimulatedEngine::defer_while_stalled(gateway::Executor::Task& task,
                                          const std::shared_ptr<net::Reply>& reply) {
  if (!stalled()) return false;
  const uint64_t id = next_deferred_++;
  deferred_.emplace(id, std::move(task));
  // The reply keeps this callback until it ends; an answered reply never runs it.
  if (reply) reply->on_close([this, id] { deferred_.erase(id); });
  arm_resume();
  return true;
}

void SimulatedEngine::arm_resume() {
  if (resume_armed_for_ == stalled_until_) return;
  resume_armed_for_ = stalled_until_;
  clock_.at(stalled_until_, [this] { resume(); });
}

void SimulatedEngine::resume() {
  if (phase_ == Phase::kDead) return;
  if (stalled()) return arm_resume();  // the stall was extended: its new end resumes
  auto tasks = std::move(deferred_);
  deferred_.clear();
  for (auto& [id, task] : tasks) task();
}

void SimulatedEngine::stall(gateway::Executor::Clock::time_point until) {
  stalled_until_ = std::max(stalled_until_, until);
}

void SimulatedEngine::call(const net::AsyncHttpRequest& request,
                           std::shared_ptr<net::Reply> reply) {
  if (phase_ == Phase::kDead) return;  // a call that waited out a stall; the reset reached it
  gateway::Executor::Task later = [this, request, reply] { call(request, reply); };
  if (defer_while_stalled(later, reply)) return;
  if (request.method == "GET" && request.target == "/health") {
    reply->respond(200, "", "text/plain");
    return;
  }
  if (request.method == "GET" && request.target == "/v1/models") {
    const int64_t created = static_cast<int64_t>(seconds_of(clock_.now()));
    reply->respond(200,
                   api::model_list_json(
                       {engine_->executor_info().model_name, created, engine_->max_model_len()}),
                   "application/json");
    return;
  }
  if (request.method == "GET" && request.target.substr(0, request.target.find('?')) == "/load") {
    // During a step: what the engine reported as the step began, and the requests that came
    // since (a live engine counts those too: its HTTP thread submits them while the step runs).
    const bool in_step = phase_ == Phase::kEnding && step_load_;
    engine::LoadReport r = in_step ? engine_->with_incoming(*step_load_) : engine_->load();
    if (in_step) r.step_running_for_s = seconds_of(clock_.now()) - step_started_;
    // Its process is the simulator's, which no engine outlives (a killed one never comes back).
    r.instance = api::this_process_instance();
    reply->respond(200, api::to_json(r, api::load_since_step(request.target)), "application/json");
    return;
  }
  auto as_http_request = [&request] {
    net::HttpRequest req;
    req.method = request.method;
    req.target = req.path = request.target;
    req.headers = request.headers;
    req.body = request.body;
    return req;
  };
  for (const auto& [route, kind] : kGenerationRoutes) {
    if (request.method != "POST" || request.target != route) continue;
    api_->handle(kind, as_http_request(), reply);
    reply->on_close([this] { wake(); });  // after the API's own, which aborts the requests
    wake();
    return;
  }
  if (request.method == "POST" && request.target == "/v1/kv_transfer/release") {
    api_->release_kv(as_http_request(), reply);  // a freed hold wakes the engine (its KV links)
    return;
  }
  reply->send_error(404, "no route " + request.method + " " + request.target + " on " + name_,
                    "invalid_request_error", "not_found");
}

void SimulatedEngine::wake() {
  if (phase_ == Phase::kRunning || phase_ == Phase::kEnding)
    woken_ = true;
  else
    kick();
}

void SimulatedEngine::kill() {
  phase_ = Phase::kDead;
  rendered_at_end_.clear();
}

void SimulatedEngine::kick() {
  if (phase_ != Phase::kIdle || !engine_->has_work()) return;
  phase_ = Phase::kPosted;
  clock_.post([this] { step(); });
}

void SimulatedEngine::step() {
  if (phase_ == Phase::kDead) return;
  gateway::Executor::Task later = [this] { step(); };
  if (defer_while_stalled(later)) return;
  phase_ = Phase::kRunning;
  step_started_ = seconds_of(clock_.now());
  step_offset_ = 0;
  step_load_.reset();
  const bool ran = engine_->run_once();
  const double seconds = step_offset_;
  step_offset_ = 0;
  if (ran) {
    ++steps_;
    busy_seconds_ += seconds;
  }
  // The step's outputs reach the gateway when its modelled time has passed; meanwhile /load
  // answers what the engine reported as the step began, plus requests submitted since. A pass that
  // ran no step, or a step of no modelled time, ends at once.
  phase_ = Phase::kEnding;
  if (step_load_)
    clock_.at(clock_.now() + duration_of(seconds), [this, ran] { end_step(ran); });
  else
    clock_.post([this, ran] { end_step(ran); });
}

void SimulatedEngine::end_step(bool ran) {
  if (phase_ == Phase::kDead) return;  // what the step produced died with the engine
  gateway::Executor::Task later = [this, ran] { end_step(ran); };
  if (defer_while_stalled(later)) return;  // a hung engine loop reports nothing
  phase_ = Phase::kIdle;
  auto tasks = std::move(rendered_at_end_);
  rendered_at_end_.clear();
  for (auto& t : tasks) t();
  // A pass that could schedule nothing waits for the next call, abort or transfer.
  if (ran || woken_) kick();
  woken_ = false;
}

}  // namespace tandem::sim
