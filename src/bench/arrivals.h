#pragma once
// Arrival times (seconds from the start of a run) for the requests of a workload: vLLM's
// Poisson / gamma process of `vllm bench serve --request-rate R --burstiness K`, and trace
// timestamps replayed at a chosen speed.
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "bench/workload.h"

namespace tandem::bench {

struct ArrivalOptions {
  // Requests per second; infinity sends every request at time 0.
  double request_rate = std::numeric_limits<double>::infinity();
  // Gamma shape k of the inter-arrival gaps (mean 1/rate, scale 1/(rate*k)): k = 1 is a Poisson
  // process, k < 1 burstier, k > 1 more regular, infinity a constant gap of 1/rate.
  double burstiness = 1.0;
  // As vLLM: the cumulative times are rescaled so the last request is sent at exactly
  // n / request_rate (the run's mean rate is then the requested one, whatever the draws).
  bool rescale_to_rate = true;
  uint64_t seed = 0;
};

// Arrival times of n requests, non-decreasing. As in vLLM the first request also waits one
// drawn gap. Throws tandem::Error for a rate or burstiness that is not > 0.
std::vector<double> rate_arrivals(size_t n, const ArrivalOptions& options);

// The requests' own arrival_s (trace timestamps) times time_scale (>= 0; 0.5 = twice as fast).
std::vector<double> trace_arrivals(std::span<const BenchRequest> requests, double time_scale);

// Sets requests[i].arrival_s = arrivals[i]; the sizes must agree.
void apply_arrivals(std::vector<BenchRequest>& requests, std::span<const double> arrivals);

}  // namespace tandem::bench
