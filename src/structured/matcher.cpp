#include "structured/matcher.h"

#include <algorithm>
#include <tuple>

#include "util/error.h"

namespace tandem::structured {
namespace {

// Rules entered in one step before each (rule, return frame) is entered once only: an ambiguous
// grammar (optional parts one after another) reaches the same ones along many paths, which
// costs quadratic or exponential time. Below it, a set would only slow the usual small steps.
constexpr size_t kEntriesBeforeDedup = 256;
// Frames kept before unreachable ones are dropped.
constexpr size_t kCompactAbove = 1 << 16;

uint64_t pair_key(int32_t pos, int32_t rest) {
  return (uint64_t(uint32_t(pos)) << 32) | uint32_t(rest);
}

}  // namespace

GrammarMatcher::GrammarMatcher(std::shared_ptr<const Grammar> grammar)
    : grammar_(std::move(grammar)) {
  work_ = 0;
  new_step();
  for (int32_t start : grammar_->alternatives(grammar_->root())) expand(start, -1, stacks_);
  std::sort(stacks_.begin(), stacks_.end(), [](const Stack& a, const Stack& b) {
    return pair_key(a.pos, a.rest) < pair_key(b.pos, b.rest);
  });
  stacks_.erase(std::unique(stacks_.begin(), stacks_.end()), stacks_.end());
}

int32_t GrammarMatcher::frame(int32_t pos, int32_t rest) {
  const uint64_t key = pair_key(pos, rest);
  if (auto it = frame_ids_.find(key); it != frame_ids_.end()) return it->second;
  const auto id = static_cast<int32_t>(frames_.size());
  frames_.emplace_back(pos, rest);
  frame_ids_.emplace(key, id);
  return id;
}

// From symbol `pos` with return frame `rest`: every stack whose next symbol is a terminal.
// Iterative: a chain of rules entered without reading a byte (nested groups, optional parts one
// after another) may be as long as the grammar. The order of `out` is the callers' to fix.
void GrammarMatcher::expand(int32_t pos, int32_t rest, Stacks& out) {
  const auto& code = grammar_->code();
  todo_.clear();
  todo_.push_back({pos, rest});
  while (!todo_.empty()) {
    pos = todo_.back().pos;
    rest = todo_.back().rest;
    todo_.pop_back();
    for (;;) {
      const Grammar::Symbol s = code[size_t(pos)];
      if (s == Grammar::kEnd) {  // the alternative ended: return to the caller
        if (rest < 0) {
          out.push_back({kAccepted, -1});
          break;
        }
        std::tie(pos, rest) = frames_[size_t(rest)];
        continue;
      }
      if (s < 0) {
        out.push_back({pos, rest});
        spend(1);
        break;
      }
      // A rule: its alternatives, returning to what follows it (nothing to push when it is last).
      const int32_t back = code[size_t(pos) + 1] == Grammar::kEnd ? rest : frame(pos + 1, rest);
      spend(1);
      if (++entries_ > kEntriesBeforeDedup && !entered_.insert(pair_key(s, back)).second) break;
      const auto& starts = grammar_->alternatives(s);
      for (auto it = starts.rbegin(); it != starts.rend(); ++it) todo_.push_back({*it, back});
      break;
    }
  }
}

void GrammarMatcher::new_step() {
  // The pairs entered say what this step's output holds already: a new step starts empty.
  if (entries_ > kEntriesBeforeDedup) entered_.clear();
  entries_ = 0;
}

size_t GrammarMatcher::mask_limit(const VocabularyTrie& trie) {
  return std::max(kMaxWork, kMaskStacks * 20 * trie.nodes.size());
}

void GrammarMatcher::spend(size_t units) {
  work_ += units;
  if (work_ > limit_)
    throw ConstraintError(
        "structured output: the format is too ambiguous to follow here (over " +
        std::to_string(limit_) +
        " parse steps for one token: the answer so far can be read in too many ways at once, "
        "as with bounded repeats one after another, like '.{0,100}.{0,100}', or an anyOf of "
        "many objects that begin alike)");
}

void GrammarMatcher::step(const Stacks& from, uint8_t byte, Stacks& to) {
  to.clear();
  new_step();
  spend(from.size());
  for (const Stack& st : from)
    if (st.pos != kAccepted && grammar_->terminal(grammar_->code()[size_t(st.pos)]).test(byte))
      expand(st.pos + 1, st.rest, to);
  if (to.size() > 1) {
    std::sort(to.begin(), to.end(), [](const Stack& a, const Stack& b) {
      return pair_key(a.pos, a.rest) < pair_key(b.pos, b.rest);
    });
    to.erase(std::unique(to.begin(), to.end()), to.end());
  }
}

bool GrammarMatcher::advance(std::string_view bytes) {
  work_ = 0;
  limit_ = kMaxWork;
  Stacks cur = stacks_, next;
  for (char c : bytes) {
    step(cur, static_cast<uint8_t>(c), next);
    if (next.empty()) return false;
    cur.swap(next);
  }
  stacks_ = std::move(cur);
  if (frames_.size() > kCompactAbove) compact();
  return true;
}

bool GrammarMatcher::accepting() const {
  return std::any_of(stacks_.begin(), stacks_.end(),
                     [](const Stack& s) { return s.pos == kAccepted; });
}

bool GrammarMatcher::can_continue() const {
  return std::any_of(stacks_.begin(), stacks_.end(),
                     [](const Stack& s) { return s.pos != kAccepted; });
}

ByteSet GrammarMatcher::next_bytes() const {
  ByteSet out;
  for (const Stack& s : stacks_)
    if (s.pos != kAccepted) out |= grammar_->terminal(grammar_->code()[size_t(s.pos)]);
  return out;
}

template <typename Position>
std::string GrammarMatcher::key_of(Position position) const {
  std::string k;
  auto put = [&](int32_t v) { k.append(reinterpret_cast<const char*>(&v), sizeof v); };
  for (const Stack& s : stacks_) {
    put(position(s.pos));
    for (int32_t r = s.rest; r >= 0; r = frames_[size_t(r)].second)
      put(position(frames_[size_t(r)].first));
    put(-2);
  }
  return k;
}

std::string GrammarMatcher::key() const {
  return key_of([](int32_t pos) { return pos; });
}

std::string GrammarMatcher::mask_key(size_t longest) const {
  return key_of([&](int32_t pos) { return grammar_->mask_position(pos, longest); });
}

void GrammarMatcher::release(size_t mark) {
  for (size_t i = mark; i < frames_.size(); ++i)
    frame_ids_.erase(pair_key(frames_[i].first, frames_[i].second));
  frames_.resize(mark);
}

void GrammarMatcher::compact() {
  // Rebuilds the pool with only the frames the stacks reach (older ones belonged to bytes read).
  std::vector<std::pair<int32_t, int32_t>> old;
  old.swap(frames_);
  frame_ids_.clear();
  std::unordered_map<int32_t, int32_t> moved;
  std::vector<int32_t> chain;  // a stack's frames not moved yet, innermost first
  for (Stack& s : stacks_) {
    // Iterative: a chain is as long as the answer nests (a recursive schema's "[[[[...").
    chain.clear();
    int32_t below = -1;  // the new id of the frame under the chain
    for (int32_t r = s.rest; r >= 0; r = old[size_t(r)].second) {
      if (auto it = moved.find(r); it != moved.end()) {
        below = it->second;
        break;
      }
      chain.push_back(r);
    }
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      below = frame(old[size_t(*it)].first, below);
      moved.emplace(*it, below);
    }
    s.rest = below;
  }
}

void GrammarMatcher::walk(const VocabularyTrie& trie, uint32_t node, size_t depth,
                          std::vector<Stacks>& levels, std::vector<uint64_t>& allowed) {
  const VocabularyTrie::Node& n = trie.nodes[node];
  for (uint32_t c = n.first_child; c < n.first_child + n.num_children; ++c) {
    const VocabularyTrie::Node& child = trie.nodes[c];
    step(levels[depth], child.byte, levels[depth + 1]);
    if (levels[depth + 1].empty()) continue;
    for (uint32_t t = child.first_token; t < child.first_token + child.num_tokens; ++t) {
      const auto id = static_cast<size_t>(trie.tokens[t]);
      allowed[id / 64] |= uint64_t(1) << (id % 64);
    }
    if (child.num_children > 0) walk(trie, c, depth + 1, levels, allowed);
  }
}

void GrammarMatcher::accepted_tokens(const VocabularyTrie& trie, std::vector<uint64_t>& allowed) {
  work_ = 0;
  limit_ = mask_limit(trie);
  const size_t mark = frames_.size();
  std::vector<Stacks> levels(trie.max_depth + 1);
  levels[0] = stacks_;
  try {
    walk(trie, 0, 0, levels, allowed);
  } catch (const ConstraintError&) {
    release(mark);
    throw;
  }
  release(mark);
}

}  // namespace tandem::structured
