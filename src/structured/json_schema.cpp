#include "structured/json_schema.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "structured/regex.h"
#include "structured/string_formats.h"
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
const std::set<std::string> kEnforced = {"type",
                                         "properties",
                                         "required",
                                         "additionalProperties",
                                         "items",
                                         "minItems",
                                         "maxItems",
                                         "enum",
                                         "const",
                                         "anyOf",
                                         "oneOf",
                                         "allOf",
                                         "$ref",
                                         "minLength",
                                         "maxLength",
                                         "pattern",
                                         "format",
                                         "minimum",
                                         "maximum",
                                         "exclusiveMinimum",
                                         "exclusiveMaximum"};

// The largest counts a schema may ask for, and each count keyword's.
constexpr int64_t kMaxItems = 10'000;
constexpr int64_t kMaxCharacters = 100'000;
const std::pair<const char*, int64_t> kCounts[] = {{"minItems", kMaxItems},
                                                   {"maxItems", kMaxItems},
                                                   {"minLength", kMaxCharacters},
                                                   {"maxLength", kMaxCharacters}};
// The numeric bounds, enforced on integers.
const char* const kBounds[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"};
// The largest integer an answer may write: kMaxIntegerDigits nines.
constexpr int64_t kLargestInteger = 9'999'999'999'999'999;
static_assert(kMaxIntegerDigits == 16, "kLargestInteger has kMaxIntegerDigits digits");

class SchemaCompiler {
 public:
  SchemaCompiler(Grammar& g, const json& root, bool disable_additional_properties = false)
      : g_(g), root_(root), disable_additional_properties_(disable_additional_properties) {}

  Symbol value(const json& schema, const std::string& where) {
    try {
      return compile_value(schema, where);
    } catch (const GrammarTooLarge&) {
      // The innermost schema being compiled when the grammar passed its size, for too_large().
      if (!passed_at_) passed_at_ = where;
      throw;
    }
  }

  Symbol compile_value(const json& schema, const std::string& where) {
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
          std::string c, v;
          canonical(schema["const"], c);
          for (const auto& e : schema["enum"]) {
            v.clear();
            canonical(e, v);
            if (v == c) return true;
          }
          return false;
        };
        for (auto it = schema.begin(); it != schema.end(); ++it)
          if (it.key() != k && !kAnnotations.count(it.key()) && !(literal && it.key() == "type") &&
              !redundant_enum(it.key()))
            fail(where, "the keyword '" + it.key() + "' beside '" + k +
                            "' is not supported (it would not be enforced)");
        break;
      }
    if (schema.contains("const")) {
      check_type(schema, declared_types(schema, where), schema["const"], where + "/const");
      return literal_value(schema["const"]);
    }
    if (schema.contains("enum")) {
      const json& e = schema["enum"];
      if (!e.is_array() || e.empty()) fail(where + "/enum", "'enum' must be a non-empty list");
      const uint8_t declared = declared_types(schema, where);
      std::vector<std::string> texts;
      for (size_t i = 0; i < e.size(); ++i) {
        check_type(schema, declared, e[i], where + "/enum/" + std::to_string(i));
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
    // A count keyword is checked wherever it stands, also where it does not apply (maxItems
    // beside "type": "string"): a malformed schema is the client's mistake to hear of.
    for (const auto& [k, most] : kCounts) count(schema, k, most, 0, where);
    for (const char* k : kBounds) bound(schema, k, where);
    for (const char* k : {"pattern", "format"})
      if (schema.contains(k) && !schema[k].is_string())
        fail(where + "/" + k, std::string("'") + k + "' must be a string");
    if (!schema.contains("type")) {
      if (schema.contains("properties") || schema.contains("required") ||
          schema.contains("additionalProperties"))
        return object(schema, where);
      // Item counts constrain only arrays, so any other value would satisfy them too; arrays
      // alone are generated, or an unbounded value could break them.
      if (schema.contains("items") || schema.contains("minItems") || schema.contains("maxItems"))
        return array(schema, where);
      if (schema.contains("minLength") || schema.contains("maxLength") ||
          schema.contains("pattern") || schema.contains("format"))
        return string(schema, where);
      // Bounds alike constrain only numbers, and are enforced where the schema says which.
      for (const char* k : kBounds)
        if (schema.contains(k))
          fail(where + "/" + k, std::string("'") + k +
                                    "' is enforced on integers and numbers only: give the schema "
                                    "\"type\": \"integer\" or \"number\"");
      return any_value();
    }
    const std::vector<std::string> types = type_names(schema, where);
    if (types.size() == 1) return typed(types[0], schema, where);
    std::vector<Sequence> alts;
    for (const auto& t : types) alts.push_back({typed(t, schema, where)});
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

  // A grammar too large, said with the bounds that take large parts of it (lengths beside
  // patterns and formats, each within kMaxCountedSteps, and plain strings' lengths and arrays'
  // item counts, each within its keyword's most; several may pass Grammar::kMaxSymbols
  // together), largest first: those of an eighth of kMaxSymbols or more, else the three largest
  // of a 64th or more. They are "most of it" only where together they take over half. Where no
  // bound takes that much, the schema where the grammar passed its size is named instead.
  std::string too_large(const GrammarTooLarge& e) const {
    std::vector<Part> large;
    for (const auto& c : parts_)
      if (c.symbols >= Grammar::kMaxSymbols / 8) large.push_back(c);
    if (large.empty()) {
      for (const auto& c : parts_)
        if (c.symbols >= Grammar::kMaxSymbols / 64) large.push_back(c);
      std::stable_sort(large.begin(), large.end(),
                       [](const auto& a, const auto& b) { return a.symbols > b.symbols; });
      large.resize(std::min<size_t>(large.size(), 3));
    }
    std::string out = std::string("schema #: ") + e.what();
    if (large.empty()) return out + ", and it passed that size at #" + passed_at_.value_or("");
    std::stable_sort(large.begin(), large.end(),
                     [](const auto& a, const auto& b) { return a.symbols > b.symbols; });
    size_t named = 0;
    bool all_counted = true;
    for (const auto& c : large) {
      named += c.symbols;
      all_counted = all_counted && c.counted;
    }
    out += named > Grammar::kMaxSymbols / 2 ? ", most of it" : ", the largest parts of it";
    out += all_counted ? " the lengths beside patterns and formats, counted once per length: "
                       : " the lengths and item counts, written out once per character or item "
                         "(beside a pattern or format, its automaton once per length): ";
    for (size_t i = 0; i < large.size(); ++i)
      out += (i ? ", #" : "#") + large[i].bound + " (" + std::to_string(large[i].symbols) +
             (large[i].stopped ? " symbols, where it passed the limit)" : " symbols)");
    return out + "; lower " + (large.size() > 1 ? "these bounds" : "this bound");
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
    if (type == "integer") return integer(schema, where);
    if (type == "number") return bounded_number(schema, where);
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
  // JSON Schema's types as bits, so that sets of them are compared in one step.
  enum : uint8_t {
    kObject = 1,
    kArray = 2,
    kString = 4,
    kInteger = 8,
    kNumber = 16,
    kBoolean = 32,
    kNull = 64,
    kAllTypes = 127
  };
  static uint8_t type_bit(const std::string& name) {
    static const std::map<std::string, uint8_t> kBits = {
        {"object", kObject}, {"array", kArray},     {"string", kString}, {"integer", kInteger},
        {"number", kNumber}, {"boolean", kBoolean}, {"null", kNull}};
    const auto it = kBits.find(name);
    return it == kBits.end() ? 0 : it->second;
  }

  // The types a value has (an integral number is an integer and a number, as in JSON Schema).
  static uint8_t types_of(const json& v) {
    if (v.is_number()) {
      const double d = v.get<double>();
      const bool integral = !v.is_number_float() || std::trunc(d) == d;
      return integral ? kInteger | kNumber : kNumber;
    }
    if (v.is_string()) return kString;
    if (v.is_boolean()) return kBoolean;
    if (v.is_null()) return kNull;
    return v.is_array() ? kArray : kObject;
  }

  // The names 'type' gives (one, or a list), each a known type named once: JSON Schema wants a
  // list's names unique, and a list of 16,000 'null's was checked against every enum value.
  static std::vector<std::string> type_names(const json& schema, const std::string& where) {
    const json& type = schema["type"];
    if (type.is_string()) {
      if (!type_bit(type.get<std::string>()))
        fail(where + "/type", "unknown type '" + type.get<std::string>() + "'");
      return {type.get<std::string>()};
    }
    if (!type.is_array() || type.empty())
      fail(where + "/type", "'type' must be a type name or a list of them");
    std::vector<std::string> out;
    uint8_t seen = 0;
    for (const auto& t : type) {
      if (!t.is_string()) fail(where + "/type", "'type' must list type names");
      const uint8_t bit = type_bit(t.get<std::string>());
      if (!bit) fail(where + "/type", "unknown type '" + t.get<std::string>() + "'");
      if (seen & bit) fail(where + "/type", "'type' lists '" + t.get<std::string>() + "' twice");
      seen |= bit;
      out.push_back(t.get<std::string>());
    }
    return out;
  }

  // The types `schema`'s 'type' names (all when it has none), with 'integer' where it names
  // 'number' (a subset).
  static uint8_t declared_types(const json& schema, const std::string& where) {
    if (!schema.contains("type")) return kAllTypes;
    uint8_t out = 0;
    for (const auto& t : type_names(schema, where)) out |= type_bit(t);
    if (out & kNumber) out |= kInteger;
    return out;
  }

  // A 'type' beside const or enum: every value must have it, else the value is refused by where
  // it is (the grammar writes the values, so a type they lack would not be enforced). `declared`:
  // declared_types(schema), worked out once for all the values.
  static void check_type(const json& schema, uint8_t declared, const json& v,
                         const std::string& value_where) {
    if (types_of(v) & declared) return;
    fail(value_where, v.dump() + " is not of the schema's 'type' (" + schema["type"].dump() + ")");
  }

  // A value as text such that two values are equal in JSON Schema's sense exactly when their
  // texts are: members sorted by key, a whole number written as an integer (1.0 equals 1),
  // strings with their length so that no text is another's prefix. Hashable, so oneOf's value
  // lists are compared by lookups. Recursive: parsed documents nest at most 64 levels.
  static void canonical(const json& v, std::string& out) {
    if (v.is_object()) {
      std::vector<std::pair<const std::string*, const json*>> members;
      for (auto it = v.begin(); it != v.end(); ++it) members.emplace_back(&it.key(), &it.value());
      std::sort(members.begin(), members.end(),
                [](const auto& a, const auto& b) { return *a.first < *b.first; });
      out += '{';
      for (const auto& [k, m] : members) {
        out += std::to_string(k->size());
        out += ':';
        out += *k;
        canonical(*m, out);
      }
      out += '}';
    } else if (v.is_array()) {
      out += '[';
      for (const auto& e : v) canonical(e, out);
      out += ']';
    } else if (v.is_string()) {
      const auto& s = v.get_ref<const std::string&>();
      out += 's';
      out += std::to_string(s.size());
      out += ':';
      out += s;
    } else if (v.is_number_unsigned()) {
      out += 'i';
      out += std::to_string(v.get<uint64_t>());
    } else if (v.is_number_integer()) {
      out += 'i';
      out += std::to_string(v.get<int64_t>());
    } else if (v.is_number_float()) {
      const double d = v.get<double>();
      if (std::trunc(d) == d && d >= -9.2e18 && d <= 9.2e18) {
        out += 'i';
        out += std::to_string(static_cast<int64_t>(d));
      } else if (std::trunc(d) == d && d >= 0 && d <= 1.8e19) {
        out += 'i';
        out += std::to_string(static_cast<uint64_t>(d));
      } else {
        char buf[40];
        std::snprintf(buf, sizeof buf, "d%.17g", d);
        out += buf;
      }
    } else {
      out += v.is_null() ? "n" : v.get<bool>() ? "t" : "f";
    }
  }

  // What a schema may match, as far as telling oneOf's schemas apart needs: its literal values
  // (const, enum) or else the types it allows (all of them when it does not say).
  struct Kinds {
    bool literal = false;
    std::unordered_set<std::string> values;  // canonical() texts
    uint8_t value_types = 0;                 // the types the values have
    uint8_t types = kAllTypes;               // none for a literal
    // An object schema's required properties whose values are listed (const, enum): two object
    // schemas whose lists for one such property share no value match no common object (a tagged
    // union, as Pydantic writes one with a callable discriminator).
    std::map<std::string, std::shared_ptr<const Kinds>> tags;
  };
  using KindsPtr = std::shared_ptr<const Kinds>;

  // The work telling every oneOf's schemas apart may cost, for the whole document: schemas
  // visited, bytes of const/enum values read, pairs of object schemas compared. Each schema's
  // Kinds is worked out once (a $ref to a 49,000-value enum beside an integer under 4000
  // properties read the enum 4000 times: 138 s on the HTTP thread), and branches are compared by
  // lookups, not pair by pair (a oneOf of 49,000 consts took 45 s).
  static constexpr int64_t kMaxOneOfWork = 4'000'000;

  void charge(int64_t units, const std::string& where) {
    oneof_work_ += units;
    if (oneof_work_ > kMaxOneOfWork)
      fail(where, "telling the schemas of this document's 'oneOf's apart takes more than " +
                      std::to_string(kMaxOneOfWork) +
                      " steps (schemas visited, bytes of const/enum values, pairs of object "
                      "schemas compared); use 'anyOf' where no value can match two schemas");
  }

  KindsPtr kinds(const json& schema, int depth, const std::string& where) {
    static const KindsPtr kAny = std::make_shared<const Kinds>();
    // Past a few $refs, or round a cycle of them, assume the worst.
    if (depth > 32 || !schema.is_object()) return kAny;
    charge(1, where);
    if (auto it = kinds_.find(&schema); it != kinds_.end()) return it->second;
    if (!kinds_open_.insert(&schema).second) return kAny;
    KindsPtr k = kinds_of(schema, depth, where);
    kinds_open_.erase(&schema);
    kinds_.emplace(&schema, k);
    return k;
  }

  KindsPtr kinds_of(const json& schema, int depth, const std::string& where) {
    auto k = std::make_shared<Kinds>();
    if (schema.contains("$ref") && schema["$ref"].is_string()) {
      const json* target = resolve(schema["$ref"].get<std::string>());
      return target ? kinds(*target, depth + 1, where) : k;
    }
    auto literals = [&](const json* begin, size_t n) {
      k->literal = true;
      k->types = 0;
      for (size_t i = 0; i < n; ++i) {
        std::string text;
        canonical(begin[i], text);
        charge(int64_t(text.size()), where);
        k->value_types |= types_of(begin[i]);
        k->values.insert(std::move(text));
      }
      return k;
    };
    if (schema.contains("const")) return literals(&schema["const"], 1);
    if (schema.contains("enum") && schema["enum"].is_array()) {
      const auto& values = schema["enum"].get_ref<const json::array_t&>();
      return literals(values.data(), values.size());
    }
    for (const char* c : {"anyOf", "oneOf"})
      if (schema.contains(c) && schema[c].is_array()) {
        k->types = 0;
        for (const auto& branch : schema[c]) {
          const KindsPtr b = kinds(branch, depth + 1, where);
          k->types |= b->types | b->value_types;
        }
        return k;
      }
    if (schema.contains("allOf") && schema["allOf"].is_array() && schema["allOf"].size() == 1)
      return kinds(schema["allOf"][0], depth + 1, where);
    if (schema.contains("type")) {
      const json& type = schema["type"];
      if (type.is_string()) {
        k->types = type_bit(type.get<std::string>());
      } else if (type.is_array()) {
        k->types = 0;
        for (const auto& t : type)
          if (t.is_string()) k->types |= type_bit(t.get<std::string>());
      }
      if (k->types & kNumber) k->types |= kInteger;
    }
    if (k->types == kObject && schema.contains("properties") && schema["properties"].is_object() &&
        schema.contains("required") && schema["required"].is_array()) {
      const json& props = schema["properties"];
      for (const auto& name : schema["required"]) {
        if (!name.is_string()) continue;
        const auto p = props.find(name.get<std::string>());
        if (p == props.end()) continue;
        KindsPtr pk = kinds(*p, depth + 1, where);
        if (pk->literal) k->tags[name.get<std::string>()] = std::move(pk);
      }
    }
    return k;
  }

  // Whether the listed values of a tag that both object schemas require tell them apart.
  bool told_apart(const Kinds& a, const Kinds& b, const std::string& where) {
    for (const auto& [name, values] : a.tags) {
      const auto theirs = b.tags.find(name);
      if (theirs == b.tags.end()) continue;
      const auto& [few, many] = values->values.size() < theirs->second->values.size()
                                    ? std::tie(values->values, theirs->second->values)
                                    : std::tie(theirs->second->values, values->values);
      charge(int64_t(few.size()), where);
      if (std::none_of(few.begin(), few.end(), [&](const auto& v) { return many.count(v) > 0; }))
        return true;
    }
    return false;
  }

  // oneOf compiles as anyOf: that is exact only when no value matches two of its schemas, which
  // is checked here for what tells them apart without a doubt (distinct types, distinct values).
  void check_disjoint(const json& list, const std::string& where) {
    std::vector<KindsPtr> branches;
    for (const auto& b : list) branches.push_back(kinds(b, 0, where));
    auto overlapping = [&](size_t i, size_t j) {
      fail(where,
           "'oneOf' is supported only where no value can match two of its schemas "
           "(they allow distinct types, list distinct const/enum values, or are objects "
           "with a required property whose listed values differ); schemas " +
               std::to_string(std::min(i, j)) + " and " + std::to_string(std::max(i, j)) +
               " may both match a value (use 'anyOf' if that is meant)");
    };
    constexpr size_t kNone = SIZE_MAX;
    // Listed values: each looked up in the longest list (read once, where its schema's Kinds was
    // made) and among the other lists' values.
    size_t longest = kNone;
    for (size_t i = 0; i < branches.size(); ++i)
      if (branches[i]->literal &&
          (longest == kNone || branches[i]->values.size() > branches[longest]->values.size()))
        longest = i;
    std::unordered_map<std::string_view, size_t> listed;
    for (size_t i = 0; i < branches.size(); ++i) {
      if (!branches[i]->literal || i == longest) continue;
      charge(int64_t(branches[i]->values.size()), where);
      for (const auto& v : branches[i]->values) {
        if (branches[longest]->values.count(v)) overlapping(i, longest);
        if (const auto [at, added] = listed.emplace(v, i); !added) overlapping(at->second, i);
      }
    }
    // Types: the first schema that allows each (object schemas may still be told apart by tags).
    std::array<size_t, 7> first;
    first.fill(kNone);
    std::vector<size_t> objects;
    for (size_t i = 0; i < branches.size(); ++i) {
      if (branches[i]->literal) continue;
      for (size_t t = 0; t < first.size(); ++t) {
        if (!((branches[i]->types >> t) & 1)) continue;
        if (uint8_t(1u << t) == kObject) {
          objects.push_back(i);
          continue;
        }
        if (first[t] != kNone) overlapping(first[t], i);
        first[t] = i;
      }
    }
    for (size_t i = 0; i < branches.size(); ++i) {
      if (!branches[i]->literal) continue;
      for (size_t t = 0; t < first.size(); ++t) {
        if (!((branches[i]->value_types >> t) & 1)) continue;
        if (first[t] != kNone) overlapping(first[t], i);
        if (uint8_t(1u << t) == kObject && !objects.empty()) overlapping(objects[0], i);
      }
    }
    if (objects.size() < 2) return;
    // A tag every object schema requires whose lists share no value tells all of them apart at
    // once (a discriminator); else they are compared pair by pair, as the budget allows.
    for (const auto& [name, _] : branches[objects[0]]->tags) {
      std::unordered_set<std::string_view> values;
      bool apart = true;
      for (size_t o : objects) {
        const auto tag = branches[o]->tags.find(name);
        if (tag == branches[o]->tags.end()) {
          apart = false;
          break;
        }
        charge(int64_t(tag->second->values.size()), where);
        for (const auto& v : tag->second->values) apart = apart && values.insert(v).second;
        if (!apart) break;
      }
      if (apart) return;
    }
    for (size_t a = 0; a < objects.size(); ++a)
      for (size_t b = a + 1; b < objects.size(); ++b) {
        charge(1, where);
        if (!told_apart(*branches[objects[a]], *branches[objects[b]], where))
          overlapping(objects[a], objects[b]);
      }
  }

  static std::string literal_text(const json& v) {
    return v.dump(-1, ' ', false, json::error_handler_t::strict);
  }
  Symbol literal_value(const json& v) { return g_.one_of_texts({literal_text(v)}); }

  // A count keyword's value (minLength, maxItems, ...): a whole number from 0 to `most`, however
  // written (JSON Schema's integers include 5.0); `absent` when the schema has none.
  static int64_t count(const json& schema, const char* k, int64_t most, int64_t absent,
                       const std::string& where) {
    if (!schema.contains(k)) return absent;
    const json& v = schema[k];
    const double d = v.is_number() ? v.get<double>() : -1;
    if (!v.is_number() || (v.is_number_integer() && !v.is_number_unsigned()) || d < 0 ||
        d > double(most) || std::trunc(d) != d)
      fail(where + "/" + k,
           std::string("'") + k + "' must be an integer from 0 to " + std::to_string(most));
    return v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>())
                                  : static_cast<int64_t>(d);
  }

  // `build()`, a part of the grammar whose size a bound sets (a length, an item count), with the
  // symbols it took, or would have taken where it passed the grammar's size, kept for
  // too_large().
  template <typename Build>
  auto sized_part(const std::string& bound, bool beside_pattern, const Build& build) {
    const size_t before = g_.symbols();
    try {
      auto built = build();
      parts_.push_back({bound, g_.symbols() - before, false, beside_pattern});
      return built;
    } catch (const GrammarTooLarge& e) {
      parts_.push_back({bound, g_.symbols() - before + e.refused, true, beside_pattern});
      if (!passed_at_) passed_at_ = bound;
      throw;
    }
  }

  // A JSON string of min..max characters (max < 0: no limit).
  Symbol string_rule(int64_t min, int64_t max) {
    const auto key = std::make_pair(min, max);
    if (auto it = strings_.find(key); it != strings_.end()) return it->second;
    const Symbol s = g_.any_of({{g_.byte('"'), g_.repeat({character()}, min, max), g_.byte('"')}});
    strings_.emplace(key, s);
    return s;
  }

  Symbol string(const json& schema, const std::string& where) {
    const int64_t min = count(schema, "minLength", kMaxCharacters, 0, where),
                  max = count(schema, "maxLength", kMaxCharacters, -1, where);
    if (max >= 0 && max < min) fail(where, "'maxLength' is below 'minLength'");
    const bool has_pattern = schema.contains("pattern"), has_format = schema.contains("format");
    if (!has_pattern && !has_format) {
      if (min == 0 && max < 0) return string_rule(min, max);
      return sized_part(where + (max >= 0 ? "/maxLength" : "/minLength"), false,
                        [&] { return string_rule(min, max); });
    }
    if (has_pattern && has_format)
      fail(where,
           "'pattern' beside 'format' is not supported (an answer would have to match both)");
    const std::string keyword = has_pattern ? "pattern" : "format";
    std::string p;
    int64_t own_most = -1;  // a format's own bound
    if (has_pattern) {
      p = schema["pattern"].get<std::string>();
    } else {
      const StringFormat f = format(schema["format"].get<std::string>(), where);
      p = f.pattern;
      own_most = f.max_length;
    }
    // The most characters, from maxLength and a format's own bound (max < 0: none).
    auto most_of = [&](int64_t max) {
      return max < 0 || own_most < 0 ? std::max(max, own_most) : std::min(max, own_most);
    };
    const int64_t most = most_of(max);
    auto quoted = [&](Symbol inside) { return g_.any_of({{g_.byte('"'), inside, g_.byte('"')}}); };
    // No lengths to count: the pattern's grammar, parsed once.
    if (min == 0 && most < 0) return quoted(pattern(p, where).rule);
    const auto key = std::make_tuple(p, min, most);
    if (auto it = bounded_.find(key); it != bounded_.end()) return it->second;
    // Parsed once for its lengths and, where they constrain, its automaton counted per length.
    std::optional<CountedPattern> counted;
    try {
      counted.emplace(p);
    } catch (const Error& e) {
      fail(where + "/" + keyword, e.what());
    }
    const RegexLengths lengths = counted->lengths();
    if (!lengths_counted(lengths, min, most)) {
      // The pattern's own grammar (the lengths add nothing), from the parse above.
      auto it = patterns_.find(p);
      if (it == patterns_.end())
        it = patterns_
                 .emplace(p,
                          RegexInJsonString{counted->whole(g_), lengths.shortest, lengths.longest})
                 .first;
      return quoted(it->second.rule);
    }
    // The lengths constrain: the pattern's automaton with a count of characters, where some
    // string of the lengths asked for matches.
    auto none = [&] {
      const std::string lengths_asked = most < 0 ? std::to_string(min) + " or more"
                                        : min == 0
                                            ? "at most " + std::to_string(most)
                                            : std::to_string(min) + " to " + std::to_string(most);
      fail(where, "no string of " + lengths_asked + " characters matches the " + keyword);
    };
    if (most >= 0 && min > most)  // past a format's own bound
      fail(where, "no string of " + std::to_string(min) + " or more characters matches the " +
                      keyword + " (its strings have at most " + std::to_string(most) + ")");
    if ((lengths.longest >= 0 && lengths.longest < min) || (most >= 0 && lengths.shortest > most))
      none();
    std::optional<Symbol> inside;
    try {
      inside = sized_part(where + (max >= 0 ? "/maxLength" : "/minLength"), true,
                          [&] { return counted->within(g_, min, most); });
    } catch (const LengthTooCostly& e) {
      too_costly(e, where, keyword, min, max, lengths, most_of);
    } catch (const PatternTooCostly& e) {
      // No bound can help: the pattern alone is to blame.
      fail(where + "/" + keyword,
           "lengths beside '" + keyword + "' are enforced through its automaton, and " + e.what() +
               " (at most " + std::to_string(kMaxCountedSteps) + " are enforced): a simpler " +
               keyword + " or no minLength and maxLength");
    }
    if (!inside) none();
    return bounded_.emplace(key, quoted(*inside)).first->second;
  }

  // Lengths min..max beside a pattern or format, too costly to count: the advice is a lower
  // bound only where one would be accepted (the highest such), else a simpler pattern. A bound
  // is accepted where the pattern needs no counting beside it, or where the counts of
  // characters it leaves fit (LengthTooCostly::counts_that_fit).
  template <typename MostOf>
  [[noreturn]] static void too_costly(const LengthTooCostly& e, const std::string& where,
                                      const std::string& keyword, int64_t min, int64_t max,
                                      RegexLengths lengths, const MostOf& most_of) {
    auto accepted = [&](int64_t least, int64_t max_length) {
      const std::optional<int64_t> counted = lengths_counted(lengths, least, most_of(max_length));
      return !counted || *counted + 1 <= e.counts_that_fit;
    };
    // The highest bound accepted below the schema's, if any leaves a string of one or more
    // characters that the pattern has.
    const std::string bound = max >= 0 ? "maxLength" : "minLength";
    int64_t lower = -1;
    if (max >= 0) {
      const int64_t m = e.counts_that_fit - 1;
      if (m >= std::max({min, lengths.shortest, int64_t{1}}) && accepted(min, m)) lower = m;
    } else {
      for (int64_t m : {e.counts_that_fit - 1, lengths.shortest})
        if (m >= 0 && m < min && accepted(m, -1)) lower = std::max(lower, m);
    }
    const std::string leave_max_out =
        max >= 0 && accepted(min, -1) ? ", or leave maxLength out" : "";
    const std::string or_without = !leave_max_out.empty() ? leave_max_out
                                   : accepted(0, -1)      ? ", or no minLength and maxLength"
                                                          : "";
    if (lower >= 0)
      fail(where + "/" + bound,
           "'" + bound + "' beside '" + keyword + "' is enforced for at most " +
               std::to_string(kMaxCountedSteps) +
               " automaton steps (each state and transition of the " + keyword +
               "'s automaton once per length up to " + bound + "), and here " + e.what() +
               ": lower " + bound + " to " + std::to_string(lower) + " or less" + leave_max_out);
    fail(where + "/" + keyword, "lengths beside '" + keyword +
                                    "' are enforced through its automaton, once per length, "
                                    "for at most " +
                                    std::to_string(kMaxCountedSteps) +
                                    " automaton steps, and here " + e.what() + "; no lower " +
                                    bound + " that leaves a string of the " + keyword +
                                    " would do: a simpler " + keyword + or_without);
  }

  // A 'pattern': its value matches it whole. JSON Schema's pattern is a search (unanchored), but
  // vLLM's default backend, xgrammar, matches it whole, and so do those who write one for an
  // answer: a search would let '[A-Z]{3}' pad any text around its three letters. An answer
  // matched whole also satisfies the search. Formats are compiled here too, as their patterns.
  RegexInJsonString pattern(const std::string& p, const std::string& where) {
    if (auto it = patterns_.find(p); it != patterns_.end()) return it->second;
    try {
      return patterns_.emplace(p, regex_in_json_string(g_, p)).first->second;
    } catch (const GrammarTooLarge&) {
      // Not this pattern's fault: json_schema_rule() names what took the space.
      throw;
    } catch (const Error& e) {
      fail(where + "/pattern", e.what());
    }
  }

  // A 'format' on a string is enforced or refused, as llguidance does by default; xgrammar lets
  // a format it does not know pass as any string, which an answer may then break.
  static StringFormat format(const std::string& f, const std::string& where) {
    std::optional<StringFormat> known = string_format(f);
    if (!known)
      fail(where + "/format", "the format '" + f +
                                  "' is not supported in structured outputs (it would not be "
                                  "enforced); supported: " +
                                  enforced_string_formats());
    return std::move(*known);
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
    // \uXXXX: a surrogate's escape only as a high one followed by a low one, and the pair is one
    // character (as JSON Schema counts it: the string holds one code point); a lone surrogate is
    // no character, and JSON parsers (nlohmann's among them) refuse it.
    ByteSet hex = byte_range('0', '9') | byte_range('a', 'f') | byte_range('A', 'F');
    const Symbol h = g_.bytes(hex);
    ByteSet not_d = hex;
    not_d.reset('d');
    not_d.reset('D');
    const Symbol d = g_.bytes(byte_range('d', 'd') | byte_range('D', 'D'));
    const Symbol low_half = g_.bytes(byte_range('0', '7'));
    const Symbol high =
        g_.bytes(byte_range('8', '9') | byte_range('a', 'b') | byte_range('A', 'B'));
    const Symbol low = g_.bytes(byte_range('c', 'f') | byte_range('C', 'F'));
    const Symbol u = g_.byte('u'), backslash = g_.byte('\\');
    alts.push_back({backslash, u, g_.bytes(not_d), h, h, h});
    alts.push_back({backslash, u, d, low_half, h, h});
    alts.push_back({backslash, u, d, high, h, h, backslash, u, d, low, h, h});
    character_ = g_.any_of(std::move(alts));
    return character_;
  }

  // A bound's value (minimum, ...): any JSON number; nothing when the schema has none.
  static std::optional<double> bound(const json& schema, const char* k, const std::string& where) {
    if (!schema.contains(k)) return std::nullopt;
    const json& v = schema[k];
    if (!v.is_number() || !std::isfinite(v.get<double>()))
      fail(where + "/" + k, std::string("'") + k + "' must be a number");
    return v.get<double>();
  }

  // An integer bound: `v` (a number or a whole number written as a float) rounded toward the
  // range (up for a lower bound, down for an upper one), then held within what an answer may
  // write, kLargestInteger either way (a bound of 1e30 bounds nothing more).
  static int64_t integer_bound(const json& v, bool lower) {
    const int64_t most = kLargestInteger + 1;  // room for the step of an exclusive bound
    if (v.is_number_unsigned()) return std::min<uint64_t>(v.get<uint64_t>(), uint64_t(most));
    if (v.is_number_integer()) return std::clamp<int64_t>(v.get<int64_t>(), -most, most);
    const double d = lower ? std::ceil(v.get<double>()) : std::floor(v.get<double>());
    return static_cast<int64_t>(std::clamp(d, double(-most), double(most)));
  }

  // The integers the schema's bounds admit, compared exactly (as Python compares an int with an
  // int or a float), within what an answer may write (lo > hi: none).
  static std::pair<int64_t, int64_t> integer_range(const json& schema) {
    int64_t lo = -kLargestInteger, hi = kLargestInteger;
    if (schema.contains("minimum")) lo = std::max(lo, integer_bound(schema["minimum"], true));
    if (schema.contains("exclusiveMinimum")) {
      // Above x: from floor(x) + 1.
      const json& x = schema["exclusiveMinimum"];
      lo = std::max(lo, integer_bound(x, false) + 1);
    }
    if (schema.contains("maximum")) hi = std::min(hi, integer_bound(schema["maximum"], false));
    if (schema.contains("exclusiveMaximum"))
      hi = std::min(hi, integer_bound(schema["exclusiveMaximum"], true) - 1);
    return {std::max(lo, -kLargestInteger), std::min(hi, kLargestInteger)};
  }

  // The texts of the integers lo..hi (lo <= hi), added to `alts`.
  void integer_texts(int64_t lo, int64_t hi, std::vector<Sequence>& alts) {
    if (lo < 0) alts.push_back({g_.byte('-'), naturals(hi < 0 ? -hi : 1, -lo)});
    if (hi >= 0) alts.push_back({naturals(std::max<int64_t>(lo, 0), hi)});
  }

  // An integer, within the schema's bounds when it has any.
  Symbol integer(const json& schema, const std::string& where) {
    bool bounded = false;
    for (const char* k : kBounds) bounded = bounded || schema.contains(k);
    if (!bounded) return integer();
    const auto [lo, hi] = integer_range(schema);
    if (lo > hi)
      fail(where, "no integer of at most " + std::to_string(kMaxIntegerDigits) +
                      " digits lies within the schema's bounds (minimum, maximum, "
                      "exclusiveMinimum, exclusiveMaximum)");
    const auto key = std::make_pair(lo, hi);
    if (auto it = integer_ranges_.find(key); it != integer_ranges_.end()) return it->second;
    std::vector<Sequence> alts;
    integer_texts(lo, hi, alts);
    const Symbol r = g_.any_of(std::move(alts));
    integer_ranges_.emplace(key, r);
    return r;
  }

  // The decimal texts of lo..hi (0 <= lo <= hi), without leading zeros: for each number of
  // digits, the texts of that length in the range.
  Symbol naturals(int64_t lo, int64_t hi) {
    std::vector<Sequence> alts;
    int64_t first = 0, past = 10;  // the numbers of one length: first..past-1
    for (size_t length = 1; first <= hi; ++length, first = past, past *= 10) {
      if (past <= lo) continue;
      same_length(std::to_string(std::max(lo, first)), std::to_string(std::min(hi, past - 1)), {},
                  alts);
      if (length == size_t(kMaxIntegerDigits)) break;
    }
    return g_.any_of(std::move(alts));
  }

  // Adds to `out` alternatives, each `prefix` then digits, that together match the digit
  // strings from a to b (as long as each other, a <= b) and no others, each one way.
  void same_length(const std::string& a, const std::string& b, Sequence prefix,
                   std::vector<Sequence>& out) {
    size_t i = 0;
    for (; i < a.size() && a[i] == b[i]; ++i) prefix.push_back(g_.byte(uint8_t(a[i])));
    if (i == a.size()) {
      out.push_back(std::move(prefix));
      return;
    }
    const std::string a_rest = a.substr(i + 1), b_rest = b.substr(i + 1);
    const bool a_rest_lowest = a_rest.find_first_not_of('0') == std::string::npos;
    const bool b_rest_highest = b_rest.find_first_not_of('9') == std::string::npos;
    // a[i] then a_rest..99..9; the digits between a[i] and b[i] then anything; b[i] then
    // 00..0..b_rest. A rest that is already the lowest (highest) joins the middle.
    if (!a_rest_lowest) {
      Sequence p = prefix;
      p.push_back(g_.byte(uint8_t(a[i])));
      same_length(a_rest, std::string(a_rest.size(), '9'), std::move(p), out);
    }
    const char from = a_rest_lowest ? a[i] : char(a[i] + 1);
    const char to = b_rest_highest ? b[i] : char(b[i] - 1);
    if (from <= to) {
      Sequence p = prefix;
      p.push_back(g_.bytes(byte_range(from, to)));
      const Symbol digit = g_.bytes(byte_range('0', '9'));
      p.insert(p.end(), a_rest.size(), digit);
      out.push_back(std::move(p));
    }
    if (!b_rest_highest) {
      Sequence p = prefix;
      p.push_back(g_.byte(uint8_t(b[i])));
      same_length(std::string(b_rest.size(), '0'), b_rest, std::move(p), out);
    }
  }

  // A number's magnitude, exactly: its whole part and its fraction's digits (no trailing zeros).
  // Ordered as numbers are.
  struct Decimal {
    int64_t whole = 0;
    std::string fraction;
    bool operator<=(const Decimal& o) const {
      return whole != o.whole ? whole < o.whole : fraction <= o.fraction;
    }
  };
  // The largest magnitude an answer may write: kMaxIntegerDigits nines, then kMaxFractionDigits.
  static Decimal largest_magnitude() {
    return {kLargestInteger, std::string(size_t(kMaxFractionDigits), '9')};
  }

  // |d| as the shortest decimal that reads back as d (what Python's repr and JSON encoders
  // write), within largest_magnitude().
  static Decimal magnitude(double d) {
    d = std::fabs(d);
    if (d >= 1e16) return largest_magnitude();
    char buf[64];
    const auto end = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific).ptr;
    const std::string text(buf, end);  // "d.ddde+XX"
    const size_t e = text.find('e');
    std::string digits = text.substr(0, e);
    digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
    const int exponent = std::stoi(text.substr(e + 1));  // the point is after digit exponent + 1
    Decimal out;
    if (exponent < 0) {
      out.fraction = std::string(size_t(-exponent - 1), '0') + digits;
    } else {
      digits.resize(std::max(digits.size(), size_t(exponent) + 1), '0');
      out.whole = std::stoll(digits.substr(0, size_t(exponent) + 1));
      out.fraction = digits.substr(size_t(exponent) + 1);
    }
    while (!out.fraction.empty() && out.fraction.back() == '0') out.fraction.pop_back();
    return out;
  }

  // A "number" within the schema's bounds when it has any. Answers in a range are written without
  // an exponent, in at most kMaxIntegerDigits and kMaxFractionDigits digits, never as -0 (a subset
  // of the numbers in the range). A text is taken when its exact decimal value lies between the
  // bounds as JSON encoders write them (shortest round trip), the bound past an exclusive one
  // (the next double): then the double a JSON parser reads, rounding monotonically, is within
  // the bounds too (and an integer text, which Python compares exactly, as well: below 10^16 no
  // integer lies between a double and its shortest decimal). An integer bound that is no double
  // (past 2^53) is taken as the double on the range's side of it, and the integers between the
  // two are written too (integer texts compared exactly, as integer() does).
  Symbol bounded_number(const json& schema, const std::string& where) {
    bool bounded = false;
    for (const char* k : kBounds) bounded = bounded || schema.contains(k);
    if (!bounded) return number();
    const double inf = std::numeric_limits<double>::infinity();
    for (const char* k : kBounds) bound(schema, k, where);
    // A bound's double on the range's side of it: an integer past 2^53 may be none
    // (9007199254740995 reads as 9007199254740996, which a maximum of it must not admit).
    auto toward_range = [&](const char* k, bool up) {
      const json& v = schema[k];
      double d = v.get<double>();
      // (9999999999999999, the largest an answer may write, reads as 1e16: adjusted too.)
      if (v.is_number_integer() && std::fabs(d) <= 1e16) {
        const int64_t exact =
            v.is_number_unsigned() ? int64_t(v.get<uint64_t>()) : v.get<int64_t>();
        if (up && int64_t(d) < exact) d = std::nextafter(d, inf);
        if (!up && int64_t(d) > exact) d = std::nextafter(d, -inf);
      }
      return d;
    };
    double lo = -inf, hi = inf;
    if (schema.contains("minimum")) lo = std::max(lo, toward_range("minimum", true));
    if (schema.contains("exclusiveMinimum"))
      lo = std::max(lo, std::nextafter(toward_range("exclusiveMinimum", false), inf));
    if (schema.contains("maximum")) hi = std::min(hi, toward_range("maximum", false));
    if (schema.contains("exclusiveMaximum"))
      hi = std::min(hi, std::nextafter(toward_range("exclusiveMaximum", true), -inf));
    // Past what an answer may write, an outer side is open; an inner one leaves nothing.
    const bool writable = lo < 1e16 && hi > -1e16;
    const Decimal top = largest_magnitude();
    const Decimal lo_mag = lo < 0 ? magnitude(lo) : Decimal{}, hi_mag = magnitude(hi);
    // The positive side (0 included) up to hi, the negative side up to -lo (no zero: '-0').
    std::vector<Sequence> alts;
    if (writable && hi >= 0) {
      const Decimal from = lo > 0 ? magnitude(lo) : Decimal{};
      const Decimal to = hi == inf ? top : hi_mag;
      if (from <= to)
        if (auto m = magnitudes(from, to)) alts.push_back({*m});
    }
    if (writable && lo < 0) {
      const Decimal tiny{0, std::string(size_t(kMaxFractionDigits - 1), '0') + "1"};
      Decimal from = hi < 0 ? hi_mag : tiny;
      if (from <= tiny) from = tiny;
      const Decimal to = lo == -inf ? top : lo_mag;
      if (from <= to)
        if (auto m = magnitudes(from, to)) alts.push_back({g_.byte('-'), *m});
    }
    // The integers in the range that lie past lo..hi (compared exactly, as Python compares an
    // int: 9007199254740995 under a maximum of it, whose double is 9007199254740994 here).
    const auto [int_lo, int_hi] = integer_range(schema);
    if (int_lo <= int_hi) {
      if (lo > hi) {
        integer_texts(int_lo, int_hi, alts);
      } else {
        if (std::fabs(lo) <= 1e16 && int_lo <= std::min(int_hi, int64_t(std::ceil(lo)) - 1))
          integer_texts(int_lo, std::min(int_hi, int64_t(std::ceil(lo)) - 1), alts);
        if (std::fabs(hi) <= 1e16 && std::max(int_lo, int64_t(std::floor(hi)) + 1) <= int_hi)
          integer_texts(std::max(int_lo, int64_t(std::floor(hi)) + 1), int_hi, alts);
      }
    }
    if (alts.empty())
      fail(where, "no number of at most " + std::to_string(kMaxIntegerDigits) + " digits and " +
                      std::to_string(kMaxFractionDigits) +
                      " fraction digits lies within the schema's bounds (minimum, maximum, "
                      "exclusiveMinimum, exclusiveMaximum)");
    return g_.any_of(std::move(alts));
  }

  // The texts (whole part, then '.' and fraction digits or nothing) of the magnitudes a..b;
  // nothing when none has at most kMaxFractionDigits fraction digits (1e-20..2e-20).
  std::optional<Symbol> magnitudes(const Decimal& a, const Decimal& b) {
    const int fd = kMaxFractionDigits;
    auto text_of = [&](int64_t whole) { return g_.literal(std::to_string(whole)); };
    auto then_fraction = [&](Sequence whole, const Fractions& f) {
      std::vector<Sequence> out;
      if (f.empty) out.push_back(whole);
      if (!f.digits.empty()) {
        whole.push_back(g_.byte('.'));
        whole.push_back(g_.any_of(f.digits));
        out.push_back(std::move(whole));
      }
      return out;
    };
    std::vector<Sequence> alts;
    auto add = [&](std::vector<Sequence> more) {
      for (auto& m : more) alts.push_back(std::move(m));
    };
    if (a.whole == b.whole) {
      add(then_fraction(text_of(a.whole), fractions_between(a.fraction, b.fraction, fd)));
    } else {
      add(then_fraction(text_of(a.whole), fractions_from(a.fraction, fd)));
      if (a.whole + 1 <= b.whole - 1) {
        const Symbol digit = g_.bytes(byte_range('0', '9'));
        alts.push_back({naturals(a.whole + 1, b.whole - 1),
                        g_.repeat({g_.byte('.'), g_.repeat({digit}, 1, fd)}, 0, 1)});
      }
      add(then_fraction(text_of(b.whole), fractions_to(b.fraction, fd)));
    }
    if (alts.empty()) return std::nullopt;
    return g_.any_of(std::move(alts));
  }

  // Digit strings F of at most `length` digits read as the fraction 0.F: `empty` whether F may
  // be empty (no fraction), `digits` the alternatives of the others, each led by its first digit
  // (distinct ones, so that a matcher holds one stack per fraction read).
  struct Fractions {
    bool empty = false;
    std::vector<Sequence> digits;
  };
  Symbol fractions_rule(Fractions f) {
    if (f.empty) f.digits.push_back({});
    return g_.any_of(std::move(f.digits));
  }
  Symbol digit_run(int lo_digit, int hi_digit, int rest) {
    return g_.any_of({{g_.bytes(byte_range('0' + lo_digit, '0' + hi_digit)),
                       g_.repeat({g_.bytes(byte_range('0', '9'))}, 0, rest)}});
  }
  // 0.F >= 0.s.
  Fractions fractions_from(const std::string& s, int length) {
    Fractions out;
    if (s.empty()) {
      out.empty = true;
      if (length > 0) out.digits.push_back({digit_run(0, 9, length - 1)});
      return out;
    }
    if (length == 0) return out;
    const int d = s[0] - '0';
    if (d < 9) out.digits.push_back({digit_run(d + 1, 9, length - 1)});
    Fractions rest = fractions_from(s.substr(1), length - 1);
    if (rest.empty || !rest.digits.empty())
      out.digits.push_back({g_.byte(uint8_t(s[0])), fractions_rule(std::move(rest))});
    return out;
  }
  // 0.F <= 0.s.
  Fractions fractions_to(const std::string& s, int length) {
    Fractions out;
    out.empty = true;
    if (length == 0) return out;
    if (s.empty()) {
      out.digits.push_back({g_.repeat({g_.byte('0')}, 1, length)});
      return out;
    }
    const int d = s[0] - '0';
    if (d > 0) out.digits.push_back({digit_run(0, d - 1, length - 1)});
    out.digits.push_back(
        {g_.byte(uint8_t(s[0])), fractions_rule(fractions_to(s.substr(1), length - 1))});
    return out;
  }
  // 0.s <= 0.F <= 0.t (0.s <= 0.t).
  Fractions fractions_between(const std::string& s, const std::string& t, int length) {
    if (s.empty()) return fractions_to(t, length);
    Fractions out;
    if (length == 0) return out;
    const int d = s[0] - '0', e = t[0] - '0';  // t is not empty: 0.t >= 0.s > 0
    if (d == e) {
      Fractions rest = fractions_between(s.substr(1), t.substr(1), length - 1);
      if (rest.empty || !rest.digits.empty())
        out.digits.push_back({g_.byte(uint8_t(s[0])), fractions_rule(std::move(rest))});
      return out;
    }
    Fractions from = fractions_from(s.substr(1), length - 1);
    if (from.empty || !from.digits.empty())
      out.digits.push_back({g_.byte(uint8_t(s[0])), fractions_rule(std::move(from))});
    if (d + 1 <= e - 1) out.digits.push_back({digit_run(d + 1, e - 1, length - 1)});
    out.digits.push_back(
        {g_.byte(uint8_t(t[0])), fractions_rule(fractions_to(t.substr(1), length - 1))});
    return out;
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
    const int64_t min = count(schema, "minItems", kMaxItems, 0, where),
                  max = count(schema, "maxItems", kMaxItems, -1, where);
    if (max >= 0 && max < min) fail(where, "'maxItems' is below 'minItems'");
    // After '[': a $ref in the items consumes a byte before it is reached.
    const auto leading = std::exchange(leading_, {});
    const Symbol item =
        schema.contains("items") ? value(schema["items"], where + "/items") : any_value();
    leading_ = leading;
    const Symbol r = g_.new_rule();
    if (max != 0) {
      const Sequence more = {ws(), g_.byte(','), ws(), item};
      auto items = [&] {
        return g_.repeat(more, std::max<int64_t>(min - 1, 0), max < 0 ? -1 : max - 1);
      };
      const Symbol rest =
          min <= 1 && max < 0
              ? items()
              : sized_part(where + (max >= 0 ? "/maxItems" : "/minItems"), false, items);
      g_.add(r, {g_.byte('['), ws(), item, rest, ws(), g_.byte(']')});
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
    // Unsaid, additional properties are allowed, unless vLLM's disable_additional_properties
    // closes this schema (as its guidance backend does each that lists properties).
    const json extra =
        schema.value("additionalProperties",
                     json(!(disable_additional_properties_ && schema.contains("properties"))));
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
  bool disable_additional_properties_ = false;
  std::map<std::string, Symbol> refs_;
  // $refs being compiled with no byte of their value read yet (the innermost last), and the
  // $refs each reaches that way.
  std::vector<std::string> leading_;
  std::map<std::string, std::set<std::string>> leads_to_;
  std::map<std::pair<int64_t, int64_t>, Symbol> strings_;
  std::map<std::pair<int64_t, int64_t>, Symbol> integer_ranges_;  // by lo, hi
  std::map<std::string, RegexInJsonString> patterns_;             // formats' too, by their patterns
  // Patterns within lengths, by pattern, minLength and maxLength.
  std::map<std::tuple<std::string, int64_t, int64_t>, Symbol> bounded_;
  // Parts whose size a bound sets (sized_part()): where (the bound: ".../maxLength"), the
  // symbols each took (with those refused where the grammar passed its size), and whether it is
  // a pattern's or format's automaton counted per length.
  struct Part {
    std::string bound;
    size_t symbols;
    bool stopped, counted;
  };
  std::vector<Part> parts_;
  // The bound or schema being compiled where the grammar passed its size ("": the root).
  std::optional<std::string> passed_at_;
  int depth_ = 0;  // value() calls under way
  // kinds() of the schemas met so far, those under way, and the work it did (kMaxOneOfWork).
  std::unordered_map<const json*, KindsPtr> kinds_;
  std::unordered_set<const json*> kinds_open_;
  int64_t oneof_work_ = 0;
  Symbol any_value_ = -1, any_object_ = -1, ws_ = -1, character_ = -1, integer_ = -1, number_ = -1;
};

}  // namespace

Grammar::Symbol json_schema_rule(Grammar& g, const nlohmann::ordered_json& schema,
                                 bool disable_additional_properties) {
  const size_t first = g.rules();
  SchemaCompiler c(g, schema, disable_additional_properties);
  Symbol v = -1, root = -1;
  try {
    v = c.value(schema, "");
    root = g.any_of({{c.ws(), v, c.ws()}});
  } catch (const GrammarTooLarge& e) {
    throw GrammarTooLarge(c.too_large(e));
  }
  c.check_ref_cycles();
  // Rules from before this schema's were checked with theirs.
  if (!g.productive(first)[size_t(v) - first])
    throw Error(
        "schema #: the schema admits no finite value (each value it allows must hold another "
        "value of the same schema, such as a required property whose schema refers back to it)");
  return root;
}

Grammar::Symbol json_object_rule(Grammar& g) {
  const json empty = json::object();
  SchemaCompiler c(g, empty);
  const Symbol v = c.any_object();
  return g.any_of({{c.ws(), v, c.ws()}});
}

}  // namespace tandem::structured
