#pragma once
// The gateway (Omni Proxy's role): one OpenAI endpoint in front of pools of prefill and decode
// engines (topology.h). Every request goes through the ten phases of lifecycle.h. The parts, by
// the thread that runs them:
//
//   io threads      front_end.h: routes, API keys, parse, tokenize, build the legs' bodies;
//                   relay.h: the engines' answers to the client as they arrive (streams stay
//                   streams, translated back to chat when the gateway sent token ids);
//                   admin_api.h: the admin API and /debug/requests (changes run on the scheduler).
//   scheduling      dispatcher.h: the queue, the policy's picks (policy.h), legs, deadlines,
//   thread          retries, drains, reloads and the end of every request; endpoints.h: the
//                   engines' state; health.h: probes and load polls; request_record.h: metrics
//                   and the access log line (written by access_log.h's own thread).
//
// Time, engines and clients reach that code through seams.h, so tests and a simulator can drive
// it on a virtual clock without sockets (virtual_executor.h). The flows: aggregated (one engine),
// sequential (vLLM: prefill with kv_transfer_params.do_remote_decode, then decode with the
// prefill's kv_transfer_params) and parallel (SGLang: both legs at once with
// bootstrap_host/port/room). Endpoints can be added and removed at run time: a removed endpoint
// takes no new request and leaves once its requests finished. docs/gateway.md describes the API,
// metrics and log.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "gateway/topology.h"
#include "util/metrics.h"

namespace tandem::net {
class ConnectionsPerAddress;  // net/http_server.h
}  // namespace tandem::net

namespace tandem::gateway {

class AdminReplicas;  // admin_api.h

class Gateway {
 public:
  // `config_path`: the topology file to re-read on /admin/reload (empty: reload is refused).
  // `replicas`: for replicas behind one port, the set every replica is built with, so an admin
  // change through any of them applies to all (null: alone). `metrics_group`: for replicas behind
  // one port, the group whose every replica's series a scrape of any of them shows (null: its
  // own only). `connections_per_address`: for replicas behind one port, the count of client
  // connections per address they share, so one address holds at most
  // topology.max_connections_per_address across all of them (null: the gateway's own count).
  // Throws tandem::Error for an inconsistent topology or an unreadable model folder.
  explicit Gateway(Topology topology, std::string config_path = {},
                   std::shared_ptr<AdminReplicas> replicas = nullptr,
                   std::shared_ptr<metrics::RegistryGroup> metrics_group = nullptr,
                   std::shared_ptr<net::ConnectionsPerAddress> connections_per_address = nullptr);
  ~Gateway();
  Gateway(const Gateway&) = delete;
  Gateway& operator=(const Gateway&) = delete;

  // How long stop() lets the requests in flight finish, by default.
  static constexpr std::chrono::milliseconds kDefaultDrain = std::chrono::seconds(30);

  void start();
  uint16_t port() const;
  // Stops in order: new requests get 503 at once; the requests in flight have up to `drain` to
  // finish (legs still start and failures are still retried meanwhile); those left then end:
  // a client that has nothing yet gets 503 "the gateway is shutting down" (an OpenAI error), a
  // stream ends with that error event; no engine is blamed. Then the connections close: those
  // whose complete answer a slow reader's socket has not yet taken once it has, within what is
  // left of `drain` (HttpServer::stop's flush), the others at once. Returns once all is done;
  // later calls do nothing. The destructor stops without a drain.
  void stop(std::chrono::milliseconds drain = kDefaultDrain);
  // The first step of stop(), on its own: new requests get 503 and /health answers 503 (so load
  // balancers take this gateway out) from now on, while the requests in flight go on. For
  // replicas, which should all refuse before any of them drains (stop_together).
  void refuse_new_requests();
  // Ends a drain, and the flush after it, at once (stop() goes on with answering those left
  // 503), or the next one before it begins. From any thread: an operator's second stop signal.
  void end_drain();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// Stops replicas (`tandem serve --gateways N`) together: each refuses new requests first, then
// all drain at once, each on a thread of its own, so the stop takes one drain and not one per
// replica (while one drained the others still took requests). Meanwhile `interrupted(wait)` is
// called again and again: it waits up to `wait` for a reason to end the drain (a second stop
// signal) and says whether one came; then every drain ends at once (end_drain). Returns once
// every gateway has stopped.
void stop_together(std::span<Gateway* const> gateways, std::chrono::milliseconds drain,
                   const std::function<bool(std::chrono::milliseconds wait)>& interrupted);

}  // namespace tandem::gateway
