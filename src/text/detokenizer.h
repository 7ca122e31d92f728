#pragma once
// Streaming detokenizer: turns generated ids into text as they arrive. It never emits part of a
// UTF-8 character; bytes that can still become one are held back until the next token decides.
// The concatenation of everything it returns, finish() included, equals Tokenizer::decode of
// all ids.
#include <string>

#include "text/tokenizer.h"

namespace tandem::text {

class IncrementalDetokenizer {
 public:
  IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens);

  // Adds one token; returns the text that became final (often empty or one character).
  std::string push(TokenId id);
  // Ends the stream: bytes still held back become U+FFFD, as a full decode would show them.
  std::string finish();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;
};

}  // namespace tandem::text
