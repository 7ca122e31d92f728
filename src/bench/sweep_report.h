#pragma once
// The HTML report of a grid of runs (`tandem simulate --sweep`): the question operators ask, how
// many prefill and decode engines for an SLO at a rate, answered as plots of goodput and of
// TTFT and TPOT percentiles against the P:D ratio (one line per policy and decode count), and
// the grid's table. A grid of one prefill count (sweeping decode alone, or aggregated mode) is
// plotted against the decode count, one line per policy, and a grid of one engine count against
// the policy; every point has a marker. Self-contained like tandem bench's report
// (bench/html_plot.h).
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tandem::bench {

struct SweepRow {
  int prefill = 0, decode = 0;
  std::string policy;
  std::optional<double> goodput;  // req/s; none without an SLO (vLLM's null request_goodput)
  double request_rate = 0;        // req/s
  double ttft_p50 = 0, ttft_p90 = 0, ttft_p99 = 0, tpot_p50 = 0, tpot_p99 = 0;  // ms
  double hit_rate = 0;                                                          // 0..1
};

// `config`: the command's settings, shown as given.
std::string sweep_report(const std::vector<SweepRow>& rows, const std::string& title,
                         const std::vector<std::pair<std::string, std::string>>& config);

}  // namespace tandem::bench
