#include "text/byte_level.h"

#include "util/utf8.h"

namespace tandem::text::byte_level {
namespace {

// Printable Latin-1 bytes stand for themselves; the other 68 bytes are assigned code points
// 256, 257, ... in byte order (the scheme of GPT-2's bytes_to_unicode).
struct Tables {
  std::array<char32_t, 256> to_char{};
  std::array<int, 324> to_byte{};  // indexed by code point < 324, -1 when not in the alphabet
  Tables() {
    to_byte.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(next++);
      to_char[b] = c;
      to_byte[c] = b;
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

char32_t char_for_byte(unsigned char b) {
  return tables().to_char[b];
}

std::optional<std::string> to_bytes(std::string_view token) {
  const auto& t = tables();
  std::string out;
  out.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    size_t len = utf8::valid_sequence_length(token, i);
    if (len == 0) return std::nullopt;
    char32_t c = utf8::decode_at(token, i, len);
    if (c >= t.to_byte.size() || t.to_byte[c] < 0) return std::nullopt;
    out += static_cast<char>(t.to_byte[c]);
    i += len;
  }
  return out;
}

std::string to_alphabet(std::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes) utf8::append(out, char_for_byte(b));
  return out;
}

}  // namespace tandem::text::byte_level
