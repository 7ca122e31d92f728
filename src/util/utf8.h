#pragma once
// UTF-8 helpers shared by the tokenizer, the detokenizer and the chat-template interpreter.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tandem::utf8 {

// Length of the well-formed UTF-8 sequence starting at s[i], or 0 if it is not well formed
// (overlong, surrogate, out of range, truncated or a stray continuation byte).
size_t valid_sequence_length(std::string_view s, size_t i);

// Decodes the well-formed sequence at s[i] (caller checked valid_sequence_length > 0).
char32_t decode_at(std::string_view s, size_t i, size_t len);

void append(std::string& out, char32_t cp);

// Replaces ill-formed input with U+FFFD per maximal subpart, exactly like Rust's
// String::from_utf8_lossy (which Hugging Face tokenizers use when decoding).
std::string to_valid_lossy(std::string_view s);

// Number of bytes at the end of s that form an incomplete (but so far valid) sequence prefix,
// i.e. bytes a streaming decoder must hold back until more input arrives.
size_t incomplete_tail_length(std::string_view s);

}  // namespace tandem::utf8
