#include "gateway/health.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "api/load_report.h"
#include "api/model_list.h"
#include "gateway/engine_get.h"
#include "util/error.h"
#include "util/json.h"
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
bool refuses_unknown_names(Dialect dialect, const ModelListSummary& list) {
  if (dialect == Dialect::kTandem || dialect == Dialect::kVllm) return true;
  return dialect == Dialect::kAuto && list.owned_by_refusing_server;
}

// The string value of `object`'s field `key`, or null.
const std::string* string_field(const nlohmann::json& object, const char* key) {
  const auto it = object.find(key);
  return it != object.end() && it->is_string() ? &it->get_ref<const std::string&>() : nullptr;
}

}  // namespace

bool SaidOnce::first(const std::string& key) {
  std::lock_guard lock(mutex_);
  return said_.insert(key).second;
}

SaidOnce& SaidOnce::process() {
  static SaidOnce said;
  return said;
}

ModelListSummary read_model_list(std::string_view body, const std::string& model) {
  ModelListSummary list;
  nlohmann::json doc;
  try {
    doc = parse_untrusted_json(body);
  } catch (const Error& e) {
    list.unreadable = std::string("it is no JSON the gateway reads: ") + e.what();
    return list;
  }
  const ReleaseJsonOnExit release{doc};
  const auto data = doc.is_object() ? doc.find("data") : doc.end();
  if (!doc.is_object() || data == doc.end() || !data->is_array()) {
    list.unreadable = "it has no \"data\" list";
    return list;
  }
  int shown = 0;
  for (const auto& m : *data) {
    if (!m.is_object()) continue;
    if (const std::string* owner = string_field(m, "owned_by"))
      list.owned_by_refusing_server |= *owner == "tandem" || *owner == "vllm";
    const std::string* id = string_field(m, "id");
    if (!id) continue;
    if (*id == model) list.lists_model = true;
    if (shown++ < 4) list.listed += (list.listed.empty() ? "'" : ", '") + utf8::clip(*id) + "'";
  }
  list.more = shown > 4;
  list.max_model_len = api::max_model_len_of_data(*data).value_or(0);
  return list;
}

// Why an engine whose GET /v1/models answered `list` serves none of the gateway's
// served_model_name (the name clients send and the gateway passes on): empty when it lists it,
// when the gateway names no model or the call told nothing (nullopt), or when the answer is no
// model list (nothing learned: said once). An engine that serves any name is kept: said once, as
// an alias it will serve.
std::string HealthMonitor::not_serving(const EndpointState& e,
                                       const std::optional<ModelListSummary>& list) {
  const std::string& model = topo_.served_model_name;
  if (model.empty() || !list || list->lists_model) return {};
  const std::string engine = e.config.name + " (" + address_key(e.config) + ")";
  if (!list->unreadable.empty()) {
    if (said_.first("unreadable " + engine + ": " + list->unreadable))
      std::fprintf(stderr,
                   "tandem gateway: engine %s: its GET /v1/models answer is no model list (%s); "
                   "kept, its model not checked\n",
                   engine.c_str(), list->unreadable.c_str());
    return {};
  }
  const std::string lists = "its GET /v1/models lists " +
                            (list->listed.empty() ? std::string("no model") : list->listed) +
                            (list->more ? " and more" : "") +
                            ", not the gateway's served_model_name '" + model + "'";
  if (refuses_unknown_names(e.dialect, *list))
    return lists + " (each request would be refused as for an unknown model)";
  if (said_.first("kept " + engine + ": " + lists))
    std::fprintf(stderr,
                 "tandem gateway: engine %s: %s; kept: it is no Tandem or vLLM engine (dialect "
                 "%s, no owned_by \"tandem\" or \"vllm\"), and such servers (SGLang, TGI, "
                 "llama.cpp) answer a request naming any model\n",
                 engine.c_str(), lists.c_str(), dialect_name(e.dialect));
  return {};
}

HealthMonitor::HealthMonitor(const Topology& topology, Executor& executor, Upstream& upstream,
                             EndpointTable& endpoints, std::function<void()> changed,
                             SaidOnce& said)
    : topo_(topology),
      exec_(executor),
      upstream_(upstream),
      endpoints_(endpoints),
      changed_(std::move(changed)),
      said_(said) {}

void HealthMonitor::start() {
  // An engine that joins from now on is probed at once, not at the next interval: it takes no
  // requests until that probe (and its model list) ended.
  endpoints_.check_joining_engines([this](int id) { exec_.post([this, id] { probe(id); }); });
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

void HealthMonitor::bound(Upstream::CallId call, std::shared_ptr<bool> cut) {
  // An ended call's id is ignored by cancel(): no need to disarm this when the call ends.
  exec_.at(exec_.now() + topo_.health.probe_timeout, [this, call, cut = std::move(cut)] {
    if (cut) *cut = true;
    upstream_.cancel(call);
  });
}

void HealthMonitor::probe_all() {
  for (const auto& [id, e] : endpoints_.all()) probe(id);
  exec_.at(exec_.now() + topo_.health.probe_interval, [this] { probe_all(); });
}

void HealthMonitor::probe(int id) {
  EndpointState* e = endpoints_.find(id);
  if (!e || e->probing || e->draining) return;
  e->probing = true;
  auto status = std::make_shared<int>(0);
  auto cut = std::make_shared<bool>(false);
  net::AsyncHttpHandlers h;
  h.on_head = [status](int s, const net::Headers&) { *status = s; };
  h.on_done = [this, status, cut, id](const std::string& error) {
    const bool ok = error.empty() && *status == 200;
    // How it failed, for the line of an engine not admitted.
    std::string why;
    if (!ok) why = !error.empty() ? error : "it answered HTTP " + std::to_string(*status);
    // `cut` is read on the scheduling thread, which sets it before the cancel.
    exec_.post([this, id, ok, cut, why = std::move(why)]() mutable {
      if (!ok && *cut)
        why = "no answer within health.probe_timeout_ms, " +
              std::to_string(topo_.health.probe_timeout.count()) + " ms";
      if (endpoints_.probe_result(id, ok, exec_.now(), why)) changed_();
      if (ok) ask_length(id);
    });
  };
  bound(upstream_.start(engine_get(*e, "/health"), std::move(h)), cut);
}

// GET /v1/models of an engine that passed a probe, if its longest sequence is to be asked.
void HealthMonitor::ask_length(int id) {
  EndpointState* e = endpoints_.find(id);
  if (!e || e->length_query != LengthQuery::kToAsk) return;
  e->length_query = LengthQuery::kAsking;
  const Upstream::CallId call = get_whole_answer(
      upstream_, engine_get(*e, "/v1/models"), kMaxAnswerBytes,
      [this, id, model = topo_.served_model_name](const EngineAnswer& a) {
        // A 4xx (whatever its size) or a body without the field is an answer (a server that
        // does not say), and so is a 200 too large to be a model list (nothing learned from
        // it); a transport error or a 5xx is none, and the next probe asks again.
        std::optional<int64_t> length;
        std::optional<ModelListSummary> list;  // a 200's, read here for the model
        const bool answered = a.error.empty() || a.too_large;
        if (a.too_large && a.status == 200) {
          length = 0;
          list.emplace().unreadable = a.error;
        } else if (answered && a.status == 200) {
          list = read_model_list(a.body, model);
          length = list->max_model_len;
        } else if (answered && a.status >= 400 && a.status < 500) {
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
