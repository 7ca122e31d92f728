#include "structured/json_schema.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "util/error.h"

namespace tandem::structured {
namespace {

// Ordered: properties are written in the order the schema lists them.
using json = nlohmann::ordered_json;
using Sequence = Grammar::Sequence;
using Symbol = Grammar::Symbol;

ByteSet byte_range(int lo, int hi) {
  ByteSet s;
  for (int c = lo; c <= hi; ++c) s.set(size_t(c));
  return s;
}

// Keywords that only describe (they never constrain a value).
const std::set<std::string> kAnnotations = {"title",    "description", "default",  "examples",
                                            "$schema",  "$id",         "$comment", "deprecated",
                                            "readOnly", "writeOnly",   "$defs",    "definitions"};
// Keywords this compiler enforces.
const std::set<std::string> kEnforced = {"type",  "properties", "required", "additionalProperties",
                                         "items", "minItems",   "maxItems", "enum",
                                         "const", "anyOf",      "oneOf",    "allOf",
                                         "$ref",  "minLength",  "maxLength"};

class SchemaCompiler {
 public:
  SchemaCompiler(Grammar& g, const json& root) : g_(g), root_(root) {}

  Symbol value(const json& schema, const std::string& where) {
    // Nesting in the document is bounded by its parser, but a chain of $refs is not.
    if (depth_ >= Grammar::kMaxNesting)
      fail(where, "schemas nest deeper than " + std::to_string(Grammar::kMaxNesting) +
                      " levels (nested schemas and the $refs followed to reach them)");
    ++depth_;
    struct Leave {
      int& depth;
      ~Leave() { --depth; }
    } leave{depth_};
    if (schema.is_boolean()) {
      if (!schema.get<bool>()) fail(where, "the schema false matches nothing");
      return any_value();
    }
    if (!schema.is_object()) fail(where, "a schema must be an object or a boolean");
    for (auto it = schema.begin(); it != schema.end(); ++it)
      if (!kAnnotations.count(it.key()) && !kEnforced.count(it.key()))
        fail(where, "the keyword '" + it.key() +
                        "' is not supported in structured outputs (it would not be enforced)");
    if (schema.contains("$ref")) {
      if (schema.size() > 1 + annotations(schema))
        fail(where, "keywords beside '$ref' are not supported (only descriptions)");
      return reference(schema, where);
    }
    // Each of these compiles to a grammar of its own values alone: a keyword beside it would be
    // a second constraint that grammar does not enforce, so it is refused (a 'type' beside const
    // or enum is checked against every value instead, and an enum beside a const it holds, as
    // Pydantic writes a one-value Literal, adds nothing).
    for (const char* k : {"const", "enum", "anyOf", "oneOf"})
      if (schema.contains(k)) {
        const bool literal = std::string(k) == "const" || std::string(k) == "enum";
        auto redundant_enum = [&](const std::string& key) {
          if (std::string(k) != "const" || key != "enum" || !schema["enum"].is_array())
            return false;
          const json& e = schema["enum"];
          return std::any_of(e.begin(), e.end(), [&](const json& v) {
            return nlohmann::json::parse(v.dump()) == nlohmann::json::parse(schema["const"].dump());
          });
        };
        for (auto it = schema.begin(); it != schema.end(); ++it)
          if (it.key() != k && !kAnnotations.count(it.key()) && !(literal && it.key() == "type") &&
              !redundant_enum(it.key()))
            fail(where, "the keyword '" + it.key() + "' beside '" + k +
                            "' is not supported (it would not be enforced)");
        break;
      }
    if (schema.contains("const")) {
      check_type(schema, schema["const"], where, where + "/const");
      return literal_value(schema["const"]);
    }
    if (schema.contains("enum")) {
      const json& e = schema["enum"];
      if (!e.is_array() || e.empty()) fail(where + "/enum", "'enum' must be a non-empty list");
      std::vector<std::string> texts;
      for (size_t i = 0; i < e.size(); ++i) {
        check_type(schema, e[i], where, where + "/enum/" + std::to_string(i));
        texts.push_back(literal_text(e[i]));
      }
      return g_.one_of_texts(std::move(texts));
    }
    for (const char* k : {"anyOf", "oneOf"})
      if (schema.contains(k)) {
        const json& list = schema[k];
        if (!list.is_array() || list.empty())
          fail(where + "/" + k, std::string("'") + k + "' must be a non-empty list");
        // The grammar is that of anyOf: it is oneOf's only where no value matches two schemas.
        if (std::string(k) == "oneOf") check_disjoint(list, where + "/oneOf");
        std::vector<Sequence> alts;
        for (size_t i = 0; i < list.size(); ++i)
          alts.push_back({value(list[i], where + "/" + k + "/" + std::to_string(i))});
        return g_.any_of(std::move(alts));
      }
    if (schema.contains("allOf")) {
      const json& list = schema["allOf"];
      if (!list.is_array() || list.size() != 1 || schema.size() > 1 + annotations(schema))
        fail(where + "/allOf", "'allOf' is supported with exactly one schema and nothing beside");
      return value(list[0], where + "/allOf/0");
    }
    if (!schema.contains("type")) {
      if (schema.contains("properties") || schema.contains("required") ||
          schema.contains("additionalProperties"))
        return object(schema, where);
      if (schema.contains("items")) return array(schema, where);
      if (schema.contains("minLength") || schema.contains("maxLength"))
        return string(schema, where);
      return any_value();
    }
    const json& type = schema["type"];
    if (type.is_string()) return typed(type.get<std::string>(), schema, where);
    if (!type.is_array() || type.empty())
      fail(where + "/type", "'type' must be a type name or a list of them");
    std::vector<Sequence> alts;
    for (const auto& t : type) {
      if (!t.is_string()) fail(where + "/type", "'type' must list type names");
      alts.push_back({typed(t.get<std::string>(), schema, where)});
    }
    return g_.any_of(std::move(alts));
  }

  Symbol any_value() {
    if (any_value_ >= 0) return any_value_;
    any_value_ = g_.new_rule();  // recursive: objects and arrays hold values
    const Symbol obj = g_.new_rule();
    {
      Sequence member = {string_rule(0, -1), ws(), g_.byte(':'), ws(), any_value_};
      Sequence more = {ws(), g_.byte(','), ws()};
      more.insert(more.end(), member.begin(), member.end());
      Sequence filled = {g_.byte('{'), ws()};
      filled.insert(filled.end(), member.begin(), member.end());
      filled.push_back(g_.repeat(more, 0, -1));
      filled.insert(filled.end(), {ws(), g_.byte('}')});
      g_.add(obj, std::move(filled));
      g_.add(obj, {g_.byte('{'), ws(), g_.byte('}')});
    }
    const Symbol arr = g_.new_rule();
    {
      Sequence more = {ws(), g_.byte(','), ws(), any_value_};
      g_.add(arr, {g_.byte('['), ws(), any_value_, g_.repeat(more, 0, -1), ws(), g_.byte(']')});
      g_.add(arr, {g_.byte('['), ws(), g_.byte(']')});
    }
    any_object_ = obj;
    for (Symbol s : {obj, arr, string_rule(0, -1), number(), boolean(), null()})
      g_.add(any_value_, {s});
    return any_value_;
  }

  Symbol any_object() {
    any_value();
    return any_object_;
  }

  Symbol ws() {
    if (ws_ < 0) {
      ByteSet s;
      for (char c : {' ', '\t', '\n', '\r'}) s.set(static_cast<uint8_t>(c));
      ws_ = g_.repeat({g_.bytes(s)}, 0, kMaxWhitespace);
    }
    return ws_;
  }

 private:
  [[noreturn]] static void fail(const std::string& where, const std::string& what) {
    throw Error("schema #" + where + ": " + what);
  }

  static size_t annotations(const json& schema) {
    size_t n = 0;
    for (auto it = schema.begin(); it != schema.end(); ++it) n += kAnnotations.count(it.key());
    return n;
  }

  Symbol typed(const std::string& type, const json& schema, const std::string& where) {
    if (type == "object") return object(schema, where);
    if (type == "array") return array(schema, where);
    if (type == "string") return string(schema, where);
    if (type == "integer") return integer();
    if (type == "number") return number();
    if (type == "boolean") return boolean();
    if (type == "null") return null();
    fail(where + "/type", "unknown type '" + type + "'");
  }

  // The schema a $ref names (nullptr: none of this document).
  const json* resolve(const std::string& r) const {
    if (r == "#") return &root_;
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      const std::string p = prefix;
      if (r.rfind(p, 0) != 0) continue;
      const std::string name = r.substr(p.size());
      const auto defs = root_.find(p.substr(2, p.size() - 3));
      if (defs != root_.end() && defs->is_object() && defs->contains(name)) return &(*defs)[name];
    }
    return nullptr;
  }

  Symbol reference(const json& schema, const std::string& where) {
    const json& ref = schema["$ref"];
    if (!ref.is_string()) fail(where + "/$ref", "'$ref' must be a string");
    const std::string r = ref.get<std::string>();
    // Also for a $ref compiled already: the cycle may close through it.
    if (!leading_.empty()) leads_to_[leading_.back()].insert(r);
    if (auto it = refs_.find(r); it != refs_.end()) return it->second;
    const json* target = resolve(r);
    if (!target)
      fail(where + "/$ref", "'" + r + "' does not name a schema of this document (#/$defs/...)");
    // The rule exists before its body is compiled, so a schema may refer to itself.
    const Symbol rule = g_.new_rule();
    refs_.emplace(r, rule);
    leading_.push_back(r);
    g_.add(rule, {value(*target, r.substr(1))});
    leading_.pop_back();
    return rule;
  }

 public:
  // A $ref that leads to itself before any byte of its value is left recursion, which the
  // grammar refuses by its internal rule numbers: this names the cycle of $refs instead.
  void check_ref_cycles() const {
    std::map<std::string, int> mark;  // absent: unseen, 1: on the path, 2: done
    // Depth-first with an explicit stack: a chain of $refs may be 1000 long.
    std::vector<std::pair<std::string, std::set<std::string>::const_iterator>> stack;
    for (const auto& [start, _] : leads_to_) {
      if (mark.count(start)) continue;
      auto push = [&](const std::string& r) {
        mark[r] = 1;
        static const std::set<std::string> kNone;
        const auto it = leads_to_.find(r);
        stack.emplace_back(r, (it == leads_to_.end() ? kNone : it->second).begin());
      };
      push(start);
      while (!stack.empty()) {
        auto& [r, next] = stack.back();
        const auto it = leads_to_.find(r);
        if (it == leads_to_.end() || next == it->second.end()) {
          mark[r] = 2;
          stack.pop_back();
          continue;
        }
        const std::string s = *next++;
        if (mark.count(s) && mark[s] == 1) {
          std::string cycle;
          bool on = false;
          for (const auto& frame : stack) {
            on = on || frame.first == s;
            if (on) cycle += frame.first + " -> ";
          }
          fail("", "'$ref' cycle: " + cycle + s +
                       " reaches itself without consuming input (it would never write a byte)");
        }
        if (!mark.count(s)) push(s);
      }
    }
  }

 private:
  // The types a value has (an integral number is an integer and a number, as in JSON Schema).
  template <class Json>
  static std::set<std::string> types_of(const Json& v) {
    if (v.is_number()) {
      const double d = v.template get<double>();
      const bool integral = !v.is_number_float() || std::trunc(d) == d;
      return integral ? std::set<std::string>{"integer", "number"}
                      : std::set<std::string>{"number"};
    }
    if (v.is_string()) return {"string"};
    if (v.is_boolean()) return {"boolean"};
    if (v.is_null()) return {"null"};
    return {v.is_array() ? "array" : "object"};
  }

  // The types `schema`'s 'type' names, with 'integer' where it names 'number' (a subset).
  static std::set<std::string> declared_types(const json& schema, const std::string& where) {
    static const std::set<std::string> kTypes = {"object", "array",   "string", "integer",
                                                 "number", "boolean", "null"};
    const json& type = schema["type"];
    std::vector<json> names;
    if (type.is_array() && !type.empty())
      names.assign(type.begin(), type.end());
    else
      names.push_back(type);
    std::set<std::string> out;
    for (const auto& t : names) {
      if (!t.is_string()) fail(where + "/type", "'type' must be a type name or a list of them");
      if (!kTypes.count(t.get<std::string>()))
        fail(where + "/type", "unknown type '" + t.get<std::string>() + "'");
      out.insert(t.get<std::string>());
    }
    if (out.count("number")) out.insert("integer");
    return out;
  }

  // A 'type' beside const or enum: every value must have it, else the value is refused by where
  // it is (the grammar writes the values, so a type they lack would not be enforced).
  static void check_type(const json& schema, const json& v, const std::string& where,
                         const std::string& value_where) {
    if (!schema.contains("type")) return;
    const std::set<std::string> declared = declared_types(schema, where);
    for (const auto& t : types_of(v))
      if (declared.count(t)) return;
    fail(value_where, v.dump() + " is not of the schema's 'type' (" + schema["type"].dump() + ")");
  }

  // What a schema may match, as far as telling oneOf's schemas apart needs: its literal values
  // (const, enum) or else the types it allows (all of them when it does not say).
  struct Kinds {
    bool literal = false;
    std::vector<nlohmann::json> values;  // unordered: objects equal whatever their key order
    std::set<std::string> types;
    // An object schema's required properties whose values are listed (const, enum): two object
    // schemas whose lists for one such property share no value match no common object (a tagged
    // union, as Pydantic writes one with a callable discriminator).
    std::map<std::string, std::set<nlohmann::json>> tags;
  };

  // `budget`: what is left of the work one oneOf may cost (schemas visited and values copied);
  // past it, assume the worst. Without it a few branches of $refs back to the root were
  // branches^depth calls (six took over 8 s on the HTTP thread).
  Kinds kinds(const json& schema, int depth, int64_t& budget) const {
    static const std::set<std::string> kAll = {"object", "array",   "string", "integer",
                                               "number", "boolean", "null"};
    Kinds k;
    k.types = kAll;
    // Past a few $refs (or a cycle of them), assume the worst.
    if (depth > 32 || !schema.is_object() || --budget < 0) return k;
    if (schema.contains("$ref") && schema["$ref"].is_string()) {
      const json* target = resolve(schema["$ref"].get<std::string>());
      return target ? kinds(*target, depth + 1, budget) : k;
    }
    auto literals = [&](const std::vector<json>& values) {
      budget -= static_cast<int64_t>(values.size());
      if (budget < 0) return k;
      k.literal = true;
      k.types.clear();
      for (const auto& v : values) k.values.push_back(nlohmann::json::parse(v.dump()));
      return k;
    };
    if (schema.contains("const")) return literals({schema["const"]});
    if (schema.contains("enum") && schema["enum"].is_array())
      return literals(std::vector<json>(schema["enum"].begin(), schema["enum"].end()));
    for (const char* c : {"anyOf", "oneOf"})
      if (schema.contains(c) && schema[c].is_array()) {
        Kinds all;
        for (const auto& branch : schema[c]) {
          const Kinds b = kinds(branch, depth + 1, budget);
          for (const auto& v : b.values)
            for (const auto& t : types_of(v)) all.types.insert(t);
          all.types.insert(b.types.begin(), b.types.end());
        }
        return all;
      }
    if (schema.contains("allOf") && schema["allOf"].is_array() && schema["allOf"].size() == 1)
      return kinds(schema["allOf"][0], depth + 1, budget);
    if (schema.contains("type") && (schema["type"].is_string() || schema["type"].is_array())) {
      k.types.clear();
      for (const auto& t : schema["type"])
        if (t.is_string()) k.types.insert(t.get<std::string>());
      if (k.types.count("number")) k.types.insert("integer");
    }
    if (k.types == std::set<std::string>{"object"} && schema.contains("properties") &&
        schema["properties"].is_object() && schema.contains("required") &&
        schema["required"].is_array()) {
      for (const auto& name : schema["required"]) {
        if (!name.is_string() || !schema["properties"].contains(name.get<std::string>())) continue;
        const Kinds p = kinds(schema["properties"][name.get<std::string>()], depth + 1, budget);
        if (p.literal) k.tags[name.get<std::string>()] = {p.values.begin(), p.values.end()};
      }
    }
    return k;
  }

  static bool overlap(const Kinds& a, const Kinds& b) {
    auto meets = [](const Kinds& literal, const std::set<std::string>& types) {
      for (const auto& v : literal.values)
        for (const auto& t : types_of(v))
          if (types.count(t)) return true;
      return false;
    };
    if (a.literal && b.literal) {
      // nlohmann::json's order is JSON Schema's equality here: 1 and 1.0 are equivalent, objects
      // compare by their members. A set: enums may hold many thousand values.
      const std::set<nlohmann::json> theirs(b.values.begin(), b.values.end());
      for (const auto& x : a.values)
        if (theirs.count(x)) return true;
      return false;
    }
    if (a.literal) return meets(a, b.types);
    if (b.literal) return meets(b, a.types);
    std::set<std::string> common;
    for (const auto& t : a.types)
      if (b.types.count(t)) common.insert(t);
    if (common.empty()) return false;
    if (common == std::set<std::string>{"object"}) {
      for (const auto& [name, values] : a.tags) {
        const auto theirs = b.tags.find(name);
        if (theirs == b.tags.end()) continue;
        if (std::none_of(values.begin(), values.end(),
                         [&](const nlohmann::json& v) { return theirs->second.count(v) > 0; }))
          return false;  // told apart by this property's value
      }
    }
    return true;
  }

  // oneOf compiles as anyOf: that is exact only when no value matches two of its schemas, which
  // is checked here for what tells them apart without a doubt (distinct types, distinct values).
  void check_disjoint(const json& list, const std::string& where) const {
    std::vector<Kinds> branches;
    int64_t budget = 100'000;
    for (const auto& b : list) branches.push_back(kinds(b, 0, budget));
    for (size_t i = 0; i < branches.size(); ++i)
      for (size_t j = i + 1; j < branches.size(); ++j)
        if (overlap(branches[i], branches[j]))
          fail(where,
               "'oneOf' is supported only where no value can match two of its schemas "
               "(they allow distinct types, list distinct const/enum values, or are objects "
               "with a required property whose listed values differ); schemas " +
                   std::to_string(i) + " and " + std::to_string(j) +
                   " may both match a value (use 'anyOf' if that is meant)");
  }

  static std::string literal_text(const json& v) {
    return v.dump(-1, ' ', false, json::error_handler_t::strict);
  }
  Symbol literal_value(const json& v) { return g_.one_of_texts({literal_text(v)}); }

  // A JSON string of min..max characters (max < 0: no limit).
  Symbol string_rule(int64_t min, int64_t max) {
    const auto key = std::make_pair(min, max);
    if (auto it = strings_.find(key); it != strings_.end()) return it->second;
    const Symbol s = g_.any_of({{g_.byte('"'), g_.repeat({character()}, min, max), g_.byte('"')}});
    strings_.emplace(key, s);
    return s;
  }

  Symbol string(const json& schema, const std::string& where) {
    auto bound = [&](const char* k, int64_t dflt) {
      if (!schema.contains(k)) return dflt;
      const json& v = schema[k];
      if (!v.is_number_unsigned() || v.get<uint64_t>() > 100'000)
        fail(where + "/" + k, std::string("'") + k + "' must be an integer from 0 to 100000");
      return static_cast<int64_t>(v.get<uint64_t>());
    };
    const int64_t min = bound("minLength", 0), max = bound("maxLength", -1);
    if (max >= 0 && max < min) fail(where, "'maxLength' is below 'minLength'");
    return string_rule(min, max);
  }

  // One character of a JSON string: unescaped, or an escape sequence.
  Symbol character() {
    if (character_ >= 0) return character_;
    ByteSet plain = byte_range(0x20, 0x7F);
    plain.reset('"');
    plain.reset('\\');
    std::vector<Sequence> alts = {{g_.bytes(plain)}};
    for (auto& seq : utf8_range(g_, 0x80, 0x10FFFF)) alts.push_back(std::move(seq));
    ByteSet escaped;
    for (char c : std::string("\"\\/bfnrt")) escaped.set(static_cast<uint8_t>(c));
    alts.push_back({g_.byte('\\'), g_.bytes(escaped)});
    ByteSet hex = byte_range('0', '9') | byte_range('a', 'f') | byte_range('A', 'F');
    const Symbol h = g_.bytes(hex);
    alts.push_back({g_.byte('\\'), g_.byte('u'), h, h, h, h});
    character_ = g_.any_of(std::move(alts));
    return character_;
  }

  Symbol integer() {
    if (integer_ >= 0) return integer_;
    const Symbol digit = g_.bytes(byte_range('0', '9'));
    const Symbol sign = g_.repeat({g_.byte('-')}, 0, 1);
    const Symbol magnitude =
        g_.any_of({{g_.byte('0')},
                   {g_.bytes(byte_range('1', '9')), g_.repeat({digit}, 0, kMaxIntegerDigits - 1)}});
    integer_ = g_.any_of({{sign, magnitude}});
    return integer_;
  }

  Symbol number() {
    if (number_ >= 0) return number_;
    const Symbol digit = g_.bytes(byte_range('0', '9'));
    ByteSet e, pm;
    e.set('e');
    e.set('E');
    pm.set('+');
    pm.set('-');
    const Symbol fraction =
        g_.repeat({g_.byte('.'), g_.repeat({digit}, 1, kMaxFractionDigits)}, 0, 1);
    const Symbol exponent = g_.repeat(
        {g_.bytes(e), g_.repeat({g_.bytes(pm)}, 0, 1), g_.repeat({digit}, 1, kMaxExponentDigits)},
        0, 1);
    number_ = g_.any_of({{integer(), fraction, exponent}});
    return number_;
  }

  Symbol boolean() { return g_.any_of({g_.literal("true"), g_.literal("false")}); }
  Symbol null() { return g_.any_of({g_.literal("null")}); }

  Symbol array(const json& schema, const std::string& where) {
    auto bound = [&](const char* k, int64_t dflt) {
      if (!schema.contains(k)) return dflt;
      const json& v = schema[k];
      if (!v.is_number_unsigned() || v.get<uint64_t>() > 10'000)
        fail(where + "/" + k, std::string("'") + k + "' must be an integer from 0 to 10000");
      return static_cast<int64_t>(v.get<uint64_t>());
    };
    const int64_t min = bound("minItems", 0), max = bound("maxItems", -1);
    if (max >= 0 && max < min) fail(where, "'maxItems' is below 'minItems'");
    // After '[': a $ref in the items consumes a byte before it is reached.
    const auto leading = std::exchange(leading_, {});
    const Symbol item =
        schema.contains("items") ? value(schema["items"], where + "/items") : any_value();
    leading_ = leading;
    const Symbol r = g_.new_rule();
    if (max != 0) {
      const Sequence more = {ws(), g_.byte(','), ws(), item};
      g_.add(r, {g_.byte('['), ws(), item,
                 g_.repeat(more, std::max<int64_t>(min - 1, 0), max < 0 ? -1 : max - 1), ws(),
                 g_.byte(']')});
    }
    if (min == 0) g_.add(r, {g_.byte('['), ws(), g_.byte(']')});
    return r;
  }

  Symbol object(const json& schema, const std::string& where) {
    const json props = schema.value("properties", json::object());
    if (!props.is_object()) fail(where + "/properties", "'properties' must be an object");
    // By name in a set: an ordered object finds a key by a linear search.
    std::set<std::string> names;
    for (auto it = props.begin(); it != props.end(); ++it) names.insert(it.key());
    std::set<std::string> required;
    if (schema.contains("required")) {
      const json& req = schema["required"];
      if (!req.is_array()) fail(where + "/required", "'required' must be a list of names");
      for (const auto& n : req) {
        if (!n.is_string() || !names.count(n.get<std::string>()))
          fail(where + "/required",
               "'required' names " + n.dump() + ", which 'properties' does not describe");
        required.insert(n.get<std::string>());
      }
    }
    // After '{': a $ref in a member's value consumes a byte before it is reached.
    struct Restore {
      std::vector<std::string>& leading;
      std::vector<std::string> saved;
      ~Restore() { leading = std::move(saved); }
    } restore{leading_, std::exchange(leading_, {})};
    const json extra = schema.value("additionalProperties", json(true));
    if (props.empty()) {
      // No listed properties: any members, of the additionalProperties schema when one is given.
      if (extra.is_boolean() && !extra.get<bool>())
        return g_.any_of({{g_.byte('{'), ws(), g_.byte('}')}});
      if (extra.is_boolean()) return any_object();
      const Symbol v = value(extra, where + "/additionalProperties");
      const Sequence member = {string_rule(0, -1), ws(), g_.byte(':'), ws(), v};
      Sequence more = {ws(), g_.byte(','), ws()};
      more.insert(more.end(), member.begin(), member.end());
      Sequence filled = {g_.byte('{'), ws()};
      filled.insert(filled.end(), member.begin(), member.end());
      filled.insert(filled.end(), {g_.repeat(more, 0, -1), ws(), g_.byte('}')});
      return g_.any_of({std::move(filled), {g_.byte('{'), ws(), g_.byte('}')}});
    }
    if (!extra.is_boolean() && !extra.is_object())
      fail(where + "/additionalProperties", "'additionalProperties' must be a boolean or a schema");
    // Members in the schema's order; optional ones may be left out. key[i]: member i or, when it
    // is optional, any later one; after[i]: what may follow member i. The comma and white space
    // before a member are read once, before the choice of key: as part of each key's alternative
    // they held one parse stack per optional member left, stepped at every node of a mask's walk.
    std::vector<std::pair<std::string, Symbol>> members;
    for (auto it = props.begin(); it != props.end(); ++it)
      members.emplace_back(it.key(), value(it.value(), where + "/properties/" + it.key()));
    const size_t n = members.size();
    // optional_from[i]: members i.. are all optional (so the object may end before i).
    std::vector<bool> optional_from(n + 1, true);
    for (size_t i = n; i-- > 0;)
      optional_from[i] = optional_from[i + 1] && !required.count(members[i].first);
    std::vector<Symbol> key(n);
    Symbol after = g_.any_of({{}});  // after the last member
    for (size_t i = n; i-- > 0;) {
      Sequence take = g_.literal(json(members[i].first).dump());
      take.insert(take.end(), {ws(), g_.byte(':'), ws(), members[i].second, after});
      std::vector<Sequence> alts = {std::move(take)};
      if (i + 1 < n && !required.count(members[i].first)) alts.push_back({key[i + 1]});
      key[i] = g_.any_of(std::move(alts));
      if (i > 0) {
        std::vector<Sequence> next = {{ws(), g_.byte(','), ws(), key[i]}};
        if (optional_from[i]) next.push_back({});
        after = g_.any_of(std::move(next));
      }
    }
    std::vector<Sequence> body = {{g_.byte('{'), ws(), key[0], ws(), g_.byte('}')}};
    if (optional_from[0]) body.push_back({g_.byte('{'), ws(), g_.byte('}')});
    return g_.any_of(std::move(body));
  }

  Grammar& g_;
  const json& root_;
  std::map<std::string, Symbol> refs_;
  // $refs being compiled with no byte of their value read yet (the innermost last), and the
  // $refs each reaches that way.
  std::vector<std::string> leading_;
  std::map<std::string, std::set<std::string>> leads_to_;
  std::map<std::pair<int64_t, int64_t>, Symbol> strings_;
  int depth_ = 0;  // value() calls under way
  Symbol any_value_ = -1, any_object_ = -1, ws_ = -1, character_ = -1, integer_ = -1, number_ = -1;
};

}  // namespace

Grammar::Symbol json_schema_rule(Grammar& g, const nlohmann::ordered_json& schema) {
  const size_t first = g.rules();
  SchemaCompiler c(g, schema);
  const Symbol v = c.value(schema, "");
  c.check_ref_cycles();
  // Rules from before this schema's were checked with theirs.
  if (!g.productive(first)[size_t(v) - first])
    throw Error(
        "schema #: the schema admits no finite value (each value it allows must hold another "
        "value of the same schema, such as a required property whose schema refers back to it)");
  return g.any_of({{c.ws(), v, c.ws()}});
}

Grammar::Symbol json_object_rule(Grammar& g) {
  const json empty = json::object();
  SchemaCompiler c(g, empty);
  const Symbol v = c.any_object();
  return g.any_of({{c.ws(), v, c.ws()}});
}

}  // namespace tandem::structured
