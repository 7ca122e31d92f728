#include "structured/regex.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "util/error.h"

namespace tandem::structured {
namespace {

using Sequence = Grammar::Sequence;
using Symbol = Grammar::Symbol;
// Code point ranges, inclusive.
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

constexpr uint32_t kMaxCodePoint = 0x10FFFF;
std::atomic<int64_t> parses{0};  // patterns_parsed()
constexpr int64_t kMaxRepeat = 10'000;
// Lengths past this are as good as unbounded to the checks that read them (a schema's maxLength
// is at most 100,000), and products of repeat counts saturate here instead of overflowing.
constexpr int64_t kLongest = 1'000'000'000'000;
int64_t saturated(int64_t n) {
  return std::min(n, kLongest);
}

// The most characters counted for min..max beside a pattern of `lengths`: max, or the pattern's
// longest where that is fewer (past it a maximum adds only counts no answer reaches), min where
// there is no max (the counts past it one).
int64_t most_counted(RegexLengths lengths, int64_t min, int64_t max) {
  if (max < 0) return min;
  return lengths.longest < 0 ? max : std::min(max, lengths.longest);
}

Ranges normalized(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& [lo, hi] : r) {
    if (!out.empty() && lo <= out.back().second + 1)
      out.back().second = std::max(out.back().second, hi);
    else
      out.emplace_back(lo, hi);
  }
  return out;
}

Ranges complement(const Ranges& r) {
  Ranges out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : normalized(r)) {
    if (lo > next) out.emplace_back(next, lo - 1);
    next = hi + 1;
  }
  if (next <= kMaxCodePoint) out.emplace_back(next, kMaxCodePoint);
  return out;
}

const Ranges kDigit = {{'0', '9'}};
const Ranges kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
// Python's re for str patterns: the code points str.isspace() holds (\S and [^\s] are their
// complement; ASCII white space alone let U+00A0 and U+2003 through \S).
const Ranges kSpace = {{'\t', '\r'},     {0x1C, 0x20},     {0x85, 0x85},     {0xA0, 0xA0},
                       {0x1680, 0x1680}, {0x2000, 0x200A}, {0x2028, 0x2029}, {0x202F, 0x202F},
                       {0x205F, 0x205F}, {0x3000, 0x3000}};

class RegexCompiler {
 public:
  // `emit`: the pattern's grammar is built once it is read (from its tree, nodes_); without it
  // only the tree, for whole() or within() or the pattern's lengths.
  RegexCompiler(Grammar& g, std::string_view p, bool json_string, bool emit = true)
      : g_(&g), p_(p), json_string_(json_string), emit_(emit) {}

  // Rules made from now on (by whole() or within()) go into `g`.
  void emit_into(Grammar& g) { g_ = &g; }

  RegexInJsonString compile() {
    ++parses;
    if (peek('^')) ++i_;
    Piece whole = alternation();
    if (i_ != p_.size()) fail("unbalanced ')'");
    root_ = whole.node;
    shortest_ = whole.shortest;
    longest_ = whole.longest;
    return {emit_ ? this->whole() : -1, whole.shortest, whole.longest};
  }

  // After compile(): a rule matching what the whole pattern matches (not after within(), which
  // reshapes the tree).
  Symbol whole() { return g_->any_of({emit(root_)}); }

  // After compile() without emitting: a rule matching the values of min..max characters (max <
  // 0: no limit) that the pattern matches, or nothing when there are none.
  std::optional<Symbol> within(int64_t min, int64_t max);

 private:
  // A part of the pattern: its sequence, and the fewest and most code points it matches
  // (longest < 0: no limit); node: where it stands in nodes_.
  struct Piece {
    bool nullable;
    int64_t shortest = 0, longest = 0;
    int32_t node = -1;
  };
  // The pattern as a tree: a character of `ranges`, a sequence or a choice of the kids, or the
  // kid repeated min..max times (max < 0: no limit).
  struct Node {
    enum Kind { kCharacter, kSequence, kChoice, kRepeat } kind = kCharacter;
    Ranges ranges;
    std::vector<int32_t> kids;
    int64_t min = 0, max = 0;
    // kCharacter nodes once repeats are written out (saturated), counted by within() (not as
    // the parser builds them: its recursive frames bound the nesting on a small stack).
    int64_t characters = 0;
  };
  int32_t node(Node n) {
    nodes_.push_back(std::move(n));
    return static_cast<int32_t>(nodes_.size() - 1);
  }
  // A node's characters, written out, from its kids'.
  int64_t characters_of(const Node& n) const {
    if (n.kind == Node::kCharacter) return 1;
    if (n.kind == Node::kRepeat) {
      const int64_t copies = n.max < 0 ? std::max<int64_t>(n.min, 1) : n.max;
      const int64_t each = nodes_[size_t(n.kids[0])].characters;
      return each > 0 && copies > kLongest / each ? kLongest : each * copies;
    }
    int64_t sum = 0;
    for (int32_t k : n.kids) sum = saturated(sum + nodes_[size_t(k)].characters);
    return sum;
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw Error("regex at offset " + std::to_string(i_) + ": " + what);
  }
  bool peek(char c) const { return i_ < p_.size() && p_[i_] == c; }
  bool at_end() const { return i_ >= p_.size(); }

  Piece alternation() {
    std::vector<Piece> alts = {concatenation()};
    while (peek('|')) {
      ++i_;
      alts.push_back(concatenation());
    }
    if (alts.size() == 1) return std::move(alts[0]);
    Piece out{false, alts[0].shortest, alts[0].longest};
    Node choice;
    choice.kind = Node::kChoice;
    for (auto& a : alts) {
      out.nullable = out.nullable || a.nullable;
      out.shortest = std::min(out.shortest, a.shortest);
      out.longest = out.longest < 0 || a.longest < 0 ? -1 : std::max(out.longest, a.longest);
      choice.kids.push_back(a.node);
    }
    out.node = node(std::move(choice));
    return out;
  }

  Piece concatenation() {
    Piece out{true};
    Node sequence;
    sequence.kind = Node::kSequence;
    while (!at_end() && !peek('|') && !peek(')')) {
      if (peek('$') && i_ + 1 == p_.size()) {  // the end is implied
        ++i_;
        break;
      }
      Piece p = quantified();
      out.nullable = out.nullable && p.nullable;
      out.shortest = saturated(out.shortest + p.shortest);
      out.longest = out.longest < 0 || p.longest < 0 ? -1 : saturated(out.longest + p.longest);
      sequence.kids.push_back(p.node);
    }
    out.node = sequence.kids.size() == 1 ? sequence.kids[0] : node(std::move(sequence));
    return out;
  }

  Piece quantified() {
    Piece atom_piece = atom();
    int64_t min = 0, max = -1;
    if (!quantifier(min, max)) return atom_piece;
    if (peek('?')) {
      ++i_;  // lazy: the same language
    } else if (peek('+')) {
      fail("possessive quantifiers are not supported");
    }
    if (atom_piece.nullable && (max < 0 || max > 1))
      fail("a repeated part that may match nothing is not supported");
    if (max > kMaxRepeat || min > kMaxRepeat)
      fail("repetition counts above " + std::to_string(kMaxRepeat) + " are not supported");
    // Python's re and ECMAScript both refuse a{2}{3} and a**; read as a repeat of the repeat it
    // silently became a{6}.
    int64_t again_min = 0, again_max = -1;
    const size_t at = i_;
    if (quantifier(again_min, again_max)) {
      i_ = at;
      fail("multiple repeat: a quantifier cannot follow another (group the first: (?:a{2}){3})");
    }
    const bool nullable = min == 0 || atom_piece.nullable;
    const int64_t longest =
        max < 0 || atom_piece.longest < 0 ? -1 : saturated(max * atom_piece.longest);
    Node repeat;
    repeat.kind = Node::kRepeat;
    repeat.kids = {atom_piece.node};
    repeat.min = min;
    repeat.max = max;
    return {nullable, saturated(min * atom_piece.shortest), longest, node(std::move(repeat))};
  }

  // *, +, ? or a count at i_: true with its bounds (i_ past it), else false (i_ stays).
  bool quantifier(int64_t& min, int64_t& max) {
    min = 0;
    max = -1;
    if (peek('*')) {
      ++i_;
    } else if (peek('+')) {
      ++i_;
      min = 1;
    } else if (peek('?')) {
      ++i_;
      max = 1;
    } else if (const auto end = peek('{') ? braces(min, max) : std::nullopt) {
      i_ = *end;
    } else {
      return false;
    }
    return true;
  }

  // {m}, {m,}, {m,n} at i_: where the count ends, or nothing when the brace is a literal (i_
  // stays either way). {,n} and {,} are refused: Python's re reads them as {0,n} and {0,},
  // ECMAScript as literal text.
  std::optional<size_t> braces(int64_t& min, int64_t& max) const {
    size_t j = i_ + 1;
    // Every digit is read (ten of them were cut at nine and the brace taken as literal text);
    // the value saturates past kMaxRepeat, which quantified() refuses.
    auto number = [&](int64_t& v) {
      const size_t from = j;
      v = 0;
      while (j < p_.size() && p_[j] >= '0' && p_[j] <= '9')
        v = std::min(v * 10 + (p_[j++] - '0'), kMaxRepeat + 1);
      return j > from;
    };
    if (j < p_.size() && p_[j] == ',') {
      ++j;
      number(max);
      if (j < p_.size() && p_[j] == '}')
        fail("'{,n}' is not supported (Python reads it as {0,n}, ECMAScript as text): write {0,n}");
      return std::nullopt;
    }
    if (!number(min)) return std::nullopt;
    if (j < p_.size() && p_[j] == '}') {
      max = min;
    } else if (j < p_.size() && p_[j] == ',') {
      ++j;
      if (!number(max)) max = -1;
      if (j >= p_.size() || p_[j] != '}') return std::nullopt;
    } else {
      return std::nullopt;
    }
    if (max >= 0 && max < min) fail("a repetition's maximum is below its minimum");
    return j + 1;
  }

  Piece atom() {
    const char c = p_[i_];
    switch (c) {
      case '(': {
        ++i_;
        if (peek('?')) {
          if (i_ + 1 < p_.size() && p_[i_ + 1] == ':')
            i_ += 2;
          else
            fail("only non-capturing groups (?:...) are supported among (? groups");
        }
        if (++depth_ > Grammar::kMaxNesting)
          fail("groups nest deeper than " + std::to_string(Grammar::kMaxNesting) + " levels");
        Piece inner = alternation();
        --depth_;
        if (!peek(')')) fail("missing ')'");
        ++i_;
        return inner;
      }
      case '[':
        return one_character(char_class());
      case '.':
        ++i_;
        return one_character(complement({{'\n', '\n'}}));
      case '\\':
        return one_character(escape(false));
      case '{': {
        // A count with nothing before it (both Python and ECMAScript refuse it).
        int64_t min = 0, max = 0;
        if (braces(min, max)) fail("nothing to repeat");
        break;
      }
      case '*':
      case '+':
      case '?':
        fail("nothing to repeat");
      case '^':
        fail("'^' is only supported at the start");
      case '$':
        fail("'$' is only supported at the end");
      default:
        break;
    }
    const uint32_t cp = code_point();
    return one_character({{cp, cp}});
  }

  Piece one_character(const Ranges& r) {
    Node character;
    character.kind = Node::kCharacter;
    character.ranges = r;
    return {false, 1, 1, node(std::move(character))};
  }

  uint32_t code_point() {
    const auto b = static_cast<uint8_t>(p_[i_]);
    const int len = b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 0;
    if (len == 0 || i_ + size_t(len) > p_.size()) fail("invalid UTF-8");
    uint32_t cp = len == 1 ? b : b & (0x7F >> len);
    for (int k = 1; k < len; ++k)
      cp = (cp << 6) | (static_cast<uint8_t>(p_[i_ + size_t(k)]) & 0x3F);
    i_ += size_t(len);
    return cp;
  }

  // After a backslash (i_ at the backslash): the code points it stands for.
  Ranges escape(bool in_class) {
    ++i_;
    if (at_end()) fail("a pattern cannot end with a backslash");
    const char c = p_[i_];
    auto one = [&](uint32_t cp) {
      ++i_;
      return Ranges{{cp, cp}};
    };
    switch (c) {
      case 'd':
        ++i_;
        return kDigit;
      case 'D':
        ++i_;
        return complement(kDigit);
      case 'w':
        ++i_;
        return kWord;
      case 'W':
        ++i_;
        return complement(kWord);
      case 's':
        ++i_;
        return kSpace;
      case 'S':
        ++i_;
        return complement(kSpace);
      case 'n':
        return one('\n');
      case 't':
        return one('\t');
      case 'r':
        return one('\r');
      case 'f':
        return one('\f');
      case 'v':
        return one('\v');
      case '0':
        // \0 then digits is octal to Python's re (\012 is a newline) and an error under
        // ECMAScript's u flag.
        if (i_ + 1 < p_.size() && p_[i_ + 1] >= '0' && p_[i_ + 1] <= '9') {
          --i_;
          fail("octal escapes (\\0 followed by a digit) are not supported: write \\xNN");
        }
        return one(0);
      case 'x':
      case 'u': {
        const size_t digits = c == 'x' ? 2 : 4;
        if (i_ + digits >= p_.size()) fail("a truncated \\" + std::string(1, c) + " escape");
        uint32_t cp = 0;
        for (size_t k = 1; k <= digits; ++k) {
          const char h = p_[i_ + k];
          const int v = h >= '0' && h <= '9'   ? h - '0'
                        : h >= 'a' && h <= 'f' ? h - 'a' + 10
                        : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                               : -1;
          if (v < 0) fail("a bad hex digit in an escape");
          cp = cp * 16 + uint32_t(v);
        }
        i_ += digits + 1;
        return {{cp, cp}};
      }
      case 'b':
        if (in_class) return one('\b');
        fail("word boundaries (\\b) are not supported");
      default:
        break;
    }
    if ((c >= '1' && c <= '9') || c == 'k') fail("backreferences are not supported");
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
      fail(std::string("the escape \\") + c + " is not supported");
    const uint32_t cp = code_point();
    return {{cp, cp}};
  }

  // [...] (i_ at the '['): its code points.
  Ranges char_class() {
    ++i_;
    bool negate = false;
    if (peek('^')) {
      negate = true;
      ++i_;
    }
    Ranges r;
    bool first = true;
    while (!at_end() && (first || !peek(']'))) {
      first = false;
      Ranges item;
      if (peek('\\')) {
        item = escape(true);
      } else if (peek('[') && i_ + 1 < p_.size() && p_[i_ + 1] == ':') {
        fail("POSIX classes like [:alpha:] are not supported");
      } else {
        const uint32_t cp = code_point();
        item = {{cp, cp}};
      }
      // A range a-z (a '-' before ']' is a literal).
      if (item.size() == 1 && item[0].first == item[0].second && peek('-') && i_ + 1 < p_.size() &&
          p_[i_ + 1] != ']') {
        ++i_;
        Ranges hi_item;
        if (peek('\\'))
          hi_item = escape(true);
        else
          hi_item = {{code_point(), 0}};
        const uint32_t hi = hi_item[0].first;
        if (hi_item.size() != 1 || hi < item[0].first) fail("a bad range in a class");
        item = {{item[0].first, hi}};
      }
      r.insert(r.end(), item.begin(), item.end());
    }
    if (!peek(']')) fail("missing ']'");
    ++i_;
    r = negate ? complement(r) : normalized(r);
    if (r.empty()) fail("a class that matches nothing");
    return r;
  }

  // The grammar of node `n`'s text, from its kids' (recursive: the tree nests as deep as the
  // pattern's groups, which the parser bounds).
  Sequence emit(int32_t n) {
    const Node& node = nodes_[size_t(n)];
    switch (node.kind) {
      case Node::kCharacter:
        return {ranges_rule(node.ranges)};
      case Node::kSequence: {
        Sequence out;
        for (int32_t k : node.kids) {
          const Sequence kid = emit(k);
          out.insert(out.end(), kid.begin(), kid.end());
        }
        return out;
      }
      case Node::kChoice: {
        std::vector<Sequence> alts;
        for (int32_t k : node.kids) alts.push_back(emit(k));
        return {g_->any_of(std::move(alts))};
      }
      case Node::kRepeat: {
        // An item of several symbols becomes one rule first: repeat() writes its item out once
        // per required copy and optional link, so (?:abcdefghij){10000} would take ten times the
        // symbols (and a group of 400 characters, 400 times).
        Sequence item = emit(node.kids[0]);
        if (item.size() > 1) item = {g_->any_of({std::move(item)})};
        return {g_->repeat(item, node.min, node.max)};
      }
    }
    return {};
  }

  // A symbol matching one code point of `r`: its one terminal, or a rule of its alternatives.
  Symbol ranges_symbol(const Ranges& r) {
    const Ranges key = normalized(r);
    if (auto it = symbols_.find(key); it != symbols_.end()) return it->second;
    std::vector<Sequence> alts = ranges_alternatives(key);
    const Symbol s =
        alts.size() == 1 && alts[0].size() == 1 ? alts[0][0] : g_->any_of(std::move(alts));
    symbols_.emplace(key, s);
    return s;
  }

  // A rule matching one code point of `r`: the ASCII part as one byte set, the rest as UTF-8.
  // Inside a JSON string, '"', '\\' and the control characters are written as JSON escapes.
  Symbol ranges_rule(const Ranges& r) { return g_->any_of(ranges_alternatives(r)); }

  std::vector<Sequence> ranges_alternatives(const Ranges& r) {
    std::vector<Sequence> alts;
    ByteSet ascii;
    for (const auto& [lo, hi] : normalized(r)) {
      for (uint32_t c = lo; c <= std::min<uint32_t>(hi, 0x7F); ++c) ascii.set(c);
      if (hi >= 0x80)
        for (auto& s : utf8_range(*g_, std::max<uint32_t>(lo, 0x80), hi))
          alts.push_back(std::move(s));
    }
    if (json_string_) {
      auto escapes = json_escapes(ascii);
      alts.insert(alts.begin(), escapes.begin(), escapes.end());
    }
    if (ascii.any()) alts.insert(alts.begin(), Sequence{g_->bytes(ascii)});
    if (alts.empty()) fail("a class that matches nothing");
    return alts;
  }

  // The characters of `ascii` that a JSON string must escape, as their escapes (taken out of
  // `ascii`): one way each, as JSON encoders write them (\" \\ \b \f \n \r \t, else \u00XX in
  // lower case), so that no answer has two spellings.
  std::vector<Sequence> json_escapes(ByteSet& ascii) {
    ByteSet after_backslash, u000, u001;  // u00N: the last hex digit of \u00NX
    for (uint32_t c = 0; c < 0x20; ++c) {
      if (!ascii.test(c)) continue;
      ascii.reset(c);
      const char letter = c == '\b'   ? 'b'
                          : c == '\f' ? 'f'
                          : c == '\n' ? 'n'
                          : c == '\r' ? 'r'
                          : c == '\t' ? 't'
                                      : 0;
      if (letter)
        after_backslash.set(static_cast<uint8_t>(letter));
      else
        (c < 0x10 ? u000 : u001).set(static_cast<uint8_t>("0123456789abcdef"[c & 15]));
    }
    for (char c : {'"', '\\'})
      if (ascii.test(static_cast<uint8_t>(c))) {
        ascii.reset(static_cast<uint8_t>(c));
        after_backslash.set(static_cast<uint8_t>(c));
      }
    std::vector<Sequence> out;
    if (after_backslash.any()) out.push_back({g_->byte('\\'), g_->bytes(after_backslash)});
    for (const auto& [last, prefix] : {std::pair{&u000, "\\u000"}, std::pair{&u001, "\\u001"}})
      if (last->any()) {
        Sequence s = g_->literal(prefix);
        s.push_back(g_->bytes(*last));
        out.push_back(std::move(s));
      }
    return out;
  }

  // The pattern's automaton for within(): Glushkov's, its states the characters of the pattern
  // (repeats written out), each entered by reading its own class, with those of the same
  // followers and finality made one.
  struct Fragment {
    std::vector<int32_t> first, last;  // the characters that may begin it, and end it
    bool nullable;
  };
  Fragment automaton_fragment(int32_t n);
  void prepare_automaton();
  void link(const std::vector<int32_t>& from, const std::vector<int32_t>& to);

  Grammar* g_;
  std::string_view p_;
  bool json_string_;
  bool emit_;
  size_t i_ = 0;
  int depth_ = 0;  // groups open around i_
  std::vector<Node> nodes_;
  int32_t root_ = -1;
  int64_t shortest_ = 0, longest_ = 0;  // the whole pattern's (longest < 0: no limit)
  std::map<Ranges, Symbol> symbols_;    // ranges_symbol()'s
  // Glushkov's characters: the node each stands for and those that may follow it.
  std::vector<int32_t> characters_;
  std::vector<std::vector<int32_t>> follow_;
  int64_t links_ = 0;  // entries of follow_, bounded by kMaxCountedSteps
};

void RegexCompiler::link(const std::vector<int32_t>& from, const std::vector<int32_t>& to) {
  links_ += int64_t(from.size()) * int64_t(to.size());
  if (links_ > kMaxCountedSteps)
    throw PatternTooCostly("its automaton has over " + std::to_string(kMaxCountedSteps) +
                           " transitions");
  for (int32_t f : from) follow_[size_t(f)].insert(follow_[size_t(f)].end(), to.begin(), to.end());
}

RegexCompiler::Fragment RegexCompiler::automaton_fragment(int32_t n) {
  const Node& node = nodes_[size_t(n)];
  Fragment out{{}, {}, true};
  // out then f, read one after the other.
  auto then = [&](Fragment f) {
    link(out.last, f.first);
    if (out.nullable) out.first.insert(out.first.end(), f.first.begin(), f.first.end());
    if (f.nullable)
      out.last.insert(out.last.end(), f.last.begin(), f.last.end());
    else
      out.last = std::move(f.last);
    out.nullable = out.nullable && f.nullable;
  };
  switch (node.kind) {
    case Node::kCharacter: {
      const auto c = static_cast<int32_t>(characters_.size());
      characters_.push_back(n);
      follow_.emplace_back();
      return {{c}, {c}, false};
    }
    case Node::kSequence:
      for (int32_t k : node.kids) then(automaton_fragment(k));
      return out;
    case Node::kChoice:
      out.nullable = false;
      for (int32_t k : node.kids) {
        Fragment f = automaton_fragment(k);
        out.first.insert(out.first.end(), f.first.begin(), f.first.end());
        out.last.insert(out.last.end(), f.last.begin(), f.last.end());
        out.nullable = out.nullable || f.nullable;
      }
      return out;
    case Node::kRepeat: {
      const int32_t kid = node.kids[0];
      const int64_t min = node.min, max = node.max;
      // x{m,}: m - 1 copies, then one that may loop (x* when m is 0).
      if (max < 0) {
        for (int64_t i = 0; i + 1 < min; ++i) then(automaton_fragment(kid));
        Fragment loop = automaton_fragment(kid);
        link(loop.last, loop.first);
        loop.nullable = loop.nullable || min == 0;
        then(std::move(loop));
        return out;
      }
      for (int64_t i = 0; i < min; ++i) then(automaton_fragment(kid));
      // The optional copies, each only after the one before it: (x(x(x)?)?)?, not x?x?x?, which
      // reads one x in three ways.
      if (max > min) {
        Fragment optional{{}, {}, true};
        std::vector<int32_t> before;
        for (int64_t i = min; i < max; ++i) {
          Fragment f = automaton_fragment(kid);
          if (i == min)
            optional.first = f.first;
          else
            link(before, f.first);
          optional.last.insert(optional.last.end(), f.last.begin(), f.last.end());
          before = std::move(f.last);
        }
        then(std::move(optional));
      }
      return out;
    }
  }
  return out;
}

// The tree made ready for the automaton, over its nodes in the order they were built (kids
// first), without recursion: the branches of a choice that are one character each become one
// character of their classes together (the same language; as many characters, each followed by
// the same ones, made (?:a|b|...)+ link each to each, branches^2 entries, where one character
// links to itself), and each node's characters are counted.
void RegexCompiler::prepare_automaton() {
  for (Node& n : nodes_) {
    if (n.kind == Node::kChoice) {
      std::vector<int32_t> kids;
      int32_t one = -1;
      for (int32_t k : n.kids) {
        Node& kid = nodes_[size_t(k)];
        if (kid.kind != Node::kCharacter) {
          kids.push_back(k);
        } else if (one < 0) {
          one = k;
          kids.push_back(k);
        } else {
          Ranges& into = nodes_[size_t(one)].ranges;
          into.insert(into.end(), kid.ranges.begin(), kid.ranges.end());
        }
      }
      if (one >= 0) nodes_[size_t(one)].ranges = normalized(nodes_[size_t(one)].ranges);
      n.kids = std::move(kids);
    }
    n.characters = characters_of(n);  // kids come before their parents
  }
}

std::optional<Symbol> RegexCompiler::within(int64_t min, int64_t max) {
  prepare_automaton();
  // Counts of characters read, saturated.
  const int64_t blocks = most_counted({shortest_, longest_}, min, max) + 1;
  // Past the pattern's longest string a maximum adds nothing but counts no answer reaches.
  if (max >= 0 && longest_ >= 0) max = std::min(max, longest_);
  if (max >= 0 && max < min) return std::nullopt;
  // No length but 0: the empty string alone, with no automaton.
  if (max == 0) return shortest_ == 0 ? std::optional(g_->any_of({{}})) : std::nullopt;
  // A character (repeats written out) is a state and a transition unless it merges with others:
  // the counts that fit so are known before its characters are written out (a million of them
  // cost hundreds of megabytes to build only to be refused).
  const int64_t characters = nodes_[size_t(root_)].characters;
  const int64_t fit_by_characters =
      characters == 0 ? kLongest : kMaxCountedSteps / (2 * characters);
  auto too_many_characters = [&](int64_t fit) {
    throw LengthTooCostly(std::to_string(characters) +
                              " characters (its repeats written out) times " +
                              std::to_string(blocks) +
                              " lengths, each a state and a transition, "
                              "are more",
                          fit);
  };
  // The fewest counts that leave a string of the pattern of one character or more: where not
  // even they fit by characters, the automaton is not built only to say by how much.
  const int64_t fewest = std::max({max >= 0 ? min : 0, shortest_, int64_t{1}}) + 1;
  if (fit_by_characters < blocks && fit_by_characters < fewest)
    too_many_characters(fit_by_characters);
  // Else the automaton is built whole (its characters are at most kMaxCountedSteps / 4, its
  // transitions bounded by link()), for the counts its states and transitions fit.
  int64_t found = 0;  // states and transitions
  const Fragment whole = automaton_fragment(root_);
  std::vector<bool> last(characters_.size(), false);
  for (int32_t c : whole.last) last[size_t(c)] = true;
  // States: the start, and a character's followers with whether it may end the value.
  std::map<std::pair<std::vector<int32_t>, bool>, int32_t> ids;
  std::vector<const std::vector<int32_t>*> followers;
  std::vector<bool> final;
  auto state = [&](std::vector<int32_t> f, bool end) {
    std::sort(f.begin(), f.end());
    f.erase(std::unique(f.begin(), f.end()), f.end());
    const auto [it, added] = ids.emplace(std::make_pair(std::move(f), end), int32_t(ids.size()));
    if (added) {
      ++found;
      followers.push_back(&it->first.first);
      final.push_back(end);
    }
    return it->second;
  };
  const int32_t start = state(whole.first, whole.nullable);
  std::vector<int32_t> of(characters_.size(), -1);  // the state a character enters
  // Each state's transitions, by the state they enter: the union of the classes that enter it.
  std::vector<std::map<int32_t, Ranges>> into;
  for (size_t s = 0; s < followers.size(); ++s) {  // grows as states are found
    std::map<int32_t, Ranges> by_target;
    for (int32_t c : *followers[s]) {
      if (of[size_t(c)] < 0) of[size_t(c)] = state(follow_[size_t(c)], last[size_t(c)]);
      const Ranges& r = nodes_[size_t(characters_[size_t(c)])].ranges;
      const auto [to, added] = by_target.try_emplace(of[size_t(c)]);
      if (added) ++found;
      to->second.insert(to->second.end(), r.begin(), r.end());
    }
    into.push_back(std::move(by_target));
  }
  const int64_t fit = std::min(fit_by_characters, kMaxCountedSteps / found);
  if (fit_by_characters < blocks) too_many_characters(fit);
  if (fit < blocks)
    throw LengthTooCostly(std::to_string(found) + " states and transitions times " +
                              std::to_string(blocks) + " lengths are more",
                          fit);
  const auto n = static_cast<int64_t>(into.size());
  // Which (state, count) can still end within the bounds, from the last count back: only those
  // are entered, so that no answer starts what it cannot finish.
  auto next_count = [&](int64_t k) { return max < 0 && k == min ? k : k + 1; };
  std::vector<std::vector<bool>> viable(size_t(blocks), std::vector<bool>(size_t(n), false));
  if (max < 0) {
    // The last block (min characters or more) loops on itself: the states that reach a final
    // one, found backwards from the final ones.
    std::vector<std::vector<int32_t>> from(static_cast<size_t>(n));
    std::vector<int32_t> todo;
    for (int64_t s = 0; s < n; ++s) {
      for (const auto& [t, _] : into[size_t(s)]) from[size_t(t)].push_back(int32_t(s));
      if (final[size_t(s)]) todo.push_back(int32_t(s));
    }
    auto& loop = viable.back();
    for (int32_t s : todo) loop[size_t(s)] = true;
    while (!todo.empty()) {
      const int32_t t = todo.back();
      todo.pop_back();
      for (int32_t s : from[size_t(t)])
        if (!loop[size_t(s)]) {
          loop[size_t(s)] = true;
          todo.push_back(s);
        }
    }
  }
  for (int64_t k = max < 0 ? blocks - 2 : blocks - 1; k >= 0; --k)
    for (int64_t s = 0; s < n; ++s) {
      bool v = final[size_t(s)] && k >= min;
      if (k + 1 < blocks)
        for (const auto& [t, _] : into[size_t(s)]) v = v || viable[size_t(k + 1)][size_t(t)];
      viable[size_t(k)][size_t(s)] = v;
    }
  if (!viable[0][size_t(start)]) return std::nullopt;
  // The classes first, so that the blocks' rules are consecutive.
  std::vector<std::vector<std::pair<Symbol, int32_t>>> steps(static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s)
    for (const auto& [t, r] : into[size_t(s)]) steps[size_t(s)].emplace_back(ranges_symbol(r), t);
  const Symbol nothing = g_->never();
  // Each (count, state)'s alternatives: a step to each viable state of the next count, the end
  // where it may end, or else `nothing`. Counted first, as add() counts them: blocks past the
  // grammar's size are refused before any of their rules is made.
  auto alternatives = [&](int64_t k, int64_t s, auto&& step, auto&& end, auto&& none) {
    const int64_t next = next_count(k);
    bool any = false;
    if (next < blocks)
      for (const auto& [symbol, t] : steps[size_t(s)])
        if (viable[size_t(next)][size_t(t)]) {
          step(symbol, next, t);
          any = true;
        }
    if (final[size_t(s)] && k >= min) {
      end();
      any = true;
    }
    if (!any) none();
  };
  size_t symbols = 0;
  for (int64_t k = 0; k < blocks; ++k)
    for (int64_t s = 0; s < n; ++s)
      alternatives(
          k, s, [&](Symbol, int64_t, int32_t) { symbols += 3; }, [&] { symbols += 1; },
          [&] { symbols += 2; });
  g_->make_room(symbols);
  const auto first = static_cast<Symbol>(g_->rules());
  auto rule = [&](int64_t k, int64_t s) { return static_cast<Symbol>(first + k * n + s); };
  for (int64_t i = 0; i < blocks * n; ++i) g_->new_rule();
  for (int64_t k = 0; k < blocks; ++k)
    for (int64_t s = 0; s < n; ++s)
      alternatives(
          k, s,
          [&](Symbol symbol, int64_t next, int32_t t) {
            g_->add(rule(k, s), {symbol, rule(next, t)});
          },
          [&] { g_->add(rule(k, s), {}); }, [&] { g_->add(rule(k, s), {nothing}); });
  g_->counted_blocks(first, static_cast<int32_t>(n), blocks);
  return rule(0, start);
}

}  // namespace

Grammar::Symbol regex_rule(Grammar& g, std::string_view pattern) {
  return RegexCompiler(g, pattern, false).compile().rule;
}

int64_t patterns_parsed() {
  return parses.load();
}

RegexInJsonString regex_in_json_string(Grammar& g, std::string_view pattern) {
  return RegexCompiler(g, pattern, true).compile();
}

struct CountedPattern::Parsed {
  explicit Parsed(std::string_view p) : pattern(p), compiler(scratch, pattern, true, false) {}
  std::string pattern;
  Grammar scratch;  // unused: the pattern is parsed without emitting
  RegexCompiler compiler;
  RegexLengths lengths{};
};

CountedPattern::CountedPattern(std::string_view pattern)
    : parsed_(std::make_unique<Parsed>(pattern)) {
  const RegexInJsonString r = parsed_->compiler.compile();
  parsed_->lengths = {r.shortest, r.longest};
}

CountedPattern::~CountedPattern() = default;

std::optional<int64_t> lengths_counted(RegexLengths lengths, int64_t min_length,
                                       int64_t max_length) {
  const bool longest_within =
      max_length < 0 || (lengths.longest >= 0 && lengths.longest <= max_length);
  if (min_length <= lengths.shortest && longest_within) return std::nullopt;
  return most_counted(lengths, min_length, max_length);
}

RegexLengths CountedPattern::lengths() const {
  return parsed_->lengths;
}

Grammar::Symbol CountedPattern::whole(Grammar& g) {
  parsed_->compiler.emit_into(g);
  return parsed_->compiler.whole();
}

std::optional<Grammar::Symbol> CountedPattern::within(Grammar& g, int64_t min_length,
                                                      int64_t max_length) {
  parsed_->compiler.emit_into(g);
  return parsed_->compiler.within(min_length, max_length);
}

}  // namespace tandem::structured
