#pragma once
// Sets of code points by Unicode property, read from ICU's data when asked for. The pre-tokenizer
// writes Oniguruma's \p{...} classes out as these ranges, so that regexes match by the Unicode
// version of ICU rather than the older one compiled into PCRE2 (Debian's PCRE2 10.42 carries
// Unicode 14; its ICU 72 carries Unicode 15.0, and Hugging Face's Oniguruma at least that).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tandem::text::unicode {

// Sorted, disjoint, non-adjacent inclusive ranges. Surrogates (U+D800..U+DFFF) are never in one:
// valid UTF-8 cannot hold them, and PCRE2 refuses them in a UTF pattern.
using Ranges = std::vector<std::pair<char32_t, char32_t>>;

// The code points of an Oniguruma property name as \p{NAME} writes it: a general category
// ("L", "Letter", "Lu", "P", ...), a script ("Han", "Latin") or a binary property ("Alphabetic",
// "White_Space", "Emoji"), loosely matched as both Oniguruma and ICU do (case, spaces,
// underscores and hyphens ignored). nullopt for a name that is none of these, and for the POSIX
// bracket names (Alnum, Digit, Punct, Word, XDigit, ...), which Oniguruma defines its own way.
std::optional<Ranges> property(std::string_view name);

// Unicode White_Space, which Oniguruma's \s matches.
const Ranges& white_space();

// Every code point (but surrogates) that is not in `r`.
Ranges complement(const Ranges& r);

// The code points of `a` that are not in `b`.
Ranges subtract(const Ranges& a, const Ranges& b);

// The code points of `a` or `b`.
Ranges unite(const Ranges& a, const Ranges& b);

// A set of code points to test text against quickly: a bitmap for the BMP, a search for the rest.
class Membership {
 public:
  Membership() = default;
  explicit Membership(const Ranges& r);
  bool empty() const { return empty_; }
  bool contains(char32_t c) const;
  // Whether any code point of `utf8` (valid UTF-8) is in the set. ASCII text is skipped eight
  // bytes at a time.
  bool any_in(std::string_view utf8) const;

 private:
  bool empty_ = true;
  std::vector<uint64_t> bmp_;  // 65536 bits
  Ranges rest_;                // the ranges at U+10000 and above
};

// The ranges as the inside of a PCRE2 character class ("\x{41}-\x{5A}\x{61}"), without brackets.
std::string class_items(const Ranges& r);

// The Unicode version of ICU's character data, such as "15.0".
std::string icu_unicode_version();

}  // namespace tandem::text::unicode
