#pragma once
// Streaming detokenizer: turns generated ids into text as they arrive, as vLLM serves it. vLLM's
// detokenizer steps Hugging Face tokenizers' DecodeStream once per id, which returns text only
// when the text so far does not end in U+FFFD: it holds back an unfinished UTF-8 character and
// also a replacement character (an invalid byte, or a token that is U+FFFD itself) until a later
// token ends the text with something else. When the request finishes, vLLM adds nothing more:
// what is still held back never reaches the client. So the concatenation of everything push()
// returns is Tokenizer::decode of all ids less a trailing run of text that ends in U+FFFD.
// One difference: vLLM first steps its stream over the prompt's last few tokens, so a prompt
// given as ids that ends inside a character has that character finished in vLLM's first piece;
// this stream starts empty, and such a first piece begins with U+FFFD.
#include <string>

#include "text/tokenizer.h"

namespace tandem::text {

class IncrementalDetokenizer {
 public:
  IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens);

  // Adds one token; returns the text that became final (often empty or one character). Nothing
  // is returned at the end of a stream: the text still held back is dropped, as in vLLM.
  std::string push(TokenId id);

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_tokens_;
  // Text held back: the decided text since the last that was returned, then the bytes of an
  // unfinished character (whose decode, U+FFFD, may still change).
  std::string held_text_;
  std::string unfinished_;
};

}  // namespace tandem::text
