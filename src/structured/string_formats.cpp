#include "structured/string_formats.h"

namespace tandem::structured {
namespace {

// Dates of the Gregorian calendar, years 0001 to 9999: RFC 3339's full-date with each month's
// days, and 29 February in leap years only (xgrammar allows 31 February, llguidance 29 February
// of any year: dates every parser refuses). Year 0000 is RFC 3339's but no Python date's.
constexpr char kYear[] = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)";
constexpr char kMonthAndDay[] =
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|"
    "02-(?:0[1-9]|1[0-9]|2[0-8]))";
// Divisible by 4 and not by 100, or by 400 (not 0000).
constexpr char kLeapYear[] =
    "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)";

std::string date() {
  return std::string("(?:") + kYear + "-" + kMonthAndDay + "|" + kLeapYear + "-02-29)";
}

// RFC 3339's full-time: the offset is required (Z or +hh:mm), the leap second 60 is left out
// (Python and Pydantic refuse it), and fractions have at most 6 digits, the microseconds Python
// and Pydantic keep (more are RFC 3339's, and cut off silently by the parsers).
std::string time() {
  return "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?"
         "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])";
}

// RFC 4122's string form, either case; uuidN (Pydantic's UUID1, UUID4, ...) also fixes the
// version digit and the RFC 4122 variant, which Python's UUID.version needs to report one.
std::string uuid(char version) {
  const std::string hex = "[0-9a-fA-F]";
  if (!version) return hex + "{8}-" + hex + "{4}-" + hex + "{4}-" + hex + "{4}-" + hex + "{12}";
  return hex + "{8}-" + hex + "{4}-" + version + hex + "{3}-[89abAB]" + hex + "{3}-" + hex + "{12}";
}

// Dotted decimal, no leading zeros (Python's ipaddress refuses them: 010 reads as octal to some).
std::string ipv4() {
  const std::string octet = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])";
  return "(?:" + octet + "\\.){3}" + octet;
}

// RFC 4291's text forms of eight groups, at most one run of them written '::'. The form with a
// dotted IPv4 tail is left out.
std::string ipv6() {
  const std::string h = "[0-9a-fA-F]{1,4}";
  std::string out = "(?:" + h + ":){7}" + h + "|::(?:" + h + "(?::" + h + "){0,6})?";
  for (int before = 1; before <= 7; ++before) {
    out += "|(?:" + h + ":){" + std::to_string(before - 1) + "}" + h + "::";
    if (before < 7) out += "(?:" + h + "(?::" + h + "){0," + std::to_string(6 - before) + "})?";
  }
  return out;
}

// RFC 5321's Mailbox with a dot-atom local part (no quoted strings) and a domain of LDH labels
// ending in a top-level label of letters (no address literals, no single-label domains, which
// Pydantic's EmailStr refuses). Not enforced, so more than EmailStr takes: RFC 5321's lengths (64
// bytes before the '@', 254 in all) and the special-use domains (.test, .local, ...).
std::string email() {
  const std::string atext = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]";
  const std::string label = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?";
  return atext + "+(?:\\." + atext + "+)*@(?:" + label + "\\.)+[A-Za-z]{2,63}";
}

// RFC 3986's parts (Appendix A). A host is a reg-name (which IPv4 addresses are too): the
// IP-literal ("[" IPv6 or IPvFuture "]") is left out, as its automaton alone is several times
// the rest's, and HttpUrl's maxLength of 2083 multiplies it (structured/regex.h).
constexpr char kPct[] = "%[0-9A-Fa-f]{2}";
std::string uri_chars(const std::string& beside_unreserved_and_sub_delims) {
  return "(?:[A-Za-z0-9._~!$&'()*+,;=" + beside_unreserved_and_sub_delims + "-]|" + kPct + ")";
}
std::string authority() {
  return "(?:" + uri_chars(":") + "*@)?" + uri_chars("") + "*(?::[0-9]*)?";
}
std::string query_and_fragment() {
  const std::string chars = uri_chars(":@/?") + "*";
  return "(?:\\?" + chars + ")?(?:#" + chars + ")?";
}
std::string segment() {
  return uri_chars(":@") + "*";
}

// scheme ":" hier-part ["?" query] ["#" fragment]; the hier-part's path-absolute, path-rootless
// and path-empty together are "/"? then a segment-nz and more segments, or nothing.
std::string uri() {
  return "[A-Za-z][A-Za-z0-9+.-]*:(?://" + authority() + "(?:/" + segment() +
         ")*|/?(?:" + uri_chars(":@") + "+(?:/" + segment() + ")*)?)" + query_and_fragment();
}

// A URI or a relative-ref: relative-part (its path-noscheme's first segment without ':')
// ["?" query] ["#" fragment].
std::string uri_reference() {
  return uri() + "|(?://" + authority() + "(?:/" + segment() + ")*|/(?:" + uri_chars(":@") +
         "+(?:/" + segment() + ")*)?|" + uri_chars("@") + "+(?:/" + segment() + ")*)?" +
         query_and_fragment();
}

// RFC 1123's host names: LDH labels of 1 to 63 characters that neither begin nor end with a
// hyphen (a digit may begin one), joined by dots; 253 characters in all (StringFormat's
// max_length), the most DNS carries. No trailing dot.
std::string hostname() {
  const std::string label = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?";
  return label + "(?:\\." + label + ")*";
}

// RFC 3339's duration (Appendix A), as JSON Schema's "duration" format: P, then a date part
// (days; months, then days at will; or years, then months and days at will) and a time part at
// will (T, then hours, minutes, seconds, each the next at will), or the time part alone, or
// weeks alone. Whole numbers only: no fractions, as the ABNF has them.
std::string duration() {
  const std::string n = "[0-9]+";
  const std::string second = n + "S", minute = n + "M(?:" + second + ")?",
                    hour = n + "H(?:" + minute + ")?";
  const std::string time = "T(?:" + hour + "|" + minute + "|" + second + ")";
  const std::string day = n + "D", month = n + "M(?:" + day + ")?",
                    year = n + "Y(?:" + month + ")?";
  return "P(?:(?:" + day + "|" + month + "|" + year + ")(?:" + time + ")?|" + time + "|" + n + "W)";
}

// RFC 6901's JSON Pointer: reference tokens, each after a '/', in which '~' is written only as
// '~0' (a '~') or '~1' (a '/').
std::string json_pointer() {
  return "(?:/(?:[^/~]|~[01])*)*";
}

}  // namespace

std::optional<StringFormat> string_format(std::string_view format) {
  if (format == "date-time") return StringFormat{date() + "T" + time()};
  if (format == "date") return StringFormat{date()};
  if (format == "time") return StringFormat{time()};
  if (format == "uuid") return StringFormat{uuid(0)};
  if (format.size() == 5 && format.substr(0, 4) == "uuid" &&
      std::string_view("1345678").find(format[4]) != std::string_view::npos)
    return StringFormat{uuid(format[4])};
  if (format == "ipv4") return StringFormat{ipv4()};
  if (format == "ipv6") return StringFormat{ipv6()};
  if (format == "email") return StringFormat{email()};
  if (format == "uri") return StringFormat{uri()};
  if (format == "uri-reference") return StringFormat{uri_reference()};
  if (format == "hostname") return StringFormat{hostname(), 253};
  if (format == "duration") return StringFormat{duration()};
  if (format == "json-pointer") return StringFormat{json_pointer()};
  return std::nullopt;
}

std::string enforced_string_formats() {
  return "date-time, date, time, uuid (and Pydantic's uuid1, uuid3 to uuid8), ipv4, ipv6, email, "
         "uri, uri-reference, hostname, duration, json-pointer";
}

}  // namespace tandem::structured
