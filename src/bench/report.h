#pragma once
// The HTML report of `tandem bench`: one self-contained file (inline CSS and SVG, no scripts,
// no fonts, no network fetches; a Content-Security-Policy forbids them) that opens in any
// browser straight from disk. It holds the run's configuration, vLLM's result metrics, the
// failed requests grouped by error, latency CDFs, output throughput and requests in flight over
// time, and, given the gateway's access log, the time spent in each gateway phase.
#include <filesystem>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/metrics.h"

namespace tandem::bench {

struct ReportOptions {
  std::string title = "tandem bench";
  // The command line and configuration, shown as given, in this order.
  std::vector<std::pair<std::string, std::string>> config;
  // For the optional rows of vLLM's terminal summary, which the report repeats.
  TableContext table;
  // Parsed lines of the gateway's access log (read_access_log); empty: no phase breakdown.
  std::vector<nlohmann::json> access_log;
};

// The report as one HTML document. Throws tandem::Error when an access-log entry fails
// read_access_log's checks (naming the entry, 1-based).
std::string html_report(const BenchSummary& summary, std::span<const RequestResult> results,
                        const ReportOptions& options = {});

// The gateway's access log (docs/gateway.md, "Request lifecycle"): one JSON object per line.
// Throws tandem::Error naming the file and the 1-based line for a line that is not a JSON
// object, including an empty line, whose "phases" is missing or not an object of finite numbers,
// or where a phase's time or e2e_seconds in ms is not finite.
std::vector<nlohmann::json> read_access_log(const std::filesystem::path& path);

}  // namespace tandem::bench
