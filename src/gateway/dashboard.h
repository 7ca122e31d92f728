#pragma once
// The gateway's live dashboard (docs/gateway.md, "Dashboard"): GET /dashboard serves one
// self-contained page (src/gateway/dashboard/dashboard.html, built into the binary; it holds no
// data), which polls GET /dashboard/state (the engines, recent requests, totals and latency
// histograms, as Dispatcher::dashboard_state builds it) and GET /dashboard/expert_load?endpoint=
// NAME (the engine's own /expert_load, relayed). The data routes are behind the admin key when one
// is set (the page sends the key it was opened with, /dashboard?key=KEY, as a bearer token).
// Replicas behind one port (`tandem serve --gateways N`) show the whole stack: the state is every
// replica's, merged (merge_dashboard_state).
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

#include "gateway/admin_api.h"
#include "gateway/dispatcher.h"
#include "gateway/seams.h"
#include "gateway/topology.h"
#include "net/http_server.h"

namespace tandem::gateway {

// The page, as built into the binary.
std::string_view dashboard_page();

// Adds the state of another replica, `next` (Dispatcher::dashboard_state), to `into`, so that the
// page shows the stack as one gateway: the counts, totals and histograms summed, the recent
// requests of both (the latest RequestRecorder::kRecent by their end), and each engine once, with
// the requests every replica has on it; it is shown healthy only where every replica finds it
// so, with the freshest load report.
void merge_dashboard_state(nlohmann::json& into, const nlohmann::json& next);
// Adds another replica's list of engines (Dispatcher::endpoints_json's "endpoints") to `into`, as
// merge_dashboard_state merges them: each engine once (by name, pool, address and draining), in
// the order they were first listed, with every replica's requests on it, and healthy only where
// every replica finds it so.
void merge_endpoint_lists(nlohmann::json& into, const nlohmann::json& next);
// Adds another replica's entry of the same engine (Dispatcher::endpoint_json) to `into`, as
// merge_endpoint_lists merges each: its requests and in-flight limits summed, healthy only where
// every replica finds it so.
void merge_endpoint(nlohmann::json& into, const nlohmann::json& next);

class Dashboard {
 public:
  // `admin`: what reads every replica (AdminApi::apply).
  Dashboard(const Topology& topology, Executor& executor, Upstream& upstream,
            Dispatcher& dispatcher, AdminApi& admin)
      : topo_(topology),
        exec_(executor),
        upstream_(upstream),
        dispatcher_(dispatcher),
        admin_(admin) {}
  void add_routes(net::HttpServer& server);

 private:
  // Scheduling thread: GET /expert_load of the engine named `name`.
  void relay_expert_load(std::shared_ptr<net::Exchange> ex, const std::string& name);

  const Topology& topo_;
  Executor& exec_;
  Upstream& upstream_;
  Dispatcher& dispatcher_;
  AdminApi& admin_;
};

}  // namespace tandem::gateway
