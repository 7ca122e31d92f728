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

// One matcher over a set of added tokens (a byte trie).
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
  void split(std::string_view text, std::vector<Segment>& out) const;
  bool empty() const { return tokens_.empty(); }

 private:
  struct Node {
    int32_t token = -1;  // index into tokens_ when a token ends here
    std::vector<std::pair<unsigned char, int32_t>> children;
  };
  // Returns the index of the longest token starting at `at`, or -1.
  int32_t longest_at(std::string_view text, size_t at) const;

  std::vector<AddedToken> tokens_;
  bool skip_special_ = false;
  std::vector<Node> nodes_;
  bool first_byte_[256] = {};
};

}  // namespace tandem::text
