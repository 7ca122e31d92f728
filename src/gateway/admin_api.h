#pragma once
// The gateway's admin API and debug view (behind admin_api_key; docs/gateway.md, "Admin API"):
// GET/POST /admin/endpoints, POST /admin/endpoints/remove, POST /admin/reload and
// GET /debug/requests. Requests are read on the io threads; the changes run on the scheduling
// thread through the dispatcher (of every replica, for replicas in one AdminReplicas set).
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "gateway/dispatcher.h"
#include "gateway/seams.h"
#include "gateway/topology.h"
#include "net/http_server.h"

namespace tandem::gateway {

// An endpoint as the admin API takes it: an entry of a topology file's `endpoints` list in JSON
// ("HOST:PORT[@BOOTSTRAP]" or an object with url or host and port, bootstrap_port, group, name,
// max_in_flight, kv_events, kv_events_replay), checked as the file's are (parse_endpoint_entry).
// Throws tandem::Error naming the field.
Endpoint endpoint_from_json(const nlohmann::json& j);

class AdminApi;

// The replicas of one gateway behind one port (`tandem serve --gateways N`): each keeps its own
// engine table, so an admin change made through the one a connection reached changed only that
// one (the others kept sending to a removed engine). With a set, a change through any replica is
// applied to every replica and answered once. Every replica joins (in construction) before any
// change is taken, and all are stopped before any is destroyed (stop_together).
class AdminReplicas {
 public:
  explicit AdminReplicas(size_t count) : count_(count) {}
  size_t count() const { return count_; }

 private:
  friend class AdminApi;
  void join(AdminApi* replica);
  // Every replica, in the order they joined; empty until all `count` have.
  std::vector<AdminApi*> all() const;

  const size_t count_;
  mutable std::mutex mutex_;
  std::vector<AdminApi*> replicas_;
};

class AdminApi {
 public:
  // `config_path`: the topology file /admin/reload reads (empty: reload is refused).
  // `replicas`: the set this gateway is a replica of (null: it is alone).
  AdminApi(const Topology& topology, std::string config_path, Executor& executor,
           Dispatcher& dispatcher, std::shared_ptr<AdminReplicas> replicas = nullptr);
  void add_routes(net::HttpServer& server);

  // What a change did on one replica: a status and, below 400, its answer; else why not.
  struct Applied {
    int status = 0;
    nlohmann::json body;
    std::string error;
  };
  // A change, run on a replica's scheduling thread with its dispatcher, and how the answers of
  // two replicas that applied it combine into one (into the first).
  using Change = std::function<Applied(Dispatcher&)>;
  using Combine = std::function<void(nlohmann::json& first, const nlohmann::json& next)>;
  // Applies `change` to every replica (this one alone without a set), one after the other on
  // each one's scheduling thread, and answers `ex` once: the first refusal, or the answers
  // combined. Also for what reads every replica (the dashboard's state).
  void apply(std::shared_ptr<net::Exchange> ex, Change change, Combine combine);

 private:
  void add(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex);
  void remove(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex);
  void reload(std::shared_ptr<net::Exchange> ex);
  size_t replica_count() const { return replicas_ ? replicas_->count() : 1; }

  const Topology& topo_;
  const std::string config_path_;
  // The file as the gateway started from it: what a reload reports as not applied is what
  // changed since (flags given over it at start are no change of the file's).
  std::optional<Topology> file_at_start_;
  Executor& exec_;
  Dispatcher& dispatcher_;
  const std::shared_ptr<AdminReplicas> replicas_;
};

}  // namespace tandem::gateway
