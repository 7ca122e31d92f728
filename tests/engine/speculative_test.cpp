// Speculative decoding with the MTP module, in process on tiny-v3 (float32): greedy outputs are
// those of plain decoding whatever the drafts (the random-weight module's, mostly rejected, and
// an oracle's that are right except at known places, so long runs are accepted), with chunked
// prefill, concurrent requests, preemption, stop strings, max_tokens and logprobs; every block
// comes back; the module's drafts are its prediction over the whole sequence at once (its latent
// cache is kept complete across chunks and steps); the metrics add up. In BF16, under
// --batch-invariant, greedy outputs are plain decoding's whatever number of drafts a step verifies.
#include <gtest/gtest.h>

#include <fstream>
#include <future>
#include <limits>
#include <map>
#include <sstream>

#include "engine/engine.h"
#include "engine/executor/cpu_executor.h"
#include "engine/executor/model_executor.h"
#include "engine/generate.h"
#include "engine/output_processor.h"
#include "engine/tiny_model_fixture.h"
#include "kernels/cpu/ops.h"
#include "structured/token_constraint.h"
#include "util/bounded_wait.h"
#include "util/error.h"

namespace tandem::engine {
namespace {

using tandem::testing::get_within;
using tandem::testing::kHangGuard;
using tandem::testing::repeat_until;

constexpr char kF32[] = "f32";
constexpr char kBf16[] = "bf16";

struct Answer {
  std::vector<int32_t> tokens;
  std::string text, finish_reason, error;
  std::vector<TokenLogprob> logprobs;
};

struct RequestSpec {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int32_t logprobs = -1;
};

SamplingParams greedy_params(int64_t max_tokens) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

std::vector<int32_t> prompt_of(int n, int base) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(base + (i * 7919) % 5000);
  return t;
}

// An executor that hands its steps to another and changes or records what comes back.
class Wrapper : public Executor {
 public:
  explicit Wrapper(std::unique_ptr<Executor> inner) : inner_(std::move(inner)) {}
  const ExecutorInfo& info() const override { return inner_->info(); }
  const std::byte* kv_bytes(int32_t b, int64_t l) const override { return inner_->kv_bytes(b, l); }
  void write_kv(int32_t b, int64_t l, std::span<const std::byte> bytes) override {
    inner_->write_kv(b, l, bytes);
  }

 protected:
  std::unique_ptr<Executor> inner_;
};

// Hands out the inner executor's results with each sampled item's drafts replaced by the known
// greedy continuation of its prompt, except at positions where `wrong(position)` holds (there
// the draft is another token).
class OracleDrafts : public Wrapper {
 public:
  OracleDrafts(std::unique_ptr<Executor> inner,
               std::map<std::vector<int32_t>, std::vector<int32_t>> continuations,
               std::function<bool(int64_t)> wrong)
      : Wrapper(std::move(inner)), continuations_(std::move(continuations)), wrong_(wrong) {}
  ExecResult execute(std::span<const ExecItem> batch, const LayerHook& on_layer) override {
    ExecResult r = inner_->execute(batch, on_layer);
    for (size_t i = 0; i < batch.size(); ++i) {
      if (!batch[i].sample) continue;
      const auto& expected =
          continuations_.at(std::vector<int32_t>(batch[i].prompt.begin(), batch[i].prompt.end()));
      const auto g = static_cast<int64_t>(batch[i].generated.size() + r.sampled[i].tokens.size());
      auto& drafts = r.sampled[i].drafts;
      const auto k = static_cast<int64_t>(drafts.size());
      drafts.clear();
      for (int64_t j = 0; j < k && g + j < static_cast<int64_t>(expected.size()); ++j) {
        const int32_t right = expected[size_t(g + j)];
        drafts.push_back(wrong_(g + j) ? (right + 1) % int32_t(info().vocab_size) : right);
      }
    }
    return r;
  }

 private:
  std::map<std::vector<int32_t>, std::vector<int32_t>> continuations_;
  std::function<bool(int64_t)> wrong_;
};

// Records every draft the inner executor proposed, with the sequence it followed.
class DraftRecorder : public Wrapper {
 public:
  struct Proposal {
    std::vector<int32_t> sequence;  // prompt, generated, the step's tokens
    std::vector<int32_t> drafts;
  };
  using Log = std::vector<Proposal>;
  DraftRecorder(std::unique_ptr<Executor> inner, std::shared_ptr<Log> log)
      : Wrapper(std::move(inner)), log_(std::move(log)) {}
  ExecResult execute(std::span<const ExecItem> batch, const LayerHook& on_layer) override {
    ExecResult r = inner_->execute(batch, on_layer);
    for (size_t i = 0; i < batch.size(); ++i) {
      if (!batch[i].sample) continue;
      Proposal p;
      p.sequence.assign(batch[i].prompt.begin(), batch[i].prompt.end());
      p.sequence.insert(p.sequence.end(), batch[i].generated.begin(), batch[i].generated.end());
      for (const auto& t : r.sampled[i].tokens) p.sequence.push_back(t.token);
      p.drafts = r.sampled[i].drafts;
      log_->push_back(std::move(p));  // the engine thread only
    }
    return r;
  }

 private:
  std::shared_ptr<Log> log_;
};

// Runs the requests concurrently through one engine; answers in request order.
std::vector<Answer> serve_on(std::shared_ptr<const text::Tokenizer> tokenizer,
                             std::unique_ptr<Executor> ex, const std::vector<RequestSpec>& requests,
                             int64_t max_batched_tokens = 2048, LoadReport* after = nullptr,
                             metrics::Registry* registry = nullptr) {
  metrics::Registry own;
  EngineConfig config;
  config.scheduler.max_num_batched_tokens = max_batched_tokens;
  Engine engine(config, std::move(ex), tokenizer, eos_ids(*tokenizer, {}),
                registry ? *registry : own);
  engine.start();
  std::vector<Answer> answers(requests.size());
  std::vector<std::promise<void>> done(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EngineRequest r;
    r.id = std::to_string(i);
    r.prompt = requests[i].prompt;
    r.sampling = requests[i].sampling;
    r.logprobs = requests[i].logprobs;
    r.on_output = [&answers, &done, i](const RequestOutput& o) {
      Answer& a = answers[i];
      a.tokens.insert(a.tokens.end(), o.tokens.begin(), o.tokens.end());
      a.logprobs.insert(a.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
      a.text.append(o.text.data(), o.text.size());
      if (o.finished) {
        a.finish_reason = o.finish_reason;
        a.error = o.error;
        done[i].set_value();
      }
    };
    engine.submit(std::move(r));
  }
  for (auto& d : done) {
    auto finished = d.get_future();
    get_within(finished, kHangGuard, "a request never finished");
  }
  if (after) {
    // The engine thread finishes its step's bookkeeping after the last output.
    repeat_until(
        [&] {
          const LoadReport load = engine.load();
          return load.running + load.waiting == 0;
        },
        kHangGuard, "the engine still counted finished requests");
    *after = engine.load();
  }
  engine.stop();
  return answers;
}

class Speculation : public test::TinyModelTest<kF32> {
 protected:
  static std::shared_ptr<const model::DeepSeekModel> model() {
    return {model_.get(), [](const model::DeepSeekModel*) {}};
  }
  static std::shared_ptr<const text::Tokenizer> tokenizer() {
    return {tok_.get(), [](const text::Tokenizer*) {}};
  }
  static std::unique_ptr<CpuExecutor> executor(int64_t k, int64_t num_blocks = 256,
                                               int64_t block_size = 4) {
    CpuExecutorOptions o;
    o.block_size = block_size;
    o.num_blocks = num_blocks;
    o.speculative_tokens = k;
    return std::make_unique<CpuExecutor>(model(), *tok_, "tiny", o);
  }
  static std::string plain_greedy(const std::vector<int32_t>& prompt, int64_t max_tokens) {
    return generate(*model_, *tok_, prompt, greedy_params(max_tokens)).text;
  }
  static std::vector<int32_t> plain_greedy_ids(const std::vector<int32_t>& prompt,
                                               int64_t max_tokens) {
    return generate(*model_, *tok_, prompt, greedy_params(max_tokens)).tokens;
  }

  static std::vector<Answer> serve(std::unique_ptr<Executor> ex,
                                   const std::vector<RequestSpec>& requests,
                                   int64_t max_batched_tokens = 2048, LoadReport* after = nullptr,
                                   metrics::Registry* registry = nullptr) {
    return serve_on(tokenizer(), std::move(ex), requests, max_batched_tokens, after, registry);
  }

  static double metric(const metrics::Registry& registry, const std::string& name,
                       const std::string& labels = {}) {
    std::istringstream in(registry.render());
    std::string line;
    while (std::getline(in, line))
      if ((line.rfind(name + "{", 0) == 0) && line.find(labels) != std::string::npos)
        return std::stod(line.substr(line.rfind(' ') + 1));
    return 0;
  }

  static std::vector<RequestSpec> mixed_requests(int64_t max_tokens) {
    std::vector<RequestSpec> r;
    for (int i = 0; i < 5; ++i)
      r.push_back({prompt_of(3 + 9 * i, 400 + 31 * i), greedy_params(max_tokens)});
    return r;
  }
};

TEST_F(Speculation, GreedyOutputsEqualPlainDecodingForOneToThreeDrafts) {
  const auto requests = mixed_requests(12);
  for (int64_t k : {1, 2, 3}) {
    // A small token budget: prompts are chunked and decodes share steps with prefill chunks.
    const auto answers = serve(executor(k), requests, /*max_batched_tokens=*/16);
    for (size_t i = 0; i < requests.size(); ++i) {
      EXPECT_EQ(answers[i].error, "");
      EXPECT_EQ(answers[i].text, plain_greedy(requests[i].prompt, 12)) << "k " << k << " #" << i;
      EXPECT_EQ(answers[i].tokens.size(), 12u);
    }
  }
}

TEST_F(Speculation, AcceptedOracleDraftsKeepOutputsExactAndMetricsAddUp) {
  const auto requests = mixed_requests(20);
  std::map<std::vector<int32_t>, std::vector<int32_t>> continuations;
  for (const auto& r : requests) continuations[r.prompt] = plain_greedy_ids(r.prompt, 20);
  for (int64_t k : {1, 3}) {
    metrics::Registry registry;
    LoadReport load;
    auto ex = std::make_unique<OracleDrafts>(executor(k), continuations,
                                             [](int64_t position) { return position % 5 == 3; });
    const auto answers = serve(std::move(ex), requests, 2048, &load, &registry);
    for (size_t i = 0; i < requests.size(); ++i) {
      EXPECT_EQ(answers[i].tokens, continuations[requests[i].prompt]) << "k " << k << " #" << i;
      EXPECT_EQ(answers[i].text, plain_greedy(requests[i].prompt, 20));
    }
    // Every block is back: the rejected drafts' and the draft passes' included.
    EXPECT_EQ(load.free_blocks, load.total_blocks);
    const double accepted = metric(registry, "vllm:spec_decode_num_accepted_tokens_total");
    const double drafted = metric(registry, "vllm:spec_decode_num_draft_tokens_total");
    const double steps = metric(registry, "vllm:spec_decode_num_drafts_total");
    EXPECT_GT(accepted, 0);
    EXPECT_LT(accepted, drafted);  // a fifth of the drafts are wrong
    EXPECT_LE(drafted, steps * double(k));
    // Per position: a draft is accepted only after the ones before it.
    double per_position = 0, before = std::numeric_limits<double>::infinity();
    for (int64_t p = 0; p < k; ++p) {
      const double n = metric(registry, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                              "position=\"" + std::to_string(p) + "\"");
      EXPECT_LE(n, before);
      before = n;
      per_position += n;
    }
    EXPECT_EQ(per_position, accepted);
    EXPECT_EQ(metric(registry, "vllm:generation_tokens_total"), 5 * 20);
  }
}

// The per-position acceptance counter has a series for each of the K draft positions from the
// start, at 0, as vLLM creates them (rate() misses a series' first increment), and none without
// speculation.
TEST_F(Speculation, EveryDraftPositionIsASeriesFromTheStart) {
  for (int64_t k : {0, 3}) {
    metrics::Registry registry;
    Engine engine(EngineConfig{}, executor(k), tokenizer(), eos_ids(*tok_, {}), registry);
    const std::string text = registry.render();
    for (int64_t p = 0; p < 4; ++p) {
      const std::string position = "position=\"" + std::to_string(p) + "\"";
      bool found = false;
      std::istringstream in(text);
      for (std::string line; std::getline(in, line);)
        found =
            found || (line.rfind("vllm:spec_decode_num_accepted_tokens_per_pos_total{", 0) == 0 &&
                      line.find(position) != std::string::npos && line.ends_with("} 0"));
      EXPECT_EQ(found, p < k) << "k " << k << " position " << p << "\n" << text;
    }
  }
}

TEST_F(Speculation, StopStringsAndMaxTokensCutAcceptedRunsWhereThePlainRunStops) {
  const auto prompt = prompt_of(11, 900);
  const auto ids = plain_greedy_ids(prompt, 24);
  // Stop at the text of the continuation's 7th token: it arrives inside an accepted run.
  const std::string stop = tok_->decode(std::span(&ids[6], 1), true);
  ASSERT_FALSE(stop.empty());
  std::vector<RequestSpec> requests(3, {prompt, greedy_params(24)});
  requests[1].sampling.max_tokens = 5;
  requests[2].sampling.stop = {stop};
  std::map<std::vector<int32_t>, std::vector<int32_t>> continuations{{prompt, ids}};
  auto ex =
      std::make_unique<OracleDrafts>(executor(3), continuations, [](int64_t) { return false; });
  const auto answers = serve(std::move(ex), requests);

  EXPECT_EQ(answers[0].tokens, ids);
  EXPECT_EQ(answers[1].tokens, std::vector<int32_t>(ids.begin(), ids.begin() + 5));
  EXPECT_EQ(answers[1].finish_reason, "length");
  auto stopped = greedy_params(24);
  stopped.stop = {stop};
  const GenerationResult plain = generate(*model_, *tok_, prompt, stopped);
  EXPECT_EQ(answers[2].text, plain.text);
  EXPECT_EQ(answers[2].finish_reason, "stop");
  EXPECT_LT(answers[2].tokens.size(), ids.size());
}

TEST_F(Speculation, PreemptionUnderATinyCacheStillAnswersExactly) {
  // 14 blocks of 4 tokens: three requests of 14 + 12 tokens cannot all stay.
  const std::vector<RequestSpec> requests = {{prompt_of(14, 100), greedy_params(12)},
                                             {prompt_of(14, 200), greedy_params(12)},
                                             {prompt_of(14, 300), greedy_params(12)}};
  std::map<std::vector<int32_t>, std::vector<int32_t>> continuations;
  for (const auto& r : requests) continuations[r.prompt] = plain_greedy_ids(r.prompt, 12);
  metrics::Registry registry;
  LoadReport load;
  auto ex = std::make_unique<OracleDrafts>(executor(2, /*num_blocks=*/14), continuations,
                                           [](int64_t p) { return p % 4 == 1; });
  const auto answers = serve(std::move(ex), requests, 2048, &load, &registry);
  for (size_t i = 0; i < requests.size(); ++i)
    EXPECT_EQ(answers[i].tokens, continuations[requests[i].prompt]) << "#" << i;
  EXPECT_GT(metric(registry, "vllm:num_preemptions_total"), 0);
  EXPECT_EQ(load.free_blocks, load.total_blocks);
}

// A seed asks for the same answer: seeded sampled requests under a tiny cache (preemption, and
// steps that verify fewer drafts than asked) answer the tokens of plain decoding, with the random
// module's drafts (mostly rejected) and with an oracle's (mostly accepted).
TEST_F(Speculation, SeededSampledAnswersAreThePlainRunsUnderPreemptionWhateverTheDrafts) {
  std::vector<RequestSpec> requests;
  for (int i = 0; i < 3; ++i) {
    SamplingParams p;
    p.temperature = 0.9;
    p.top_p = 0.95;
    p.seed = 40 + i;
    p.max_tokens = 12;
    p.ignore_eos = true;
    requests.push_back({prompt_of(14, 100 * (i + 1)), p});
  }
  const auto plain = serve(executor(0), requests);
  std::map<std::vector<int32_t>, std::vector<int32_t>> continuations;
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_EQ(plain[i].tokens.size(), 12u);
    continuations[requests[i].prompt] = plain[i].tokens;
  }
  for (const bool oracle : {false, true}) {
    SCOPED_TRACE(oracle ? "oracle drafts" : "the module's drafts");
    metrics::Registry registry;
    LoadReport load;
    std::unique_ptr<Executor> ex = executor(3, /*num_blocks=*/14);
    if (oracle)
      ex = std::make_unique<OracleDrafts>(std::move(ex), continuations,
                                          [](int64_t p) { return p % 5 == 2; });
    const auto answers = serve(std::move(ex), requests, 2048, &load, &registry);
    for (size_t i = 0; i < requests.size(); ++i)
      EXPECT_EQ(answers[i].tokens, plain[i].tokens) << "#" << i;
    EXPECT_GT(metric(registry, "vllm:num_preemptions_total"), 0);
    if (oracle) {
      EXPECT_GT(metric(registry, "vllm:spec_decode_num_accepted_tokens_total"), 10);
    }
    EXPECT_EQ(load.free_blocks, load.total_blocks);
  }
}

TEST_F(Speculation, LogprobsOfAcceptedTokensAreThoseOfPlainDecoding) {
  const auto prompt = prompt_of(9, 1200);
  RequestSpec r{prompt, greedy_params(10), 3};
  const auto plain = serve(executor(0), {r});
  std::map<std::vector<int32_t>, std::vector<int32_t>> continuations{{prompt, plain[0].tokens}};
  auto ex =
      std::make_unique<OracleDrafts>(executor(2), continuations, [](int64_t p) { return p == 4; });
  const auto spec = serve(std::move(ex), {r});
  ASSERT_EQ(spec[0].tokens, plain[0].tokens);
  ASSERT_EQ(spec[0].logprobs.size(), plain[0].logprobs.size());
  for (size_t i = 0; i < plain[0].logprobs.size(); ++i) {
    EXPECT_NEAR(spec[0].logprobs[i].logprob, plain[0].logprobs[i].logprob, 1e-5) << i;
    ASSERT_EQ(spec[0].logprobs[i].top.size(), 3u);
    for (size_t k = 0; k < 3; ++k) {
      EXPECT_EQ(spec[0].logprobs[i].top[k].first, plain[0].logprobs[i].top[k].first);
      EXPECT_NEAR(spec[0].logprobs[i].top[k].second, plain[0].logprobs[i].top[k].second, 1e-5);
    }
  }
}

TEST_F(Speculation, DraftsAreTheMtpModulesPredictionOverTheWholeSequence) {
  // Two drafts per step. The first: the module's argmax after the step's last verified token,
  // computed with its latent cache filled chunk by chunk and step by step, must be what the
  // module predicts when it sees the whole sequence in one pass. The second: the module once
  // more, one position further, fed the first draft and its own hidden state.
  auto requests = mixed_requests(10);
  requests.resize(3);
  auto log = std::make_shared<DraftRecorder::Log>();
  serve(std::make_unique<DraftRecorder>(executor(2), log), requests, /*max_batched_tokens=*/16);
  const auto no_text = ids_without_text(*tok_, model_->config().vocab_size);
  const int64_t vocab = model_->config().vocab_size;
  // The draft must be the argmax, or within float32 noise of it (a near-tie).
  auto expect_argmax = [&](std::span<float> logits, int32_t draft, const std::string& what) {
    for (auto id : no_text) logits[size_t(id)] = -std::numeric_limits<float>::infinity();
    const auto best = std::max_element(logits.begin(), logits.begin() + vocab);
    if (draft != static_cast<int32_t>(best - logits.begin())) {
      EXPECT_NEAR(logits[size_t(draft)], *best, 1e-4) << what;
    }
  };
  ASSERT_FALSE(log->empty());
  int64_t checked = 0;
  for (const auto& p : *log) {
    ASSERT_EQ(p.drafts.size(), 2u);
    const auto& seq = p.sequence;  // ends with the token the drafts follow
    const auto n = static_cast<int64_t>(seq.size());
    const int64_t blocks = (n + 4) / 4;
    model::LatentCache cache(model_->cache_shape(4), blocks);
    std::vector<int32_t> table;
    for (int32_t b = 0; b < blocks; ++b) table.push_back(b);
    const std::span<const int32_t> main_tokens(seq.data(), size_t(n - 1));
    model::SequenceStep step{main_tokens, 0, table, model::LogitRows::kNone};
    const auto main = model_->forward(std::span(&step, 1), cache);
    model::SequenceStep mtp{std::span<const int32_t>(seq).subspan(1), 0, table,
                            model::LogitRows::kLast};
    auto first = model_->forward_mtp(std::span(&mtp, 1), main.hidden.data(), cache);
    expect_argmax(first.logits, p.drafts[0], "first draft after " + std::to_string(n));
    const int32_t fed = p.drafts[0];
    model::SequenceStep again{std::span(&fed, 1), n - 1, table, model::LogitRows::kLast};
    auto second = model_->forward_mtp(
        std::span(&again, 1), first.hidden.data() + (n - 2) * model_->config().hidden_size, cache);
    expect_argmax(second.logits, p.drafts[1], "second draft after " + std::to_string(n));
    ++checked;
  }
  EXPECT_EQ(checked, 3 * 10);  // drafts after every sampled token
}

TEST_F(Speculation, SampledRequestsFinishWithSpeculation) {
  // Rejection sampling end to end (its distribution is tested in sampler_test): every request
  // answers its tokens, seeded runs repeat.
  std::vector<RequestSpec> requests;
  for (int i = 0; i < 3; ++i) {
    SamplingParams p;
    p.temperature = 0.9;
    p.top_p = 0.95;
    p.repetition_penalty = 1.1;
    p.seed = 7 + i;
    p.max_tokens = 10;
    p.ignore_eos = true;
    requests.push_back({prompt_of(6 + i, 700), p});
  }
  const auto a = serve(executor(2), requests);
  const auto b = serve(executor(2), requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(a[i].tokens.size(), 10u);
    EXPECT_EQ(a[i].tokens, b[i].tokens);
  }
}

// A request whose format cannot go on (here: its one choice is written and, with no end ids in
// this engine, nothing may follow) fails alone, with a 400; the request batched with it, in every
// step, answers as if alone. With and without drafts (verify() as well as sample()).
TEST_F(Speculation, AFormatThatCannotGoOnFailsItsRequestAloneNotItsBatch) {
  for (int64_t k : {0, 1}) {
    SCOPED_TRACE("speculative tokens " + std::to_string(k));
    metrics::Registry registry;
    Engine engine(EngineConfig{}, executor(k), tokenizer(), /*eos_ids=*/{}, registry);
    struct Outcome {
      std::string text, finish_reason, error;
      int status = 0;
      std::promise<void> done;
    };
    Outcome constrained, plain;
    auto request = [](std::string id, std::vector<int32_t> prompt, SamplingParams sampling,
                      Outcome& outcome) {
      EngineRequest r;
      r.id = std::move(id);
      r.prompt = std::move(prompt);
      r.sampling = std::move(sampling);
      r.on_output = [&outcome](const RequestOutput& o) {
        outcome.text += o.text;
        if (!o.finished) return;
        outcome.finish_reason = o.finish_reason;
        outcome.error = o.error;
        outcome.status = o.error_status;
        outcome.done.set_value();
      };
      return r;
    };
    SamplingParams choice = greedy_params(20);
    choice.structured_output = structured::OutputSpec{structured::OutputSpec::Kind::kChoice,
                                                      R"(["yes"])", "guided_choice"};
    // Submitted before the loop starts: both are in every step until the first one fails.
    engine.submit(request("constrained", prompt_of(5, 100), choice, constrained));
    engine.submit(request("plain", prompt_of(7, 300), greedy_params(16), plain));
    engine.start();
    auto constrained_done = constrained.done.get_future();
    auto plain_done = plain.done.get_future();
    get_within(constrained_done, kHangGuard, "the constrained request never ended");
    get_within(plain_done, kHangGuard, "the plain request never ended");
    engine.stop();
    EXPECT_EQ(constrained.finish_reason, "error");
    EXPECT_NE(constrained.error.find("no token can continue the answer"), std::string::npos)
        << constrained.error;
    EXPECT_EQ(constrained.status, 400);
    EXPECT_EQ(constrained.text, "yes");  // what was written before it failed
    EXPECT_EQ(plain.finish_reason, "length") << plain.error;
    EXPECT_EQ(plain.text, plain_greedy(prompt_of(7, 300), 16));
  }
}

// The grammar the API compiled with a request lives in the engine's cache or nowhere. A request of
// a spec the cache has already kept its own grammar alive through its copies of the sampling
// parameters (sampler, output processor, the request) for as long as it ran: ~30 MB each for a
// large grammar, per request in flight.
TEST_F(Speculation, AGrammarCompiledWithARequestIsKeptOnlyByTheEnginesCache) {
  metrics::Registry registry;
  Engine engine(EngineConfig{}, executor(0), tokenizer(), eos_ids(*tok_, {}), registry);
  const structured::OutputSpec spec{structured::OutputSpec::Kind::kJsonObject, "",
                                    "response_format"};
  std::vector<std::weak_ptr<const structured::Grammar>> grammars;
  for (int i = 0; i < 2; ++i) {
    SamplingParams p = greedy_params(50);
    p.structured_output = spec;
    p.structured_output->compiled = structured::compile(spec);
    grammars.push_back(p.structured_output->compiled);
    EngineRequest r;
    r.id = "r" + std::to_string(i);
    r.prompt = prompt_of(5, 100 + 10 * i);
    r.sampling = std::move(p);
    r.on_output = [](const RequestOutput&) {};
    engine.submit(std::move(r));
  }
  engine.run_once();  // admits both: the first one's grammar goes to the cache
  ASSERT_EQ(engine.load().running + engine.load().waiting, 2);  // both still run
  EXPECT_FALSE(grammars[0].expired());
  EXPECT_TRUE(grammars[1].expired()) << "the second request keeps a grammar the cache has";
  engine.stop();
}

// The engine's own check (what the API does not see: a request made in process, a P/D leg):
// the prompt plus max_tokens near 2^63 wrapped negative and passed, and the request then grew
// until the cache was full.
TEST_F(Speculation, MaxTokensNearTheLargestIntegerIsRefusedNotWrapped) {
  metrics::Registry registry;
  Engine engine(EngineConfig{}, executor(0), tokenizer(), eos_ids(*tok_, {}), registry);
  auto refusal = [&](int64_t max_tokens) {
    EngineRequest r;
    r.id = "r";
    r.prompt = prompt_of(5, 100);
    r.sampling = greedy_params(max_tokens);
    try {
      engine.check(r);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  for (int64_t huge : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max() - 4,
                       int64_t(1) << 62})
    EXPECT_NE(refusal(huge).find("plus max_tokens (" + std::to_string(huge) + ") exceeds"),
              std::string::npos)
        << huge;
  // 256 blocks of 4 tokens: the cache, not the model's context, bounds a sequence, and the
  // limits the API derives a chat request's default max_tokens from say so.
  const int64_t cache = engine.executor_info().num_blocks * engine.executor_info().block_size;
  ASSERT_LT(cache, engine.executor_info().max_model_len);
  EXPECT_EQ(engine.max_model_len(), cache);
  EXPECT_EQ(engine.request_limits().max_model_len, cache);
  EXPECT_NE(refusal(cache - 4).find("exceeds this engine's KV cache (--kv-cache-gb, "
                                    "--num-kv-blocks) of " +
                                    std::to_string(cache) + " tokens"),
            std::string::npos)
      << refusal(cache - 4);
  EXPECT_EQ(refusal(cache - 5), "(accepted)");
}

// The operator's --max-model-len lowers the longest sequence below the model's context and the
// cache; it never raises it.
TEST_F(Speculation, TheLongestSequenceIsTheLeastOfContextFlagAndCache) {
  auto longest = [&](int64_t flag, int64_t blocks) {
    metrics::Registry registry;
    EngineConfig config;
    config.max_model_len = flag;
    Engine engine(config, executor(0, blocks), tokenizer(), eos_ids(*tok_, {}), registry);
    return engine.max_model_len();
  };
  const int64_t context = model_->config().max_position_embeddings;
  ASSERT_LT(context, 4 * 50000);
  EXPECT_EQ(longest(0, 50000), context);
  EXPECT_EQ(longest(100, 50000), 100);
  EXPECT_EQ(longest(100, 16), 64);
  EXPECT_EQ(longest(context + 1000, 50000), context);
}

TEST_F(Speculation, EnginesThatCannotSpeculateRefuseToStart) {
  // tiny-v2-lite has no MTP module; a simulated model speculates with an acceptance model, which
  // must be probabilities.
  const auto dir = test::temp_path("no-mtp").replace_extension();
  const auto log = test::temp_path("no-mtp-log");
  ASSERT_EQ(
      test::run_command(std::string(TANDEM_BINARY) + " make-model --preset tiny-v2-lite --out " +
                        test::quote(dir) + " >/dev/null 2>&1"),
      0);
  auto refusal = [&](const std::string& model) {
    const int status = test::run_command(
        std::string(TANDEM_BINARY) + " engine --model " + model +
        " --port 0 --speculative-tokens 1 --sim-mtp-acceptance 1.5 >" + test::quote(log) + " 2>&1");
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    EXPECT_NE(status, 0) << model;
    return text.str();
  };
  EXPECT_NE(refusal(test::quote(dir)).find("MTP module"), std::string::npos);
  EXPECT_NE(refusal("sim:tiny").find("--sim-mtp-acceptance"), std::string::npos);
  std::filesystem::remove_all(dir);
  std::filesystem::remove(log);
}

// BF16 kernels pick a product by a step's token count, and how many drafts a greedy request's
// verify step carries varies (max_tokens, the budget and free blocks bound it), so outputs are
// plain decoding's exactly only under batch-invariant numerics (--batch-invariant), which this
// suite runs under. Without it the tenth token of this prompt changed with max_tokens.
class SpeculationBf16 : public test::TinyModelTest<kBf16> {
 protected:
  static void SetUpTestSuite() {
    // Before the model loads: which weight copies it keeps depends on the numerics.
    kernels::set_batch_invariant(true);
    TinyModelTest::SetUpTestSuite();
  }
  static void TearDownTestSuite() {
    TinyModelTest::TearDownTestSuite();
    kernels::set_batch_invariant(false);
  }
  static std::vector<int32_t> greedy(int64_t k, const std::vector<int32_t>& prompt,
                                     int64_t max_tokens) {
    CpuExecutorOptions o;
    o.speculative_tokens = k;
    auto ex = std::make_unique<CpuExecutor>(
        std::shared_ptr<const model::DeepSeekModel>(model_.get(), [](const auto*) {}), *tok_,
        "tiny", o);
    const auto answers = serve_on({tok_.get(), [](const auto*) {}}, std::move(ex),
                                  {{prompt, greedy_params(max_tokens)}});
    EXPECT_EQ(answers[0].error, "");
    return answers[0].tokens;
  }
};

TEST_F(SpeculationBf16, GreedyOutputsEqualPlainDecodingWhateverMaxTokensLeavesForDrafts) {
  const std::vector<int32_t> prompt = {341, 348, 355, 362, 369, 376, 383, 390, 397, 404, 411};
  for (int64_t max_tokens = 8; max_tokens <= 16; ++max_tokens)
    EXPECT_EQ(greedy(2, prompt, max_tokens), greedy(0, prompt, max_tokens))
        << "max_tokens " << max_tokens;
}

}  // namespace
}  // namespace tandem::engine
