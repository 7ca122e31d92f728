#include "api/model_list.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "util/error.h"
#include "util/json.h"

namespace tandem::api {

using nlohmann::json;

std::string model_list_json(const ModelCard& model) {
  json m = {{"id", model.id},       {"object", "model"}, {"created", model.created},
            {"owned_by", "tandem"}, {"root", model.id},  {"parent", nullptr}};
  if (model.max_model_len > 0) m["max_model_len"] = model.max_model_len;
  // Replace, not throw, on invalid UTF-8, as the completion path writes text: a model name that
  // is no UTF-8 must not turn the list into a 500.
  return json{{"object", "list"}, {"data", json::array({m})}}.dump(-1, ' ', false,
                                                                   json::error_handler_t::replace);
}

namespace {

// The list body's `data` array, or nullopt when the body is not a model list.
std::optional<json> models_of(std::string_view body) {
  json doc;
  try {
    doc = parse_untrusted_json(body);
  } catch (const Error&) {
    return std::nullopt;
  }
  if (!doc.is_object()) return std::nullopt;
  const auto data = doc.find("data");
  if (data == doc.end() || !data->is_array()) return std::nullopt;
  return std::move(*data);
}

}  // namespace

std::optional<std::string> first_model_id(std::string_view body) {
  const std::optional<json> data = models_of(body);
  if (!data || data->empty() || !data->front().is_object()) return std::nullopt;
  const auto id = data->front().find("id");
  if (id == data->front().end() || !id->is_string()) return std::nullopt;
  return id->get<std::string>();
}

std::optional<int64_t> max_model_len_of(std::string_view body) {
  const std::optional<json> data = models_of(body);
  if (!data) return std::nullopt;
  std::optional<int64_t> least;
  for (const json& m : *data) {
    if (!m.is_object()) continue;
    const auto len = m.find("max_model_len");
    if (len == m.end() || !len->is_number_integer() || len->get<int64_t>() <= 0) continue;
    least = std::min(least.value_or(len->get<int64_t>()), len->get<int64_t>());
  }
  return least;
}

}  // namespace tandem::api
