#include "structured/matcher.h"

#include <algorithm>
#include <tuple>

#include "util/error.h"
#include "util/hash.h"

namespace tandem::structured {
namespace {

// Rules entered in one step before each (rule, return frame) is entered once only: an ambiguous
// grammar (optional parts one after another) reaches the same ones along many paths, which
// costs quadratic or exponential time. Below it, a set would only slow the usual small steps.
constexpr size_t kEntriesBeforeDedup = 256;
// Stacks at one position merged into one from this many on. Merging costs more than stepping the
// few a format usually holds at one position (a JSON value's white space, entered from the comma's
// and the brace's places), and pays where many stay inside one rule for a while (an anyOf's
// variants inside their shared first field).
constexpr size_t kMergeFrom = 8;
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
  merge(stacks_);
}

size_t GrammarMatcher::MembersHash::operator()(const std::vector<int32_t>& m) const {
  return hash_bytes({reinterpret_cast<const char*>(m.data()), m.size() * sizeof(int32_t)});
}

int32_t GrammarMatcher::frame(int32_t pos, int32_t rest) {
  const uint64_t key = pair_key(pos, rest);
  if (auto it = frame_ids_.find(key); it != frame_ids_.end()) return it->second;
  const auto id = static_cast<int32_t>(frames_.size());
  frames_.emplace_back(pos, rest);
  shapes_.push_back(hash_u64(shape(rest) * 0x9E3779B97F4A7C15ULL + uint32_t(pos)));
  frame_ids_.emplace(key, id);
  return id;
}

int32_t GrammarMatcher::union_frame(std::vector<int32_t>& members) {
  if (!std::is_sorted(members.begin(), members.end())) std::sort(members.begin(), members.end());
  members.erase(std::unique(members.begin(), members.end()), members.end());
  if (members.size() == 1) return members[0];
  if (auto it = union_ids_.find(members); it != union_ids_.end()) return it->second;
  const auto id = static_cast<int32_t>(frames_.size());
  frames_.emplace_back(kUnion, static_cast<int32_t>(unions_.size()));
  uint64_t h = 0;  // of the members' shapes in any order, as their ids say nothing
  for (int32_t m : members) h += hash_u64(shape(m));
  shapes_.push_back(hash_u64(h ^ uint64_t(kUnion)));
  unions_.push_back(members);
  union_ids_.emplace(members, id);
  return id;
}

void GrammarMatcher::merge(Stacks& sorted) {
  // Usually no position holds that many: find the first that does, or leave the stacks alone.
  size_t start = 0, end = 1;  // of a run of stacks at one position
  for (; end < sorted.size() && end - start < kMergeFrom; ++end)
    if (sorted[end].pos != sorted[start].pos) start = end;
  if (end - start < kMergeFrom) return;
  size_t kept = start;  // the stacks before that run stay where they are
  for (size_t i = kept, j; i < sorted.size(); i = j) {
    for (j = i + 1; j < sorted.size() && sorted[j].pos == sorted[i].pos;) ++j;
    if (j - i < kMergeFrom) {  // kept as they are, kAccepted stacks too: all (kAccepted, -1)
      while (i < j) sorted[kept++] = sorted[i++];
      continue;
    }
    members_.clear();
    for (size_t k = i; k < j; ++k) {
      const int32_t r = sorted[k].rest;
      if (r >= 0 && frames_[size_t(r)].first == kUnion) {
        const auto& m = unions_[size_t(frames_[size_t(r)].second)];
        members_.insert(members_.end(), m.begin(), m.end());
      } else {
        members_.push_back(r);
      }
    }
    spend(members_.size());
    sorted[kept++] = {sorted[i].pos, union_frame(members_)};
  }
  sorted.resize(kept);
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
        const auto [p, r] = frames_[size_t(rest)];
        if (p == kUnion) {  // to each of the callers of the stacks merged
          const auto& members = unions_[size_t(r)];
          spend(members.size());
          for (int32_t m : members)
            if (m < 0)
              out.push_back({kAccepted, -1});
            else
              todo_.push_back({frames_[size_t(m)].first, frames_[size_t(m)].second});
          break;
        }
        pos = p;
        rest = r;
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
        "many schemas that read the same text in different ways)");
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
    if (to.size() >= kMergeFrom) merge(to);
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
  // Each stack's position, then its chain of frames, written depth first: a union as its members'
  // chains between two marks, or a reference to where it was written already (a union may be
  // reached along many chains). Positions are >= -1, so the marks below cannot be mistaken.
  enum Mark : int32_t { kStack = -2, kOpen = -3, kClose = -4, kSeen = -5, kNone = -6 };
  std::string k;
  auto put = [&](int32_t v) { k.append(reinterpret_cast<const char*>(&v), sizeof v); };
  std::unordered_map<int32_t, int32_t> written;  // union frame -> its order of writing
  std::vector<int32_t> todo;                     // chains to write, or kClose
  for (const Stack& s : stacks_) {
    put(position(s.pos));
    todo.assign(1, s.rest);
    while (!todo.empty()) {
      int32_t r = todo.back();
      todo.pop_back();
      if (r == kClose) {
        put(kClose);
        continue;
      }
      for (;; r = frames_[size_t(r)].second) {
        if (r < 0) {
          put(kNone);
          break;
        }
        const auto [p, rest] = frames_[size_t(r)];
        if (p != kUnion) {
          put(position(p));
          continue;
        }
        const auto [it, first] = written.emplace(r, static_cast<int32_t>(written.size()));
        if (!first) {
          put(kSeen);
          put(it->second);
          break;
        }
        put(kOpen);
        todo.push_back(kClose);
        // By shape, so that equal unions are written alike by every matcher unless two shapes
        // collide (then a mask is computed again, never taken wrongly: the key still tells the
        // states apart); ids, which depend on the matcher's history, only order those.
        const size_t from = todo.size();
        const auto& members = unions_[size_t(rest)];
        todo.insert(todo.end(), members.begin(), members.end());
        std::sort(todo.begin() + std::ptrdiff_t(from), todo.end(), [this](int32_t a, int32_t b) {
          return std::pair(shape(a), a) > std::pair(shape(b), b);  // the first on top
        });
        break;
      }
    }
    put(kStack);
  }
  return k;
}

std::string GrammarMatcher::key() const {
  return key_of([](int32_t pos) { return pos; });
}

std::string GrammarMatcher::mask_key(size_t longest) const {
  return key_of([&](int32_t pos) { return grammar_->mask_position(pos, longest); });
}

void GrammarMatcher::release(size_t frames, size_t unions) {
  for (size_t i = frames; i < frames_.size(); ++i)
    if (frames_[i].first == kUnion)
      union_ids_.erase(unions_[size_t(frames_[i].second)]);
    else
      frame_ids_.erase(pair_key(frames_[i].first, frames_[i].second));
  frames_.resize(frames);
  shapes_.resize(frames);
  unions_.resize(unions);
}

void GrammarMatcher::compact() {
  // Rebuilds the pool with only the frames the stacks reach (older ones belonged to bytes read).
  std::vector<std::pair<int32_t, int32_t>> old;
  std::vector<std::vector<int32_t>> old_unions;
  old.swap(frames_);
  old_unions.swap(unions_);
  shapes_.clear();
  frame_ids_.clear();
  union_ids_.clear();
  std::unordered_map<int32_t, int32_t> moved{{-1, -1}};
  // Iterative, depth first: a chain is as long as the answer nests (a recursive schema's
  // "[[[[..."). A frame moves once what it returns to has moved.
  std::vector<int32_t> todo;
  std::vector<int32_t> members;
  for (Stack& s : stacks_) {
    todo.assign(1, s.rest);
    while (!todo.empty()) {
      const int32_t r = todo.back();
      if (moved.count(r)) {
        todo.pop_back();
        continue;
      }
      const auto [p, rest] = old[size_t(r)];
      if (p != kUnion) {
        if (auto it = moved.find(rest); it != moved.end()) {
          moved.emplace(r, frame(p, it->second));
          todo.pop_back();
        } else {
          todo.push_back(rest);
        }
        continue;
      }
      const size_t waiting = todo.size();
      for (int32_t m : old_unions[size_t(rest)])
        if (!moved.count(m)) todo.push_back(m);
      if (todo.size() > waiting) continue;
      members.clear();
      for (int32_t m : old_unions[size_t(rest)]) members.push_back(moved.at(m));
      moved.emplace(r, union_frame(members));
      todo.pop_back();
    }
    s.rest = moved.at(s.rest);
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
  const size_t frames = frames_.size(), unions = unions_.size();
  std::vector<Stacks> levels(trie.max_depth + 1);
  levels[0] = stacks_;
  try {
    walk(trie, 0, 0, levels, allowed);
  } catch (const ConstraintError&) {
    release(frames, unions);
    throw;
  }
  release(frames, unions);
}

}  // namespace tandem::structured
