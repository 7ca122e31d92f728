#include "gateway/gateway_metrics.h"

#include <cmath>
#include <vector>

namespace tandem::gateway {
namespace {

metrics::LabelPairs model_label(const std::string& model_name) {
  if (model_name.empty()) return {};
  return {{"model_name", model_name}};
}

// The phases last from microseconds (a scheduling decision, a queue that was empty) to minutes
// (a long decode): 1-2.5-5 steps from 10 us to 100 s. vLLM's end-to-end buckets, used before,
// start at 0.3 s and put every short phase in their first bucket.
std::vector<double> phase_buckets() {
  std::vector<double> b;
  for (int exponent = -5; exponent <= 1; ++exponent)
    for (double step : {1.0, 2.5, 5.0}) b.push_back(step * std::pow(10.0, exponent));
  b.push_back(100);
  return b;
}

}  // namespace

GatewayMetrics::GatewayMetrics(metrics::Registry& r, const std::string& model_name)
    : phase_seconds(r.histogram_family("tandem:gateway_phase_seconds",
                                       "Seconds requests spent in each lifecycle phase.", {"phase"},
                                       phase_buckets())),
      ttft(r.histogram("vllm:time_to_first_token_seconds",
                       "Time to first token (streaming requests), seen at the gateway.",
                       metrics::vllm_ttft_buckets(), model_label(model_name))),
      tpot(r.histogram("vllm:request_time_per_output_token_seconds",
                       "Each stream's mean time per output token after the first: (last token "
                       "event - first) / (events - 1), seen at the gateway.",
                       metrics::vllm_tpot_buckets(), model_label(model_name))),
      tpot_gaps(r.histogram("vllm:time_per_output_token_seconds",
                            "Time per output token: every gap between two streamed token events, "
                            "seen at the gateway.",
                            metrics::vllm_tpot_buckets(), model_label(model_name))),
      itl(r.histogram("vllm:inter_token_latency_seconds",
                      "Gaps between streamed token events, seen at the gateway.",
                      metrics::vllm_tpot_buckets(), model_label(model_name))),
      e2e(r.histogram("vllm:e2e_request_latency_seconds",
                      "End-to-end request latency at the gateway.",
                      metrics::vllm_request_latency_buckets(), model_label(model_name))),
      queue_time(r.histogram("vllm:request_queue_time_seconds",
                             "Seconds requests waited in the gateway for a free engine.",
                             metrics::vllm_request_latency_buckets(), model_label(model_name))),
      class_ttft(r.histogram_family("tandem:gateway_class_time_to_first_token_seconds",
                                    "Time to first token per priority class (streaming "
                                    "requests), seen at the gateway.",
                                    {"class"}, metrics::vllm_ttft_buckets())),
      running(r.gauge("vllm:num_requests_running", "Requests being served by engines.",
                      model_label(model_name))),
      waiting(r.gauge("vllm:num_requests_waiting", "Requests waiting in the gateway queue.",
                      model_label(model_name))),
      requests(r.int_counter_family("tandem:gateway_requests_total",
                                    "Requests answered, by HTTP status.", {"status"})),
      retries(r.int_counter("tandem:gateway_retries_total",
                            "Attempts started again on other engines after a failure.")),
      endpoint_in_flight(r.gauge_family("tandem:gateway_endpoint_in_flight",
                                        "Requests in flight per engine.", {"pool", "endpoint"})),
      endpoint_healthy(r.gauge_family(
          "tandem:gateway_endpoint_healthy",
          "1 while an engine passes its health checks, 0 while ejected (a draining engine keeps "
          "its health: see tandem:gateway_endpoint_draining).",
          {"pool", "endpoint"})),
      endpoint_draining(r.gauge_family(
          "tandem:gateway_endpoint_draining",
          "1 while an engine removed (admin API or reload) finishes its requests, else 0.",
          {"pool", "endpoint"})),
      endpoint_ejections(r.int_counter_family(
          "tandem:gateway_endpoint_ejections_total",
          "Times an engine was ejected: after health.failures_to_eject failed legs or probes in a "
          "row, or for a model list without the served model.",
          {"pool", "endpoint"})),
      endpoint_readmissions(r.int_counter_family(
          "tandem:gateway_endpoint_readmissions_total",
          "Times an ejected engine came back into routing: a passing health probe, or a model list "
          "that names the served model again.",
          {"pool", "endpoint"})),
      endpoint_requests(r.int_counter_family("tandem:gateway_endpoint_requests_total",
                                             "Legs sent per engine.", {"pool", "endpoint"})),
      endpoint_failures(r.int_counter_family("tandem:gateway_endpoint_failures_total",
                                             "Failed legs per engine, and failed health probes "
                                             "of an engine in routing (not those of one ejected).",
                                             {"pool", "endpoint"})),
      endpoint_overloaded(r.int_counter_family(
          "tandem:gateway_endpoint_overloaded_total",
          "Legs an engine answered 429/503, or that timed out while it answered its health "
          "probes: overload, not counted toward ejection.",
          {"pool", "endpoint"})),
      prefix_reuse_tokens(r.int_counter_family(
          "tandem:gateway_prefix_reuse_tokens_total",
          "Prompt tokens of measured requests cached on some engine of the computing pool "
          "(split=available), on the engine chosen (chosen), and reused as that engine reported "
          "(delivered).",
          {"split"})),
      prefix_reuse_available(prefix_reuse_tokens.labels({"available"})),
      prefix_reuse_chosen(prefix_reuse_tokens.labels({"chosen"})),
      prefix_reuse_delivered(prefix_reuse_tokens.labels({"delivered"})),
      prefix_reuse_prompt_tokens(
          r.int_counter("tandem:gateway_prefix_reuse_prompt_tokens_total",
                        "Prompt tokens of the requests the prefix reuse split was measured for.")),
      prefix_reuse_requests(
          r.int_counter("tandem:gateway_prefix_reuse_requests_total",
                        "Requests the prefix reuse split was measured for (tokenized, answered "
                        "200, and the computing engine reported its cached_tokens).")),
      access_log_dropped(r.int_counter(
          "tandem:gateway_access_log_dropped_lines_total",
          "Access log lines not written: dropped while the lines waiting were at their cap, lost "
          "to a failed write, or left when shutdown's deadline passed.")),
      kv_releases(r.int_counter_family(
          "tandem:gateway_kv_releases_total",
          "Sequential P/D requests that ended before a decode engine took their prompt's KV, "
          "whose prefill engine the gateway told to let go of it, by result: released, "
          "not_held (pulled, expired or released already), failed (no answer within "
          "timeouts.connect_ms included), or dropped (4096 already "
          "waiting their turn behind the 64 sent at once). One under way when the gateway stops "
          "is cut and counts as failed; those still waiting their turn then are neither sent "
          "nor counted.",
          {"result"})) {}

}  // namespace tandem::gateway
