// Prompt logprobs in process on tiny-v3 (float32): every prompt position's logprob, rank and
// alternatives are the log-softmax of the model's own logits for the prefix before it (the forward
// pass is held to the PyTorch reference at every position by numerics_test); they do not depend on
// how the prompt was chunked, preempted or found in the prefix cache, nor on speculation; a
// generated token's logprob is the one its position gets when the answer is scored as a prompt.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <limits>
#include <numeric>
#include <set>

#include <nlohmann/json.hpp>

#include "api/request.h"
#include "api/response.h"
#include "engine/engine.h"
#include "engine/executor/cpu_executor.h"
#include "engine/executor/model_executor.h"
#include "engine/output_processor.h"
#include "engine/tiny_model_fixture.h"
#include "util/bounded_wait.h"
#include "util/error.h"

namespace tandem::engine {
namespace {

using tandem::testing::get_within;
using tandem::testing::kHangGuard;

constexpr char kF32[] = "f32";
constexpr double kTol = 1e-5;

struct Answer {
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs, prompt_logprobs;
  size_t outputs_with_prompt_logprobs = 0;
  std::string finish_reason, error;
};

struct Ask {
  std::vector<int32_t> prompt;
  int32_t prompt_logprobs = -1;
  int64_t max_tokens = 1;
  int32_t logprobs = -1;
};

std::vector<int32_t> prompt_of(int n, int base) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(base + (i * 7919) % 5000);
  return t;
}

struct EngineShape {
  int64_t speculative_tokens = 0;
  int64_t num_blocks = 256;
  int64_t max_batched_tokens = 2048;
  int64_t max_scored_tokens = 256;
};

// Hands the steps to the CPU executor and records how many prompt tokens each one scored.
class ScoredPerStep : public Executor {
 public:
  ScoredPerStep(std::unique_ptr<Executor> inner, std::vector<int64_t>& log)
      : inner_(std::move(inner)), log_(log) {}
  const ExecutorInfo& info() const override { return inner_->info(); }
  const std::byte* kv_bytes(int32_t b, int64_t l) const override { return inner_->kv_bytes(b, l); }
  void write_kv(int32_t b, int64_t l, std::span<const std::byte> bytes) override {
    inner_->write_kv(b, l, bytes);
  }
  ExecResult execute(std::span<const ExecItem> batch, const LayerHook& on_layer) override {
    ExecResult r = inner_->execute(batch, on_layer);
    int64_t scored = 0;
    for (size_t i = 0; i < batch.size(); ++i) scored += int64_t(r.sampled[i].prompt.size());
    log_.push_back(scored);  // the engine thread only; read after the engine stopped
    return r;
  }

 private:
  std::unique_ptr<Executor> inner_;
  std::vector<int64_t>& log_;
};

class PromptLogprobs : public test::TinyModelTest<kF32> {
 protected:
  // Runs the requests concurrently through one engine; answers in request order.
  static std::vector<Answer> serve(const std::vector<Ask>& asks, const EngineShape& shape = {},
                                   bool one_after_another = false,
                                   std::vector<int64_t>* scored_per_step = nullptr) {
    CpuExecutorOptions o;
    o.block_size = 4;
    o.num_blocks = shape.num_blocks;
    o.speculative_tokens = shape.speculative_tokens;
    metrics::Registry registry;
    EngineConfig config;
    config.scheduler.max_num_batched_tokens = shape.max_batched_tokens;
    config.scheduler.max_scored_tokens = shape.max_scored_tokens;
    std::unique_ptr<Executor> executor =
        std::make_unique<CpuExecutor>(std::shared_ptr<const model::DeepSeekModel>(
                                          model_.get(), [](const model::DeepSeekModel*) {}),
                                      *tok_, "tiny", o);
    if (scored_per_step)
      executor = std::make_unique<ScoredPerStep>(std::move(executor), *scored_per_step);
    Engine engine(config, std::move(executor),
                  std::shared_ptr<const text::Tokenizer>(tok_.get(), [](const text::Tokenizer*) {}),
                  eos_ids(*tok_, {}), registry);
    engine.start();
    std::vector<Answer> answers(asks.size());
    std::vector<std::promise<void>> done(asks.size());
    for (size_t i = 0; i < asks.size(); ++i) {
      EngineRequest r;
      r.id = std::to_string(i);
      r.prompt = asks[i].prompt;
      r.sampling.temperature = 0;
      r.sampling.ignore_eos = true;
      r.sampling.max_tokens = asks[i].max_tokens;
      r.logprobs = asks[i].logprobs;
      r.prompt_logprobs = asks[i].prompt_logprobs;
      r.on_output = [&answers, &done, i](const RequestOutput& out) {
        Answer& a = answers[i];
        a.tokens.insert(a.tokens.end(), out.tokens.begin(), out.tokens.end());
        a.logprobs.insert(a.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
        if (!out.prompt_logprobs.empty()) {
          ++a.outputs_with_prompt_logprobs;
          a.prompt_logprobs = out.prompt_logprobs;
        }
        if (out.finished) {
          a.finish_reason = out.finish_reason;
          a.error = out.error;
          done[i].set_value();
        }
      };
      engine.submit(std::move(r));
      if (one_after_another) {
        auto finished = done[i].get_future();
        get_within(finished, kHangGuard, "a request never finished");
      }
    }
    if (!one_after_another)
      for (auto& d : done) {
        auto finished = d.get_future();
        get_within(finished, kHangGuard, "a request never finished");
      }
    engine.stop();
    return answers;
  }

  // The log-softmax, in double, of the model's logits at every position of `tokens`, computed
  // whole in a cache of its own, over the ids with text (those a serving engine samples from).
  static std::vector<std::vector<double>> reference(const std::vector<int32_t>& tokens) {
    const int64_t block = 4;
    model::LatentCache cache(model_->cache_shape(block), 64);
    std::vector<int32_t> blocks((tokens.size() + block - 1) / block);
    std::iota(blocks.begin(), blocks.end(), 0);
    const model::SequenceStep step{tokens, 0, blocks, model::LogitRows::kAll};
    const auto out = model_->forward(std::span<const model::SequenceStep>(&step, 1), cache);
    const auto vocab = static_cast<size_t>(model_->config().vocab_size);
    const std::vector<int32_t> no_text = ids_without_text(*tok_, model_->config().vocab_size);
    EXPECT_FALSE(no_text.empty()) << "tiny-v3 pads its vocabulary: the mask is exercised";
    std::vector<std::vector<double>> rows;
    for (size_t r = 0; r < tokens.size(); ++r) {
      std::vector<double> row(out.logits.data() + r * vocab, out.logits.data() + (r + 1) * vocab);
      for (int32_t id : no_text) row[size_t(id)] = -std::numeric_limits<double>::infinity();
      const double m = *std::max_element(row.begin(), row.end());
      double sum = 0;
      for (double v : row) sum += std::exp(v - m);
      for (double& v : row) v -= m + std::log(sum);
      rows.push_back(std::move(row));
    }
    return rows;
  }

  static void expect_near(const std::vector<TokenLogprob>& got,
                          const std::vector<TokenLogprob>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t p = 0; p < got.size(); ++p) {
      SCOPED_TRACE("position " + std::to_string(p + 1));
      EXPECT_EQ(got[p].token, want[p].token);
      EXPECT_NEAR(got[p].logprob, want[p].logprob, kTol);
      // Deep in the vocabulary logits lie closer than rounding tells apart.
      EXPECT_NEAR(got[p].rank, want[p].rank, want[p].rank / 1000);
      ASSERT_EQ(got[p].top.size(), want[p].top.size());
      for (size_t k = 0; k < got[p].top.size(); ++k) {
        EXPECT_EQ(got[p].top[k].first, want[p].top[k].first);
        EXPECT_NEAR(got[p].top[k].second, want[p].top[k].second, kTol);
      }
    }
  }
};

TEST_F(PromptLogprobs, AreTheLogSoftmaxOfTheModelsLogitsForThePrefixBeforeEachToken) {
  const auto prompt = prompt_of(19, 300);
  const auto answers = serve({{prompt, 3}});
  ASSERT_EQ(answers[0].error, "");
  const Answer& a = answers[0];
  EXPECT_EQ(a.outputs_with_prompt_logprobs, 1u) << "they come once, with the first token";
  ASSERT_EQ(a.prompt_logprobs.size(), prompt.size() - 1);
  const auto ref = reference(prompt);
  for (size_t p = 1; p < prompt.size(); ++p) {
    SCOPED_TRACE("position " + std::to_string(p));
    const TokenLogprob& lp = a.prompt_logprobs[p - 1];
    const std::vector<double>& row = ref[p - 1];  // the logits after token p - 1
    EXPECT_EQ(lp.token, prompt[p]);
    EXPECT_NEAR(lp.logprob, row[size_t(prompt[p])], kTol);
    const auto above =
        std::count_if(row.begin(), row.end(), [&](double v) { return v > row[size_t(prompt[p])]; });
    EXPECT_EQ(lp.rank, 1 + above);
    std::vector<int32_t> order(row.size());
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 3, order.end(),
                      [&](int32_t x, int32_t y) { return row[size_t(x)] > row[size_t(y)]; });
    ASSERT_EQ(lp.top.size(), 3u);
    for (size_t k = 0; k < 3; ++k) {
      EXPECT_EQ(lp.top[k].first, order[k]);
      EXPECT_NEAR(lp.top[k].second, row[size_t(order[k])], kTol);
    }
  }
}

TEST_F(PromptLogprobs, DoNotDependOnChunksPreemptionThePrefixCacheOrSpeculation) {
  const auto prompt = prompt_of(23, 700);
  const auto alone = serve({{prompt, 2}})[0].prompt_logprobs;
  ASSERT_EQ(alone.size(), prompt.size() - 1);
  {
    SCOPED_TRACE("chunks of 5 new tokens, and of 3 scored ones");
    expect_near(serve({{prompt, 2}}, {.max_batched_tokens = 5})[0].prompt_logprobs, alone);
    expect_near(serve({{prompt, 2}}, {.max_scored_tokens = 3})[0].prompt_logprobs, alone);
  }
  {
    SCOPED_TRACE("the same prompt cached by an earlier request");
    const auto answers = serve({{prompt, -1, 4}, {prompt, 2}}, {}, /*one_after_another=*/true);
    expect_near(answers[1].prompt_logprobs, alone);
  }
  {
    SCOPED_TRACE("preempted: four long answers in a cache of 20 blocks of 4 tokens");
    std::vector<Ask> asks;
    for (int i = 0; i < 4; ++i) asks.push_back({prompt, 2, 20});
    const auto answers = serve(asks, {.num_blocks = 20, .max_batched_tokens = 8});
    for (const Answer& a : answers) {
      ASSERT_EQ(a.error, "");
      EXPECT_EQ(a.outputs_with_prompt_logprobs, 1u);
      expect_near(a.prompt_logprobs, alone);
    }
  }
  {
    SCOPED_TRACE("an engine that speculates with the MTP module");
    expect_near(serve({{prompt, 2}}, {.speculative_tokens = 2})[0].prompt_logprobs, alone);
  }
}

// Each scored token is a row of logits (vocab floats): a step scores at most the bound, over all
// its sequences, whatever their number.
TEST_F(PromptLogprobs, AStepScoresAtMostItsBoundOverAllItsSequences) {
  const auto prompt = prompt_of(40, 900);
  const auto alone = serve({{prompt, 1}})[0].prompt_logprobs;
  std::vector<Ask> asks(6, Ask{prompt, 1, 2});
  std::vector<int64_t> per_step;
  const auto answers = serve(asks, {.max_scored_tokens = 16}, false, &per_step);
  for (const Answer& a : answers) expect_near(a.prompt_logprobs, alone);
  ASSERT_FALSE(per_step.empty());
  EXPECT_LE(*std::max_element(per_step.begin(), per_step.end()), 16);
  EXPECT_EQ(std::accumulate(per_step.begin(), per_step.end(), int64_t{0}), 6 * 39);
}

TEST_F(PromptLogprobs, OfAnAnswerScoredAsAPromptAreTheLogprobsItWasGeneratedWith) {
  const auto prompt = prompt_of(9, 1200);
  const Answer generated = serve({{prompt, -1, 6, 2}})[0];
  ASSERT_EQ(generated.logprobs.size(), 6u);
  auto whole = prompt;
  whole.insert(whole.end(), generated.tokens.begin(), generated.tokens.end());
  const Answer scored = serve({{whole, 2}})[0];
  ASSERT_EQ(scored.prompt_logprobs.size(), whole.size() - 1);
  const std::vector<TokenLogprob> tail(scored.prompt_logprobs.end() - 6,
                                       scored.prompt_logprobs.end());
  for (size_t k = 0; k < 6; ++k) {
    SCOPED_TRACE("generated token " + std::to_string(k));
    EXPECT_EQ(tail[k].token, generated.logprobs[k].token);
    EXPECT_NEAR(tail[k].logprob, generated.logprobs[k].logprob, kTol);
    EXPECT_EQ(tail[k].rank, 1) << "greedy tokens are the most likely";
    ASSERT_EQ(tail[k].top.size(), 2u);
    EXPECT_EQ(tail[k].top[0].first, generated.logprobs[k].top[0].first);
  }
}

// A prompt may hold the rows a padded vocabulary adds past the tokenizer's ids (tiny-v3, as
// DeepSeek-V3: 129,280 rows, 128,815 ids), as vLLM's may. Such an id is scored as any other: its
// position's logprob and rank are the log-softmax of the model's logits over the ids a serving
// engine samples from, in which it has none (-inf, shown as vLLM shows it: -9999.0, ranked after
// every id with text), and the positions after it are scored with it in their context. Echo shows
// it as nothing, as transformers' decode skips ids it does not know (9222c81).
TEST_F(PromptLogprobs, OfAPromptWithPaddedIdsAreScoredAndEchoedAsForOtherIds) {
  const std::vector<int32_t> no_text = ids_without_text(*tok_, model_->config().vocab_size);
  const auto first_padded = static_cast<int32_t>(tok_->vocab_size());
  const auto last_row = static_cast<int32_t>(model_->config().vocab_size - 1);
  ASSERT_TRUE(std::binary_search(no_text.begin(), no_text.end(), first_padded));
  ASSERT_TRUE(std::binary_search(no_text.begin(), no_text.end(), last_row));
  auto prompt = prompt_of(12, 300);
  prompt.insert(prompt.begin() + 3, first_padded);
  prompt.insert(prompt.begin() + 8, last_row);
  const std::set<size_t> padded_at = {3, 8};
  const Answer a = serve({{prompt, 2, 1, 1}})[0];
  ASSERT_EQ(a.error, "");
  ASSERT_EQ(a.prompt_logprobs.size(), prompt.size() - 1);
  const auto ref = reference(prompt);
  for (size_t p = 1; p < prompt.size(); ++p) {
    SCOPED_TRACE("position " + std::to_string(p));
    const TokenLogprob& lp = a.prompt_logprobs[p - 1];
    const std::vector<double>& row = ref[p - 1];
    EXPECT_EQ(lp.token, prompt[p]);
    if (padded_at.count(p)) {
      EXPECT_EQ(lp.logprob, -std::numeric_limits<float>::infinity());
      EXPECT_EQ(size_t(lp.rank), size_t(model_->config().vocab_size) - no_text.size() + 1);
    } else {
      EXPECT_NEAR(lp.logprob, row[size_t(prompt[p])], kTol);
      const auto above = std::count_if(row.begin(), row.end(),
                                       [&](double v) { return v > row[size_t(prompt[p])]; });
      EXPECT_NEAR(lp.rank, 1 + above, (1 + above) / 1000);
    }
    ASSERT_EQ(lp.top.size(), 2u);
    const auto best = std::max_element(row.begin(), row.end()) - row.begin();
    EXPECT_EQ(lp.top[0].first, best);
    EXPECT_NEAR(lp.top[0].second, row[size_t(best)], kTol);
    for (const auto& [id, logprob] : lp.top)
      EXPECT_FALSE(std::binary_search(no_text.begin(), no_text.end(), id)) << id;
  }

  // Echoed as the engine's API renders it: the padded ids' text is nothing, their logprob vLLM's
  // -9999.0; every other position as the tokenizer and the scores say.
  const api::ModelLimits limits{.model_name = "tiny", .vocab_size = model_->config().vocab_size};
  const api::ApiRequest req = api::parse_completion(nlohmann::json{{"prompt", prompt},
                                                                   {"echo", true},
                                                                   {"logprobs", 1},
                                                                   {"prompt_logprobs", 1},
                                                                   {"max_tokens", 1}},
                                                    *tok_, limits);
  api::RequestOutput out;
  out.tokens = a.tokens;
  out.logprobs = a.logprobs;
  out.prompt_logprobs = a.prompt_logprobs;
  out.finished = true;
  out.finish_reason = a.finish_reason;
  api::ResponseBuilder builder(req, *tok_, "cmpl-1", 1);
  builder.on_output(0, out);
  const nlohmann::json body = builder.final_body();
  const nlohmann::json& echoed = body["choices"][0]["logprobs"];
  const nlohmann::json& scored = body["choices"][0]["prompt_logprobs"];
  ASSERT_EQ(scored.size(), prompt.size());
  for (size_t p = 1; p < prompt.size(); ++p) {
    SCOPED_TRACE("position " + std::to_string(p));
    const TokenLogprob& lp = a.prompt_logprobs[p - 1];
    const std::string text =
        padded_at.count(p) ? "" : tok_->decode_as_transformers({&prompt[p], 1}, false);
    const double wire = padded_at.count(p) ? -9999.0 : double(lp.logprob);
    EXPECT_EQ(echoed["tokens"][p], text);
    EXPECT_EQ(echoed["token_logprobs"][p].get<double>(), wire);
    const nlohmann::json& entry = scored[p][std::to_string(prompt[p])];
    EXPECT_EQ(entry["decoded_token"], text);
    EXPECT_EQ(entry["logprob"].get<double>(), wire);
    EXPECT_EQ(entry["rank"], lp.rank);
  }
}

TEST_F(PromptLogprobs, AOneTokenPromptHasNoneAndARequestWithoutThemGetsNone) {
  const auto answers = serve({{{500}, 4, 2}, {prompt_of(7, 40), -1, 2}});
  for (const Answer& a : answers) {
    EXPECT_EQ(a.error, "");
    EXPECT_EQ(a.tokens.size(), 2u);
    EXPECT_TRUE(a.prompt_logprobs.empty());
  }
}

}  // namespace
}  // namespace tandem::engine
