#include "structured/output_spec.h"

#include <vector>

#include <nlohmann/json.hpp>

#include "structured/json_schema.h"
#include "structured/regex.h"
#include "structured/tool_call_grammar.h"
#include "util/error.h"
#include "util/json.h"

namespace tandem::structured {

std::string OutputSpec::key() const {
  return std::to_string(static_cast<int>(kind)) + ":" + text;
}

namespace {

// Keys one object of a schema or tool list may have. The order-keeping document below finds
// each key by a linear search as it inserts, so an object of n keys costs n^2 / 2 comparisons:
// 200K $defs took tens of seconds of the HTTP thread; 4096 take milliseconds.
constexpr size_t kMaxObjectKeys = 4096;

// Parsed keeping the key order (properties are generated in the schema's order), after our
// reader checked it (bounded depth, so nlohmann's parse below cannot go deep; bounded objects,
// so it cannot take quadratic time).
nlohmann::ordered_json parse_ordered(const std::string& text) {
  const nlohmann::json doc = parse_untrusted_json(text);
  std::vector<const nlohmann::json*> pending = {&doc};
  while (!pending.empty()) {
    const nlohmann::json* j = pending.back();
    pending.pop_back();
    if (j->is_object() && j->size() > kMaxObjectKeys)
      throw Error("an object of " + std::to_string(j->size()) + " keys (at most " +
                  std::to_string(kMaxObjectKeys) + ")");
    if (j->is_structured())
      for (const auto& child : *j) pending.push_back(&child);
  }
  return nlohmann::ordered_json::parse(text);
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
      root = json_schema_rule(*g, parse_ordered(spec.text));
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
      root = tool_calls_rule(*g, parse_ordered(spec.text));
      break;
  }
  g->finish(root);
  return g;
}

}  // namespace tandem::structured
