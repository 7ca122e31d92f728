// Fuzzes the tokenizer (text/tokenizer.h) and the streaming detokenizer (text/detokenizer.h) on
// arbitrary bytes with the real DeepSeek-V3 tokenizer: encode (pre-tokenizer regexes, added
// tokens, byte-level BPE) with and without special tokens; decode of arbitrary token ids (out of
// range ones included) with and without skipping special tokens; the same ids through the
// detokenizer. The errors are tandem::Error for text that is not valid UTF-8 (encode; the
// bytes are then encoded with ill-formed sequences replaced by U+FFFD) and for ids outside the
// vocabulary (decode); anything else escaping is a finding, and so is a broken documented
// property: the detokenizer's concatenation equals decode, and byte-level BPE without a
// normalizer is lossless (decode(encode(text)) == text).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_tokenizer.h"
#include "text/detokenizer.h"
#include "util/error.h"
#include "util/utf8.h"

namespace {

using tandem::text::TokenId;

void check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tandem::fuzz::tokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto& tok = tandem::fuzz::tokenizer();
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const std::string text = tandem::utf8::to_valid_lossy(bytes);
  if (text != bytes) {
    bool refused = false;
    try {
      (void)tok.encode(bytes, false);
    } catch (const tandem::Error&) {
      refused = true;
    }
    check(refused);
  }
  const std::vector<TokenId> plain = tok.encode(text, false);
  (void)tok.encode(text, true);
  check(tok.decode(plain, false) == text);
  (void)tok.decode(plain, true);

  // The same bytes read as token ids: some beyond the vocabulary (an error), then all within.
  std::vector<TokenId> ids(size / sizeof(TokenId));
  if (!ids.empty()) std::memcpy(ids.data(), data, ids.size() * sizeof(TokenId));
  try {
    (void)tok.decode(ids, false);
  } catch (const tandem::Error&) {
  }
  const auto vocab = static_cast<uint32_t>(tok.vocab_size());
  for (auto& id : ids) id = static_cast<TokenId>(static_cast<uint32_t>(id) % vocab);
  for (const bool skip : {false, true}) {
    std::string whole;
    try {
      whole = tok.decode(ids, skip);
    } catch (const tandem::Error&) {
      return 0;  // an id in a gap of the vocabulary
    }
    tandem::text::IncrementalDetokenizer detok(tok, skip);
    std::string streamed;
    for (const TokenId id : ids) streamed += detok.push(id);
    streamed += detok.finish();
    check(streamed == whole);
  }
  return 0;
}
