#pragma once
// The gateway's live dashboard (docs/gateway.md, "Dashboard"): GET /dashboard serves one
// self-contained page (src/gateway/dashboard/dashboard.html, built into the binary; it holds no
// data), which polls GET /dashboard/state (the engines, recent requests, totals and latency
// histograms, as Dispatcher::dashboard_state builds it) and GET /dashboard/expert_load?endpoint=
// NAME (the engine's own /expert_load, relayed). The data routes are behind the admin key when one
// is set (the page sends the key it was opened with, /dashboard?key=KEY, as a bearer token).
#include <memory>
#include <string>
#include <string_view>

#include "gateway/dispatcher.h"
#include "gateway/seams.h"
#include "gateway/topology.h"
#include "net/http_server.h"

namespace tandem::gateway {

// The page, as built into the binary.
std::string_view dashboard_page();

class Dashboard {
 public:
  Dashboard(const Topology& topology, Executor& executor, Upstream& upstream,
            Dispatcher& dispatcher)
      : topo_(topology), exec_(executor), upstream_(upstream), dispatcher_(dispatcher) {}
  void add_routes(net::HttpServer& server);

 private:
  // Scheduling thread: GET /expert_load of the engine named `name`.
  void relay_expert_load(std::shared_ptr<net::Exchange> ex, const std::string& name);

  const Topology& topo_;
  Executor& exec_;
  Upstream& upstream_;
  Dispatcher& dispatcher_;
};

}  // namespace tandem::gateway
