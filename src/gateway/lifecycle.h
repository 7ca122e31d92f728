#pragma once
// The ten phases every gateway request goes through, and the record of when it reached each.
//
//   received -> tokenizing -> prefix_matching -> prefill_waiting -> prefill_scheduled ->
//   prefilling -> decode_waiting -> decode_scheduled -> decoding -> completed
//
// In parallel mode the prefill and decode phases overlap (both legs are chosen and sent
// together); in aggregated mode one engine does both, so its prefill and decode phases are
// stamped from the same events. What each phase means precisely is documented in
// docs/gateway.md ("Request lifecycle").
#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace tandem::gateway {

enum class Phase : int {
  kReceived,
  kTokenizing,
  kPrefixMatching,
  kPrefillWaiting,
  kPrefillScheduled,
  kPrefilling,
  kDecodeWaiting,
  kDecodeScheduled,
  kDecoding,
  kCompleted,
};
inline constexpr int kPhaseCount = 10;
const char* phase_name(Phase phase);

// Nanoseconds on the steady clock.
int64_t steady_now_ns();

// When a request reached each phase, plus the end of its prefill leg (not a phase of its own:
// the prefill leg's end closes "prefilling"). Written from any thread; each stamp is set once
// (later marks of a stamped phase are ignored, so a retry keeps the first times).
class PhaseTimes {
 public:
  void mark(Phase phase, int64_t ns);
  void mark(Phase phase) { mark(phase, steady_now_ns()); }
  void mark_prefill_done(int64_t ns);
  std::optional<int64_t> at(Phase phase) const;
  std::optional<int64_t> prefill_done() const;
  // The latest phase reached, in the order above.
  Phase current() const;
  // Seconds spent in `phase`: from its stamp to the stamp that ends it (prefill_waiting ->
  // prefill_scheduled -> prefilling -> prefill end; decode_waiting -> decode_scheduled ->
  // decoding -> completed; the first three each end at the next). Empty while it has not ended.
  std::optional<double> seconds_in(Phase phase) const;
  // {"received": 0, "tokenizing": 0.0001, ...}: seconds since received, only stamped phases.
  nlohmann::json offsets() const;

 private:
  std::array<std::atomic<int64_t>, kPhaseCount> ns_{};
  std::atomic<int64_t> prefill_done_{0};
};

}  // namespace tandem::gateway
