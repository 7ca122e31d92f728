// Fuzzes the tokenizer loader (Tokenizer::from_json, text/tokenizer.h) on a tokenizer.json and
// a tokenizer_config.json: the input is tokenizer.json, then optionally a NUL byte and
// tokenizer_config.json. Every tokenizer it accepts then encodes and decodes a fixed text with
// added tokens, digits, spaces and non-ASCII. tandem::Error is the documented error (malformed
// JSON, an unsupported component, inconsistent vocabularies); anything else escaping is a
// finding.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "text/tokenizer.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* begin = reinterpret_cast<const char*>(data);
  const auto* nul = static_cast<const char*>(std::memchr(begin, 0, size));
  const std::string_view tokenizer_json(begin, nul ? size_t(nul - begin) : size);
  const std::string_view config_json =
      nul ? std::string_view(nul + 1, size_t(begin + size - nul - 1)) : std::string_view();
  try {
    const auto tok = tandem::text::Tokenizer::from_json(tokenizer_json, config_json, "fuzz");
    for (const bool special : {false, true}) {
      const std::vector<tandem::text::TokenId> ids =
          tok.encode("Hello, wörld!  12345 <s>x</s> \xe2\x98\x83\n\tend", special);
      (void)tok.decode(ids, false);
      (void)tok.decode(ids, true);
    }
    (void)tok.vocab_size();
  } catch (const tandem::Error&) {
  }
  return 0;
}
