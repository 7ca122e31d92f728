#pragma once
// The engine's HTTP front: the generation routes (generation_api.h: OpenAI /v1/completions and
// /v1/chat/completions, SGLang's tokens-in /generate), /v1/models, /health, /metrics (Prometheus),
// /load (the JSON load report the gateway polls), the expert placement, and
// POST /v1/kv_transfer/release (a prefill engine's held KV freed: GenerationApi::release_kv). The
// engine's outputs come back on the engine thread, which hands them to the server's render thread:
// the response bodies and stream chunks are built there and written to the client through the HTTP
// server's exchanges, so the step loop never serializes JSON. A client that disconnects aborts its
// requests, which frees their KV blocks. The requests are prepared (bodies parsed, prompts
// tokenized, chat templates rendered, grammars compiled) on threads of their own, not on the io
// threads, so that one 8 MiB prompt or heavy schema holds up no other client's stream nor /health.
// A stop drains, as the gateway's does (gateway.h) and vLLM's: new generation requests are
// refused while those in flight finish.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>
#include <string>

#include "api/load_report.h"
#include "engine/engine.h"
#include "engine/generation_api.h"
#include "net/http_server.h"
#include "util/metrics.h"
#include "util/task_thread.h"

namespace tandem::engine {

// The environment variable an engine takes its API key from when --api-key is not given
// (`tandem serve` hands its engines their key this way: command lines are visible to every user
// of the host).
inline constexpr const char* kEngineApiKeyVariable = "TANDEM_ENGINE_API_KEY";

// Where requests are prepared: generation requests (and their refusals while the engine stops),
// /tokenize and /detokenize.
struct RequestPreparation {
  int threads = 2;
  // Runs on a preparation thread before each request is prepared: a seam for tests, which hold
  // one there.
  std::function<void(const net::HttpRequest&, net::Reply&)> before_each;
};

class ApiServer {
 public:
  // `engine` and `registry` must outlive the server. With `api_keys`, every route but /health and
  // /metrics needs one of them as a Bearer token (401 otherwise).
  ApiServer(Engine& engine, metrics::Registry& registry, net::HttpServerOptions options,
            std::vector<std::string> api_keys = {}, RequestPreparation preparation = {});
  ~ApiServer();

  // What a stopping engine answers new generation requests and /health (503).
  static constexpr const char* kShuttingDown = "the engine is shutting down";

  void start();
  uint16_t port() const;
  // What the engine reports at GET /load: its own report (Engine::load) and the generation
  // requests still waiting to be prepared, which it has not been given yet. Each of those counts
  // as a waiting sequence whose prompt is its body's bytes / kBodyBytesPerToken tokens (at most
  // the model's length), none of them cached: a router must not take an engine whose preparation
  // threads hold a queue as idle.
  api::LoadReport load() const;
  // About 4 bytes a token for English text; token ids in JSON take more bytes each, so their
  // prompts are over-counted, the safe error for a router for the little time they wait.
  static constexpr int64_t kBodyBytesPerToken = 4;
  // Stops in order: new generation requests (completions, chat, /generate) get 503 "the engine
  // is shutting down" (an OpenAI error) and /health answers 503, so that load balancers and
  // gateways take the engine out, while the cheap routes (/tokenize, /v1/models, /load,
  // /metrics) still answer. The requests in flight have up to `drain` to finish: their answers
  // go to the sockets; then, KV a prefill holds for a decode engine's pull or room (its answer
  // already went out) may still be taken. Then the connections close: those whose complete answer
  // a slow reader's socket has not yet taken once it has, within what is left of `drain`
  // (HttpServer::stop's flush); the others at once, cutting what is left (the engine, stopped
  // after, aborts its requests). Returns once all is done; later calls do nothing. The destructor
  // stops without a drain.
  void stop(std::chrono::milliseconds drain = {});
  // The first step of stop(), on its own: the refusals above from now on (once started; before,
  // nothing is served and this does nothing).
  void refuse_new_requests();
  // Ends a drain, and the flush after it, at once (stop() goes on with closing), or the next one
  // before it begins. From any thread: an operator's second stop signal.
  void end_drain();

  // What a drain waits for (shared: the replies that count it may outlive the server).
  struct Drain;

 private:
  // What a preparation thread does with a request, answering through the reply.
  using Preparation =
      std::function<void(const net::HttpRequest& request, std::shared_ptr<net::Reply> reply)>;
  struct Preparer;
  struct Unprepared;

  // Where the server is in its life; it only moves down this list.
  enum class State {
    kCreated,   // not started: nothing is served
    kServing,   // started
    kRefusing,  // new generation requests are refused (refuse_new_requests)
    kStopped,   // stop() was called: refusing until the connections close
  };
  bool refusing() const { return state_.load() >= State::kRefusing; }

  // server_.route behind the API keys (all routes but /health and /metrics).
  void route(std::string method, std::string path, net::Handler handler);
  // server_.route_prefix behind the API keys.
  void route_prefix(std::string method, std::string prefix, net::Handler handler);
  // `handler` answering 401 invalid_api_key to a request without one of api_keys_ (if any).
  net::Handler behind_api_keys(net::Handler handler) const;
  // `work` for the request of `exchange`, on the preparation thread with the fewest requests
  // queued; when its client left meanwhile, `dropped` instead (if any), there.
  void prepare(std::shared_ptr<net::Exchange> exchange, std::shared_ptr<net::Reply> reply,
               Preparation work, Preparation dropped = {});
  // net::pass_io_threads over this server's io threads.
  void io_threads_pass();

  Engine& engine_;
  metrics::Registry& registry_;
  const std::vector<std::string> api_keys_;
  const int io_threads_;
  const std::shared_ptr<Drain> drain_;
  // The generation requests not yet prepared (shared: their tasks may outlive the server).
  const std::shared_ptr<Unprepared> unprepared_;
  std::atomic<State> state_{State::kCreated};
  net::HttpServer server_;
  // Builds and writes responses from the engine's outputs, in the order they came. Shared with
  // the callbacks, which may outlive the server (an engine stopped later aborts its requests).
  std::shared_ptr<util::TaskThread> renderer_ = std::make_shared<util::TaskThread>("render");
  const std::function<void(const net::HttpRequest&, net::Reply&)> before_preparation_;
  std::vector<std::unique_ptr<Preparer>> preparers_;
  GenerationApi generation_;
  int64_t created_;
};

}  // namespace tandem::engine
