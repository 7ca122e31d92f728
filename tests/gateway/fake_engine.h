#pragma once
// An engine as the gateway sees it, in-process: our HTTP server answering the OpenAI routes,
// /health and /load as an engine would, or failing on purpose (Behaviour). The gateway cannot
// tell it from a real engine. For the gateway's failure and replica tests.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/error.h"
#include "gateway/topology.h"
#include "net/http_server.h"
#include "net/sse.h"

namespace tandem::gateway::testing {

using nlohmann::json;
using namespace std::chrono_literals;

enum class Behaviour {
  kOk,          // answers at once (a stream: three token events, then [DONE])
  kError500,    // HTTP 500 with an OpenAI error body
  kGarbage,     // HTTP 200 with a body that is not JSON
  kHold,        // answers only when released (or never): a slow engine
  kCutStream,   // a stream with one event, then the connection is cut (the engine died)
  kErrorEvent,  // a stream whose first event is an error
  // A stream of one event, then an error event and [DONE]: an engine whose generation failed.
  kFailMidStream,
  kError400,  // HTTP 400 with an OpenAI error body (the engine refuses the request)
  kEmpty422,  // HTTP 422 with an empty body
  // A stream of one event every 50 ms until the gateway gives the leg up (60 s at most): a client
  // can leave in the middle however late it does.
  kSlowStream,
  // A stream of 12 MiB as fast as the gateway takes it (16 KiB events), stopping when the gateway
  // gives the leg up: more than socket buffers hold, less than the default high-water mark.
  kFloodStream,
};

// An engine as the gateway sees it: OpenAI endpoints, /health, the P/D fields.
class FakeEngine {
 public:
  explicit FakeEngine(std::string name) : name_(std::move(name)) {
    net::HttpServerOptions o;
    o.host = "127.0.0.1";
    o.threads = 2;
    o.error_response = api::openai_error_response;
    server_ = std::make_unique<net::HttpServer>(o);
    server_->route("GET", "/health", [this](const net::HttpRequest&, auto ex) {
      ex->respond(healthy_ ? 200 : 503, "", "text/plain");
    });
    auto gen = [this](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
      handle(req, std::move(ex));
    };
    server_->route("POST", "/v1/completions", gen);
    server_->route("POST", "/v1/chat/completions", gen);
    server_->route("GET", "/v1/models", [this](const net::HttpRequest&, auto ex) {
      ++model_lists_;
      std::lock_guard lock(mutex_);
      if (models_.empty()) {
        ex->send_error(404, "Invalid URL (GET /v1/models)");  // by default, as before the route
        return;
      }
      json data = json::array();
      for (const auto& id : models_) {
        json entry = {{"id", id}, {"object", "model"}};
        entry.update(model_fields_);
        data.push_back(std::move(entry));
      }
      ex->respond(200, json{{"object", "list"}, {"data", data}}.dump());
    });
    // models.retrieve relayed: the target each call arrived with, answered with an echo of it.
    server_->route_prefix("GET", "/v1/models/", [this](const net::HttpRequest& req, auto ex) {
      std::lock_guard lock(mutex_);
      retrieved_.push_back(req.target);
      ex->respond(200, json{{"id", req.target}, {"object", "model"}}.dump());
    });
    server_->route("GET", "/load", [this](const net::HttpRequest&, auto ex) {
      std::lock_guard lock(mutex_);
      if (load_status_ == 404)
        ex->send_error(404, "Invalid URL (GET /load)");  // as a server without the route
      else
        ex->respond(load_status_, load_body_);
    });
    server_->start();
  }
  ~FakeEngine() {
    release();
    server_->stop();
  }

  uint16_t port() const { return server_->port(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port()); }
  void set(Behaviour b) { behaviour_ = b; }
  void set_healthy(bool h) { healthy_ = h; }
  // What GET /load answers; by default 404, as engines without load reports (vLLM, SGLang).
  void set_load(int status, std::string body) {
    std::lock_guard lock(mutex_);
    load_status_ = status;
    load_body_ = std::move(body);
  }
  // The model ids GET /v1/models lists, each entry with `fields` too ({"owned_by": "sglang"});
  // none (the default): it answers 404.
  void set_models(std::vector<std::string> ids, json fields = json::object()) {
    std::lock_guard lock(mutex_);
    models_ = std::move(ids);
    model_fields_ = std::move(fields);
  }
  int requests() const { return requests_; }
  // The GET /v1/models calls it had: a gateway asks once an engine's health probe passed.
  int model_lists() const { return model_lists_; }
  // The targets of the GET /v1/models/{id} calls it answered.
  std::vector<std::string> retrieved() {
    std::lock_guard lock(mutex_);
    return retrieved_;
  }
  int closed_early() const { return closed_early_; }  // clients that left before the answer
  json last_body() {
    std::lock_guard lock(mutex_);
    return bodies_.empty() ? json() : bodies_.back();
  }
  std::vector<json> bodies() {
    std::lock_guard lock(mutex_);
    return bodies_;
  }
  // The bodies as they came, in their key order (bodies() sorts the keys).
  std::vector<std::string> texts() {
    std::lock_guard lock(mutex_);
    return texts_;
  }
  // Answers every held request (normally).
  void release() {
    std::vector<std::pair<std::shared_ptr<net::Exchange>, json>> held;
    {
      std::lock_guard lock(mutex_);
      held.swap(held_);
    }
    for (auto& [ex, body] : held) answer(*ex, body);
  }
  size_t held() {
    std::lock_guard lock(mutex_);
    return held_.size();
  }
  // The most requests it held at once.
  size_t max_held() {
    std::lock_guard lock(mutex_);
    return max_held_;
  }

 private:
  void handle(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
    ++requests_;
    const json body = json::parse(req.body);
    {
      std::lock_guard lock(mutex_);
      bodies_.push_back(body);
      texts_.push_back(req.body);
    }
    ex->on_close([this] { ++closed_early_; });
    switch (behaviour_.load()) {
      case Behaviour::kOk:
        answer(*ex, body);
        break;
      case Behaviour::kError500:
        ex->send_error(500, "fake engine " + name_ + " broke", "server_error");
        break;
      case Behaviour::kError400:
        ex->send_error(400, "fake engine " + name_ + " refuses max_tokens",
                       "invalid_request_error");
        break;
      case Behaviour::kEmpty422:
        ex->respond(422, "", "application/json");
        break;
      case Behaviour::kGarbage:
        ex->respond(200, "this is not json {", "application/json");
        break;
      case Behaviour::kHold: {
        std::lock_guard lock(mutex_);
        held_.emplace_back(ex, body);
        max_held_ = std::max(max_held_, held_.size());
        break;
      }
      case Behaviour::kCutStream:
        ex->start_stream(200, "text/event-stream");
        ex->write(net::sse_event(chunk(0)));
        std::thread([ex] {
          std::this_thread::sleep_for(50ms);
          ex->abort();
        }).detach();
        break;
      case Behaviour::kSlowStream: {
        ex->start_stream(200, "text/event-stream");
        ex->write(net::sse_event(chunk(0)));
        std::vector<std::string> events;
        for (int i = 1; i < 1200; ++i) events.push_back(net::sse_event(chunk(i)));
        std::thread([ex, events = std::move(events)] {
          for (const auto& e : events) {
            std::this_thread::sleep_for(50ms);
            if (!ex->write(e)) return;  // the gateway gave up on the leg
          }
          ex->write(net::kSseDone);
          ex->end();
        }).detach();
        break;
      }
      case Behaviour::kFloodStream: {
        ex->start_stream(200, "text/event-stream");
        const std::string event = net::sse_event(
            json{{"choices", {{{"index", 0}, {"text", std::string(16 << 10, 'x')}}}}}.dump());
        // Until the gateway gives up on the leg (1 GiB at most): a flood that ended by itself
        // could finish (end()) before the gateway cut it, and the leg would not be cut at all.
        std::thread([ex, event] {
          for (size_t sent = 0; sent < (size_t{1} << 30); sent += event.size())
            if (!ex->write(event)) return;  // the gateway gave up on the leg
          ex->write(net::kSseDone);
          ex->end();
        }).detach();
        break;
      }
      case Behaviour::kFailMidStream:
        ex->start_stream(200, "text/event-stream");
        ex->write(net::sse_event(chunk(0)));
        ex->write(net::sse_event(api::openai_error_body("generation failed", "server_error")));
        ex->write(net::kSseDone);
        ex->end();
        break;
      case Behaviour::kErrorEvent:
        ex->start_stream(200, "text/event-stream");
        ex->write(net::sse_event(api::openai_error_body("KV transfer failed", "server_error")));
        ex->write(net::kSseDone);
        ex->end();
        break;
    }
  }

  std::string chunk(int i) const {
    return json{{"id", "cmpl-x"},
                {"object", "text_completion"},
                {"model", "fake"},
                {"choices", {{{"index", 0}, {"text", name_ + std::to_string(i)}}}}}
        .dump();
  }

  void answer(net::Exchange& ex, const json& body) {
    if (body.value("stream", false)) {
      ex.start_stream(200, "text/event-stream");
      for (int i = 0; i < 3; ++i) ex.write(net::sse_event(chunk(i)));
      ex.write(net::kSseDone);
      ex.end();
      return;
    }
    json out = {{"id", "cmpl-x"},
                {"object", "text_completion"},
                {"model", "fake"},
                {"choices", {{{"index", 0}, {"text", name_}, {"finish_reason", "length"}}}},
                {"usage", {{"prompt_tokens", 3}, {"completion_tokens", 1}, {"total_tokens", 4}}}};
    if (body.contains("kv_transfer_params") &&
        body["kv_transfer_params"].value("do_remote_decode", false))
      out["kv_transfer_params"] = {{"do_remote_prefill", true}, {"remote_engine_id", name_}};
    ex.respond(200, out.dump());
  }

  std::string name_;
  std::unique_ptr<net::HttpServer> server_;
  std::atomic<Behaviour> behaviour_{Behaviour::kOk};
  std::atomic<bool> healthy_{true};
  std::atomic<int> requests_{0}, closed_early_{0}, model_lists_{0};
  std::mutex mutex_;
  std::vector<json> bodies_;
  std::vector<std::string> texts_;
  std::vector<std::pair<std::shared_ptr<net::Exchange>, json>> held_;
  size_t max_held_ = 0;
  int load_status_ = 404;
  std::vector<std::string> models_;
  std::vector<std::string> retrieved_;
  json model_fields_ = json::object();
  std::string load_body_;
};

Endpoint endpoint_of(const FakeEngine& e, std::string name, uint16_t bootstrap = 0) {
  Endpoint p = parse_endpoint(e.address());
  p.name = std::move(name);
  p.bootstrap_port = bootstrap;
  return p;
}

}  // namespace tandem::gateway::testing
