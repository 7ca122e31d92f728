#pragma once
// The pieces of Tandem's self-contained HTML reports (tandem bench's, tandem simulate's sweeps):
// escaped text, inline SVG line plots with linear or log axes, sections, and the page itself
// (inline CSS, no scripts or fetches; a Content-Security-Policy forbids them).
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tandem::bench::html_plot {

// Text for HTML content and quoted attributes (ill-formed UTF-8 becomes U+FFFD first).
std::string escape(std::string_view raw);
std::string printf_string(const char* format, double v);
std::string fixed2(double v);  // two decimals, as vLLM's terminal summary prints
std::string coord(double v);   // an SVG coordinate, to a tenth of a pixel
// A tick label with as many decimals as the tick step needs.
std::string tick_label(double v, double step);

// A plot's size and margins, pixels.
constexpr double kWidth = 640, kHeight = 300;
constexpr double kLeft = 64, kRight = 16, kTop = 28, kBottom = 44;
constexpr double kPlotW = kWidth - kLeft - kRight, kPlotH = kHeight - kTop - kBottom;

struct Axis {
  double lo = 0, hi = 1;
  bool log = false;
  std::vector<std::pair<double, std::string>> ticks;  // value, label
  std::string label;

  double fraction(double v) const;  // 0..1 along the axis
};

// About five ticks from `lo` to at least `hi`, ending on one.
Axis linear_axis(double lo, double hi, std::string label);
// Whole decades around [lo, hi] (both > 0).
Axis log_axis(double lo, double hi, std::string label);
double px(const Axis& x, double v);
double py(const Axis& y, double v);

struct Series {
  std::string name;
  std::string color;
  std::vector<std::pair<double, double>> points;
  bool dashed = false;
  // A circle at every point (hollow when dashed), so that a series of one point shows at all.
  bool markers = false;
};

std::string svg_open(const std::string& title);
// Frame, grid, ticks and axis labels; `y` may be null for a plot with category rows.
std::string svg_axes(const Axis& x, const Axis* y);
std::string svg_no_data();
// Series as polylines, and markers where asked (a legend when there are several); "no data"
// when !any_data.
std::string line_plot(const std::string& title, const Axis& x, const Axis& y,
                      const std::vector<Series>& series, bool any_data);

// <section id=ID><h2>HEADING</h2>BODY</section>
std::string section(const std::string& id, const std::string& heading, const std::string& body);
// A whole document: head (charset, CSP, viewport, title, style) and `body` (HTML).
std::string html_page(const std::string& title, const std::string& body);

}  // namespace tandem::bench::html_plot
