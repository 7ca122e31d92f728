#include "api/model_list.h"

#include <algorithm>
#include <cctype>

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

}  // namespace

std::string model_list_json(const ModelCard& model) {
  return dumped(json{{"object", "list"}, {"data", json::array({model_object(model)})}});
}

std::string model_json(const ModelCard& model) {
  return dumped(model_object(model));
}

std::vector<std::string> model_paths(std::string_view id) {
  std::vector<std::string> paths = {"/v1/models/" + std::string(id)};
  // encodeURIComponent's form: the openai client (v5) sends "Qwen/Qwen3-8B" as Qwen%2FQwen3-8B,
  // and the server decodes only the escapes of unreserved characters.
  std::string encoded = "/v1/models/";
  static constexpr char kHex[] = "0123456789ABCDEF";
  for (const unsigned char c : id) {
    if (std::isalnum(c) || std::string_view("-_.!~*'()").find(char(c)) != std::string_view::npos) {
      encoded += char(c);
    } else {
      encoded += '%';
      encoded += kHex[c >> 4];
      encoded += kHex[c & 15];
    }
  }
  if (encoded != paths[0]) paths.push_back(encoded);
  return paths;
}

net::HttpResponse model_retrieval(std::string_view path, const ModelCard& model) {
  static constexpr std::string_view kPrefix = "/v1/models/";
  const std::vector<std::string> paths = model_paths(model.id);
  net::HttpResponse r;
  if (std::find(paths.begin(), paths.end(), path) != paths.end()) {
    r.body = model_json(model);
    return r;
  }
  const ApiError e = model_not_found(path.substr(std::min(path.size(), kPrefix.size())));
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
