#include "bench/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "util/error.h"

namespace tandem::bench {
namespace {

using nlohmann::json;

const char* const kMetricNames[] = {"ttft", "tpot", "itl", "e2el", "tbt"};

bool selected(const MetricsOptions& o, const std::string& name) {
  return std::find(o.percentile_metrics.begin(), o.percentile_metrics.end(), name) !=
         o.percentile_metrics.end();
}

// numpy's linear interpolation between neighbours (np.lib.function_base._lerp), which takes
// the formula from the nearer end so the result is exact at both ends.
double lerp(double a, double b, double t) {
  const double diff = b - a;
  return t >= 0.5 ? b - diff * (1.0 - t) : a + diff * t;
}

double percentile_sorted(const std::vector<double>& v, double p) {
  if (v.size() == 1) return v[0];
  const double index = (static_cast<double>(v.size()) - 1.0) * (p / 100.0);
  const auto lo = static_cast<size_t>(std::floor(index));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return lerp(v[lo], v[hi], index - static_cast<double>(lo));
}

// Statistics of `values` (seconds) in ms. vLLM computes np.mean(values or 0) etc., so an empty
// list counts as the single value 0.
MetricStats stats_ms(std::vector<double> values, const std::vector<double>& percentiles) {
  if (values.empty()) values.push_back(0.0);
  MetricStats s;
  double sum = 0;
  for (double x : values) sum += x;
  const double n = static_cast<double>(values.size());
  const double mean = sum / n;
  double sq = 0;
  for (double x : values) sq += (x - mean) * (x - mean);
  std::sort(values.begin(), values.end());
  const size_t m = values.size();
  const double median = m % 2 ? values[m / 2] : (values[m / 2 - 1] + values[m / 2]) / 2.0;
  s.mean_ms = mean * 1000;
  s.std_ms = std::sqrt(sq / n) * 1000;
  s.median_ms = median * 1000;
  for (double p : percentiles)
    s.percentiles_ms.emplace_back(p, percentile_sorted(values, p) * 1000);
  return s;
}

// Python's repr of a float that is not whole: the shortest digits that read back, written out
// when the decimal exponent is in [-4, 16) and in scientific notation otherwise, with at least
// two exponent digits ("0.0001", "1.5e-05"). to_chars's shortest form switches at other
// exponents ("1e-04"), so the notation is chosen here from the exponent of the shortest digits.
std::string python_float_repr(double v) {
  char buf[64];
  const auto sci = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  const std::string scientific(buf, sci.ptr);  // "1.5e-05": the exponent has two digits or more
  const int exponent = std::stoi(scientific.substr(scientific.find('e') + 1));
  if (exponent < -4 || exponent >= 16) return scientific;
  const auto fixed = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed);
  return std::string(buf, fixed.ptr);
}

// `prefix` and the percentile as vLLM writes it (str(int(p)) when whole, else Python's str(p)):
// "p99", "p99.9", "p0.0001", "p1e-05".
std::string percentile_word(double p, const char* prefix) {
  std::string word = prefix;
  if (p == std::floor(p)) {
    word += std::to_string(static_cast<int64_t>(p));
  } else {
    word += python_float_repr(p);
  }
  return word;
}

const MetricStats& stats_of(const BenchSummary& s, const std::string& name) {
  if (name == "ttft") return s.ttft;
  if (name == "tpot") return s.tpot;
  if (name == "itl") return s.itl;
  if (name == "e2el") return s.e2el;
  return s.tbt;
}

// Python's "{:<40} {:<10.2f}" and "{:<40} {:<10}".
std::string row(const std::string& label, double value) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "%-40s %-10.2f\n", label.c_str(), value);
  return buf;
}
std::string row(const std::string& label, int64_t value) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "%-40s %-10lld\n", label.c_str(), static_cast<long long>(value));
  return buf;
}

// Python's "{s:{c}^{n}}": centred, the odd padding character on the right.
std::string banner(const std::string& title, char fill, size_t width = 50) {
  const size_t pad = title.size() >= width ? 0 : width - title.size();
  return std::string(pad / 2, fill) + title + std::string(pad - pad / 2, fill) + "\n";
}

}  // namespace

double mooncake_tbt(std::span<const double> itl_s) {
  if (itl_s.empty()) return 0.0;
  std::vector<double> gaps(itl_s.begin(), itl_s.end());
  const size_t k = std::max<size_t>(1, (gaps.size() + 9) / 10);
  std::partial_sort(gaps.begin(), gaps.begin() + k, gaps.end(), std::greater<double>());
  double sum = 0;
  for (size_t i = 0; i < k; ++i) sum += gaps[i];
  return sum / static_cast<double>(k);
}

double percentile(std::vector<double> values, double p) {
  if (!(p >= 0 && p <= 100))
    throw Error("percentile must be in [0, 100], got " + std::to_string(p));
  if (values.empty()) throw Error("percentile of an empty list");
  std::sort(values.begin(), values.end());
  return percentile_sorted(values, p);
}

BenchSummary summarize(std::span<const RequestResult> results, double duration_s,
                       const MetricsOptions& options) {
  if (!(duration_s > 0)) {
    throw Error("bench metrics: duration must be > 0 s, got " + std::to_string(duration_s));
  }
  for (double p : options.percentiles) {
    if (!(p >= 0 && p <= 100)) {
      throw Error("bench metrics: percentile " + std::to_string(p) + " is outside [0, 100]");
    }
  }
  for (const std::string& m : options.percentile_metrics) {
    if (std::find(std::begin(kMetricNames), std::end(kMetricNames), m) == std::end(kMetricNames)) {
      throw Error("bench metrics: unknown metric \"" + m +
                  "\" (expected one of ttft, tpot, itl, e2el, tbt)");
    }
  }

  BenchSummary s;
  s.options = options;
  s.duration_s = duration_s;
  std::vector<double> ttfts, tpots, itls, e2els, tbts;
  int64_t good = 0;
  const bool any_slo = options.goodput_ttft_ms || options.goodput_tpot_ms ||
                       options.goodput_e2el_ms || options.goodput_tbt_ms;
  for (const RequestResult& r : results) {
    if (!r.success) {
      ++s.failed;
      continue;
    }
    ++s.completed;
    s.total_input_tokens += r.prompt_tokens;
    s.total_output_tokens += r.output_tokens;
    // vLLM: TPOT only for requests with more than one output token; for goodput such a
    // request counts with TPOT 0.
    double tpot = 0;
    if (r.output_tokens > 1) {
      tpot = (r.latency_s - r.ttft_s) / static_cast<double>(r.output_tokens - 1);
      tpots.push_back(tpot);
    }
    const double tbt = mooncake_tbt(r.itl_s);
    if (!r.itl_s.empty()) tbts.push_back(tbt);
    itls.insert(itls.end(), r.itl_s.begin(), r.itl_s.end());
    ttfts.push_back(r.ttft_s);
    e2els.push_back(r.latency_s);
    if (any_slo) {
      // vLLM compares `slo_ms / 1000 >= value_s`.
      const auto meets = [](const std::optional<double>& slo_ms, double value_s) {
        return !slo_ms || *slo_ms / 1000.0 >= value_s;
      };
      if (meets(options.goodput_ttft_ms, r.ttft_s) && meets(options.goodput_tpot_ms, tpot) &&
          meets(options.goodput_e2el_ms, r.latency_s) && meets(options.goodput_tbt_ms, tbt)) {
        ++good;
      }
    }
  }
  s.request_throughput = static_cast<double>(s.completed) / duration_s;
  if (any_slo) s.request_goodput = static_cast<double>(good) / duration_s;
  s.output_throughput = static_cast<double>(s.total_output_tokens) / duration_s;
  s.total_token_throughput =
      static_cast<double>(s.total_input_tokens + s.total_output_tokens) / duration_s;
  s.ttft = stats_ms(std::move(ttfts), options.percentiles);
  s.tpot = stats_ms(std::move(tpots), options.percentiles);
  s.itl = stats_ms(std::move(itls), options.percentiles);
  s.e2el = stats_ms(std::move(e2els), options.percentiles);
  s.tbt = stats_ms(std::move(tbts), options.percentiles);

  // Peak output tokens per second and peak concurrency, from the run's timeline.
  const Timeline t = timeline(results);
  for (const auto& [second, tokens] : t.busy_seconds)
    s.max_output_tokens_per_s = std::max(s.max_output_tokens_per_s, static_cast<double>(tokens));
  int64_t current = 0;
  for (const auto& e : t.in_flight_changes) {
    current += e.second;
    s.max_concurrent_requests = std::max(s.max_concurrent_requests, current);
  }
  return s;
}

Timeline timeline(std::span<const RequestResult> results) {
  Timeline t;
  double min_start = INFINITY, max_end = -INFINITY;
  for (const RequestResult& r : results) {
    if (!r.success) continue;
    min_start = std::min(min_start, r.start_s);
    max_end = std::max(max_end, r.start_s + r.latency_s);
  }
  if (!std::isfinite(min_start)) return t;
  t.origin = min_start;
  t.end = max_end;
  t.seconds = static_cast<int64_t>(std::ceil(max_end - min_start)) + 1;
  // (bucket, tokens) of every chunk, then summed: memory follows the chunks, not the run's span.
  std::vector<std::pair<int64_t, int64_t>> buckets;
  for (const RequestResult& r : results) {
    if (!r.success) continue;
    // A chunk may carry several tokens (speculative decoding), and the stream says how many only
    // in all: the request's output tokens are spread over its chunks, chunk k of C taking
    // floor((k+1)T/C) - floor(kT/C), so the buckets add up to the tokens, not to the chunks.
    // (As base + the remainder's share: k * output_tokens could overflow, k * rem < chunks^2 not.)
    const auto chunks = static_cast<int64_t>(r.itl_s.size()) + 1;
    const int64_t base = r.output_tokens / chunks, rem = r.output_tokens % chunks;
    int64_t k = 0;
    double at = r.start_s + r.ttft_s;
    const auto add = [&](double time) {
      const int64_t tokens = base + (k + 1) * rem / chunks - k * rem / chunks;
      ++k;
      const auto b = static_cast<int64_t>(time - min_start);  // int(): toward zero
      if (tokens > 0 && b >= 0 && b < t.seconds) buckets.emplace_back(b, tokens);
    };
    add(at);
    for (double gap : r.itl_s) {
      at += gap;
      add(at);
    }
    t.in_flight_changes.emplace_back(r.start_s, 1);
    t.in_flight_changes.emplace_back(r.start_s + r.latency_s, -1);
  }
  std::sort(buckets.begin(), buckets.end());
  for (const auto& [b, tokens] : buckets) {
    if (t.busy_seconds.empty() || t.busy_seconds.back().first != b)
      t.busy_seconds.emplace_back(b, 0);
    t.busy_seconds.back().second += tokens;
  }
  std::sort(t.in_flight_changes.begin(), t.in_flight_changes.end());
  return t;
}

json to_json(const BenchSummary& s, std::span<const RequestResult> results) {
  json j;
  j["duration"] = s.duration_s;
  j["completed"] = s.completed;
  j["failed"] = s.failed;
  j["total_input_tokens"] = s.total_input_tokens;
  j["total_output_tokens"] = s.total_output_tokens;
  j["request_throughput"] = s.request_throughput;
  j["request_goodput"] = s.request_goodput ? json(*s.request_goodput) : json(nullptr);
  j["output_throughput"] = s.output_throughput;
  j["total_token_throughput"] = s.total_token_throughput;
  j["max_output_tokens_per_s"] = s.max_output_tokens_per_s;
  j["max_concurrent_requests"] = s.max_concurrent_requests;
  for (const char* name : kMetricNames) {
    if (!selected(s.options, name)) continue;
    const MetricStats& m = stats_of(s, name);
    const std::string n = name;
    j["mean_" + n + "_ms"] = m.mean_ms;
    j["median_" + n + "_ms"] = m.median_ms;
    j["std_" + n + "_ms"] = m.std_ms;
    for (const auto& [p, v] : m.percentiles_ms) j[percentile_word(p, "p") + "_" + n + "_ms"] = v;
  }
  if (!results.empty()) {
    json input_lens = json::array(), output_lens = json::array(), ttfts = json::array(),
         itls = json::array(), latencies = json::array(), starts = json::array(),
         errors = json::array();
    for (const RequestResult& r : results) {
      input_lens.push_back(r.prompt_tokens);
      output_lens.push_back(r.success ? r.output_tokens : 0);
      // vLLM writes a failed request's TTFT and latency as 0.0, its output's defaults; tools that
      // read the lists take them so.
      ttfts.push_back(r.success ? r.ttft_s : 0.0);
      itls.push_back(r.itl_s);
      latencies.push_back(r.success ? r.latency_s : 0.0);
      starts.push_back(r.start_s);
      errors.push_back(r.error);
    }
    j["input_lens"] = std::move(input_lens);
    j["output_lens"] = std::move(output_lens);
    j["ttfts"] = std::move(ttfts);
    j["itls"] = std::move(itls);
    j["latencies"] = std::move(latencies);
    j["start_times"] = std::move(starts);
    j["errors"] = std::move(errors);
  }
  return j;
}

std::string summary_table(const BenchSummary& s, const TableContext& c) {
  std::string out = banner(" Serving Benchmark Result ", '=');
  out += row("Successful requests:", s.completed);
  out += row("Failed requests:", s.failed);
  if (c.max_concurrency) out += row("Maximum request concurrency:", *c.max_concurrency);
  if (std::isfinite(c.request_rate)) out += row("Request rate configured (RPS):", c.request_rate);
  out += row("Benchmark duration (s):", s.duration_s);
  out += row("Total input tokens:", s.total_input_tokens);
  out += row("Total generated tokens:", s.total_output_tokens);
  out += row("Request throughput (req/s):", s.request_throughput);
  if (s.request_goodput) out += row("Request goodput (req/s):", *s.request_goodput);
  out += row("Output token throughput (tok/s):", s.output_throughput);
  out += row("Peak output token throughput (tok/s):", s.max_output_tokens_per_s);
  out += row("Peak concurrent requests:", static_cast<double>(s.max_concurrent_requests));
  out += row("Total token throughput (tok/s):", s.total_token_throughput);
  struct Section {
    const char* name;
    const char* label;
    const char* header;
  };
  const Section sections[] = {
      {"ttft", "TTFT", "Time to First Token"},
      {"tpot", "TPOT", "Time per Output Token (excl. 1st token)"},
      {"itl", "ITL", "Inter-token Latency"},
      {"e2el", "E2EL", "End-to-end Latency"},
      {"tbt", "TBT", "Time between Tokens (Mooncake)"},
  };
  for (const Section& sec : sections) {
    if (!selected(s.options, sec.name)) continue;
    const MetricStats& m = stats_of(s, sec.name);
    const std::string label = sec.label;
    out += banner(sec.header, '-');
    out += row("Mean " + label + " (ms):", m.mean_ms);
    out += row("Median " + label + " (ms):", m.median_ms);
    for (const auto& [p, v] : m.percentiles_ms) {
      out += row(percentile_word(p, "P") + " " + label + " (ms):", v);
    }
  }
  out += std::string(50, '=') + "\n";
  return out;
}

}  // namespace tandem::bench
