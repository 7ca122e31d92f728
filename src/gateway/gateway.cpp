#include "gateway/gateway.h"

#include <atomic>
#include <mutex>
#include <random>

#include <nlohmann/json.hpp>

#include "net/async_http_client.h"
#include "net/http_server.h"
#include "util/error.h"
#include "util/json.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;

uint64_t random_u64() {
  thread_local std::mt19937_64 rng(std::random_device{}());
  return rng();
}

std::string random_id() {
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(random_u64()),
                static_cast<unsigned long long>(random_u64()));
  return buf;
}

uint16_t port_number(const std::string& text, const std::string& whole) {
  try {
    size_t used = 0;
    const int p = std::stoi(text, &used);
    if (used == text.size() && p >= 1 && p <= 65535) return static_cast<uint16_t>(p);
  } catch (const std::exception&) {
  }
  throw Error("endpoint '" + whole + "': expected HOST:PORT[@BOOTSTRAP_PORT] with ports 1..65535");
}

// An engine and the requests the gateway has sent it that have not finished.
struct Backend {
  Endpoint endpoint;
  std::atomic<int64_t> in_flight{0};
};

// One client request while it is served: its legs, and whether the client got anything yet.
struct Flow {
  std::shared_ptr<net::Exchange> exchange;
  std::mutex mutex;
  std::vector<net::AsyncHttpClient::CallId> calls;
  bool answered = false;  // a response or a stream started
  bool finished = false;  // no more legs will start
};

}  // namespace

Endpoint parse_endpoint(const std::string& text) {
  Endpoint e;
  std::string rest = text;
  if (const auto at = rest.find('@'); at != std::string::npos) {
    e.bootstrap_port = port_number(rest.substr(at + 1), text);
    rest = rest.substr(0, at);
  }
  const auto colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0)
    throw Error("endpoint '" + text + "': expected HOST:PORT[@BOOTSTRAP_PORT]");
  e.host = rest.substr(0, colon);
  e.port = port_number(rest.substr(colon + 1), text);
  return e;
}

PdMode parse_mode(const std::string& text) {
  if (text == "aggregated") return PdMode::kAggregated;
  if (text == "sequential" || text == "vllm") return PdMode::kSequential;
  if (text == "parallel" || text == "sglang") return PdMode::kParallel;
  throw Error("mode: expected aggregated, sequential (vllm) or parallel (sglang), got '" + text +
              "'");
}

class Gateway::Impl {
 public:
  explicit Impl(GatewayOptions options) : options_(std::move(options)), server_(server_options()) {
    if (options_.decode.empty()) throw Error("the gateway needs at least one decode engine");
    if (options_.mode == PdMode::kAggregated && !options_.prefill.empty())
      throw Error("aggregated mode has no prefill pool; choose sequential or parallel");
    if (options_.mode != PdMode::kAggregated && options_.prefill.empty())
      throw Error("sequential and parallel modes need at least one prefill engine");
    for (const auto& e : options_.prefill) {
      if (options_.mode == PdMode::kParallel && e.bootstrap_port == 0)
        throw Error("parallel mode: prefill engine " + e.host + ":" + std::to_string(e.port) +
                    " needs its bootstrap (KV transfer) port, as HOST:PORT@BOOTSTRAP_PORT");
      prefill_.push_back(std::make_unique<Backend>());
      prefill_.back()->endpoint = e;
    }
    for (const auto& e : options_.decode) {
      decode_.push_back(std::make_unique<Backend>());
      decode_.back()->endpoint = e;
    }
    server_.route("GET", "/health", [](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
      ex->respond(200, "", "text/plain");
    });
    server_.route("GET", "/v1/models",
                  [this](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
                    auto flow = std::make_shared<Flow>();
                    flow->exchange = ex;
                    relay(flow, *least_loaded(decode_), "GET", req.target, {}, req.headers);
                  });
    auto generation = [this](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
      handle(req, std::move(ex));
    };
    server_.route("POST", "/v1/completions", generation);
    server_.route("POST", "/v1/chat/completions", generation);
  }

  void start() { server_.start(); }
  uint16_t port() const { return server_.port(); }
  void stop() { server_.stop(); }

 private:
  net::HttpServerOptions server_options() const {
    net::HttpServerOptions o;
    o.host = options_.host;
    o.port = options_.port;
    o.threads = options_.http_threads;
    o.max_body_bytes = options_.max_body_bytes;
    return o;
  }

  static Backend* least_loaded(const std::vector<std::unique_ptr<Backend>>& pool) {
    Backend* best = pool.front().get();
    for (const auto& b : pool)
      if (b->in_flight.load() < best->in_flight.load()) best = b.get();
    return best;
  }

  void handle(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
    json body;
    try {
      body = parse_untrusted_json(req.body);
      if (!body.is_object()) throw Error("the request body must be a JSON object");
    } catch (const std::exception& e) {
      ex->send_error(400, std::string("invalid JSON body: ") + e.what());
      return;
    }
    // The same id to both legs (engines and logs correlate on it).
    net::Headers headers;
    std::string id = req.headers.get("X-Request-Id");
    if (id.empty()) id = random_id();
    headers.set("X-Request-Id", id);
    if (const auto* auth = req.headers.find("Authorization")) headers.set("Authorization", *auth);

    auto flow = std::make_shared<Flow>();
    flow->exchange = ex;
    ex->on_close([this, flow] { cancel_all(*flow); });
    Backend& decode = *least_loaded(decode_);
    switch (options_.mode) {
      case PdMode::kAggregated:
        relay(flow, decode, "POST", req.target, body.dump(), headers);
        break;
      case PdMode::kSequential:
        sequential(flow, *least_loaded(prefill_), decode, req.target, std::move(body), headers);
        break;
      case PdMode::kParallel:
        parallel(flow, *least_loaded(prefill_), decode, req.target, std::move(body), headers);
        break;
    }
  }

  void cancel_all(Flow& flow) {
    std::vector<net::AsyncHttpClient::CallId> calls;
    {
      std::lock_guard lock(flow.mutex);
      flow.finished = true;
      calls = flow.calls;
    }
    for (auto id : calls) client_.cancel(id);
  }

  net::AsyncHttpRequest upstream(const Backend& b, const std::string& method,
                                 const std::string& target, std::string body,
                                 const net::Headers& headers) const {
    net::AsyncHttpRequest r;
    r.host = b.endpoint.host;
    r.port = b.endpoint.port;
    r.method = method;
    r.target = target;
    r.body = std::move(body);
    r.headers = headers;
    r.timeout = options_.upstream_timeout;
    return r;
  }

  // Starts a leg unless the flow already ended (the client left, or another leg failed).
  void start_leg(const std::shared_ptr<Flow>& flow, Backend& b, net::AsyncHttpRequest r,
                 net::AsyncHttpHandlers h) {
    std::lock_guard lock(flow->mutex);
    if (flow->finished) return;
    ++b.in_flight;
    auto done = std::move(h.on_done);
    h.on_done = [&b, done](const std::string& error) {
      --b.in_flight;
      if (done) done(error);
    };
    flow->calls.push_back(client_.start(std::move(r), std::move(h)));
  }

  // Relays one upstream response to the client as it arrives: streams stay streams.
  void relay(const std::shared_ptr<Flow>& flow, Backend& b, const std::string& method,
             const std::string& target, std::string body, const net::Headers& headers) {
    struct Relay {
      int status = 0;
      std::string content_type, body;
      bool streaming = false;
    };
    auto state = std::make_shared<Relay>();
    net::AsyncHttpHandlers h;
    h.on_head = [flow, state](int status, const net::Headers& hs) {
      state->status = status;
      state->content_type = hs.get("Content-Type", "application/json");
      state->streaming = state->content_type.rfind("text/event-stream", 0) == 0;
      if (state->streaming) {
        std::lock_guard lock(flow->mutex);
        flow->answered = true;
        flow->exchange->start_stream(status, state->content_type);
      }
    };
    h.on_body = [flow, state](std::string_view piece) {
      if (!state->streaming) {
        state->body += piece;
        return true;
      }
      return flow->exchange->write(piece);
    };
    const std::string where = b.endpoint.host + ":" + std::to_string(b.endpoint.port);
    h.on_done = [this, flow, state, where](const std::string& error) {
      if (state->streaming) {
        // Mid-stream failure: cut the stream so the client sees it was incomplete.
        if (error.empty())
          flow->exchange->end();
        else
          flow->exchange->abort();
      } else if (error.empty()) {
        respond(*flow, state->status, state->body, state->content_type);
      } else {
        fail(*flow, "engine " + where + " failed: " + error);
      }
      cancel_all(*flow);
    };
    start_leg(flow, b, upstream(b, method, target, std::move(body), headers), std::move(h));
  }

  void respond(Flow& flow, int status, const std::string& body, const std::string& type) {
    std::lock_guard lock(flow.mutex);
    if (flow.answered) return;
    flow.answered = true;
    flow.exchange->respond(status, body, type);
  }

  // An upstream failure before the client got anything: 502 in the OpenAI shape.
  void fail(Flow& flow, const std::string& message) {
    std::lock_guard lock(flow.mutex);
    if (flow.answered) return;
    flow.answered = true;
    flow.exchange->send_error(502, message, "server_error");
  }

  void sequential(const std::shared_ptr<Flow>& flow, Backend& prefill, Backend& decode,
                  const std::string& target, json body, const net::Headers& headers) {
    json pre = body;
    pre["kv_transfer_params"] = {{"do_remote_decode", true},    {"do_remote_prefill", false},
                                 {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
                                 {"remote_host", nullptr},      {"remote_port", nullptr}};
    pre["stream"] = false;
    pre.erase("stream_options");
    pre["max_tokens"] = 1;
    if (pre.contains("max_completion_tokens")) pre["max_completion_tokens"] = 1;
    pre.erase("min_tokens");
    auto answer = std::make_shared<std::pair<int, std::string>>();
    net::AsyncHttpHandlers h;
    h.on_head = [answer](int status, const net::Headers&) { answer->first = status; };
    h.on_body = [answer](std::string_view piece) {
      answer->second += piece;
      return true;
    };
    const std::string where = prefill.endpoint.host + ":" + std::to_string(prefill.endpoint.port);
    h.on_done = [this, flow, answer, body = std::move(body), &decode, target, headers,
                 where](const std::string& error) mutable {
      if (!error.empty()) {
        fail(*flow, "prefill engine " + where + " failed: " + error);
        return;
      }
      if (answer->first != 200) {  // the engine's own error, as it sent it
        respond(*flow, answer->first, answer->second, "application/json");
        return;
      }
      json params;
      try {
        params = parse_untrusted_json(answer->second).at("kv_transfer_params");
      } catch (const std::exception&) {
        fail(*flow, "prefill engine " + where + " answered without kv_transfer_params");
        return;
      }
      body["kv_transfer_params"] = params;  // opaque: forwarded verbatim
      relay(flow, decode, "POST", target, body.dump(), headers);
    };
    start_leg(flow, prefill, upstream(prefill, "POST", target, pre.dump(), headers), std::move(h));
  }

  void parallel(const std::shared_ptr<Flow>& flow, Backend& prefill, Backend& decode,
                const std::string& target, json body, const net::Headers& headers) {
    body["bootstrap_host"] = prefill.endpoint.host;
    body["bootstrap_port"] = prefill.endpoint.bootstrap_port;
    body["bootstrap_room"] = random_u64() & 0x7fffffffffffffffULL;
    const std::string text = body.dump();
    // The prefill leg's answer is drained; its failure fails the request (the decode leg would
    // only wait for KV that never comes): the engine's own error when it sent one, else 502.
    auto answer = std::make_shared<std::pair<int, std::string>>();
    net::AsyncHttpHandlers h;
    h.on_head = [answer](int s, const net::Headers&) { answer->first = s; };
    h.on_body = [answer](std::string_view piece) {
      if (answer->first != 200) answer->second += piece;
      return true;
    };
    const std::string where = prefill.endpoint.host + ":" + std::to_string(prefill.endpoint.port);
    h.on_done = [this, flow, answer, where](const std::string& error) {
      if (error.empty() && answer->first == 200) return;
      if (error.empty())
        respond(*flow, answer->first, answer->second, "application/json");
      else
        fail(*flow, "prefill engine " + where + " failed: " + error);
      cancel_all(*flow);
    };
    start_leg(flow, prefill, upstream(prefill, "POST", target, text, headers), std::move(h));
    relay(flow, decode, "POST", target, text, headers);
  }

  GatewayOptions options_;
  std::vector<std::unique_ptr<Backend>> prefill_, decode_;
  net::AsyncHttpClient client_;  // before server_: the server's handlers use it
  net::HttpServer server_;
};

Gateway::Gateway(GatewayOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Gateway::~Gateway() {
  stop();
}
void Gateway::start() {
  impl_->start();
}
uint16_t Gateway::port() const {
  return impl_->port();
}
void Gateway::stop() {
  impl_->stop();
}

}  // namespace tandem::gateway
