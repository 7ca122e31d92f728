#include "gateway/dashboard.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "gateway/front_end.h"
#include "gateway/http_seams.h"
#include "gateway/request_record.h"

namespace tandem::gateway {

using nlohmann::json;

namespace {

// `into[key]` plus `next[key]`, numbers (an absent one counts 0).
void add(json& into, const json& next, const std::string& key) {
  const auto n = next.find(key);
  if (n == next.end() || !n->is_number()) return;
  const auto i = into.find(key);
  if (i == into.end() || !i->is_number()) {
    into[key] = *n;
  } else if (i->is_number_float() || n->is_number_float()) {
    *i = i->get<double>() + n->get<double>();
  } else {
    *i = i->get<int64_t>() + n->get<int64_t>();
  }
}

// `into[key]` and `next[key]`, objects of counts (by status, by class, prefix reuse), added key
// by key.
void add_counts(json& into, const json& next, const std::string& key) {
  const auto n = next.find(key);
  if (n == next.end() || !n->is_object()) return;
  json& counts = into[key];
  if (!counts.is_object()) counts = json::object();
  for (const auto& [name, value] : n->items()) add(counts, *n, name);
}

void keep_max(json& into, const json& next, const std::string& key) {
  const auto n = next.find(key);
  if (n == next.end() || !n->is_number()) return;
  const auto i = into.find(key);
  if (i == into.end() || !i->is_number() || *n > *i) into[key] = *n;
}

// Where the replicas learn an engine's load: one value where they agree, else each value once,
// sorted and joined with '/' (one still asking while another has reports is the operator's to
// see, not one replica's word).
void merge_load_source(json& into, const json& next) {
  const auto n = next.find("load_source");
  if (n == next.end() || !n->is_string()) return;
  const auto i = into.find("load_source");
  if (i == into.end() || !i->is_string()) {
    into["load_source"] = *n;
    return;
  }
  std::set<std::string> sources;
  const std::string& mine = i->get_ref<const std::string&>();
  for (size_t from = 0; from <= mine.size();) {
    const size_t to = std::min(mine.find('/', from), mine.size());
    sources.insert(mine.substr(from, to - from));
    from = to + 1;
  }
  if (!sources.insert(n->get<std::string>()).second) return;
  std::string joined;
  for (const std::string& s : sources) joined += (joined.empty() ? "" : "/") + s;
  into["load_source"] = joined;
}

}  // namespace

// One engine as two replicas see it: each has its own requests on it, its own health verdict and
// its own poll of its load.
void merge_endpoint(json& into, const json& next) {
  for (const char* key : {"in_flight", "max_in_flight", "uncached_tokens_in_flight"})
    add(into, next, key);
  keep_max(into, next, "consecutive_failures");
  keep_max(into, next, "failed_probes_while_out");
  keep_max(into, next, "prefix_blocks");
  // Ejected by one replica is news to an operator, though the others still send to it.
  into["healthy"] = into.value("healthy", true) && next.value("healthy", true);
  // Held by one replica for its first check: not yet taking that replica's share.
  if (next.value("unchecked", false)) into["unchecked"] = true;
  // The least a replica was told, as the gateway takes the least of its engines' (a replica
  // that has not asked yet shows none).
  if (const auto n = next.find("max_model_len"); n != next.end() && n->is_number()) {
    const auto i = into.find("max_model_len");
    if (i == into.end() || !i->is_number() || *n < *i) into["max_model_len"] = *n;
  }
  merge_load_source(into, next);
  for (const char* key : {"unhealthy_reason", "load_error"})
    if (!into.contains(key) && next.contains(key)) into[key] = next[key];
  if (const auto load = next.find("load"); load != next.end()) {
    const auto mine = into.find("load");
    if (mine == into.end() || load->value("age_ms", 0.0) < mine->value("age_ms", 0.0))
      into["load"] = *load;
  }
  add_counts(into, next, "reuse");
}

namespace {

// An engine's entry across replicas: removed and added again at once, one name can have a
// draining entry beside the new one.
using EndpointKey = std::tuple<std::string, std::string, std::string, int, bool>;
EndpointKey endpoint_key(const json& e) {
  return {e.value("name", ""), e.value("pool", ""), e.value("host", ""), e.value("port", 0),
          e.value("draining", false)};
}

void merge_histogram(json& into, const json& next) {
  if (!into.is_object() || !next.is_object() ||
      into.value("bounds", json()) != next.value("bounds", json()))
    return;  // never so: every replica has the same buckets
  json& cumulative = into["cumulative"];
  const json more = next.value("cumulative", json());
  if (!cumulative.is_array() || !more.is_array() || cumulative.size() != more.size()) return;
  for (size_t i = 0; i < cumulative.size(); ++i)
    cumulative[i] = cumulative[i].get<uint64_t>() + more[i].get<uint64_t>();
  add(into, next, "sum");
  add(into, next, "count");
}

// When a recent request ended (its line's receipt plus its time in the gateway).
double ended_unix_ms(const json& line) {
  return line.value("time_unix_ms", 0.0) + line.value("e2e_seconds", 0.0) * 1000.0;
}

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

void merge_endpoint_lists(json& into, const json& next) {
  if (!into.is_array()) into = json::array();
  if (!next.is_array()) return;
  // Each entry's key made once: a search of `into` for each of next's made O(E^2) of them, a
  // tuple of strings each, on every poll of a stack with E engines.
  std::map<EndpointKey, size_t> at;
  for (size_t i = 0; i < into.size(); ++i) at.emplace(endpoint_key(into[i]), i);
  for (const json& e : next) {
    const auto [same, added] = at.emplace(endpoint_key(e), into.size());
    if (added)
      into.push_back(e);
    else
      merge_endpoint(into[same->second], e);
  }
}

void merge_dashboard_state(json& into, const json& next) {
  add(into, next, "waiting");
  add(into, next, "running");
  keep_max(into, next, "time_unix_ms");
  merge_endpoint_lists(into["endpoints"], next.value("endpoints", json::array()));
  json& totals = into["totals"];
  if (!totals.is_object()) totals = json::object();
  if (const auto t = next.find("totals"); t != next.end() && t->is_object()) {
    add(totals, *t, "requests");
    for (const char* key : {"by_status", "prefix_reuse", "by_class"}) add_counts(totals, *t, key);
  }
  json& recent = into["recent"];
  if (!recent.is_array()) recent = json::array();
  for (const json& line : next.value("recent", json::array())) recent.push_back(line);
  std::stable_sort(recent.begin(), recent.end(), [](const json& a, const json& b) {
    return ended_unix_ms(a) < ended_unix_ms(b);
  });
  if (recent.size() > RequestRecorder::kRecent)
    recent.erase(recent.begin(), recent.begin() + static_cast<std::ptrdiff_t>(
                                                      recent.size() - RequestRecorder::kRecent));
  if (const auto h = next.find("histograms"); h != next.end() && h->is_object())
    for (const auto& [name, histogram] : h->items())
      if (into["histograms"].contains(name)) merge_histogram(into["histograms"][name], histogram);
}

void Dashboard::add_routes(net::HttpServer& server) {
  // The page itself carries no data: it is served to anyone, and asks for the key it needs.
  server.route("GET", "/dashboard", [](const net::HttpRequest&, auto ex) {
    ex->respond(200, std::string(dashboard_page()), "text/html; charset=utf-8");
  });
  server.route("GET", "/dashboard/state", [this](const net::HttpRequest& req, auto ex) {
    if (!dashboard_key_accepted(topo_, req, *ex)) return;
    // A connection reaches one replica, which saw only its share of the requests.
    admin_.apply(
        std::move(ex),
        [](Dispatcher& dispatcher) {
          return AdminApi::Applied{200, dispatcher.dashboard_state(), {}};
        },
        merge_dashboard_state);
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
