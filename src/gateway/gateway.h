#pragma once
// The gateway (Omni Proxy's role): one OpenAI endpoint in front of pools of prefill and decode
// engines. This is its first, core slice: the three ways of serving a request, each request
// relayed as it streams, on one asynchronous client thread:
//
//   aggregated  no prefill pool: the request goes to one decode engine as it is;
//   sequential  vLLM's flow: the prefill leg (kv_transfer_params.do_remote_decode, max_tokens 1,
//               no stream), then the original body plus the prefill's kv_transfer_params to a
//               decode engine, which pulls the KV;
//   parallel    SGLang's flow: the same body with bootstrap_host/port/room to a prefill and a
//               decode engine at once; the decode leg answers the client, the prefill leg is
//               drained, and if either leg fails the other is cancelled.
//
// Engines are chosen by fewest requests in flight. A client that disconnects cancels both legs.
// Upstream errors before any byte reached the client are answered as OpenAI errors (the engine's
// own error body when it sent one, else 502). Not yet here (see the gateway issue): the request
// lifecycle and its metrics, tokenization, health checks, retries, admin API and config files.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tandem::gateway {

enum class PdMode { kAggregated, kSequential, kParallel };

struct Endpoint {
  std::string host;
  uint16_t port = 0;
  uint16_t bootstrap_port = 0;  // parallel mode: the prefill engine's KV transfer port
};

struct GatewayOptions {
  std::string host = "0.0.0.0";
  uint16_t port = 8080;
  int http_threads = 2;
  size_t max_body_bytes = size_t{8} << 20;
  PdMode mode = PdMode::kAggregated;
  std::vector<Endpoint> prefill, decode;
  // Each upstream call: connecting, the response head, and each wait for the next piece.
  std::chrono::milliseconds upstream_timeout = std::chrono::seconds(600);
};

// "HOST:PORT" or, for a parallel-mode prefill engine, "HOST:PORT@BOOTSTRAP_PORT". Throws
// tandem::Error naming the text otherwise.
Endpoint parse_endpoint(const std::string& text);
// "aggregated", "sequential" (alias "vllm") or "parallel" (alias "sglang").
PdMode parse_mode(const std::string& text);

class Gateway {
 public:
  // Throws tandem::Error for an inconsistent configuration (no decode engine, a prefill pool in
  // aggregated mode or none in a P/D mode, a parallel-mode prefill without a bootstrap port).
  explicit Gateway(GatewayOptions options);
  ~Gateway();
  Gateway(const Gateway&) = delete;
  Gateway& operator=(const Gateway&) = delete;

  void start();
  uint16_t port() const;
  void stop();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::gateway
