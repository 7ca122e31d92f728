#include "text/jinja/builtins.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <initializer_list>
#include <optional>
#include <unordered_map>

#include <unicode/uchar.h>
#include <unicode/ustring.h>

#include "util/html.h"
#include "util/utf8.h"

namespace tandem::text::jinja {
namespace {

[[noreturn]] void type_error(const std::string& message) {
  throw RuntimeError{message};
}
[[noreturn]] void unsupported(const std::string& message) {
  throw UnsupportedError{"unsupported " + message};
}

void check_string_size(size_t bytes, const char* what) {
  if (bytes > kMaxStringBytes) unsupported(std::string(what) + " beyond 64 MiB");
}
void check_list_size(size_t items, const char* what) {
  if (items > kMaxListItems) unsupported(std::string(what) + " beyond 4M items");
}

// Using an Undefined in arithmetic, calls, attribute access etc. raises UndefinedError.
void check_defined(const Value& v) {
  if (v.is_undefined()) throw RuntimeError{v.s.str()};
}

// ---- argument binding like a Python signature ----

class Params {
 public:
  Params(const std::string& fn, const CallArgs& call, std::initializer_list<std::string_view> names)
      : fn_(fn), names_(names.begin(), names.end()), values_(names.size()) {
    if (call.args.size() > names_.size()) {
      type_error(fn + "() takes at most " + std::to_string(names_.size()) + " argument(s) (" +
                 std::to_string(call.args.size()) + " given)");
    }
    for (size_t k = 0; k < call.args.size(); ++k) values_[k] = call.args[k];
    for (const auto& [key, value] : call.kwargs) {
      auto it = std::find(names_.begin(), names_.end(), key);
      if (it == names_.end())
        type_error(fn + "() got an unexpected keyword argument '" + key + "'");
      auto& slot = values_[static_cast<size_t>(it - names_.begin())];
      if (slot) type_error(fn + "() got multiple values for argument '" + key + "'");
      slot = value;
    }
  }
  bool has(size_t k) const { return values_[k].has_value(); }
  const Value& get(size_t k) const {
    if (!values_[k])
      type_error(fn_ + "() missing required argument '" + std::string(names_[k]) + "'");
    return *values_[k];
  }
  Value get_or(size_t k, Value fallback) const { return values_[k] ? *values_[k] : fallback; }

 private:
  std::string fn_;
  std::vector<std::string_view> names_;
  std::vector<std::optional<Value>> values_;
};

// Integer arithmetic and indexing with an integer beyond int64 (from a request's JSON).
[[noreturn]] void big_integer_unsupported(const Value& v, const std::string& use) {
  unsupported(use + " with the integer " + std::to_string(v.big()) + ", beyond 64 bits");
}

int64_t to_index(const Value& v, const std::string& what) {
  if (v.kind == Kind::kBigInt) big_integer_unsupported(v, what);
  if (!v.is_int_like()) {
    type_error("'" + type_name(v) + "' object cannot be interpreted as an integer (" + what + ")");
  }
  return v.i;
}

// ---- Unicode case mapping (Python's full mappings, as ICU's root locale provides them) ----

std::u32string icu_map(char32_t c, int which) {
  UChar src[2];
  int32_t src_len = 0;
  U16_APPEND_UNSAFE(src, src_len, static_cast<UChar32>(c));
  UChar dst[16];
  UErrorCode err = U_ZERO_ERROR;
  int32_t n = 0;
  if (which == 0) {
    n = u_strToUpper(dst, 16, src, src_len, "", &err);
  } else if (which == 1) {
    n = u_strToLower(dst, 16, src, src_len, "", &err);
  } else {
    n = u_strToTitle(dst, 16, src, src_len, nullptr, "", &err);
  }
  if (U_FAILURE(err)) return std::u32string(1, c);
  std::u32string out;
  for (int32_t k = 0; k < n;) {
    UChar32 cp;
    U16_NEXT(dst, k, n, cp);
    out += static_cast<char32_t>(cp);
  }
  return out;
}

bool is_cased(char32_t c) {
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_CASED);
}
bool is_case_ignorable(char32_t c) {
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_CASE_IGNORABLE);
}

// Python lowercases a capital sigma to final sigma after a cased letter when no cased letter
// follows (case-ignorable characters skipped both ways).
bool is_final_sigma(const std::u32string& s, size_t i) {
  size_t j = i;
  while (j > 0 && is_case_ignorable(s[j - 1])) --j;
  if (j == 0 || !is_cased(s[j - 1])) return false;
  size_t k = i + 1;
  while (k < s.size() && is_case_ignorable(s[k])) ++k;
  return k == s.size() || !is_cased(s[k]);
}

void append_lower(std::u32string& out, const std::u32string& s, size_t i) {
  char32_t c = s[i];
  if (c < 0x80) {
    out += (c >= 'A' && c <= 'Z') ? c + 32 : c;
  } else if (c == 0x3A3) {
    out += is_final_sigma(s, i) ? char32_t{0x3C2} : char32_t{0x3C3};
  } else {
    out += icu_map(c, 1);
  }
}

void append_upper(std::u32string& out, char32_t c) {
  if (c < 0x80) {
    out += (c >= 'a' && c <= 'z') ? c - 32 : c;
  } else {
    out += icu_map(c, 0);
  }
}

void append_title(std::u32string& out, char32_t c) {
  if (c < 0x80) {
    out += (c >= 'a' && c <= 'z') ? c - 32 : c;
  } else {
    out += icu_map(c, 2);
  }
}

std::string py_lower(std::string_view s) {
  std::u32string u = to_u32(s), out;
  for (size_t i = 0; i < u.size(); ++i) append_lower(out, u, i);
  return from_u32(out);
}

std::string py_upper(std::string_view s) {
  std::u32string out;
  for (char32_t c : to_u32(s)) append_upper(out, c);
  return from_u32(out);
}

std::string py_capitalize(std::string_view s) {
  std::u32string u = to_u32(s), out;
  for (size_t i = 0; i < u.size(); ++i) {
    if (i == 0) {
      append_title(out, u[0]);
    } else {
      append_lower(out, u, i);
    }
  }
  return from_u32(out);
}

std::string py_title(std::string_view s) {
  std::u32string u = to_u32(s), out;
  bool previous_cased = false;
  for (size_t i = 0; i < u.size(); ++i) {
    if (previous_cased) {
      append_lower(out, u, i);
    } else {
      append_title(out, u[i]);
    }
    previous_cased = is_cased(u[i]);
  }
  return from_u32(out);
}

// Jinja2's `title` filter: split on runs of [-\s({\[<], upper-case each piece's first
// character and lower-case the rest.
std::string jinja_title(std::string_view s) {
  std::u32string u = to_u32(s), out;
  auto is_sep = [](char32_t c) {
    return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c);
  };
  size_t i = 0;
  while (i < u.size()) {
    size_t j = i;
    bool sep = is_sep(u[i]);
    while (j < u.size() && is_sep(u[j]) == sep) ++j;
    std::u32string piece = u.substr(i, j - i);
    append_upper(out, piece[0]);
    for (size_t k = 1; k < piece.size(); ++k) append_lower(out, piece, k);
    i = j;
  }
  return from_u32(out);
}

bool py_islower(std::string_view s) {
  bool cased = false;
  for (char32_t c : to_u32(s)) {
    auto cp = static_cast<UChar32>(c);
    if (u_hasBinaryProperty(cp, UCHAR_UPPERCASE) || u_istitle(cp)) return false;
    if (u_hasBinaryProperty(cp, UCHAR_LOWERCASE)) cased = true;
  }
  return cased;
}

bool py_isupper(std::string_view s) {
  bool cased = false;
  for (char32_t c : to_u32(s)) {
    auto cp = static_cast<UChar32>(c);
    if (u_hasBinaryProperty(cp, UCHAR_LOWERCASE) || u_istitle(cp)) return false;
    if (u_hasBinaryProperty(cp, UCHAR_UPPERCASE)) cased = true;
  }
  return cased;
}

// ---- str helpers on code points ----

std::u32string strip_chars(const std::u32string& s, const Value& chars, bool left, bool right) {
  std::u32string set;
  bool whitespace = chars.is_none() || chars.is_undefined();
  if (!whitespace) {
    if (!chars.is_string()) type_error("strip arg must be None or str");
    set = to_u32(chars.s);
  }
  auto strip = [&](char32_t c) {
    return whitespace ? py_isspace(c) : set.find(c) != std::u32string::npos;
  };
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e && strip(s[b])) ++b;
  }
  if (right) {
    while (e > b && strip(s[e - 1])) --e;
  }
  return s.substr(b, e - b);
}

std::string py_strip(std::string_view s, const Value& chars, bool left, bool right) {
  return from_u32(strip_chars(to_u32(s), chars, left, right));
}

Value str_list(const std::vector<std::u32string>& parts) {
  std::vector<Value> items;
  items.reserve(parts.size());
  for (const auto& p : parts) items.push_back(Value::string(from_u32(p)));
  return Value::list(std::move(items));
}

// str.split / str.rsplit.
Value py_split(std::string_view str, const Value& sep, int64_t maxsplit, bool from_right) {
  std::u32string s = to_u32(str);
  std::vector<std::u32string> parts;
  // A 64 MiB string of separators has 64M parts: the cap of one list is checked as each is
  // made, before they are all held.
  auto add = [&parts,
              what = from_right ? "str.rsplit result" : "str.split result"](std::u32string part) {
    check_list_size(parts.size() + 1, what);
    parts.push_back(std::move(part));
  };
  if (sep.is_none()) {
    // Runs of whitespace separate; leading/trailing whitespace yields no empty parts.
    if (!from_right) {
      size_t i = 0;
      while (true) {
        while (i < s.size() && py_isspace(s[i])) ++i;
        if (i >= s.size()) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          add(s.substr(i));  // the remainder keeps its trailing whitespace
          break;
        }
        size_t j = i;
        while (j < s.size() && !py_isspace(s[j])) ++j;
        add(s.substr(i, j - i));
        i = j;
      }
    } else {
      size_t i = s.size();
      while (true) {
        while (i > 0 && py_isspace(s[i - 1])) --i;
        if (i == 0) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          add(s.substr(0, i));  // the remainder keeps its leading whitespace
          break;
        }
        size_t j = i;
        while (j > 0 && !py_isspace(s[j - 1])) --j;
        add(s.substr(j, i - j));
        i = j;
      }
      std::reverse(parts.begin(), parts.end());
    }
    return str_list(parts);
  }
  if (!sep.is_string()) type_error("must be str or None, not " + type_name(sep));
  std::u32string d = to_u32(sep.s);
  if (d.empty()) type_error("empty separator");
  if (!from_right) {
    size_t i = 0;
    while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
      size_t j = s.find(d, i);
      if (j == std::u32string::npos) break;
      add(s.substr(i, j - i));
      i = j + d.size();
    }
    add(s.substr(i));
  } else {
    size_t end = s.size();
    while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
      if (end < d.size()) break;
      size_t j = s.rfind(d, end - d.size());
      if (j == std::u32string::npos) break;
      add(s.substr(j + d.size(), end - j - d.size()));
      end = j;
    }
    add(s.substr(0, end));
    std::reverse(parts.begin(), parts.end());
  }
  return str_list(parts);
}

// str.replace, on the UTF-8 bytes: in valid UTF-8 no code point's encoding starts inside
// another's, so bytes match exactly where code points do. The result's size follows from the
// number of replacements, counted first: many long replacements would otherwise grow without
// bound before any check.
std::string py_replace(std::string_view s, std::string_view old_s, std::string_view new_s,
                       int64_t count, const char* what) {
  const size_t chars = code_points(s);  // also rejects invalid UTF-8, as decoding did
  code_points(old_s);
  code_points(new_s);
  const size_t limit = count < 0 ? SIZE_MAX : static_cast<size_t>(count);
  size_t replacements = 0;
  if (old_s.empty()) {
    replacements = std::min(chars + 1, limit);  // before every character and at the end
  } else {
    for (size_t j = s.find(old_s); j != std::string_view::npos && replacements < limit;
         j = s.find(old_s, j + old_s.size())) {
      ++replacements;
    }
  }
  const size_t size = s.size() - replacements * old_s.size() + replacements * new_s.size();
  check_string_size(size, what);
  std::string out;
  out.reserve(size);
  size_t i = 0;
  for (size_t k = 0; k < replacements; ++k) {
    if (old_s.empty()) {
      out += new_s;
      if (i == s.size()) break;
      const size_t len = utf8::valid_sequence_length(s, i);
      out += s.substr(i, len);
      i += len;
    } else {
      const size_t j = s.find(old_s, i);
      out += s.substr(i, j - i);
      out += new_s;
      i = j + old_s.size();
    }
  }
  out += s.substr(i);
  return out;
}

// Python's str.splitlines() line boundaries.
bool is_line_break(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}

// `what` names the list the lines become, whose cap is checked as they are made.
std::vector<std::u32string> py_splitlines(const std::u32string& s, bool keepends,
                                          const char* what) {
  std::vector<std::u32string> lines;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i;
    while (j < s.size() && !is_line_break(s[j])) ++j;
    size_t eol = j;
    if (j < s.size()) {
      eol = (s[j] == '\r' && j + 1 < s.size() && s[j + 1] == '\n') ? j + 2 : j + 1;
    }
    check_list_size(lines.size() + 1, what);
    lines.push_back(s.substr(i, (keepends ? eol : j) - i));
    i = eol;
  }
  return lines;
}

// Python slice bounds for [start:end] arguments of find/count/startswith.
void adjust_range(const Value& start, const Value& end, int64_t len, int64_t& b, int64_t& e) {
  b = start.is_none() || start.is_undefined() ? 0 : to_index(start, "slice");
  e = end.is_none() || end.is_undefined() ? len : to_index(end, "slice");
  if (b < 0) b = std::max<int64_t>(0, b + len);
  if (e < 0) e = std::max<int64_t>(0, e + len);
  e = std::min(e, len);
}

Value escape_value(const Value& v) {
  if (v.is_string() && v.markup) return v;
  return Value::string(html_escape(py_str(v)), true);
}

// ---- numbers ----

Value checked_int(bool overflow, int64_t r) {
  if (overflow) unsupported("integer arithmetic beyond 64 bits");
  return Value::integer(r);
}

double py_fmod(double x, double y) {
  double mod = std::fmod(x, y);
  if (mod != 0.0) {
    if ((y < 0) != (mod < 0)) mod += y;
  } else {
    mod = std::copysign(0.0, y);
  }
  return mod;
}

double py_floordiv(double x, double y) {
  double mod = std::fmod(x, y);
  double div = (x - mod) / y;
  if (mod != 0.0 && ((y < 0) != (mod < 0))) div -= 1.0;
  if (div != 0.0) {
    double floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
    return floordiv;
  }
  return std::copysign(0.0, x / y);
}

// Python's int(str) and float(str) read any Unicode decimal digit (category Nd: "٣", "３") as
// its ASCII digit. Everything else stays as it is.
std::string ascii_digits(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t c : to_u32(text)) {
    if (c >= 0x80 && u_charType(static_cast<UChar32>(c)) == U_DECIMAL_DIGIT_NUMBER) {
      out += static_cast<char>('0' + u_charDigitValue(static_cast<UChar32>(c)));
    } else {
      utf8::append(out, c);
    }
  }
  return out;
}

// Python's float(str): surrounding whitespace, underscores between digits, inf/nan words.
std::optional<double> parse_py_float(std::string_view raw) {
  const std::string text = ascii_digits(raw);
  std::string s = py_strip(text, Value::none(), true, true);
  std::string lower = py_lower(s);
  std::string body = lower;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) body = body.substr(1);
  double sign = !lower.empty() && lower[0] == '-' ? -1.0 : 1.0;
  if (body == "inf" || body == "infinity") return sign * HUGE_VAL;
  if (body == "nan") return std::nan("");
  std::string clean;
  for (size_t k = 0; k < s.size(); ++k) {
    char c = s[k];
    if (c == '_') {
      bool ok = k > 0 && k + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[k - 1])) &&
                std::isdigit(static_cast<unsigned char>(s[k + 1]));
      if (!ok) return std::nullopt;
      continue;
    }
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == 'e' || c == 'E' ||
          c == '+' || c == '-')) {
      return std::nullopt;
    }
    clean += c;
  }
  if (clean.empty() || clean.find_first_of("0123456789") == std::string::npos) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  double d = std::strtod(clean.c_str(), &end);
  if (end != clean.c_str() + clean.size()) return std::nullopt;
  return d;
}

// Python's int(str, 10).
std::optional<int64_t> parse_py_int(std::string_view raw) {
  const std::string text = ascii_digits(raw);
  std::string s = py_strip(text, Value::none(), true, true);
  size_t k = 0;
  bool neg = false;
  if (k < s.size() && (s[k] == '+' || s[k] == '-')) neg = s[k++] == '-';
  if (k >= s.size()) return std::nullopt;
  std::string digits;
  for (; k < s.size(); ++k) {
    char c = s[k];
    if (c == '_' && !digits.empty() && k + 1 < s.size() &&
        std::isdigit(static_cast<unsigned char>(s[k + 1]))) {
      continue;
    }
    if (!std::isdigit(static_cast<unsigned char>(c))) return std::nullopt;
    digits += c;
  }
  errno = 0;
  long long v = std::strtoll((neg ? "-" + digits : digits).c_str(), nullptr, 10);
  if (errno == ERANGE) unsupported("integer beyond 64 bits");
  return v;
}

Value float_to_int(double d) {
  if (std::isinf(d)) type_error("cannot convert float infinity to integer");
  if (d >= 9.2233720368547758e18 || d < -9.2233720368547758e18)
    unsupported("integer beyond 64 bits");
  return Value::integer(static_cast<int64_t>(d));
}

// ---- sequences ----

Value generator(std::vector<Value> items) {
  return Value::list(std::move(items), SeqKind::kGenerator);
}

Value make_tuple2(Value a, Value b) {
  std::vector<Value> items;
  items.push_back(std::move(a));
  items.push_back(std::move(b));
  return Value::tuple(std::move(items));
}

bool is_mapping(const Value& v) {
  return v.kind == Kind::kDict;
}

Value ignore_case(const Value& v) {
  if (v.is_string()) return Value::string(py_lower(v.s));
  return v;
}

// jinja2.filters._prepare_attribute_parts + make_attrgetter (items are looked up with getitem).
std::vector<Value> attribute_parts(const Value& attribute) {
  std::vector<Value> parts;
  if (attribute.is_none() || attribute.is_undefined()) return parts;
  if (!attribute.is_string()) {
    parts.push_back(attribute);
    return parts;
  }
  const std::string s = attribute.s.str();
  size_t i = 0;
  while (true) {
    size_t j = s.find('.', i);
    std::string part = s.substr(i, j == std::string::npos ? std::string::npos : j - i);
    bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) {
      return std::isdigit(static_cast<unsigned char>(c));
    });
    if (digits) {
      parts.push_back(Value::integer(std::strtoll(part.c_str(), nullptr, 10)));
    } else {
      parts.push_back(Value::string(part));
    }
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return parts;
}

Value get_path(Value item, const std::vector<Value>& parts, const Value* fallback) {
  for (const auto& part : parts) {
    item = get_item(item, part);
    if (fallback && !fallback->is_none() && item.is_undefined()) item = *fallback;
  }
  return item;
}

std::vector<std::vector<Value>> multi_attribute_parts(const Value& attribute) {
  std::vector<std::vector<Value>> out;
  if (attribute.is_string()) {
    const std::string_view names = attribute.s;
    size_t i = 0;
    while (true) {
      size_t j = names.find(',', i);
      out.push_back(attribute_parts(
          Value::string(names.substr(i, j == std::string::npos ? std::string::npos : j - i))));
      if (j == std::string::npos) break;
      i = j + 1;
    }
  } else {
    out.push_back(attribute_parts(attribute));
  }
  return out;
}

void check_hashable(const Value& v) {
  if (v.kind == Kind::kDict || v.is_seq(SeqKind::kList)) {
    type_error("unhashable type: '" + type_name(v) + "'");
  }
}

Value sum_values(const Value& a, const Value& b) {
  return binary_op("+", a, b);
}

// ---- str.format / printf-style formatting (the simple forms templates use) ----

std::string py_format(std::string_view fmt, const CallArgs& call) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '{') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
        out += '{';
        ++i;
        continue;
      }
      size_t j = fmt.find('}', i);
      if (j == std::string::npos) type_error("Single '{' encountered in format string");
      std::string field(fmt.substr(i + 1, j - i - 1));
      if (field.find_first_of("!:.[{") != std::string::npos)
        unsupported("str.format field '{" + field + "}'");
      const Value* v = nullptr;
      if (field.empty() || std::isdigit(static_cast<unsigned char>(field[0]))) {
        size_t idx = field.empty() ? auto_index++ : std::stoul(field);
        if (idx >= call.args.size())
          type_error("Replacement index " + std::to_string(idx) + " out of range");
        v = &call.args[idx];
      } else {
        for (const auto& [k, val] : call.kwargs) {
          if (k == field) v = &val;
        }
        if (!v) type_error("'" + field + "'");
      }
      out += py_str(*v);
      i = j;
    } else if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}') {
        out += '}';
        ++i;
        continue;
      }
      type_error("Single '}' encountered in format string");
    } else {
      out += c;
    }
  }
  return out;
}

std::string percent_format(std::string_view fmt, const Value& rhs) {
  if (rhs.kind == Kind::kDict) unsupported("%-formatting with a mapping");
  std::vector<Value> args;
  if (rhs.is_seq(SeqKind::kTuple)) {
    args = rhs.seq->items;
  } else {
    args.push_back(rhs);
  }
  std::string out;
  size_t next_arg = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (i + 1 >= fmt.size()) type_error("incomplete format");
    char spec = fmt[++i];
    if (spec == '%') {
      out += '%';
      continue;
    }
    if (spec != 's' && spec != 'r' && spec != 'd' && spec != 'i')
      unsupported("%-format '%" + std::string(1, spec) + "'");
    if (next_arg >= args.size()) type_error("not enough arguments for format string");
    const Value& a = args[next_arg++];
    if (spec == 's') {
      out += py_str(a);
    } else if (spec == 'r') {
      out += py_repr(a);
    } else {
      check_defined(a);
      if (a.is_int_like()) {
        out += std::to_string(a.i);
      } else if (a.kind == Kind::kBigInt) {
        out += std::to_string(a.big());
      } else if (a.kind == Kind::kFloat) {
        out += std::to_string(float_to_int(std::trunc(a.f)).i);
      } else {
        type_error("%" + std::string(1, spec) + " format: a real number is required, not " +
                   type_name(a));
      }
    }
  }
  if (next_arg < args.size()) type_error("not all arguments converted during string formatting");
  return out;
}

// ---- methods ----

Value method(const std::string& name, std::function<Value(CallArgs&)> fn) {
  Value v;
  v.kind = Kind::kCallable;
  v.fn = std::make_shared<Callable>();
  v.fn->name = name;
  v.fn->fn = std::move(fn);
  return v;
}

// The entry for `name` in a name -> function table, or nullptr when the table has none.
template <class Table>
const typename Table::mapped_type* find_entry(const Table& table, std::string_view name) {
  auto it = table.find(name);
  return it == table.end() ? nullptr : &it->second;
}

// `self.name(args)`: what the body of a bound str, dict or list method gets when it is called.
template <class Self>
struct MethodCall {
  const Self& self;
  const std::string& name;  // for argument errors, as Python names the method
  CallArgs& args;
};
using StrCall = MethodCall<std::string_view>;
using DictCall = MethodCall<Dict>;
using ListCall = MethodCall<Sequence>;

template <class Self>
using MethodFn = Value (*)(const MethodCall<Self>& call);

bool affix_match(const std::u32string& s, const Value& affix, const Value& start, const Value& end,
                 bool prefix, const std::string& fn) {
  int64_t b = 0, e = 0;
  adjust_range(start, end, static_cast<int64_t>(s.size()), b, e);
  auto one = [&](const Value& a) {
    if (!a.is_string()) {
      type_error(fn + " first arg must be str or a tuple of str, not " + type_name(a));
    }
    std::u32string x = to_u32(a.s);
    if (b > static_cast<int64_t>(s.size())) return false;
    if (e - b < static_cast<int64_t>(x.size())) return false;
    size_t pos = prefix ? static_cast<size_t>(b) : static_cast<size_t>(e) - x.size();
    return s.compare(pos, x.size(), x) == 0;
  };
  if (affix.is_seq(SeqKind::kTuple)) {
    for (const auto& a : affix.seq->items) {
      if (one(a)) return true;
    }
    return false;
  }
  return one(affix);
}

// str.startswith / str.endswith
Value str_affix(const StrCall& c, bool prefix) {
  Params p(c.name, c.args, {"prefix", "start", "end"});
  return Value::boolean(affix_match(to_u32(c.self), p.get(0), p.get_or(1, Value::none()),
                                    p.get_or(2, Value::none()), prefix, c.name));
}

// str.split / str.rsplit
Value str_split(const StrCall& c, bool from_right) {
  Params p(c.name, c.args, {"sep", "maxsplit"});
  return py_split(c.self, p.get_or(0, Value::none()),
                  to_index(p.get_or(1, Value::integer(-1)), "maxsplit"), from_right);
}

// str.strip / str.lstrip / str.rstrip
Value str_strip(const StrCall& c, bool left, bool right) {
  Params p(c.name, c.args, {"chars"});
  return Value::string(py_strip(c.self, p.get_or(0, Value::none()), left, right));
}

Value str_replace(const StrCall& c) {
  Params p(c.name, c.args, {"old", "new", "count"});
  const Value& o = p.get(0);
  const Value& n = p.get(1);
  if (!o.is_string() || !n.is_string()) type_error("replace() argument must be str");
  return Value::string(py_replace(
      c.self, o.s, n.s, to_index(p.get_or(2, Value::integer(-1)), "count"), "str.replace result"));
}

// str.upper / lower / title / capitalize
template <std::string (*Convert)(std::string_view)>
Value str_case(const StrCall& c) {
  Params p(c.name, c.args, {});
  return Value::string(Convert(c.self));
}

// The arguments of find/rfind/index/rindex/count: the string and the substring as code points
// and the [b, e) window that start and end select.
struct Search {
  std::u32string u, sub;
  int64_t b = 0, e = 0;
};

Search search_args(const StrCall& c) {
  Params p(c.name, c.args, {"sub", "start", "end"});
  const Value& subv = p.get(0);
  if (!subv.is_string()) type_error("must be str, not " + type_name(subv));
  Search q;
  q.u = to_u32(c.self);
  q.sub = to_u32(subv.s);
  adjust_range(p.get_or(1, Value::none()), p.get_or(2, Value::none()),
               static_cast<int64_t>(q.u.size()), q.b, q.e);
  return q;
}

Value str_count(const StrCall& c) {
  Search q = search_args(c);
  if (q.b > q.e) return Value::integer(0);
  if (q.sub.empty()) return Value::integer(q.e - q.b + 1);
  int64_t n = 0;
  size_t i = static_cast<size_t>(q.b);
  while (true) {
    size_t j = q.u.find(q.sub, i);
    if (j == std::u32string::npos || j + q.sub.size() > static_cast<size_t>(q.e)) break;
    ++n;
    i = j + q.sub.size();
  }
  return Value::integer(n);
}

// str.find / rfind, and str.index / rindex, which raise where find returns -1.
Value str_find(const StrCall& c, bool from_right, bool raise) {
  Search q = search_args(c);
  int64_t found = -1;
  if (q.b <= q.e && static_cast<int64_t>(q.sub.size()) <= q.e - q.b) {
    std::u32string window = q.u.substr(static_cast<size_t>(q.b), static_cast<size_t>(q.e - q.b));
    size_t j = from_right ? window.rfind(q.sub) : window.find(q.sub);
    if (j != std::u32string::npos) found = q.b + static_cast<int64_t>(j);
  }
  if (found < 0 && raise) type_error("substring not found");
  return Value::integer(found);
}

Value str_join(const StrCall& c) {
  Params p(c.name, c.args, {"iterable"});
  std::string out;
  size_t k = 0;
  for (const auto& item : py_iterate(p.get(0))) {
    if (!item.is_string()) {
      type_error("sequence item " + std::to_string(k) + ": expected str instance, " +
                 type_name(item) + " found");
    }
    if (k++) out += c.self;
    out += item.s;
    // A long separator between many items would multiply the size.
    check_string_size(out.size(), "str.join result");
  }
  return Value::string(std::move(out));
}

Value str_splitlines(const StrCall& c) {
  Params p(c.name, c.args, {"keepends"});
  return str_list(py_splitlines(to_u32(c.self), truthy(p.get_or(0, Value::boolean(false))),
                                "str.splitlines result"));
}

// str.removeprefix / str.removesuffix
Value str_remove_affix(const StrCall& c, bool prefix) {
  Params p(c.name, c.args, {"affix"});
  const Value& x = p.get(0);
  const std::string_view s = c.self;
  if (!x.is_string()) type_error(c.name + "() argument must be str, not " + type_name(x));
  const std::string_view a = x.s;
  if (prefix && s.substr(0, a.size()) == a) return Value::string(s.substr(a.size()));
  if (!prefix && s.size() >= a.size() && s.substr(s.size() - a.size()) == a) {
    return Value::string(s.substr(0, s.size() - a.size()));
  }
  return Value::string(s);
}

// Character classes of str.isdigit() and friends, from the Unicode numeric type as CPython uses it.
int numeric_type(char32_t c) {
  return u_getIntPropertyValue(static_cast<UChar32>(c), UCHAR_NUMERIC_TYPE);
}
bool char_is_decimal(char32_t c) {
  return numeric_type(c) == U_NT_DECIMAL;
}
bool char_is_digit(char32_t c) {
  return char_is_decimal(c) || numeric_type(c) == U_NT_DIGIT;
}
bool char_is_numeric(char32_t c) {
  return char_is_digit(c) || numeric_type(c) == U_NT_NUMERIC;
}
bool char_is_alpha(char32_t c) {
  return u_isalpha(static_cast<UChar32>(c));
}
bool char_is_alnum(char32_t c) {
  return char_is_alpha(c) || char_is_numeric(c);
}

// str.isspace / isdigit / isdecimal / isnumeric / isalpha / isalnum: a non-empty string whose
// every character is of the class.
template <bool (*InClass)(char32_t)>
Value str_all_chars(const StrCall& c) {
  Params p(c.name, c.args, {});
  std::u32string u = to_u32(c.self);
  if (u.empty()) return Value::boolean(false);
  for (char32_t ch : u) {
    if (!InClass(ch)) return Value::boolean(false);
  }
  return Value::boolean(true);
}

// Every method Python's str has. A null entry is one this interpreter refuses.
const std::unordered_map<std::string_view, MethodFn<std::string_view>> kStrMethods = {
    {"capitalize", str_case<py_capitalize>},
    {"casefold",
     [](const StrCall& c) -> Value {
       Params p(c.name, c.args, {});
       unsupported("str.casefold");
     }},
    {"center", nullptr},
    {"count", str_count},
    {"encode", nullptr},
    {"endswith", [](const StrCall& c) { return str_affix(c, /*prefix=*/false); }},
    {"expandtabs", nullptr},
    {"find", [](const StrCall& c) { return str_find(c, /*from_right=*/false, /*raise=*/false); }},
    {"format", [](const StrCall& c) { return Value::string(py_format(c.self, c.args)); }},
    {"format_map", nullptr},
    {"index", [](const StrCall& c) { return str_find(c, /*from_right=*/false, /*raise=*/true); }},
    {"isalnum", str_all_chars<char_is_alnum>},
    {"isalpha", str_all_chars<char_is_alpha>},
    {"isascii", nullptr},
    {"isdecimal", str_all_chars<char_is_decimal>},
    {"isdigit", str_all_chars<char_is_digit>},
    {"isidentifier", nullptr},
    {"islower",
     [](const StrCall& c) {
       Params p(c.name, c.args, {});
       return Value::boolean(py_islower(c.self));
     }},
    {"isnumeric", str_all_chars<char_is_numeric>},
    {"isprintable", nullptr},
    {"isspace", str_all_chars<py_isspace>},
    {"istitle", nullptr},
    {"isupper",
     [](const StrCall& c) {
       Params p(c.name, c.args, {});
       return Value::boolean(py_isupper(c.self));
     }},
    {"join", str_join},
    {"ljust", nullptr},
    {"lower", str_case<py_lower>},
    {"lstrip", [](const StrCall& c) { return str_strip(c, /*left=*/true, /*right=*/false); }},
    {"maketrans", nullptr},
    {"partition", nullptr},
    {"removeprefix", [](const StrCall& c) { return str_remove_affix(c, /*prefix=*/true); }},
    {"removesuffix", [](const StrCall& c) { return str_remove_affix(c, /*prefix=*/false); }},
    {"replace", str_replace},
    {"rfind", [](const StrCall& c) { return str_find(c, /*from_right=*/true, /*raise=*/false); }},
    {"rindex", [](const StrCall& c) { return str_find(c, /*from_right=*/true, /*raise=*/true); }},
    {"rjust", nullptr},
    {"rpartition", nullptr},
    {"rsplit", [](const StrCall& c) { return str_split(c, /*from_right=*/true); }},
    {"rstrip", [](const StrCall& c) { return str_strip(c, /*left=*/false, /*right=*/true); }},
    {"split", [](const StrCall& c) { return str_split(c, /*from_right=*/false); }},
    {"splitlines", str_splitlines},
    {"startswith", [](const StrCall& c) { return str_affix(c, /*prefix=*/true); }},
    {"strip", [](const StrCall& c) { return str_strip(c, /*left=*/true, /*right=*/true); }},
    {"swapcase", nullptr},
    {"title", str_case<py_title>},
    {"translate", nullptr},
    {"upper", str_case<py_upper>},
    {"zfill", nullptr},
};

enum class DictView { kItems, kKeys, kValues };

Value dict_view(const DictCall& c, DictView view) {
  Params p(c.name, c.args, {});
  std::vector<Value> out;
  for (const auto& [k, v] : c.self.items) {
    if (view == DictView::kItems) {
      out.push_back(make_tuple2(k, v));
    } else {
      out.push_back(view == DictView::kKeys ? k : v);
    }
  }
  return Value::list(std::move(out), SeqKind::kDictView);
}

// Every method Python's dict has. A null entry is one the sandbox forbids (it mutates).
const std::unordered_map<std::string_view, MethodFn<Dict>> kDictMethods = {
    {"clear", nullptr},
    {"copy",
     [](const DictCall& c) {
       Params p(c.name, c.args, {});
       charge_items(2 * c.self.items.size());
       Value v;
       v.kind = Kind::kDict;
       v.dict = std::make_shared<Dict>(c.self);
       return v;
     }},
    {"fromkeys", nullptr},
    {"get",
     [](const DictCall& c) {
       Params p(c.name, c.args, {"key", "default"});
       check_hashable(p.get(0));
       const Value* v = c.self.find(p.get(0));
       return v ? *v : p.get_or(1, Value::none());
     }},
    {"items", [](const DictCall& c) { return dict_view(c, DictView::kItems); }},
    {"keys", [](const DictCall& c) { return dict_view(c, DictView::kKeys); }},
    {"pop", nullptr},
    {"popitem", nullptr},
    {"setdefault", nullptr},
    {"update", nullptr},
    {"values", [](const DictCall& c) { return dict_view(c, DictView::kValues); }},
};

// Every method Python's list has (a tuple has count and index only). A null entry is one the
// sandbox forbids (it mutates).
const std::unordered_map<std::string_view, MethodFn<Sequence>> kListMethods = {
    {"append", nullptr},
    {"clear", nullptr},
    {"copy", nullptr},
    {"count",
     [](const ListCall& c) {
       Params p(c.name, c.args, {"value"});
       charge_steps(static_cast<int64_t>(c.self.items.size()));  // compared, as `in` charges
       int64_t n = 0;
       for (const auto& v : c.self.items) n += py_equal(v, p.get(0)) ? 1 : 0;
       return Value::integer(n);
     }},
    {"extend", nullptr},
    {"index",
     [](const ListCall& c) {
       Params p(c.name, c.args, {"value"});
       for (size_t k = 0; k < c.self.items.size(); ++k) {
         charge_steps(1);  // compared, as `in` charges
         if (py_equal(c.self.items[k], p.get(0))) return Value::integer(static_cast<int64_t>(k));
       }
       type_error(py_repr(p.get(0)) + " is not in list");
     }},
    {"insert", nullptr},
    {"pop", nullptr},
    {"remove", nullptr},
    {"reverse", nullptr},
    {"sort", nullptr},
};

// `self.name`, bound; `body` is the table's entry for the name.
Value str_method(const Value& self, const std::string& name, MethodFn<std::string_view> body) {
  if (self.markup) unsupported("method '" + name + "' on a Markup string");
  if (!body) unsupported("str method '" + name + "'");
  return method("str." + name, [s = self.s, name, body](CallArgs& a) {
    const std::string_view text = s;
    return body(StrCall{text, name, a});
  });
}

Value dict_method(const Value& self, const std::string& name, MethodFn<Dict> body) {
  if (!body) unsupported("dict method '" + name + "' (the sandbox forbids mutation)");
  return method("dict." + name, [d = self.dict, name, body](CallArgs& a) {
    return body(DictCall{*d, name, a});
  });
}

Value list_method(const Value& self, const std::string& name, MethodFn<Sequence> body) {
  if (!body) unsupported("list method '" + name + "' (the sandbox forbids mutation)");
  return method("list." + name, [sq = self.seq, name, body](CallArgs& a) {
    return body(ListCall{*sq, name, a});
  });
}

// The attributes of a `loop` variable.
int64_t loop_index0(const LoopInfo& l) {
  return static_cast<int64_t>(l.index0);
}
int64_t loop_length(const LoopInfo& l) {
  return static_cast<int64_t>(l.length);
}

const std::unordered_map<std::string_view, Value (*)(const LoopInfo&)> kLoopAttrs = {
    {"index0", [](const LoopInfo& l) { return Value::integer(loop_index0(l)); }},
    {"index", [](const LoopInfo& l) { return Value::integer(loop_index0(l) + 1); }},
    {"revindex", [](const LoopInfo& l) { return Value::integer(loop_length(l) - loop_index0(l)); }},
    {"revindex0",
     [](const LoopInfo& l) { return Value::integer(loop_length(l) - loop_index0(l) - 1); }},
    {"first", [](const LoopInfo& l) { return Value::boolean(loop_index0(l) == 0); }},
    {"last",
     [](const LoopInfo& l) { return Value::boolean(loop_index0(l) == loop_length(l) - 1); }},
    {"length", [](const LoopInfo& l) { return Value::integer(loop_length(l)); }},
    {"depth", [](const LoopInfo& l) { return Value::integer(l.depth); }},
    {"depth0", [](const LoopInfo& l) { return Value::integer(l.depth - 1); }},
    {"previtem",
     [](const LoopInfo& l) {
       return loop_index0(l) > 0 ? l.item(l.index0 - 1)
                                 : Value::undefined("there is no previous item");
     }},
    {"nextitem",
     [](const LoopInfo& l) {
       return loop_index0(l) + 1 < loop_length(l) ? l.item(l.index0 + 1)
                                                  : Value::undefined("there is no next item");
     }},
    {"cycle",
     [](const LoopInfo& l) {
       size_t idx = l.index0;
       return method("loop.cycle", [idx](CallArgs& a) {
         if (a.args.empty()) type_error("no items for cycling given");
         return a.args[idx % a.args.size()];
       });
     }},
    {"changed", [](const LoopInfo&) -> Value { unsupported("loop.changed"); }},
};

// Python-level attribute lookup; returns false when the object has no such attribute.
bool python_attr(const Value& obj, const std::string& name, Value& out) {
  if (name.size() >= 2 && name.compare(0, 2, "__") == 0)
    unsupported("dunder attribute '" + name + "'");
  switch (obj.kind) {
    case Kind::kString: {
      auto body = find_entry(kStrMethods, name);
      if (!body) return false;
      out = str_method(obj, name, *body);
      return true;
    }
    case Kind::kDict: {
      auto body = find_entry(kDictMethods, name);
      if (!body) return false;
      out = dict_method(obj, name, *body);
      return true;
    }
    case Kind::kSequence:
      if (obj.seq->kind == SeqKind::kList || obj.seq->kind == SeqKind::kTuple) {
        auto body = find_entry(kListMethods, name);
        if (!body) return false;
        if (obj.seq->kind == SeqKind::kTuple && name != "count" && name != "index") return false;
        out = list_method(obj, name, *body);
        return true;
      }
      return false;
    case Kind::kNamespace:
      if (const Value* v = obj.ns->find(name)) {
        out = *v;
        return true;
      }
      return false;
    case Kind::kLoop: {
      auto attr = find_entry(kLoopAttrs, name);
      if (!attr) return false;
      out = (*attr)(*obj.loop);
      return true;
    }
    case Kind::kInt:
    case Kind::kBigInt:
    case Kind::kFloat:
    case Kind::kBool:
      if (name == "real" || name == "imag" || name == "numerator" || name == "denominator" ||
          name == "is_integer" || name == "bit_length" || name == "conjugate") {
        unsupported("number attribute '" + name + "'");
      }
      return false;
    default:
      return false;
  }
}

Value undefined_attribute(const Value& obj, const std::string& name) {
  return Value::undefined("'" + object_type_repr(obj) + "' has no attribute '" + name + "'");
}

// obj[key] in Python; returns false on KeyError/IndexError/TypeError (the sandbox then tries an
// attribute or returns Undefined).
bool python_item(const Value& obj, const Value& key, Value& out) {
  switch (obj.kind) {
    case Kind::kDict: {
      if (key.kind == Kind::kDict || key.is_seq(SeqKind::kList)) return false;  // unhashable
      if (const Value* v = obj.dict->find(key)) {
        out = *v;
        return true;
      }
      return false;
    }
    case Kind::kSequence: {
      if (obj.seq->kind == SeqKind::kGenerator || obj.seq->kind == SeqKind::kDictView) return false;
      // (lists, tuples and ranges are indexable)
      if (!key.is_int_like()) return false;
      int64_t n = static_cast<int64_t>(obj.seq->items.size());
      int64_t i = key.i < 0 ? key.i + n : key.i;
      if (i < 0 || i >= n) return false;
      out = obj.seq->items[static_cast<size_t>(i)];
      return true;
    }
    case Kind::kString: {
      if (!key.is_int_like()) return false;
      std::u32string u = to_u32(obj.s);
      int64_t n = static_cast<int64_t>(u.size());
      int64_t i = key.i < 0 ? key.i + n : key.i;
      if (i < 0 || i >= n) return false;
      out = Value::string(from_u32(u.substr(static_cast<size_t>(i), 1)), obj.markup);
      return true;
    }
    default:
      return false;
  }
}

}  // namespace

// ---- attribute and item access ----

Value get_attr(const Value& obj, const std::string& name) {
  check_defined(obj);
  Value out;
  if (python_attr(obj, name, out)) return out;
  if (python_item(obj, Value::string(name), out)) return out;
  return undefined_attribute(obj, name);
}

Value get_item(const Value& obj, const Value& key) {
  check_defined(obj);
  Value out;
  if (python_item(obj, key, out)) return out;
  if (key.is_string()) {
    const std::string name = key.s.str();
    if (python_attr(obj, name, out)) return out;
    return undefined_attribute(obj, name);
  }
  return Value::undefined(object_type_repr(obj) + " has no element " + py_repr(key));
}

namespace {

// Python's slice.indices for obj[start:stop:step] over `len` items: the first index, the bound
// the walk stops at and the stride.
struct SliceBounds {
  int64_t begin = 0, end = 0, stride = 1;
};

SliceBounds slice_bounds(int64_t len, const Value& start, const Value& stop, const Value& step) {
  auto idx = [](const Value& v, bool& given) -> int64_t {
    given = !(v.is_none() || v.is_undefined());
    if (!given) return 0;
    if (v.kind == Kind::kBigInt) big_integer_unsupported(v, "a slice");
    if (!v.is_int_like()) type_error("slice indices must be integers or None");
    return v.i;
  };
  bool has_start, has_stop, has_step;
  int64_t b = idx(start, has_start), e = idx(stop, has_stop), st = idx(step, has_step);
  if (!has_step) st = 1;
  if (st == 0) type_error("slice step cannot be zero");
  auto adjust = [&](int64_t v, bool given, bool is_start) {
    if (!given) return is_start ? (st < 0 ? len - 1 : 0) : (st < 0 ? -1 : len);
    if (v < 0) {
      v += len;
      if (v < 0) v = st < 0 ? -1 : 0;
    } else if (v >= len) {
      v = st < 0 ? len - 1 : len;
    }
    return v;
  };
  return {adjust(b, has_start, true), adjust(e, has_stop, false), st};
}

bool is_sliceable_sequence(const Value& obj) {
  return obj.is_seq(SeqKind::kList) || obj.is_seq(SeqKind::kTuple) || obj.is_seq(SeqKind::kRange);
}

}  // namespace

Value get_slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  check_defined(obj);
  bool is_str = obj.is_string();
  std::u32string u;
  int64_t len = 0;
  if (is_str) {
    u = to_u32(obj.s);
    len = static_cast<int64_t>(u.size());
  } else if (is_sliceable_sequence(obj)) {
    len = static_cast<int64_t>(obj.seq->items.size());
  } else {
    slice_bounds(0, start, stop, step);  // bad indices are a TypeError first
    // TypeError in Python; the sandbox turns it into an Undefined.
    return Value::undefined(object_type_repr(obj) + " has no element slice");
  }
  const SliceBounds bounds = slice_bounds(len, start, stop, step);
  std::vector<int64_t> picks;
  if (bounds.stride > 0) {
    for (int64_t i = bounds.begin; i < bounds.end; i += bounds.stride) picks.push_back(i);
  } else {
    for (int64_t i = bounds.begin; i > bounds.end; i += bounds.stride) picks.push_back(i);
  }
  if (is_str) {
    std::u32string out;
    for (int64_t i : picks) out += u[static_cast<size_t>(i)];
    return Value::string(from_u32(out), obj.markup);
  }
  std::vector<Value> out;
  out.reserve(picks.size());
  for (int64_t i : picks) out.push_back(obj.seq->items[static_cast<size_t>(i)]);
  return Value::list(std::move(out), obj.seq->kind);
}

bool contiguous_slice(const Value& obj, const Value& start, const Value& stop, const Value& step,
                      size_t& begin, size_t& count) {
  if (!is_sliceable_sequence(obj)) return false;
  const auto len = static_cast<int64_t>(obj.seq->items.size());
  const SliceBounds bounds = slice_bounds(len, start, stop, step);
  if (bounds.stride != 1) return false;
  begin = static_cast<size_t>(bounds.begin);
  count = bounds.end > bounds.begin ? static_cast<size_t>(bounds.end - bounds.begin) : 0;
  return true;
}

// ---- operators ----

Value binary_op(const std::string& op, const Value& a, const Value& b) {
  check_defined(a);
  if (op == "%" && a.is_string()) {
    // str % x formats str(x), and str(Undefined) is "", so an undefined operand is fine here.
    if (a.markup) unsupported("%-formatting a Markup string");
    return Value::string(percent_format(a.s, b));
  }
  check_defined(b);
  // Python computes with any integer; with one beyond int64 only what gives a float is done here
  // (with a float operand, or `/`).
  const bool gives_float = op == "/" || a.kind == Kind::kFloat || b.kind == Kind::kFloat;
  if (a.kind == Kind::kBigInt && !gives_float) big_integer_unsupported(a, "'" + op + "'");
  if (b.kind == Kind::kBigInt && !gives_float) big_integer_unsupported(b, "'" + op + "'");
  auto unsupported_operands = [&]() -> Value {
    type_error("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" +
               type_name(b) + "'");
  };
  bool both_int = a.is_int_like() && b.is_int_like();
  bool both_num = a.is_number() && b.is_number();
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      if (a.markup != b.markup) {
        // markupsafe escapes the plain operand before concatenating.
        std::string joined = a.markup ? a.s.str() : html_escape(a.s);
        joined += b.markup ? b.s.str() : html_escape(b.s);
        check_string_size(joined.size(), "string concatenation");
        return Value::string(std::move(joined), true);
      }
      // Doubling a string in a loop would reach any size in a few dozen steps.
      check_string_size(a.s.size() + b.s.size(), "string concatenation");
      return Value::string(Str::concat(a.s, b.s), a.markup);
    }
    if (both_int) {
      int64_t r;
      bool overflow = __builtin_add_overflow(a.i, b.i, &r);
      return checked_int(overflow, r);
    }
    if (both_num) return Value::floating(a.as_double() + b.as_double());
    if (a.kind == Kind::kSequence && b.kind == Kind::kSequence && a.seq->kind == b.seq->kind &&
        (a.seq->kind == SeqKind::kList || a.seq->kind == SeqKind::kTuple)) {
      check_list_size(a.seq->items.size() + b.seq->items.size(), "list concatenation");
      std::vector<Value> items = a.seq->items;
      items.insert(items.end(), b.seq->items.begin(), b.seq->items.end());
      return Value::list(std::move(items), a.seq->kind);
    }
    if (a.is_string() && !a.markup)
      type_error("can only concatenate str (not \"" + type_name(b) + "\") to str");
    if (a.is_seq(SeqKind::kList))
      type_error("can only concatenate list (not \"" + type_name(b) + "\") to list");
    return unsupported_operands();
  }
  if (op == "-") {
    if (both_int) {
      int64_t r;
      bool overflow = __builtin_sub_overflow(a.i, b.i, &r);
      return checked_int(overflow, r);
    }
    if (both_num) return Value::floating(a.as_double() - b.as_double());
    return unsupported_operands();
  }
  if (op == "*") {
    if (both_int) {
      int64_t r;
      bool overflow = __builtin_mul_overflow(a.i, b.i, &r);
      return checked_int(overflow, r);
    }
    if (both_num) return Value::floating(a.as_double() * b.as_double());
    const Value* seq = nullptr;
    const Value* count = nullptr;
    if (b.is_int_like()) {
      seq = &a;
      count = &b;
    } else if (a.is_int_like()) {
      seq = &b;
      count = &a;
    }
    if (seq && seq->is_string()) {
      if (seq->markup) unsupported("repeating a Markup string");
      // Checked by division: the product wraps for huge counts, and an empty string repeated
      // 2^62 times must not loop 2^62 times to make nothing.
      if (count->i <= 0 || seq->s.empty()) return Value::string("");
      if (static_cast<uint64_t>(count->i) > kMaxStringBytes / seq->s.size())
        unsupported("string repetition beyond 64 MiB");
      std::string out;
      out.reserve(seq->s.size() * static_cast<size_t>(count->i));
      for (int64_t k = 0; k < count->i; ++k) out += seq->s;
      return Value::string(std::move(out));
    }
    if (seq && (seq->is_seq(SeqKind::kList) || seq->is_seq(SeqKind::kTuple))) {
      const auto& items = seq->seq->items;
      if (count->i <= 0 || items.empty()) return Value::list({}, seq->seq->kind);
      if (static_cast<uint64_t>(count->i) > kMaxListItems / items.size())
        unsupported("list repetition beyond 4M items");
      std::vector<Value> out;
      out.reserve(items.size() * static_cast<size_t>(count->i));
      for (int64_t k = 0; k < count->i; ++k) out.insert(out.end(), items.begin(), items.end());
      return Value::list(std::move(out), seq->seq->kind);
    }
    if (seq)
      type_error("can't multiply sequence by non-int of type '" + type_name(count == &a ? b : a) +
                 "'");
    return unsupported_operands();
  }
  if (op == "/") {
    if (!both_num) return unsupported_operands();
    if (b.as_double() == 0.0) type_error(both_int ? "division by zero" : "float division by zero");
    return Value::floating(a.as_double() / b.as_double());
  }
  if (op == "//" || op == "%") {
    if (!both_num) return unsupported_operands();
    if (both_int) {
      if (b.i == 0) type_error("integer division or modulo by zero");
      if (a.i == INT64_MIN && b.i == -1) unsupported("integer arithmetic beyond 64 bits");
      int64_t q = a.i / b.i, r = a.i % b.i;
      if (r != 0 && ((r < 0) != (b.i < 0))) {
        q -= 1;
        r += b.i;
      }
      return Value::integer(op == "//" ? q : r);
    }
    if (b.as_double() == 0.0)
      type_error(op == "//" ? "float floor division by zero" : "float modulo");
    return Value::floating(op == "//" ? py_floordiv(a.as_double(), b.as_double())
                                      : py_fmod(a.as_double(), b.as_double()));
  }
  if (op == "**") {
    if (!both_num) return unsupported_operands();
    if (both_int && b.i >= 0) {
      int64_t r = 1, base = a.i;
      for (int64_t k = 0; k < b.i; ++k) {
        if (__builtin_mul_overflow(r, base, &r)) unsupported("integer arithmetic beyond 64 bits");
        if (r == 0 || r == 1) break;
      }
      return Value::integer(r);
    }
    double x = a.as_double(), y = b.as_double();
    if (x == 0.0 && y < 0) type_error("0.0 cannot be raised to a negative power");
    if (x < 0 && y != std::floor(y)) unsupported("complex result of **");
    const double r = std::pow(x, y);
    // CPython's float_pow: an infinite result of finite operands is an OverflowError (ERANGE).
    if (std::isinf(r) && std::isfinite(x) && std::isfinite(y))
      type_error("(34, 'Numerical result out of range')");
    return Value::floating(r);
  }
  unsupported("operator '" + op + "'");
}

Value negate(const Value& v) {
  check_defined(v);
  if (v.is_int_like()) {
    if (v.i == INT64_MIN) unsupported("integer arithmetic beyond 64 bits");
    return Value::integer(-v.i);
  }
  if (v.kind == Kind::kBigInt) {
    // The literal -9223372036854775808 is 9223372036854775808 negated.
    if (v.big() == uint64_t{1} << 63) return Value::integer(INT64_MIN);
    big_integer_unsupported(v, "unary '-'");
  }
  if (v.kind == Kind::kFloat) return Value::floating(-v.f);
  type_error("bad operand type for unary -: '" + type_name(v) + "'");
}

Value unary_plus(const Value& v) {
  check_defined(v);
  if (v.is_int_like()) return Value::integer(v.i);
  if (v.kind == Kind::kFloat || v.kind == Kind::kBigInt) return v;
  type_error("bad operand type for unary +: '" + type_name(v) + "'");
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Kind::kUndefined:
      return false;
    case Kind::kString:
      if (!item.is_string()) {
        check_defined(item);
        type_error("'in <string>' requires string as left operand, not " + type_name(item));
      }
      charge_bytes(static_cast<int64_t>(container.s.size()));  // scanned
      return container.s.view().find(item.s.view()) != std::string::npos;
    case Kind::kDict:
      check_hashable(item);
      return container.dict->find(item) != nullptr;
    case Kind::kSequence: {
      // A step per element compared, as Dict::find charges: `x in l` over a long list in a loop
      // would otherwise be unbounded work.
      auto& sq = *container.seq;
      size_t from = sq.kind == SeqKind::kGenerator ? sq.consumed : 0;
      for (size_t k = from; k < sq.items.size(); ++k) {
        charge_steps(1);
        if (py_equal(sq.items[k], item)) {
          if (sq.kind == SeqKind::kGenerator) sq.consumed = k + 1;
          return true;
        }
      }
      if (sq.kind == SeqKind::kGenerator) sq.consumed = sq.items.size();
      return false;
    }
    default:
      type_error("argument of type '" + type_name(container) + "' is not iterable");
  }
}

Value call_value(const Value& callee, CallArgs& args) {
  check_defined(callee);
  if (callee.kind != Kind::kCallable)
    type_error("'" + type_name(callee) + "' object is not callable");
  return callee.fn->fn(args);
}

// ---- globals ----

namespace {

Value raise_exception_global(CallArgs& a) {
  Params p("raise_exception", a, {"message"});
  throw RaisedError{py_str(p.get(0))};
}

Value strftime_now_global(CallArgs& a) {
  Params p("strftime_now", a, {"format"});
  const Value& f = p.get(0);
  if (!f.is_string()) type_error("strftime() argument 1 must be str, not " + type_name(f));
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[512];
  const std::string format = f.s.str();
  size_t n = std::strftime(buf, sizeof(buf), format.c_str(), &tm);
  if (n == 0 && !format.empty()) unsupported("strftime format '" + format + "'");
  return Value::string(std::string(buf, n));
}

Value range_global(CallArgs& a) {
  if (!a.kwargs.empty()) type_error("range() takes no keyword arguments");
  if (a.args.empty() || a.args.size() > 3) type_error("range expected 1 to 3 arguments");
  int64_t start = 0, stop = 0, step = 1;
  if (a.args.size() == 1) {
    stop = to_index(a.args[0], "range");
  } else {
    start = to_index(a.args[0], "range");
    stop = to_index(a.args[1], "range");
    if (a.args.size() == 3) step = to_index(a.args[2], "range");
  }
  if (step == 0) type_error("range() arg 3 must not be zero");
  std::vector<Value> items;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    // The sandbox caps ranges at MAX_RANGE items.
    if (items.size() >= 100000)
      type_error("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    items.push_back(Value::integer(i));
  }
  // A range object: indexable like a tuple but printed as "range(a, b)", which we refuse.
  return Value::list(std::move(items), SeqKind::kRange);
}

// namespace(...) and dict(...) take an optional dict, then keyword arguments. The dict's keys are
// distinct, so they are copied without looking each up among those before it (n^2/2 comparisons
// for a large dict); only the keyword arguments are looked up.
const Dict* constructor_dict(CallArgs& a) {
  if (a.args.size() > 1) type_error("expected at most 1 positional argument");
  if (a.args.empty()) return nullptr;
  if (a.args[0].kind != Kind::kDict) unsupported("namespace()/dict() from a non-dict argument");
  return a.args[0].dict.get();
}

Value namespace_global(CallArgs& a) {
  const Dict* src = constructor_dict(a);
  Value v;
  v.kind = Kind::kNamespace;
  v.ns = std::make_shared<Namespace>();
  if (src) {
    charge_items(src->items.size());
    v.ns->attrs.reserve(src->items.size());
    for (const auto& [k, e] : src->items) {
      if (!k.is_string()) unsupported("namespace() with non-string keys");
      v.ns->attrs.emplace_back(k.s.str(), e);
    }
  }
  for (auto& [k, e] : a.kwargs) v.ns->set(k, e);
  return v;
}

Value dict_global(CallArgs& a) {
  const Dict* src = constructor_dict(a);
  Value v;
  v.kind = Kind::kDict;
  if (src) {
    charge_items(2 * src->items.size());  // as dict.copy
    v.dict = std::make_shared<Dict>(*src);
  } else {
    v.dict = std::make_shared<Dict>();
  }
  for (auto& [k, e] : a.kwargs) v.dict->set(Value::string(k), e);
  return v;
}

// Jinja2's default globals and transformers' additions. A null entry is one this interpreter
// refuses.
const std::unordered_map<std::string_view, Value (*)(CallArgs&)> kGlobals = {
    {"cycler", nullptr},
    {"dict", dict_global},
    {"joiner", nullptr},
    {"lipsum", nullptr},
    {"namespace", namespace_global},
    {"raise_exception", raise_exception_global},
    {"range", range_global},
    {"strftime_now", strftime_now_global},
};

}  // namespace

bool lookup_global(const std::string& name, Value& out) {
  auto body = find_entry(kGlobals, name);
  if (!body) return false;
  if (!*body) unsupported("global '" + name + "'");
  out = method(name, *body);
  return true;
}

// ---- tests ----

namespace {

// `x is name` takes no argument beyond x; `x is name(arg)` takes exactly one, called `param`.
struct Test {
  bool (*unary)(const Value& x) = nullptr;
  bool (*binary)(const Value& x, const Value& arg) = nullptr;
  const char* param = nullptr;
};

Test unary(bool (*fn)(const Value& x)) {
  Test t;
  t.unary = fn;
  return t;
}

Test binary(const char* param, bool (*fn)(const Value& x, const Value& arg)) {
  Test t;
  t.binary = fn;
  t.param = param;
  return t;
}

bool mod_equals(const Value& v, const Value& d, int64_t expect) {
  Value r = binary_op("%", v, d);
  return py_equal(r, Value::integer(expect));
}

bool is_equal(const Value& a, const Value& b) {
  return py_equal(a, b);
}
bool is_not_equal(const Value& a, const Value& b) {
  return !py_equal(a, b);
}
bool is_less(const Value& a, const Value& b) {
  return py_less(a, b);
}
bool is_greater(const Value& a, const Value& b) {
  return py_less(b, a);
}
bool is_less_or_equal(const Value& a, const Value& b) {
  return py_less(a, b) || py_equal(a, b);
}
bool is_greater_or_equal(const Value& a, const Value& b) {
  return py_less(b, a) || py_equal(a, b);
}

bool is_sameas(const Value& v, const Value& other) {
  auto singleton = [](const Value& x) {
    return x.is_none() || x.kind == Kind::kBool || x.is_undefined();
  };
  if (singleton(v) || singleton(other)) {
    if (v.is_undefined() || other.is_undefined()) {
      unsupported("'sameas' with an undefined value");
    }
    return v.kind == other.kind && (v.is_none() || v.b == other.b);
  }
  unsupported("'sameas' test on non-singleton values (object identity)");
}

const std::unordered_map<std::string_view, Test> kTests = {
    {"defined", unary([](const Value& v) { return !v.is_undefined(); })},
    {"undefined", unary([](const Value& v) { return v.is_undefined(); })},
    {"none", unary([](const Value& v) { return v.is_none(); })},
    {"boolean", unary([](const Value& v) { return v.kind == Kind::kBool; })},
    {"true", unary([](const Value& v) { return v.kind == Kind::kBool && v.b; })},
    {"false", unary([](const Value& v) { return v.kind == Kind::kBool && !v.b; })},
    {"integer",
     unary([](const Value& v) { return v.kind == Kind::kInt || v.kind == Kind::kBigInt; })},
    {"float", unary([](const Value& v) { return v.kind == Kind::kFloat; })},
    {"number", unary([](const Value& v) { return v.is_number(); })},
    {"string", unary([](const Value& v) { return v.is_string(); })},
    {"mapping", unary(is_mapping)},
    // Python's callable(): jinja2's Undefined and loop objects have __call__ too.
    {"callable", unary([](const Value& v) {
       return v.kind == Kind::kCallable || v.is_undefined() || v.kind == Kind::kLoop;
     })},
    {"escaped", unary([](const Value& v) { return v.is_string() && v.markup; })},
    {"iterable", unary([](const Value& v) {
       return v.is_undefined() || v.is_string() || v.kind == Kind::kSequence ||
              v.kind == Kind::kDict;
     })},
    // len() and __getitem__ both exist (Undefined has both).
    {"sequence", unary([](const Value& v) {
       return v.is_undefined() || v.is_string() || v.kind == Kind::kDict ||
              v.is_seq(SeqKind::kList) || v.is_seq(SeqKind::kTuple) || v.is_seq(SeqKind::kRange);
     })},
    {"lower", unary([](const Value& v) { return py_islower(py_str(v)); })},
    {"upper", unary([](const Value& v) { return py_isupper(py_str(v)); })},
    {"odd", unary([](const Value& v) { return mod_equals(v, Value::integer(2), 1); })},
    {"even", unary([](const Value& v) { return mod_equals(v, Value::integer(2), 0); })},
    {"divisibleby",
     binary("num", [](const Value& v, const Value& n) { return mod_equals(v, n, 0); })},
    {"in", binary("seq", [](const Value& v, const Value& seq) { return contains(seq, v); })},
    {"sameas", binary("other", is_sameas)},
    {"==", binary("other", is_equal)},
    {"eq", binary("other", is_equal)},
    {"equalto", binary("other", is_equal)},
    {"!=", binary("other", is_not_equal)},
    {"ne", binary("other", is_not_equal)},
    {"<", binary("other", is_less)},
    {"lt", binary("other", is_less)},
    {"lessthan", binary("other", is_less)},
    {">", binary("other", is_greater)},
    {"gt", binary("other", is_greater)},
    {"greaterthan", binary("other", is_greater)},
    {"<=", binary("other", is_less_or_equal)},
    {"le", binary("other", is_less_or_equal)},
    {">=", binary("other", is_greater_or_equal)},
    {"ge", binary("other", is_greater_or_equal)},
};

}  // namespace

bool is_supported_test(std::string_view name) {
  return kTests.count(name) > 0;
}

bool apply_test(const std::string& name, const Value& v, CallArgs& args) {
  const Test* test = find_entry(kTests, name);
  if (!test) unsupported("test '" + name + "'");
  if (test->unary) {
    Params p(name, args, {});
    return test->unary(v);
  }
  Params p(name, args, {test->param});
  return test->binary(v, p.get(0));
}

// ---- filters ----

namespace {

Value sort_values(std::vector<Value> items, bool reverse,
                  const std::function<Value(const Value&)>& key) {
  std::vector<std::pair<Value, Value>> keyed;
  keyed.reserve(items.size());
  for (auto& item : items) keyed.emplace_back(key(item), std::move(item));
  auto less = [](const auto& x, const auto& y) { return py_less_in_sort(x.first, y.first); };
  if (reverse) {
    std::stable_sort(keyed.begin(), keyed.end(),
                     [&](const auto& x, const auto& y) { return less(y, x); });
  } else {
    std::stable_sort(keyed.begin(), keyed.end(), less);
  }
  std::vector<Value> out;
  out.reserve(keyed.size());
  for (auto& kv : keyed) out.push_back(std::move(kv.second));
  return Value::list(std::move(out));
}

std::vector<Value> select_items(const Value& input, CallArgs& args, bool select, bool by_attr,
                                const std::string& fn) {
  std::vector<Value> out;
  if (!truthy(input)) return out;
  size_t off = 0;
  std::vector<Value> attr_parts;
  if (by_attr) {
    if (args.args.empty()) type_error("Missing parameter for attribute name");
    attr_parts = attribute_parts(args.args[0]);
    off = 1;
  }
  std::string test;
  CallArgs test_args;
  bool has_test = args.args.size() > off;
  if (has_test) {
    const Value& t = args.args[off];
    if (!t.is_string()) type_error(fn + ": test name must be a string");
    test = t.s.str();
    if (!is_supported_test(test)) unsupported("test '" + test + "'");
    test_args.args.assign(args.args.begin() + static_cast<std::ptrdiff_t>(off + 1),
                          args.args.end());
    test_args.kwargs = args.kwargs;
  }
  for (const auto& item : py_iterate(input)) {
    Value x = by_attr ? get_path(item, attr_parts, nullptr) : item;
    bool r;
    if (has_test) {
      CallArgs a = test_args;
      r = apply_test(test, x, a);
    } else {
      r = truthy(x);
    }
    if (r == select) out.push_back(item);
  }
  return out;
}

Value json_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonOptions o;
  o.ensure_ascii = truthy(p.get_or(0, Value::boolean(false)));
  Value indent = p.get_or(1, Value::none());
  if (!indent.is_none()) {
    o.has_indent = true;
    if (indent.is_string()) {
      if (indent.s.size() > static_cast<size_t>(kMaxIndentWidth))
        unsupported("tojson indent beyond " + std::to_string(kMaxIndentWidth) + " characters");
      o.indent = indent.s.str();
    } else if (indent.is_int_like()) {
      if (indent.i > kMaxIndentWidth)
        unsupported("tojson indent beyond " + std::to_string(kMaxIndentWidth) + " characters");
      o.indent = std::string(static_cast<size_t>(std::max<int64_t>(0, indent.i)), ' ');
    } else {
      type_error("indent must be an int or str");
    }
    o.item_separator = ",";
  }
  Value seps = p.get_or(2, Value::none());
  if (!seps.is_none()) {
    if (seps.kind != Kind::kSequence || seps.seq->items.size() != 2 ||
        !seps.seq->items[0].is_string() || !seps.seq->items[1].is_string()) {
      type_error("separators must be a pair of strings");
    }
    o.item_separator = seps.seq->items[0].s.str();
    o.key_separator = seps.seq->items[1].s.str();
  }
  o.sort_keys = truthy(p.get_or(3, Value::boolean(false)));
  return Value::string(py_json_dumps(input, o));
}

Value round_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"precision", "method"});
  int64_t precision = to_index(p.get_or(0, Value::integer(0)), "precision");
  Value method_v = p.get_or(1, Value::string("common"));
  std::string m = method_v.is_string() ? method_v.s.str() : "";
  if (m != "common" && m != "ceil" && m != "floor")
    type_error("method must be common, ceil or floor");
  check_defined(input);
  if (!input.is_number())
    type_error("type " + type_name(input) + " doesn't define __round__ method");
  if (m == "common") {
    if (input.is_int_like() || input.kind == Kind::kBigInt) {
      if (precision < 0) unsupported("round() of an integer to negative precision");
      return input.kind == Kind::kBigInt ? input : Value::integer(input.i);
    }
    if (precision < 0) unsupported("round() to negative precision");
    if (!std::isfinite(input.f) || precision > 300) return input;
    // printf rounds the exact binary value half-to-even, as Python's round() does.
    char buf[512];
    std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(precision), input.f);
    return Value::floating(std::strtod(buf, nullptr));
  }
  double scale = std::pow(10.0, static_cast<double>(precision));
  if (precision < 0 || precision > 22) unsupported("round(method='" + m + "') with this precision");
  double x = input.as_double() * scale;
  if (!std::isfinite(x)) type_error("cannot convert float infinity to integer");
  double r = m == "ceil" ? std::ceil(x) : std::floor(x);
  return Value::floating(r / scale);
}

Value length_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {});
  return Value::integer(py_len(input));
}

Value default_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"default_value", "boolean"});
  bool boolean = truthy(p.get_or(1, Value::boolean(false)));
  if (input.is_undefined() || (boolean && !truthy(input))) return p.get_or(0, Value::string(""));
  return input;
}

Value string_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {});
  if (input.is_string()) return input;
  return Value::string(py_str(input));
}

Value safe_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {});
  if (input.is_string() && input.markup) return input;
  return Value::string(py_str(input), true);
}

Value escape_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {});
  return escape_value(input);
}

Value forceescape_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {});
  return Value::string(html_escape(py_str(input)), true);
}

Value trim_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"chars"});
  Value chars = p.get_or(0, Value::none());
  if (input.markup && !chars.is_none()) unsupported("trim(chars) on a Markup string");
  return Value::string(py_strip(py_str(input), chars, true, true), input.markup);
}

// upper / lower / capitalize / title
template <std::string (*Convert)(std::string_view)>
Value case_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {});
  return Value::string(Convert(py_str(input)));
}

Value replace_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"old", "new", "count"});
  Value count = p.get_or(2, Value::none());
  return Value::string(py_replace(py_str(input), py_str(p.get(0)), py_str(p.get(1)),
                                  count.is_none() ? -1 : to_index(count, "count"),
                                  "replace result"));
}

Value list_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {});
  return Value::list(py_iterate(input));
}

Value first_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {});
  if (input.is_seq(SeqKind::kGenerator)) {
    auto& sq = *input.seq;
    if (sq.consumed < sq.items.size()) return sq.items[sq.consumed++];
    return Value::undefined("No first item, sequence was empty.");
  }
  if (input.kind == Kind::kSequence && input.seq->kind != SeqKind::kDictView) {
    // Without copying the list: `messages|first` inside a loop over the messages stays linear.
    if (input.seq->items.empty()) return Value::undefined("No first item, sequence was empty.");
    return input.seq->items.front();
  }
  auto items = py_iterate(input);
  if (items.empty()) return Value::undefined("No first item, sequence was empty.");
  return items.front();
}

Value last_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {});
  if (input.is_seq(SeqKind::kGenerator)) {
    type_error("'" + type_name(input) + "' object is not reversible");
  }
  if (input.kind == Kind::kSequence) {  // dict views are reversible since Python 3.8
    if (input.seq->items.empty()) return Value::undefined("No last item, sequence was empty.");
    return input.seq->items.back();
  }
  auto items = py_iterate(input);
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return items.back();
}

Value join_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"d", "attribute"});
  std::string sep = py_str(p.get_or(0, Value::string("")));
  Value attribute = p.get_or(1, Value::none());
  auto parts = attribute_parts(attribute);
  std::string out;
  bool first = true;
  for (const auto& item : py_iterate(input)) {
    if (!first) out += sep;
    first = false;
    const Value& part = attribute.is_none() ? item : get_path(item, parts, nullptr);
    if (part.is_string()) {
      out += part.s;
    } else {
      out += py_str(part);
    }
    check_string_size(out.size(), "join result");
  }
  return Value::string(std::move(out));
}

Value items_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {});
  if (input.is_undefined()) return generator({});
  if (!is_mapping(input)) type_error("Can only get item pairs from a mapping.");
  std::vector<Value> out;
  for (const auto& [k, v] : input.dict->items) out.push_back(make_tuple2(k, v));
  return generator(std::move(out));
}

Value dictsort_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"case_sensitive", "by", "reverse"});
  bool case_sensitive = truthy(p.get_or(0, Value::boolean(false)));
  Value by = p.get_or(1, Value::string("key"));
  size_t pos;
  if (by.is_string() && by.s.view() == "key") {
    pos = 0;
  } else if (by.is_string() && by.s.view() == "value") {
    pos = 1;
  } else {
    type_error("You can only sort by either \"key\" or \"value\"");
  }
  check_defined(input);
  if (!is_mapping(input)) type_error("'" + type_name(input) + "' object has no attribute 'items'");
  std::vector<Value> items;
  for (const auto& [k, v] : input.dict->items) items.push_back(make_tuple2(k, v));
  return sort_values(std::move(items), truthy(p.get_or(2, Value::boolean(false))),
                     [&](const Value& item) {
                       const Value& x = item.seq->items[pos];
                       return case_sensitive ? x : ignore_case(x);
                     });
}

Value sort_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"reverse", "case_sensitive", "attribute"});
  bool case_sensitive = truthy(p.get_or(1, Value::boolean(false)));
  auto parts = multi_attribute_parts(p.get_or(2, Value::none()));
  return sort_values(py_iterate(input), truthy(p.get_or(0, Value::boolean(false))),
                     [&](const Value& item) {
                       std::vector<Value> key;
                       for (const auto& path : parts) {
                         Value x = get_path(item, path, nullptr);
                         key.push_back(case_sensitive ? x : ignore_case(x));
                       }
                       return Value::list(std::move(key));
                     });
}

// A hash under which the values py_equal calls equal hash alike, as Python requires of a set's
// members: a number by its exact value (1, 1.0 and True meet, and 2**63 with 2.0**63), a string by
// its text, a tuple by its items. Walking a value is charged as comparing it is.
size_t py_hash(const Value& v) {
  auto mix = [](size_t h, size_t x) {
    return h ^ (x + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
  };
  switch (v.kind) {
    case Kind::kBool:
    case Kind::kInt:
      return std::hash<int64_t>{}(v.i);
    case Kind::kBigInt:
      return std::hash<uint64_t>{}(v.big());
    case Kind::kFloat: {
      constexpr double kTwo63 = 9223372036854775808.0;
      const double d = v.f;
      if (std::trunc(d) == d && d >= -kTwo63 && d < kTwo63)
        return std::hash<int64_t>{}(static_cast<int64_t>(d));
      if (std::trunc(d) == d && d >= 0 && d < 2 * kTwo63)
        return std::hash<uint64_t>{}(static_cast<uint64_t>(d));
      return std::hash<double>{}(d);
    }
    case Kind::kString:
      charge_bytes(static_cast<int64_t>(v.s.size()));  // scanned
      return std::hash<std::string_view>{}(v.s.view());
    case Kind::kSequence: {
      if (v.seq->kind != SeqKind::kList && v.seq->kind != SeqKind::kTuple)
        return std::hash<const void*>{}(v.seq.get());  // equal only to itself
      size_t h = static_cast<size_t>(v.seq->kind);
      for (const auto& item : v.seq->items) {
        charge_steps(1);
        h = mix(h, py_hash(item));
      }
      return h;
    }
    case Kind::kDict:
      return mix(static_cast<size_t>(Kind::kDict), v.dict->items.size());
    case Kind::kNamespace:
      return std::hash<const void*>{}(v.ns.get());
    case Kind::kCallable:
      return std::hash<const void*>{}(v.fn.get());
    case Kind::kLoop:
      return std::hash<const void*>{}(v.loop.get());
    default:  // Undefined, None
      return static_cast<size_t>(v.kind);
  }
}

Value unique_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"case_sensitive", "attribute"});
  bool case_sensitive = truthy(p.get_or(0, Value::boolean(false)));
  auto parts = attribute_parts(p.get_or(1, Value::none()));
  // Jinja2 keeps a set of the keys seen; comparing each key with every one before it was n^2/2
  // comparisons. Keys with the same hash are told apart by py_equal, a step each.
  std::vector<Value> seen, out;
  std::unordered_multimap<size_t, size_t> seen_by_hash;
  for (const auto& item : py_iterate(input)) {
    Value key = get_path(item, parts, nullptr);
    if (!case_sensitive) key = ignore_case(key);
    check_hashable(key);
    const size_t hash = py_hash(key);
    bool dup = false;
    for (auto [it, end] = seen_by_hash.equal_range(hash); it != end && !dup; ++it) {
      charge_steps(1);
      dup = py_equal(seen[it->second], key);
    }
    if (!dup) {
      seen_by_hash.emplace(hash, seen.size());
      seen.push_back(std::move(key));
      out.push_back(item);
    }
  }
  return generator(std::move(out));
}

// min / max
Value extreme_filter(const std::string& name, const Value& input, CallArgs& args, bool max) {
  Params p(name, args, {"case_sensitive", "attribute"});
  bool case_sensitive = truthy(p.get_or(0, Value::boolean(false)));
  auto parts = attribute_parts(p.get_or(1, Value::none()));
  auto items = py_iterate(input);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  auto key = [&](const Value& item) {
    Value k = get_path(item, parts, nullptr);
    return case_sensitive ? k : ignore_case(k);
  };
  size_t best = 0;
  Value best_key = key(items[0]);
  for (size_t k = 1; k < items.size(); ++k) {
    Value kk = key(items[k]);
    if (max ? py_less(best_key, kk) : py_less(kk, best_key)) {
      best = k;
      best_key = kk;
    }
  }
  return items[best];
}

Value min_filter(const std::string& name, const Value& input, CallArgs& args) {
  return extreme_filter(name, input, args, false);
}

Value max_filter(const std::string& name, const Value& input, CallArgs& args) {
  return extreme_filter(name, input, args, true);
}

Value sum_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"attribute", "start"});
  Value attribute = p.get_or(0, Value::none());
  auto parts = attribute_parts(attribute);
  Value total = p.get_or(1, Value::integer(0));
  for (const auto& item : py_iterate(input)) {
    Value x = attribute.is_none() ? item : get_path(item, parts, nullptr);
    if (x.is_string() || total.is_string())
      type_error("unsupported operand type(s) for +: sum of str");
    total = sum_values(total, x);
  }
  return total;
}

Value reverse_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {});
  if (input.is_string()) {
    std::u32string u = to_u32(input.s);
    std::reverse(u.begin(), u.end());
    return Value::string(from_u32(u));
  }
  auto items = py_iterate(input);
  std::reverse(items.begin(), items.end());
  // reversed() gives an iterator for sequences and dicts; generators become a list.
  bool reversible = !input.is_seq(SeqKind::kGenerator);
  return Value::list(std::move(items), reversible ? SeqKind::kGenerator : SeqKind::kList);
}

Value map_filter(const std::string&, const Value& input, CallArgs& args) {
  std::vector<Value> out;
  // Jinja2's do_map reads its arguments and iterates only `if value:`, as select does.
  if (!truthy(input)) return generator(std::move(out));
  if (args.args.empty()) {
    bool has_attribute = false;
    Value attribute, fallback = Value::none();
    for (const auto& [k, v] : args.kwargs) {
      if (k == "attribute") {
        attribute = v;
        has_attribute = true;
      } else if (k == "default") {
        fallback = v;
      } else {
        type_error("Unexpected keyword argument '" + k + "'");
      }
    }
    if (!has_attribute) type_error("map requires a filter argument");
    auto parts = attribute_parts(attribute);
    for (const auto& item : py_iterate(input)) out.push_back(get_path(item, parts, &fallback));
    return generator(std::move(out));
  }
  const Value& f = args.args[0];
  if (!f.is_string()) type_error("map: filter name must be a string");
  const std::string filter = f.s.str();
  if (!is_supported_filter(filter)) unsupported("filter '" + filter + "'");
  CallArgs rest;
  rest.args.assign(args.args.begin() + 1, args.args.end());
  rest.kwargs = args.kwargs;
  for (const auto& item : py_iterate(input)) {
    CallArgs a = rest;
    out.push_back(apply_filter(filter, item, a));
  }
  return generator(std::move(out));
}

// select / reject (by the item) and selectattr / rejectattr (by an attribute of it)
template <bool kSelect, bool kByAttr>
Value select_filter(const std::string& name, const Value& input, CallArgs& args) {
  return generator(select_items(input, args, kSelect, kByAttr, name));
}

Value attr_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"name"});
  const Value& n = p.get(0);
  if (!n.is_string()) type_error("attribute name must be a string");
  check_defined(input);
  Value out;
  const std::string attr = n.s.str();
  if (python_attr(input, attr, out)) return out;
  return undefined_attribute(input, attr);
}

Value int_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"default", "base"});
  Value fallback = p.get_or(0, Value::integer(0));
  Value base = p.get_or(1, Value::integer(10));
  if (!base.is_int_like() || base.i != 10) unsupported("int filter with a base other than 10");
  check_defined(input);
  if (input.is_int_like()) return Value::integer(input.i);
  if (input.kind == Kind::kBigInt) return input;
  if (input.kind == Kind::kFloat) {
    if (std::isnan(input.f)) return fallback;
    return float_to_int(std::trunc(input.f));
  }
  if (input.is_string()) {
    if (auto v = parse_py_int(input.s)) return Value::integer(*v);
    if (auto d = parse_py_float(input.s)) {
      if (std::isnan(*d)) return fallback;
      return float_to_int(std::trunc(*d));
    }
    return fallback;
  }
  return fallback;
}

Value float_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"default"});
  Value fallback = p.get_or(0, Value::floating(0.0));
  check_defined(input);
  if (input.is_number()) return Value::floating(input.as_double());
  if (input.is_string()) {
    if (auto d = parse_py_float(input.s)) return Value::floating(*d);
  }
  return fallback;
}

Value abs_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {});
  check_defined(input);
  if (input.is_int_like()) {
    if (input.i == INT64_MIN) unsupported("integer arithmetic beyond 64 bits");
    return Value::integer(input.i < 0 ? -input.i : input.i);
  }
  if (input.kind == Kind::kBigInt) return input;
  if (input.kind == Kind::kFloat) return Value::floating(std::fabs(input.f));
  type_error("bad operand type for abs(): '" + type_name(input) + "'");
}

// Calls line(text) for each line of Python's (s + "\n").splitlines(), as Jinja2's indent splits:
// the breaks are those of is_line_break, "\r\n" is one, and the "\n" appended ends the last line
// (or joins a final "\r"). s is valid UTF-8, so a break's bytes are never part of another
// character.
template <typename F>
void for_each_indent_line(std::string_view s, F&& line) {
  auto byte = [&](size_t i) { return i < s.size() ? static_cast<unsigned char>(s[i]) : 0; };
  size_t start = 0, i = 0;
  while (i < s.size()) {
    const unsigned char c = byte(i);
    size_t len = 0;
    if (c == '\n' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E) {
      len = 1;
    } else if (c == '\r') {
      len = byte(i + 1) == '\n' ? 2 : 1;
    } else if (c == 0xC2 && byte(i + 1) == 0x85) {  // U+0085
      len = 2;
    } else if (c == 0xE2 && byte(i + 1) == 0x80 && (byte(i + 2) == 0xA8 || byte(i + 2) == 0xA9)) {
      len = 3;  // U+2028, U+2029
    }
    if (len == 0) {
      ++i;
      continue;
    }
    line(s.substr(start, i - start));
    i += len;
    start = i;
  }
  if (s.empty() || s.back() != '\r') line(s.substr(start));
}

Value indent_filter(const std::string& name, const Value& input, CallArgs& args) {
  Params p(name, args, {"width", "first", "blank"});
  Value width = p.get_or(0, Value::integer(4));
  bool first = truthy(p.get_or(1, Value::boolean(false)));
  bool blank = truthy(p.get_or(2, Value::boolean(false)));
  std::string indention;
  // indent(10**18) would ask for an exabyte of spaces.
  if (width.is_string()) {
    if (width.s.size() > static_cast<size_t>(kMaxIndentWidth))
      unsupported("indent width beyond " + std::to_string(kMaxIndentWidth) + " characters");
    indention = width.s.str();
  } else if (width.is_int_like()) {
    if (width.i > kMaxIndentWidth)
      unsupported("indent width beyond " + std::to_string(kMaxIndentWidth) + " characters");
    indention = std::string(static_cast<size_t>(std::max<int64_t>(0, width.i)), ' ');
  } else {
    type_error("can't multiply sequence by non-int of type '" + type_name(width) + "'");
  }
  check_defined(input);
  if (!input.is_string())
    type_error("unsupported operand type(s) for +=: '" + type_name(input) + "' and 'str'");
  const std::string_view text = input.s.view();
  if (!utf8::is_valid(text)) type_error("invalid UTF-8 in a template string");
  charge_bytes(static_cast<int64_t>(text.size()));  // scanned for the lines
  // Many short lines each gain the whole indentation: the size is known from the count of lines,
  // before anything is built (a string per line held ~95 times the input).
  size_t lines = 0;
  for_each_indent_line(text, [&](std::string_view) { ++lines; });
  check_string_size(text.size() + lines * (indention.size() + 1), "indent result");
  // Jinja2 joins the lines with '\n' + indention, or '\n' alone before an empty line unless
  // `blank`, and puts indention before the first line if `first`.
  std::string rv;
  rv.reserve(text.size() + lines * (indention.size() + 1));
  if (first) rv += indention;
  size_t k = 0;
  for_each_indent_line(text, [&](std::string_view line) {
    if (k++) {
      rv += '\n';
      if (blank || !line.empty()) rv += indention;
    }
    rv += line;
  });
  return Value::string(std::move(rv));
}

struct Filter {
  Value (*fn)(const std::string& name, const Value& input, CallArgs& args);
  // Whether it takes a Markup string; on one, the others are refused rather than given
  // markupsafe's semantics.
  bool takes_markup = false;
};
constexpr bool kTakesMarkup = true;

const std::unordered_map<std::string_view, Filter> kFilters = {
    {"abs", {abs_filter}},
    {"attr", {attr_filter}},
    {"capitalize", {case_filter<py_capitalize>}},
    {"count", {length_filter, kTakesMarkup}},
    {"d", {default_filter, kTakesMarkup}},
    {"default", {default_filter, kTakesMarkup}},
    {"dictsort", {dictsort_filter}},
    {"e", {escape_filter, kTakesMarkup}},
    {"escape", {escape_filter, kTakesMarkup}},
    {"first", {first_filter, kTakesMarkup}},
    {"float", {float_filter}},
    {"forceescape", {forceescape_filter, kTakesMarkup}},
    {"indent", {indent_filter}},
    {"int", {int_filter}},
    {"items", {items_filter}},
    {"join", {join_filter}},
    {"last", {last_filter, kTakesMarkup}},
    {"length", {length_filter, kTakesMarkup}},
    {"list", {list_filter, kTakesMarkup}},
    {"lower", {case_filter<py_lower>}},
    {"map", {map_filter}},
    {"max", {max_filter}},
    {"min", {min_filter}},
    {"reject", {select_filter<false, false>}},
    {"rejectattr", {select_filter<false, true>}},
    {"replace", {replace_filter}},
    {"reverse", {reverse_filter}},
    {"round", {round_filter}},
    {"safe", {safe_filter, kTakesMarkup}},
    {"select", {select_filter<true, false>}},
    {"selectattr", {select_filter<true, true>}},
    {"sort", {sort_filter}},
    {"string", {string_filter, kTakesMarkup}},
    {"sum", {sum_filter}},
    {"title", {case_filter<jinja_title>}},
    {"tojson", {json_filter, kTakesMarkup}},
    {"trim", {trim_filter}},
    {"unique", {unique_filter}},
    {"upper", {case_filter<py_upper>}},
};

}  // namespace

bool is_supported_filter(std::string_view name) {
  return kFilters.count(name) > 0;
}

Value apply_filter(const std::string& name, const Value& input, CallArgs& args) {
  const Filter* filter = find_entry(kFilters, name);
  if (input.is_string() && input.markup && !(filter && filter->takes_markup)) {
    unsupported("filter '" + name + "' on a Markup string");
  }
  if (!filter) unsupported("filter '" + name + "'");
  return filter->fn(name, input, args);
}

}  // namespace tandem::text::jinja
