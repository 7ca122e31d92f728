#pragma once
// Executes a parsed template against a JSON context.
//
// Supported subset: {{ }}, {% %}, {# #} with -/+ whitespace control; if/elif/else; for (loop.*
// attributes, for-else, inline `if`, tuple unpacking, break/continue); set (plain, tuple, block
// with filters, namespace attributes); macro (positional/keyword arguments, defaults, varargs,
// kwargs); filter
// blocks; transformers' {% generation %}; the filters and tests listed in builtins.cpp; str,
// dict and list methods templates use; Python operators, slicing, literals and truthiness.
// Anything else (extends/include/import/call/raw, caller, recursive loops, filters or methods
// not implemented, printing objects Python shows by address) raises tandem::Error instead of
// rendering differently from Jinja2.
#include <string>

#include <nlohmann/json.hpp>

#include "text/jinja/ast.h"

namespace tandem::text::jinja {

// Renders `body`; the context's top-level keys become template variables. Throws tandem::Error
// naming the template line for runtime errors, including raise_exception() and a render that
// spends its budget (value.h). `stats`, when given, receives what the render spent.
std::string render_template(const Body& body, const nlohmann::ordered_json& context,
                            RenderStats* stats = nullptr);

}  // namespace tandem::text::jinja
