#include "api/error.h"

#include <nlohmann/json.hpp>

#include "util/error.h"
#include "util/json.h"
#include "util/utf8.h"

namespace tandem::api {

std::string openai_error_body(std::string_view message, std::string_view type,
                              std::string_view code, std::string_view param) {
  // ordered_json keeps OpenAI's field order, which people compare by eye.
  nlohmann::ordered_json error = {{"message", message}, {"type", type}, {"param", nullptr}};
  if (!param.empty()) error["param"] = param;
  error["code"] = code.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(code);
  // Replace, not throw, on invalid UTF-8: messages may quote bytes a client sent.
  return nlohmann::ordered_json{{"error", std::move(error)}}.dump(
      -1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

namespace {

// A string member of an OpenAI error body's error object.
std::optional<std::string> error_member(std::string_view body, const char* name) {
  nlohmann::json doc;
  try {
    doc = parse_untrusted_json(body);
  } catch (const Error&) {
    return std::nullopt;
  }
  if (!doc.is_object()) return std::nullopt;
  const auto error = doc.find("error");
  if (error == doc.end() || !error->is_object()) return std::nullopt;
  const auto member = error->find(name);
  if (member == error->end() || !member->is_string()) return std::nullopt;
  return member->get<std::string>();
}

}  // namespace

std::optional<std::string> openai_error_message(std::string_view body) {
  return error_member(body, "message");
}

std::optional<std::string> openai_error_code(std::string_view body) {
  return error_member(body, "code");
}

std::string_view default_error_type(int status) {
  return status >= 500 ? "server_error" : "invalid_request_error";
}

net::HttpResponse openai_error_response(int status, std::string_view message, std::string_view type,
                                        std::string_view code) {
  net::HttpResponse r;
  r.status = status;
  r.body = openai_error_body(message, type.empty() ? default_error_type(status) : type, code);
  return r;
}

ApiError model_not_found(std::string_view model) {
  return ApiError{404, "The model `" + utf8::clip(model) + "` does not exist.", "model",
                  "NotFoundError", std::string(kModelNotFoundCode)};
}

std::string api_error_body(const ApiError& e) {
  return openai_error_body(e.message, e.type.empty() ? default_error_type(e.status) : e.type,
                           e.code, e.param);
}

}  // namespace tandem::api
