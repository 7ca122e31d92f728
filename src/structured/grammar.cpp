#include "structured/grammar.h"

#include <algorithm>
#include <string>
#include <tuple>

#include "util/error.h"

namespace tandem::structured {

Grammar::Symbol Grammar::new_rule() {
  rules_.emplace_back();
  return static_cast<Symbol>(rules_.size() - 1);
}

void Grammar::make_room(size_t symbols) const {
  if (symbols_ + symbols > kMaxSymbols)
    throw GrammarTooLarge(
        "the grammar is too large (over " + std::to_string(kMaxSymbols) + " symbols)", symbols);
}

void Grammar::add(Symbol rule, Sequence alternative) {
  make_room(alternative.size() + 1);
  symbols_ += alternative.size() + 1;
  rules_.at(size_t(rule)).push_back(std::move(alternative));
}

Grammar::Symbol Grammar::bytes(const ByteSet& set) {
  const std::string key = set.to_string();
  if (auto it = terminal_ids_.find(key); it != terminal_ids_.end()) return it->second;
  terminals_.push_back(set);
  const Symbol s = -static_cast<Symbol>(terminals_.size());
  terminal_ids_.emplace(key, s);
  return s;
}

Grammar::Symbol Grammar::byte(uint8_t c) {
  ByteSet set;
  set.set(c);
  return bytes(set);
}

Grammar::Sequence Grammar::literal(std::string_view text) {
  Sequence out;
  for (char c : text) out.push_back(byte(static_cast<uint8_t>(c)));
  return out;
}

Grammar::Symbol Grammar::any_of(std::vector<Sequence> alternatives) {
  const Symbol r = new_rule();
  for (auto& a : alternatives) add(r, std::move(a));
  return r;
}

Grammar::Symbol Grammar::one_of_texts(std::vector<std::string> texts) {
  std::sort(texts.begin(), texts.end());
  texts.erase(std::unique(texts.begin(), texts.end()), texts.end());
  if (texts.empty()) throw Error("one_of_texts: no texts");
  // A node: texts[begin, end) share their first `depth` bytes. Its alternatives are the empty one
  // when texts[begin] ends there (a prefix sorts first), and per next byte the longest run the
  // texts of that byte share, followed by their node when more than one text goes on. With an
  // explicit work list: a text may be longer than any thread's stack is deep.
  const Symbol top = new_rule();
  std::vector<std::tuple<Symbol, size_t, size_t, size_t>> todo = {{top, 0, texts.size(), 0}};
  while (!todo.empty()) {
    auto [rule, begin, end, depth] = todo.back();
    todo.pop_back();
    if (texts[begin].size() == depth) {
      add(rule, {});
      ++begin;
    }
    while (begin < end) {
      const char c = texts[begin][depth];
      size_t group_end = begin + 1;
      while (group_end < end && texts[group_end][depth] == c) ++group_end;
      // The run: the common prefix of the group's first and last texts (sorted, so of all).
      const std::string& first = texts[begin];
      const std::string& last = texts[group_end - 1];
      size_t run = depth + 1;
      while (run < first.size() && run < last.size() && first[run] == last[run]) ++run;
      Sequence alt = literal(std::string_view(first).substr(depth, run - depth));
      if (group_end - begin > 1 || first.size() > run) {
        const Symbol next = new_rule();
        alt.push_back(next);
        todo.emplace_back(next, begin, group_end, run);
      }
      add(rule, std::move(alt));
      begin = group_end;
    }
  }
  return top;
}

Grammar::Symbol Grammar::never() {
  if (never_ < 0) {
    never_ = new_rule();
    add(never_, {never_});  // matches nothing finite: finish() drops it, and what holds it
  }
  return never_;
}

void Grammar::counted_blocks(Symbol first, int32_t width, int64_t blocks) {
  if (width > 0 && blocks >= 2) counted_.push_back({first, width, blocks});
}

Grammar::Symbol Grammar::repeat(const Sequence& item, int64_t min, int64_t max) {
  if (min < 0 || (max >= 0 && max < min)) throw Error("repeat: bad bounds");
  // The symbols the rules below take (add() counts an alternative's symbols and one more), known
  // before any is made: a repeat past the limit is refused without building the rules up to it.
  const auto item_size = int64_t(item.size());
  const int64_t links = max < 0 ? 0 : max - min;
  const int64_t optional =
      max < 0 ? item_size + 3 : links * (item_size + 2) + std::max<int64_t>(links - 1, 0);
  make_room(size_t(optional + min * item_size + (max < 0 || links > 0 ? 1 : 0) + 1));
  // The optional part: a right-recursive loop, or a chain of max - min optional items, built from
  // its end so each link refers to the next.
  Symbol tail = -1;
  if (max < 0) {
    tail = new_rule();
    Sequence again = item;
    again.push_back(tail);
    add(tail, std::move(again));
    add(tail, {});
  } else {
    for (int64_t k = max - min; k > 0; --k) {
      const Symbol link = new_rule();
      Sequence one = item;
      if (tail >= 0) one.push_back(tail);
      add(link, std::move(one));
      add(link, {});
      tail = link;
    }
  }
  const Symbol r = new_rule();
  Sequence all;
  for (int64_t i = 0; i < min; ++i) all.insert(all.end(), item.begin(), item.end());
  if (tail >= 0) all.push_back(tail);
  add(r, std::move(all));
  if (!item.empty() && (min >= 2 || links >= 2))
    built_.push_back({r, tail, links > 0 ? Symbol(r - links) : -1, min, links, item});
  return r;
}

size_t Grammar::bytes() const {
  size_t n = sizeof(*this) + code_.capacity() * sizeof(Symbol) + runs_.capacity() * sizeof(Run) +
             terminals_.capacity() * sizeof(ByteSet) + terminal_ids_.size() * (64 + 256);
  for (const auto& s : starts_) n += sizeof(s) + s.capacity() * sizeof(int32_t);
  return n;
}

std::vector<bool> Grammar::productive(size_t first) const {
  // A work list, not a loop to a fixed point: a chain of rules each made before the one it holds
  // ($refs, repeats) would take a pass over the whole grammar per link.
  const size_t n = rules_.size() - first;
  std::vector<bool> done(n, false);
  // waiting[a]: rules of `first`.. alternative a holds that are not known productive yet (per
  // occurrence); uses[rule]: the alternatives holding it, once per occurrence.
  std::vector<size_t> waiting, owner;
  std::vector<std::vector<size_t>> uses(n);
  std::vector<size_t> ready;
  for (size_t r = 0; r < n; ++r)
    for (const auto& alt : rules_[first + r]) {
      size_t count = 0;
      for (Symbol s : alt)
        if (s >= 0 && size_t(s) >= first) {
          uses[size_t(s) - first].push_back(waiting.size());
          ++count;
        }
      if (count == 0 && !done[r]) {
        done[r] = true;
        ready.push_back(r);
      }
      waiting.push_back(count);
      owner.push_back(r);
    }
  while (!ready.empty()) {
    const size_t r = ready.back();
    ready.pop_back();
    for (size_t a : uses[r])
      if (--waiting[a] == 0 && !done[owner[a]]) {
        done[owner[a]] = true;
        ready.push_back(owner[a]);
      }
  }
  return done;
}

void Grammar::finish(Symbol root) {
  root_ = root;
  const size_t n = rules_.size();
  for (size_t r = 0; r < n; ++r)
    if (rules_[r].empty())
      throw Error("grammar: rule " + std::to_string(r) + " has no alternative");
  {
    const std::vector<bool> finite = productive();
    if (!finite[size_t(root)]) throw Error("grammar: the format matches no finite text");
    for (auto& alts : rules_)
      alts.erase(std::remove_if(alts.begin(), alts.end(),
                                [&](const Sequence& alt) {
                                  for (Symbol s : alt)
                                    if (s >= 0 && !finite[size_t(s)]) return true;
                                  return false;
                                }),
                 alts.end());
  }
  // Nullable rules (fixpoint), then left recursion: a rule reachable from itself through symbols
  // that all may match nothing before it.
  std::vector<bool> nullable(n, false);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r) {
      if (nullable[r]) continue;
      for (const auto& alt : rules_[r]) {
        bool all = true;
        for (Symbol s : alt) all = all && s >= 0 && nullable[size_t(s)];
        if (all) {
          nullable[r] = true;
          changed = true;
          break;
        }
      }
    }
  }
  std::vector<std::vector<Symbol>> leading(n);
  for (size_t r = 0; r < n; ++r)
    for (const auto& alt : rules_[r])
      for (Symbol s : alt) {
        if (s < 0) break;
        leading[r].push_back(s);
        if (!nullable[size_t(s)]) break;
      }
  // Depth-first, with an explicit stack: a chain of rules (nested groups, $refs) may be as long
  // as the grammar, too long for the thread's stack.
  std::vector<uint8_t> mark(n, 0);              // 0 unseen, 1 on the path, 2 done
  std::vector<std::pair<size_t, size_t>> path;  // (rule, next of its leading symbols)
  for (size_t root = 0; root < n; ++root) {
    if (mark[root] != 0) continue;
    mark[root] = 1;
    path.emplace_back(root, 0);
    while (!path.empty()) {
      auto& [r, next] = path.back();
      if (next == leading[r].size()) {
        mark[r] = 2;
        path.pop_back();
        continue;
      }
      const auto s = size_t(leading[r][next++]);
      if (mark[s] == 1) throw Error("grammar: left recursion through rule " + std::to_string(s));
      if (mark[s] == 0) {
        mark[s] = 1;
        path.emplace_back(s, 0);
      }
    }
  }

  code_.clear();
  starts_.assign(n, {});
  std::vector<int32_t> rule_begin(n + 1);
  for (size_t r = 0; r < n; ++r) {
    rule_begin[r] = static_cast<int32_t>(code_.size());
    for (const auto& alt : rules_[r]) {
      starts_[r].push_back(static_cast<int32_t>(code_.size()));
      code_.insert(code_.end(), alt.begin(), alt.end());
      code_.push_back(kEnd);
    }
  }
  rule_begin[n] = static_cast<int32_t>(code_.size());
  find_runs(rule_begin);
  rules_.clear();
  rules_.shrink_to_fit();
}

void Grammar::find_runs(const std::vector<int32_t>& rule_begin) {
  // Only where the repeat's rules are still what repeat() made (finish() drops alternatives that
  // match no finite text) and laid out as expected: elsewhere positions stay themselves, which is
  // exact, only slower.
  runs_.clear();
  find_counted_runs(rule_begin);
  for (const Built& b : built_) {
    const auto w = static_cast<int64_t>(b.item.size());
    const auto& main = rules_[size_t(b.rule)];
    if (b.min >= 2 && !main.empty() &&
        main[0].size() == size_t(b.min * w) + (b.tail >= 0 ? 1 : 0)) {
      bool same = true;
      for (int64_t i = 0; i < b.min * w && same; ++i)
        same = main[0][size_t(i)] == b.item[size_t(i % w)];
      if (same) {
        const int32_t begin = starts_[size_t(b.rule)][0];
        runs_.push_back({begin, int32_t(b.min), int32_t(w), int32_t(w), b.min - 1, -1, begin});
      }
    }
    // Links 1..links-1 (the last, with nothing after it, is never far from the bound): link k is
    // rule last_link + links - k, item then link k + 1, or nothing; rules are laid out in order,
    // so link k - 1 follows link k at a fixed stride.
    if (b.links < 2) continue;
    const int64_t n = b.links, stride = w + 3;
    auto link = [&](int64_t k) { return size_t(b.last_link + n - k); };
    const int32_t base = starts_[link(n - 1)].empty() ? -1 : starts_[link(n - 1)][0];
    bool regular = base >= 0;
    for (int64_t k = n - 1; k >= 1 && regular; --k) {
      const auto& alts = rules_[link(k)];
      regular = alts.size() == 2 && alts[1].empty() && alts[0].size() == size_t(w + 1) &&
                alts[0].back() == Symbol(link(k + 1)) &&
                std::equal(b.item.begin(), b.item.end(), alts[0].begin()) &&
                starts_[link(k)][0] == base + (n - 1 - k) * stride;
    }
    if (regular)
      runs_.push_back({base, int32_t(n - 1), int32_t(stride), int32_t(w + 1), 1, 1,
                       int32_t(base + (n - 2) * stride)});
  }
  built_.clear();
  built_.shrink_to_fit();
  std::sort(runs_.begin(), runs_.end(),
            [](const Run& a, const Run& b) { return a.begin < b.begin; });
  runs_.shrink_to_fit();
}

void Grammar::find_counted_runs(const std::vector<int32_t>& rule_begin) {
  // As finish() left them (alternatives that match nothing dropped): blocks k and k + 1 are
  // alike when each rule of one has the alternatives of its counterpart in the other, symbol by
  // symbol, a rule of its own block or the next one standing for its place there.
  for (const Counted& c : counted_) {
    const int64_t w = c.width;
    auto rule = [&](int64_t k, int64_t i) { return size_t(c.first + k * w + i); };
    auto alike = [&](int64_t k) {
      const int64_t base = c.first + k * w, next = base + w;
      // The places a symbol may stand for: its own block, and the next one where there is one.
      const int64_t reach_k = 2 * w, reach_next = k + 2 < c.blocks ? 2 * w : w;
      for (int64_t i = 0; i < w; ++i) {
        const auto& a = rules_[rule(k, i)];
        const auto& b = rules_[rule(k + 1, i)];
        if (a.size() != b.size()) return false;
        for (size_t j = 0; j < a.size(); ++j) {
          if (a[j].size() != b[j].size()) return false;
          for (size_t m = 0; m < a[j].size(); ++m) {
            const int64_t x = a[j][m] - base, y = b[j][m] - next;
            const bool x_placed = a[j][m] >= 0 && x >= 0 && x < reach_k;
            const bool y_placed = b[j][m] >= 0 && y >= 0 && y < reach_next;
            if (x_placed != y_placed || (x_placed ? x != y : a[j][m] != b[j][m])) return false;
          }
        }
      }
      return true;
    };
    for (int64_t a = 0; a < c.blocks;) {
      int64_t b = a + 1;  // blocks a..b-1 alike
      while (b < c.blocks && alike(b - 1)) ++b;
      const int64_t count = b - a;
      const int64_t begin = rule_begin[rule(a, 0)];
      const int64_t stride = count >= 2 ? rule_begin[rule(a + 1, 0)] - begin : 0;
      // Block j of the run has count - 1 - j alike after it: one is kept in hand, so that the
      // block a token's last character ends in is alike too.
      if (count >= 3 && stride > 0)
        runs_.push_back({int32_t(begin), int32_t(count), int32_t(stride), int32_t(stride),
                         count - 2, -1, int32_t(begin)});
      a = b;
    }
  }
  counted_.clear();
  counted_.shrink_to_fit();
}

int32_t Grammar::mask_position(int32_t pos, size_t longest) const {
  auto it = std::upper_bound(runs_.begin(), runs_.end(), pos,
                             [](int32_t p, const Run& r) { return p < r.begin; });
  if (pos < 0 || it == runs_.begin()) return pos;
  const Run& r = *--it;
  const int64_t from = pos - r.begin;
  if (from >= int64_t(r.count) * r.stride) return pos;
  const int64_t j = from / r.stride, offset = from % r.stride;
  if (offset >= r.width || r.left_first + r.left_step * j < int64_t(longest)) return pos;
  return r.canonical + int32_t(offset);
}

namespace {

// Code points of one encoded length, split into ranges whose bytes each form a contiguous range.
void utf8_sequences(Grammar& g, uint32_t lo, uint32_t hi, std::vector<Grammar::Sequence>& out) {
  static constexpr uint32_t kMaxOfLength[] = {0x7F, 0x7FF, 0xFFFF};
  for (uint32_t max : kMaxOfLength)
    if (lo <= max && max < hi) {
      utf8_sequences(g, lo, max, out);
      utf8_sequences(g, max + 1, hi, out);
      return;
    }
  auto encode = [](uint32_t cp, uint8_t* b) -> int {
    if (cp < 0x80) {
      b[0] = uint8_t(cp);
      return 1;
    }
    if (cp < 0x800) {
      b[0] = uint8_t(0xC0 | (cp >> 6));
      b[1] = uint8_t(0x80 | (cp & 0x3F));
      return 2;
    }
    if (cp < 0x10000) {
      b[0] = uint8_t(0xE0 | (cp >> 12));
      b[1] = uint8_t(0x80 | ((cp >> 6) & 0x3F));
      b[2] = uint8_t(0x80 | (cp & 0x3F));
      return 3;
    }
    b[0] = uint8_t(0xF0 | (cp >> 18));
    b[1] = uint8_t(0x80 | ((cp >> 12) & 0x3F));
    b[2] = uint8_t(0x80 | ((cp >> 6) & 0x3F));
    b[3] = uint8_t(0x80 | (cp & 0x3F));
    return 4;
  };
  uint8_t a[4], b[4];
  const int len = encode(lo, a);
  encode(hi, b);
  // Split where a lower byte does not span its whole range, so every position is a plain range.
  for (int i = 1; i < len; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_sequences(g, lo, lo | m, out);
        utf8_sequences(g, (lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        utf8_sequences(g, lo, (hi & ~m) - 1, out);
        utf8_sequences(g, hi & ~m, hi, out);
        return;
      }
    }
  }
  Grammar::Sequence seq;
  for (int i = 0; i < len; ++i) {
    ByteSet set;
    for (int c = a[i]; c <= b[i]; ++c) set.set(size_t(c));
    seq.push_back(g.bytes(set));
  }
  out.push_back(std::move(seq));
}

}  // namespace

std::vector<Grammar::Sequence> utf8_range(Grammar& g, uint32_t lo, uint32_t hi) {
  std::vector<Grammar::Sequence> out;
  hi = std::min<uint32_t>(hi, 0x10FFFF);
  if (lo > hi) return out;
  // Surrogates are not characters.
  if (lo < 0xD800 && hi > 0xDFFF) {
    utf8_sequences(g, lo, 0xD7FF, out);
    utf8_sequences(g, 0xE000, hi, out);
  } else if (lo >= 0xD800 && hi <= 0xDFFF) {
    return out;
  } else if (lo < 0xD800 && hi >= 0xD800) {
    utf8_sequences(g, lo, 0xD7FF, out);
  } else if (lo <= 0xDFFF && hi > 0xDFFF) {
    utf8_sequences(g, 0xE000, hi, out);
  } else {
    utf8_sequences(g, lo, hi, out);
  }
  return out;
}

}  // namespace tandem::structured
