#pragma once
// The engine's generation routes (OpenAI /v1/completions and /v1/chat/completions, streaming and
// not, and SGLang's tokens-in /generate; vLLM's /tokenize and /detokenize beside them) over any
// net::Reply: the request body parsed and
// checked, its choices submitted to the Engine as engine requests (with the P/D leg its
// disaggregation fields and the engine's role make of it), and the engine's outputs rendered
// into response bodies or SSE chunks. The HTTP server (api_server.h) serves it over sockets; the
// cluster simulator (sim/) calls it directly in virtual time.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "api/request.h"
#include "engine/engine.h"
#include "net/http.h"
#include "net/reply.h"
#include "text/chat_template.h"

namespace tandem::engine {

class GenerationApi {
 public:
  // Runs a rendering task: the engine's outputs are rendered there, in the order they came, so the
  // step loop never serializes JSON (a thread of the server's; the simulator's clock).
  using Post = std::function<void(std::function<void()>)>;
  // Unique engine request ids (default: random).
  using NewId = std::function<std::string()>;
  // The Unix time in seconds that each response's `created` carries, read as its request comes
  // (default: the system clock).
  using UnixNow = std::function<int64_t()>;

  // `engine` must outlive the API; `post` may be called from the engine thread.
  GenerationApi(Engine& engine, Post post, NewId new_id = {}, UnixNow unix_now = {});

  // Answers one generation request through `reply`: an OpenAI error for a bad body, else the
  // response as the engine produces it. A reply that closes early aborts its engine requests.
  void handle(api::ApiKind kind, const net::HttpRequest& request,
              std::shared_ptr<net::Reply> reply);
  // Turns one generation request away (the engine is stopping, or its client left before it was
  // prepared): 503 `why`, an OpenAI server_error, which a gateway retries elsewhere. A decode
  // leg's prefill engine is told to let go of the KV it holds for it, as for any refused decode
  // leg; the body is parsed for that alone, and only on an engine with KV transfer when its text
  // names kv_transfer_params or bootstrap_room.
  void refuse(api::ApiKind kind, const net::HttpRequest& request, net::Reply& reply,
              const std::string& why);
  // vLLM's /tokenize (the ids a generation request with this prompt or chat runs on, rendered by
  // the same parser and template) and /detokenize (api/tokenize.h), answered at once.
  void tokenize(const net::HttpRequest& request, std::shared_ptr<net::Reply> reply);
  void detokenize(const net::HttpRequest& request, std::shared_ptr<net::Reply> reply);
  // POST /v1/kv_transfer/release, body {"kv_transfer_params": {...}} as this engine's prefill
  // answer gave them: a gateway whose request ended before any decode engine took that KV frees
  // it now instead of at --kv-transfer-timeout. 200 {"released": true} when a hold was freed,
  // {"released": false} when none is held by that id (pulled, released, expired, another engine's)
  // or a decode engine is pulling it right now (that pull frees it); 400 naming the field for a
  // bad body, or for an engine that holds no KV for decode engines (no KV transfer, or
  // --role decode).
  void release_kv(const net::HttpRequest& request, std::shared_ptr<net::Reply> reply);

 private:
  void release_refused_decode_leg(api::ApiKind kind, const net::HttpRequest& request,
                                  const nlohmann::json& body,
                                  const std::vector<std::vector<int32_t>>& prompts,
                                  const std::string& why);

  Engine& engine_;
  Post post_;
  NewId new_id_;
  UnixNow unix_now_;
  std::optional<text::ChatTemplate> chat_template_;
};

}  // namespace tandem::engine
