#pragma once
// Parsing JSON that arrives from the network. nlohmann's parser recurses once per nesting level,
// so a hostile body of a few megabytes of '[' would exhaust the stack; the depth is checked with
// a flat scan first.
#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace tandem {

// Parses `text`, or throws tandem::Error saying what is wrong (malformed JSON with the byte
// offset, or nesting deeper than `max_depth`).
nlohmann::json parse_untrusted_json(std::string_view text, size_t max_depth = 64);

// The same for a document read from `source` (a file name): errors start with it.
nlohmann::json parse_json_document(std::string_view text, const std::string& source);

}  // namespace tandem
