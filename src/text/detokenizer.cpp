#include "text/detokenizer.h"

#include "util/utf8.h"

namespace tandem::text {

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string IncrementalDetokenizer::push(TokenId id) {
  std::string bytes = tokenizer_.token_bytes(id);  // validates the id
  if (skip_special_tokens_ && tokenizer_.is_special(id)) return {};
  pending_ += bytes;
  // Everything before an incomplete tail is decided: a later byte cannot change how
  // from_utf8_lossy treats it, because the tail starts a new sequence.
  size_t keep = utf8::incomplete_tail_length(pending_);
  std::string out =
      utf8::to_valid_lossy(std::string_view(pending_).substr(0, pending_.size() - keep));
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string IncrementalDetokenizer::finish() {
  std::string out = utf8::to_valid_lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace tandem::text
