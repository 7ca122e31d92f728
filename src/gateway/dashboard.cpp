#include "gateway/dashboard.h"

#include <nlohmann/json.hpp>

#include "gateway/front_end.h"
#include "gateway/http_seams.h"

namespace tandem::gateway {

namespace {

// With an admin key, that key as a bearer token; without one, a client key when the gateway
// has client keys (the state names every engine and the last requests, and the expert loads are
// fetched from the engines with the engines' key: a guarded gateway must not give them to anyone);
// open only when the gateway itself is. Else 401.
bool dashboard_key_accepted(const Topology& topo, const net::HttpRequest& req, net::Exchange& ex) {
  if (!topo.admin_api_key.empty()) return admin_key_accepted(topo, req, ex);
  if (!topo.api_keys.empty()) return api_key_accepted(topo, req, ex);
  return true;
}

}  // namespace

void Dashboard::add_routes(net::HttpServer& server) {
  // The page itself carries no data: it is served to anyone, and asks for the key it needs.
  server.route("GET", "/dashboard", [](const net::HttpRequest&, auto ex) {
    ex->respond(200, std::string(dashboard_page()), "text/html; charset=utf-8");
  });
  server.route("GET", "/dashboard/state", [this](const net::HttpRequest& req, auto ex) {
    if (!dashboard_key_accepted(topo_, req, *ex)) return;
    exec_.post([this, ex] {
      ex->respond(200, dispatcher_.dashboard_state().dump(
                           -1, ' ', false, nlohmann::json::error_handler_t::replace));
    });
  });
  server.route("GET", "/dashboard/expert_load", [this](const net::HttpRequest& req, auto ex) {
    if (!dashboard_key_accepted(topo_, req, *ex)) return;
    auto name = net::query_param(req.query, "endpoint");
    if (!name || name->empty()) {
      ex->send_error(400, "endpoint: expected ?endpoint=NAME, the name of one of the engines",
                     "invalid_request_error");
      return;
    }
    exec_.post([this, ex, name = std::move(*name)] { relay_expert_load(ex, name); });
  });
}

void Dashboard::relay_expert_load(std::shared_ptr<net::Exchange> ex, const std::string& name) {
  const EndpointState* e = dispatcher_.endpoint_named(name);
  if (!e) {
    ex->send_error(404, "endpoint: no engine is named \"" + name + "\"", "invalid_request_error",
                   "not_found");
    return;
  }
  net::AsyncHttpRequest u;
  u.host = e->config.host;
  u.port = e->config.port;
  u.target = "/expert_load";
  u.timeout = topo_.timeouts.connect;
  relay_engine_call(upstream_, std::move(u), e->config.name, std::move(ex));
}

}  // namespace tandem::gateway
