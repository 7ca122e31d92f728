#include "text/added_vocabulary.h"

#include <unicode/uchar.h>

#include "util/utf8.h"

namespace tandem::text {
namespace {

// The last / first character of s, or U+FFFF when there is none.
char32_t last_char(std::string_view s) {
  if (s.empty()) return 0xFFFF;
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  size_t len = utf8::valid_sequence_length(s, i);
  return len ? utf8::decode_at(s, i, len) : 0xFFFF;
}

char32_t first_char(std::string_view s) {
  if (s.empty()) return 0xFFFF;
  size_t len = utf8::valid_sequence_length(s, 0);
  return len ? utf8::decode_at(s, 0, len) : 0xFFFF;
}

// The regex crate's Unicode \w, which HF's single_word check matches against the characters
// beside a token (`\w$`, `^\w`): Alphabetic, marks, decimal digits, connector punctuation
// (not only '_') and the joiners ZWNJ / ZWJ. Other numbers (², ½) are not word characters.
bool is_word_char(char32_t c) {
  if (c == 0xFFFF) return false;
  const auto cp = static_cast<UChar32>(c);
  if (u_hasBinaryProperty(cp, UCHAR_ALPHABETIC) || u_hasBinaryProperty(cp, UCHAR_JOIN_CONTROL))
    return true;
  const int32_t mask = U_GET_GC_MASK(cp);
  return (mask & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0;
}

bool is_space(char32_t c) {
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE);
}

// Byte offset where the trailing whitespace of s begins.
size_t trailing_space_start(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t i = end - 1;
    while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
    size_t len = utf8::valid_sequence_length(s, i);
    if (!len || !is_space(utf8::decode_at(s, i, len))) break;
    end = i;
  }
  return end;
}

// Length in bytes of the leading whitespace of s.
size_t leading_space_length(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t len = utf8::valid_sequence_length(s, i);
    if (!len || !is_space(utf8::decode_at(s, i, len))) break;
    i += len;
  }
  return i;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens, bool skip_special)
    : tokens_(std::move(tokens)), skip_special_(skip_special) {
  nodes_.emplace_back();
  for (size_t t = 0; t < tokens_.size(); ++t) {
    const auto& content = tokens_[t].content;
    if (content.empty()) continue;
    first_byte_[static_cast<unsigned char>(content[0])] = true;
    int32_t node = 0;
    for (unsigned char b : content) {
      int32_t child = -1;
      for (auto& [byte, index] : nodes_[node].children)
        if (byte == b) child = index;
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_[node].children.emplace_back(b, child);
        nodes_.emplace_back();
      }
      node = child;
    }
    if (nodes_[node].token < 0) nodes_[node].token = static_cast<int32_t>(t);
  }
}

int32_t AddedTokenMatcher::longest_at(std::string_view text, size_t at) const {
  int32_t node = 0, best = -1;
  for (size_t i = at; i < text.size(); ++i) {
    auto b = static_cast<unsigned char>(text[i]);
    int32_t next = -1;
    for (auto& [byte, index] : nodes_[node].children)
      if (byte == b) next = index;
    if (next < 0) break;
    node = next;
    if (nodes_[node].token >= 0) best = nodes_[node].token;
  }
  return best;
}

void AddedTokenMatcher::split(std::string_view text, std::vector<Segment>& out) const {
  size_t emitted = 0;  // text before this offset has been emitted
  size_t i = 0;
  while (i < text.size()) {
    if (!first_byte_[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    int32_t t = longest_at(text, i);
    if (t < 0) {
      ++i;
      continue;
    }
    const AddedToken& tok = tokens_[t];
    size_t start = i, stop = i + tok.content.size();
    if (tok.special && skip_special_) {
      i = stop;  // tokenizers' find_matches skips the match itself, nothing inside it
      continue;
    }
    if (tok.single_word && (is_word_char(last_char(text.substr(0, start))) ||
                            is_word_char(first_char(text.substr(stop))))) {
      i = stop;  // matches do not overlap: the search resumes after the rejected one, as in HF
      continue;
    }
    // As HF's find_matches: the matches are those of one leftmost-longest scan of the text, which
    // goes on where a match ends whatever its flags take; lstrip takes the white space before it
    // that no earlier token took, rstrip the white space after it, and the text after a token
    // starts where the token's span ends. A token found inside white space that the previous
    // token's rstrip took is emitted too, and the text after it then starts inside that white
    // space again ("<R>\n\n\ny" with <R> rstrip and "\n\n" a token: <R>, "\n\n", "\ny").
    i = stop;
    if (tok.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), emitted);
    if (tok.rstrip) stop += leading_space_length(text.substr(stop));
    if (start > emitted) out.push_back({text.substr(emitted, start - emitted), -1});
    out.push_back({text.substr(std::min(start, stop), stop - std::min(start, stop)), tok.id});
    emitted = stop;
  }
  if (emitted < text.size()) out.push_back({text.substr(emitted), -1});
}

}  // namespace tandem::text
