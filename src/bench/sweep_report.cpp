#include "bench/sweep_report.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "bench/html_plot.h"

namespace tandem::bench {
namespace {

using namespace html_plot;

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                   "#9467bd", "#8c564b", "#e377c2", "#17becf"};

double ratio(const SweepRow& r) {
  return r.decode > 0 ? double(r.prefill) / double(r.decode) : 0;
}

// One line per (policy, decode count), the prefill count varying along it; `value` picks the
// metric. `dashed` lines are the second metric of a pair (p99 next to p50).
void add_lines(const std::vector<SweepRow>& rows, double (*value)(const SweepRow&),
               const std::string& suffix, bool dashed, std::vector<Series>& out) {
  std::map<std::pair<std::string, int>, std::vector<const SweepRow*>> lines;
  for (const SweepRow& r : rows) lines[{r.policy, r.decode}].push_back(&r);
  size_t color = 0;
  for (auto& [key, members] : lines) {
    std::sort(members.begin(), members.end(),
              [](const SweepRow* a, const SweepRow* b) { return ratio(*a) < ratio(*b); });
    Series s;
    s.name = key.first + ", " + std::to_string(key.second) + " decode" + suffix;
    s.color = kColors[color++ % std::size(kColors)];
    s.dashed = dashed;
    for (const SweepRow* r : members) s.points.emplace_back(ratio(*r), value(*r));
    out.push_back(std::move(s));
  }
}

std::string plot(const std::vector<SweepRow>& rows, const std::string& title,
                 const std::string& y_label, double (*first)(const SweepRow&),
                 const std::string& first_name, double (*second)(const SweepRow&),
                 const std::string& second_name, bool log_y) {
  std::vector<Series> series;
  add_lines(rows, first, first_name, false, series);
  if (second) add_lines(rows, second, second_name, true, series);
  double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
  for (const Series& s : series)
    for (const auto& [x, y] : s.points) {
      xlo = std::min(xlo, x), xhi = std::max(xhi, x);
      if (!log_y || y > 0) ylo = std::min(ylo, y), yhi = std::max(yhi, y);
    }
  const bool any = std::isfinite(xlo) && std::isfinite(ylo);
  if (!any) xlo = 0, xhi = 1, ylo = 0, yhi = 1;
  // Ratios double along a doubling grid: a log axis spaces them evenly.
  const Axis x = xlo > 0 && xhi / xlo >= 4 ? log_axis(xlo, xhi, "prefill : decode engines")
                                           : linear_axis(0, xhi, "prefill : decode engines");
  const Axis y = log_y && ylo > 0 ? log_axis(ylo, yhi, y_label) : linear_axis(0, yhi, y_label);
  return "<figure><figcaption>" + escape(title) + "</figcaption>" +
         line_plot(title, x, y, series, any) + "</figure>";
}

}  // namespace

std::string sweep_report(const std::vector<SweepRow>& rows, const std::string& title,
                         const std::vector<std::pair<std::string, std::string>>& config) {
  std::string body = "<h1>" + escape(title) + "</h1>\n";
  std::string cfg = "<table>";
  for (const auto& [k, v] : config)
    cfg += "<tr><th>" + escape(k) + "</th><td>" + escape(v) + "</td></tr>";
  body += section("config", "Configuration", cfg + "</table>");

  // Without an SLO there is no goodput: a line at 0 would read as no request meeting them.
  const bool no_slo =
      !rows.empty() && std::none_of(rows.begin(), rows.end(),
                                    [](const SweepRow& r) { return r.goodput.has_value(); });
  std::string plots = no_slo ? "<p>No goodput SLO was given (<code>--goodput</code>), so there is "
                               "no goodput to plot.</p><div class=\"grid2\">"
                             : "<div class=\"grid2\">";
  if (!no_slo)
    plots += plot(
        rows, "Goodput (requests meeting every SLO)", "req/s",
        [](const SweepRow& r) { return r.goodput.value_or(0); }, "", nullptr, "", false);
  plots += plot(
      rows, "TTFT p50 (solid) and p99 (dashed)", "ms", [](const SweepRow& r) { return r.ttft_p50; },
      " p50", [](const SweepRow& r) { return r.ttft_p99; }, " p99", true);
  plots += plot(
      rows, "TPOT p50 (solid) and p99 (dashed)", "ms", [](const SweepRow& r) { return r.tpot_p50; },
      " p50", [](const SweepRow& r) { return r.tpot_p99; }, " p99", false);
  plots += plot(
      rows, "Prefix-cache hit rate", "%", [](const SweepRow& r) { return 100 * r.hit_rate; }, "",
      nullptr, "", false);
  body += section("plots", "Against the P:D ratio", plots + "</div>");

  std::string table =
      "<table class=\"summary\"><tr><th>prefill</th><th>decode</th><th>P:D</th><th>policy</th>"
      "<th>goodput (req/s)</th><th>req/s</th><th>TTFT p50</th><th>TTFT p90</th>"
      "<th>TTFT p99</th><th>TPOT p50</th><th>TPOT p99</th><th>hit %</th></tr>";
  for (const SweepRow& r : rows)
    table += "<tr><td>" + std::to_string(r.prefill) + "</td><td>" + std::to_string(r.decode) +
             "</td><td>" + fixed2(ratio(r)) + "</td><td>" + escape(r.policy) + "</td><td>" +
             (r.goodput ? printf_string("%.3f", *r.goodput) : std::string("n/a")) + "</td><td>" +
             printf_string("%.3f", r.request_rate) + "</td><td>" +
             printf_string("%.0f", r.ttft_p50) + "</td><td>" + printf_string("%.0f", r.ttft_p90) +
             "</td><td>" + printf_string("%.0f", r.ttft_p99) + "</td><td>" +
             printf_string("%.1f", r.tpot_p50) + "</td><td>" + printf_string("%.1f", r.tpot_p99) +
             "</td><td>" + fixed2(100 * r.hit_rate) + "</td></tr>";
  body += section("grid", "Every point (times in ms)", table + "</table>");
  return html_page(title, body);
}

}  // namespace tandem::bench
