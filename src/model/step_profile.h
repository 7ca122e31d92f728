#pragma once
// Where a forward step's time goes, by part of the model: filled by DeepSeekModel when a
// profile is attached (benchmarks; the clock is read only then). Parts are wall time on the
// calling thread, so a part's parallel regions count with their thread start-up and imbalance.
#include <array>
#include <chrono>
#include <cstddef>

namespace tandem::model {

enum class StepPart {
  kAttentionProjections,  // q (LoRA), kv_a, latent norm and RoPE into the cache, o
  kAttentionCore,         // absorbed or expanded attention over the cache, W_UK / W_UV
  kRouting,               // router product and top-k
  kRoutedExperts,         // the routed experts and their weighted sum
  kSharedExperts,
  kDenseMlp,
  kLmHead,  // final norm and LM head
  kCount
};

struct StepProfile {
  std::array<double, static_cast<size_t>(StepPart::kCount)> seconds{};
  double& operator[](StepPart p) { return seconds[static_cast<size_t>(p)]; }
  double total() const {
    double t = 0;
    for (double s : seconds) t += s;
    return t;
  }
  static const char* name(StepPart p) {
    static constexpr const char* kNames[] = {
        "attention projections", "attention core", "routing", "routed experts",
        "shared experts",        "dense MLP",      "LM head"};
    static_assert(std::size(kNames) == static_cast<size_t>(StepPart::kCount));
    return kNames[static_cast<size_t>(p)];
  }
};

// Adds the time from construction to destruction to one part of a profile (none: no clock read).
class PartTimer {
 public:
  PartTimer(StepProfile* profile, StepPart part) : profile_(profile), part_(part) {
    if (profile_) start_ = std::chrono::steady_clock::now();
  }
  ~PartTimer() {
    if (profile_)
      (*profile_)[part_] +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  PartTimer(const PartTimer&) = delete;
  PartTimer& operator=(const PartTimer&) = delete;

 private:
  StepProfile* profile_;
  StepPart part_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace tandem::model
