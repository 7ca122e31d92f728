#pragma once
// The engine's HTTP front: the generation routes (generation_api.h: OpenAI /v1/completions and
// /v1/chat/completions, SGLang's tokens-in /generate), /v1/models, /health, /metrics (Prometheus),
// /load (the JSON load report the gateway polls) and the expert placement. The engine's outputs
// come back on the engine thread, which hands them to the server's render thread: the response
// bodies and stream chunks are built there and written to the client through the HTTP server's
// exchanges, so the step loop never serializes JSON. A client that disconnects aborts its
// requests, which frees their KV blocks.
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>
#include <string>

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

class ApiServer {
 public:
  // `engine` and `registry` must outlive the server. With `api_keys`, every route but /health and
  // /metrics needs one of them as a Bearer token (401 otherwise).
  ApiServer(Engine& engine, metrics::Registry& registry, net::HttpServerOptions options,
            std::vector<std::string> api_keys = {});
  ~ApiServer();

  void start();
  uint16_t port() const;
  void stop();

 private:
  // server_.route behind the API keys (all routes but /health and /metrics).
  void route(std::string method, std::string path, net::Handler handler);

  Engine& engine_;
  metrics::Registry& registry_;
  const std::vector<std::string> api_keys_;
  net::HttpServer server_;
  // Builds and writes responses from the engine's outputs, in the order they came. Shared with
  // the callbacks, which may outlive the server (an engine stopped later aborts its requests).
  std::shared_ptr<util::TaskThread> renderer_ = std::make_shared<util::TaskThread>("render");
  GenerationApi generation_;
  int64_t created_;
};

}  // namespace tandem::engine
