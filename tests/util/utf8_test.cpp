// UTF-8 helpers: the lossy conversion must replace ill-formed input exactly like Rust's
// String::from_utf8_lossy (Unicode's "maximal subpart" practice), which HF decoding uses.
#include "util/utf8.h"

#include <gtest/gtest.h>

namespace tandem::utf8 {
namespace {

const std::string kFffd = "\xEF\xBF\xBD";

TEST(Utf8, ValidSequenceLengths) {
  EXPECT_EQ(valid_sequence_length("a", 0), 1u);
  EXPECT_EQ(valid_sequence_length("\xC3\xA9", 0), 2u);
  EXPECT_EQ(valid_sequence_length("\xE4\xBD\xA0", 0), 3u);
  EXPECT_EQ(valid_sequence_length("\xF0\x9F\x98\x80", 0), 4u);
  EXPECT_EQ(valid_sequence_length("\xC0\x80", 0), 0u);          // overlong
  EXPECT_EQ(valid_sequence_length("\xED\xA0\x80", 0), 0u);      // surrogate
  EXPECT_EQ(valid_sequence_length("\xF4\x90\x80\x80", 0), 0u);  // above U+10FFFF
  EXPECT_EQ(valid_sequence_length("\x80", 0), 0u);
  EXPECT_EQ(valid_sequence_length("\xE4\xBD", 0), 0u);  // truncated
}

// Cases from the Unicode standard's table 3-8 and Rust's documented behaviour.
TEST(Utf8, LossyReplacesMaximalSubparts) {
  EXPECT_EQ(to_valid_lossy("abc"), "abc");
  EXPECT_EQ(to_valid_lossy("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
            "a" + kFffd + kFffd + kFffd + "b" + kFffd + "c" + kFffd + kFffd + "d");
  EXPECT_EQ(to_valid_lossy("\xC0\xAF"), kFffd + kFffd);
  EXPECT_EQ(to_valid_lossy("\xED\xA0\x80"), kFffd + kFffd + kFffd);
  EXPECT_EQ(to_valid_lossy("\xF0\x9F\x98"), kFffd);  // truncated at the end: one replacement
  EXPECT_EQ(to_valid_lossy("\xF0\x9F\x98x"), kFffd + "x");
}

// Python's len() of the decoded text: one per code point, one per replacement.
TEST(Utf8, CodePointsCountAsThePythonStrOfTheLossyText) {
  for (const std::string s :
       {"", "abc", "caf\xC3\xA9", "\xE4\xBD\xA0\xE5\xA5\xBD", "\xF0\x9F\x98\x80!",
        "\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64", "\xF0\x9F\x98", "\xED\xA0\x80"}) {
    const std::string lossy = to_valid_lossy(s);
    size_t expected = 0;  // lead bytes of the valid text
    for (unsigned char c : lossy) expected += (c & 0xC0) != 0x80;
    EXPECT_EQ(code_points(s), expected) << s;
  }
  EXPECT_EQ(code_points("\xF0\x9F\x98\x80!"), 2u);
  EXPECT_EQ(code_points("caf\xC3\xA9"), 4u);
}

TEST(Utf8, IncompleteTail) {
  EXPECT_EQ(incomplete_tail_length("ab"), 0u);
  EXPECT_EQ(incomplete_tail_length("a\xE4"), 1u);
  EXPECT_EQ(incomplete_tail_length("a\xE4\xBD"), 2u);
  EXPECT_EQ(incomplete_tail_length("a\xE4\xBD\xA0"), 0u);
  EXPECT_EQ(incomplete_tail_length("\xF0\x9F\x98"), 3u);
  EXPECT_EQ(incomplete_tail_length("\xE4\x41"), 0u);  // already invalid: nothing to wait for
  EXPECT_EQ(incomplete_tail_length("\xED\xA0"), 0u);  // can never become valid
  EXPECT_EQ(incomplete_tail_length("\x80"), 0u);
}

TEST(Utf8, AppendRoundTrips) {
  for (char32_t cp : {U'a', U'\u00e9', U'\u4f60', U'\U0001F600', U'\U0010FFFF'}) {
    std::string s;
    append(s, cp);
    ASSERT_EQ(valid_sequence_length(s, 0), s.size());
    EXPECT_EQ(decode_at(s, 0, s.size()), cp);
  }
}

// Client text quoted in logs and messages: bounded, never cutting a character, naming the cut.
TEST(Utf8, ClipKeepsShortTextAndBoundsLongTextOnACharacterBoundary) {
  EXPECT_EQ(clip("model-a"), "model-a");
  EXPECT_EQ(clip(std::string(kClipBytes, 'm')), std::string(kClipBytes, 'm'));
  const std::string long_name(7 << 20, 'm');
  EXPECT_EQ(clip(long_name), std::string(kClipBytes, 'm') + "\u2026(+7339776 bytes)");
  // "\xE4\xBD\xA0" (3 bytes) straddles byte 4: it is left out whole, and counted.
  EXPECT_EQ(clip("abc\xE4\xBD\xA0"
                 "def",
                 4),
            "abc\u2026(+6 bytes)");
  EXPECT_EQ(clip("\xF0\x9F\x98\x80\xF0\x9F\x98\x80", 5), "\xF0\x9F\x98\x80\u2026(+4 bytes)");
  // Ill-formed bytes count one each; the JSON writer replaces them.
  EXPECT_EQ(clip("\xff\xfe\xfd", 2), "\xff\xfe\u2026(+1 bytes)");
}

// A name from a file or a client in an error message: a NUL would end a C-string message and a
// line break split a log line, so control bytes are written out; a long value is cut, its size
// said.
TEST(Utf8, QuotedTextShowsControlBytesAndSaysWhatWasCut) {
  using namespace std::string_literals;
  EXPECT_EQ(quote_escaped("model.safetensors"), "'model.safetensors'");
  EXPECT_EQ(quote_escaped("a\0b\n\x7f"s), "'a\\x00b\\x0a\\x7f'");
  EXPECT_EQ(quote_escaped("héllo"), "'héllo'");
  EXPECT_EQ(quote_escaped(std::string(100, 'x'), 4), "'xxxx' (100 bytes)");
  EXPECT_EQ(quote_escaped("xxxx", 4), "'xxxx'");
  EXPECT_TRUE(has_control_bytes("a\tb"));
  EXPECT_TRUE(has_control_bytes("\x7f"));
  EXPECT_FALSE(has_control_bytes("plain text, ünïcode"));
}

}  // namespace
}  // namespace tandem::utf8
