#pragma once
// Parsing JSON that arrives from the network, into nlohmann::json documents: our own reader
// (util/json.cpp), iterative, so a hostile body of a few megabytes of '[' cannot exhaust the
// stack, and faster than nlohmann's parser on the bodies that dominate (a prompt of 14K token ids:
// 0.36 ms against 1.4 ms, then the same 0.4 ms in nlohmann's destructor; measured 2026-12-02 on
// the AVX-512 VM). It accepts exactly what nlohmann's parser
// accepts (RFC 8259, UTF-8 checked) and builds the same document (tests/util/json_test.cpp
// compares the two on generated and mutated documents).
#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace tandem {

// What a key repeated in one object means: the last value wins (nlohmann's parsers, and what
// RFC 8259 leaves to the reader), or the document is refused naming the key, where dropping the
// earlier value would lose data silently (a safetensors header listing a tensor twice).
enum class DuplicateKeys { kLastWins, kRefuse };

// Parses `text`, or throws tandem::Error saying what is wrong (malformed JSON with the byte
// offset, nesting deeper than `max_depth`, or a repeated key refused).
nlohmann::json parse_untrusted_json(std::string_view text, size_t max_depth = 64,
                                    DuplicateKeys duplicates = DuplicateKeys::kLastWins);

// Frees a document's contents (it is null afterwards), leaves first. nlohmann's destructor moves
// every element of every array onto a heap stack before freeing it (to avoid recursion), which
// for a prompt of thousands of token ids costs as much as parsing it; emptying the innermost
// containers first leaves it nothing to move.
void release_json(nlohmann::json& doc);
// release_json(doc) when the scope ends, whichever way.
struct ReleaseJsonOnExit {
  nlohmann::json& doc;
  ~ReleaseJsonOnExit() { release_json(doc); }
};

// The same for a document read from `source` (a file name): errors start with it.
nlohmann::json parse_json_document(std::string_view text, const std::string& source);

// A value quoted in an error message: its compact JSON text, cut after about `max_bytes` with
// "..." marking the cut. nlohmann's dump() recurses (a value nested 100,000 deep overflows the
// stack) and writes the whole value (a 10 MB list in a message); this stops at the limit.
std::string json_excerpt(const nlohmann::json& value, size_t max_bytes = 100);

}  // namespace tandem
