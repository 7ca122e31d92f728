#include "util/json_fields.h"

#include <stdexcept>

#include "util/error.h"
#include "util/json.h"

namespace tandem {

using json = nlohmann::json;

std::string Fields::where() const {
  return path_.empty() ? origin_ : origin_ + ": " + path_;
}

std::string Fields::path_of(const std::string& key) const {
  return path_.empty() ? key : path_ + "." + key;
}

void Fields::fail(const std::string& key, const std::string& what) const {
  throw Error(origin_ + ": field '" + path_of(key) + "' " + what);
}

const json* Fields::get(const std::string& key, Null null) {
  seen_.insert(key);
  const auto it = obj_.find(key);
  if (it == obj_.end() || (it->is_null() && null == Null::kAbsent)) return nullptr;
  return &*it;
}

bool Fields::present(const std::string& key) const {
  const auto it = obj_.find(key);
  return it != obj_.end() && !it->is_null();
}

const json& Fields::need(const std::string& key) {
  const json* v = get(key);
  if (!v) fail(key, "is required");
  return *v;
}

void Fields::ignore(const std::string& key) {
  seen_.insert(key);
}

void Fields::reject_unknown() const {
  // A lenient reader never meant to list every field; asking it which are unknown is a bug here.
  if (!strict_) throw std::logic_error("reject_unknown() on lenient Fields of " + where());
  for (const auto& [key, value] : obj_.items())
    if (!seen_.count(key)) fail(key, "is not a known field of this configuration");
}

const json& Fields::required(const std::string& key, Null null, const char* expected) {
  const json* v = get(key, null);
  if (!v) fail(key, std::string("is required (") + expected + ")");
  return *v;
}

int64_t Fields::as_integer(const std::string& key, const json& v) const {
  if (!v.is_number_integer()) fail(key, "must be an integer, got " + json_excerpt(v));
  // get<int64_t>() would wrap 2^64 - 1 to -1, and the message would name a value never given.
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX})
    fail(key, "is " + std::to_string(v.get<uint64_t>()) + ", above the limit of " +
                  std::to_string(INT64_MAX));
  return v.get<int64_t>();
}

double Fields::as_number(const std::string& key, const json& v) const {
  if (!v.is_number()) fail(key, "must be a number, got " + json_excerpt(v));
  return v.get<double>();
}

bool Fields::as_boolean(const std::string& key, const json& v) const {
  if (!v.is_boolean()) fail(key, "must be true or false, got " + json_excerpt(v));
  return v.get<bool>();
}

std::string Fields::as_string(const std::string& key, const json& v) const {
  if (!v.is_string()) fail(key, "must be a string, got " + json_excerpt(v));
  return v.get<std::string>();
}

int64_t Fields::integer(const std::string& key, Null null) {
  return as_integer(key, required(key, null, "an integer"));
}

int64_t Fields::integer_or(const std::string& key, int64_t fallback, Null null) {
  const json* v = get(key, null);
  return v ? as_integer(key, *v) : fallback;
}

std::optional<int64_t> Fields::optional_integer(const std::string& key, Null null) {
  const json* v = get(key, null);
  return v ? std::optional<int64_t>(as_integer(key, *v)) : std::nullopt;
}

std::vector<int64_t> Fields::integers(const std::string& key) {
  const json* v = get(key);
  if (!v) return {};
  if (!v->is_array()) {
    if (!v->is_number_integer())
      fail(key, "must be an integer or a list of integers, got " + json_excerpt(*v));
    return {as_integer(key, *v)};
  }
  std::vector<int64_t> out;
  for (size_t i = 0; i < v->size(); ++i)
    out.push_back(as_integer(key + "[" + std::to_string(i) + "]", (*v)[i]));
  return out;
}

double Fields::number(const std::string& key, Null null) {
  return as_number(key, required(key, null, "a number"));
}

double Fields::number_or(const std::string& key, double fallback, Null null) {
  const json* v = get(key, null);
  return v ? as_number(key, *v) : fallback;
}

std::optional<double> Fields::optional_number(const std::string& key, Null null) {
  const json* v = get(key, null);
  return v ? std::optional<double>(as_number(key, *v)) : std::nullopt;
}

bool Fields::boolean(const std::string& key, Null null) {
  return as_boolean(key, required(key, null, "true or false"));
}

bool Fields::boolean_or(const std::string& key, bool fallback, Null null) {
  const json* v = get(key, null);
  return v ? as_boolean(key, *v) : fallback;
}

std::string Fields::string(const std::string& key, Null null) {
  return as_string(key, required(key, null, "a string"));
}

std::string Fields::string_or(const std::string& key, const std::string& fallback, Null null) {
  const json* v = get(key, null);
  return v ? as_string(key, *v) : fallback;
}

std::optional<std::string> Fields::optional_string(const std::string& key, Null null) {
  const json* v = get(key, null);
  return v ? std::optional<std::string>(as_string(key, *v)) : std::nullopt;
}

const json& Fields::list(const std::string& key, Null null) {
  const json& v = required(key, null, "a list");
  if (!v.is_array()) fail(key, "must be a list, got " + json_excerpt(v));
  return v;
}

const json& Fields::object(const std::string& key, Null null) {
  const json& v = required(key, null, "an object");
  if (!v.is_object()) fail(key, "must be an object, got " + json_excerpt(v));
  return v;
}

Fields Fields::nested(const std::string& key, Null null) {
  return Fields(object(key, null), origin_, path_of(key), strict_);
}

void Fields::at_most(const std::string& key, int64_t v, int64_t limit) const {
  if (v > limit)
    fail(key,
         "is " + std::to_string(v) + ", above this engine's limit of " + std::to_string(limit));
}

void Fields::positive_at_most(const std::string& key, int64_t v, int64_t limit) const {
  if (v <= 0) fail(key, "must be positive, got " + std::to_string(v));
  at_most(key, v, limit);
}

}  // namespace tandem
