#include "gateway/health.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>

#include "api/load_report.h"
#include "api/model_list.h"
#include "gateway/engine_get.h"

namespace tandem::gateway {
namespace {

// A /load answer is a few kilobytes, a model list less; anything far larger is not one.
constexpr size_t kMaxAnswerBytes = size_t{1} << 20;

}  // namespace

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
        if (a.error.empty() && a.status == 200)
          length = api::max_model_len_of(a.body).value_or(0);
        else if (a.error.empty() && a.status >= 400 && a.status < 500)
          length = 0;
        exec_.post([this, id, length] { endpoints_.length_result(id, length); });
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
          LoadAnswer answer = a.too_large ? LoadAnswer{LoadAnswer::Kind::kNoReport, {}, a.error}
                                          : read_load_answer(a.error, a.status, a.body);
          exec_.post([this, id, launched, answer = std::move(answer)]() mutable {
            if (endpoints_.load_result(id, launched, std::move(answer), exec_.now())) changed_();
          });
        });
    bound(call);
  }
  exec_.at(exec_.now() + topo_.scheduling.load_interval, [this] { poll_loads(); });
}

}  // namespace tandem::gateway
