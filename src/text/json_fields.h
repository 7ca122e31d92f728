#pragma once
// Fields of tokenizer.json and tokenizer_config.json read by type, naming the field when it has
// another: nlohmann's typed getters throw a type_error that names neither the file nor the field.
// `where` names the object holding the field ("file: path"); the field is "where.key". Absent and
// null are told apart as Hugging Face tokenizers' serde reading does: an Option takes null, a
// bool does not.
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace tandem::text::json_fields {

// obj[key], which must be a string.
inline std::string string_field(const nlohmann::json& obj, const char* key,
                                const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end()) throw Error(where + "." + key + " must be a string, and is missing");
  if (!it->is_string())
    throw Error(where + "." + key + " must be a string, not " + it->type_name());
  return it->get<std::string>();
}

// obj[key], a string, or nullopt when absent or null.
inline std::optional<std::string> optional_string(const nlohmann::json& obj, const char* key,
                                                  const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return std::nullopt;
  if (!it->is_string())
    throw Error(where + "." + key + " must be a string or null, not " + it->type_name());
  return it->get<std::string>();
}

// obj[key], a number, or nullopt when absent or null.
inline std::optional<double> optional_number(const nlohmann::json& obj, const char* key,
                                             const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return std::nullopt;
  if (!it->is_number())
    throw Error(where + "." + key + " must be a number or null, not " + it->type_name());
  return it->get<double>();
}

// obj[key], true or false, `fallback` when absent.
inline bool flag(const nlohmann::json& obj, const char* key, bool fallback,
                 const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end()) return fallback;
  if (!it->is_boolean())
    throw Error(where + "." + key + " must be true or false, not " + it->type_name());
  return it->get<bool>();
}

// obj[key], which must be a list.
inline const nlohmann::json& list_field(const nlohmann::json& obj, const char* key,
                                        const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end()) throw Error(where + "." + key + " must be a list, and is missing");
  if (!it->is_array()) throw Error(where + "." + key + " must be a list, not " + it->type_name());
  return *it;
}

// obj[key], which must be an object.
inline const nlohmann::json& object_field(const nlohmann::json& obj, const char* key,
                                          const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end()) throw Error(where + "." + key + " must be an object, and is missing");
  if (!it->is_object())
    throw Error(where + "." + key + " must be an object, not " + it->type_name());
  return *it;
}

}  // namespace tandem::text::json_fields
