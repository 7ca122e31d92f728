#pragma once
// Where a text stands in a grammar: the set of parse stacks a top-down (pushdown) recognizer
// holds after reading it, advanced byte by byte. Stacks share their tails through a pool of
// hash-consed frames, so equal stacks are equal pairs and copying one is copying two integers.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "structured/grammar.h"
#include "structured/vocabulary_trie.h"

namespace tandem::structured {

class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const Grammar> grammar);

  // Reads `bytes`; false (and nothing read) when the grammar refuses them.
  bool advance(std::string_view bytes);
  // Whether the text read so far is complete: a sentence of the grammar.
  bool accepting() const;
  // Whether some byte may still follow.
  bool can_continue() const;
  // The bytes that may follow.
  ByteSet next_bytes() const;
  // The state as a string: equal for equal states, whichever matcher holds them.
  std::string key() const;

  // Sets bit t of `allowed` (one bit per token id, 64 per word) for every token of the trie whose
  // bytes the grammar accepts next. The state is unchanged.
  void accepted_tokens(const VocabularyTrie& trie, std::vector<uint64_t>& allowed);

 private:
  static constexpr int32_t kAccepted = -1;  // a stack that matched everything
  struct Stack {
    int32_t pos;   // offset in the grammar's code of the next terminal, or kAccepted
    int32_t rest;  // frame to return to when the current alternative ends, -1 for none
    bool operator==(const Stack&) const = default;
  };
  using Stacks = std::vector<Stack>;

  int32_t frame(int32_t pos, int32_t rest);
  void expand(int32_t pos, int32_t rest, Stacks& out);
  void new_step();
  void step(const Stacks& from, uint8_t byte, Stacks& to);
  void release(size_t mark);  // drops frames made after `mark` (a mask's scratch)
  void compact();
  void walk(const VocabularyTrie& trie, uint32_t node, size_t depth, std::vector<Stacks>& levels,
            std::vector<uint64_t>& allowed);

  std::shared_ptr<const Grammar> grammar_;
  std::vector<std::pair<int32_t, int32_t>> frames_;  // (pos, rest)
  std::unordered_map<uint64_t, int32_t> frame_ids_;
  Stacks stacks_;
  Stacks todo_;                           // expand()'s work list, kept for its capacity
  size_t entries_ = 0;                    // rules expand() entered in this step
  std::unordered_set<uint64_t> entered_;  // (rule, return frame) pairs, past kEntriesBeforeDedup
};

}  // namespace tandem::structured
