#pragma once
// GPT-2's byte-level alphabet: every byte maps to one printable code point, so that byte-level
// BPE vocabularies can be stored as text. Tandem converts vocabularies back to raw bytes at load
// time and runs BPE on bytes; this table is the bridge.
#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace tandem::text::byte_level {

// The code point that stands for byte b.
char32_t char_for_byte(unsigned char b);

// Converts a token written in the alphabet back to raw bytes; nullopt if a character of the
// token is not in the alphabet (e.g. added tokens such as "<|im_start|>").
std::optional<std::string> to_bytes(std::string_view token);

// Writes raw bytes in the alphabet (the inverse of to_bytes).
std::string to_alphabet(std::string_view bytes);

}  // namespace tandem::text::byte_level
