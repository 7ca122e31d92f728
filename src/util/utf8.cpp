#include "util/utf8.h"

#include <algorithm>
#include <cstdio>

namespace tandem::utf8 {
namespace {

// Bounds for the second byte of a sequence, per Unicode Table 3-7 (well-formed sequences).
bool second_byte_ok(unsigned char lead, unsigned char b) {
  if (lead == 0xE0) return b >= 0xA0 && b <= 0xBF;
  if (lead == 0xED) return b >= 0x80 && b <= 0x9F;
  if (lead == 0xF0) return b >= 0x90 && b <= 0xBF;
  if (lead == 0xF4) return b >= 0x80 && b <= 0x8F;
  return b >= 0x80 && b <= 0xBF;
}

size_t expected_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

bool is_continuation(unsigned char b) {
  return (b & 0xC0) == 0x80;
}

// How many bytes starting at i are a valid prefix of a sequence (the "maximal subpart").
size_t valid_prefix(std::string_view s, size_t i, size_t need) {
  auto lead = static_cast<unsigned char>(s[i]);
  size_t k = 1;
  while (k < need && i + k < s.size()) {
    auto b = static_cast<unsigned char>(s[i + k]);
    bool ok = k == 1 ? second_byte_ok(lead, b) : is_continuation(b);
    if (!ok) break;
    ++k;
  }
  return k;
}

}  // namespace

size_t valid_sequence_length(std::string_view s, size_t i) {
  auto lead = static_cast<unsigned char>(s[i]);
  size_t need = expected_length(lead);
  if (need <= 1) return need;
  return valid_prefix(s, i, need) == need ? need : 0;
}

char32_t decode_at(std::string_view s, size_t i, size_t len) {
  auto b = [&](size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[i + k])); };
  switch (len) {
    case 1:
      return b(0);
    case 2:
      return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3:
      return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default:
      return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string to_valid_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    size_t len = valid_sequence_length(s, i);
    if (len > 0) {
      out.append(s.substr(i, len));
      i += len;
      continue;
    }
    size_t need = expected_length(static_cast<unsigned char>(s[i]));
    i += need == 0 ? 1 : valid_prefix(s, i, need);
    out += "\xEF\xBF\xBD";
  }
  return out;
}

size_t code_points(std::string_view s) {
  size_t n = 0, i = 0;
  while (i < s.size()) {
    if (size_t len = valid_sequence_length(s, i); len > 0) {
      i += len;
    } else {
      size_t need = expected_length(static_cast<unsigned char>(s[i]));
      i += need == 0 ? 1 : valid_prefix(s, i, need);
    }
    ++n;
  }
  return n;
}

size_t incomplete_tail_length(std::string_view s) {
  // A sequence is at most 4 bytes, so only the last 3 bytes can start an incomplete one.
  size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    size_t i = n - back;
    auto lead = static_cast<unsigned char>(s[i]);
    if (is_continuation(lead)) continue;
    size_t need = expected_length(lead);
    if (need > back && valid_prefix(s, i, need) == back) return back;
    return 0;
  }
  return 0;
}

std::string clip(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return std::string(s);
  size_t kept = 0;
  while (kept < max_bytes) {
    // Ill-formed bytes go one at a time (the JSON writer replaces them later).
    const size_t len = std::max<size_t>(valid_sequence_length(s, kept), 1);
    if (kept + len > max_bytes) break;
    kept += len;
  }
  return std::string(s.substr(0, kept)) + "\u2026(+" + std::to_string(s.size() - kept) + " bytes)";
}

bool has_control_bytes(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return c < 0x20 || c == 0x7f;
  });
}

std::string quote_escaped(std::string_view s, size_t max_bytes) {
  const size_t shown = max_bytes > 0 ? std::min(s.size(), max_bytes) : s.size();
  std::string out = "'";
  for (size_t i = 0; i < shown; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", c);
      out += escaped;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += "'";
  if (shown < s.size()) out += " (" + std::to_string(s.size()) + " bytes)";
  return out;
}

bool is_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t length = valid_sequence_length(s, i);
    if (length == 0) return false;
    i += length;
  }
  return true;
}

}  // namespace tandem::utf8
