#pragma once
// Typed fields of one JSON object read from a file (config.json, generation_config.json,
// tokenizer.json, tokenizer_config.json), every error naming the file, the field's path and what
// the field must be: nlohmann's typed getters throw a type_error that names none of them.
//
// Messages have one form, "<origin>: field '<path>' <what>":
//   config.json: field 'rope_scaling.factor' must be a number, got "2"
//   tokenizer.json: field 'normalizer.prepend' is required (a string)
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tandem {

class Fields {
 public:
  using json = nlohmann::json;

  // What a JSON null given for a field means, chosen per call as the format's own reader does:
  // the field left out (transformers' None, serde's Option), or a value of the wrong type (serde's
  // bool and String refuse it).
  enum class Null { kAbsent, kWrongType };

  // Strict: every field must be read or ignored, and reject_unknown() reports the rest, for
  // configs where a misspelt setting would otherwise be dropped silently (config.json).
  // `path` is where `obj` sits in its document ("" for the document itself, "rope_scaling",
  // "pre_tokenizer.pretokenizers[0]").
  static Fields strict(const json& obj, std::string origin, std::string path = "") {
    return Fields(obj, std::move(origin), std::move(path), true);
  }
  // Lenient: fields not read are the format's business (tokenizer.json carries much that
  // Tandem does not use).
  static Fields lenient(const json& obj, std::string origin, std::string path = "") {
    return Fields(obj, std::move(origin), std::move(path), false);
  }

  const std::string& origin() const { return origin_; }
  // "<origin>: <path>", or the origin alone for the document, for messages about the object as a
  // whole.
  std::string where() const;
  // The field's path as messages name it: "<path>.<key>", or the key alone for the document.
  std::string path_of(const std::string& key) const;
  [[noreturn]] void fail(const std::string& key, const std::string& what) const;

  // The value, or null when absent (or JSON null, under Null::kAbsent).
  const json* get(const std::string& key, Null null = Null::kAbsent);
  // Given and not JSON null.
  bool present(const std::string& key) const;
  // The value, whatever its type; an error when absent or null.
  const json& need(const std::string& key);
  // Accepted without effect (training settings, bookkeeping).
  void ignore(const std::string& key);
  // An error naming the first field neither read nor ignored. Strict Fields only.
  void reject_unknown() const;

  // A value of the field `key` (read elsewhere: a list's element, a value already found) checked
  // for its type.
  int64_t as_integer(const std::string& key, const json& v) const;
  double as_number(const std::string& key, const json& v) const;
  bool as_boolean(const std::string& key, const json& v) const;
  std::string as_string(const std::string& key, const json& v) const;

  // Typed fields: `x(key)` is required, `x_or(key, fallback)` has a default when absent, and
  // `optional_x(key)` is empty when absent.
  int64_t integer(const std::string& key, Null null = Null::kAbsent);
  int64_t integer_or(const std::string& key, int64_t fallback, Null null = Null::kAbsent);
  std::optional<int64_t> optional_integer(const std::string& key, Null null = Null::kAbsent);
  // An integer or a list of them (transformers' Union[int, List[int]], as eos_token_id); empty
  // when absent or null. An element's error names it: 'eos_token_id[1]'.
  std::vector<int64_t> integers(const std::string& key);
  double number(const std::string& key, Null null = Null::kAbsent);
  double number_or(const std::string& key, double fallback, Null null = Null::kAbsent);
  std::optional<double> optional_number(const std::string& key, Null null = Null::kAbsent);
  bool boolean(const std::string& key, Null null = Null::kAbsent);
  bool boolean_or(const std::string& key, bool fallback, Null null = Null::kAbsent);
  std::string string(const std::string& key, Null null = Null::kAbsent);
  std::string string_or(const std::string& key, const std::string& fallback,
                        Null null = Null::kAbsent);
  std::optional<std::string> optional_string(const std::string& key, Null null = Null::kAbsent);
  const json& list(const std::string& key, Null null = Null::kAbsent);
  const json& object(const std::string& key, Null null = Null::kAbsent);
  // The fields of the object field `key`, read as these are (strict ones need their own
  // reject_unknown()), their messages naming "<path>.<key>.<field>".
  Fields nested(const std::string& key, Null null = Null::kAbsent);

  // An integer field's value against a limit of this engine.
  void at_most(const std::string& key, int64_t v, int64_t limit) const;
  // An integer field that must lie in [1, limit].
  void positive_at_most(const std::string& key, int64_t v, int64_t limit) const;

 private:
  Fields(const json& obj, std::string origin, std::string path, bool strict)
      : obj_(obj), origin_(std::move(origin)), path_(std::move(path)), strict_(strict) {}
  // The value given for a required field, failing with what it must be when there is none.
  const json& required(const std::string& key, Null null, const char* expected);

  const json& obj_;
  std::string origin_, path_;
  bool strict_;
  std::set<std::string> seen_;  // strict: the fields read or ignored
};

}  // namespace tandem
