#pragma once
// Range checks for numeric flags that say what is wanted. CLI11's PositiveNumber and
// NonNegativeNumber answer 0 with "Value 0 not in range 0.000000 to " and the largest double in
// 309 digits. CLI11 puts the flag's name before these messages: "--max-num-seqs: must be a
// positive number, got 0".
#include <cmath>
#include <string>

#include <CLI/CLI.hpp>

namespace tandem::cli {

// Text that is not a number is left to the option's own conversion to refuse; nan and the
// infinities are refused here, as CLI11's checks refused them.
inline std::string number_check(const std::string& text, bool zero_allowed) {
  double value = 0;
  if (!CLI::detail::lexical_cast(text, value)) return std::string();
  if (!std::isfinite(value)) return "must be a finite number, got " + text;
  if (value > 0 || (zero_allowed && value == 0)) return std::string();
  return (zero_allowed ? "must be 0 or more, got " : "must be a positive number, got ") + text;
}

// More than 0.
inline CLI::Validator positive_number() {
  return CLI::Validator([](const std::string& text) { return number_check(text, false); },
                        "POSITIVE");
}

// 0 or more.
inline CLI::Validator non_negative_number() {
  return CLI::Validator([](const std::string& text) { return number_check(text, true); },
                        "NONNEGATIVE");
}

}  // namespace tandem::cli
