#pragma once
// Expert load statistics: tokens routed per (MoE layer, logical expert), over a sliding window of
// recent steps and since start. What Omni Placement plans from (GET /expert_load, the
// tandem:expert_load_imbalance gauges, --expert-load-dump).
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <span>
#include <vector>

#include <nlohmann/json.hpp>

namespace tandem::engine {

struct ExpertLoadSnapshot {
  std::vector<int64_t> layer_ids;  // model layer index of each row
  int64_t experts = 0;
  uint64_t steps = 0;         // steps recorded since start
  uint64_t window_steps = 0;  // the last steps the window covers (at most the configured window)
  std::vector<int64_t> window, cumulative;  // [layers, experts], row-major

  // Per layer, the busiest expert's window count over the mean (1 when the layer saw none).
  std::vector<double> window_imbalance() const;
  nlohmann::json to_json() const;
  // `stem`.npy ([layers, experts] int64: the window counts, or the cumulative ones) and
  // `stem`.json, each written atomically. The .json is to_json() for the window; for the
  // cumulative counts it has "kind": "cumulative" and no window fields (window, window_steps,
  // imbalance), so that both files of the pair give a planner the same loads.
  void write(const std::filesystem::path& stem, bool cumulative_npy = false) const;
};

class ExpertLoadStats {
 public:
  // The window is kept as kBuckets buckets of window_steps / kBuckets steps (rounded up, so
  // window_steps() may exceed what was asked); it covers between 7/8 of window_steps() and all
  // of it, and exactly window_steps() right after every multiple of it.
  static constexpr int kBuckets = 8;
  ExpertLoadStats(std::vector<int64_t> layer_ids, int64_t experts, int64_t window_steps);

  // One step's routes, [layers, experts]; called by one thread (the engine's).
  void record(std::span<const int64_t> step);
  // Any thread.
  ExpertLoadSnapshot snapshot() const;
  int64_t window_steps() const { return bucket_steps_ * kBuckets; }

 private:
  const std::vector<int64_t> layer_ids_;
  const int64_t experts_;
  const int64_t bucket_steps_;
  mutable std::mutex mutex_;
  std::vector<std::vector<int64_t>> buckets_;  // ring; current_ is being filled
  std::vector<int64_t> bucket_fill_;           // steps in each bucket
  int current_ = 0;
  uint64_t steps_ = 0;
  std::vector<int64_t> cumulative_;
};

}  // namespace tandem::engine
