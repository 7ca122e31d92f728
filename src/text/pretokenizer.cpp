#include "text/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <map>
#include <mutex>
#include <optional>

#include "text/unicode_sets.h"
#include "util/error.h"
#include "util/json_fields.h"
#include "util/utf8.h"

namespace tandem::text {
namespace {

// GPT-2's pattern, which ByteLevel applies when use_regex is true.
constexpr std::string_view kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// A set of code points as the regex needs it written: inside a bracketed class its items (the
// complement's when negated), outside one a class of its own.
std::string class_of(const unicode::Ranges& set, bool negated, bool in_class) {
  if (in_class) return unicode::class_items(negated ? unicode::complement(set) : set);
  if (set.empty()) return negated ? "[\\x{0}-\\x{10FFFF}]" : "(?!)";
  return (negated ? "[^" : "[") + unicode::class_items(set) + "]";
}

const unicode::Ranges& hex_digits() {
  static const unicode::Ranges ranges = {{'0', '9'}, {'A', 'F'}, {'a', 'f'}};
  return ranges;
}

// The code points PCRE2's own \p{NAME} matches (by its built-in Unicode tables), found by
// matching it against every code point (~10 ms, once per name and process: property_class
// caches); nullopt when PCRE2 does not know the name.
std::optional<unicode::Ranges> pcre2_property(std::string_view name) {
  const std::string pattern = "\\p{" + std::string(name) + "}+";
  int err = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
  if (!code) return std::nullopt;
  std::string every_code_point;
  every_code_point.reserve(4 * 0x110000);
  for (char32_t c = 0; c <= 0x10FFFF; ++c)
    if (c < 0xD800 || c > 0xDFFF) utf8::append(every_code_point, c);
  const bool jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(every_code_point.data());
  unicode::Ranges out;
  for (size_t from = 0;;) {
    int rc = jit ? pcre2_jit_match(code, subject, every_code_point.size(), from, PCRE2_NO_UTF_CHECK,
                                   data, nullptr)
                 : pcre2_match(code, subject, every_code_point.size(), from, PCRE2_NO_UTF_CHECK,
                               data, nullptr);
    if (rc < 0) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data);
    const std::string_view run(every_code_point.data() + ov[0], ov[1] - ov[0]);
    size_t last = run.size() - 1;
    while ((static_cast<unsigned char>(run[last]) & 0xC0) == 0x80) --last;
    out.emplace_back(utf8::decode_at(run, 0, utf8::valid_sequence_length(run, 0)),
                     utf8::decode_at(run, last, run.size() - last));
    from = ov[1];
  }
  pcre2_match_data_free(data);
  pcre2_code_free(code);
  // A run broken only by the surrogates, which the subject skips, is one range.
  for (size_t i = 1; i < out.size(); ++i)
    if (out[i - 1].second == 0xD7FF && out[i].first == 0xE000) {
      out[i - 1].second = out[i].second;
      out.erase(out.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  return out;
}

// How \p{NAME} is written for PCRE2 so that it matches ICU's set (unicode_sets.h). When PCRE2
// knows the name and its set lies within ICU's (a newer Unicode has assigned more characters,
// which is how versions usually differ), PCRE2's own \p{NAME} plus the code points ICU adds:
// PCRE2 looks a property up in a table, while a class of hundreds of ranges is a search through
// them for every character. Otherwise ICU's ranges in full.
struct PropertyClass {
  unicode::Ranges icu;       // the set to match
  bool use_own = false;      // \p{NAME} plus `extra` is that set
  unicode::Ranges extra;     // icu minus PCRE2's \p{NAME}
  bool pcre2_knows = false;  // PCRE2 has a \p{NAME} of its own
  unicode::Ranges differs;   // the code points where PCRE2's \p{NAME} and ICU's set disagree
};

std::optional<PropertyClass> property_class(std::string_view name) {
  static std::mutex mutex;
  static std::map<std::string, std::optional<PropertyClass>, std::less<>> cache;
  std::lock_guard lock(mutex);
  if (auto it = cache.find(name); it != cache.end()) return it->second;
  std::optional<PropertyClass> result;
  if (auto icu = unicode::property(name)) {
    result.emplace();
    result->icu = std::move(*icu);
    if (auto own = pcre2_property(name)) {
      const unicode::Ranges missing = unicode::subtract(result->icu, *own);
      const unicode::Ranges wrong = unicode::subtract(*own, result->icu);
      result->pcre2_knows = true;
      result->differs = unicode::unite(missing, wrong);
      if (wrong.empty()) {
        result->use_own = true;
        result->extra = missing;
      }
    }
  }
  return cache.emplace(std::string(name), std::move(result)).first->second;
}

std::string property_regex(std::string_view name, const PropertyClass& p, bool negated,
                           bool in_class) {
  if (!p.use_own || (negated && in_class && !p.extra.empty()))
    return class_of(p.icu, negated, in_class);
  std::string own = (negated && in_class ? "\\P{" : "\\p{") + std::string(name) + "}";
  if (in_class) return own + unicode::class_items(p.extra);
  return (negated ? "[^" : "[") + own + unicode::class_items(p.extra) + "]";
}

// Rewrites what Oniguruma (Ruby syntax, which tokenizers uses) means differently from PCRE2:
//  - \p{NAME}, \P{NAME}, \p{^NAME}: written out as ICU's code point ranges, so the Unicode
//    version is ICU's, not the older one built into PCRE2 (unicode_sets.h);
//  - \s, \S: Unicode White_Space (PCRE2's misses U+0085);
//  - \h, \H: a hex digit or not (PCRE2: horizontal white space);
//  - {,n}: {0,n} (PCRE2 10.42 reads it as literal text);
//  - a class inside a class ([^(\s|[.,!?])], BLOOM's): a union, whose items join the outer class
//    (negated inner classes and && intersections are refused).
// ^ and $ are line anchors in both once the regex is compiled with PCRE2_MULTILINE.
//
// Property classes cost time even so (~25% more for the regexes on English code), and they
// matter only for the few characters on which ICU's and PCRE2's Unicode disagree. So a pattern
// is translated twice: `exact` as above, and `fast` with \p{NAME} left to PCRE2 wherever PCRE2
// knows the name; `differs` collects those characters, and a text without any of them is split
// with `fast` (PreTokenizer::split). No `fast` when some name is ICU's only.
struct Translation {
  std::string exact;
  std::optional<std::string> fast;
  unicode::Ranges differs;
};

Translation translate_oniguruma(std::string_view pattern, const std::string& where) {
  Translation t;
  std::string out, fast;
  bool has_fast = true;
  auto emit = [&](const auto& text) {
    out += text;
    fast += text;
  };
  bool in_class = false;
  int nested = 0;  // classes open inside the outermost one
  for (size_t i = 0; i < pattern.size(); ++i) {
    char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      char n = pattern[++i];
      if (n == 's' || n == 'S') {
        emit(class_of(unicode::white_space(), n == 'S', in_class));
      } else if (n == 'h' || n == 'H') {
        emit(class_of(hex_digits(), n == 'H', in_class));
      } else if ((n == 'p' || n == 'P') && i + 1 < pattern.size() && pattern[i + 1] == '{' &&
                 pattern.find('}', i + 2) != std::string_view::npos) {
        const size_t close = pattern.find('}', i + 2);
        std::string_view name = pattern.substr(i + 2, close - i - 2);
        bool negated = n == 'P';
        if (name.starts_with('^')) {
          negated = !negated;
          name.remove_prefix(1);
        }
        const std::string_view verbatim = pattern.substr(i - 1, close + 2 - i);
        if (auto set = property_class(name)) {
          const std::string exact = property_regex(name, *set, negated, in_class);
          out += exact;
          if (set->pcre2_knows) {
            fast.append(verbatim);
            t.differs = unicode::unite(t.differs, set->differs);
          } else {
            fast += exact;
            has_fast = false;
          }
        } else {  // a name ICU does not define: PCRE2 reads it or refuses the pattern
          out.append(verbatim);
          fast.append(verbatim);
        }
        i = close;
      } else {
        emit(c);
        emit(n);
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      emit(c);
      // A ']' or '^]' right after the opening bracket is a literal, not the end.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') emit(pattern[++i]);
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') emit(pattern[++i]);
      continue;
    }
    if (c == '[' && in_class) {
      if (pattern.substr(i, 2) == "[:") {  // a POSIX bracket such as [:alpha:], PCRE2's too
        const size_t close = pattern.find(":]", i + 2);
        if (close != std::string_view::npos) {
          emit(pattern.substr(i, close + 2 - i));
          i = close + 1;
          continue;
        }
      }
      // Oniguruma nests classes, [a[bc]] being a union: the inner items join the outer class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^')
        throw Error(where + ": a negated character class inside another is not supported");
      ++nested;
      continue;
    }
    if (c == ']' && in_class) {
      if (nested > 0) {
        --nested;
        continue;
      }
      in_class = false;
    }
    if (c == '&' && in_class && i + 1 < pattern.size() && pattern[i + 1] == '&')
      throw Error(where + ": character class intersection (&&) is not supported");
    if (c == '{' && !in_class && i + 1 < pattern.size() && pattern[i + 1] == ',') {
      size_t j = i + 2;
      while (j < pattern.size() && pattern[j] >= '0' && pattern[j] <= '9') ++j;
      if (j > i + 2 && j < pattern.size() && pattern[j] == '}') {
        emit("{0");
        continue;
      }
    }
    emit(c);
  }
  t.exact = std::move(out);
  if (has_fast && fast != t.exact) t.fast = std::move(fast);
  return t;
}

std::string quote_literal(std::string_view s) {
  std::string out = "\\Q";
  for (size_t i = 0; i < s.size(); ++i) {
    if (s.substr(i, 2) == "\\E") {
      out += "\\E\\\\E\\Q";
      ++i;
    } else {
      out += s[i];
    }
  }
  return out + "\\E";
}

class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    // Oniguruma's ^ and $ are line anchors, and its lines end at \n only.
    pcre2_compile_context* context = pcre2_compile_context_create(nullptr);
    pcre2_set_newline(context, PCRE2_NEWLINE_LF);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &offset, context);
    pcre2_compile_context_free(context);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      throw Error(where + ": cannot compile regex at offset " + std::to_string(offset) + ": " +
                  reinterpret_cast<const char*>(msg));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Finds the next match in subject at or after `from`; returns false when there is none.
  bool find(std::string_view subject, size_t from, size_t& start, size_t& end) const {
    auto& t = thread_state();
    int rc = jit_ ? pcre2_jit_match(code_, reinterpret_cast<PCRE2_SPTR>(subject.data()),
                                    subject.size(), from, PCRE2_NO_UTF_CHECK, t.data, t.context)
                  : pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(),
                                from, PCRE2_NO_UTF_CHECK, t.data, t.context);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0 && rc != 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw Error(std::string("pre-tokenizer regex failed: ") + reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(t.data);
    start = ov[0];
    end = ov[1];
    return true;
  }

 private:
  // Match data and a JIT stack large enough for long whitespace runs, one set per thread.
  struct ThreadState {
    pcre2_match_data* data;
    pcre2_match_context* context;
    pcre2_jit_stack* stack;
    ThreadState() {
      data = pcre2_match_data_create(1, nullptr);
      context = pcre2_match_context_create(nullptr);
      stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
      pcre2_jit_stack_assign(context, nullptr, stack);
    }
    ~ThreadState() {
      pcre2_jit_stack_free(stack);
      pcre2_match_context_free(context);
      pcre2_match_data_free(data);
    }
  };
  static ThreadState& thread_state() {
    thread_local ThreadState state;
    return state;
  }

  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Behavior parse_behavior(const std::string& name, const std::string& where) {
  if (name == "Removed") return Behavior::kRemoved;
  if (name == "Isolated") return Behavior::kIsolated;
  if (name == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::kMergedWithNext;
  if (name == "Contiguous") return Behavior::kContiguous;
  throw Error(where + ": unknown split behavior '" + name + "'");
}

}  // namespace

struct PreTokenizer::Step {
  virtual ~Step() = default;
  // `exact`: the text holds a character on which PCRE2's Unicode and ICU's disagree, so regexes
  // must use ICU's classes (Translation).
  virtual void apply(std::string_view piece, std::vector<std::string_view>& out,
                     std::deque<std::string>& arena, bool exact) const = 0;
};

namespace {

// Splits on regex matches, then assembles pieces as the behaviour says (HF's SplitDelimiter).
class SplitStep : public PreTokenizer::Step {
  using Segments = std::vector<std::pair<std::string_view, bool>>;

 public:
  SplitStep(const Translation& pattern, Behavior behavior, bool invert, const std::string& where)
      : regex_(pattern.exact, where),
        fast_(pattern.fast ? std::make_unique<Regex>(*pattern.fast, where) : nullptr),
        behavior_(behavior),
        invert_(invert) {}

  void apply(std::string_view piece, std::vector<std::string_view>& out, std::deque<std::string>&,
             bool exact) const override {
    const Regex& regex = exact || !fast_ ? regex_ : *fast_;
    // Segments alternate between non-matches and matches; `is_match` tells which.
    thread_local Segments segs;
    segs.clear();
    // Matches are found as the onig crate's find_iter finds them: an empty match is a match (a
    // delimiter of no text), except one right where the previous match ended, which moves the
    // search on by a character.
    size_t pos = 0, search = 0, start = 0, end = 0;
    bool matched = false;
    while (search <= piece.size() && regex.find(piece, search, start, end)) {
      if (end == start && matched && end == pos) {
        if (search >= piece.size()) break;
        size_t len = utf8::valid_sequence_length(piece, search);
        search += len ? len : 1;
        continue;
      }
      if (start > pos) segs.emplace_back(piece.substr(pos, start - pos), invert_);
      segs.emplace_back(piece.substr(start, end - start), !invert_);
      pos = search = end;
      matched = true;
    }
    if (pos < piece.size()) segs.emplace_back(piece.substr(pos), invert_);
    assemble(segs, out);
  }

 private:
  void assemble(const Segments& segs, std::vector<std::string_view>& out) const {
    auto join = [&](std::string_view a, std::string_view b) {
      // Both views are adjacent slices of `piece`.
      return std::string_view(a.data(), static_cast<size_t>(b.data() + b.size() - a.data()));
    };
    switch (behavior_) {
      case Behavior::kIsolated:
        for (auto& [s, m] : segs) out.push_back(s);
        break;
      case Behavior::kRemoved:
        for (auto& [s, m] : segs)
          if (!m) out.push_back(s);
        break;
      case Behavior::kMergedWithPrevious: {
        bool can_merge = false;
        for (auto& [s, m] : segs) {
          if (m && can_merge) {
            out.back() = join(out.back(), s);
          } else {
            out.push_back(s);
          }
          can_merge = !m;
        }
        break;
      }
      case Behavior::kMergedWithNext: {
        bool pending = false;
        for (auto& [s, m] : segs) {
          if (pending && !m) {
            out.back() = join(out.back(), s);
          } else {
            out.push_back(s);
          }
          pending = m;
        }
        break;
      }
      case Behavior::kContiguous: {
        // Neighbours alike are joined, non-matches too: with invert, adjacent matches become
        // adjacent non-matches, and HF joins them.
        bool last_match = false;
        for (size_t i = 0; i < segs.size(); ++i) {
          auto& [s, m] = segs[i];
          if (i > 0 && m == last_match) {
            out.back() = join(out.back(), s);
          } else {
            out.push_back(s);
          }
          last_match = m;
        }
        break;
      }
    }
  }

  Regex regex_;
  std::unique_ptr<Regex> fast_;  // PCRE2's own property classes; see Translation
  Behavior behavior_;
  bool invert_;
};

// ByteLevel's own part of pre-tokenization: the optional prefix space and the GPT-2 split. The
// byte mapping itself is implicit, since BPE runs on raw bytes.
class ByteLevelStep : public PreTokenizer::Step {
 public:
  ByteLevelStep(bool add_prefix_space, bool use_regex, const std::string& where,
                unicode::Ranges& differs)
      : add_prefix_space_(add_prefix_space) {
    if (use_regex) {
      const Translation pattern = translate_oniguruma(kGpt2Pattern, where);
      differs = unicode::unite(differs, pattern.differs);
      split_ = std::make_unique<SplitStep>(pattern, Behavior::kIsolated, false, where);
    }
  }
  void apply(std::string_view piece, std::vector<std::string_view>& out,
             std::deque<std::string>& arena, bool exact) const override {
    if (add_prefix_space_ && !piece.starts_with(' ')) {
      std::string& prefixed = arena.emplace_back(1, ' ');
      prefixed.append(piece);
      piece = prefixed;
    }
    if (split_) {
      split_->apply(piece, out, arena, exact);
    } else {
      out.push_back(piece);
    }
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<SplitStep> split_;
};

// The steps of the pre-tokenizer at `path` in `origin` (tokenizer.json).
void add_steps(const nlohmann::json& cfg, const std::string& origin, const std::string& path,
               std::vector<std::unique_ptr<PreTokenizer::Step>>& steps, bool& saw_byte_level,
               unicode::Ranges& differs) {
  const std::string where = origin + ": " + path;
  if (!cfg.is_object() || !cfg.contains("type"))
    throw Error(where + ": expected an object with a 'type'");
  // tokenizers reads these with serde: null is a value of the wrong type.
  constexpr auto kNull = Fields::Null::kWrongType;
  auto f = Fields::lenient(cfg, origin, path);
  const auto type = f.string("type", kNull);
  if (saw_byte_level) throw Error(where + ": a " + type + " step after ByteLevel is not supported");
  if (type == "Sequence") {
    const auto& list = f.list("pretokenizers", kNull);
    for (size_t i = 0; i < list.size(); ++i)
      add_steps(list[i], origin, f.path_of("pretokenizers") + "[" + std::to_string(i) + "]", steps,
                saw_byte_level, differs);
  } else if (type == "Split") {
    const auto& pat = f.object("pattern", kNull);
    auto pattern = Fields::lenient(pat, origin, f.path_of("pattern"));
    Translation regex;
    if (pat.contains("Regex")) {
      regex = translate_oniguruma(pattern.string("Regex", kNull), where);
    } else if (pat.contains("String")) {
      regex.exact = quote_literal(pattern.string("String", kNull));
    } else {
      throw Error(where + ": Split pattern must have 'Regex' or 'String'");
    }
    differs = unicode::unite(differs, regex.differs);
    steps.push_back(std::make_unique<SplitStep>(
        regex, parse_behavior(f.string_or("behavior", "Isolated", kNull), where),
        f.boolean_or("invert", false, kNull), where));
  } else if (type == "Digits") {
    bool individual = f.boolean_or("individual_digits", false, kNull);
    const Translation numbers = translate_oniguruma("\\p{N}", where);
    differs = unicode::unite(differs, numbers.differs);
    steps.push_back(std::make_unique<SplitStep>(
        numbers, individual ? Behavior::kIsolated : Behavior::kContiguous, false, where));
  } else if (type == "ByteLevel") {
    steps.push_back(std::make_unique<ByteLevelStep>(f.boolean_or("add_prefix_space", false, kNull),
                                                    f.boolean_or("use_regex", true, kNull), where,
                                                    differs));
    saw_byte_level = true;
  } else {
    throw Error(where + ": pre-tokenizer type '" + type + "' is not supported");
  }
}

}  // namespace

PreTokenizer::PreTokenizer(const nlohmann::json& config, const std::string& origin) {
  const std::string where = origin + ": pre_tokenizer";
  if (config.is_null())
    throw Error(where + ": missing; byte-level BPE needs a ByteLevel pre-tokenizer");
  bool saw_byte_level = false;
  unicode::Ranges differs;
  add_steps(config, origin, "pre_tokenizer", steps_, saw_byte_level, differs);
  needs_exact_ = unicode::Membership(differs);
  if (!saw_byte_level)
    throw Error(where + ": no ByteLevel step; only byte-level BPE tokenizers are supported");
}

PreTokenizer::~PreTokenizer() = default;

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& pieces,
                         std::deque<std::string>& arena) const {
  thread_local std::vector<std::string_view> current, next;
  current.assign(1, text);
  const bool exact = needs_exact_.any_in(text);
  for (const auto& step : steps_) {
    next.clear();
    for (auto piece : current)
      if (!piece.empty()) step->apply(piece, next, arena, exact);
    std::swap(current, next);
  }
  for (auto piece : current)
    if (!piece.empty()) pieces.push_back(piece);
}

}  // namespace tandem::text
