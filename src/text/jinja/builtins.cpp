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
#include <set>

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

// Using an Undefined in arithmetic, calls, attribute access etc. raises UndefinedError.
void check_defined(const Value& v) {
  if (v.is_undefined()) throw RuntimeError{v.s};
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

int64_t to_index(const Value& v, const std::string& what) {
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

std::string py_lower(const std::string& s) {
  std::u32string u = to_u32(s), out;
  for (size_t i = 0; i < u.size(); ++i) append_lower(out, u, i);
  return from_u32(out);
}

std::string py_upper(const std::string& s) {
  std::u32string out;
  for (char32_t c : to_u32(s)) append_upper(out, c);
  return from_u32(out);
}

std::string py_capitalize(const std::string& s) {
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

std::string py_title(const std::string& s) {
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
std::string jinja_title(const std::string& s) {
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

bool py_islower(const std::string& s) {
  bool cased = false;
  for (char32_t c : to_u32(s)) {
    auto cp = static_cast<UChar32>(c);
    if (u_hasBinaryProperty(cp, UCHAR_UPPERCASE) || u_istitle(cp)) return false;
    if (u_hasBinaryProperty(cp, UCHAR_LOWERCASE)) cased = true;
  }
  return cased;
}

bool py_isupper(const std::string& s) {
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

std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  return from_u32(strip_chars(to_u32(s), chars, left, right));
}

Value str_list(const std::vector<std::u32string>& parts) {
  std::vector<Value> items;
  items.reserve(parts.size());
  for (const auto& p : parts) items.push_back(Value::string(from_u32(p)));
  return Value::list(std::move(items));
}

// str.split / str.rsplit.
Value py_split(const std::string& str, const Value& sep, int64_t maxsplit, bool from_right) {
  std::u32string s = to_u32(str);
  std::vector<std::u32string> parts;
  if (sep.is_none()) {
    // Runs of whitespace separate; leading/trailing whitespace yields no empty parts.
    if (!from_right) {
      size_t i = 0;
      while (true) {
        while (i < s.size() && py_isspace(s[i])) ++i;
        if (i >= s.size()) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          parts.push_back(s.substr(i));  // the remainder keeps its trailing whitespace
          break;
        }
        size_t j = i;
        while (j < s.size() && !py_isspace(s[j])) ++j;
        parts.push_back(s.substr(i, j - i));
        i = j;
      }
    } else {
      size_t i = s.size();
      while (true) {
        while (i > 0 && py_isspace(s[i - 1])) --i;
        if (i == 0) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          parts.push_back(s.substr(0, i));  // the remainder keeps its leading whitespace
          break;
        }
        size_t j = i;
        while (j > 0 && !py_isspace(s[j - 1])) --j;
        parts.push_back(s.substr(j, i - j));
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
      parts.push_back(s.substr(i, j - i));
      i = j + d.size();
    }
    parts.push_back(s.substr(i));
  } else {
    size_t end = s.size();
    while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
      if (end < d.size()) break;
      size_t j = s.rfind(d, end - d.size());
      if (j == std::u32string::npos) break;
      parts.push_back(s.substr(j + d.size(), end - j - d.size()));
      end = j;
    }
    parts.push_back(s.substr(0, end));
    std::reverse(parts.begin(), parts.end());
  }
  return str_list(parts);
}

std::string py_replace(const std::string& str, const std::string& old_s, const std::string& new_s,
                       int64_t count) {
  std::u32string s = to_u32(str), o = to_u32(old_s), n = to_u32(new_s), out;
  if (o.empty()) {
    // Python inserts the replacement before every character and at the end.
    int64_t done = 0;
    for (size_t i = 0; i <= s.size(); ++i) {
      if (count < 0 || done < count) {
        out += n;
        ++done;
      }
      if (i < s.size()) out += s[i];
    }
    return from_u32(out);
  }
  size_t i = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t j = s.find(o, i);
    if (j == std::u32string::npos) break;
    out += s.substr(i, j - i);
    out += n;
    i = j + o.size();
    ++done;
  }
  out += s.substr(i);
  return from_u32(out);
}

// Python's str.splitlines() line boundaries.
bool is_line_break(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}

std::vector<std::u32string> py_splitlines(const std::u32string& s, bool keepends) {
  std::vector<std::u32string> lines;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i;
    while (j < s.size() && !is_line_break(s[j])) ++j;
    size_t eol = j;
    if (j < s.size()) {
      eol = (s[j] == '\r' && j + 1 < s.size() && s[j + 1] == '\n') ? j + 2 : j + 1;
    }
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

// Python's float(str): surrounding whitespace, underscores between digits, inf/nan words.
std::optional<double> parse_py_float(const std::string& text) {
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
std::optional<int64_t> parse_py_int(const std::string& text) {
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
  std::string s = attribute.s;
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
    size_t i = 0;
    while (true) {
      size_t j = attribute.s.find(',', i);
      out.push_back(attribute_parts(Value::string(
          attribute.s.substr(i, j == std::string::npos ? std::string::npos : j - i))));
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

std::string py_format(const std::string& fmt, const CallArgs& call) {
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
      std::string field = fmt.substr(i + 1, j - i - 1);
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

std::string percent_format(const std::string& fmt, const Value& rhs) {
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

const std::set<std::string, std::less<>> kStrMethods = {
    "capitalize",   "casefold",    "center",    "count",      "encode",       "endswith",
    "expandtabs",   "find",        "format",    "format_map", "index",        "isalnum",
    "isalpha",      "isascii",     "isdecimal", "isdigit",    "isidentifier", "islower",
    "isnumeric",    "isprintable", "isspace",   "istitle",    "isupper",      "join",
    "ljust",        "lower",       "lstrip",    "maketrans",  "partition",    "removeprefix",
    "removesuffix", "replace",     "rfind",     "rindex",     "rjust",        "rpartition",
    "rsplit",       "rstrip",      "split",     "splitlines", "startswith",   "strip",
    "swapcase",     "title",       "translate", "upper",      "zfill"};
const std::set<std::string, std::less<>> kDictMethods = {
    "clear", "copy",    "fromkeys",   "get",    "items", "keys",
    "pop",   "popitem", "setdefault", "update", "values"};
const std::set<std::string, std::less<>> kListMethods = {"append", "clear",   "copy",   "count",
                                                         "extend", "index",   "insert", "pop",
                                                         "remove", "reverse", "sort"};

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

Value str_method(const Value& self, const std::string& name) {
  if (self.markup) unsupported("method '" + name + "' on a Markup string");
  const std::string s = self.s;
  auto bound = [&](std::function<Value(CallArgs&)> fn) {
    return method("str." + name, std::move(fn));
  };
  if (name == "startswith" || name == "endswith") {
    bool prefix = name == "startswith";
    return bound([s, prefix, name](CallArgs& a) {
      Params p(name, a, {"prefix", "start", "end"});
      return Value::boolean(affix_match(to_u32(s), p.get(0), p.get_or(1, Value::none()),
                                        p.get_or(2, Value::none()), prefix, name));
    });
  }
  if (name == "split" || name == "rsplit") {
    bool right = name == "rsplit";
    return bound([s, right, name](CallArgs& a) {
      Params p(name, a, {"sep", "maxsplit"});
      return py_split(s, p.get_or(0, Value::none()),
                      to_index(p.get_or(1, Value::integer(-1)), "maxsplit"), right);
    });
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    bool left = name != "rstrip", right = name != "lstrip";
    return bound([s, left, right, name](CallArgs& a) {
      Params p(name, a, {"chars"});
      return Value::string(py_strip(s, p.get_or(0, Value::none()), left, right));
    });
  }
  if (name == "replace") {
    return bound([s](CallArgs& a) {
      Params p("replace", a, {"old", "new", "count"});
      const Value& o = p.get(0);
      const Value& n = p.get(1);
      if (!o.is_string() || !n.is_string()) type_error("replace() argument must be str");
      return Value::string(
          py_replace(s, o.s, n.s, to_index(p.get_or(2, Value::integer(-1)), "count")));
    });
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize" ||
      name == "casefold") {
    return bound([s, name](CallArgs& a) {
      Params p(name, a, {});
      if (name == "upper") return Value::string(py_upper(s));
      if (name == "lower") return Value::string(py_lower(s));
      if (name == "title") return Value::string(py_title(s));
      if (name == "capitalize") return Value::string(py_capitalize(s));
      unsupported("str.casefold");
    });
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    return bound([s, name](CallArgs& a) {
      Params p(name, a, {"sub", "start", "end"});
      const Value& subv = p.get(0);
      if (!subv.is_string()) type_error("must be str, not " + type_name(subv));
      std::u32string u = to_u32(s), sub = to_u32(subv.s);
      int64_t b = 0, e = 0;
      adjust_range(p.get_or(1, Value::none()), p.get_or(2, Value::none()),
                   static_cast<int64_t>(u.size()), b, e);
      if (name == "count") {
        if (b > e) return Value::integer(0);
        if (sub.empty()) return Value::integer(e - b + 1);
        int64_t n = 0;
        size_t i = static_cast<size_t>(b);
        while (true) {
          size_t j = u.find(sub, i);
          if (j == std::u32string::npos || j + sub.size() > static_cast<size_t>(e)) break;
          ++n;
          i = j + sub.size();
        }
        return Value::integer(n);
      }
      int64_t found = -1;
      if (b <= e && static_cast<int64_t>(sub.size()) <= e - b) {
        std::u32string window = u.substr(static_cast<size_t>(b), static_cast<size_t>(e - b));
        size_t j = (name == "find" || name == "index") ? window.find(sub) : window.rfind(sub);
        if (j != std::u32string::npos) found = b + static_cast<int64_t>(j);
      }
      if (found < 0 && (name == "index" || name == "rindex")) type_error("substring not found");
      return Value::integer(found);
    });
  }
  if (name == "join") {
    return bound([s](CallArgs& a) {
      Params p("join", a, {"iterable"});
      std::string out;
      size_t k = 0;
      for (const auto& item : py_iterate(p.get(0))) {
        if (!item.is_string()) {
          type_error("sequence item " + std::to_string(k) + ": expected str instance, " +
                     type_name(item) + " found");
        }
        if (k++) out += s;
        out += item.s;
      }
      return Value::string(out);
    });
  }
  if (name == "format") {
    return bound([s](CallArgs& a) { return Value::string(py_format(s, a)); });
  }
  if (name == "splitlines") {
    return bound([s](CallArgs& a) {
      Params p("splitlines", a, {"keepends"});
      return str_list(py_splitlines(to_u32(s), truthy(p.get_or(0, Value::boolean(false)))));
    });
  }
  if (name == "removeprefix" || name == "removesuffix") {
    bool prefix = name == "removeprefix";
    return bound([s, prefix, name](CallArgs& a) {
      Params p(name, a, {"affix"});
      const Value& x = p.get(0);
      if (!x.is_string()) type_error(name + "() argument must be str, not " + type_name(x));
      if (prefix && s.compare(0, x.s.size(), x.s) == 0 && s.size() >= x.s.size()) {
        return Value::string(s.substr(x.s.size()));
      }
      if (!prefix && s.size() >= x.s.size() &&
          s.compare(s.size() - x.s.size(), x.s.size(), x.s) == 0) {
        return Value::string(s.substr(0, s.size() - x.s.size()));
      }
      return Value::string(s);
    });
  }
  if (name == "isspace" || name == "isdigit" || name == "isalpha" || name == "isalnum" ||
      name == "islower" || name == "isupper" || name == "isdecimal" || name == "isnumeric") {
    return bound([s, name](CallArgs& a) {
      Params p(name, a, {});
      if (name == "islower") return Value::boolean(py_islower(s));
      if (name == "isupper") return Value::boolean(py_isupper(s));
      std::u32string u = to_u32(s);
      if (u.empty()) return Value::boolean(false);
      for (char32_t c : u) {
        auto cp = static_cast<UChar32>(c);
        int nt = u_getIntPropertyValue(cp, UCHAR_NUMERIC_TYPE);
        bool decimal = nt == U_NT_DECIMAL;
        bool digit = decimal || nt == U_NT_DIGIT;
        bool numeric = digit || nt == U_NT_NUMERIC;
        bool alpha = u_isalpha(cp);
        bool ok = name == "isspace"     ? py_isspace(c)
                  : name == "isdigit"   ? digit
                  : name == "isdecimal" ? decimal
                  : name == "isnumeric" ? numeric
                  : name == "isalpha"   ? alpha
                                        : (alpha || numeric);
        if (!ok) return Value::boolean(false);
      }
      return Value::boolean(true);
    });
  }
  unsupported("str method '" + name + "'");
}

Value dict_method(const Value& self, const std::string& name) {
  auto d = self.dict;
  if (name == "items" || name == "keys" || name == "values") {
    return method("dict." + name, [d, name](CallArgs& a) {
      Params p(name, a, {});
      std::vector<Value> out;
      for (const auto& [k, v] : d->items) {
        if (name == "items") {
          out.push_back(make_tuple2(k, v));
        } else {
          out.push_back(name == "keys" ? k : v);
        }
      }
      return Value::list(std::move(out), SeqKind::kDictView);
    });
  }
  if (name == "get") {
    return method("dict.get", [d](CallArgs& a) {
      Params p("get", a, {"key", "default"});
      check_hashable(p.get(0));
      const Value* v = d->find(p.get(0));
      return v ? *v : p.get_or(1, Value::none());
    });
  }
  if (name == "copy") {
    return method("dict.copy", [d](CallArgs& a) {
      Params p("copy", a, {});
      Value v;
      v.kind = Kind::kDict;
      v.dict = std::make_shared<Dict>(*d);
      return v;
    });
  }
  unsupported("dict method '" + name + "' (the sandbox forbids mutation)");
}

Value list_method(const Value& self, const std::string& name) {
  auto sq = self.seq;
  if (name == "count") {
    return method("list.count", [sq](CallArgs& a) {
      Params p("count", a, {"value"});
      int64_t n = 0;
      for (const auto& v : sq->items) n += py_equal(v, p.get(0)) ? 1 : 0;
      return Value::integer(n);
    });
  }
  if (name == "index") {
    return method("list.index", [sq](CallArgs& a) {
      Params p("index", a, {"value"});
      for (size_t k = 0; k < sq->items.size(); ++k) {
        if (py_equal(sq->items[k], p.get(0))) return Value::integer(static_cast<int64_t>(k));
      }
      type_error(py_repr(p.get(0)) + " is not in list");
    });
  }
  unsupported("list method '" + name + "' (the sandbox forbids mutation)");
}

// Python-level attribute lookup; returns false when the object has no such attribute.
bool python_attr(const Value& obj, const std::string& name, Value& out) {
  if (name.size() >= 2 && name.compare(0, 2, "__") == 0)
    unsupported("dunder attribute '" + name + "'");
  switch (obj.kind) {
    case Kind::kString:
      if (!kStrMethods.count(name)) return false;
      out = str_method(obj, name);
      return true;
    case Kind::kDict:
      if (!kDictMethods.count(name)) return false;
      out = dict_method(obj, name);
      return true;
    case Kind::kSequence:
      if (obj.seq->kind == SeqKind::kList || obj.seq->kind == SeqKind::kTuple) {
        if (!kListMethods.count(name)) return false;
        if (obj.seq->kind == SeqKind::kTuple && name != "count" && name != "index") return false;
        out = list_method(obj, name);
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
      const auto& l = *obj.loop;
      int64_t len = static_cast<int64_t>(l.items.size());
      int64_t i0 = static_cast<int64_t>(l.index0);
      if (name == "index0")
        out = Value::integer(i0);
      else if (name == "index")
        out = Value::integer(i0 + 1);
      else if (name == "revindex")
        out = Value::integer(len - i0);
      else if (name == "revindex0")
        out = Value::integer(len - i0 - 1);
      else if (name == "first")
        out = Value::boolean(i0 == 0);
      else if (name == "last")
        out = Value::boolean(i0 == len - 1);
      else if (name == "length")
        out = Value::integer(len);
      else if (name == "depth")
        out = Value::integer(l.depth);
      else if (name == "depth0")
        out = Value::integer(l.depth - 1);
      else if (name == "previtem") {
        out = i0 > 0 ? l.items[l.index0 - 1] : Value::undefined("there is no previous item");
      } else if (name == "nextitem") {
        out = i0 + 1 < len ? l.items[l.index0 + 1] : Value::undefined("there is no next item");
      } else if (name == "cycle") {
        size_t idx = l.index0;
        out = method("loop.cycle", [idx](CallArgs& a) {
          if (a.args.empty()) type_error("no items for cycling given");
          return a.args[idx % a.args.size()];
        });
      } else if (name == "changed") {
        unsupported("loop.changed");
      } else {
        return false;
      }
      return true;
    }
    case Kind::kInt:
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
    if (python_attr(obj, key.s, out)) return out;
    return undefined_attribute(obj, key.s);
  }
  return Value::undefined(object_type_repr(obj) + " has no element " + py_repr(key));
}

Value get_slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  check_defined(obj);
  auto idx = [](const Value& v, bool& given) -> int64_t {
    given = !(v.is_none() || v.is_undefined());
    if (!given) return 0;
    if (!v.is_int_like()) type_error("slice indices must be integers or None");
    return v.i;
  };
  bool has_start, has_stop, has_step;
  int64_t b = idx(start, has_start), e = idx(stop, has_stop), st = idx(step, has_step);
  if (!has_step) st = 1;
  if (st == 0) type_error("slice step cannot be zero");
  bool is_str = obj.is_string();
  std::u32string u;
  int64_t len = 0;
  if (is_str) {
    u = to_u32(obj.s);
    len = static_cast<int64_t>(u.size());
  } else if (obj.is_seq(SeqKind::kList) || obj.is_seq(SeqKind::kTuple) ||
             obj.is_seq(SeqKind::kRange)) {
    len = static_cast<int64_t>(obj.seq->items.size());
  } else {
    // TypeError in Python; the sandbox turns it into an Undefined.
    return Value::undefined(object_type_repr(obj) + " has no element slice");
  }
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
  b = adjust(b, has_start, true);
  e = adjust(e, has_stop, false);
  std::vector<int64_t> picks;
  if (st > 0) {
    for (int64_t i = b; i < e; i += st) picks.push_back(i);
  } else {
    for (int64_t i = b; i > e; i += st) picks.push_back(i);
  }
  if (is_str) {
    std::u32string out;
    for (int64_t i : picks) out += u[static_cast<size_t>(i)];
    return Value::string(from_u32(out), obj.markup);
  }
  std::vector<Value> out;
  for (int64_t i : picks) out.push_back(obj.seq->items[static_cast<size_t>(i)]);
  return Value::list(std::move(out), obj.seq->kind);
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
        return Value::string(
            (a.markup ? a.s : html_escape(a.s)) + (b.markup ? b.s : html_escape(b.s)), true);
      }
      return Value::string(a.s + b.s, a.markup);
    }
    if (both_int) {
      int64_t r;
      bool overflow = __builtin_add_overflow(a.i, b.i, &r);
      return checked_int(overflow, r);
    }
    if (both_num) return Value::floating(a.as_double() + b.as_double());
    if (a.kind == Kind::kSequence && b.kind == Kind::kSequence && a.seq->kind == b.seq->kind &&
        (a.seq->kind == SeqKind::kList || a.seq->kind == SeqKind::kTuple)) {
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
      if (count->i > 0 && seq->s.size() * static_cast<uint64_t>(count->i) > (1u << 26)) {
        unsupported("string repetition beyond 64 MiB");
      }
      std::string out;
      for (int64_t k = 0; k < count->i; ++k) out += seq->s;
      return Value::string(out);
    }
    if (seq && (seq->is_seq(SeqKind::kList) || seq->is_seq(SeqKind::kTuple))) {
      std::vector<Value> out;
      for (int64_t k = 0; k < count->i; ++k) {
        out.insert(out.end(), seq->seq->items.begin(), seq->seq->items.end());
        if (out.size() > (1u << 22)) unsupported("list repetition beyond 4M items");
      }
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
    return Value::floating(std::pow(x, y));
  }
  unsupported("operator '" + op + "'");
}

Value negate(const Value& v) {
  check_defined(v);
  if (v.is_int_like()) {
    if (v.i == INT64_MIN) unsupported("integer arithmetic beyond 64 bits");
    return Value::integer(-v.i);
  }
  if (v.kind == Kind::kFloat) return Value::floating(-v.f);
  type_error("bad operand type for unary -: '" + type_name(v) + "'");
}

Value unary_plus(const Value& v) {
  check_defined(v);
  if (v.is_int_like()) return Value::integer(v.i);
  if (v.kind == Kind::kFloat) return v;
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
      return container.s.find(item.s) != std::string::npos;
    case Kind::kDict:
      check_hashable(item);
      return container.dict->find(item) != nullptr;
    case Kind::kSequence: {
      auto& sq = *container.seq;
      size_t from = sq.kind == SeqKind::kGenerator ? sq.consumed : 0;
      for (size_t k = from; k < sq.items.size(); ++k) {
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

bool lookup_global(const std::string& name, Value& out) {
  if (name == "raise_exception") {
    out = method("raise_exception", [](CallArgs& a) -> Value {
      Params p("raise_exception", a, {"message"});
      throw RaisedError{py_str(p.get(0))};
    });
    return true;
  }
  if (name == "strftime_now") {
    out = method("strftime_now", [](CallArgs& a) {
      Params p("strftime_now", a, {"format"});
      const Value& f = p.get(0);
      if (!f.is_string()) type_error("strftime() argument 1 must be str, not " + type_name(f));
      std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[512];
      size_t n = std::strftime(buf, sizeof(buf), f.s.c_str(), &tm);
      if (n == 0 && !f.s.empty()) unsupported("strftime format '" + f.s + "'");
      return Value::string(std::string(buf, n));
    });
    return true;
  }
  if (name == "range") {
    out = method("range", [](CallArgs& a) {
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
    });
    return true;
  }
  if (name == "namespace" || name == "dict") {
    bool ns = name == "namespace";
    out = method(name, [ns](CallArgs& a) {
      if (a.args.size() > 1) type_error("expected at most 1 positional argument");
      std::vector<std::pair<Value, Value>> items;
      if (!a.args.empty()) {
        const Value& src = a.args[0];
        if (src.kind != Kind::kDict) unsupported("namespace()/dict() from a non-dict argument");
        items = src.dict->items;
      }
      for (auto& [k, v] : a.kwargs) items.emplace_back(Value::string(k), v);
      if (ns) {
        Value v;
        v.kind = Kind::kNamespace;
        v.ns = std::make_shared<Namespace>();
        for (auto& [k, e] : items) {
          if (!k.is_string()) unsupported("namespace() with non-string keys");
          v.ns->set(k.s, e);
        }
        return v;
      }
      Value v;
      v.kind = Kind::kDict;
      v.dict = std::make_shared<Dict>();
      for (auto& [k, e] : items) v.dict->set(k, e);
      return v;
    });
    return true;
  }
  if (name == "cycler" || name == "joiner" || name == "lipsum") {
    unsupported("global '" + name + "'");
  }
  return false;
}

// ---- tests ----

namespace {

const std::set<std::string, std::less<>> kTests = {
    "odd",     "even",        "divisibleby", "defined",  "undefined", "none",   "boolean",
    "false",   "true",        "integer",     "float",    "lower",     "upper",  "string",
    "mapping", "number",      "sequence",    "iterable", "callable",  "sameas", "escaped",
    "in",      "==",          "eq",          "equalto",  "!=",        "ne",     ">",
    "gt",      "greaterthan", "ge",          ">=",       "<",         "lt",     "lessthan",
    "<=",      "le"};

const std::set<std::string, std::less<>> kFilters = {
    "abs",    "attr",   "capitalize", "count",      "d",           "default", "dictsort",
    "e",      "escape", "first",      "float",      "forceescape", "indent",  "int",
    "items",  "join",   "last",       "length",     "list",        "lower",   "map",
    "max",    "min",    "reject",     "rejectattr", "replace",     "reverse", "round",
    "safe",   "select", "selectattr", "sort",       "string",      "sum",     "title",
    "tojson", "trim",   "unique",     "upper"};

Value compare_values(const std::string& op, const Value& a, const Value& b) {
  if (op == "==" || op == "eq" || op == "equalto") return Value::boolean(py_equal(a, b));
  if (op == "!=" || op == "ne") return Value::boolean(!py_equal(a, b));
  if (op == "<" || op == "lt" || op == "lessthan") return Value::boolean(py_less(a, b));
  if (op == ">" || op == "gt" || op == "greaterthan") return Value::boolean(py_less(b, a));
  if (op == "<=" || op == "le") return Value::boolean(py_less(a, b) || py_equal(a, b));
  return Value::boolean(py_less(b, a) || py_equal(a, b));
}

bool mod_equals(const Value& v, const Value& d, int64_t expect) {
  Value r = binary_op("%", v, d);
  return py_equal(r, Value::integer(expect));
}

}  // namespace

bool is_supported_test(std::string_view name) {
  return kTests.count(name) > 0;
}
bool is_supported_filter(std::string_view name) {
  return kFilters.count(name) > 0;
}

bool apply_test(const std::string& name, const Value& v, CallArgs& args) {
  auto arg = [&](const char* pname) -> Value {
    Params p(name, args, {pname});
    return p.get(0);
  };
  auto no_args = [&]() { Params p(name, args, {}); };
  if (name == "defined") return no_args(), !v.is_undefined();
  if (name == "undefined") return no_args(), v.is_undefined();
  if (name == "none") return no_args(), v.is_none();
  if (name == "boolean") return no_args(), v.kind == Kind::kBool;
  if (name == "true") return no_args(), v.kind == Kind::kBool && v.b;
  if (name == "false") return no_args(), v.kind == Kind::kBool && !v.b;
  if (name == "integer") return no_args(), v.kind == Kind::kInt;
  if (name == "float") return no_args(), v.kind == Kind::kFloat;
  if (name == "number") return no_args(), v.is_number();
  if (name == "string") return no_args(), v.is_string();
  if (name == "mapping") return no_args(), is_mapping(v);
  if (name == "callable") return no_args(), v.kind == Kind::kCallable;
  if (name == "escaped") return no_args(), v.is_string() && v.markup;
  if (name == "iterable") {
    no_args();
    return v.is_undefined() || v.is_string() || v.kind == Kind::kSequence || v.kind == Kind::kDict;
  }
  if (name == "sequence") {
    no_args();
    // len() and __getitem__ both exist (Undefined has both).
    return v.is_undefined() || v.is_string() || v.kind == Kind::kDict || v.is_seq(SeqKind::kList) ||
           v.is_seq(SeqKind::kTuple) || v.is_seq(SeqKind::kRange);
  }
  if (name == "lower") return no_args(), py_islower(py_str(v));
  if (name == "upper") return no_args(), py_isupper(py_str(v));
  if (name == "odd") return no_args(), mod_equals(v, Value::integer(2), 1);
  if (name == "even") return no_args(), mod_equals(v, Value::integer(2), 0);
  if (name == "divisibleby") return mod_equals(v, arg("num"), 0);
  if (name == "in") return contains(arg("seq"), v);
  if (name == "sameas") {
    const Value& other = arg("other");
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
  return truthy(compare_values(name, v, arg("other")));
}

// ---- filters ----

namespace {

Value sort_values(std::vector<Value> items, bool reverse,
                  const std::function<Value(const Value&)>& key) {
  std::vector<std::pair<Value, Value>> keyed;
  keyed.reserve(items.size());
  for (auto& item : items) keyed.emplace_back(key(item), std::move(item));
  auto less = [](const auto& x, const auto& y) { return py_less(x.first, y.first); };
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
    test = t.s;
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

Value json_filter(const Value& input, CallArgs& args) {
  Params p("tojson", args, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonOptions o;
  o.ensure_ascii = truthy(p.get_or(0, Value::boolean(false)));
  Value indent = p.get_or(1, Value::none());
  if (!indent.is_none()) {
    o.has_indent = true;
    if (indent.is_string()) {
      o.indent = indent.s;
    } else if (indent.is_int_like()) {
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
    o.item_separator = seps.seq->items[0].s;
    o.key_separator = seps.seq->items[1].s;
  }
  o.sort_keys = truthy(p.get_or(3, Value::boolean(false)));
  return Value::string(py_json_dumps(input, o));
}

Value round_filter(const Value& input, CallArgs& args) {
  Params p("round", args, {"precision", "method"});
  int64_t precision = to_index(p.get_or(0, Value::integer(0)), "precision");
  Value method_v = p.get_or(1, Value::string("common"));
  std::string m = method_v.is_string() ? method_v.s : "";
  if (m != "common" && m != "ceil" && m != "floor")
    type_error("method must be common, ceil or floor");
  check_defined(input);
  if (!input.is_number())
    type_error("type " + type_name(input) + " doesn't define __round__ method");
  if (m == "common") {
    if (input.is_int_like()) {
      if (precision < 0) unsupported("round() of an integer to negative precision");
      return Value::integer(input.i);
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

}  // namespace

Value apply_filter(const std::string& name, const Value& input, CallArgs& args) {
  if (input.is_string() && input.markup) {
    static const std::set<std::string, std::less<>> kMarkupSafe = {
        "safe",   "e",       "escape", "forceescape", "string", "length", "count",
        "tojson", "default", "d",      "list",        "first",  "last"};
    if (!kMarkupSafe.count(name)) unsupported("filter '" + name + "' on a Markup string");
  }
  if (name == "length" || name == "count") {
    Params p(name, args, {});
    return Value::integer(py_len(input));
  }
  if (name == "default" || name == "d") {
    Params p(name, args, {"default_value", "boolean"});
    bool boolean = truthy(p.get_or(1, Value::boolean(false)));
    if (input.is_undefined() || (boolean && !truthy(input))) return p.get_or(0, Value::string(""));
    return input;
  }
  if (name == "string") {
    Params p(name, args, {});
    if (input.is_string()) return input;
    return Value::string(py_str(input));
  }
  if (name == "safe") {
    Params p(name, args, {});
    if (input.is_string() && input.markup) return input;
    return Value::string(py_str(input), true);
  }
  if (name == "e" || name == "escape") {
    Params p(name, args, {});
    return escape_value(input);
  }
  if (name == "forceescape") {
    Params p(name, args, {});
    return Value::string(html_escape(py_str(input)), true);
  }
  if (name == "tojson") return json_filter(input, args);
  if (name == "trim") {
    Params p(name, args, {"chars"});
    Value chars = p.get_or(0, Value::none());
    if (input.markup && !chars.is_none()) unsupported("trim(chars) on a Markup string");
    return Value::string(py_strip(py_str(input), chars, true, true), input.markup);
  }
  if (name == "upper" || name == "lower" || name == "capitalize" || name == "title") {
    Params p(name, args, {});
    std::string s = py_str(input);
    if (name == "upper") return Value::string(py_upper(s));
    if (name == "lower") return Value::string(py_lower(s));
    if (name == "capitalize") return Value::string(py_capitalize(s));
    return Value::string(jinja_title(s));
  }
  if (name == "replace") {
    Params p(name, args, {"old", "new", "count"});
    Value count = p.get_or(2, Value::none());
    return Value::string(py_replace(py_str(input), py_str(p.get(0)), py_str(p.get(1)),
                                    count.is_none() ? -1 : to_index(count, "count")));
  }
  if (name == "list") {
    Params p(name, args, {});
    return Value::list(py_iterate(input));
  }
  if (name == "first") {
    Params p(name, args, {});
    if (input.is_seq(SeqKind::kGenerator)) {
      auto& sq = *input.seq;
      if (sq.consumed < sq.items.size()) return sq.items[sq.consumed++];
      return Value::undefined("No first item, sequence was empty.");
    }
    auto items = py_iterate(input);
    if (items.empty()) return Value::undefined("No first item, sequence was empty.");
    return items.front();
  }
  if (name == "last") {
    Params p(name, args, {});
    if (input.is_seq(SeqKind::kGenerator) || input.is_seq(SeqKind::kDictView)) {
      type_error("'" + type_name(input) + "' object is not reversible");
    }
    auto items = py_iterate(input);
    if (items.empty()) return Value::undefined("No last item, sequence was empty.");
    return items.back();
  }
  if (name == "join") {
    Params p(name, args, {"d", "attribute"});
    std::string sep = py_str(p.get_or(0, Value::string("")));
    Value attribute = p.get_or(1, Value::none());
    auto parts = attribute_parts(attribute);
    std::string out;
    bool first = true;
    for (const auto& item : py_iterate(input)) {
      if (!first) out += sep;
      first = false;
      out += py_str(attribute.is_none() ? item : get_path(item, parts, nullptr));
    }
    return Value::string(out);
  }
  if (name == "items") {
    Params p(name, args, {});
    if (input.is_undefined()) return generator({});
    if (!is_mapping(input)) type_error("Can only get item pairs from a mapping.");
    std::vector<Value> out;
    for (const auto& [k, v] : input.dict->items) out.push_back(make_tuple2(k, v));
    return generator(std::move(out));
  }
  if (name == "dictsort") {
    Params p(name, args, {"case_sensitive", "by", "reverse"});
    bool case_sensitive = truthy(p.get_or(0, Value::boolean(false)));
    Value by = p.get_or(1, Value::string("key"));
    size_t pos;
    if (by.is_string() && by.s == "key") {
      pos = 0;
    } else if (by.is_string() && by.s == "value") {
      pos = 1;
    } else {
      type_error("You can only sort by either \"key\" or \"value\"");
    }
    check_defined(input);
    if (!is_mapping(input))
      type_error("'" + type_name(input) + "' object has no attribute 'items'");
    std::vector<Value> items;
    for (const auto& [k, v] : input.dict->items) items.push_back(make_tuple2(k, v));
    return sort_values(std::move(items), truthy(p.get_or(2, Value::boolean(false))),
                       [&](const Value& item) {
                         const Value& x = item.seq->items[pos];
                         return case_sensitive ? x : ignore_case(x);
                       });
  }
  if (name == "sort") {
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
  if (name == "unique") {
    Params p(name, args, {"case_sensitive", "attribute"});
    bool case_sensitive = truthy(p.get_or(0, Value::boolean(false)));
    auto parts = attribute_parts(p.get_or(1, Value::none()));
    std::vector<Value> seen, out;
    for (const auto& item : py_iterate(input)) {
      Value key = get_path(item, parts, nullptr);
      if (!case_sensitive) key = ignore_case(key);
      check_hashable(key);
      bool dup =
          std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return py_equal(s, key); });
      if (!dup) {
        seen.push_back(key);
        out.push_back(item);
      }
    }
    return generator(std::move(out));
  }
  if (name == "min" || name == "max") {
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
      if (name == "max" ? py_less(best_key, kk) : py_less(kk, best_key)) {
        best = k;
        best_key = kk;
      }
    }
    return items[best];
  }
  if (name == "sum") {
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
  if (name == "reverse") {
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
  if (name == "map") {
    std::vector<Value> out;
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
    if (!is_supported_filter(f.s)) unsupported("filter '" + f.s + "'");
    CallArgs rest;
    rest.args.assign(args.args.begin() + 1, args.args.end());
    rest.kwargs = args.kwargs;
    for (const auto& item : py_iterate(input)) {
      CallArgs a = rest;
      out.push_back(apply_filter(f.s, item, a));
    }
    return generator(std::move(out));
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    bool select = name == "select" || name == "selectattr";
    bool by_attr = name == "selectattr" || name == "rejectattr";
    return generator(select_items(input, args, select, by_attr, name));
  }
  if (name == "attr") {
    Params p(name, args, {"name"});
    const Value& n = p.get(0);
    if (!n.is_string()) type_error("attribute name must be a string");
    check_defined(input);
    Value out;
    if (python_attr(input, n.s, out)) return out;
    return undefined_attribute(input, n.s);
  }
  if (name == "int") {
    Params p(name, args, {"default", "base"});
    Value fallback = p.get_or(0, Value::integer(0));
    Value base = p.get_or(1, Value::integer(10));
    if (!base.is_int_like() || base.i != 10) unsupported("int filter with a base other than 10");
    check_defined(input);
    if (input.is_int_like()) return Value::integer(input.i);
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
  if (name == "float") {
    Params p(name, args, {"default"});
    Value fallback = p.get_or(0, Value::floating(0.0));
    check_defined(input);
    if (input.is_number()) return Value::floating(input.as_double());
    if (input.is_string()) {
      if (auto d = parse_py_float(input.s)) return Value::floating(*d);
    }
    return fallback;
  }
  if (name == "round") return round_filter(input, args);
  if (name == "abs") {
    Params p(name, args, {});
    check_defined(input);
    if (input.is_int_like()) {
      if (input.i == INT64_MIN) unsupported("integer arithmetic beyond 64 bits");
      return Value::integer(input.i < 0 ? -input.i : input.i);
    }
    if (input.kind == Kind::kFloat) return Value::floating(std::fabs(input.f));
    type_error("bad operand type for abs(): '" + type_name(input) + "'");
  }
  if (name == "indent") {
    Params p(name, args, {"width", "first", "blank"});
    Value width = p.get_or(0, Value::integer(4));
    bool first = truthy(p.get_or(1, Value::boolean(false)));
    bool blank = truthy(p.get_or(2, Value::boolean(false)));
    std::string indention;
    if (width.is_string()) {
      indention = width.s;
    } else if (width.is_int_like()) {
      indention = std::string(static_cast<size_t>(std::max<int64_t>(0, width.i)), ' ');
    } else {
      type_error("can't multiply sequence by non-int of type '" + type_name(width) + "'");
    }
    check_defined(input);
    if (!input.is_string())
      type_error("unsupported operand type(s) for +=: '" + type_name(input) + "' and 'str'");
    auto lines = py_splitlines(to_u32(input.s + "\n"), false);
    std::string rv;
    if (blank) {
      for (size_t k = 0; k < lines.size(); ++k) {
        if (k) rv += "\n" + indention;
        rv += from_u32(lines[k]);
      }
    } else {
      rv = from_u32(lines[0]);
      if (lines.size() > 1) {
        rv += "\n";
        for (size_t k = 1; k < lines.size(); ++k) {
          if (k > 1) rv += "\n";
          if (!lines[k].empty()) rv += indention;
          rv += from_u32(lines[k]);
        }
      }
    }
    if (first) rv = indention + rv;
    return Value::string(rv);
  }
  unsupported("filter '" + name + "'");
}

}  // namespace tandem::text::jinja
