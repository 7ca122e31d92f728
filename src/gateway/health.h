#pragma once
// The gateway's view of its engines over time, on the scheduling thread: a GET /health probe of
// every engine each health.probe_interval, and of an engine as it joins once the checks run
// (ejected engines are readmitted when one passes; a new one takes requests once its first check
// ended, EndpointState::unchecked), a GET /v1/models of an engine whose longest sequence is to be
// asked (LengthQuery) when it passes one, and a GET /load poll each scheduling.load_interval of
// the engines that report their load or may (dialect auto). Calls go through the Upstream seam,
// timers through the Executor: tests drive both without sockets or clocks.
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include "gateway/endpoints.h"
#include "gateway/seams.h"
#include "gateway/topology.h"

namespace tandem::gateway {

// What an engine's GET /v1/models answer says of the gateway's model. The body is the engine's to
// choose (deeply nested, or as large as the call allows): it is read on the io thread that
// received it, with the bounded reader, and only this summary goes to the scheduling thread.
struct ModelListSummary {
  // Why the answer is no model list (the reader's error, or what it lacks); empty when it is one.
  // Nothing is learned from such an answer: the engine is kept, as an engine that does not say.
  std::string unreadable;
  bool lists_model = false;  // an entry's id is the model
  std::string listed;        // up to four of its ids, quoted and clipped, for the messages
  bool more = false;         // it lists more than those
  // An entry says owned_by "tandem" or "vllm": servers that refuse a model they do not list.
  bool owned_by_refusing_server = false;
  int64_t max_model_len = 0;  // the least its entries say (max_model_len_of_data); 0: none
};
// Reads `body`, a 200 answer to GET /v1/models, for `model` (the served_model_name; empty: the
// gateway names none, and only the longest sequence is read).
ModelListSummary read_model_list(std::string_view body, const std::string& model);

// Lines said once however many gateway replicas (--gateways N) check the same engine: such a
// line says a fact of the engine, not of a replica. Keyed by what is said (the engine's name,
// address and what its answer showed), so that an engine that comes back answering otherwise is
// said again. Thread-safe.
class SaidOnce {
 public:
  // True the first time `key` is asked.
  bool first(const std::string& key);
  // The process's: the gateway's replicas share it.
  static SaidOnce& process();

 private:
  std::mutex mutex_;
  std::set<std::string> said_;
};

class HealthMonitor {
 public:
  // `changed` runs (on the scheduling thread) when an engine was readmitted or reported a fresh
  // load (waiting requests may start now), or was ejected (those it leaves without an engine are
  // answered now, not at their queue timeout).
  // `said` keeps the lines said once (a test gives its own).
  HealthMonitor(const Topology& topology, Executor& executor, Upstream& upstream,
                EndpointTable& endpoints, std::function<void()> changed,
                SaidOnce& said = SaidOnce::process());

  // Scheduling thread: probes every engine now, then at every interval; polls loads likewise
  // (when scheduling.load_interval > 0).
  void start();

 private:
  void probe_all();
  void probe(int id);  // unless its probe runs already, or it drains
  void poll_loads();
  void ask_length(int id);
  std::string not_serving(const EndpointState& e, const std::optional<ModelListSummary>& list);
  net::AsyncHttpRequest engine_get(const EndpointState& e, std::string target) const;
  // Cancels `call` at the probe timeout if it has not ended: the HTTP client bounds each piece
  // only, and a body trickled a byte at a time would keep the call (and the engine's probing or
  // load_polling) open forever. `cut`, if given, is set when it cancels the call.
  void bound(Upstream::CallId call, std::shared_ptr<bool> cut = nullptr);

  const Topology& topo_;
  Executor& exec_;
  Upstream& upstream_;
  EndpointTable& endpoints_;
  std::function<void()> changed_;
  SaidOnce& said_;
};

}  // namespace tandem::gateway
