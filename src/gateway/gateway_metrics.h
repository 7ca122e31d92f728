#pragma once
// The gateway's Prometheus metrics (vLLM's names where vLLM has one; docs/gateway.md lists them),
// registered once in the gateway's registry and shared by the parts that write them.
#include "util/metrics.h"

namespace tandem::gateway {

struct GatewayMetrics {
  explicit GatewayMetrics(metrics::Registry& r);

  metrics::Family<metrics::Histogram>& phase_seconds;
  metrics::Histogram &ttft, &tpot, &itl, &e2e, &queue_time;
  metrics::Gauge &running, &waiting;
  metrics::Family<metrics::IntCounter>& requests;
  metrics::IntCounter& retries;
  metrics::Family<metrics::Gauge>& endpoint_in_flight;
  metrics::Family<metrics::Gauge>& endpoint_healthy;
  metrics::Family<metrics::IntCounter>& endpoint_requests;
  metrics::Family<metrics::IntCounter>& endpoint_failures;
  metrics::Family<metrics::IntCounter>& endpoint_overloaded;
};

}  // namespace tandem::gateway
