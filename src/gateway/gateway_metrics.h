#pragma once
// The gateway's Prometheus metrics (vLLM's names where vLLM has one; docs/gateway.md lists them),
// registered once in the gateway's registry and shared by the parts that write them.
#include "util/metrics.h"

namespace tandem::gateway {

struct GatewayMetrics {
  // `model_name`: the served model's name (the topology's served_model_name), the model_name
  // label of the vllm:* series as the engines label theirs; empty: no such label (the gateway
  // does not know it before the engines answer).
  explicit GatewayMetrics(metrics::Registry& r, const std::string& model_name = {});

  metrics::Family<metrics::Histogram>& phase_seconds;
  // tpot: each stream's mean time per output token (vllm:request_time_per_output_token_seconds);
  // tpot_gaps: every gap between its token events (vllm:time_per_output_token_seconds, observed
  // per gap as vLLM observes it; the same gaps as itl. The engine's own splits a step's gap over
  // the tokens an MTP step yields).
  metrics::Histogram &ttft, &tpot, &tpot_gaps, &itl, &e2e, &queue_time;
  metrics::Family<metrics::Histogram>& class_ttft;  // {class}: with priority classes
  metrics::Gauge &running, &waiting;
  metrics::Family<metrics::IntCounter>& requests;
  metrics::IntCounter& retries;
  metrics::Family<metrics::Gauge>& endpoint_in_flight;
  metrics::Family<metrics::Gauge>& endpoint_healthy;
  metrics::Family<metrics::Gauge>& endpoint_draining;
  metrics::Family<metrics::IntCounter>& endpoint_ejections;
  metrics::Family<metrics::IntCounter>& endpoint_readmissions;
  metrics::Family<metrics::IntCounter>& endpoint_requests;
  metrics::Family<metrics::IntCounter>& endpoint_failures;
  metrics::Family<metrics::IntCounter>& endpoint_overloaded;
  // Routing quality (routing_quality.h) of the requests it was measured for.
  metrics::Family<metrics::IntCounter>& prefix_reuse_tokens;  // {split}
  metrics::IntCounter &prefix_reuse_available, &prefix_reuse_chosen, &prefix_reuse_delivered;
  metrics::IntCounter& prefix_reuse_prompt_tokens;
  metrics::IntCounter& prefix_reuse_requests;
  metrics::IntCounter& access_log_dropped;  // lines the access log could not write (access_log.h)
  // {result}: the gateway's releases of prefill KV no decode engine took (Dispatcher).
  metrics::Family<metrics::IntCounter>& kv_releases;
};

}  // namespace tandem::gateway
