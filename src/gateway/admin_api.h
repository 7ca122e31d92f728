#pragma once
// The gateway's admin API and debug view (behind admin_api_key; docs/gateway.md, "Admin API"):
// GET/POST /admin/endpoints, POST /admin/endpoints/remove, POST /admin/reload and
// GET /debug/requests. Requests are read on the io threads; the changes run on the scheduling
// thread through the dispatcher.
#include <string>

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

class AdminApi {
 public:
  // `config_path`: the topology file /admin/reload reads (empty: reload is refused).
  AdminApi(const Topology& topology, std::string config_path, Executor& executor,
           Dispatcher& dispatcher);
  void add_routes(net::HttpServer& server);

 private:
  void add(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex);
  void remove(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex);
  void reload(std::shared_ptr<net::Exchange> ex);

  const Topology& topo_;
  const std::string config_path_;
  Executor& exec_;
  Dispatcher& dispatcher_;
};

}  // namespace tandem::gateway
