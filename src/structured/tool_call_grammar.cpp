#include "structured/tool_call_grammar.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "structured/json_schema.h"
#include "util/error.h"

namespace tandem::structured {

namespace {

// For a schema that passed the grammar's size: the symbols the functions' schemas before it
// took, where they took an eighth of the grammar or more, naming those of a 64th or more,
// largest first ("" where they took less).
std::string taken_before(std::vector<std::pair<std::string, size_t>> taken) {
  size_t total = 0;
  for (const auto& t : taken) total += t.second;
  if (total < Grammar::kMaxSymbols / 8) return "";
  std::stable_sort(taken.begin(), taken.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  std::string named;
  for (const auto& [name, symbols] : taken) {
    if (symbols < Grammar::kMaxSymbols / 64) break;
    named += named.empty() ? ": " : ", ";
    named += "function '" + name + "' (" + std::to_string(symbols) + " symbols)";
  }
  return " (" + std::to_string(total) + " symbols were taken by the schemas before this one" +
         named + ")";
}

}  // namespace

Grammar::Symbol tool_calls_rule(Grammar& g, const nlohmann::ordered_json& calls) {
  auto text = [&](const char* k) {
    const auto it = calls.find(k);
    if (it == calls.end() || !it->is_string())
      throw Error(std::string("tool calls: '") + k + "' is missing");
    return g.literal(it->get<std::string>());
  };
  const auto functions = calls.find("functions");
  if (functions == calls.end() || !functions->is_array() || functions->empty())
    throw Error("tool calls: no functions to call");
  std::vector<Grammar::Sequence> one_call;
  // The symbols each function's schema took: the functions share one grammar, and a schema that
  // passes its size names only its own bounds, though those before it may have taken most.
  std::vector<std::pair<std::string, size_t>> taken;
  for (const auto& f : *functions) {
    const std::string name = f.at("name").get<std::string>();
    // Arguments are always a JSON object (a parser reads them as one): without parameters, or
    // with the empty schema, any object; a schema of another top level is refused.
    nlohmann::ordered_json params = {{"type", "object"}};
    if (f.contains("parameters") && !f["parameters"].empty()) params = f["parameters"];
    Grammar::Symbol args;
    try {
      if (!is_object_schema(params))
        throw Error("arguments are a JSON object: the schema needs \"type\": \"object\"");
      const size_t before = g.symbols();
      args = json_schema_rule(g, params);
      taken.emplace_back(name, g.symbols() - before);
    } catch (const GrammarTooLarge& e) {
      throw GrammarTooLarge("function '" + name + "' parameters: " + e.what() +
                            taken_before(taken));
    } catch (const Error& e) {
      throw Error("function '" + name + "' parameters: " + e.what());
    }
    Grammar::Sequence call = text("call_prefix");
    for (Grammar::Symbol s : g.literal(name)) call.push_back(s);
    for (Grammar::Symbol s : text("after_name")) call.push_back(s);
    call.push_back(args);
    for (Grammar::Symbol s : text("call_suffix")) call.push_back(s);
    one_call.push_back(std::move(call));
  }
  const Grammar::Symbol call = g.any_of(std::move(one_call));
  const int64_t min = calls.value("min_calls", 1), max = calls.value("max_calls", -1);
  if (min < 1 || (max >= 0 && max < min)) throw Error("tool calls: bad call counts");
  Grammar::Sequence more = text("between");
  more.push_back(call);
  Grammar::Sequence all = text("open");
  all.push_back(call);
  all.push_back(g.repeat(more, min - 1, max < 0 ? -1 : max - 1));
  for (Grammar::Symbol s : text("close")) all.push_back(s);
  return g.any_of({std::move(all)});
}

}  // namespace tandem::structured
