#include "api/body_fields.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "api/error.h"

namespace tandem::api {

using nlohmann::json;

void fail(const std::string& param, const std::string& message) {
  throw ApiError{400, message, param};
}

const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

double number(const json& body, const char* name, double fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_number()) fail(name, std::string("'") + name + "' must be a number");
  return v->get<double>();
}

bool is_whole_number(const json& v) {
  if (v.is_number_integer() || v.is_number_unsigned()) return true;
  if (!v.is_number_float()) return false;
  const double d = v.get<double>();
  return std::isfinite(d) && d == std::trunc(d);
}

std::optional<int64_t> whole_number_value(const json& v) {
  if (!is_whole_number(v)) return std::nullopt;
  // 2^63 is exact as a double; a float at or past it (or below -2^63) has no int64 value.
  constexpr double kLimit = 9223372036854775808.0;
  if ((v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX}) ||
      (v.is_number_float() && (v.get<double>() >= kLimit || v.get<double>() < -kLimit)))
    return std::nullopt;
  return v.is_number_float() ? static_cast<int64_t>(v.get<double>()) : v.get<int64_t>();
}

int64_t whole_number(const json& v, const std::string& name) {
  if (!is_whole_number(v)) fail(name, "'" + name + "' must be an integer");
  const std::optional<int64_t> value = whole_number_value(v);
  if (!value) fail(name, "'" + name + "' is too large: " + v.dump());
  return *value;
}

int64_t integer(const json& body, const char* name, int64_t fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  return whole_number(*v, name);
}

bool boolean(const json& body, const char* name, bool fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_boolean()) fail(name, std::string("'") + name + "' must be a boolean");
  return v->get<bool>();
}

bool is_token_list(const json& v) {
  return v.is_array() && !v.empty() &&
         std::all_of(v.begin(), v.end(), [](const json& t) { return t.is_number(); });
}

std::vector<int32_t> token_list(const json& v, const char* name, int64_t vocab_size) {
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (const auto& t : v) {
    if (!t.is_number_integer() && !t.is_number_unsigned())
      fail(name, std::string("'") + name + "' must hold integer token ids");
    if (t.is_number_unsigned() && t.get<uint64_t>() > uint64_t{INT64_MAX})
      fail(name, "token id " + t.dump() + " is outside the vocabulary of " +
                     std::to_string(vocab_size) + " ids");
    const auto id = t.get<int64_t>();
    if (id < 0 || id >= vocab_size)
      fail(name, "token id " + std::to_string(id) + " is outside the vocabulary of " +
                     std::to_string(vocab_size) + " ids");
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

}  // namespace tandem::api
