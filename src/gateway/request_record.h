#pragma once
// What a finished request leaves behind: its metrics (status counts, phase durations, TTFT, TPOT,
// inter-token latency, end-to-end latency, routing quality) and its access log line
// (docs/gateway.md lists the fields), and what the dashboard shows of recent requests.
// Scheduling thread only.
#include <array>
#include <deque>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "gateway/gateway_metrics.h"
#include "gateway/lifecycle.h"
#include "gateway/request.h"
#include "gateway/routing_quality.h"
#include "gateway/topology.h"

namespace tandem::gateway {

class AccessLog;

// The access log line of a request that ended (`completed_ns`: its end on the steady clock).
nlohmann::json access_log_line(const Request& r, const Topology& topology, int64_t completed_ns);

// Makes `reply` the reply of `r`, the request `req` from a client: r.reply counts the response
// body bytes it is given (r.body_bytes_sent: a whole answer's, an error's, a stream's chunks),
// and r.client_address is the client's. Io thread, before `r` reaches the scheduler.
void set_client(Request& r, const net::HttpRequest& req, std::shared_ptr<ClientReply> reply);

class RequestRecorder {
 public:
  // `log` may be null (no access log).
  RequestRecorder(GatewayMetrics& metrics, AccessLog* log, const Topology& topology);
  // Records `r`, which ended; `now_ns` stands in for its end if it was never stamped.
  void record(Request& r, int64_t now_ns);

  // The dashboard's view: {"recent": the access log lines of the last kRecent requests that
  // ended while it was watched, oldest first; "totals": requests, by_status, prefix_reuse
  // (ReuseTotals), by_class (with priority classes)} and, per engine that computed prompts, what
  // it reported reusing: {name: {requests, prompt_tokens, delivered}}.
  static constexpr size_t kRecent = 200;
  nlohmann::json dashboard_json() const;
  // Someone looks at the dashboard at `now_ns`: requests ending within kWatch of it are kept for
  // "recent" (building their lines costs the scheduling thread; nobody watching, nothing is built
  // unless the access log is on).
  static constexpr int64_t kWatch = int64_t{60} * 1'000'000'000;
  void watch(int64_t now_ns) { watched_until_ns_ = now_ns + kWatch; }
  nlohmann::json engine_reuse_json(const std::string& name) const;  // null when none

 private:
  struct EngineReuse {
    int64_t requests = 0, prompt_tokens = 0, delivered = 0;
  };

  GatewayMetrics& metrics_;
  AccessLog* log_;
  const Topology& topo_;
  std::deque<nlohmann::json> recent_;
  int64_t watched_until_ns_ = 0;
  int64_t requests_ = 0;
  std::map<int, int64_t> by_status_;
  std::vector<int64_t> by_class_;  // requests per priority class
  std::vector<metrics::Histogram*> class_ttft_;
  ReuseTotals reuse_;
  std::map<std::string, EngineReuse> engine_reuse_;
  std::array<metrics::Histogram*, kPhaseCount> phase_histograms_{};
  std::unordered_map<int, metrics::IntCounter*> status_counters_;
};

}  // namespace tandem::gateway
