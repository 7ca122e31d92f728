#pragma once
// JSON Schema (the subset structured outputs use: OpenAI's strict schemas, Pydantic's) and plain
// JSON as grammars. The answers follow the schema's property order, write required properties
// always and optional ones at will, and never add properties the schema does not list (still
// valid where additionalProperties allows more). A string's pattern is matched by its whole value
// (structured/regex.h), its format by structured/string_formats.h, either within minLength and
// maxLength (characters of the value, however written; beside a pattern or format at a cost that
// grows with maxLength, bounded: structured/regex.h, kMaxCountedSteps); numeric bounds are
// enforced on integers and numbers (a number within bounds is written without an exponent).
// Keywords that constrain values in ways a grammar here cannot (multipleOf, unknown formats, ...)
// are refused by name, never ignored.
#include <nlohmann/json.hpp>

#include "structured/grammar.h"

namespace tandem::structured {

// Bounds that keep every answer finite; a model may still stop earlier.
// Bytes of white space between two tokens of JSON: pretty printers need "\n" and the indent
// (61 bytes for 4-space indents 15 levels deep; xgrammar and llguidance, vLLM's backends, set no
// bound), while the bound still ends a model's run of white space.
inline constexpr int kMaxWhitespace = 64;
inline constexpr int kMaxIntegerDigits = 16;   // digits of an integer part
inline constexpr int kMaxFractionDigits = 16;  // digits after the decimal point
inline constexpr int kMaxExponentDigits = 3;

// Adds to `g` a rule matching the JSON text of a value valid under `schema`, and returns it.
// `disable_additional_properties`: vLLM's option, which its guidance backend implements by setting
// additionalProperties to false in each (sub)schema that lists properties or patternProperties and
// sets no additionalProperties; here each such object schema compiled (wherever it stands: under
// properties, items, anyOf, $defs, additionalProperties) is closed alike, and literal values
// (const, enum, default) are left as written. Throws tandem::Error naming the unsupported keyword
// and where it is.
Grammar::Symbol json_schema_rule(Grammar& g, const nlohmann::ordered_json& schema,
                                 bool disable_additional_properties = false);
// A rule matching any JSON object (OpenAI's json_object).
Grammar::Symbol json_object_rule(Grammar& g);

}  // namespace tandem::structured
