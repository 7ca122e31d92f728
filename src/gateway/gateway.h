#pragma once
// The gateway (Omni Proxy's role): one OpenAI endpoint in front of pools of prefill and decode
// engines (topology.h). Every request goes through the ten phases of lifecycle.h:
//
//   io threads      parse, authenticate, tokenize (when a model folder is configured), prepare
//                   the bodies of its legs, then hand the request to the scheduling thread;
//   scheduling      owns the endpoints, their load and health and the waiting queue; asks the
//   thread          policy (policy.h) for engines, starts the legs, runs the timers, retries a
//                   prefill that failed before the client got anything, keeps the statistics;
//   client thread   relays the engines' answers to the client as they arrive (streams stay
//                   streams, translated back to chat when the gateway sent token ids).
//
// The flows: aggregated (one engine), sequential (vLLM: prefill with
// kv_transfer_params.do_remote_decode, then decode with the prefill's kv_transfer_params) and
// parallel (SGLang: both legs at once with bootstrap_host/port/room). Endpoints can be added and
// removed at run time (/admin/endpoints, /admin/reload): a removed endpoint takes no new request
// and leaves once its requests finished. docs/gateway.md describes the API, metrics and log.
#include <cstdint>
#include <memory>
#include <string>

#include "gateway/topology.h"

namespace tandem::gateway {

class Gateway {
 public:
  // `config_path`: the topology file to re-read on /admin/reload (empty: reload is refused).
  // Throws tandem::Error for an inconsistent topology or an unreadable model folder.
  explicit Gateway(Topology topology, std::string config_path = {});
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
