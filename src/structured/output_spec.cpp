#include "structured/output_spec.h"

#include <vector>

#include <nlohmann/json.hpp>

#include "structured/json_schema.h"
#include "structured/ordered_json.h"
#include "structured/regex.h"
#include "structured/tool_call_grammar.h"
#include "util/error.h"
#include "util/json.h"

namespace tandem::structured {

std::string OutputSpec::key() const {
  return std::to_string(static_cast<int>(kind)) + (disable_additional_properties ? "c" : "") + ":" +
         text;
}

namespace {

// In the client's key order (properties are generated in the schema's order), with each
// object's size bounded for the compilers' lookups by name.
nlohmann::ordered_json parse_checked(const std::string& text) {
  nlohmann::ordered_json doc = parse_ordered(text);
  check_object_sizes(doc);
  return doc;
}

}  // namespace

std::shared_ptr<const Grammar> compile(const OutputSpec& spec) {
  auto g = std::make_shared<Grammar>();
  Grammar::Symbol root = -1;
  switch (spec.kind) {
    case OutputSpec::Kind::kJsonObject:
      root = json_object_rule(*g);
      break;
    case OutputSpec::Kind::kJsonSchema:
      root = json_schema_rule(*g, parse_checked(spec.text), spec.disable_additional_properties);
      break;
    case OutputSpec::Kind::kRegex:
      if (spec.text.empty()) throw Error("the regex is empty");
      root = regex_rule(*g, spec.text);
      break;
    case OutputSpec::Kind::kChoice: {
      const nlohmann::json choices = parse_untrusted_json(spec.text);
      if (!choices.is_array() || choices.empty())
        throw Error("the choices must be a non-empty list of strings");
      std::vector<std::string> texts;
      for (const auto& c : choices) {
        if (!c.is_string() || c.get<std::string>().empty())
          throw Error("the choices must be non-empty strings");
        texts.push_back(c.get<std::string>());
      }
      root = g->one_of_texts(std::move(texts));
      break;
    }
    case OutputSpec::Kind::kToolCalls:
      root = tool_calls_rule(*g, parse_checked(spec.text));
      break;
  }
  g->finish(root);
  return g;
}

}  // namespace tandem::structured
