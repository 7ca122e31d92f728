#pragma once
// Added tokens (special and not) of tokenizer.json. They are found in the text before BPE, the
// leftmost-longest match winning, with their lstrip / rstrip / single_word flags applied as
// Hugging Face tokenizers does.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::text {

using TokenId = int32_t;

struct AddedToken {
  std::string content;
  TokenId id = -1;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
  bool normalized = false;
};

// One matcher over a set of added tokens. Matching takes time linear in the text whatever the
// tokens' length: an Aho-Corasick automaton over the tokens written backwards, run once over the
// text from its end, gives the longest token starting at each offset.
class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  // `skip_special`: special tokens are found but left in the text, as tokenizers does with
  // encode_special_tokens (transformers' split_special_tokens); the search resumes after them.
  explicit AddedTokenMatcher(std::vector<AddedToken> tokens, bool skip_special = false);

  struct Segment {
    std::string_view text;  // the matched span (with stripped whitespace) or plain text
    TokenId id;             // -1 for plain text
  };
  // Splits text into plain segments and added-token matches, in order; appends to `out`.
  // `steps`, when given, grows by the automaton's steps (tests bound the work with it).
  void split(std::string_view text, std::vector<Segment>& out, size_t* steps = nullptr) const;
  bool empty() const { return tokens_.empty(); }

 private:
  // A node of the trie of the reversed tokens: the text read so far, backwards.
  struct Node {
    int32_t token = -1;    // index into tokens_ when a token ends here
    int32_t fail = 0;      // the node of the longest proper suffix of this one's text
    int32_t longest = -1;  // the longest token that this node's text ends with, or -1
    std::vector<std::pair<unsigned char, int32_t>> children;
  };
  int32_t child(int32_t node, unsigned char byte) const;

  std::vector<AddedToken> tokens_;
  bool skip_special_ = false;
  std::vector<Node> nodes_;
  int32_t root_children_[256] = {};  // the root's children by byte (0: none), the hot path
};

}  // namespace tandem::text
