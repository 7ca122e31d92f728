#include "bench/html_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "util/html.h"
#include "util/utf8.h"

namespace tandem::bench::html_plot {
namespace {

constexpr const char* kStyle = R"css(
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em auto;
       max-width: 1360px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 2px 8px; text-align: left; vertical-align: top; }
td.num, table.summary td { text-align: right; font-variant-numeric: tabular-nums; }
td.error { white-space: pre-wrap; word-break: break-all; font-family: monospace; }
pre { background: #f6f6f6; padding: 0.5em; overflow-x: auto; }
.grid2 { display: flex; flex-wrap: wrap; gap: 1em; }
figure { margin: 0; } figcaption { font-size: 0.9em; margin-bottom: 4px; max-width: 640px; }
svg.plot { max-width: 100%; height: auto; background: #fff; font-size: 11px; }
svg .frame { fill: none; stroke: #888; }
svg .grid { stroke: #e4e4e4; }
svg .series { stroke-width: 1.6; }
svg .marker { stroke: #555; stroke-dasharray: 3 3; }
svg .whisker, svg .median { stroke: #333; stroke-width: 1.4; }
svg .tick, svg .legend, svg .row-label { fill: #444; }
svg .axis-label { fill: #222; font-size: 12px; }
svg .no-data { fill: #999; font-size: 14px; }
)css";

}  // namespace

double Axis::fraction(double v) const {
  if (log) {
    v = std::clamp(v, lo, hi);
    return (std::log10(v) - std::log10(lo)) / (std::log10(hi) - std::log10(lo));
  }
  return (v - lo) / (hi - lo);
}

// Text for HTML content and quoted attributes. Ill-formed UTF-8 becomes U+FFFD first, so that a
// server's garbled error message cannot change how the page decodes.
std::string escape(std::string_view raw) {
  return html_escape(utf8::to_valid_lossy(raw));
}

std::string printf_string(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// Two decimals, as vLLM's terminal summary prints its numbers.
std::string fixed2(double v) {
  return printf_string("%.2f", v);
}

// SVG coordinates: a tenth of a pixel is plenty and keeps big plots small.
std::string coord(double v) {
  return printf_string("%.1f", v);
}

// A tick label: as many decimals as the tick step needs.
std::string tick_label(double v, double step) {
  const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

// 1, 2 or 5 times a power of ten, at least `raw`.
static double nice_step(double raw) {
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw * (1 - 1e-9)) return m * p;
  return 10 * p;
}

// From `lo` to at least `hi`, ending on a tick, about five ticks.
Axis linear_axis(double lo, double hi, std::string label) {
  Axis a;
  a.label = std::move(label);
  if (!(hi > lo)) hi = lo + 1;
  const double step = nice_step((hi - lo) / 5);
  a.lo = std::floor(lo / step + 1e-9) * step;
  a.hi = std::ceil(hi / step - 1e-9) * step;
  for (int i = 0;; ++i) {
    const double v = a.lo + i * step;
    if (v > a.hi + step * 1e-6) break;
    a.ticks.emplace_back(v, tick_label(v, step));
  }
  return a;
}

// Whole decades around [lo, hi] (both > 0).
Axis log_axis(double lo, double hi, std::string label) {
  Axis a;
  a.label = std::move(label);
  a.log = true;
  int e0 = static_cast<int>(std::floor(std::log10(lo) + 1e-9));
  int e1 = static_cast<int>(std::ceil(std::log10(hi) - 1e-9));
  if (e1 <= e0) e1 = e0 + 1;
  a.lo = std::pow(10.0, e0);
  a.hi = std::pow(10.0, e1);
  for (int e = e0; e <= e1; ++e) {
    const double v = std::pow(10.0, e);
    a.ticks.emplace_back(v, tick_label(v, v));
  }
  return a;
}

double px(const Axis& x, double v) {
  return kLeft + x.fraction(v) * kPlotW;
}
double py(const Axis& y, double v) {
  return kTop + (1 - y.fraction(v)) * kPlotH;
}

std::string svg_open(const std::string& title) {
  return "<svg class=\"plot\" viewBox=\"0 0 " + coord(kWidth) + " " + coord(kHeight) +
         "\" width=\"" + coord(kWidth) + "\" height=\"" + coord(kHeight) + "\" role=\"img\">" +
         "<title>" + escape(title) + "</title>";
}

// Frame, grid, ticks and axis labels. `y` may be null for a plot with category rows.
std::string svg_axes(const Axis& x, const Axis* y) {
  std::string s;
  s += "<rect class=\"frame\" x=\"" + coord(kLeft) + "\" y=\"" + coord(kTop) + "\" width=\"" +
       coord(kPlotW) + "\" height=\"" + coord(kPlotH) + "\"/>";
  for (const auto& [v, label] : x.ticks) {
    const std::string xp = coord(px(x, v));
    s += "<line class=\"grid\" x1=\"" + xp + "\" x2=\"" + xp + "\" y1=\"" + coord(kTop) +
         "\" y2=\"" + coord(kTop + kPlotH) + "\"/>";
    s += "<text class=\"tick\" x=\"" + xp + "\" y=\"" + coord(kTop + kPlotH + 16) +
         "\" text-anchor=\"middle\">" + escape(label) + "</text>";
  }
  s += "<text class=\"axis-label\" x=\"" + coord(kLeft + kPlotW / 2) + "\" y=\"" +
       coord(kHeight - 6) + "\" text-anchor=\"middle\">" + escape(x.label) + "</text>";
  if (y) {
    for (const auto& [v, label] : y->ticks) {
      const std::string yp = coord(py(*y, v));
      s += "<line class=\"grid\" x1=\"" + coord(kLeft) + "\" x2=\"" + coord(kLeft + kPlotW) +
           "\" y1=\"" + yp + "\" y2=\"" + yp + "\"/>";
      s += "<text class=\"tick\" x=\"" + coord(kLeft - 6) + "\" y=\"" + coord(py(*y, v) + 4) +
           "\" text-anchor=\"end\">" + escape(label) + "</text>";
    }
    s += "<text class=\"axis-label\" transform=\"translate(14 " + coord(kTop + kPlotH / 2) +
         ") rotate(-90)\" text-anchor=\"middle\">" + escape(y->label) + "</text>";
  }
  return s;
}

std::string svg_no_data() {
  return "<text class=\"no-data\" x=\"" + coord(kLeft + kPlotW / 2) + "\" y=\"" +
         coord(kTop + kPlotH / 2) + "\" text-anchor=\"middle\">no data</text>";
}

std::string line_plot(const std::string& title, const Axis& x, const Axis& y,
                      const std::vector<Series>& series, bool any_data) {
  std::string s = svg_open(title) + svg_axes(x, &y);
  if (!any_data) s += svg_no_data();
  for (const Series& ser : series) {
    s += "<polyline class=\"series\" fill=\"none\" stroke=\"" + ser.color + "\"";
    if (ser.dashed) s += " stroke-dasharray=\"5 4\"";
    s += " points=\"";
    for (const auto& [a, b] : ser.points) s += coord(px(x, a)) + "," + coord(py(y, b)) + " ";
    s += "\"><title>" + escape(ser.name) + "</title></polyline>";
    // A polyline of one point draws nothing: only a marker shows it.
    if (!ser.markers) continue;
    for (const auto& [a, b] : ser.points) {
      s += "<circle class=\"point\" cx=\"" + coord(px(x, a)) + "\" cy=\"" + coord(py(y, b)) +
           "\" r=\"3.5\" stroke=\"" + ser.color + "\" stroke-width=\"1.6\" fill=\"" +
           (ser.dashed ? std::string("#fff") : ser.color) + "\"><title>" + escape(ser.name) +
           "</title></circle>";
    }
  }
  // A legend when there is more than one series.
  if (series.size() > 1) {
    double lx = kLeft + 8;
    for (const Series& ser : series) {
      s += "<line x1=\"" + coord(lx) + "\" x2=\"" + coord(lx + 18) + "\" y1=\"" + coord(kTop - 10) +
           "\" y2=\"" + coord(kTop - 10) + "\" stroke=\"" + ser.color + "\" stroke-width=\"2\"" +
           (ser.dashed ? " stroke-dasharray=\"5 4\"" : "") + "/>";
      s += "<text class=\"legend\" x=\"" + coord(lx + 22) + "\" y=\"" + coord(kTop - 6) + "\">" +
           escape(ser.name) + "</text>";
      lx += 30 + 7.0 * static_cast<double>(ser.name.size());
    }
  }
  return s + "</svg>";
}

std::string section(const std::string& id, const std::string& heading, const std::string& body) {
  return "<section id=\"" + id + "\"><h2>" + escape(heading) + "</h2>" + body + "</section>\n";
}

std::string html_page(const std::string& title, const std::string& body) {
  std::string out;
  out += "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n";
  // Nothing may be fetched or run: the file must work offline, and injected markup would be
  // inert even if escaping ever failed.
  out +=
      "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src "
      "'unsafe-inline'\">\n";
  out += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n";
  out += "<title>" + escape(title) + "</title>\n<style>" + kStyle + "</style></head>\n";
  out += "<body>\n" + body + "</body></html>\n";
  return out;
}

}  // namespace tandem::bench::html_plot
