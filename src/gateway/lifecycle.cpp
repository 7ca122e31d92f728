#include "gateway/lifecycle.h"

#include <chrono>

#include <nlohmann/json.hpp>

namespace tandem::gateway {
namespace {

void set_once(std::atomic<int64_t>& slot, int64_t ns) {
  int64_t expected = 0;
  slot.compare_exchange_strong(expected, ns == 0 ? 1 : ns);
}

std::optional<int64_t> get(const std::atomic<int64_t>& slot) {
  const int64_t v = slot.load();
  if (v == 0) return std::nullopt;
  return v;
}

}  // namespace

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kReceived:
      return "received";
    case Phase::kTokenizing:
      return "tokenizing";
    case Phase::kPrefixMatching:
      return "prefix_matching";
    case Phase::kPrefillWaiting:
      return "prefill_waiting";
    case Phase::kPrefillScheduled:
      return "prefill_scheduled";
    case Phase::kPrefilling:
      return "prefilling";
    case Phase::kDecodeWaiting:
      return "decode_waiting";
    case Phase::kDecodeScheduled:
      return "decode_scheduled";
    case Phase::kDecoding:
      return "decoding";
    case Phase::kCompleted:
      return "completed";
  }
  return "?";
}

int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void PhaseTimes::mark(Phase phase, int64_t ns) {
  set_once(ns_[static_cast<int>(phase)], ns);
}

void PhaseTimes::mark_prefill_done(int64_t ns) {
  set_once(prefill_done_, ns);
}

std::optional<int64_t> PhaseTimes::at(Phase phase) const {
  return get(ns_[static_cast<int>(phase)]);
}

std::optional<int64_t> PhaseTimes::prefill_done() const {
  return get(prefill_done_);
}

Phase PhaseTimes::current() const {
  for (int i = kPhaseCount - 1; i > 0; --i)
    if (ns_[i].load() != 0) return static_cast<Phase>(i);
  return Phase::kReceived;
}

std::optional<double> PhaseTimes::seconds_in(Phase phase) const {
  const auto start = at(phase);
  std::optional<int64_t> end;
  switch (phase) {
    case Phase::kReceived:
      end = at(Phase::kTokenizing);
      break;
    case Phase::kTokenizing:
      end = at(Phase::kPrefixMatching);
      break;
    case Phase::kPrefixMatching:
      end = at(Phase::kPrefillWaiting);
      break;
    case Phase::kPrefillWaiting:
      end = at(Phase::kPrefillScheduled);
      break;
    case Phase::kPrefillScheduled:
      end = at(Phase::kPrefilling);
      break;
    case Phase::kPrefilling:
      end = prefill_done();
      break;
    case Phase::kDecodeWaiting:
      end = at(Phase::kDecodeScheduled);
      break;
    case Phase::kDecodeScheduled:
      end = at(Phase::kDecoding);
      break;
    case Phase::kDecoding:
      end = at(Phase::kCompleted);
      break;
    case Phase::kCompleted:
      return std::nullopt;
  }
  if (!start || !end || *end < *start) return std::nullopt;
  return static_cast<double>(*end - *start) * 1e-9;
}

nlohmann::json PhaseTimes::offsets() const {
  nlohmann::json out = nlohmann::json::object();
  const auto origin = at(Phase::kReceived);
  if (!origin) return out;
  for (int i = 0; i < kPhaseCount; ++i)
    if (auto t = at(static_cast<Phase>(i)))
      out[phase_name(static_cast<Phase>(i))] = static_cast<double>(*t - *origin) * 1e-9;
  if (auto t = prefill_done()) out["prefill_done"] = static_cast<double>(*t - *origin) * 1e-9;
  return out;
}

}  // namespace tandem::gateway
