#include "api/model_list.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "api/error.h"
#include "util/error.h"
#include "util/json.h"

namespace tandem::api {

using nlohmann::json;

namespace {

json model_object(const ModelCard& model) {
  json m = {{"id", model.id},       {"object", "model"}, {"created", model.created},
            {"owned_by", "tandem"}, {"root", model.id},  {"parent", nullptr}};
  if (model.max_model_len > 0) m["max_model_len"] = model.max_model_len;
  return m;
}

// Replace, not throw, on invalid UTF-8, as the completion path writes text: a model name that is
// no UTF-8 must not turn the answer into a 500.
std::string dumped(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// The part of a path under /v1/models/ after that prefix.
std::string_view id_part(std::string_view path) {
  static constexpr std::string_view kPrefix = "/v1/models/";
  return path.substr(std::min(path.size(), kPrefix.size()));
}

}  // namespace

std::string model_list_json(const ModelCard& model) {
  return dumped(json{{"object", "list"}, {"data", json::array({model_object(model)})}});
}

std::string model_json(const ModelCard& model) {
  return dumped(model_object(model));
}

std::string retrieved_model_id(std::string_view path) {
  return net::percent_decoded(id_part(path));
}

namespace {

// Whether a "/"-separated segment of `id` is ".." or, with `dot`, ".".
bool has_segment_of_dots(std::string_view id, bool dot) {
  for (size_t start = 0; start <= id.size();) {
    const size_t slash = std::min(id.find('/', start), id.size());
    const std::string_view segment = id.substr(start, slash - start);
    if (segment == ".." || (dot && segment == ".")) return true;
    start = slash + 1;
  }
  return false;
}

}  // namespace

bool has_dot_segment(std::string_view id) {
  return has_segment_of_dots(id, true);
}

bool has_parent_segment(std::string_view id) {
  return has_segment_of_dots(id, false);
}

net::HttpResponse model_retrieval(std::string_view path, const ModelCard& model) {
  const std::string id = retrieved_model_id(path);
  net::HttpResponse r;
  if (id == model.id) {
    r.body = model_json(model);
    return r;
  }
  const ApiError e = model_not_found(id);
  r.status = e.status;
  r.body = api_error_body(e);
  return r;
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
  return data ? max_model_len_of_data(*data) : std::nullopt;
}

std::optional<int64_t> max_model_len_of_data(const json& data) {
  std::optional<int64_t> least;
  for (const json& m : data) {
    if (!m.is_object()) continue;
    const auto len = m.find("max_model_len");
    if (len == m.end() || !len->is_number_integer() || len->get<int64_t>() <= 0) continue;
    least = std::min(least.value_or(len->get<int64_t>()), len->get<int64_t>());
  }
  return least;
}

}  // namespace tandem::api
