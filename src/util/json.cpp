#include "util/json.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "util/error.h"
#include "util/utf8.h"

namespace tandem {
namespace {

using nlohmann::json;

// One pass over the text, with an explicit stack of open containers (no recursion), building the
// same document nlohmann::json::parse builds: integers as unsigned when non-negative, signed when
// negative, floating point when they have a fraction or exponent or do not fit 64 bits; the last of
// duplicate object keys wins; strings must be valid UTF-8 without raw control characters, and
// \u escapes must pair their surrogates. Token-id prompts of many thousand integers are the
// common large body, so integers take a path without strtoull.
class Reader {
 public:
  Reader(std::string_view text, size_t max_depth, DuplicateKeys duplicates)
      : begin_(text.data()),
        p_(text.data()),
        end_(text.data() + text.size()),
        max_depth_(max_depth),
        duplicates_(duplicates) {}

  json document() {
    if (end_ - p_ >= 3 && p_[0] == '\xEF' && p_[1] == '\xBB' && p_[2] == '\xBF') p_ += 3;
    skip_space();
    if (p_ == end_) fail("empty input (expected a JSON value)");
    json root;
    json* slot = &root;  // where the next value goes
    for (;;) {
      skip_space();
      if (p_ == end_) fail("unexpected end (expected a value)");
      const char c = *p_;
      bool value_done = true;
      if (c == '{' || c == '[') {
        ++p_;
        if (stack_.size() >= max_depth_)
          throw Error("JSON nesting is deeper than " + std::to_string(max_depth_) + " levels");
        const bool object = c == '{';
        *slot = object ? json::object() : json::array();
        stack_.push_back({slot, object});
        skip_space();
        if (p_ != end_ && *p_ == (object ? '}' : ']')) {
          ++p_;
          stack_.pop_back();
        } else if (!number_into_array(stack_.back())) {
          slot = next_slot(stack_.back());
          value_done = false;
        }
      } else {
        scalar(*slot);
      }
      if (!value_done) continue;
      // A value is complete: close what ends here, then find where the next one goes.
      for (;;) {
        if (stack_.empty()) {
          skip_space();
          if (p_ != end_) fail("unexpected content after the document");
          return root;
        }
        skip_space();
        const Open& open = stack_.back();
        const char close = open.object ? '}' : ']';
        if (p_ == end_) fail(std::string("unexpected end (expected ',' or '") + close + "')");
        if (*p_ == ',') {
          ++p_;
          if (number_into_array(open)) continue;
          slot = next_slot(open);
          break;
        }
        if (*p_ != close) fail(std::string("expected ',' or '") + close + "'");
        ++p_;
        stack_.pop_back();
      }
    }
  }

 private:
  struct Open {
    json* node;
    bool object;
  };

  [[noreturn]] void fail(const std::string& what) const {
    throw Error("malformed JSON at byte " + std::to_string(p_ - begin_) + ": " + what);
  }

  void skip_space() {
    while (p_ != end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) ++p_;
  }

  // The slot of the next element of `open`: an array's new last element, or an object's member
  // after its key and colon.
  json* next_slot(const Open& open) {
    if (!open.object) {
      auto& array = open.node->get_ref<json::array_t&>();
      array.emplace_back();
      return &array.back();
    }
    skip_space();
    if (p_ == end_ || *p_ != '"') fail("expected a member name in double quotes");
    std::string key = string();
    skip_space();
    if (p_ == end_ || *p_ != ':') fail("expected ':' after a member name");
    ++p_;
    if (duplicates_ == DuplicateKeys::kLastWins) return &(*open.node)[std::move(key)];
    const auto [at, added] = open.node->get_ref<json::object_t&>().try_emplace(std::move(key));
    if (!added) throw Error("key '" + utf8::clip(at->first) + "' appears twice in one object");
    return &at->second;
  }

  // The long arrays are of numbers: one goes straight to the end of an open array.
  bool number_into_array(const Open& open) {
    if (open.object) return false;
    skip_space();
    if (p_ == end_ || (*p_ != '-' && (*p_ < '0' || *p_ > '9'))) return false;
    open.node->get_ref<json::array_t&>().push_back(number());
    return true;
  }

  void scalar(json& out) {
    const char c = *p_;
    if (c == '"') {
      out = string();
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      out = number();
    } else if (literal("true")) {
      out = true;
    } else if (literal("false")) {
      out = false;
    } else if (literal("null")) {
      out = nullptr;
    } else {
      fail("expected a value");
    }
  }

  bool literal(std::string_view word) {
    if (static_cast<size_t>(end_ - p_) < word.size() || std::string_view(p_, word.size()) != word)
      return false;
    p_ += word.size();
    return true;
  }

  json number() {
    const char* start = p_;
    const bool negative = *p_ == '-';
    if (negative) ++p_;
    auto digits = [&] {
      const char* from = p_;
      while (p_ != end_ && *p_ >= '0' && *p_ <= '9') ++p_;
      return p_ - from;
    };
    if (p_ == end_ || *p_ < '0' || *p_ > '9') fail("expected a digit");
    const char* int_start = p_;
    if (*p_ == '0') {
      ++p_;
    } else {
      digits();
    }
    const char* int_end = p_;
    bool integer = true;
    if (p_ != end_ && *p_ == '.') {
      ++p_;
      if (digits() == 0) fail("expected a digit after the decimal point");
      integer = false;
    }
    if (p_ != end_ && (*p_ == 'e' || *p_ == 'E')) {
      ++p_;
      if (p_ != end_ && (*p_ == '+' || *p_ == '-')) ++p_;
      if (digits() == 0) fail("expected a digit in the exponent");
      integer = false;
    }
    if (integer) {
      uint64_t magnitude = 0;
      bool fits = true;
      for (const char* d = int_start; d != int_end && fits; ++d) {
        const auto digit = static_cast<uint64_t>(*d - '0');
        fits = magnitude <= (UINT64_MAX - digit) / 10;
        magnitude = magnitude * 10 + digit;
      }
      if (fits && !negative) return json(magnitude);
      if (fits && magnitude <= uint64_t{1} << 63)
        return json(magnitude == uint64_t{1} << 63 ? INT64_MIN : -static_cast<int64_t>(magnitude));
    }
    double value = 0;
    const auto [end, error] = std::from_chars(start, p_, value);
    if (error == std::errc::result_out_of_range) {
      // Underflow reads as (nearly) zero, as strtod has it; overflow is refused below.
      value = std::strtod(std::string(start, p_).c_str(), nullptr);
    } else if (error != std::errc() || end != p_) {
      fail("not a number");
    }
    if (!std::isfinite(value)) fail("number overflow: " + std::string(start, p_));
    return json(value);
  }

  // A string from its opening quote; p_ ends after the closing one.
  std::string string() {
    ++p_;
    std::string s;
    for (;;) {
      const char* run = p_;
      while (p_ != end_ && static_cast<unsigned char>(*p_) >= 0x20 && *p_ != '"' && *p_ != '\\' &&
             static_cast<unsigned char>(*p_) < 0x80)
        ++p_;
      s.append(run, p_);
      if (p_ == end_) fail("unterminated string");
      const auto c = static_cast<unsigned char>(*p_);
      if (c == '"') {
        ++p_;
        return s;
      }
      if (c == '\\') {
        escape(s);
      } else if (c < 0x20) {
        fail("control character in a string (escape it)");
      } else {
        multibyte(s);
      }
    }
  }

  void escape(std::string& s) {
    ++p_;
    if (p_ == end_) fail("unterminated escape");
    const char c = *p_++;
    switch (c) {
      case '"':
        s += '"';
        return;
      case '\\':
        s += '\\';
        return;
      case '/':
        s += '/';
        return;
      case 'b':
        s += '\b';
        return;
      case 'f':
        s += '\f';
        return;
      case 'n':
        s += '\n';
        return;
      case 'r':
        s += '\r';
        return;
      case 't':
        s += '\t';
        return;
      case 'u':
        break;
      default:
        --p_;
        fail("invalid escape");
    }
    uint32_t code = hex4();
    if (code >= 0xDC00 && code <= 0xDFFF) fail("a low surrogate \\u escape without a high one");
    if (code >= 0xD800 && code <= 0xDBFF) {
      if (end_ - p_ < 2 || p_[0] != '\\' || p_[1] != 'u')
        fail("a high surrogate \\u escape must be followed by a low one");
      p_ += 2;
      const uint32_t low = hex4();
      if (low < 0xDC00 || low > 0xDFFF)
        fail("a high surrogate \\u escape must be followed by a low one");
      code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
    }
    utf8::append(s, code);
  }

  uint32_t hex4() {
    if (end_ - p_ < 4) fail("a \\u escape needs four hex digits");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i, ++p_) {
      const char c = *p_;
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= uint32_t(c - '0');
      else if (c >= 'a' && c <= 'f')
        v |= uint32_t(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        v |= uint32_t(c - 'A' + 10);
      else
        fail("a \\u escape needs four hex digits");
    }
    return v;
  }

  // One multi-byte UTF-8 sequence (RFC 3629: no overlong forms, no surrogates, up to U+10FFFF).
  void multibyte(std::string& s) {
    const auto at = static_cast<size_t>(p_ - begin_);
    const size_t len = utf8::valid_sequence_length(std::string_view(begin_, end_ - begin_), at);
    if (len == 0) fail("invalid UTF-8 in a string");
    s.append(p_, len);
    p_ += len;
  }

  const char* begin_;
  const char* p_;
  const char* end_;
  size_t max_depth_;
  DuplicateKeys duplicates_;
  std::vector<Open> stack_;
};

}  // namespace

nlohmann::json parse_untrusted_json(std::string_view text, size_t max_depth,
                                    DuplicateKeys duplicates) {
  return Reader(text, max_depth, duplicates).document();
}

void release_json(json& doc) {
  // Depth first with an explicit stack: a container is emptied once its children hold no
  // containers any more (they were emptied before it).
  std::vector<std::pair<json*, bool>> stack{{&doc, false}};  // (node, children pushed)
  while (!stack.empty()) {
    auto& [node, expanded] = stack.back();
    if (!node->is_structured()) {
      stack.pop_back();
      continue;
    }
    if (!expanded) {
      expanded = true;
      json* parent = node;
      for (auto& child : *parent)
        if (child.is_structured()) stack.push_back({&child, false});
      continue;
    }
    if (node->is_array())
      node->get_ref<json::array_t&>().clear();
    else
      node->get_ref<json::object_t&>().clear();
    stack.pop_back();
  }
  doc = nullptr;
}

nlohmann::json parse_json_document(std::string_view text, const std::string& source) {
  try {
    return parse_untrusted_json(text);
  } catch (const Error& e) {
    throw Error(source + ": " + e.what());
  }
}

std::string json_excerpt(const json& value, size_t max_bytes) {
  std::string out;
  // A key or string longer than the limit is cut before it is escaped, so its cost is bounded
  // too; a sequence split by the cut is replaced rather than refused.
  auto quoted = [&](const std::string& s) {
    out += json(s.substr(0, max_bytes + 1)).dump(-1, ' ', false, json::error_handler_t::replace);
  };
  struct Open {
    const json* node;
    json::const_iterator next;
  };
  std::vector<Open> open;
  const json* pending = &value;
  // Every step writes at least one byte, so the loop ends soon after the limit.
  while (out.size() <= max_bytes) {
    if (pending) {
      if (pending->is_structured()) {
        out += pending->is_object() ? '{' : '[';
        open.push_back({pending, pending->cbegin()});
      } else if (pending->is_string()) {
        quoted(pending->get_ref<const std::string&>());
      } else {
        out += pending->dump();
      }
      pending = nullptr;
      continue;
    }
    if (open.empty()) return out;
    Open& o = open.back();
    if (o.next == o.node->cend()) {
      out += o.node->is_object() ? '}' : ']';
      open.pop_back();
      continue;
    }
    if (o.next != o.node->cbegin()) out += ',';
    if (o.node->is_object()) {
      quoted(o.next.key());
      out += ':';
    }
    pending = &*o.next;
    ++o.next;
  }
  size_t cut = max_bytes;
  while (cut > 0 && (static_cast<unsigned char>(out[cut]) & 0xC0) == 0x80) --cut;
  out.resize(cut);
  return out + "...";
}

}  // namespace tandem
