#pragma once
// JSON Schema's string formats as regular expressions (structured/regex.h's flavour, matched
// whole), for the formats structured outputs enforce. Each matches only strings valid under the
// format's RFC and readable by the parsers clients use (Python's datetime.fromisoformat,
// uuid.UUID and ipaddress, Pydantic's types): where those disagree the pattern keeps to what all
// of them take (a subset of the RFC, never more), except email's lengths and special-use
// domains (string_formats.cpp). duration (RFC 3339's Appendix A) and json-pointer (RFC 6901),
// which no Python standard parser reads, are their RFCs' ABNF exactly.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace tandem::structured {

// A format's pattern, and the most characters its strings may have beside it (-1: what the
// pattern says), as a maxLength of its own (hostname's 253).
struct StringFormat {
  std::string pattern;
  int64_t max_length = -1;
};
// Nothing for a format not enforced here.
std::optional<StringFormat> string_format(std::string_view format);
// The formats enforced, for error messages: "date-time, date, ...".
std::string enforced_string_formats();

}  // namespace tandem::structured
