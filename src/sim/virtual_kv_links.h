#pragma once
// KV transfer between simulated engines (the engine's KvTransfers seam, engine/transfer/
// kv_transfers.h), on the simulator's virtual clock: the same two flows as the real agent
// (sequential pull of held blocks, parallel bootstrap rooms pushed layer by layer as the prefill
// step completes them), the same checks (transfer ids, prompt hashes, the timeout for a hold or a
// room's other leg), no bytes moved. A transfer takes the link's latency plus its bytes over the
// link's bandwidth; a room streams each layer once its prefill step has written it and the link
// is free. Every outcome reaches its engine through the engine's Post, which is then woken.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "engine/executor/executor.h"
#include "engine/transfer/kv_transfer.h"
#include "engine/transfer/kv_transfers.h"
#include "gateway/seams.h"

namespace tandem::sim {

struct KvLinkModel {
  double bytes_per_s = 25e9;  // one engine pair's link (an RDMA NIC's worth)
  double latency_s = 50e-6;   // one way
};

class VirtualKvNetwork {
 public:
  VirtualKvNetwork(gateway::Executor& clock, KvLinkModel link);
  ~VirtualKvNetwork();

  // The KvTransfers of one engine (EngineConfig::make_transfers): `now` is the engine's clock
  // (virtual time plus its running step's modelled seconds), `wake` runs after anything was
  // posted to it. An engine with config.port >= 0 serves prefill legs at
  // config.advertise_host:config.port.
  std::unique_ptr<engine::KvTransfers> make(const engine::KvTransferConfig& config,
                                            engine::Executor& executor,
                                            engine::KvTransfers::Post post,
                                            std::function<double()> now,
                                            std::function<void()> wake);

  // The engine of this engine_id died: its server refuses connections, and transfers to or from it
  // fail (a reset connection).
  void kill(const std::string& engine_id);
  // A slow-link fault on this engine_id begins: while it lasts the engine's links run `factor`
  // times slower, or as slow as the slowest fault under way says (faults on one engine may
  // overlap or meet: each counts until its own end). The transfers that start later take
  // longer, those under way keep their times.
  void slow(const std::string& engine_id, double factor);
  // That fault ends: its factor no longer counts.
  void end_slow(const std::string& engine_id, double factor);
  // The engine of this engine_id hangs until `until` (a later end extends a stall under way),
  // frozen whole as bench/chaos.sh's SIGSTOP freezes a live engine, its KV transfer threads
  // included: a request for its KV waits until it wakes, and a transfer to or from it stops and
  // goes on when it wakes.
  void stall(const std::string& engine_id, gateway::Executor::Clock::time_point until);

  int64_t transfers() const { return transfers_; }  // completed
  double bytes() const { return bytes_; }           // that they moved

 private:
  class Endpoint;
  gateway::Executor& clock_;
  KvLinkModel link_;
  std::map<std::string, Endpoint*> servers_;    // by "host:port"
  std::map<std::string, Endpoint*> endpoints_;  // by engine id
  int64_t transfers_ = 0;
  double bytes_ = 0;
};

}  // namespace tandem::sim
