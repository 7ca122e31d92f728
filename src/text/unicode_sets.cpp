#include "text/unicode_sets.h"

#include <unicode/uchar.h>
#include <unicode/uniset.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "util/utf8.h"

namespace tandem::text::unicode {
namespace {

Ranges ranges_of(icu::UnicodeSet& set) {
  set.remove(0xD800, 0xDFFF);
  Ranges out;
  out.reserve(set.getRangeCount());
  for (int32_t i = 0; i < set.getRangeCount(); ++i)
    out.emplace_back(static_cast<char32_t>(set.getRangeStart(i)),
                     static_cast<char32_t>(set.getRangeEnd(i)));
  return out;
}

// Oniguruma's POSIX bracket names, which it also accepts as \p{NAME} with its own definitions
// (Punct takes in the ASCII symbols, XDigit is ASCII only, ...): ICU reads several of them as
// something else (punct as gc=P, digit as gc=Nd, alnum and xdigit as its POSIX sets).
bool is_posix_name(std::string_view name) {
  std::string key;
  for (char c : name)
    if (c != ' ' && c != '_' && c != '-')
      key += static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c);
  for (std::string_view posix : {"alnum", "alpha", "ascii", "blank", "cntrl", "digit", "graph",
                                 "lower", "print", "punct", "space", "upper", "xdigit", "word"})
    if (key == posix) return true;
  return false;
}

}  // namespace

std::optional<Ranges> property(std::string_view name) {
  if (is_posix_name(name)) return std::nullopt;
  const std::string n(name);
  icu::UnicodeSet set;
  UErrorCode ec = U_ZERO_ERROR;
  if (int32_t mask = u_getPropertyValueEnum(UCHAR_GENERAL_CATEGORY_MASK, n.c_str());
      mask != UCHAR_INVALID_CODE) {
    set.applyIntPropertyValue(UCHAR_GENERAL_CATEGORY_MASK, mask, ec);
  } else if (int32_t script = u_getPropertyValueEnum(UCHAR_SCRIPT, n.c_str());
             script != UCHAR_INVALID_CODE) {
    set.applyIntPropertyValue(UCHAR_SCRIPT, script, ec);
  } else {
    const UProperty prop = u_getPropertyEnum(n.c_str());
    // Unicode's binary properties only; ICU's POSIX-like ones are not Oniguruma's.
    if (prop < UCHAR_BINARY_START || prop >= UCHAR_BINARY_LIMIT || prop == UCHAR_POSIX_ALNUM ||
        prop == UCHAR_POSIX_BLANK || prop == UCHAR_POSIX_GRAPH || prop == UCHAR_POSIX_PRINT ||
        prop == UCHAR_POSIX_XDIGIT)
      return std::nullopt;
    set.applyIntPropertyValue(prop, 1, ec);
  }
  if (U_FAILURE(ec)) return std::nullopt;
  return ranges_of(set);
}

const Ranges& white_space() {
  static const Ranges ranges = [] {
    icu::UnicodeSet set;
    UErrorCode ec = U_ZERO_ERROR;
    set.applyIntPropertyValue(UCHAR_WHITE_SPACE, 1, ec);
    return ranges_of(set);
  }();
  return ranges;
}

Ranges complement(const Ranges& r) {
  Ranges out;
  char32_t next = 0;  // the first code point not yet covered
  auto add = [&](char32_t lo, char32_t hi) {
    // Split around the surrogates.
    if (lo < 0xD800 && hi >= 0xD800) {
      out.emplace_back(lo, 0xD7FF);
      lo = 0xE000;
    }
    if (lo >= 0xD800 && lo <= 0xDFFF) lo = 0xE000;
    if (lo <= hi) out.emplace_back(lo, hi);
  };
  for (const auto& [lo, hi] : r) {
    if (lo > next) add(next, lo - 1);
    next = hi + 1;
  }
  if (next <= 0x10FFFF) add(next, 0x10FFFF);
  return out;
}

Ranges subtract(const Ranges& a, const Ranges& b) {
  Ranges out;
  size_t j = 0;
  for (auto [lo, hi] : a) {
    while (j < b.size() && b[j].second < lo) ++j;
    for (size_t k = j; k < b.size() && b[k].first <= hi && lo <= hi; ++k) {
      if (b[k].first > lo) out.emplace_back(lo, b[k].first - 1);
      if (b[k].second >= hi) {
        lo = hi + 1;  // all of the rest is covered
      } else {
        lo = std::max<char32_t>(lo, b[k].second + 1);
      }
    }
    if (lo <= hi) out.emplace_back(lo, hi);
  }
  return out;
}

Ranges unite(const Ranges& a, const Ranges& b) {
  Ranges all(a);
  all.insert(all.end(), b.begin(), b.end());
  std::sort(all.begin(), all.end());
  Ranges out;
  for (const auto& [lo, hi] : all) {
    if (!out.empty() && lo <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, hi);
    } else {
      out.emplace_back(lo, hi);
    }
  }
  return out;
}

Membership::Membership(const Ranges& r) : empty_(r.empty()), bmp_(65536 / 64, 0) {
  for (auto [lo, hi] : r) {
    for (char32_t c = lo; c <= hi && c < 0x10000; ++c) bmp_[c >> 6] |= uint64_t{1} << (c & 63);
    if (hi >= 0x10000) rest_.emplace_back(std::max<char32_t>(lo, 0x10000), hi);
  }
}

bool Membership::contains(char32_t c) const {
  if (empty_) return false;
  if (c < 0x10000) return (bmp_[c >> 6] >> (c & 63)) & 1;
  auto it = std::upper_bound(rest_.begin(), rest_.end(), c,
                             [](char32_t v, const auto& range) { return v < range.first; });
  return it != rest_.begin() && c <= std::prev(it)->second;
}

bool Membership::any_in(std::string_view s) const {
  if (empty_) return false;
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    if (i + 8 <= n) {
      uint64_t word;
      std::memcpy(&word, s.data() + i, 8);
      if ((word & 0x8080808080808080ull) == 0) {
        i += 8;
        continue;
      }
    }
    const auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      ++i;
      continue;
    }
    const size_t len = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : 2;
    if (i + len > n) break;
    if (contains(utf8::decode_at(s, i, len))) return true;
    i += len;
  }
  return false;
}

std::string class_items(const Ranges& r) {
  std::string out;
  out.reserve(r.size() * 18);
  char buf[32];
  for (const auto& [lo, hi] : r) {
    if (lo == hi) {
      std::snprintf(buf, sizeof buf, "\\x{%X}", static_cast<unsigned>(lo));
    } else {
      std::snprintf(buf, sizeof buf, "\\x{%X}-\\x{%X}", static_cast<unsigned>(lo),
                    static_cast<unsigned>(hi));
    }
    out += buf;
  }
  return out;
}

std::string icu_unicode_version() {
  UVersionInfo v;
  u_getUnicodeVersion(v);
  return std::to_string(v[0]) + "." + std::to_string(v[1]);
}

}  // namespace tandem::text::unicode
