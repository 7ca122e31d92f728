#include "text/detokenizer.h"

#include "util/utf8.h"

namespace tandem::text {

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string IncrementalDetokenizer::push(TokenId id) {
  std::string bytes = tokenizer_.token_bytes(id);  // validates the id
  if (skip_special_tokens_ && tokenizer_.is_special(id)) return {};
  unfinished_ += bytes;
  // Everything before an incomplete tail is decided: a later byte cannot change how
  // from_utf8_lossy treats it, because the tail starts a new sequence. Decoding it once here
  // keeps a long run of held-back replacements linear, where DecodeStream decodes it again at
  // every step.
  const size_t keep = utf8::incomplete_tail_length(unfinished_);
  held_text_ +=
      utf8::to_valid_lossy(std::string_view(unfinished_).substr(0, unfinished_.size() - keep));
  unfinished_.erase(0, unfinished_.size() - keep);
  // DecodeStream's text ends in U+FFFD while a character is unfinished (it decodes as one) or
  // the decided text ends in one.
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  if (keep > 0 || std::string_view(held_text_).ends_with(kReplacement)) return {};
  std::string out;
  out.swap(held_text_);
  return out;
}

}  // namespace tandem::text
