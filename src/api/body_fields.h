#pragma once
// Reading the fields of a JSON request body the way every API parser here does: null counts as
// absent, and a field of the wrong type is an ApiError (400) that names it.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tandem::api {

// Throws ApiError{400, message, param}.
[[noreturn]] void fail(const std::string& param, const std::string& message);

// The field, or null when it is absent or JSON null.
const nlohmann::json* field(const nlohmann::json& body, const char* name);

// Typed fields with a default for an absent one; a field of another type fails naming it.
// integer() takes any whole number (below).
double number(const nlohmann::json& body, const char* name, double fallback);
int64_t integer(const nlohmann::json& body, const char* name, int64_t fallback);
bool boolean(const nlohmann::json& body, const char* name, bool fallback);

// A JSON integer, or a float with no fractional part (256.0): pydantic's lax mode, which vLLM's
// request models use, takes those for an int field. 2.5, "5" and true are not whole numbers.
bool is_whole_number(const nlohmann::json& v);
// A whole number's int64 value; fails naming `name` for anything else or one outside int64.
int64_t whole_number(const nlohmann::json& v, const std::string& name);
// The same value, or nullopt where whole_number fails: for a reader that leaves the refusal to
// the engine (the gateway's fan-out and priority classes read the fields as the engine does).
std::optional<int64_t> whole_number_value(const nlohmann::json& v);

// A non-empty list of numbers (a prompt given as token ids rather than text).
bool is_token_list(const nlohmann::json& v);
// Its ids, each an integer in [0, vocab_size); fails naming `name` otherwise.
std::vector<int32_t> token_list(const nlohmann::json& v, const char* name, int64_t vocab_size);

}  // namespace tandem::api
