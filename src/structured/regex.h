#pragma once
// Regular expressions as grammars matching the whole answer (anchors at the ends are implied).
// The flavour, exactly: Python's re for str patterns, with \d and \w ASCII as re.ASCII has them.
//   \d  [0-9]; \w  [0-9A-Za-z_]; \D and \W their complements over every code point ('é', '中'
//       and '٣' are \W and \D). These are ECMAScript's (JSON Schema's pattern) and xgrammar's,
//       vLLM's default backend, and keep answers meant as numbers or identifiers ASCII; Python's
//       default and llguidance's plain regexes make \d and \w Unicode.
//   \s  the code points str.isspace() holds (Unicode white space, as Python's default); \S the
//       rest.
//   .   any code point but \n (Python's; ECMAScript's also excludes \r, U+2028 and U+2029).
// Literals, escapes (\n \t \r \f \v \0 \xNN \uNNNN, escaped punctuation), classes and ranges,
// groups ((...) and (?:...)), '|', greedy or lazy quantifiers. Refused, naming the construct:
// backreferences, lookaround, word boundaries, other (? groups, possessive quantifiers, {,n} and
// octal escapes (read differently by Python and ECMAScript), a quantifier right after another.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "structured/grammar.h"
#include "util/error.h"

namespace tandem::structured {

// Throws tandem::Error naming the construct and its offset in the pattern.
Grammar::Symbol regex_rule(Grammar& g, std::string_view pattern);
// Patterns read so far by this process (regex_rule(), regex_in_json_string(), CountedPattern):
// for tests that a pattern is read once where it is compiled.
int64_t patterns_parsed();

// A pattern compiled to match the inside of a JSON string (the text between its quotes) whose
// value the pattern matches whole, as a JSON Schema 'pattern' or 'format' is compiled. Each
// character is written one way: '"', '\' and the control characters as JSON encoders escape them
// (\" \\ \b \f \n \r \t, the others \u00xx), every other character as itself in UTF-8.
struct RegexInJsonString {
  Grammar::Symbol rule;
  // The fewest and the most characters (code points) of the values it matches; longest < 0: no
  // limit.
  int64_t shortest, longest;
};
RegexInJsonString regex_in_json_string(Grammar& g, std::string_view pattern);

// The fewest and the most characters of the values a pattern matches (longest < 0: no limit),
// as regex_in_json_string() has them.
struct RegexLengths {
  int64_t shortest, longest;
};

// CountedPattern::within(): regex_in_json_string() for the values of min_length..max_length
// characters alone (max_length < 0: no limit), characters counted as there (code points of the
// value, however written): the pattern's automaton once per count of characters read, up to
// max_length or the pattern's longest, the fewer (min_length where there is no limit, the counts
// past it one); max_length 0 is the empty string alone. Nothing when no such value matches. Each
// state and transition of the automaton is a rule or an alternative per count, and each
// character (repeats written out) is counted as a state and a transition before the automaton is
// built: past kMaxCountedSteps of either it throws LengthTooCostly, saying what made them and
// how many counts would have fitted; an automaton whose transitions alone pass it, whatever the
// lengths, throws PatternTooCostly.
inline constexpr int64_t kMaxCountedSteps = 1'000'000;
// The most characters within() counts beside a pattern of `lengths` for min_length..max_length
// (its automaton is built once per count, 0 to this), or none where the pattern's own lengths lie
// within the bounds and it needs no counting: what is accepted, and what advice offers, alike.
std::optional<int64_t> lengths_counted(RegexLengths lengths, int64_t min_length,
                                       int64_t max_length);
class LengthTooCostly : public Error {
 public:
  LengthTooCostly(const std::string& what, int64_t counts_that_fit)
      : Error(what), counts_that_fit(counts_that_fit) {}
  // The most counts of characters the automaton fits the budget for: lengths 0 to
  // counts_that_fit - 1 would be accepted. Exact where it is at least 1 + the fewest characters
  // a string could have under a lower bound (one or more: the pattern's shortest, or min_length
  // beside a max_length); below that no such bound fits, the automaton is not built to count its
  // states, and it is the characters' bound alone (a bound from above).
  int64_t counts_that_fit;
};
class PatternTooCostly : public Error {
 public:
  using Error::Error;
};
// A pattern parsed once (throws as regex_rule()) for its lengths and then, at most once, either
// whole() (regex_in_json_string()'s rule, where the lengths need no counting) or within().
class CountedPattern {
 public:
  explicit CountedPattern(std::string_view pattern);
  ~CountedPattern();
  RegexLengths lengths() const;
  Grammar::Symbol whole(Grammar& g);
  std::optional<Grammar::Symbol> within(Grammar& g, int64_t min_length, int64_t max_length);

 private:
  struct Parsed;
  std::unique_ptr<Parsed> parsed_;
};

}  // namespace tandem::structured
