#include "gateway/admin_api.h"

#include <nlohmann/json.hpp>

#include "gateway/front_end.h"
#include "util/error.h"
#include "util/json.h"

namespace tandem::gateway {

using nlohmann::json;

Endpoint endpoint_from_json(const json& j) {
  if (j.is_string()) return parse_endpoint(j.get<std::string>());
  if (!j.is_object()) throw Error("endpoint: expected \"HOST:PORT[@BOOTSTRAP]\" or an object");
  Endpoint e;
  if (auto u = j.find("url"); u != j.end()) e = parse_endpoint(u->get<std::string>());
  if (auto h = j.find("host"); h != j.end()) e.host = h->get<std::string>();
  if (auto p = j.find("port"); p != j.end()) e.port = p->get<uint16_t>();
  if (auto b = j.find("bootstrap_port"); b != j.end()) e.bootstrap_port = b->get<uint16_t>();
  e.group = j.value("group", 0);
  e.max_in_flight = j.value("max_in_flight", 0);
  e.name = j.value("name", std::string());
  if (e.host.empty() || e.port == 0) throw Error("endpoint: host and port are required");
  if (e.name.empty()) e.name = e.host + ":" + std::to_string(e.port);
  return e;
}

AdminApi::AdminApi(const Topology& topology, std::string config_path, Executor& executor,
                   Dispatcher& dispatcher)
    : topo_(topology),
      config_path_(std::move(config_path)),
      exec_(executor),
      dispatcher_(dispatcher) {}

void AdminApi::add_routes(net::HttpServer& server) {
  server.route("GET", "/debug/requests", [this](const net::HttpRequest& req, auto ex) {
    if (!admin_key_accepted(topo_, req, *ex)) return;
    exec_.post([this, ex] {
      ex->respond(
          200, dispatcher_.debug_requests().dump(-1, ' ', false, json::error_handler_t::replace));
    });
  });
  server.route("GET", "/admin/endpoints", [this](const net::HttpRequest& req, auto ex) {
    if (!admin_key_accepted(topo_, req, *ex)) return;
    exec_.post([this, ex] { ex->respond(200, dispatcher_.endpoints_json().dump()); });
  });
  server.route("POST", "/admin/endpoints", [this](const net::HttpRequest& req, auto ex) {
    if (admin_key_accepted(topo_, req, *ex)) add(req, ex);
  });
  server.route("POST", "/admin/endpoints/remove", [this](const net::HttpRequest& req, auto ex) {
    if (admin_key_accepted(topo_, req, *ex)) remove(req, ex);
  });
  server.route("POST", "/admin/reload", [this](const net::HttpRequest& req, auto ex) {
    if (admin_key_accepted(topo_, req, *ex)) reload(ex);
  });
}

void AdminApi::add(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
  bool prefill = false;
  Endpoint e;
  try {
    const json body = parse_untrusted_json(req.body);
    const std::string pool = body.at("pool").get<std::string>();
    if (pool != "prefill" && pool != "decode") throw Error("pool: expected prefill or decode");
    prefill = pool == "prefill";
    e = endpoint_from_json(body.at("endpoint"));
  } catch (const std::exception& err) {
    ex->send_error(400, std::string("admin: ") + err.what());
    return;
  }
  exec_.post([this, ex, prefill, e] {
    int id = -1;
    if (auto why = dispatcher_.add_endpoint(prefill, e, &id); !why.empty()) {
      ex->send_error(400, "admin: " + why);
      return;
    }
    ex->respond(201, dispatcher_.endpoint_json(id).dump());
  });
}

void AdminApi::remove(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
  std::string name;
  try {
    name = parse_untrusted_json(req.body).at("name").get<std::string>();
  } catch (const std::exception& err) {
    ex->send_error(400, std::string("admin: expected {\"name\": ...}: ") + err.what());
    return;
  }
  exec_.post([this, ex, name] {
    int64_t in_flight = 0;
    if (dispatcher_.remove_endpoint(name, &in_flight))
      ex->respond(200, json{{"removed", name}, {"draining_requests", in_flight}}.dump());
    else
      ex->send_error(404, "admin: no endpoint named '" + name + "'");
  });
}

void AdminApi::reload(std::shared_ptr<net::Exchange> ex) {
  if (config_path_.empty()) {
    ex->send_error(400, "admin: the gateway was not started with --config; nothing to reload");
    return;
  }
  Topology next;
  try {
    next = load_topology(config_path_);
    if (next.mode != topo_.mode)
      throw Error("reload cannot change the mode (restart the gateway for that)");
  } catch (const std::exception& err) {
    ex->send_error(400, std::string("admin: reload failed, topology unchanged: ") + err.what());
    return;
  }
  exec_.post([this, ex, next] {
    const auto result = dispatcher_.reload(next);
    ex->respond(200, json{{"added", result.added}, {"removed", result.removed}}.dump());
  });
}

}  // namespace tandem::gateway
