#include "bench/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>

#include "bench/html_plot.h"
#include "bench/workload.h"
#include "util/error.h"

namespace tandem::bench {
namespace {

using namespace html_plot;

using nlohmann::json;

// --- Sections --------------------------------------------------------------------------------

std::string config_section(const ReportOptions& o) {
  std::string body;
  if (o.config.empty()) {
    body = "<p>No configuration was given.</p>";
  } else {
    body = "<table class=\"kv\">";
    for (const auto& [k, v] : o.config)
      body += "<tr><th>" + escape(k) + "</th><td><code>" + escape(v) + "</code></td></tr>";
    body += "</table>";
  }
  return section("config", "Configuration", body);
}

// vLLM's result keys (to_json) in the order of its terminal summary, then each metric's
// statistics with the percentiles in ascending order.
std::vector<std::string> summary_key_order(const json& j) {
  std::vector<std::string> keys = {"duration",
                                   "completed",
                                   "failed",
                                   "total_input_tokens",
                                   "total_output_tokens",
                                   "request_throughput",
                                   "request_goodput",
                                   "output_throughput",
                                   "total_token_throughput",
                                   "max_output_tokens_per_s",
                                   "max_concurrent_requests"};
  for (const char* m : {"ttft", "tpot", "itl", "e2el", "tbt"}) {
    const std::string suffix = std::string("_") + m + "_ms";
    for (const char* stat : {"mean", "median", "std"}) keys.push_back(stat + suffix);
    std::vector<std::pair<double, std::string>> ps;
    for (const auto& [k, v] : j.items()) {
      if (k.size() > suffix.size() + 1 && k[0] == 'p' &&
          k.compare(k.size() - suffix.size(), suffix.size(), suffix) == 0) {
        ps.emplace_back(std::strtod(k.c_str() + 1, nullptr), k);
      }
    }
    std::sort(ps.begin(), ps.end());
    for (auto& p : ps) keys.push_back(p.second);
  }
  // Anything else to_json may write one day still shows.
  for (const auto& [k, v] : j.items())
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  return keys;
}

std::string summary_section(const BenchSummary& summary, const ReportOptions& o) {
  const json j = to_json(summary);
  std::string body =
      "<div class=\"grid2\"><table class=\"summary\"><tr><th>key</th><th>value</th></tr>";
  for (const std::string& k : summary_key_order(j)) {
    if (!j.contains(k)) continue;
    const json& v = j.at(k);
    std::string shown;
    if (v.is_null())
      shown = "n/a";
    else if (v.is_number_integer() || v.is_number_unsigned())
      shown = v.dump();
    else if (v.is_number())
      shown = fixed2(v.get<double>());
    else
      shown = v.dump();
    body += "<tr data-key=\"" + escape(k) + "\"><th><code>" + escape(k) +
            "</code></th><td data-value=\"" + escape(v.dump()) + "\">" + escape(shown) +
            "</td></tr>";
  }
  body += "</table>";
  body += "<details open><summary>As <code>vllm bench serve</code> prints it</summary><pre>" +
          escape(summary_table(summary, o.table)) + "</pre></details></div>";
  return section("summary", "Summary", body);
}

std::string failures_section(std::span<const RequestResult> results) {
  std::map<std::string, int64_t> by_error;
  int64_t failed = 0;
  for (const RequestResult& r : results) {
    if (r.success) continue;
    ++failed;
    ++by_error[r.error];
  }
  std::string body;
  if (failed == 0) {
    body = "<p>No request failed.</p>";
  } else {
    std::vector<std::pair<int64_t, std::string>> rows;
    for (auto& [e, n] : by_error) rows.emplace_back(n, e);
    std::stable_sort(rows.begin(), rows.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    body =
        "<p>" + std::to_string(failed) + " of " + std::to_string(results.size()) +
        " requests failed, with " + std::to_string(rows.size()) +
        " distinct errors.</p><table class=\"failures\"><tr><th>requests</th><th>error</th></tr>";
    for (const auto& [n, e] : rows) {
      body += "<tr><td class=\"num\">" + std::to_string(n) + "</td><td class=\"error\">" +
              (e.empty() ? std::string("<em>(no error message)</em>") : escape(e)) + "</td></tr>";
    }
    body += "</table>";
  }
  return section("failures", "Failed requests", body);
}

// The empirical CDF as a step line; beyond kMaxSteps values it is sampled at evenly spaced
// ranks, which is indistinguishable at this resolution and keeps the file small.
std::vector<std::pair<double, double>> cdf_points(std::vector<double> ms) {
  constexpr size_t kMaxSteps = 2000;
  std::sort(ms.begin(), ms.end());
  std::vector<std::pair<double, double>> pts;
  const size_t n = ms.size();
  if (n == 0) return pts;
  const double dn = static_cast<double>(n);
  if (n <= kMaxSteps) {
    pts.emplace_back(ms[0], 0.0);
    for (size_t i = 0; i < n; ++i) {
      if (i > 0) pts.emplace_back(ms[i], static_cast<double>(i) / dn);
      pts.emplace_back(ms[i], static_cast<double>(i + 1) / dn);
    }
  } else {
    pts.emplace_back(ms[0], 0.0);
    for (size_t k = 0; k <= kMaxSteps; ++k) {
      const size_t i = (n - 1) * k / kMaxSteps;
      pts.emplace_back(ms[i], static_cast<double>(i + 1) / dn);
    }
  }
  return pts;
}

std::string stats_caption(const MetricStats& m, size_t count) {
  std::string s = std::to_string(count) + " values; mean <span class=\"stat\">" +
                  fixed2(m.mean_ms) + "</span> ms, median <span class=\"stat\">" +
                  fixed2(m.median_ms) + "</span> ms";
  for (const auto& [p, v] : m.percentiles_ms)
    s += ", p" + printf_string("%g", p) + " <span class=\"stat\">" + fixed2(v) + "</span> ms";
  return s + " (the summary's statistics).";
}

std::string latency_section(const BenchSummary& summary, std::span<const RequestResult> results) {
  std::vector<double> ttft, tpot, itl, e2e;
  for (const RequestResult& r : results) {
    if (!r.success) continue;
    ttft.push_back(r.ttft_s * 1000);
    if (r.output_tokens > 1)
      tpot.push_back((r.latency_s - r.ttft_s) / static_cast<double>(r.output_tokens - 1) * 1000);
    for (double g : r.itl_s) itl.push_back(g * 1000);
    e2e.push_back(r.latency_s * 1000);
  }
  struct Cdf {
    const char* id;
    const char* name;
    const std::vector<double>* values;
    const MetricStats* stats;
    const char* color;
  };
  const Cdf cdfs[] = {
      {"cdf-ttft", "TTFT (time to first token)", &ttft, &summary.ttft, "#1f77b4"},
      {"cdf-tpot", "TPOT (time per output token, excl. 1st)", &tpot, &summary.tpot, "#ff7f0e"},
      {"cdf-itl", "ITL (inter-token latency, every gap)", &itl, &summary.itl, "#2ca02c"},
      {"cdf-e2el", "E2E latency", &e2e, &summary.e2el, "#d62728"},
  };
  std::string body =
      "<p>Completed requests only. Each curve is the share of values at or below x.</p>"
      "<div class=\"grid2\">";
  for (const Cdf& c : cdfs) {
    const std::vector<double>& v = *c.values;
    // From the smallest value, not 0: a tight distribution (TPOT, E2E) would otherwise be a
    // vertical line at the right edge.
    const auto [lo, hi] = v.empty() ? std::pair<double, double>(0, 1)
                                    : std::pair(*std::min_element(v.begin(), v.end()),
                                                *std::max_element(v.begin(), v.end()));
    const Axis x = linear_axis(lo, std::max(hi, lo + 1e-3), std::string(c.name) + ", ms");
    const Axis y = linear_axis(0, 1, "fraction of values");
    Series s{c.name, c.color, cdf_points(v)};
    std::string svg = line_plot(std::string("CDF of ") + c.name, x, y, {s}, !v.empty());
    if (!v.empty()) {
      // The summary's median as a dashed marker.
      const std::string mx = coord(px(x, c.stats->median_ms));
      svg.insert(svg.size() - 6, "<line class=\"marker\" x1=\"" + mx + "\" x2=\"" + mx +
                                     "\" y1=\"" + coord(kTop) + "\" y2=\"" + coord(kTop + kPlotH) +
                                     "\"><title>median</title></line>");
    }
    body += "<figure id=\"" + std::string(c.id) + "\"><figcaption><b>" + escape(c.name) +
            "</b>: " + stats_caption(*c.stats, v.size()) + "</figcaption>" + svg + "</figure>";
  }
  body += "</div>";
  return section("latency", "Latency distributions", body);
}

// Output tokens per 1 s bucket and requests in flight, with the buckets and rules of
// summarize(): completed requests, buckets from the earliest send, a token at start + ttft and
// after each gap, a request in flight over [start, start + latency) with ends before starts at
// equal times. So the busiest bucket is max_output_tokens_per_s and the highest "most in
// flight" point is max_concurrent_requests.
std::string timeline_section(std::span<const RequestResult> results) {
  const Timeline tl = timeline(results);
  const double origin = tl.in_flight_changes.empty() ? INFINITY : tl.origin;
  const double end = tl.end;
  std::string body =
      "<p>Completed requests, in 1 s buckets from the first send: output tokens (streamed "
      "chunks) per second, and requests in flight (the most at any instant of the second, and "
      "the time average). A run longer than 2000 s is drawn in windows of whole seconds: the "
      "busiest second and the most in flight of each window, and its time average.</p><div "
      "class=\"grid2\">";
  if (!std::isfinite(origin)) {
    const Axis x = linear_axis(0, 1, "time since first send, s");
    body += "<figure id=\"throughput\">" +
            line_plot("Output tokens per second", x, linear_axis(0, 1, "tokens/s"), {}, false) +
            "</figure><figure id=\"concurrency\">" +
            line_plot("Requests in flight", x, linear_axis(0, 1, "requests"), {}, false) +
            "</figure></div>";
    return section("timeline", "Throughput and concurrency over time", body);
  }
  // Plotted in windows of whole seconds, at most kMaxWindows of them: a week-long trace's 1 s
  // buckets made tens of megabytes of SVG. Each window is worked out whole, never a value per
  // second: arrivals may lie 10^9 s apart, and arrays of that many seconds took gigabytes. A
  // window shows its busiest second and its most in flight (so the highest points stay the
  // captions' figures) and its time average.
  constexpr int64_t kMaxWindows = 2000;
  const int64_t buckets = tl.seconds;  // summarize()'s buckets
  const int64_t width = (buckets + kMaxWindows - 1) / kMaxWindows;
  const auto windows = static_cast<size_t>((buckets + width - 1) / width);
  std::vector<double> tokens(windows, 0.0), peak(windows, 0.0), area(windows, 0.0);
  for (const auto& [second, n] : tl.busy_seconds) {
    double& w = tokens[static_cast<size_t>(second / width)];
    w = std::max(w, static_cast<double>(n));
  }
  const auto window_of = [&](double t) {
    return static_cast<size_t>(
        std::min(static_cast<int64_t>(std::max(0.0, t - origin)), buckets - 1) / width);
  };
  const auto& events = tl.in_flight_changes;
  int64_t current = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    const double t = events[i].first;
    current += events[i].second;
    const auto c = static_cast<double>(current);
    const size_t w = window_of(t);
    peak[w] = std::max(peak[w], c);
    if (i + 1 == events.size()) break;
    // Until the next event `current` requests are in flight: over the rest of this window,
    // every window the interval crosses and the start of the window it ends in.
    const double t2 = events[i + 1].first;
    if (t2 <= t) continue;
    const size_t w2 = window_of(t2);
    for (size_t k = w; k <= w2; ++k) {
      const auto first = static_cast<int64_t>(k) * width;
      const double lo = std::max(t, origin + static_cast<double>(first));
      const double hi =
          std::min(t2, origin + static_cast<double>(std::min(first + width, buckets)));
      if (hi > lo) {
        area[k] += c * (hi - lo);
        peak[k] = std::max(peak[k], c);
      }
    }
  }
  Series tok{"output tokens/s", "#1f77b4", {}};
  Series most{"most in flight", "#d62728", {}};
  Series mean{"mean in flight", "#9467bd", {}, true};
  double max_tok = 0, max_peak = 0;
  for (size_t k = 0; k < windows; ++k) {
    const auto a = static_cast<double>(static_cast<int64_t>(k) * width);
    const auto b = static_cast<double>(std::min((static_cast<int64_t>(k) + 1) * width, buckets));
    tok.points.emplace_back(a, tokens[k]);
    tok.points.emplace_back(b, tokens[k]);
    most.points.emplace_back(a, peak[k]);
    most.points.emplace_back(b, peak[k]);
    // The last window usually extends past the run; average over the part inside it.
    const double span = std::min(b - a, end - (origin + a));
    const double avg = span > 0 ? area[k] / span : 0;
    mean.points.emplace_back(a, avg);
    mean.points.emplace_back(b, avg);
    max_tok = std::max(max_tok, tokens[k]);
    max_peak = std::max(max_peak, peak[k]);
  }
  const Axis x = linear_axis(0, static_cast<double>(buckets), "time since first send, s");
  body +=
      "<figure id=\"throughput\"><figcaption><b>Output tokens per second</b>: busiest "
      "second <span class=\"stat\">" +
      printf_string("%.0f", max_tok) + "</span> tokens.</figcaption>" +
      line_plot("Output tokens per second", x, linear_axis(0, max_tok, "tokens/s"), {tok}, true) +
      "</figure>";
  body +=
      "<figure id=\"concurrency\"><figcaption><b>Requests in flight</b>: at most <span "
      "class=\"stat\">" +
      printf_string("%.0f", max_peak) + "</span> at once.</figcaption>" +
      line_plot("Requests in flight", x, linear_axis(0, max_peak, "requests"), {most, mean}, true) +
      "</figure></div>";
  return section("timeline", "Throughput and concurrency over time", body);
}

// --- Gateway phases --------------------------------------------------------------------------

// The nine phases that end, and the stamp that ends each: gateway::PhaseTimes::seconds_in (src/
// gateway/lifecycle.cpp) on the access log's offsets. A phase counts when both stamps are there
// and the end is not before the start, as the gateway's histogram counts it.
struct PhaseRule {
  const char* phase;
  const char* ends_at;
};
constexpr PhaseRule kPhaseRules[] = {
    {"received", "tokenizing"},
    {"tokenizing", "prefix_matching"},
    {"prefix_matching", "prefill_waiting"},
    {"prefill_waiting", "prefill_scheduled"},
    {"prefill_scheduled", "prefilling"},
    {"prefilling", "prefill_done"},
    {"decode_waiting", "decode_scheduled"},
    {"decode_scheduled", "decoding"},
    {"decoding", "completed"},
};

// Empty when the entry is fine, else what is wrong with it.
std::string access_entry_problem(const json& entry) {
  if (!entry.is_object()) return "expected a JSON object";
  const auto it = entry.find("phases");
  if (it == entry.end()) return "has no \"phases\"";
  if (!it->is_object()) return "\"phases\" must be an object";
  for (const auto& [k, v] : it->items()) {
    if (!v.is_number()) return "phase \"" + k + "\" must be a number of seconds";
    if (!std::isfinite(v.get<double>()))
      return "phase \"" + k + "\" must be a finite number of seconds";
  }
  // Finite stamps can still span more than a double holds (-1e308 to 1e308), and a time in ms
  // that is not finite puts "inf" and "nan" into the plot.
  for (const PhaseRule& rule : kPhaseRules) {
    const auto a = it->find(rule.phase);
    const auto b = it->find(rule.ends_at);
    if (a == it->end() || b == it->end()) continue;
    if (!std::isfinite((b->get<double>() - a->get<double>()) * 1000))
      return std::string("phase \"") + rule.phase + "\" to \"" + rule.ends_at +
             "\" is not a finite number of milliseconds";
  }
  if (const auto e = entry.find("e2e_seconds");
      e != entry.end() && e->is_number() && !std::isfinite(e->get<double>() * 1000))
    return "\"e2e_seconds\" is not a finite number of milliseconds";
  return {};
}

struct BoxStats {
  size_t n = 0;
  double min = 0, p5 = 0, p25 = 0, p50 = 0, p75 = 0, p90 = 0, p95 = 0, p99 = 0, max = 0, mean = 0;
};

BoxStats box_stats(std::vector<double> v) {
  BoxStats b;
  b.n = v.size();
  if (v.empty()) return b;
  std::sort(v.begin(), v.end());
  // Finite times near a double's limit can sum past it; x86's long double holds the sum.
  long double sum = 0;
  for (double x : v) sum += x;
  b.mean = static_cast<double>(sum / static_cast<long double>(v.size()));
  b.min = v.front();
  b.max = v.back();
  // percentile() sorts its copy again; the lists are per phase and small next to the log.
  b.p5 = percentile(v, 5);
  b.p25 = percentile(v, 25);
  b.p50 = percentile(v, 50);
  b.p75 = percentile(v, 75);
  b.p90 = percentile(v, 90);
  b.p95 = percentile(v, 95);
  b.p99 = percentile(v, 99);
  return b;
}

std::string phases_section(const std::vector<json>& log) {
  if (log.empty()) {
    return section("phases", "Gateway phases",
                   "<p>No gateway access log was given, so there is no per-phase breakdown.</p>");
  }
  std::vector<std::vector<double>> ms(std::size(kPhaseRules));
  std::vector<double> e2e_ms;
  std::map<std::string, int64_t> statuses;
  for (size_t i = 0; i < log.size(); ++i) {
    const json& entry = log[i];
    if (std::string p = access_entry_problem(entry); !p.empty())
      throw Error("access log entry " + std::to_string(i + 1) + ": " + p);
    const json& phases = entry.at("phases");
    for (size_t r = 0; r < std::size(kPhaseRules); ++r) {
      const auto a = phases.find(kPhaseRules[r].phase);
      const auto b = phases.find(kPhaseRules[r].ends_at);
      if (a == phases.end() || b == phases.end()) continue;
      const double start = a->get<double>(), stop = b->get<double>();
      if (stop < start) continue;
      ms[r].push_back((stop - start) * 1000);
    }
    if (const auto e = entry.find("e2e_seconds"); e != entry.end() && e->is_number())
      e2e_ms.push_back(e->get<double>() * 1000);
    const auto st = entry.find("status");
    ++statuses[st == entry.end() ? std::string("(none)") : st->dump()];
  }

  struct Row {
    std::string name;
    BoxStats b;
    bool total;
  };
  std::vector<Row> rows;
  for (size_t r = 0; r < std::size(kPhaseRules); ++r)
    if (!ms[r].empty()) rows.push_back({kPhaseRules[r].phase, box_stats(ms[r]), false});
  if (!e2e_ms.empty()) rows.push_back({"e2e (received to completed)", box_stats(e2e_ms), true});

  std::string body = "<p>" + std::to_string(log.size()) + " access-log entries; status";
  bool first = true;
  for (const auto& [s, n] : statuses) {
    body += (first ? " " : ", ") + escape(s) + ": " + std::to_string(n);
    first = false;
  }
  body +=
      ". Time in each gateway phase, from its stamp to the stamp that ends it (docs/gateway.md, "
      "\"Request lifecycle\"); in parallel mode the prefill and decode phases overlap, so they do "
      "not add up to the total. Boxes span p25 to p75 with the median marked, whiskers p5 to "
      "p95; log scale.</p>";

  if (rows.empty()) {
    body += "<p>No entry has a finished phase.</p>";
    return section("phases", "Gateway phases", body);
  }
  // The box plot: one row per phase, a shared log-scale time axis.
  double lo = INFINITY, hi = 0;
  for (const Row& r : rows) {
    if (r.b.p5 > 0) lo = std::min(lo, r.b.p5);
    hi = std::max(hi, r.b.p95);
  }
  if (!std::isfinite(lo)) lo = 1e-3;
  lo = std::max(lo, 1e-4);  // 0.1 µs: a zero-length phase sits at the left edge
  hi = std::max(hi, lo * 10);
  const Axis x = log_axis(lo, hi, "time in phase, ms (log scale)");
  const double row_h = 24, label_w = 180, pad_right = 16;  // room for the last tick label
  const double height = kTop + row_h * static_cast<double>(rows.size()) + kBottom;
  std::string svg = "<svg class=\"plot\" viewBox=\"0 0 " + coord(kWidth + label_w + pad_right) +
                    " " + coord(height) + "\" width=\"" + coord(kWidth + label_w + pad_right) +
                    "\" height=\"" + coord(height) +
                    "\" role=\"img\"><title>Time per gateway phase</title>";
  svg += "<g transform=\"translate(" + coord(label_w) + " 0)\">";
  const double plot_h = row_h * static_cast<double>(rows.size());
  svg += "<rect class=\"frame\" x=\"" + coord(kLeft) + "\" y=\"" + coord(kTop) + "\" width=\"" +
         coord(kPlotW) + "\" height=\"" + coord(plot_h) + "\"/>";
  for (const auto& [v, label] : x.ticks) {
    const std::string xp = coord(px(x, v));
    svg += "<line class=\"grid\" x1=\"" + xp + "\" x2=\"" + xp + "\" y1=\"" + coord(kTop) +
           "\" y2=\"" + coord(kTop + plot_h) + "\"/><text class=\"tick\" x=\"" + xp + "\" y=\"" +
           coord(kTop + plot_h + 16) + "\" text-anchor=\"middle\">" + escape(label) + "</text>";
  }
  svg += "<text class=\"axis-label\" x=\"" + coord(kLeft + kPlotW / 2) + "\" y=\"" +
         coord(kTop + plot_h + 36) + "\" text-anchor=\"middle\">" + escape(x.label) + "</text>";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const double yc = kTop + row_h * (static_cast<double>(i) + 0.5);
    const char* color = r.total ? "#7f7f7f" : "#1f77b4";
    svg += "<g class=\"box\" data-phase=\"" + escape(r.name) + "\"><title>" + escape(r.name) +
           ": n " + std::to_string(r.b.n) + ", median " + fixed2(r.b.p50) + " ms</title>";
    svg += "<text class=\"row-label\" x=\"" + coord(kLeft - 8) + "\" y=\"" + coord(yc + 4) +
           "\" text-anchor=\"end\">" + escape(r.name) + "</text>";
    svg += "<line class=\"whisker\" x1=\"" + coord(px(x, r.b.p5)) + "\" x2=\"" +
           coord(px(x, r.b.p95)) + "\" y1=\"" + coord(yc) + "\" y2=\"" + coord(yc) + "\"/>";
    const double x25 = px(x, r.b.p25), x75 = px(x, r.b.p75);
    svg += "<rect x=\"" + coord(x25) + "\" y=\"" + coord(yc - row_h * 0.3) + "\" width=\"" +
           coord(std::max(1.0, x75 - x25)) + "\" height=\"" + coord(row_h * 0.6) + "\" fill=\"" +
           color + "\" fill-opacity=\"0.35\" stroke=\"" + color + "\"/>";
    const std::string xm = coord(px(x, r.b.p50));
    svg += "<line class=\"median\" x1=\"" + xm + "\" x2=\"" + xm + "\" y1=\"" +
           coord(yc - row_h * 0.3) + "\" y2=\"" + coord(yc + row_h * 0.3) + "\"/></g>";
  }
  svg += "</g></svg>";
  body += "<figure id=\"phase-boxes\">" + svg + "</figure>";

  body +=
      "<table class=\"phases\"><tr><th>phase</th><th>requests</th><th>mean ms</th><th>median "
      "ms</th><th>p90 ms</th><th>p99 ms</th><th>max ms</th></tr>";
  for (const Row& r : rows) {
    body += "<tr data-phase=\"" + escape(r.name) + "\"><th>" + escape(r.name) +
            "</th><td class=\"num\">" + std::to_string(r.b.n) + "</td><td class=\"num\">" +
            fixed2(r.b.mean) + "</td><td class=\"num\">" + fixed2(r.b.p50) +
            "</td><td class=\"num\">" + fixed2(r.b.p90) + "</td><td class=\"num\">" +
            fixed2(r.b.p99) + "</td><td class=\"num\">" + fixed2(r.b.max) + "</td></tr>";
  }
  body += "</table>";
  return section("phases", "Gateway phases", body);
}

}  // namespace

std::string html_report(const BenchSummary& summary, std::span<const RequestResult> results,
                        const ReportOptions& options) {
  // Built first, so that a bad access log throws before anything else is done.
  const std::string phases = phases_section(options.access_log);
  std::string out;
  out += "<h1>" + escape(options.title) + "</h1>\n";
  out += "<p>" + std::to_string(summary.completed) + " requests completed, " +
         std::to_string(summary.failed) + " failed, in " + fixed2(summary.duration_s) + " s.</p>\n";
  out += config_section(options);
  out += summary_section(summary, options);
  out += failures_section(results);
  out += latency_section(summary, results);
  out += timeline_section(results);
  out += phases;
  return html_page(options.title, out);
}

std::vector<json> read_access_log(const std::filesystem::path& path) {
  check_input_file(path, "access log " + path.string());
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("access log " + path.string() + ": cannot open the file");
  std::vector<json> out;
  std::string line;
  const std::string what = "access log " + path.string();
  for (int64_t number = 1; read_line(in, line, what, number); ++number) {
    const std::string where = "access log " + path.string() + ":" + std::to_string(number) + ": ";
    json entry;
    try {
      entry = json::parse(line);
    } catch (const json::exception& e) {  // out_of_range too: a number past a double's range
      throw Error(where + "not a JSON line (" + json_error_text(e) + ")");
    }
    if (std::string p = access_entry_problem(entry); !p.empty()) throw Error(where + p);
    out.push_back(std::move(entry));
  }
  if (in.bad()) throw Error("access log " + path.string() + ": read error");
  return out;
}

}  // namespace tandem::bench
