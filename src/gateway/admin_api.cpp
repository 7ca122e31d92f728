#include "gateway/admin_api.h"

#include <nlohmann/json.hpp>

#include "gateway/front_end.h"
#include "util/error.h"
#include "util/json.h"

namespace tandem::gateway {

using nlohmann::json;

namespace {

// Runs an admin task on the scheduling thread. Whatever it throws is answered: an exception that
// left the task unanswered made the server say 'the server did not produce a response'.
template <typename F>
void answered(net::Exchange& ex, F&& task) {
  try {
    task();
  } catch (const std::exception& e) {
    ex.send_error(500, std::string("admin: ") + e.what());
  }
}

}  // namespace

Endpoint endpoint_from_json(const json& j) {
  // The topology file's reader: one set of checks for engines however they arrive.
  return parse_endpoint_entry(j.dump(), "endpoint");
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
      answered(*ex, [&] {
        ex->respond(
            200, dispatcher_.debug_requests().dump(-1, ' ', false, json::error_handler_t::replace));
      });
    });
  });
  server.route("GET", "/admin/endpoints", [this](const net::HttpRequest& req, auto ex) {
    if (!admin_key_accepted(topo_, req, *ex)) return;
    exec_.post([this, ex] {
      answered(*ex, [&] { ex->respond(200, dispatcher_.endpoints_json().dump()); });
    });
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
    if (!body.is_object()) throw Error("expected an object with pool and endpoint");
    for (const auto& [key, value] : body.items())
      if (key != "pool" && key != "endpoint")
        throw Error(key + ": expected one of pool, endpoint, got an unknown key");
    const auto pool = body.find("pool");
    if (pool == body.end() || !pool->is_string() || (*pool != "prefill" && *pool != "decode"))
      throw Error("pool: expected prefill or decode");
    prefill = *pool == "prefill";
    if (!body.contains("endpoint")) throw Error("endpoint: expected an engine, got nothing");
    e = endpoint_from_json(body.at("endpoint"));
  } catch (const std::exception& err) {
    ex->send_error(400, std::string("admin: ") + err.what());
    return;
  }
  exec_.post([this, ex, prefill, e] {
    answered(*ex, [&] {
      int id = -1;
      if (auto why = dispatcher_.add_endpoint(prefill, e, &id); !why.empty()) {
        ex->send_error(400, "admin: " + why);
        return;
      }
      ex->respond(201, dispatcher_.endpoint_json(id).dump());
    });
  });
}

void AdminApi::remove(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
  std::string name;
  try {
    const json body = parse_untrusted_json(req.body);  // its error names the offset
    if (!body.is_object()) throw Error("expected an object {\"name\": NAME}");
    for (const auto& [key, value] : body.items())
      if (key != "name") throw Error(key + ": expected only name, got an unknown key");
    const auto it = body.find("name");
    if (it == body.end()) throw Error("name: expected an engine's name, got nothing");
    if (!it->is_string() || it->get_ref<const std::string&>().empty())
      throw Error("name: expected an engine's name (a non-empty string), got " +
                  std::string(it->is_string() ? "an empty string" : it->type_name()));
    name = it->get<std::string>();
  } catch (const std::exception& err) {
    ex->send_error(400, std::string("admin: ") + err.what());
    return;
  }
  exec_.post([this, ex, name] {
    answered(*ex, [&] {
      int64_t in_flight = 0;
      if (dispatcher_.remove_endpoint(name, &in_flight))
        ex->respond(200, json{{"removed", name}, {"draining_requests", in_flight}}.dump());
      else
        ex->send_error(404, "admin: no endpoint named '" + name + "'");
    });
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
    if (const std::string why = reload_refusal(topo_, next); !why.empty()) throw Error(why);
  } catch (const std::exception& err) {
    ex->send_error(400, std::string("admin: reload failed, topology unchanged: ") + err.what());
    return;
  }
  exec_.post([this, ex, next] {
    answered(*ex, [&] {
      EndpointTable::ReloadResult result;
      try {
        result = dispatcher_.reload(next);
      } catch (const std::exception& err) {
        // A new engine that cannot join (its KV-event consumer): the reload changed nothing.
        ex->send_error(400, std::string("admin: reload failed, topology unchanged: ") + err.what());
        return;
      }
      ex->respond(200, json{{"added", result.added}, {"removed", result.removed}}.dump());
    });
  });
}

}  // namespace tandem::gateway
