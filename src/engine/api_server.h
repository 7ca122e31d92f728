#pragma once
// The engine's HTTP front: OpenAI /v1/completions and /v1/chat/completions (streaming and not),
// SGLang's tokens-in /generate, /v1/models, /health, /metrics (Prometheus) and /load (the JSON
// load report the gateway polls). Requests go to the Engine; its outputs come back on the engine
// thread, which hands them to the server's render thread: the response bodies and stream chunks
// are built there and written to the client through the HTTP server's exchanges, so the step
// loop never serializes JSON. A client that disconnects aborts its requests, which frees their KV
// blocks.
#include <cstdint>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>
#include <string>

#include "engine/engine.h"
#include "net/http_server.h"
#include "text/chat_template.h"
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
  void handle_generation(int kind, const net::HttpRequest& request,
                         std::shared_ptr<net::Exchange> exchange);
  void release_refused_decode_leg(const nlohmann::json& body);

  Engine& engine_;
  metrics::Registry& registry_;
  net::HttpServer server_;
  std::optional<text::ChatTemplate> chat_template_;
  // Builds and writes responses from the engine's outputs, in the order they came. Shared with
  // the callbacks, which may outlive the server (an engine stopped later aborts its requests).
  std::shared_ptr<util::TaskThread> renderer_ = std::make_shared<util::TaskThread>("render");
  int64_t created_;
};

}  // namespace tandem::engine
