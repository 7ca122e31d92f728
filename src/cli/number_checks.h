#pragma once
// Range checks for numeric flags that say what is wanted. CLI11's PositiveNumber and
// NonNegativeNumber answer 0 with "Value 0 not in range 0.000000 to " and the largest double in
// 309 digits. CLI11 puts the flag's name before these messages: "--max-num-seqs: must be a
// positive number, got 0".
#include <algorithm>
#include <cctype>
#include <cmath>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>

namespace tandem::cli {

// Text that is not a number is left to the option's own conversion to refuse (nullopt here); nan
// and the infinities are numbers that every check below refuses.
inline std::optional<double> number_of(const std::string& text) {
  double value = 0;
  if (!CLI::detail::lexical_cast(text, value)) return std::nullopt;
  return value;
}

inline std::string number_check(const std::string& text, bool zero_allowed) {
  const std::optional<double> value = number_of(text);
  if (!value) return std::string();
  if (!std::isfinite(*value)) return "must be a finite number, got " + text;
  if (*value > 0 || (zero_allowed && *value == 0)) return std::string();
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

// A number of seconds: refuses nan (which passes CLI::Range, every comparison with it being
// false, and then converts to milliseconds as undefined behaviour) and infinities.
inline CLI::Validator finite_seconds() {
  return CLI::Validator(
      [](const std::string& text) {
        const std::optional<double> value = number_of(text);
        if (value && !std::isfinite(*value))
          return "expected a finite number of seconds, got " + text;
        return std::string();
      },
      "FINITE");
}

// A number of seconds that is a timer's bound: util/duration.h's milliseconds_of rounds below
// 0.0005 to 0 ms, which the setting's own validation then refused naming a config key the user
// never wrote ("timeouts.prefill_ms ... got 0"), after `tandem serve` had started its engines.
inline CLI::Validator at_least_a_millisecond() {
  return CLI::Validator(
      [](const std::string& text) {
        const std::optional<double> value = number_of(text);
        if (value && *value < 0.001)
          return "must be at least 0.001 seconds (a millisecond), got " + text;
        return std::string();
      },
      ">=0.001");
}

// A number of seconds for `option`, at most `most`, at least a millisecond or (where 0 means
// none) 0: the checks above and CLI::Range, with one type in the help, "SECONDS in [0.001 -
// 2147483.647]" with every digit. Each check added its own ("FLOAT:FINITE:>=0.001:FLOAT in
// [0 - 2.14748e+06]"): bounds that disagreed, and a maximum rounded.
inline CLI::Option* check_seconds(CLI::Option* option, bool at_least_a_ms, double most) {
  std::ostringstream type;
  type << std::setprecision(10) << "SECONDS in [" << (at_least_a_ms ? 0.001 : 0.0) << " - " << most
       << "]";
  return option->check(finite_seconds().description(""))
      ->check((at_least_a_ms ? at_least_a_millisecond() : non_negative_number()).description(""))
      ->check(CLI::Range(0.0, most).description(type.str()));
}

// Why `text` is no integer as a flag takes it, or "": a decimal number, its sign and leading
// spaces as strtoll takes them. CLI11 (2.1) read integers as strtoll with base 0, "010" as octal 8
// and "0x10" as 16, where a user meant 10 or a typo; and answered "abc" with CLI::Range's "Value
// abc not in range 0 to 65535". A number past the type's range is left to the range's check.
inline std::string integer_text_check(const std::string& text) {
  size_t at = 0;
  while (at < text.size() && std::isspace(static_cast<unsigned char>(text[at]))) ++at;
  if (at < text.size() && (text[at] == '+' || text[at] == '-')) ++at;
  // (A letter: "0x10", and "0b10", which glibc 2.38's strtoll reads as binary.)
  if (at + 1 < text.size() && text[at] == '0' &&
      std::isalnum(static_cast<unsigned char>(text[at + 1])))
    return "expected a decimal number (no leading 0 or 0x), got " + text;
  const bool digits = at < text.size() && std::all_of(text.begin() + at, text.end(), [](char c) {
                        return std::isdigit(static_cast<unsigned char>(c));
                      });
  return digits ? std::string() : "expected a whole number, got " + text;
}

// Every numeric option of `app` and its subcommands, as they stand: an integer option takes a
// decimal whole number (integer_text_check), a floating one a number, refused naming the flag
// ("--port: expected a whole number, got abc") before any other check of the option (a range's)
// words it otherwise.
inline void refuse_malformed_numbers(CLI::App& app) {
  const CLI::Validator integer(integer_text_check, "");  // nothing added to the help's type
  const CLI::Validator number(
      [](const std::string& text) {
        return number_of(text) ? std::string() : "expected a number, got " + text;
      },
      "");
  for (CLI::Option* option : app.get_options()) {
    // CLI11's own type name, before any check's ("UINT:INT in [1 - 64]").
    const std::string type = option->get_type_name();
    const std::string base = type.substr(0, type.find(':'));
    // transform(), not check(): put first, before the checks the option was given.
    if (base == "INT" || base == "UINT") option->transform(integer);
    if (base == "FLOAT") option->transform(number);
  }
  for (CLI::App* command : app.get_subcommands([](CLI::App*) { return true; }))
    refuse_malformed_numbers(*command);
}

}  // namespace tandem::cli
