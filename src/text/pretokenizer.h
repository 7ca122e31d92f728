#pragma once
// Pre-tokenizers of tokenizer.json: Sequence, Split (string or regex pattern, all five split
// behaviours, invert), Digits and ByteLevel. Regexes are Oniguruma syntax in the files; they are
// translated where PCRE2 differs (\s, \h, {,n}, nested classes, Unicode property classes from
// ICU; pretokenizer.cpp, translate_oniguruma) and compiled with PCRE2's JIT.
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/unicode_sets.h"

namespace tandem::text {

class PreTokenizer {
 public:
  // `config` is tokenizer.json's "pre_tokenizer" value. Byte-level BPE needs a ByteLevel step;
  // its absence, or any unsupported type, throws tandem::Error naming `origin`.
  PreTokenizer(const nlohmann::json& config, const std::string& origin);
  ~PreTokenizer();

  // Splits one segment of text into pieces. Pieces point into `text` or into `arena` (for the
  // prefix space that ByteLevel may add; a deque keeps them in place); empty pieces are dropped.
  void split(std::string_view text, std::vector<std::string_view>& pieces,
             std::deque<std::string>& arena) const;

  struct Step;

 private:
  std::vector<std::unique_ptr<Step>> steps_;
  // The characters on which PCRE2's property classes and ICU's disagree: text with one of them
  // is split with ICU's classes, other text with PCRE2's (faster; same pieces).
  unicode::Membership needs_exact_;
};

}  // namespace tandem::text
