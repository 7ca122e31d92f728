#pragma once
// UTF-8 helpers shared by the tokenizer, the detokenizer, the chat-template interpreter, and the
// logs and error messages that quote what clients sent.
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

// Whether s is well-formed UTF-8 throughout.
bool is_valid(std::string_view s);

// Replaces ill-formed input with U+FFFD per maximal subpart, exactly like Rust's
// String::from_utf8_lossy (which Hugging Face tokenizers use when decoding).
std::string to_valid_lossy(std::string_view s);

// The number of code points in s as to_valid_lossy reads it (each replacement one): the length
// a Python str of the text has, which OpenAI's completion text_offset counts in.
size_t code_points(std::string_view s);

// Number of bytes at the end of s that form an incomplete (but so far valid) sequence prefix,
// i.e. bytes a streaming decoder must hold back until more input arrives.
size_t incomplete_tail_length(std::string_view s);

// Client text quoted in a log line or an error message (a model name, an engine's error) is
// clipped to its first kClipBytes bytes, never splitting a well-formed sequence, followed by
// "…(+N bytes)" naming what was cut; shorter text is returned as it is. A client decides how
// long its strings are, and a 7 MiB model name must not become a 7 MiB log line or 404.
inline constexpr size_t kClipBytes = 256;
std::string clip(std::string_view s, size_t max_bytes = kClipBytes);

// Whether s holds an ASCII control byte (below 0x20, or DEL).
bool has_control_bytes(std::string_view s);

// Text from a file or a client as an error message quotes it: in single quotes, its control bytes
// written \xNN (a NUL would cut a message printed as a C string, a line break would split a log
// line). Past `max_bytes` (0: no limit) it is cut, and its size in bytes follows the quote.
std::string quote_escaped(std::string_view s, size_t max_bytes = 0);

}  // namespace tandem::utf8
