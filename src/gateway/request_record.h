#pragma once
// What a finished request leaves behind: its metrics (status counts, phase durations, TTFT, TPOT,
// inter-token latency, end-to-end latency) and its access log line (docs/gateway.md lists the
// fields). Scheduling thread only.
#include <array>
#include <unordered_map>

#include <nlohmann/json_fwd.hpp>

#include "gateway/gateway_metrics.h"
#include "gateway/lifecycle.h"
#include "gateway/request.h"
#include "gateway/topology.h"

namespace tandem::gateway {

class AccessLog;

// The access log line of a request that ended (`completed_ns`: its end on the steady clock).
nlohmann::json access_log_line(const Request& r, PdMode mode, int64_t completed_ns);

class RequestRecorder {
 public:
  // `log` may be null (no access log).
  RequestRecorder(GatewayMetrics& metrics, AccessLog* log, PdMode mode);
  // Records `r`, which ended; `now_ns` stands in for its end if it was never stamped.
  void record(Request& r, int64_t now_ns);

 private:
  GatewayMetrics& metrics_;
  AccessLog* log_;
  PdMode mode_;
  std::array<metrics::Histogram*, kPhaseCount> phase_histograms_{};
  std::unordered_map<int, metrics::IntCounter*> status_counters_;
};

}  // namespace tandem::gateway
