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
// one, a guess got right.
bool api_key_valid(std::span<const std::string> keys, const net::HttpRequest& req);

}  // namespace tandem::api
