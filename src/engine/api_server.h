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

#include <nlohmann/json.hpp>
#include <string>

#include "engine/engine.h"
#include "engine/generation_api.h"
#include "net/http_server.h"
#include "util/metrics.h"
#include "util/task_thread.h"

namespace tandem::engine {

class ApiServer {
 public:
  // `engine` and `registry` must outlive the server.
  ApiServer(Engine& engine, metrics::Registry& registry, net::HttpServerOptions options);
  ~ApiServer();

  void start();
  uint16_t port() const;
  void stop();

 private:
  Engine& engine_;
  metrics::Registry& registry_;
  net::HttpServer server_;
  // Builds and writes responses from the engine's outputs, in the order they came. Shared with
  // the callbacks, which may outlive the server (an engine stopped later aborts its requests).
  std::shared_ptr<util::TaskThread> renderer_ = std::make_shared<util::TaskThread>("render");
  GenerationApi generation_;
  int64_t created_;
};

}  // namespace tandem::engine
