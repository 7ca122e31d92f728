// The simulated executor's MTP acceptance model: drafts are the sequence's own continuation with
// the acceptance probability, verification keeps the right ones, and the tokens that come out are
// exactly those of plain decoding; drafting costs its share of the step's modelled time.
#include <gtest/gtest.h>

#include "engine/executor/sim_executor.h"
#include "engine/sim_engine_fixture.h"
#include "util/error.h"

namespace tandem::engine {
namespace {

SimExecutorOptions options(int64_t drafts, std::vector<double> acceptance) {
  SimExecutorOptions o;
  o.preset = "tiny";
  o.seed = 7;
  o.mtp.drafts = drafts;
  o.mtp.acceptance = std::move(acceptance);
  o.wait = [](double) {};  // no sleeping
  return o;
}

// A prompt, prefilled; the result's first token and drafts.
StepTokens prefill(SimExecutor& ex, const std::vector<int32_t>& prompt) {
  ExecItem item;
  item.tokens = prompt;
  item.sample = true;
  item.prompt = prompt;
  return ex.execute(std::span(&item, 1)).sampled[0];
}

// One decode step of the sequence `prompt` + `generated` (its last token new), with `drafts`.
StepTokens decode(SimExecutor& ex, const std::vector<int32_t>& prompt,
                  const std::vector<int32_t>& generated, const std::vector<int32_t>& drafts = {}) {
  ExecItem item;
  item.tokens = std::span(&generated.back(), 1);
  item.start = static_cast<int64_t>(prompt.size() + generated.size() - 1);
  item.sample = true;
  item.prompt = prompt;
  item.generated = generated;
  item.drafts = drafts;
  return ex.execute(std::span(&item, 1)).sampled[0];
}

std::vector<int32_t> tokens_of(const StepTokens& s) {
  std::vector<int32_t> t;
  for (const auto& x : s.tokens) t.push_back(x.token);
  return t;
}

const std::vector<int32_t> kPrompt = {1000, 2000, 3000, 4000, 5000};

// The first `n` tokens of plain decoding.
std::vector<int32_t> plain(size_t n) {
  SimExecutor ex(test::deepseek_v3_tokenizer(), options(0, {0.85}));
  std::vector<int32_t> out = tokens_of(prefill(ex, kPrompt));
  while (out.size() < n) out.push_back(tokens_of(decode(ex, kPrompt, out))[0]);
  return out;
}

TEST(SimMtp, AlwaysRightDraftsAreThePlainContinuationAndAllAccepted) {
  SimExecutor ex(test::deepseek_v3_tokenizer(), options(3, {1.0}));
  EXPECT_EQ(ex.info().speculative_tokens, 3);
  const StepTokens first = prefill(ex, kPrompt);
  const std::vector<int32_t> expected = plain(8);
  ASSERT_EQ(first.tokens.size(), 1u);
  ASSERT_EQ(first.drafts.size(), 3u);
  EXPECT_EQ(first.drafts, std::vector<int32_t>(expected.begin() + 1, expected.begin() + 4));
  // Verifying three right drafts yields them and the token after them.
  const StepTokens next = decode(ex, kPrompt, tokens_of(first), first.drafts);
  EXPECT_EQ(tokens_of(next), std::vector<int32_t>(expected.begin() + 1, expected.begin() + 5));
  EXPECT_EQ(next.drafts, std::vector<int32_t>(expected.begin() + 5, expected.begin() + 8));
}

TEST(SimMtp, NeverRightDraftsAreRejectedAndTheStepYieldsThePlainToken) {
  SimExecutor ex(test::deepseek_v3_tokenizer(), options(2, {0.0}));
  const StepTokens first = prefill(ex, kPrompt);
  const std::vector<int32_t> expected = plain(3);
  ASSERT_EQ(first.drafts.size(), 2u);
  EXPECT_NE(first.drafts[0], expected[1]);
  const StepTokens next = decode(ex, kPrompt, tokens_of(first), first.drafts);
  EXPECT_EQ(tokens_of(next), std::vector<int32_t>{expected[1]});
}

TEST(SimMtp, AcceptedRunsFollowTheAcceptanceProbabilitiesAndKeepThePlainTokens) {
  // Two drafts, 0.8 then 0.5 given the first: 0.8 + 0.8 * 0.5 = 1.2 accepted per step.
  SimExecutor ex(test::deepseek_v3_tokenizer(), options(2, {0.8, 0.5}));
  const std::vector<int32_t> expected = plain(3000);
  StepTokens last = prefill(ex, kPrompt);
  std::vector<int32_t> out = tokens_of(last);
  int64_t steps = 0, accepted = 0, first_accepted = 0;
  while (out.size() < 2900) {
    last = decode(ex, kPrompt, out, last.drafts);
    const auto got = tokens_of(last);
    ++steps;
    accepted += int64_t(got.size()) - 1;
    first_accepted += got.size() > 1;
    out.insert(out.end(), got.begin(), got.end());
  }
  EXPECT_EQ(out, std::vector<int32_t>(expected.begin(), expected.begin() + out.size()));
  EXPECT_NEAR(double(first_accepted) / double(steps), 0.8, 0.04);
  EXPECT_NEAR(double(accepted) / double(steps), 1.2, 0.06);
}

TEST(SimMtp, DraftingAddsItsShareOfTheStepTime) {
  auto time_of = [](int64_t drafts, double share) {
    SimExecutorOptions o = options(drafts, {1.0});
    o.mtp.draft_pass_share = share;
    double seconds = 0;
    o.wait = [&](double s) { seconds += s; };
    SimExecutor ex(test::deepseek_v3_tokenizer(), o);
    prefill(ex, kPrompt);
    return seconds;
  };
  const double plain_step = time_of(0, 0.25);
  ASSERT_GT(plain_step, 0);
  EXPECT_NEAR(time_of(2, 0.25), plain_step * 1.5, 1e-12);
  EXPECT_NEAR(time_of(2, 0), plain_step, 1e-12);
}

TEST(SimMtp, BadAcceptanceModelsAreRefusedByName) {
  EXPECT_THROW(SimExecutor(test::deepseek_v3_tokenizer(), options(1, {1.5})), Error);
  EXPECT_THROW(SimExecutor(test::deepseek_v3_tokenizer(), options(1, {})), Error);
  EXPECT_THROW(SimExecutor(test::deepseek_v3_tokenizer(), options(17, {0.5})), Error);
  try {
    SimExecutor(test::deepseek_v3_tokenizer(), options(1, {-0.1}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("acceptance"), std::string::npos);
  }
}

}  // namespace
}  // namespace tandem::engine
