#pragma once
// API keys as OpenAI clients send them (Authorization: Bearer KEY), checked the same way by the
// gateway and the engines.
#include <span>
#include <string>

#include "net/http.h"

namespace tandem::api {

inline constexpr const char* kInvalidApiKey =
    "invalid or missing API key (Authorization: Bearer KEY)";

// The Bearer token of an Authorization header, or empty.
std::string bearer_token(const net::HttpRequest& req);

// Whether the request carries one of `keys` (true when there are none). Every key is compared,
// each in constant time: how long the check takes says nothing about which key, or how much of
// one, a guess got right. A request without a key is refused whatever the list holds: an empty
// key (`--api-key "$UNSET"`) must not open a server that looks guarded.
bool api_key_valid(std::span<const std::string> keys, const net::HttpRequest& req);

// Throws tandem::Error naming `option` when one of `keys` is empty (the operator meant to set a
// key and did not).
void check_api_keys(std::span<const std::string> keys, const std::string& option);

}  // namespace tandem::api
