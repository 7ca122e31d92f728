#pragma once
// Result metrics of `tandem bench`, defined exactly as vLLM's `vllm bench serve`
// (vllm/benchmarks/serve.py, calculate_metrics) so that the numbers compare one to one, plus
// Mooncake's TBT. Statistics follow numpy: mean, median, population std (np.std) and
// np.percentile's default linear interpolation; an empty list reports 0 for all of them, as
// vLLM's `np.mean(values or 0)` does.
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace tandem::bench {

// One request as the driver measured it, all times in seconds from a monotonic clock.
struct RequestResult {
  bool success = false;
  std::string error;
  double start_s = 0;         // when the request was sent (any common origin)
  double ttft_s = 0;          // send -> first streamed token
  double latency_s = 0;       // send -> last token (E2EL)
  std::vector<double> itl_s;  // gaps between successive streamed chunks after the first
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;  // tokens generated (from the server's usage when it reports it)
};

struct MetricStats {
  double mean_ms = 0;
  double median_ms = 0;
  double std_ms = 0;
  std::vector<std::pair<double, double>> percentiles_ms;  // (p, value) in the order asked
};

struct MetricsOptions {
  // Percentiles to report (vLLM --metric-percentiles, default "99"), each in [0, 100].
  std::vector<double> percentiles = {99};
  // Metrics to report (vLLM --percentile-metrics, default "ttft,tpot,itl"); any of ttft, tpot,
  // itl, e2el and tbt (Mooncake's TBT, not in vLLM). All are computed; this selects the output.
  std::vector<std::string> percentile_metrics = {"ttft", "tpot", "itl"};
  // Goodput SLOs in ms (vLLM --goodput ttft:<ms> tpot:<ms> e2el:<ms>; tbt is ours). A completed
  // request is good when it meets every SLO given (value <= SLO). Without any SLO there is no
  // goodput (request_goodput is null in JSON).
  std::optional<double> goodput_ttft_ms;
  std::optional<double> goodput_tpot_ms;
  std::optional<double> goodput_e2el_ms;
  std::optional<double> goodput_tbt_ms;
};

struct BenchSummary {
  double duration_s = 0;
  int64_t completed = 0;
  int64_t failed = 0;
  int64_t total_input_tokens = 0;         // over completed requests
  int64_t total_output_tokens = 0;        // over completed requests
  double request_throughput = 0;          // completed / duration
  std::optional<double> request_goodput;  // good / duration, when an SLO is given
  double output_throughput = 0;           // total_output_tokens / duration
  double total_token_throughput = 0;      // (input + output) / duration
  double max_output_tokens_per_s = 0;     // busiest 1 s bucket of output tokens (timeline())
  int64_t max_concurrent_requests = 0;    // most requests in flight, over [start, start+latency)
  MetricStats ttft;                       // per completed request
  MetricStats tpot;  // (latency - ttft) / (output_tokens - 1), requests with output_tokens > 1
  MetricStats itl;   // every gap of every completed request, pooled (token-weighted)
  MetricStats e2el;  // per completed request
  MetricStats tbt;   // mooncake_tbt() per completed request with at least one gap
  MetricsOptions options;  // what was asked (selects the JSON keys and table rows)
};

// Mooncake's time between tokens of one request: the mean of its slowest 10 % of gaps
// (max(1, ceil(n / 10)) of the n gaps); 0 without gaps.
double mooncake_tbt(std::span<const double> itl_s);

// np.percentile(values, p) with the default linear method; values need not be sorted.
double percentile(std::vector<double> values, double p);

// The run over time, with summarize()'s rules: completed requests only; output tokens (chunks at
// start + ttft, then one after each gap, the request's output tokens spread evenly over its
// chunks, as a chunk may carry several with speculative decoding) in 1 s buckets counted from the
// earliest send (times truncated toward zero, as Python's int()); and the changes of requests in
// flight, +1 at a send and -1 at start + latency, sorted with ends before starts at equal times.
// Empty (no buckets, no changes) when nothing completed.
struct Timeline {
  double origin = 0;    // earliest send
  double end = 0;       // latest start + latency
  int64_t seconds = 0;  // the 1 s buckets from origin through end: ceil(end - origin) + 1
  // (bucket, output tokens) of the buckets that have any, in bucket order. Only those: a trace's
  // arrivals may lie up to 10^9 s apart, and a value for every second of that took gigabytes.
  std::vector<std::pair<int64_t, int64_t>> busy_seconds;
  std::vector<std::pair<double, int>> in_flight_changes;
};
Timeline timeline(std::span<const RequestResult> results);

// vLLM's calculate_metrics. duration_s is the wall time of the run (its start to the last answer).
// Throws tandem::Error for duration_s <= 0, a percentile outside [0, 100] or an unknown metric.
BenchSummary summarize(std::span<const RequestResult> results, double duration_s,
                       const MetricsOptions& options = {});

// vLLM's result JSON: "duration", "completed", "failed", "total_input_tokens",
// "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
// "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests" and, for each
// selected metric m, "mean_<m>_ms", "median_<m>_ms", "std_<m>_ms", "p<P>_<m>_ms" (P as Python
// prints it: 99, 99.9). With `results`, vLLM's per-request lists as well: "input_lens",
// "output_lens" (0 for a failed request), "ttfts", "itls", "latencies" (TTFT and latency 0.0 for a
// failed request, as vLLM writes them), "start_times", "errors".
nlohmann::json to_json(const BenchSummary& summary, std::span<const RequestResult> results = {});

// What the run was configured with, for the table's optional rows.
struct TableContext {
  double request_rate = std::numeric_limits<double>::infinity();  // row shown when finite
  std::optional<int64_t> max_concurrency;                         // row shown when given
};

// vLLM's terminal summary ("============ Serving Benchmark Result ============" ...), same rows,
// labels and number formats; a "Time between Tokens (Mooncake)" section when tbt is selected.
std::string summary_table(const BenchSummary& summary, const TableContext& context = {});

}  // namespace tandem::bench
