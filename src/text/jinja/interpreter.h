#pragma once
// Executes a parsed template against a JSON context.
#include <string>

#include <nlohmann/json.hpp>

#include "text/jinja/ast.h"

namespace tandem::text::jinja {

// Renders `body`; the context's top-level keys become template variables. Throws tandem::Error
// naming the template line for runtime errors, including raise_exception().
std::string render_template(const Body& body, const nlohmann::ordered_json& context);

}  // namespace tandem::text::jinja
