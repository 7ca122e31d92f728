#pragma once
// JSON from a client kept in its key order (nlohmann::json sorts keys; a schema's properties are
// generated, and tools shown to the model, in the client's order), read in linear time.
// nlohmann::ordered_json's own parser finds each key by a linear search as it inserts it, so an
// object of n keys cost n^2 / 2 comparisons: a body with 200,000 unrelated keys held the HTTP
// thread for 48 to 103 s.
#include <cstddef>
#include <string_view>

#include <nlohmann/json.hpp>

namespace tandem::structured {

// Parses `text` keeping key order (the last of duplicate keys wins, in the first one's place, as
// nlohmann's parsers do), or throws tandem::Error saying what is wrong (malformed JSON, or nesting
// deeper than `max_depth`).
nlohmann::ordered_json parse_ordered(std::string_view text, size_t max_depth = 64);

// Keys one object of a schema or tool list may have: their compilers look keys up by name in
// ordered objects, a linear search each.
inline constexpr size_t kMaxObjectKeys = 4096;
// Throws tandem::Error ("an object of N keys (at most 4096)") for the first object in `doc`
// with more than kMaxObjectKeys keys.
void check_object_sizes(const nlohmann::ordered_json& doc);

}  // namespace tandem::structured
