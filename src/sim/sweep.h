#pragma once
// The grid of `tandem simulate --sweep`: the engine counts and policies to simulate, each point a
// whole run of the same workload, so that goodput and latency can be read against the P:D ratio
// (how many prefill and decode engines an SLO needs at a rate) or against the policy.
#include <string>
#include <vector>

namespace tandem::sim {

struct SweepPoint {
  int prefill = 0, decode = 1;
  std::string policy;
};

// Every combination of the specs, each "KEY=VALUES" with KEY prefill, decode or policy, varying
// `base` (keys not named keep its value), in the order: prefill, decode, policy. VALUES: a list
// "2,3,5"; "A..B", a doubling range (2..16: 2, 4, 8, 16; B is included when it is reached); or
// "A..B/S", a range in steps of S (4..12/4: 4, 8, 12). Throws tandem::Error naming the spec for an
// unknown key, a key given twice, a bad number, an empty or descending range, or more than 1,000
// points.
std::vector<SweepPoint> sweep_points(const std::vector<std::string>& specs, const SweepPoint& base);

}  // namespace tandem::sim
