#include "bench/arrivals.h"

#include <cmath>
#include <string>

#include "bench/rng.h"
#include "util/error.h"

namespace tandem::bench {

std::vector<double> rate_arrivals(size_t n, const ArrivalOptions& o) {
  if (!(o.request_rate > 0)) {
    throw Error("arrivals: request rate must be > 0 (or inf), got " +
                std::to_string(o.request_rate));
  }
  if (!(o.burstiness > 0)) {
    throw Error("arrivals: burstiness must be > 0 (or inf), got " + std::to_string(o.burstiness));
  }
  std::vector<double> t(n, 0.0);
  if (n == 0 || std::isinf(o.request_rate)) return t;
  Rng rng(o.seed);
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    const double gap = std::isinf(o.burstiness)
                           ? 1.0 / o.request_rate
                           : rng.gamma(o.burstiness, 1.0 / (o.request_rate * o.burstiness));
    sum += gap;
    t[i] = sum;
  }
  if (o.rescale_to_rate && sum > 0) {
    const double factor = (static_cast<double>(n) / o.request_rate) / sum;
    for (double& x : t) x *= factor;
  }
  return t;
}

std::vector<double> trace_arrivals(std::span<const BenchRequest> requests, double time_scale) {
  if (!(std::isfinite(time_scale) && time_scale >= 0)) {
    throw Error("arrivals: time scale must be a finite number >= 0, got " +
                std::to_string(time_scale));
  }
  std::vector<double> t;
  t.reserve(requests.size());
  for (const BenchRequest& r : requests) t.push_back(r.arrival_s * time_scale);
  return t;
}

void apply_arrivals(std::vector<BenchRequest>& requests, std::span<const double> arrivals) {
  if (arrivals.size() != requests.size()) {
    throw Error("arrivals: " + std::to_string(arrivals.size()) + " arrival times for " +
                std::to_string(requests.size()) + " requests");
  }
  for (size_t i = 0; i < requests.size(); ++i) requests[i].arrival_s = arrivals[i];
}

}  // namespace tandem::bench
