#pragma once
// Regular expressions (the common subset of Python's re and ECMAScript: literals, escapes, classes,
// '.', groups, alternation, greedy or lazy quantifiers) as grammars matching the whole answer.
// Anchors at the ends are implied; backreferences, lookaround and word boundaries are refused.
#include <string_view>

#include "structured/grammar.h"

namespace tandem::structured {

// Throws tandem::Error naming the construct and its offset in the pattern.
Grammar::Symbol regex_rule(Grammar& g, std::string_view pattern);

}  // namespace tandem::structured
