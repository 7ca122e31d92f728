#include "bench/sweep_report.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "bench/html_plot.h"

namespace tandem::bench {
namespace {

using namespace html_plot;

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                   "#9467bd", "#8c564b", "#e377c2", "#17becf"};

double ratio(const SweepRow& r) {
  return r.decode > 0 ? double(r.prefill) / double(r.decode) : 0;
}

// What the plots run against: the P:D ratio when the prefill count was swept; else the decode
// count when it was (sweeping decode alone, or aggregated mode, where prefill is always 0);
// else the policy. Against a ratio that never changes every line would be one point.
struct XDimension {
  enum Kind { kRatio, kDecode, kPolicy } kind = kRatio;
  std::vector<std::string> policies;  // kPolicy: the policies in order, one x position each

  static XDimension of(const std::vector<SweepRow>& rows) {
    std::set<int> prefills, decodes;
    std::set<std::string> policies;
    for (const SweepRow& r : rows) {
      prefills.insert(r.prefill);
      decodes.insert(r.decode);
      policies.insert(r.policy);
    }
    XDimension d;
    if (rows.empty() || prefills.size() > 1) return d;
    if (decodes.size() > 1) {
      d.kind = kDecode;
      return d;
    }
    d.kind = kPolicy;
    d.policies.assign(policies.begin(), policies.end());
    return d;
  }

  double x(const SweepRow& r) const {
    switch (kind) {
      case kRatio:
        return ratio(r);
      case kDecode:
        return r.decode;
      case kPolicy:
        break;
    }
    return double(std::lower_bound(policies.begin(), policies.end(), r.policy) - policies.begin());
  }

  // One line per policy, and per decode count when that is not the x axis.
  std::pair<std::string, int> line_of(const SweepRow& r) const {
    return {r.policy, kind == kRatio ? r.decode : 0};
  }
  std::string line_name(const std::pair<std::string, int>& line, const SweepRow& any) const {
    if (kind == kRatio) return line.first + ", " + std::to_string(line.second) + " decode";
    if (any.prefill > 0) return line.first + ", " + std::to_string(any.prefill) + " prefill";
    return line.first;
  }

  Axis axis(double lo, double hi) const {
    switch (kind) {
      case kRatio:  // ratios double along a doubling grid: a log axis spaces them evenly
        return lo > 0 && hi / lo >= 4 ? log_axis(lo, hi, "prefill : decode engines")
                                      : linear_axis(0, hi, "prefill : decode engines");
      case kDecode:
        return linear_axis(0, hi, "decode engines");
      case kPolicy:
        break;
    }
    Axis a;
    a.label = "policy";
    a.lo = -0.5;
    a.hi = static_cast<double>(policies.size()) - 0.5;
    for (size_t i = 0; i < policies.size(); ++i) a.ticks.emplace_back(double(i), policies[i]);
    return a;
  }

  std::string heading() const {
    return kind == kRatio    ? "Against the P:D ratio"
           : kind == kDecode ? "Against the decode engine count"
                             : "By policy";
  }
};

// `value` picks the metric. `dashed` lines are the second metric of a pair (p99 next to p50).
void add_lines(const std::vector<SweepRow>& rows, const XDimension& dim,
               double (*value)(const SweepRow&), const std::string& suffix, bool dashed,
               std::vector<Series>& out) {
  std::map<std::pair<std::string, int>, std::vector<const SweepRow*>> lines;
  for (const SweepRow& r : rows) lines[dim.line_of(r)].push_back(&r);
  size_t color = 0;
  for (auto& [key, members] : lines) {
    std::sort(members.begin(), members.end(),
              [&](const SweepRow* a, const SweepRow* b) { return dim.x(*a) < dim.x(*b); });
    Series s;
    s.name = dim.line_name(key, *members.front()) + suffix;
    s.color = kColors[color++ % std::size(kColors)];
    s.dashed = dashed;
    s.markers = true;
    for (const SweepRow* r : members) s.points.emplace_back(dim.x(*r), value(*r));
    out.push_back(std::move(s));
  }
}

std::string plot(const std::vector<SweepRow>& rows, const XDimension& dim, const std::string& title,
                 const std::string& y_label, double (*first)(const SweepRow&),
                 const std::string& first_name, double (*second)(const SweepRow&),
                 const std::string& second_name, bool log_y) {
  std::vector<Series> series;
  add_lines(rows, dim, first, first_name, false, series);
  if (second) add_lines(rows, dim, second, second_name, true, series);
  double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
  for (const Series& s : series)
    for (const auto& [x, y] : s.points) {
      xlo = std::min(xlo, x), xhi = std::max(xhi, x);
      if (!log_y || y > 0) ylo = std::min(ylo, y), yhi = std::max(yhi, y);
    }
  const bool any = std::isfinite(xlo) && std::isfinite(ylo);
  if (!any) xlo = 0, xhi = 1, ylo = 0, yhi = 1;
  const Axis x = dim.axis(xlo, xhi);
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

  const XDimension dim = XDimension::of(rows);
  // Without an SLO there is no goodput: a line at 0 would read as no request meeting them.
  const bool no_slo =
      !rows.empty() && std::none_of(rows.begin(), rows.end(),
                                    [](const SweepRow& r) { return r.goodput.has_value(); });
  std::string plots = no_slo ? "<p>No goodput SLO was given (<code>--goodput</code>), so there is "
                               "no goodput to plot.</p><div class=\"grid2\">"
                             : "<div class=\"grid2\">";
  if (!no_slo)
    plots += plot(
        rows, dim, "Goodput (requests meeting every SLO)", "req/s",
        [](const SweepRow& r) { return r.goodput.value_or(0); }, "", nullptr, "", false);
  plots += plot(
      rows, dim, "TTFT p50 (solid) and p99 (dashed)", "ms",
      [](const SweepRow& r) { return r.ttft_p50; }, " p50",
      [](const SweepRow& r) { return r.ttft_p99; }, " p99", true);
  plots += plot(
      rows, dim, "TPOT p50 (solid) and p99 (dashed)", "ms",
      [](const SweepRow& r) { return r.tpot_p50; }, " p50",
      [](const SweepRow& r) { return r.tpot_p99; }, " p99", false);
  plots += plot(
      rows, dim, "Prefix-cache hit rate", "%", [](const SweepRow& r) { return 100 * r.hit_rate; },
      "", nullptr, "", false);
  body += section("plots", dim.heading(), plots + "</div>");

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
