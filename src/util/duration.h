#pragma once
// Seconds as settings give them (flags and config fields are doubles) to the durations timers
// take: one conversion, rounded one way, for every setting.
#include <chrono>
#include <cmath>
#include <cstdint>

namespace tandem {

// `seconds` to the nearest millisecond. The caller has checked that it is finite and small enough
// (cli/number_checks.h's finite_seconds and a range): a NaN, an infinity or a value past int64
// milliseconds converts as undefined behaviour.
inline std::chrono::milliseconds milliseconds_of(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(seconds * 1000)));
}

}  // namespace tandem
