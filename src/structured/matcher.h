#pragma once
// Where a text stands in a grammar: the set of parse stacks a top-down (pushdown) recognizer
// holds after reading it, advanced byte by byte. Stacks share their tails through a pool of
// hash-consed frames, so equal stacks are equal pairs and copying one is copying two integers.
// Many stacks at one position are one stack whose return frame is a union of theirs (a graph of
// stacks, as GLR parsers keep): an anyOf of objects that share a first field is one stack while
// inside it, however many objects, and splits where the field ends.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "structured/grammar.h"
#include "structured/vocabulary_trie.h"
#include "util/error.h"

namespace tandem::structured {

// What the constraint throws when the answer cannot go on as its format requires: an error of
// one request's format, which ends that request alone.
class ConstraintError : public Error {
 public:
  using Error::Error;
};

class GrammarMatcher {
 public:
  // The most work one call (the constructor, advance(), accepted_tokens()) may do, counted in
  // stacks stepped and rules entered. An ambiguous grammar (bounded repeats one after another:
  // '.{0,100}.{0,100}') holds a stack per way of reading the text so far, as many as the text is
  // long, and a mask steps every one at every node of the vocabulary's trie: past this the call
  // throws ConstraintError instead of holding the engine's thread for seconds (a unit took 4 to 9
  // ns on the test VM, so a mask stops within about 0.3 s). Unambiguous formats stay far below
  // it: a mask inside a JSON string, where nearly every token of DeepSeek-V3's is allowed, is
  // about 5 million.
  static constexpr size_t kMaxWork = size_t(1) << 25;
  // A mask may do more: as much as kMaskStacks stacks stepping at every node of the trie (about
  // 20 units a node a stack), so that formats holding a few stacks at different positions are
  // followed, while a format whose stacks grow with the answer still fails within about 16
  // characters' worth of growth.
  static constexpr size_t kMaskStacks = 16;
  static size_t mask_limit(const VocabularyTrie& trie);

  // Throws ConstraintError past kMaxWork.
  explicit GrammarMatcher(std::shared_ptr<const Grammar> grammar);

  // Reads `bytes`; false (and nothing read) when the grammar refuses them. Throws
  // ConstraintError (nothing read) past kMaxWork.
  bool advance(std::string_view bytes);
  // Whether the text read so far is complete: a sentence of the grammar.
  bool accepting() const;
  // Whether some byte may still follow.
  bool can_continue() const;
  // The bytes that may follow.
  ByteSet next_bytes() const;
  // The state as a string: equal for equal states, whichever matcher holds them.
  std::string key() const;
  // A key of the tokens of at most `longest` bytes that may follow: key() with each position as
  // Grammar::mask_position() has it, so states that differ only in how far a bounded repeat is
  // from its bounds, beyond what one token can reach, share it (and their masks).
  std::string mask_key(size_t longest) const;

  // Sets bit t of `allowed` (one bit per token id, 64 per word) for every token of the trie whose
  // bytes the grammar accepts next. The state is unchanged. Throws ConstraintError past
  // mask_limit(trie).
  void accepted_tokens(const VocabularyTrie& trie, std::vector<uint64_t>& allowed);
  // The work the last of those calls did, in kMaxWork's units.
  size_t work() const { return work_; }

 private:
  static constexpr int32_t kAccepted = -1;  // a stack that matched everything
  // A frame's pos that marks it a union: its rest is an index in unions_, whose members are the
  // frames (or -1, none) that stacks at one position return to. Members are never unions.
  static constexpr int32_t kUnion = -2;
  struct Stack {
    int32_t pos;   // offset in the grammar's code of the next terminal, or kAccepted
    int32_t rest;  // frame to return to when the current alternative ends, -1 for none
    bool operator==(const Stack&) const = default;
  };
  using Stacks = std::vector<Stack>;

  template <typename Position>
  std::string key_of(Position position) const;
  int32_t frame(int32_t pos, int32_t rest);
  // The frame that returns to each of `members` (frames or -1), sorted by id and deduplicated in
  // place; a member itself when only one is left.
  int32_t union_frame(std::vector<int32_t>& members);
  // A hash of what frame `f` (or -1, none) holds: positions down its chain, whatever its id.
  uint64_t shape(int32_t f) const { return f < 0 ? 0 : shapes_[size_t(f)]; }
  void merge(Stacks& sorted);  // stacks at one position become one, returning to a union
  void expand(int32_t pos, int32_t rest, Stacks& out);
  void new_step();
  void spend(size_t units);  // counts work, throws past kMaxWork
  void step(const Stacks& from, uint8_t byte, Stacks& to);
  void release(size_t frames, size_t unions);  // drops what was made after (a mask's scratch)
  void compact();
  void walk(const VocabularyTrie& trie, uint32_t node, size_t depth, std::vector<Stacks>& levels,
            std::vector<uint64_t>& allowed);

  std::shared_ptr<const Grammar> grammar_;
  std::vector<std::pair<int32_t, int32_t>> frames_;  // (pos, rest)
  std::unordered_map<uint64_t, int32_t> frame_ids_;
  std::vector<uint64_t> shapes_;              // of frames_, by id
  std::vector<std::vector<int32_t>> unions_;  // members of union frames
  struct MembersHash {
    size_t operator()(const std::vector<int32_t>& m) const;
  };
  std::unordered_map<std::vector<int32_t>, int32_t, MembersHash> union_ids_;
  std::vector<int32_t> members_;  // merge()'s scratch, kept for its capacity
  Stacks stacks_;
  Stacks todo_;                           // expand()'s work list, kept for its capacity
  size_t entries_ = 0;                    // rules expand() entered in this step
  std::unordered_set<uint64_t> entered_;  // (rule, return frame) pairs, past kEntriesBeforeDedup
  size_t work_ = 0;                       // spent by the call under way
  size_t limit_ = kMaxWork;               // of the call under way
};

}  // namespace tandem::structured
