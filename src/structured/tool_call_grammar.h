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
// The arguments follow each function's parameters schema (json_schema.h), and are always a JSON
// object: any object without parameters. Throws tandem::Error naming what is wrong.
Grammar::Symbol tool_calls_rule(Grammar& g, const nlohmann::ordered_json& calls);

// Whether a function's parameters describe objects only: the empty schema (any object, as no
// parameters) or one whose top level says "type": "object".
// (Either kind of nlohmann document: the API checks the sorted one.)
template <class Json>
bool is_object_schema(const Json& schema) {
  if (!schema.is_object()) return false;
  if (schema.empty()) return true;
  const auto type = schema.find("type");
  return type != schema.end() && *type == "object";
}

}  // namespace tandem::structured
