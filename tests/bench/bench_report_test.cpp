// The HTML report of `tandem bench` (src/bench/report.h): its sections and numbers against the
// summary, escaping of hostile text, the access-log reader's errors, and a render in headless
// Chromium (Debian's `chromium`; the test skips only when that binary is absent) that must log
// no console message at all and keep every section and plot in the parsed DOM.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "bench/metrics.h"
#include "bench/report.h"
#include "bench/sweep_report.h"
#include "util/error.h"
#include "util/headless_chromium.h"

namespace tandem::bench {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

const char kHostile[] = "</script><img src=x onerror=alert(1)>\"'&";

// 20 requests sent every 0.25 s; five failed (three with the hostile error, two alike).
std::vector<RequestResult> sample_results() {
  std::vector<RequestResult> out;
  for (int i = 0; i < 20; ++i) {
    RequestResult r;
    r.start_s = 100 + 0.25 * i;  // any origin
    r.prompt_tokens = 100 + i;
    if (i == 3 || i == 9 || i == 15) {
      r.error = kHostile;
      out.push_back(r);
      continue;
    }
    if (i == 5 || i == 11) {
      r.error = "HTTP 503: overloaded";
      out.push_back(r);
      continue;
    }
    r.success = true;
    r.ttft_s = 0.05 + 0.01 * i;
    r.output_tokens = 1 + (i % 5) * 3;
    r.latency_s = r.ttft_s;
    for (int64_t k = 1; k < r.output_tokens; ++k) {
      r.itl_s.push_back(0.02 + 0.001 * i);
      r.latency_s += r.itl_s.back();
    }
    out.push_back(r);
  }
  return out;
}

BenchSummary sample_summary(const std::vector<RequestResult>& results) {
  double lo = 1e300, hi = -1e300;
  for (const RequestResult& r : results) {
    lo = std::min(lo, r.start_s);
    hi = std::max(hi, r.start_s + r.latency_s);
  }
  MetricsOptions o;
  o.percentiles = {50, 90, 99};
  o.percentile_metrics = {"ttft", "tpot", "itl", "e2el"};
  return summarize(results, hi - lo, o);
}

// Gateway access-log lines (docs/gateway.md): three sequential-mode requests and a 401.
std::vector<std::string> sample_log_lines() {
  return {
      R"({"request_id":"a","status":200,"e2e_seconds":0.5,"phases":{"received":0,"tokenizing":0.001,"prefix_matching":0.002,"prefill_waiting":0.003,"prefill_scheduled":0.004,"prefilling":0.005,"prefill_done":0.015,"decode_waiting":0.016,"decode_scheduled":0.017,"decoding":0.03,"completed":0.5}})",
      R"({"request_id":"b","status":200,"e2e_seconds":0.6,"phases":{"received":0,"tokenizing":0.001,"prefix_matching":0.002,"prefill_waiting":0.003,"prefill_scheduled":0.004,"prefilling":0.005,"prefill_done":0.025,"decode_waiting":0.026,"decode_scheduled":0.027,"decoding":0.04,"completed":0.6}})",
      R"({"request_id":"c","status":200,"e2e_seconds":0.7,"phases":{"received":0,"tokenizing":0.001,"prefix_matching":0.002,"prefill_waiting":0.003,"prefill_scheduled":0.004,"prefilling":0.005,"prefill_done":0.035,"decode_waiting":0.036,"decode_scheduled":0.037,"decoding":0.05,"completed":0.7}})",
      R"({"request_id":"d","status":401,"e2e_seconds":0.0001,"phases":{"received":0,"completed":0.0001}})",
  };
}

std::vector<json> sample_log() {
  std::vector<json> out;
  for (const std::string& l : sample_log_lines()) out.push_back(json::parse(l));
  return out;
}

ReportOptions sample_options() {
  ReportOptions o;
  o.title = std::string("run ") + kHostile;
  o.config = {{"command", "tandem bench --rate 4 --workload random"},
              {"note", kHostile},
              {"model", "tiny-v3"}};
  o.table.request_rate = 4;
  o.access_log = sample_log();
  return o;
}

std::string two_decimals(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

size_t count(const std::string& s, const std::string& needle) {
  size_t n = 0;
  for (size_t at = s.find(needle); at != std::string::npos; at = s.find(needle, at + 1)) ++n;
  return n;
}

// A fresh directory under the system temp directory, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("tandem_report_" + std::to_string(::getpid()) + "_" + info->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
  ASSERT_TRUE(out.good()) << p;
}

TEST(BenchReport, HasEverySectionAndPlot) {
  const auto results = sample_results();
  const std::string html = html_report(sample_summary(results), results, sample_options());
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  for (const char* id : {"config", "summary", "failures", "latency", "timeline", "phases"})
    EXPECT_THAT(html, HasSubstr(std::string("<section id=\"") + id + "\">")) << id;
  for (const char* id :
       {"cdf-ttft", "cdf-tpot", "cdf-itl", "cdf-e2el", "throughput", "concurrency", "phase-boxes"})
    EXPECT_THAT(html, HasSubstr(std::string("<figure id=\"") + id + "\">")) << id;
  EXPECT_EQ(count(html, "<svg "), 7u);
  EXPECT_EQ(count(html, "</svg>"), 7u);
  // 4 CDFs, tokens/s, most and mean in flight.
  EXPECT_EQ(count(html, "<polyline "), 7u);
  EXPECT_THAT(html, Not(HasSubstr("no data")));
  EXPECT_THAT(html, HasSubstr("<code>tandem bench --rate 4 --workload random</code>"));
}

TEST(BenchReport, SummaryTableHoldsExactlyTheResultKeys) {
  const auto results = sample_results();
  const BenchSummary summary = sample_summary(results);
  const std::string html = html_report(summary, results, sample_options());
  const json expected = to_json(summary);
  ASSERT_GT(expected.size(), 20u);
  const std::regex row(
      R"re(<tr data-key="([^"]+)"><th><code>[^<]*</code></th><td data-value="([^"]*)">([^<]*)</td></tr>)re");
  json seen = json::object();
  std::vector<std::string> order;
  for (auto it = std::sregex_iterator(html.begin(), html.end(), row); it != std::sregex_iterator();
       ++it) {
    const std::string key = (*it)[1], value = (*it)[2], shown = (*it)[3];
    ASSERT_TRUE(expected.contains(key)) << key;
    const json v = json::parse(value);
    EXPECT_EQ(v, expected.at(key)) << key;  // exact: the full-precision value is kept
    if (v.is_number_float()) {
      EXPECT_EQ(shown, two_decimals(v.get<double>())) << key;
    }
    if (v.is_number_integer()) {
      EXPECT_EQ(shown, v.dump()) << key;
    }
    if (v.is_null()) {
      EXPECT_EQ(shown, "n/a") << key;
    }
    seen[key] = v;
    order.push_back(key);
  }
  EXPECT_EQ(seen.size(), expected.size());
  EXPECT_EQ(order.size(), expected.size());  // each once
  // vLLM's order: the run first, percentiles ascending.
  ASSERT_GE(order.size(), 3u);
  EXPECT_EQ(order[0], "duration");
  EXPECT_EQ(order[1], "completed");
  const auto pos = [&](const std::string& k) { return std::find(order.begin(), order.end(), k); };
  EXPECT_LT(pos("mean_ttft_ms"), pos("p50_ttft_ms"));
  EXPECT_LT(pos("p50_ttft_ms"), pos("p90_ttft_ms"));
  EXPECT_LT(pos("p90_ttft_ms"), pos("p99_ttft_ms"));
  EXPECT_LT(pos("p99_ttft_ms"), pos("mean_tpot_ms"));
  // vLLM's terminal table, configured rate included.
  EXPECT_THAT(html, HasSubstr("============ Serving Benchmark Result ============"));
  EXPECT_THAT(html, HasSubstr("Request rate configured (RPS):"));
}

// The timeline's captions: the summary's busiest second and peak concurrency.
void expect_timeline_captions(const std::string& html, const BenchSummary& summary) {
  EXPECT_THAT(html,
              HasSubstr("busiest second <span class=\"stat\">" +
                        std::to_string(static_cast<int64_t>(summary.max_output_tokens_per_s)) +
                        "</span> tokens"));
  EXPECT_THAT(html, HasSubstr("at most <span class=\"stat\">" +
                              std::to_string(summary.max_concurrent_requests) + "</span> at once"));
}

TEST(BenchReport, PlotsAgreeWithTheSummary) {
  const auto results = sample_results();
  const BenchSummary summary = sample_summary(results);
  ASSERT_EQ(summary.completed, 15);
  const std::string html = html_report(summary, results, sample_options());
  // The busiest second and the peak concurrency come from the same buckets and sweep as
  // summarize(), so they must agree exactly.
  expect_timeline_captions(html, summary);
  const auto caption = [&](const char* id, const MetricStats& m, size_t n) {
    const size_t at = html.find(std::string("<figure id=\"") + id + "\">");
    EXPECT_NE(at, std::string::npos) << id;
    const std::string fig = html.substr(at, html.find("</figure>", at) - at);
    EXPECT_THAT(fig, HasSubstr(std::to_string(n) + " values; mean <span class=\"stat\">" +
                               two_decimals(m.mean_ms) +
                               "</span> ms, median <span "
                               "class=\"stat\">" +
                               two_decimals(m.median_ms) + "</span> ms"))
        << id;
    for (const auto& [p, v] : m.percentiles_ms)
      EXPECT_THAT(fig, HasSubstr("<span class=\"stat\">" + two_decimals(v) + "</span> ms")) << id;
  };
  size_t tpots = 0, itls = 0;
  for (const RequestResult& r : results) {
    if (!r.success) continue;
    tpots += r.output_tokens > 1;
    itls += r.itl_s.size();
  }
  caption("cdf-ttft", summary.ttft, 15);
  caption("cdf-tpot", summary.tpot, tpots);
  caption("cdf-itl", summary.itl, itls);
  caption("cdf-e2el", summary.e2el, 15);
}

// A run of a million seconds (a week-long trace) is drawn in at most 2000 windows per series:
// its 1 s buckets made tens of megabytes of SVG. The captions keep the summary's busiest second
// and peak concurrency, which a window's highest point still shows.
TEST(BenchReport, ALongRunsTimelineStaysSmallAndKeepsItsPeaks) {
  std::vector<RequestResult> results;
  for (int i = 0; i < 40; ++i) {
    RequestResult r;
    r.success = true;
    r.start_s = i < 20 ? 10.0 * i : 1e6 - 10.0 * i;  // two bursts a million seconds apart
    r.prompt_tokens = 10;
    r.ttft_s = 0.1;
    r.output_tokens = 1 + i % 7;
    r.latency_s = r.ttft_s;
    for (int64_t k = 1; k < r.output_tokens; ++k) {
      r.itl_s.push_back(0.01);
      r.latency_s += 0.01;
    }
    results.push_back(r);
  }
  const BenchSummary summary = sample_summary(results);
  const std::string html = html_report(summary, results, sample_options());
  EXPECT_LT(html.size(), 2'000'000u);
  expect_timeline_captions(html, summary);
}

// Memory follows the requests, not the time they span: two requests 10^12 s apart (past the
// 10^9 s a trace may span, so that a value per second of the run could not even be allocated
// and the test fails at once rather than swapping) are summarized and drawn like two requests
// a second apart. A value per second took 868 MB for two records 10^8 s apart.
TEST(BenchReport, TwoRequestsFarApartNeedNoMemoryForTheSecondsBetween) {
  std::vector<RequestResult> results;
  for (double start : {5.0, 5.0 + 1e12}) {
    RequestResult r;
    r.success = true;
    r.start_s = start;
    r.prompt_tokens = 10;
    r.ttft_s = 0.25;
    r.output_tokens = 4;
    r.itl_s = {0.125, 0.125, 0.125};
    r.latency_s = 0.625;
    results.push_back(r);
  }
  const BenchSummary summary = sample_summary(results);
  EXPECT_DOUBLE_EQ(summary.max_output_tokens_per_s, 4);  // each request's four, in its second
  EXPECT_EQ(summary.max_concurrent_requests, 1);
  const Timeline t = timeline(results);
  EXPECT_EQ(t.seconds, 1'000'000'000'001 + 1);
  ASSERT_EQ(t.busy_seconds.size(), 2u);
  EXPECT_EQ(t.busy_seconds[0], (std::pair<int64_t, int64_t>(0, 4)));
  EXPECT_EQ(t.busy_seconds[1].second, 4);
  const std::string html = html_report(summary, results, sample_options());
  EXPECT_LT(html.size(), 2'000'000u);
  expect_timeline_captions(html, summary);
}

TEST(BenchReport, EscapesEveryTextAndFetchesNothing) {
  const auto results = sample_results();
  const std::string html = html_report(sample_summary(results), results, sample_options());
  // (find, not HasSubstr: a failure should not print the whole document.)
  for (const char* s : {"<script", "</script", "<img", "\"'&<"})
    EXPECT_EQ(html.find(s), std::string::npos) << s;
  const std::string escaped = "&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;&#34;&#39;&amp;";
  // Title twice (<title>, <h1>), the config value, the grouped error.
  EXPECT_EQ(count(html, escaped), 4u);
  // Self-contained: nothing that could fetch.
  for (const char* s : {"http:", "https:", "src=\"", "href=", "url(", "@import", "<link"})
    EXPECT_EQ(html.find(s), std::string::npos) << s;
  EXPECT_THAT(html, HasSubstr("Content-Security-Policy\" content=\"default-src 'none'"));

  // Ill-formed UTF-8 in an error becomes U+FFFD rather than reaching the page raw.
  std::vector<RequestResult> bad = results;
  bad[3].error = std::string("bad \xff\xfe bytes");
  const std::string h2 = html_report(sample_summary(bad), bad, {});
  EXPECT_THAT(h2, HasSubstr("bad \xEF\xBF\xBD\xEF\xBF\xBD bytes"));
  EXPECT_THAT(h2, Not(HasSubstr("\xff")));
}

TEST(BenchReport, GroupsFailuresByError) {
  const auto results = sample_results();
  const std::string html = html_report(sample_summary(results), results, {});
  EXPECT_THAT(html, HasSubstr("5 of 20 requests failed, with 2 distinct errors."));
  const size_t a = html.find("<td class=\"num\">3</td><td class=\"error\">&lt;/script&gt;");
  const size_t b = html.find("<td class=\"num\">2</td><td class=\"error\">HTTP 503: overloaded");
  ASSERT_NE(a, std::string::npos);
  ASSERT_NE(b, std::string::npos);
  EXPECT_LT(a, b);  // most frequent first

  std::vector<RequestResult> ok = results;
  for (RequestResult& r : ok) {
    if (r.success) continue;
    r.success = true;
    r.error.clear();
    r.ttft_s = r.latency_s = 0.1;
    r.output_tokens = 1;
  }
  EXPECT_THAT(html_report(sample_summary(ok), ok, {}), HasSubstr("No request failed."));
}

TEST(BenchReport, PhaseBreakdownFollowsTheGatewayRules) {
  const auto results = sample_results();
  const std::string html = html_report(sample_summary(results), results, sample_options());
  EXPECT_THAT(html, HasSubstr("4 access-log entries; status 200: 3, 401: 1."));
  const auto phase_row = [&](const std::string& phase) {
    const size_t at = html.find("<tr data-phase=\"" + phase + "\">");
    EXPECT_NE(at, std::string::npos) << phase;
    if (at == std::string::npos) return std::string();
    return html.substr(at, html.find("</tr>", at) - at);
  };
  // prefilling ends at prefill_done: 10, 20, 30 ms.
  EXPECT_THAT(phase_row("prefilling"),
              HasSubstr("<td class=\"num\">3</td><td class=\"num\">20.00</td><td "
                        "class=\"num\">20.00</td><td class=\"num\">28.00</td><td "
                        "class=\"num\">29.80</td><td class=\"num\">30.00</td>"));
  // decoding ends at completed: 470, 560, 650 ms.
  EXPECT_THAT(phase_row("decoding"), HasSubstr("<td class=\"num\">3</td><td "
                                               "class=\"num\">560.00</td><td "
                                               "class=\"num\">560.00</td>"));
  // received ends at tokenizing: the 401 has no tokenizing stamp, so three, not four.
  EXPECT_THAT(phase_row("received"), HasSubstr("<td class=\"num\">3</td><td class=\"num\">1.00"));
  // e2e_seconds of all four.
  EXPECT_THAT(phase_row("e2e (received to completed)"), HasSubstr("<td class=\"num\">4</td>"));
  EXPECT_EQ(count(html, "<g class=\"box\""), 10u);  // nine phases plus e2e

  // Without a log there is a note instead.
  ReportOptions none = sample_options();
  none.access_log.clear();
  const std::string h2 = html_report(sample_summary(results), results, none);
  EXPECT_THAT(h2, HasSubstr("No gateway access log was given"));
  EXPECT_THAT(h2, Not(HasSubstr("phase-boxes")));

  // An entry without phases is an error naming it.
  ReportOptions bad = sample_options();
  bad.access_log.push_back(json{{"request_id", "x"}});
  try {
    html_report(sample_summary(results), results, bad);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("access log entry 5: has no \"phases\""));
  }
  // So is an entry given in memory whose span overflows, or that holds an infinity.
  const auto expect_refused = [&](const json& entry, const std::string& what) {
    ReportOptions o = sample_options();
    o.access_log.push_back(entry);
    try {
      html_report(sample_summary(results), results, o);
      ADD_FAILURE() << "expected an error for " << entry.dump();
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("access log entry 5: " + what));
    }
  };
  expect_refused(json::parse(R"({"phases":{"decoding":-1e308,"completed":1e308}})"),
                 "phase \"decoding\" to \"completed\" is not a finite number of milliseconds");
  expect_refused(json{{"phases", {{"received", INFINITY}}}},
                 "phase \"received\" must be a finite number of seconds");
}

TEST(BenchReport, RendersWithoutAnyCompletedRequest) {
  std::vector<RequestResult> results(3);
  for (RequestResult& r : results) r.error = "connection refused";
  const BenchSummary summary = summarize(results, 1.0);
  const std::string html = html_report(summary, results, {});
  EXPECT_EQ(count(html, "no data"), 6u);  // four CDFs, two timelines
  EXPECT_THAT(html, HasSubstr("3 of 3 requests failed, with 1 distinct errors."));
  EXPECT_EQ(count(html, "<svg "), 6u);
}

TEST(BenchReport, ReadsTheAccessLogAndNamesABadLine) {
  TempDir dir;
  const auto path = dir.path() / "access.jsonl";
  const auto lines = sample_log_lines();
  std::string text;
  for (const std::string& l : lines) text += l + "\n";
  write_text(path, text);
  const std::vector<json> log = read_access_log(path);
  ASSERT_EQ(log.size(), lines.size());
  EXPECT_EQ(log[1].at("request_id"), "b");
  EXPECT_EQ(log[3].at("status"), 401);

  const auto expect_error = [&](const std::string& content, const std::string& what) {
    write_text(path, content);
    try {
      read_access_log(path);
      ADD_FAILURE() << "expected an error for: " << content;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(path.string() + ":3: " + what)) << content;
    }
  };
  expect_error(lines[0] + "\n" + lines[1] + "\n{\"phases\": {\"received\": 0\n" + lines[2] + "\n",
               "not a JSON line");
  expect_error(lines[0] + "\n" + lines[1] + "\n\n" + lines[2] + "\n", "not a JSON line");
  expect_error(lines[0] + "\n" + lines[1] + "\n[1, 2]\n", "expected a JSON object");
  expect_error(lines[0] + "\n" + lines[1] + "\n{\"status\": 200}\n", "has no \"phases\"");
  expect_error(lines[0] + "\n" + lines[1] + "\n{\"phases\": {\"received\": \"0\"}}\n",
               "phase \"received\" must be a number");
  // Numbers whose times or spans in ms are not finite put "-nan" and "inf" into the plot.
  expect_error(lines[0] + "\n" + lines[1] +
                   "\n{\"phases\": {\"received\": -1e308, \"tokenizing\": 1e308}}\n",
               "phase \"received\" to \"tokenizing\" is not a finite number of milliseconds");
  // nlohmann refuses a number past a double's range as it parses (out_of_range, not parse_error).
  expect_error(
      lines[0] + "\n" + lines[1] + "\n{\"phases\": {\"received\": 1e400}}\n",
      "not a JSON line ([json.exception.out_of_range.406] number overflow parsing '1e400')");
  expect_error(
      lines[0] + "\n" + lines[1] + "\n{\"e2e_seconds\": 1e307, \"phases\": {\"received\": 0}}\n",
      "\"e2e_seconds\" is not a finite number of milliseconds");
  EXPECT_THROW(read_access_log(dir.path() / "missing.jsonl"), Error);
  // A directory: the stream library's "basic_filebuf::underflow" named nothing.
  try {
    read_access_log(dir.path());
    ADD_FAILURE() << "a directory was read as an access log";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(dir.path().string() + ": is a directory, not a file"));
  }
}

// --- Headless Chromium ---------------------------------------------------------------------

using testing::find_chromium;

// Opens `page` in headless Chromium (tests/util/headless_chromium.h).
testing::ChromiumRender render(const std::string& chromium, const std::filesystem::path& page,
                               const std::filesystem::path& work) {
  return testing::render_in_chromium(chromium, "file://" + page.string(), work);
}

TEST(BenchReportChromium, RendersWithoutConsoleMessages) {
  const std::string chromium = find_chromium();
  if (chromium.empty())
    GTEST_SKIP() << "no `chromium` on PATH (Debian package chromium, scripts/install-deps.sh "
                    "installs it); the headless render check did not run";
  TempDir dir;

  // The oracle can fail: a page with a script error is caught.
  const auto broken = dir.path() / "broken.html";
  write_text(broken,
             "<!DOCTYPE html><html><head><meta charset=\"utf-8\"></head><body><p>x</p>"
             "<script>throw new Error(\"report-test-canary\");</script></body></html>");
  const auto control = render(chromium, broken, dir.path());
  ASSERT_EQ(control.status, 0) << control.stderr_text;
  ASSERT_FALSE(control.console.empty()) << control.stderr_text;
  EXPECT_THAT(control.console[0], HasSubstr("report-test-canary"));

  const auto results = sample_results();
  const std::string html = html_report(sample_summary(results), results, sample_options());
  const auto page = dir.path() / "report.html";
  write_text(page, html);
  const auto r = render(chromium, page, dir.path());
  ASSERT_EQ(r.status, 0) << r.stderr_text;
  EXPECT_TRUE(r.console.empty()) << ::testing::PrintToString(r.console);

  // The parsed document keeps every section, figure and plot element: nothing was swallowed by
  // a stray tag, and the hostile error stayed text.
  EXPECT_EQ(count(r.dom, "<section id="), 6u) << r.dom.substr(0, 2000);
  EXPECT_EQ(count(r.dom, "<svg "), count(html, "<svg "));
  EXPECT_EQ(count(r.dom, "<polyline "), count(html, "<polyline "));
  EXPECT_EQ(count(r.dom, "<g class=\"box\""), 10u);
  for (const char* id :
       {"cdf-ttft", "cdf-tpot", "cdf-itl", "cdf-e2el", "throughput", "concurrency", "phase-boxes"})
    EXPECT_THAT(r.dom, HasSubstr(std::string("<figure id=\"") + id + "\">")) << id;
  EXPECT_THAT(r.dom, Not(HasSubstr("<img")));
  EXPECT_THAT(r.dom, Not(HasSubstr("<script")));
  EXPECT_THAT(r.dom, HasSubstr("&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;"));
  EXPECT_THAT(r.dom, HasSubstr("data-key=\"max_concurrent_requests\""));
}

// A 3 x 2 P:D grid under two policies (one named with hostile text).
std::vector<SweepRow> sample_sweep() {
  std::vector<SweepRow> rows;
  for (const std::string& policy : {std::string("tandem"), std::string(kHostile)})
    for (int decode : {2, 4})
      for (int prefill : {2, 4, 8}) {
        SweepRow r;
        r.prefill = prefill;
        r.decode = decode;
        r.policy = policy;
        r.goodput = 0.1 * prefill;
        r.request_rate = 1.2;
        r.ttft_p50 = 1000.0 / prefill, r.ttft_p90 = 3000.0 / prefill, r.ttft_p99 = 9000.0 / prefill;
        r.tpot_p50 = 25 + decode, r.tpot_p99 = 30 + decode;
        r.hit_rate = 0.2;
        rows.push_back(r);
      }
  return rows;
}

TEST(SweepReport, PlotsEveryLineAgainstTheRatioAndTablesEveryPoint) {
  const std::string html = sweep_report(sample_sweep(), "sweep", {{"model", "sim:x"}});
  EXPECT_EQ(count(html, "<svg "), 4u);  // goodput, TTFT, TPOT, hit rate
  // Four lines (2 policies x 2 decode counts) in the single-metric plots, eight in the pairs.
  EXPECT_EQ(count(html, "<polyline "), 4u + 8u + 8u + 4u);
  EXPECT_EQ(count(html, "<circle class=\"point\""), 12u * 6);  // a marker at every point
  EXPECT_THAT(html, HasSubstr(">prefill : decode engines</text>"));
  EXPECT_EQ(count(html, "<tr><td>"), 12u);
  EXPECT_THAT(html, HasSubstr("<td>0.50</td>"));  // P:D of 2 prefill : 4 decode
  EXPECT_THAT(html, Not(HasSubstr(kHostile)));
  EXPECT_THAT(html, HasSubstr("Content-Security-Policy"));
  EXPECT_THAT(html, Not(HasSubstr("<script")));
}

// Without an SLO a sweep has no goodput (null in its JSON): the table says n/a and the goodput
// plot is left out, where a line at 0 read as no request meeting the SLOs.
TEST(SweepReport, WithoutAnSloTheGoodputIsNotApplicableNotZero) {
  std::vector<SweepRow> rows = sample_sweep();
  for (SweepRow& r : rows) r.goodput.reset();
  const std::string html = sweep_report(rows, "sweep", {});
  EXPECT_EQ(count(html, "<svg "), 3u);  // TTFT, TPOT, hit rate
  EXPECT_THAT(html, Not(HasSubstr("Goodput (requests meeting every SLO)")));
  EXPECT_THAT(html, HasSubstr("No goodput SLO was given"));
  EXPECT_EQ(count(html, "<td>n/a</td>"), 12u);
  EXPECT_THAT(html, Not(HasSubstr("<td>0.000</td>")));
}

// The x coordinates of the markers in the report's first plot (goodput), in order.
std::vector<std::string> first_plot_marker_xs(const std::string& html) {
  const std::string plot = html.substr(0, html.find("</svg>"));
  std::vector<std::string> xs;
  const std::regex cx("<circle class=\"point\" cx=\"([0-9.]+)\"");
  for (auto it = std::sregex_iterator(plot.begin(), plot.end(), cx); it != std::sregex_iterator();
       ++it)
    xs.push_back((*it)[1]);
  return xs;
}

// A one-point line draws nothing as a polyline: sweeping only the decode count (or running
// aggregated, prefill always 0) left every plot empty. Without a prefill sweep the decode count
// is the x axis, one line per policy, and every point has a marker.
TEST(SweepReport, WithOnePrefillCountThePlotsRunAgainstTheDecodeCount) {
  for (int prefill : {2, 0}) {  // parallel mode, and aggregated (no prefill engines)
    std::vector<SweepRow> rows;
    for (int decode : {1, 2, 3, 4}) {
      SweepRow r;
      r.prefill = prefill, r.decode = decode, r.policy = "tandem", r.goodput = 0.5 * decode;
      r.ttft_p50 = 100, r.ttft_p99 = 200, r.tpot_p50 = 10, r.tpot_p99 = 20;
      rows.push_back(r);
    }
    const std::string html = sweep_report(rows, "sweep", {});
    EXPECT_EQ(count(html, "<circle class=\"point\""), 4u * 6) << prefill;
    EXPECT_THAT(html, HasSubstr(">decode engines</text>")) << prefill;
    EXPECT_THAT(html, Not(HasSubstr("prefill : decode engines"))) << prefill;
    const std::vector<std::string> xs = first_plot_marker_xs(html);
    ASSERT_EQ(xs.size(), 4u) << prefill;
    for (size_t i = 1; i < xs.size(); ++i) EXPECT_LT(std::stod(xs[i - 1]), std::stod(xs[i]));
  }
}

// With one engine count and several policies, each policy is a point of its own along the x axis.
TEST(SweepReport, WithOneEngineCountEachPolicyIsAMarkedPointOfItsOwn) {
  std::vector<SweepRow> rows;
  for (const std::string& policy : {std::string("round_robin"), std::string(kHostile)}) {
    SweepRow r;
    r.prefill = 2, r.decode = 2, r.policy = policy, r.goodput = 1;
    rows.push_back(r);
  }
  const std::string html = sweep_report(rows, "sweep", {});
  EXPECT_EQ(count(html, "<circle class=\"point\""), 2u * 6);
  EXPECT_THAT(html, HasSubstr(">policy</text>"));
  EXPECT_THAT(html, HasSubstr(">round_robin</text>"));  // a tick per policy
  EXPECT_THAT(html, Not(HasSubstr(kHostile)));
  const std::vector<std::string> xs = first_plot_marker_xs(html);
  ASSERT_EQ(xs.size(), 2u);
  EXPECT_NE(xs[0], xs[1]);
}

TEST(SweepReport, RendersWithoutAPoint) {
  const std::string html = sweep_report({}, "empty", {});
  EXPECT_EQ(count(html, "no data"), 4u);
}

TEST(BenchReportChromium, TheSweepReportRendersWithoutConsoleMessages) {
  const std::string chromium = find_chromium();
  if (chromium.empty()) GTEST_SKIP() << "no `chromium` on PATH; the render check did not run";
  TempDir dir;
  const std::string html = sweep_report(sample_sweep(), "sweep", {{"model", "sim:x"}});
  const auto page = dir.path() / "sweep.html";
  write_text(page, html);
  const auto r = render(chromium, page, dir.path());
  ASSERT_EQ(r.status, 0) << r.stderr_text;
  EXPECT_TRUE(r.console.empty()) << ::testing::PrintToString(r.console);
  EXPECT_EQ(count(r.dom, "<polyline "), count(html, "<polyline "));
  EXPECT_EQ(count(r.dom, "<section id="), 3u);
  EXPECT_THAT(r.dom, Not(HasSubstr("<img")));
}

}  // namespace
}  // namespace tandem::bench
