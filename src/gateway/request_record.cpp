#include "gateway/request_record.h"

#include <nlohmann/json.hpp>

#include "gateway/access_log.h"

namespace tandem::gateway {

using nlohmann::json;

json access_log_line(const Request& r, PdMode mode, int64_t completed_ns) {
  const int64_t received = *r.times.at(Phase::kReceived);
  json line = {{"time_unix_ms", r.received_unix_ms},
               {"request_id", r.id},
               {"method", r.method},
               {"path", r.path},
               {"status", r.outcome.status},
               {"mode", mode_name(mode)},
               {"stream", r.stream},
               {"attempts", r.attempt + 1},
               {"prompt_tokens", r.prompt_tokens},
               {"prompt_tokens_estimated", !r.tokens_known},
               {"phases", r.times.offsets()},
               {"e2e_seconds", static_cast<double>(completed_ns - received) * 1e-9}};
  if (!r.model.empty()) line["model"] = r.model;
  if (!r.prefill_name.empty()) line["prefill"] = r.prefill_name;
  if (!r.decode_name.empty()) line["decode"] = r.decode_name;
  if (!r.retried_after.empty()) line["retried_after"] = r.retried_after;
  if (r.output_events > 0) {
    line["output_events"] = r.output_events;
    line["ttft_seconds"] = static_cast<double>(r.first_token_ns - received) * 1e-9;
  }
  if (r.completion_tokens >= 0) line["completion_tokens"] = r.completion_tokens;
  if (!r.outcome.error.empty()) line["error"] = r.outcome.error;
  return line;
}

RequestRecorder::RequestRecorder(GatewayMetrics& metrics, AccessLog* log, PdMode mode)
    : metrics_(metrics), log_(log), mode_(mode) {
  for (int p = 0; p < kPhaseCount; ++p)
    phase_histograms_[p] = &metrics_.phase_seconds.labels({phase_name(static_cast<Phase>(p))});
}

void RequestRecorder::record(Request& r, int64_t now_ns) {
  // The relay is done with the request once it ended; the lock orders its last writes before
  // these reads.
  std::lock_guard lock(r.mutex);
  const int status = r.outcome.status;
  auto counter = status_counters_.find(status);
  if (counter == status_counters_.end())
    counter =
        status_counters_.emplace(status, &metrics_.requests.labels({std::to_string(status)})).first;
  counter->second->inc();
  const int64_t received = *r.times.at(Phase::kReceived);
  const std::optional<int64_t> stamped = r.times.at(Phase::kCompleted);
  const int64_t completed = stamped ? *stamped : now_ns;
  for (int p = 0; p < kPhaseCount; ++p)
    if (auto s = r.times.seconds_in(static_cast<Phase>(p))) phase_histograms_[p]->observe(*s);
  if (status == 200) {
    metrics_.e2e.observe(static_cast<double>(completed - received) * 1e-9);
    const int64_t events = r.output_events;
    if (events > 0) metrics_.ttft.observe(static_cast<double>(r.first_token_ns - received) * 1e-9);
    if (events > 1)
      metrics_.tpot.observe(static_cast<double>(r.last_token_ns - r.first_token_ns) * 1e-9 /
                            static_cast<double>(events - 1));
    // Events that arrived together have gaps of 0, often most of them: observed in one go.
    uint64_t together = 0;
    for (double g : r.itl) {
      if (g == 0.0)
        ++together;
      else
        metrics_.itl.observe(g);
    }
    metrics_.itl.observe(0.0, together);
  }
  r.itl = {};
  if (log_) log_->add(access_log_line(r, mode_, completed));
}

}  // namespace tandem::gateway
