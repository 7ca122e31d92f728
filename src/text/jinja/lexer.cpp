#include "text/jinja/lexer.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <string_view>

#include "text/jinja/value.h"
#include "util/error.h"
#include "util/utf8.h"

namespace tandem::text::jinja {

std::string line_message(int line, const std::string& message) {
  return "chat template line " + std::to_string(line) + ": " + message;
}

namespace {

[[noreturn]] void fail(int line, const std::string& message) {
  throw Error(line_message(line, message));
}

// Whether s holds nothing but characters Python's str.isspace() accepts.
bool only_white_space(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t len = utf8::valid_sequence_length(s, i);
    if (len == 0 || !py_isspace(utf8::decode_at(s, i, len))) return false;
    i += len;
  }
  return true;
}

// Jinja2 splits the source on \r\n, \r and \n, joins with \n and drops one trailing newline
// (keep_trailing_newline=False).
std::string normalize_newlines(const std::string& in) {
  std::string out;
  out.reserve(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] == '\r') {
      out += '\n';
      if (i + 1 < in.size() && in[i + 1] == '\n') ++i;
    } else {
      out += in[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

// Length of the (Python, Unicode-aware) whitespace character at s[i], or 0.
size_t space_at(std::string_view s, size_t i) {
  if (i >= s.size()) return 0;
  size_t len = utf8::valid_sequence_length(s, i);
  if (len == 0) return 0;
  return py_isspace(utf8::decode_at(s, i, len)) ? len : 0;
}

size_t skip_spaces(std::string_view s, size_t i) {
  while (size_t len = space_at(s, i)) i += len;
  return i;
}

// str.rstrip() with Unicode whitespace.
std::string rstrip_py(const std::string& s) {
  std::u32string u = to_u32(s);
  size_t end = u.size();
  while (end > 0 && py_isspace(u[end - 1])) --end;
  return from_u32(std::u32string_view(u).substr(0, end));
}

int count_newlines(std::string_view s) {
  return static_cast<int>(std::count(s.begin(), s.end(), '\n'));
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Jinja2 unescapes string literals with
// value.encode("ascii", "backslashreplace").decode("unicode-escape"); replicate both steps so
// odd inputs (a backslash before a non-ASCII character, unknown escapes) come out the same.
std::string unescape_string(const std::string& raw, int line) {
  std::string ascii;
  for (char32_t c : to_u32(raw)) {
    char buf[16];
    if (c < 0x80) {
      ascii += static_cast<char>(c);
      continue;
    }
    if (c <= 0xFF) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
    } else if (c <= 0xFFFF) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
    } else {
      std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(c));
    }
    ascii += buf;
  }
  std::string out;
  auto put = [&](uint32_t cp) {
    if (cp > 0x10FFFF) fail(line, "illegal Unicode character in string literal");
    if (cp >= 0xD800 && cp <= 0xDFFF) {
      throw Error(line_message(line, "unsupported: surrogate escape in string literal"));
    }
    utf8::append(out, static_cast<char32_t>(cp));
  };
  for (size_t i = 0; i < ascii.size(); ++i) {
    char c = ascii[i];
    if (c != '\\') {
      out += c;
      continue;
    }
    if (i + 1 >= ascii.size()) fail(line, "\\ at end of string literal");
    char e = ascii[++i];
    switch (e) {
      case '\n':
        break;
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x':
      case 'u':
      case 'U': {
        int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        uint32_t cp = 0;
        for (int k = 0; k < digits; ++k) {
          int h = i + 1 < ascii.size() ? hex_value(ascii[i + 1]) : -1;
          if (h < 0) fail(line, std::string("truncated \\") + e + " escape in string literal");
          cp = cp * 16 + static_cast<uint32_t>(h);
          ++i;
        }
        put(cp);
        break;
      }
      case 'N':
        throw Error(line_message(line, "unsupported: \\N{...} escape in string literal"));
      default:
        if (e >= '0' && e <= '7') {
          uint32_t cp = static_cast<uint32_t>(e - '0');
          for (int k = 0;
               k < 2 && i + 1 < ascii.size() && ascii[i + 1] >= '0' && ascii[i + 1] <= '7'; ++k) {
            cp = cp * 8 + static_cast<uint32_t>(ascii[++i] - '0');
          }
          put(cp);
        } else {
          // Python keeps unknown escapes verbatim.
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

// Matches `(\d+_)*\d+` at i; returns the end or npos.
size_t match_digits(std::string_view s, size_t i) {
  if (i >= s.size() || !is_digit(s[i])) return std::string_view::npos;
  while (i < s.size() && is_digit(s[i])) {
    ++i;
    if (i + 1 < s.size() && s[i] == '_' && is_digit(s[i + 1])) ++i;
  }
  return i;
}

// jinja2 float_re: (?<!\.)(\d+_)*\d+((\.(\d+_)*\d+)?e[+\-]?(\d+_)*\d+|\.(\d+_)*\d+)
size_t match_float(std::string_view s, size_t i) {
  if (i > 0 && s[i - 1] == '.') return std::string_view::npos;
  size_t p = match_digits(s, i);
  if (p == std::string_view::npos) return p;
  size_t frac_end = std::string_view::npos;
  if (p < s.size() && s[p] == '.') frac_end = match_digits(s, p + 1);
  size_t q = frac_end != std::string_view::npos ? frac_end : p;
  if (q < s.size() && (s[q] == 'e' || s[q] == 'E')) {
    size_t r = q + 1;
    if (r < s.size() && (s[r] == '+' || s[r] == '-')) ++r;
    size_t exp_end = match_digits(s, r);
    if (exp_end != std::string_view::npos) return exp_end;
  }
  return frac_end;
}

// jinja2 integer_re (decimal forms only; 0b/0o/0x are rejected by the caller).
size_t match_integer(std::string_view s, size_t i) {
  if (i >= s.size() || !is_digit(s[i])) return std::string_view::npos;
  if (s[i] == '0') {
    ++i;
    while (i < s.size() && (s[i] == '0' || (s[i] == '_' && i + 1 < s.size() && s[i + 1] == '0'))) {
      ++i;
    }
    return i;
  }
  return match_digits(s, i);
}

constexpr std::array<std::string_view, 26> kOperators = {
    "//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[",
    "]",  "(",  ")",  "{",  "}",  ">",  "<", "=", ".", ":", "|", ",", ";"};

class Lexer {
 public:
  explicit Lexer(const std::string& source) : src_(normalize_newlines(source)) {}

  std::vector<Token> run() {
    std::string_view s = src_;
    while (pos_ < s.size()) {
      size_t t = find_tag(pos_);
      if (t == std::string_view::npos) {
        emit(TokenType::kData, src_.substr(pos_), line_);
        break;
      }
      char kind = s[t + 1];
      size_t after = t + 2;
      char sign = 0;
      if (after < s.size() && (s[after] == '-' || s[after] == '+')) sign = s[after++];
      std::string text = src_.substr(pos_, t - pos_);
      int text_line = line_;
      line_ += count_newlines(text);
      if (sign == '-') {
        text = rstrip_py(text);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: drop the white space between the line start and a block or comment
        // tag; Jinja2 tests it with re's \s (str.isspace: U+3000, \v, \x1c ... too).
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if ((l_pos > 0 || line_starting_) && only_white_space(std::string_view(text).substr(l_pos)))
          text.resize(l_pos);
      }
      if (!text.empty()) emit(TokenType::kData, text, text_line);
      line_starting_ = false;
      pos_ = after;
      if (kind == '#') {
        lex_comment();
      } else if (kind == '%') {
        check_raw();
        emit(TokenType::kBlockBegin, "", line_);
        lex_tag(true);
      } else {
        emit(TokenType::kVariableBegin, "", line_);
        lex_tag(false);
      }
    }
    emit(TokenType::kEnd, "", line_);
    return std::move(tokens_);
  }

 private:
  size_t find_tag(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i) {
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return std::string_view::npos;
  }

  void emit(TokenType type, std::string value, int line) {
    tokens_.push_back(Token{type, std::move(value), line});
  }

  // Advances over s[pos_, end) keeping the line count and the "last match ended a line" flag
  // that lstrip_blocks consults.
  void consume_to(size_t end) {
    line_ += count_newlines(std::string_view(src_).substr(pos_, end - pos_));
    if (end > pos_) line_starting_ = src_[end - 1] == '\n';
    pos_ = end;
  }

  void check_raw() {
    std::string_view s = src_;
    size_t p = skip_spaces(s, pos_);
    if (s.substr(p, 3) == "raw") {
      size_t q = p + 3;
      if (space_at(s, q) || s.substr(q, 2) == "%}" || s.substr(q, 3) == "-%}") {
        fail(line_, "unsupported tag 'raw'");
      }
    }
  }

  void lex_comment() {
    std::string_view s = src_;
    for (size_t p = pos_; p < s.size(); ++p) {
      if (s.substr(p, 3) == "+#}") {
        consume_to(p + 3);
        return;
      }
      if (s.substr(p, 3) == "-#}") {
        consume_to(skip_spaces(s, p + 3));
        return;
      }
      if (s.substr(p, 2) == "#}") {
        size_t end = p + 2;
        if (end < s.size() && s[end] == '\n') ++end;  // trim_blocks
        consume_to(end);
        return;
      }
    }
    fail(line_, "missing end of comment tag");
  }

  bool try_end(bool block) {
    std::string_view s = src_;
    if (block) {
      if (s.substr(pos_, 3) == "+%}") {
        consume_to(pos_ + 3);
      } else if (s.substr(pos_, 3) == "-%}") {
        consume_to(skip_spaces(s, pos_ + 3));
      } else if (s.substr(pos_, 2) == "%}") {
        size_t end = pos_ + 2;
        if (end < s.size() && s[end] == '\n') ++end;  // trim_blocks
        consume_to(end);
      } else {
        return false;
      }
      emit(TokenType::kBlockEnd, "", line_);
      return true;
    }
    if (s.substr(pos_, 3) == "-}}") {
      consume_to(skip_spaces(s, pos_ + 3));
    } else if (s.substr(pos_, 2) == "}}") {
      consume_to(pos_ + 2);
    } else {
      return false;
    }
    emit(TokenType::kVariableEnd, "", line_);
    return true;
  }

  void lex_tag(bool block) {
    std::string_view s = src_;
    std::string balance;
    while (true) {
      if (pos_ >= s.size()) fail(line_, "unexpected end of template inside a tag");
      if (balance.empty() && try_end(block)) return;
      if (size_t sp = skip_spaces(s, pos_); sp != pos_) {
        consume_to(sp);
        continue;
      }
      char c = s[pos_];
      int line = line_;
      if (size_t end = match_float(s, pos_); end != std::string_view::npos) {
        emit(TokenType::kFloat, std::string(s.substr(pos_, end - pos_)), line);
        consume_to(end);
        continue;
      }
      if (is_digit(c)) {
        if (c == '0' && pos_ + 1 < s.size() && std::strchr("bBoOxX", s[pos_ + 1]) != nullptr &&
            s[pos_ + 1] != '\0') {
          fail(line, "unsupported: binary, octal and hexadecimal integer literals");
        }
        size_t end = match_integer(s, pos_);
        emit(TokenType::kInteger, std::string(s.substr(pos_, end - pos_)), line);
        consume_to(end);
        continue;
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t end = pos_;
        while (end < s.size() &&
               (std::isalnum(static_cast<unsigned char>(s[end])) || s[end] == '_')) {
          ++end;
        }
        emit(TokenType::kName, std::string(s.substr(pos_, end - pos_)), line);
        consume_to(end);
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t p = pos_ + 1;
        while (p < s.size() && s[p] != c) p += s[p] == '\\' ? 2 : 1;
        if (p >= s.size()) fail(line, "unterminated string literal");
        std::string raw(s.substr(pos_ + 1, p - pos_ - 1));
        emit(TokenType::kString, unescape_string(raw, line), line);
        consume_to(p + 1);
        continue;
      }
      bool matched = false;
      for (std::string_view op : kOperators) {
        if (s.substr(pos_, op.size()) != op) continue;
        if (op == "(" || op == "[" || op == "{") {
          balance += op[0];
        } else if (op == ")" || op == "]" || op == "}") {
          char open = op == ")" ? '(' : op == "]" ? '[' : '{';
          if (balance.empty() || balance.back() != open) {
            fail(line, "unexpected '" + std::string(op) + "'");
          }
          balance.pop_back();
        }
        emit(TokenType::kOperator, std::string(op), line);
        consume_to(pos_ + op.size());
        matched = true;
        break;
      }
      if (!matched) {
        size_t len = utf8::valid_sequence_length(s, pos_);
        fail(line, "unexpected char '" + std::string(s.substr(pos_, len ? len : 1)) + "'");
      }
    }
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(const std::string& source) {
  return Lexer(source).run();
}

}  // namespace tandem::text::jinja
