#include "gateway/health.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "api/load_report.h"
#include "api/model_list.h"
#include "gateway/engine_get.h"
#include "util/utf8.h"

namespace tandem::gateway {
namespace {

// A /load answer is a few kilobytes, a model list less; anything far larger is not one.
constexpr size_t kMaxAnswerBytes = size_t{1} << 20;

// Whether an engine refuses a request naming a model its GET /v1/models does not list, so that
// such a list means every request would fail: Tandem's engines and vLLM do (404 "The model `x`
// does not exist."); SGLang, TGI and llama.cpp list their model path but serve any name
// (sglang#4293), so an alias as served_model_name is fine there. Known from the pool's dialect,
// else from the list's owned_by ("tandem", "vllm"; SGLang says "sglang").
bool refuses_unknown_names(Dialect dialect, const nlohmann::json& data) {
  if (dialect == Dialect::kTandem || dialect == Dialect::kVllm) return true;
  if (dialect != Dialect::kAuto) return false;
  for (const auto& m : data) {
    if (!m.is_object() || !m.contains("owned_by") || !m["owned_by"].is_string()) continue;
    const std::string& owner = m["owned_by"].get_ref<const std::string&>();
    if (owner == "tandem" || owner == "vllm") return true;
  }
  return false;
}

}  // namespace

// Why an engine whose GET /v1/models answered `body` serves none of `model` (the gateway's
// served_model_name, the name clients send and the gateway passes on): empty when it lists it,
// when the gateway names no model, or when the body is no model list (nothing learned). An engine
// that serves any name is kept: said once on stderr, as an alias it will serve.
std::string HealthMonitor::not_serving(const EndpointState& e, const std::string& body) {
  const std::string& model = topo_.served_model_name;
  if (model.empty()) return {};
  const nlohmann::json doc = nlohmann::json::parse(body, nullptr, false);
  if (!doc.is_object() || !doc.contains("data") || !doc["data"].is_array()) return {};
  std::string listed;
  int shown = 0;
  for (const auto& m : doc["data"]) {
    if (!m.is_object() || !m.contains("id") || !m["id"].is_string()) continue;
    const std::string& id = m["id"].get_ref<const std::string&>();
    if (id == model) return {};
    if (shown++ < 4) listed += (listed.empty() ? "'" : ", '") + utf8::clip(id) + "'";
  }
  const std::string lists =
      "its GET /v1/models lists " + (listed.empty() ? std::string("no model") : listed) +
      (shown > 4 ? " and more" : "") + ", not the gateway's served_model_name '" + model + "'";
  if (refuses_unknown_names(e.dialect, doc["data"]))
    return lists + " (each request would be refused as for an unknown model)";
  if (warned_alias_.insert(e.id).second)
    std::fprintf(stderr,
                 "tandem gateway: engine %s: %s; kept: it is no Tandem or vLLM engine (dialect "
                 "%s, no owned_by \"tandem\" or \"vllm\"), and such servers (SGLang, TGI, "
                 "llama.cpp) answer a request naming any model\n",
                 e.config.name.c_str(), lists.c_str(), dialect_name(e.dialect));
  return {};
}

HealthMonitor::HealthMonitor(const Topology& topology, Executor& executor, Upstream& upstream,
                             EndpointTable& endpoints, std::function<void()> changed)
    : topo_(topology),
      exec_(executor),
      upstream_(upstream),
      endpoints_(endpoints),
      changed_(std::move(changed)) {}

void HealthMonitor::start() {
  probe_all();
  if (topo_.scheduling.load_interval.count() > 0) poll_loads();
}

// A GET of the gateway's own (health, load) to an engine, bounded by the probe timeout.
net::AsyncHttpRequest HealthMonitor::engine_get(const EndpointState& e, std::string target) const {
  net::AsyncHttpRequest u;
  u.host = e.config.host;
  u.port = e.config.port;
  u.target = std::move(target);
  u.timeout = topo_.health.probe_timeout;
  u.connect_timeout = std::min(topo_.timeouts.connect, topo_.health.probe_timeout);
  return u;
}

void HealthMonitor::bound(Upstream::CallId call) {
  // An ended call's id is ignored by cancel(): no need to disarm this when the call ends.
  exec_.at(exec_.now() + topo_.health.probe_timeout, [this, call] { upstream_.cancel(call); });
}

void HealthMonitor::probe_all() {
  for (auto& [id, e] : endpoints_.all()) {
    if (e.probing || e.draining) continue;
    e.probing = true;
    auto status = std::make_shared<int>(0);
    net::AsyncHttpHandlers h;
    h.on_head = [status](int s, const net::Headers&) { *status = s; };
    h.on_done = [this, status, id = id](const std::string& error) {
      const bool ok = error.empty() && *status == 200;
      exec_.post([this, id, ok] {
        if (endpoints_.probe_result(id, ok, exec_.now())) changed_();
        if (ok) ask_length(id);
      });
    };
    bound(upstream_.start(engine_get(e, "/health"), std::move(h)));
  }
  exec_.at(exec_.now() + topo_.health.probe_interval, [this] { probe_all(); });
}

// GET /v1/models of an engine that passed a probe, if its longest sequence is to be asked.
void HealthMonitor::ask_length(int id) {
  EndpointState* e = endpoints_.find(id);
  if (!e || e->length_query != LengthQuery::kToAsk) return;
  e->length_query = LengthQuery::kAsking;
  const Upstream::CallId call = get_whole_answer(
      upstream_, engine_get(*e, "/v1/models"), kMaxAnswerBytes, [this, id](const EngineAnswer& a) {
        // A 4xx or a body without the field is an answer (a server that does not
        // say); a transport error or a 5xx is none, and the next probe asks again.
        std::optional<int64_t> length;
        std::string list;  // a 200's body, read for the model on the scheduling thread
        if (a.error.empty() && a.status == 200) {
          length = api::max_model_len_of(a.body).value_or(0);
          list = a.body;
        } else if (a.error.empty() && a.status >= 400 && a.status < 500) {
          length = 0;
        }
        exec_.post([this, id, length, list = std::move(list)] {
          const EndpointState* e = endpoints_.find(id);
          std::string why_not = e ? not_serving(*e, list) : std::string();
          if (endpoints_.models_result(id, length, std::move(why_not), exec_.now())) changed_();
        });
      });
  bound(call);
}

// One poll per engine at a time.
void HealthMonitor::poll_loads() {
  for (auto& [id, e] : endpoints_.all()) {
    if (e.load_source == LoadSource::kOwnCounts || e.load_polling || e.draining) continue;
    e.load_polling = true;
    // A leg launched shortly before this poll may still be on its way into the engine when it
    // answers: the report is taken to know only the legs launched before the previous poll.
    const LaunchedAtPoll launched = e.launched_at_last_poll;
    e.launched_at_last_poll = {e.counts.launched_total, e.counts.legs_launched};
    const Upstream::CallId call = get_whole_answer(
        upstream_, engine_get(e, api::load_target(e.load.last_step)), kMaxAnswerBytes,
        [this, id = id, launched](const EngineAnswer& a) {
          // Too large to be a report: said, as a body that is not one.
          LoadAnswer answer;
          if (a.too_large) {
            answer.kind = LoadAnswer::Kind::kNoReport;
            answer.why = a.error;
          } else {
            answer = read_load_answer(a.error, a.status, a.body);
          }
          exec_.post([this, id, launched, answer = std::move(answer)]() mutable {
            if (endpoints_.load_result(id, launched, std::move(answer), exec_.now())) changed_();
          });
        });
    bound(call);
  }
  exec_.at(exec_.now() + topo_.scheduling.load_interval, [this] { poll_loads(); });
}

}  // namespace tandem::gateway
