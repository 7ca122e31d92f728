#pragma once
// Errors as the OpenAI API words them, for engine and gateway alike: the error a request parser
// throws (ApiError) and the body every HTTP error carries.
#include <optional>
#include <string>
#include <string_view>

#include "net/http.h"

namespace tandem::api {

// A client error: becomes an HTTP 4xx with the OpenAI error JSON.
struct ApiError {
  int status = 400;
  std::string message;
  std::string param;  // the offending field, when there is one
  std::string type = "invalid_request_error";
  std::string code = {};  // OpenAI's error.code ("model_not_found"); empty: null
};

// {"error":{"message":...,"type":...,"param":...,"code":...}}, the error object of the OpenAI
// API. An empty `code` or `param` is written as null.
std::string openai_error_body(std::string_view message,
                              std::string_view type = "invalid_request_error",
                              std::string_view code = {}, std::string_view param = {});

// The message of an OpenAI error body (error.message), or nullopt when `body` is not one.
std::optional<std::string> openai_error_message(std::string_view body);
// Its code (error.code), or nullopt when `body` is not one or the code is null.
std::optional<std::string> openai_error_code(std::string_view body);

// OpenAI's code for a request naming a model the server does not serve (a 404).
inline constexpr std::string_view kModelNotFoundCode = "model_not_found";
// The error for a request naming `model`, which the server does not serve: a 404 with
// kModelNotFoundCode, worded as vLLM words it (its name clipped, as a client may send any).
ApiError model_not_found(std::string_view model);

// The code of a P/D prefill leg's error when its bootstrap room's decode leg went away (a 502):
// it ended before it registered, was refused, or left a registered room; the decode leg's own
// answer says why the request failed, so a gateway must not count this one against the prefill
// engine.
inline constexpr std::string_view kRoomAbandonedCode = "room_abandoned";

// The code of a P/D decode leg's error when it could not take the prompt's KV from its prefill
// engine (a 502: the transfer failed, timed out or was refused there): the prefill engine's
// failure, which a gateway counts against that engine and not against the decode engine, which
// only reported it.
inline constexpr std::string_view kKvTransferFailedCode = "kv_transfer_failed";

// The code of a sequential P/D decode leg's error when its prefill engine no longer held the
// prompt's KV (a 502: the hold expired after --kv-transfer-timeout, was pulled already, or was
// never held there, as after a restart): no engine failed, and the KV is gone, so a gateway
// starts the request again from a prefill engine and counts it against neither engine.
inline constexpr std::string_view kKvTransferExpiredCode = "kv_transfer_expired";

// The code of a sequential P/D decode leg's error when its prefill engine refused the pull for
// now (every KV transfer connection it allows, in all or from the decode engine's address, was in
// use): the KV is still held there and no engine failed, so a gateway sends a decode leg again
// with the same kv_transfer_params after a short wait, and counts it against neither engine.
inline constexpr std::string_view kKvTransferBusyCode = "kv_transfer_busy";

// The error type Tandem uses for a status: "invalid_request_error" for 4xx, "server_error" for
// 5xx (OpenAI's own names).
std::string_view default_error_type(int status);

// The HTTP error response of engine and gateway (their servers' net::ErrorFormatter): the OpenAI
// error body, of default_error_type(status) when no type is named.
net::HttpResponse openai_error_response(int status, std::string_view message, std::string_view type,
                                        std::string_view code);
// The body of the answer to a request the parsers refused (status e.status): the field it
// names as "param", and its code, as OpenAI does.
std::string api_error_body(const ApiError& e);

}  // namespace tandem::api
