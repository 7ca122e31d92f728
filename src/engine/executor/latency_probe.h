#pragma once
// Measures how long an executor takes for a set of representative step shapes (prefill chunks
// with and without cached context, decode batches over short and long contexts), so that a
// simulated-executor latency model can be fitted to real measurements (`tandem sim-fit`).
#include <functional>
#include <vector>

#include "engine/executor/executor.h"
#include "engine/executor/sim_latency.h"

namespace tandem::engine {

struct ProbeOptions {
  std::vector<std::pair<int64_t, int64_t>> prefills = {
      {32, 0}, {128, 0}, {512, 0}, {128, 512}, {64, 1024}};  // (new tokens, cached context)
  std::vector<int64_t> decode_batches = {1, 2, 4, 8, 16};
  std::vector<int64_t> decode_contexts = {128, 1024};
  int repeats = 3;  // the median of this many timed runs, after one warm-up run
};

// Runs every shape that fits the executor's cache and context and returns one sample per shape.
// The cache content is whatever the blocks hold: timing does not depend on it.
std::vector<LatencySample> probe_step_latencies(
    Executor& executor, const ProbeOptions& options = {},
    const std::function<void(const LatencySample&)>& on_sample = {});

}  // namespace tandem::engine
