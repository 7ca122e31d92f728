#pragma once
// Context-free grammars over bytes: what structured outputs (JSON schemas, JSON, regular
// expressions, choices) compile to, and what the matcher (structured/matcher.h) walks one byte at
// a time. Rules are lists of alternatives, alternatives are sequences of symbols, a symbol is a
// byte set or another rule. Left recursion is refused (the matcher expands rules top-down).
#include <bitset>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "util/error.h"

namespace tandem::structured {

using ByteSet = std::bitset<256>;

class Grammar {
 public:
  // A symbol: >= 0 is a rule id, < 0 a terminal (byte set) -(index + 1).
  using Symbol = int32_t;
  using Sequence = std::vector<Symbol>;

  // Building. A new rule has no alternatives until add() gives it some.
  Symbol new_rule();
  void add(Symbol rule, Sequence alternative);
  Symbol bytes(const ByteSet& set);
  Symbol byte(uint8_t c);
  Sequence literal(std::string_view text);
  // A rule with these alternatives.
  Symbol any_of(std::vector<Sequence> alternatives);
  // A rule matching exactly one of `texts` (duplicates are one). Built as a trie whose runs
  // without a branch are literals, so the matcher holds one stack wherever it is: as alternatives
  // of one rule, 180,000 choices were 180,000 stacks, each stepped at every node of a mask's walk.
  Symbol one_of_texts(std::vector<std::string> texts);
  // `item` at least `min` and at most `max` times (max < 0: no limit). `item` must not match the
  // empty string.
  Symbol repeat(const Sequence& item, int64_t min, int64_t max);
  // A rule that matches no text, for a place that must hold a rule where no text can follow
  // (finish() drops every alternative that holds it).
  Symbol never();
  // Declares rules first.. first + width * blocks - 1, made in that order, as `blocks` blocks of
  // `width` rules: the states of an automaton once per count of characters read, block k + 1
  // reached from block k by one character (a pattern within minLength and maxLength). Blocks
  // alike (the same alternatives, each referring to the same place of its own or the next block)
  // read alike: finish() finds runs of them for mask_position().
  void counted_blocks(Symbol first, int32_t width, int64_t blocks);
  // Rules made so far.
  size_t rules() const { return rules_.size(); }
  // For rules first.. (those before are taken to be): whether each matches some finite text,
  // that is, has an alternative of terminals and such rules only.
  std::vector<bool> productive(size_t first = 0) const;
  // Makes `rule` the start, flattens the grammar for matching and checks it: throws
  // tandem::Error for left recursion, a rule without alternatives, a start that matches no
  // finite text or a grammar too large. Alternatives that match no finite text are dropped (a
  // matcher would let an answer into them and it could never end).
  void finish(Symbol root);

  // Matching (after finish): code() holds every alternative's symbols followed by kEnd;
  // alternatives(rule) are the offsets where that rule's alternatives start.
  static constexpr Symbol kEnd = INT32_MIN;
  Symbol root() const { return root_; }
  const std::vector<Symbol>& code() const { return code_; }
  const std::vector<int32_t>& alternatives(Symbol rule) const { return starts_[size_t(rule)]; }
  const ByteSet& terminal(Symbol s) const { return terminals_[size_t(-s - 1)]; }
  size_t size() const { return code_.size(); }
  // The memory it holds, about.
  size_t bytes() const;
  // The position that stands for `pos` (in a parse stack or a return frame) in a key of the
  // tokens that may follow, tokens of at most `longest` bytes. Which of them may follow depends
  // only on the continuations of at most `longest` bytes, and inside a bounded repeat two
  // positions at the same offset of the item have the same such continuations when both have at
  // least `longest` items still required after theirs, or both are past the required ones with at
  // least `longest` more allowed: items read a byte or more, so no continuation that short
  // reaches the bound from either. Likewise two positions at the same offset of two counted
  // blocks (counted_blocks()) each followed by `longest` or more blocks alike. Those share one
  // position; any other stands for itself. Without this each character of a string of maxLength
  // 2000 was a state, and a walk of the vocabulary.
  int32_t mask_position(int32_t pos, size_t longest) const;

  // Limits: grammars past them are refused with an error, not built (GrammarTooLarge past
  // kMaxSymbols).
  static constexpr size_t kMaxSymbols = 4'000'000;
  // Symbols added so far (what kMaxSymbols bounds).
  size_t symbols() const { return symbols_; }
  // Throws GrammarTooLarge unless `symbols` more fit within kMaxSymbols: what add() checks, for
  // a builder to check before it makes the rules of a part whose size it knows.
  void make_room(size_t symbols) const;
  // How deep the compilers may nest (regex groups; nested schemas and the $refs followed to reach
  // one). They recurse once per level, and at this depth they use well under 1 MiB of stack (the
  // tests compile at the limit on a thread of 1 MiB), less than any thread that compiles.
  static constexpr int kMaxNesting = 1000;

 private:
  std::vector<std::vector<Sequence>> rules_;
  std::vector<ByteSet> terminals_;
  std::map<std::string, Symbol> terminal_ids_;
  std::vector<Symbol> code_;
  std::vector<std::vector<int32_t>> starts_;
  Symbol root_ = -1;
  size_t symbols_ = 0;
  // The repeats built with runs of items (two or more required, or two or more optional ones),
  // for finish() to find in code().
  struct Built {
    Symbol rule;         // item^min then tail
    Symbol tail;         // the first link or the loop, -1 for none
    Symbol last_link;    // links are rules last_link.. in order last to first
    int64_t min, links;  // links: max - min
    Sequence item;
  };
  std::vector<Built> built_;
  struct Counted {
    Symbol first;
    int32_t width;
    int64_t blocks;
  };
  std::vector<Counted> counted_;
  Symbol never_ = -1;
  // A run of a repeat's items in code(): `count` of them `stride` apart, each with `width`
  // positions that mask_position() may replace. The item at j (from `begin`) has
  // left_first + left_step * j items after it up to the bound the run ends at, and the run's
  // positions that have at least `longest` become canonical + their offset in the item.
  struct Run {
    int32_t begin, count, stride, width;
    int64_t left_first, left_step;
    int32_t canonical;
  };
  std::vector<Run> runs_;  // by begin
  // rule_begin[r]: where rule r's code starts (its alternatives, if any are left).
  void find_runs(const std::vector<int32_t>& rule_begin);
  void find_counted_runs(const std::vector<int32_t>& rule_begin);
};

// Thrown when a grammar would pass Grammar::kMaxSymbols: `refused` the symbols that did not fit
// (an alternative's, or a whole part's refused before it was built).
class GrammarTooLarge : public Error {
 public:
  explicit GrammarTooLarge(const std::string& what, size_t refused = 0)
      : Error(what), refused(refused) {}
  size_t refused;
};

// UTF-8 encoded code points as grammar sequences: the alternatives that match one code point in
// [lo, hi] (well-formed UTF-8, no surrogates).
std::vector<Grammar::Sequence> utf8_range(Grammar& g, uint32_t lo, uint32_t hi);

}  // namespace tandem::structured
