#include "engine/expert_load.h"

#include <algorithm>

#include "util/error.h"
#include "util/file.h"
#include "util/npy.h"

namespace tandem::engine {

std::vector<double> ExpertLoadSnapshot::window_imbalance() const {
  std::vector<double> out;
  for (size_t l = 0; l < layer_ids.size(); ++l) {
    const int64_t* row = window.data() + l * experts;
    int64_t total = 0, top = 0;
    for (int64_t e = 0; e < experts; ++e) total += row[e], top = std::max(top, row[e]);
    out.push_back(total > 0 ? double(top) * double(experts) / double(total) : 1.0);
  }
  return out;
}

nlohmann::json ExpertLoadSnapshot::to_json() const {
  const auto rows = [&](const std::vector<int64_t>& v) {
    nlohmann::json out = nlohmann::json::array();
    for (size_t l = 0; l < layer_ids.size(); ++l)
      out.push_back(std::vector<int64_t>(v.begin() + l * experts, v.begin() + (l + 1) * experts));
    return out;
  };
  return {{"layers", layer_ids.size()},   {"experts", experts},
          {"layer_ids", layer_ids},       {"steps", steps},
          {"window_steps", window_steps}, {"imbalance", window_imbalance()},
          {"window", rows(window)},       {"cumulative", rows(cumulative)}};
}

void ExpertLoadSnapshot::write(const std::filesystem::path& stem, bool cumulative_npy) const {
  std::filesystem::path npy = stem, json = stem;
  npy += ".npy";
  json += ".json";
  write_npy(npy, {int64_t(layer_ids.size()), experts}, cumulative_npy ? cumulative : window);
  nlohmann::json j = to_json();
  if (cumulative_npy) {
    // The .json says what the .npy holds: a reader that plans from "window" when it is there
    // (as for /expert_load) would otherwise take the last window from the cumulative dump.
    j["kind"] = "cumulative";
    for (const char* windowed : {"window", "window_steps", "imbalance"}) j.erase(windowed);
  }
  write_file_atomically(json, j.dump() + "\n");
}

ExpertLoadStats::ExpertLoadStats(std::vector<int64_t> layer_ids, int64_t experts,
                                 int64_t window_steps)
    : layer_ids_(std::move(layer_ids)),
      experts_(experts),
      bucket_steps_(std::max<int64_t>(1, (window_steps + kBuckets - 1) / kBuckets)),
      buckets_(kBuckets, std::vector<int64_t>(layer_ids_.size() * experts, 0)),
      bucket_fill_(kBuckets, 0),
      cumulative_(layer_ids_.size() * experts, 0) {
  if (window_steps < 1) throw Error("--expert-load-window must be at least 1 step");
}

void ExpertLoadStats::record(std::span<const int64_t> step) {
  if (step.size() != cumulative_.size()) return;  // an executor without routing this step
  std::lock_guard lock(mutex_);
  // Advance only when the next step arrives, so right after every window_steps() steps the
  // window holds exactly the last window_steps() of them.
  if (bucket_fill_[current_] == bucket_steps_) {
    current_ = (current_ + 1) % kBuckets;
    std::fill(buckets_[current_].begin(), buckets_[current_].end(), 0);
    bucket_fill_[current_] = 0;
  }
  std::vector<int64_t>& bucket = buckets_[current_];
  for (size_t i = 0; i < step.size(); ++i) {
    bucket[i] += step[i];
    cumulative_[i] += step[i];
  }
  ++bucket_fill_[current_];
  ++steps_;
}

ExpertLoadSnapshot ExpertLoadStats::snapshot() const {
  std::lock_guard lock(mutex_);
  ExpertLoadSnapshot s{layer_ids_, experts_, steps_, 0, std::vector<int64_t>(cumulative_.size(), 0),
                       cumulative_};
  for (int b = 0; b < kBuckets; ++b) {
    s.window_steps += uint64_t(bucket_fill_[b]);
    for (size_t i = 0; i < s.window.size(); ++i) s.window[i] += buckets_[b][i];
  }
  return s;
}

}  // namespace tandem::engine
