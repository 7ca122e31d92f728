#include "gateway/admin_api.h"

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gateway/dashboard.h"
#include "gateway/front_end.h"
#include "gateway/policy.h"
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

// One change on its way through the replicas: each applies it on its own scheduling thread and
// hands it to the next from there, so changes made at once through different replicas reach
// every replica in the order they reached the first (each executor runs tasks in posting order).
struct Rollout {
  struct Replica {
    Executor* exec = nullptr;
    Dispatcher* dispatcher = nullptr;
  };
  std::vector<Replica> replicas;
  AdminApi::Change change;
  AdminApi::Combine combine;
  std::shared_ptr<net::Exchange> ex;
  int status = 0;
  json body;  // the answers so far, combined
};

void roll_out(std::shared_ptr<Rollout> r, size_t i) {
  Executor& exec = *r->replicas[i].exec;
  exec.post([r = std::move(r), i] {
    answered(*r->ex, [&] {
      AdminApi::Applied got = r->change(*r->replicas[i].dispatcher);
      if (got.status >= 400) {
        // The first replica refusing changed nothing anywhere; a later one should not (they
        // hold the same engines), but if it does the replicas differ, which is the gateway's
        // fault, not the caller's.
        if (i == 0)
          r->ex->send_error(got.status, "admin: " + got.error);
        else
          r->ex->send_error(500, "admin: gateway replicas 0.." + std::to_string(i - 1) +
                                     " applied it, replica " + std::to_string(i) +
                                     " refused it: " + got.error);
        return;
      }
      if (i == 0) {
        r->status = got.status;
        r->body = std::move(got.body);
      } else {
        r->combine(r->body, got.body);
      }
      if (i + 1 == r->replicas.size())
        r->ex->respond(r->status, r->body.dump(-1, ' ', false, json::error_handler_t::replace));
      else
        roll_out(r, i + 1);
    });
  });
}

}  // namespace

void AdminReplicas::join(AdminApi* replica) {
  std::lock_guard lock(mutex_);
  replicas_.push_back(replica);
}

std::vector<AdminApi*> AdminReplicas::all() const {
  std::lock_guard lock(mutex_);
  return replicas_.size() == count_ ? replicas_ : std::vector<AdminApi*>{};
}

namespace {

// Why a gateway could not start from the reloaded file `next`, as far as it can be checked without
// starting one (a port's bind, or a tokenizer's load, cannot): empty when nothing is found. Only
// the settings the file changed since `then` (its text at start, when it was read) are checked,
// and not those `running` took from a flag instead: a file's access_log in a folder this host
// lacks, which `--access-log -` overrode, or a model folder since removed, refused every later
// reload, even one that only adds an engine.
std::string start_refusal(const Topology& next, const std::optional<Topology>& then,
                          const Topology& running) {
  auto changed = [&](std::string Topology::*setting) {
    return !then || ((*then).*setting != next.*setting && running.*setting == (*then).*setting);
  };
  if (changed(&Topology::policy))
    if (std::string why = unknown_policy_error(next.policy); !why.empty()) return "policy: " + why;
  if (changed(&Topology::model) && !next.model.empty() &&
      !std::filesystem::is_regular_file(std::filesystem::path(next.model) / "tokenizer.json"))
    return "model: " + next.model + " has no tokenizer.json (the gateway tokenizes with it)";
  if (changed(&Topology::access_log) && !next.access_log.empty() && next.access_log != "-") {
    const auto dir = std::filesystem::path(next.access_log).parent_path();
    if (!dir.empty() && !std::filesystem::is_directory(dir))
      return "access_log: " + next.access_log + ": no such directory";
  }
  return {};
}

// The file's settings, changed since `then`, that a reload does not apply (they need a restart):
// all but the pools' engines, dialect and max_in_flight (mode and tokens_in are refused).
std::vector<std::string> not_applied(const Topology& then, const Topology& now) {
  std::vector<std::string> out;
  auto check = [&out](bool same, const char* key) {
    if (!same) out.emplace_back(key);
  };
  check(then.host == now.host && then.port == now.port && then.io_threads == now.io_threads &&
            then.reuse_port == now.reuse_port && then.max_body_bytes == now.max_body_bytes &&
            then.max_body_time == now.max_body_time &&
            then.max_unsent_bytes == now.max_unsent_bytes &&
            then.max_connections == now.max_connections &&
            then.max_connections_per_address == now.max_connections_per_address &&
            then.allowed_origins == now.allowed_origins,
        "listen");
  check(then.policy == now.policy, "policy");
  check(then.model == now.model, "model");
  check(then.served_model_name == now.served_model_name, "served_model_name");
  check(then.api_keys == now.api_keys, "api_keys");
  check(then.admin_api_key == now.admin_api_key, "admin_api_key");
  check(then.metrics_api_key == now.metrics_api_key, "metrics_api_key");
  check(then.engine_api_key == now.engine_api_key, "engine_api_key");
  check(then.max_tokens_limit == now.max_tokens_limit &&
            then.default_max_tokens == now.default_max_tokens,
        "max_tokens");
  check(then.max_queue == now.max_queue, "max_queue");
  check(then.max_queued_body_bytes == now.max_queued_body_bytes, "max_queued_body_bytes");
  check(then.max_answer_bytes == now.max_answer_bytes, "max_answer_bytes");
  check(then.prefill_retries == now.prefill_retries, "prefill_retries");
  // Whole sections compared (defaulted ==), so a field added to one is covered: comparing a
  // list of fields missed scheduling.max_hold_ms, cache_aware.*, a class's max_wait_ms ...
  check(then.retry_backoff == now.retry_backoff, "retry_backoff");
  check(then.access_log == now.access_log, "access_log");
  check(then.shutdown_timeout == now.shutdown_timeout, "shutdown_timeout");
  check(then.health == now.health, "health");
  check(then.timeouts == now.timeouts, "timeouts");
  check(then.scheduling == now.scheduling, "scheduling");
  check(then.priority == now.priority, "priority_classes");
  return out;
}

}  // namespace

Endpoint endpoint_from_json(const json& j) {
  // The topology file's reader: one set of checks for engines however they arrive.
  return parse_endpoint_entry(j.dump(), "endpoint");
}

AdminApi::AdminApi(const Topology& topology, std::string config_path, Executor& executor,
                   Dispatcher& dispatcher, std::shared_ptr<AdminReplicas> replicas)
    : topo_(topology),
      config_path_(std::move(config_path)),
      exec_(executor),
      dispatcher_(dispatcher),
      replicas_(std::move(replicas)) {
  if (replicas_) replicas_->join(this);
  // Read again (cheap): a file that no longer loads leaves nothing to compare with.
  if (!config_path_.empty()) try {
      file_at_start_ = load_topology(config_path_);
    } catch (const std::exception&) {
    }
}

void AdminApi::apply(std::shared_ptr<net::Exchange> ex, Change change, Combine combine) {
  const std::vector<AdminApi*> replicas =
      replicas_ ? replicas_->all() : std::vector<AdminApi*>{this};
  if (replicas.empty()) {
    ex->send_error(503, "admin: the gateway's replicas are still starting; try again");
    return;
  }
  auto r = std::make_shared<Rollout>();
  for (AdminApi* a : replicas) r->replicas.push_back({&a->exec_, &a->dispatcher_});
  r->change = std::move(change);
  r->combine = std::move(combine);
  r->ex = std::move(ex);
  roll_out(std::move(r), 0);
}

void AdminApi::add_routes(net::HttpServer& server) {
  server.route("GET", "/debug/requests", [this](const net::HttpRequest& req, auto ex) {
    if (!admin_key_accepted(topo_, req, *ex)) return;
    // Every replica's requests: a connection reaches one replica, which holds its own only.
    apply(
        std::move(ex),
        [](Dispatcher& dispatcher) {
          return Applied{200, dispatcher.debug_requests(), {}};
        },
        [](json& first, const json& next) {
          for (const json& r : next.at("requests")) first["requests"].push_back(r);
          first["waiting"] = first["waiting"].get<size_t>() + next.at("waiting").get<size_t>();
        });
  });
  server.route("GET", "/admin/endpoints", [this](const net::HttpRequest& req, auto ex) {
    if (!admin_key_accepted(topo_, req, *ex)) return;
    // Every replica's view: each has its own requests on an engine and its own health verdict
    // (an engine one replica ejected is still sent to by the others), merged as the dashboard's.
    apply(
        std::move(ex),
        [](Dispatcher& dispatcher) {
          return Applied{200, dispatcher.endpoints_json(), {}};
        },
        [](json& first, const json& next) {
          merge_endpoint_lists(first["endpoints"], next.at("endpoints"));
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
    // A key given twice is refused, as the topology file refuses it: the last one silently won.
    const json body = parse_untrusted_json(req.body, 64, DuplicateKeys::kRefuse);
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
  // Replicas each take their share of the engine's own in-flight limit, as of their pools'
  // (tandem serve): together they send it no more than one gateway would (plus one per extra
  // replica).
  const int n = static_cast<int>(replica_count());
  if (e.max_in_flight > 0) e.max_in_flight = (e.max_in_flight + n - 1) / n;
  apply(
      std::move(ex),
      [prefill, e](Dispatcher& dispatcher) {
        int id = -1;
        if (auto why = dispatcher.add_endpoint(prefill, e, &id); !why.empty())
          return Applied{400, nullptr, why};
        return Applied{201, dispatcher.endpoint_json(id), {}};
      },
      // Every replica's share of its limit, as GET /admin/endpoints shows it.
      [](json& first, const json& next) { merge_endpoint(first, next); });
}

void AdminApi::remove(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
  std::string name;
  try {
    // Its error names the offset, or a key given twice (the last one won: another engine).
    const json body = parse_untrusted_json(req.body, 64, DuplicateKeys::kRefuse);
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
  apply(
      std::move(ex),
      [name](Dispatcher& dispatcher) {
        int64_t in_flight = 0;
        if (!dispatcher.remove_endpoint(name, &in_flight))
          return Applied{404, nullptr, "no endpoint named '" + name + "'"};
        return Applied{200, json{{"removed", name}, {"draining_requests", in_flight}}, {}};
      },
      [](json& first, const json& next) {  // every replica's requests still on the engine
        first["draining_requests"] =
            first["draining_requests"].get<int64_t>() + next["draining_requests"].get<int64_t>();
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
    // Checked as at start: a file the gateway could not start from is no file to run on.
    if (const std::string why = start_refusal(next, file_at_start_, topo_); !why.empty())
      throw Error(config_path_ + ": " + why);
  } catch (const std::exception& err) {
    ex->send_error(400, std::string("admin: reload failed, topology unchanged: ") + err.what());
    return;
  }
  std::vector<std::string> unapplied;
  if (file_at_start_) unapplied = not_applied(*file_at_start_, next);
  apply(
      std::move(ex),
      [next, unapplied](Dispatcher& dispatcher) {
        EndpointTable::ReloadResult result;
        try {
          result = dispatcher.reload(next);
        } catch (const std::exception& err) {
          // A new engine that cannot join (its KV-event consumer): the reload changed nothing.
          return Applied{400, nullptr,
                         std::string("reload failed, topology unchanged: ") + err.what()};
        }
        json answer = {{"added", result.added}, {"removed", result.removed}};
        if (!unapplied.empty()) answer["not_applied"] = unapplied;  // until a restart
        return Applied{200, std::move(answer), {}};
      },
      [](json&, const json&) {});  // the same engines joined and left every replica
}

}  // namespace tandem::gateway
