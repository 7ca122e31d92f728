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
    int32_t node = 0;
    for (auto it = content.rbegin(); it != content.rend(); ++it) {
      const auto b = static_cast<unsigned char>(*it);
      int32_t next = -1;
      for (const auto& [byte, index] : nodes_[node].children)
        if (byte == b) next = index;
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_[node].children.emplace_back(b, next);
        nodes_.emplace_back();
      }
      node = next;
    }
    if (nodes_[node].token < 0) nodes_[node].token = static_cast<int32_t>(t);
  }
  for (const auto& [byte, index] : nodes_[0].children) root_children_[byte] = index;
  // Failure links breadth first, so that a node's link, which is shallower, is done before it.
  std::vector<int32_t> queue;
  for (const auto& [byte, index] : nodes_[0].children) queue.push_back(index);
  for (size_t q = 0; q < queue.size(); ++q) {
    const int32_t node = queue[q];
    Node& n = nodes_[node];
    n.longest = n.token >= 0 ? n.token : nodes_[n.fail].longest;
    for (const auto& [byte, index] : n.children) {
      int32_t f = n.fail, next;
      while ((next = child(f, byte)) < 0 && f != 0) f = nodes_[f].fail;
      nodes_[index].fail = next < 0 ? 0 : next;
      queue.push_back(index);
    }
  }
}

int32_t AddedTokenMatcher::child(int32_t node, unsigned char byte) const {
  if (node == 0) return root_children_[byte] ? root_children_[byte] : -1;
  for (const auto& [b, index] : nodes_[node].children)
    if (b == byte) return index;
  return -1;
}

void AddedTokenMatcher::split(std::string_view text, std::vector<Segment>& out,
                              size_t* steps) const {
  // The longest token starting at each offset where one starts, as (offset, token), in
  // decreasing order of offset: the automaton reads the text backwards, so a token starting at
  // an offset is one that the text read so far ends with.
  std::vector<std::pair<size_t, int32_t>> starts;
  if (nodes_.size() > 1) {
    size_t work = 0;
    int32_t node = 0;
    for (size_t i = text.size(); i-- > 0;) {
      const auto b = static_cast<unsigned char>(text[i]);
      int32_t next;
      while ((next = child(node, b)) < 0 && node != 0) {
        node = nodes_[node].fail;
        ++work;
      }
      node = next < 0 ? 0 : next;
      ++work;
      if (nodes_[node].longest >= 0) starts.emplace_back(i, nodes_[node].longest);
    }
    if (steps) *steps += work;
  }
  size_t emitted = 0;  // text before this offset has been emitted
  size_t resume = 0;   // matches start at or after this offset (they do not overlap)
  for (auto it = starts.rbegin(); it != starts.rend(); ++it) {
    const auto [i, t] = *it;
    if (i < resume) continue;
    const AddedToken& tok = tokens_[t];
    size_t start = i, stop = i + tok.content.size();
    resume = stop;
    // tokenizers' find_matches skips the match itself, nothing inside it
    if (tok.special && skip_special_) continue;
    // matches do not overlap: the search resumes after the rejected one, as in HF
    if (tok.single_word && (is_word_char(last_char(text.substr(0, start))) ||
                            is_word_char(first_char(text.substr(stop)))))
      continue;
    // As HF's find_matches: the matches are those of one leftmost-longest scan of the text, which
    // goes on where a match ends whatever its flags take; lstrip takes the white space before it
    // that no earlier token took, rstrip the white space after it, and the text after a token
    // starts where the token's span ends. A token found inside white space that the previous
    // token's rstrip took is emitted too, and the text after it then starts inside that white
    // space again ("<R>\n\n\ny" with <R> rstrip and "\n\n" a token: <R>, "\n\n", "\ny").
    if (tok.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), emitted);
    if (tok.rstrip) stop += leading_space_length(text.substr(stop));
    if (start > emitted) out.push_back({text.substr(emitted, start - emitted), -1});
    out.push_back({text.substr(std::min(start, stop), stop - std::min(start, stop)), tok.id});
    emitted = stop;
  }
  if (emitted < text.size()) out.push_back({text.substr(emitted), -1});
}

}  // namespace tandem::text
