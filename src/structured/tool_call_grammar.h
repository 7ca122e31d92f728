#pragma once
// Forced tool calls (tool_choice "required" or a named function) as a grammar of the model's own
// call markup, so the answer is what the model was trained to write and the same parser reads it
// (api/tool_calls.h owns the markup and fills the description below).
#include <nlohmann/json.hpp>

#include "structured/grammar.h"

namespace tandem::structured {

// `calls` describes the markup and the functions:
//   {"open": text before the calls, "call_prefix": text before a name, "after_name": text between
//    the name and the arguments, "call_suffix": text after the arguments, "between": text between
//    calls, "close": text after the calls, "functions": [{"name", "parameters"}],
//    "min_calls", "max_calls" (-1: no limit)}
// The arguments follow each function's parameters schema (json_schema.h). Throws tandem::Error
// naming what is wrong.
Grammar::Symbol tool_calls_rule(Grammar& g, const nlohmann::ordered_json& calls);

}  // namespace tandem::structured
