// What an engine exports under vLLM's names besides its gauges and token counters: the token
// histograms of finished requests (vllm:request_prompt_tokens, vllm:request_generation_tokens,
// vllm:request_params_max_tokens; per prompt vllm:request_params_n and
// vllm:request_max_num_generation_tokens), vllm:iteration_tokens_total per step,
// vllm:inter_token_latency_seconds per decode step and vllm:cache_config_info. Each is read back
// through the Prometheus oracle (util/prometheus_oracle.h) after requests whose counts are known:
// its type, its labels (model_name, as every engine series), vLLM's bucket bounds
// (vllm/v1/metrics/loggers.py) and its values. The engine runs a simulated executor in virtual
// time: run_once() steps it and the test's clock moves 1/32 s after each step, so there is no
// sleep and no wall-clock timing.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/generate.h"
#include "engine/generation_api.h"
#include "engine/kept_reply.h"
#include "engine/sim_engine_fixture.h"
#include "util/metrics.h"
#include "util/prometheus_oracle.h"

namespace tandem::engine {
namespace {

using nlohmann::json;
using Labels = std::map<std::string, std::string>;

constexpr double kStep = 1.0 / 32;  // virtual seconds per run_once (exact in binary)
constexpr int64_t kMaxModelLen = 1000;
const Labels kModel = {{"model_name", "tiny"}};

// vLLM's buckets: build_1_2_5_buckets(max_model_len) for token counts, and the fixed lists.
const std::vector<double> kTokenBuckets = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000};
const std::vector<double> kIterationBuckets = {1,   8,    16,   32,   64,   128,  256,
                                               512, 1024, 2048, 4096, 8192, 16384};
const std::vector<double> kNBuckets = {1, 2, 5, 10, 20};
const std::vector<double> kItlBuckets = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                         0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};

using testing::KeptReply;

// One histogram as the oracle read it.
struct Histogram {
  std::vector<double> bounds;           // the finite `le` values, in order
  std::map<double, double> cumulative;  // by `le` (+Inf: INFINITY)
  double sum = -1, count = -1;
  double bucket(double le) const {
    auto it = cumulative.find(le);
    return it == cumulative.end() ? -1 : it->second;
  }
};

double number(const json& v) {
  return v.is_number() ? v.get<double>() : NAN;
}

// The family `name` of the oracle's parse (a counter's without "_total"), of type `type`.
json family(const json& parsed, const std::string& name, const std::string& type) {
  for (const auto& f : parsed["families"])
    if (f["name"] == name) {
      EXPECT_EQ(f["type"], type) << name;
      return f;
    }
  ADD_FAILURE() << "no family " << name;
  return json{{"samples", json::array()}};
}

// The histogram `name`, whose every sample must be labelled model_name (and `le`) alone.
Histogram histogram(const json& parsed, const std::string& name) {
  Histogram h;
  const json f = family(parsed, name, "histogram");
  for (const auto& s : f["samples"]) {
    auto labels = s["labels"].get<Labels>();
    const std::string sample = s["name"];
    if (sample == name + "_bucket") {
      const std::string le = labels["le"];
      labels.erase("le");
      const double bound = le == "+Inf" ? INFINITY : std::stod(le);
      if (std::isfinite(bound)) h.bounds.push_back(bound);
      h.cumulative[bound] = number(s["value"]);
    } else if (sample == name + "_sum") {
      h.sum = number(s["value"]);
    } else if (sample == name + "_count") {
      h.count = number(s["value"]);
    } else {
      ADD_FAILURE() << "unexpected sample " << sample;
    }
    EXPECT_EQ(labels, kModel) << sample;
  }
  EXPECT_EQ(h.bucket(INFINITY), h.count) << name;
  return h;
}

// The value of the one sample of an unlabelled (but for model_name) counter or gauge.
double value(const json& parsed, const std::string& family_name, const std::string& type) {
  const json f = family(parsed, family_name, type);
  EXPECT_EQ(f["samples"].size(), 1u) << family_name;
  if (f["samples"].empty()) return NAN;
  EXPECT_EQ(f["samples"][0]["labels"].get<Labels>(), kModel) << family_name;
  return number(f["samples"][0]["value"]);
}

class EngineMetrics : public ::testing::Test {
 protected:
  EngineMetrics()
      : engine_(test::sim_engine(config(), test::deepseek_v3_tokenizer(), registry_,
                                 /*num_blocks=*/256, kMaxModelLen)),
        api_(*engine_, [](std::function<void()> task) { task(); }) {}
  ~EngineMetrics() override { engine_->stop(); }

  EngineConfig config() {
    EngineConfig c;
    c.clock = [this] { return now_; };
    return c;
  }

  void step() {
    engine_->run_once();
    now_ += kStep;
  }
  void run_until_idle() {
    for (int i = 0; i < 500 && engine_->has_work(); ++i) step();
    EXPECT_FALSE(engine_->has_work());
  }

  // A completion through the engine's API, stepped until it is answered.
  json complete(const json& body) {
    net::HttpRequest req;
    req.method = "POST";
    req.body = body.dump();
    auto reply = std::make_shared<KeptReply>();
    api_.handle(api::ApiKind::kCompletion, req, reply);
    for (int i = 0; i < 500 && !reply->done; ++i) step();
    EXPECT_TRUE(reply->done);
    EXPECT_EQ(reply->status, 200) << reply->body;
    run_until_idle();  // the step's bookkeeping after the answer
    return reply->status == 200 ? json::parse(reply->body) : json();
  }

  // An engine request of `max_tokens` tokens, as one of `choices` (null: alone); `*finished`
  // turns true with its last output.
  void submit(const std::string& id, std::vector<int32_t> prompt, int64_t max_tokens,
              std::shared_ptr<ChoiceGroup> choices, bool* finished) {
    EngineRequest r;
    r.id = id;
    r.prompt = std::move(prompt);
    r.sampling.max_tokens = max_tokens;
    r.choices = std::move(choices);
    r.on_output = [finished](const RequestOutput& o) {
      if (o.finished) *finished = true;
    };
    engine_->submit(std::move(r));
  }

  json scrape() const { return test::parse_prometheus(registry_.render()); }

  double now_ = 1000;
  metrics::Registry registry_;
  std::unique_ptr<Engine> engine_;
  GenerationApi api_;
};

// One request of 5 prompt tokens and 3 generated: one observation in each per-request histogram,
// in the bucket its count falls in; its steps in vllm:iteration_tokens_total as vLLM counts them
// (the prompt with its first token, then one token a step); its two decode gaps in
// vllm:inter_token_latency_seconds beside vllm:time_per_output_token_seconds.
TEST_F(EngineMetrics, OneRequestFillsVllmsHistogramsWithItsCounts) {
  const json r = complete({{"prompt", {1000, 2000, 3000, 4000, 5000}}, {"max_tokens", 3}});
  ASSERT_EQ(r["usage"]["prompt_tokens"], 5) << r.dump();
  ASSERT_EQ(r["usage"]["completion_tokens"], 3) << r.dump();
  const json m = scrape();

  const Histogram prompt = histogram(m, "vllm:request_prompt_tokens");
  EXPECT_EQ(prompt.bounds, kTokenBuckets);
  EXPECT_EQ(prompt.count, 1);
  EXPECT_EQ(prompt.sum, 5);
  EXPECT_EQ(prompt.bucket(2), 0);
  EXPECT_EQ(prompt.bucket(5), 1);

  const Histogram generated = histogram(m, "vllm:request_generation_tokens");
  EXPECT_EQ(generated.bounds, kTokenBuckets);
  EXPECT_EQ(generated.count, 1);
  EXPECT_EQ(generated.sum, 3);
  EXPECT_EQ(generated.bucket(2), 0);
  EXPECT_EQ(generated.bucket(5), 1);

  const Histogram max_tokens = histogram(m, "vllm:request_params_max_tokens");
  EXPECT_EQ(max_tokens.bounds, kTokenBuckets);
  EXPECT_EQ(max_tokens.count, 1);
  EXPECT_EQ(max_tokens.sum, 3);

  const Histogram n = histogram(m, "vllm:request_params_n");
  EXPECT_EQ(n.bounds, kNBuckets);
  EXPECT_EQ(n.count, 1);
  EXPECT_EQ(n.sum, 1);
  EXPECT_EQ(n.bucket(1), 1);

  const Histogram most = histogram(m, "vllm:request_max_num_generation_tokens");
  EXPECT_EQ(most.bounds, kTokenBuckets);
  EXPECT_EQ(most.count, 1);
  EXPECT_EQ(most.sum, 3);

  // Steps: 5 prompt tokens with the first generated (6), then 1 and 1.
  const Histogram iteration = histogram(m, "vllm:iteration_tokens_total");
  EXPECT_EQ(iteration.bounds, kIterationBuckets);
  EXPECT_EQ(iteration.count, 3);
  EXPECT_EQ(iteration.sum, 8);
  EXPECT_EQ(iteration.bucket(1), 2);
  EXPECT_EQ(iteration.bucket(8), 3);
  EXPECT_EQ(iteration.sum, value(m, "vllm:prompt_tokens", "counter") +
                               value(m, "vllm:generation_tokens", "counter"));

  // Two decode steps, kStep apart from the step before.
  const Histogram itl = histogram(m, "vllm:inter_token_latency_seconds");
  EXPECT_EQ(itl.bounds, kItlBuckets);
  EXPECT_EQ(itl.count, 2);
  EXPECT_EQ(itl.sum, 2 * kStep);
  EXPECT_EQ(itl.bucket(0.025), 0);
  EXPECT_EQ(itl.bucket(0.05), 2);
  const Histogram tpot = histogram(m, "vllm:time_per_output_token_seconds");  // kept beside it
  EXPECT_EQ(tpot.bounds, kItlBuckets);
  EXPECT_EQ(tpot.count, 2);

  // The cache's configuration in the labels of a gauge of 1.
  const json info = family(m, "vllm:cache_config_info", "gauge");
  ASSERT_EQ(info["samples"].size(), 1u);
  EXPECT_EQ(info["samples"][0]["labels"].get<Labels>(),
            (Labels{{"model_name", "tiny"},
                    {"block_size", "16"},
                    {"num_gpu_blocks", "256"},
                    {"enable_prefix_caching", "True"}}));
  EXPECT_EQ(number(info["samples"][0]["value"]), 1);
}

// The choices of one prompt (the API's n) count once in vllm:request_params_n and
// vllm:request_max_num_generation_tokens, with the most any of them generated, when the last one
// finishes; a request alone counts as n = 1 when it finishes. The per-request histograms count
// every choice.
TEST_F(EngineMetrics, ChoicesOfOnePromptCountOnceWithTheLongestWhenTheLastFinishes) {
  auto group = std::make_shared<ChoiceGroup>(2);
  bool short_done = false, long_done = false, lone_done = false;
  submit("short", {1000, 2000, 3000}, 2, group, &short_done);
  submit("long", {1000, 2000, 3000}, 6, group, &long_done);
  submit("lone", {4000, 5000, 6000, 7000}, 4, nullptr, &lone_done);
  for (int i = 0; i < 100 && !short_done; ++i) step();
  ASSERT_TRUE(short_done);
  ASSERT_FALSE(long_done);
  ASSERT_FALSE(lone_done);
  {
    const json m = scrape();
    EXPECT_EQ(histogram(m, "vllm:request_generation_tokens").count, 1);
    EXPECT_EQ(histogram(m, "vllm:request_params_n").count, 0);  // its other choice still runs
    EXPECT_EQ(histogram(m, "vllm:request_max_num_generation_tokens").count, 0);
  }
  run_until_idle();
  ASSERT_TRUE(long_done && lone_done);
  const json m = scrape();
  const Histogram n = histogram(m, "vllm:request_params_n");
  EXPECT_EQ(n.count, 2);
  EXPECT_EQ(n.sum, 3);
  EXPECT_EQ(n.bucket(1), 1);
  EXPECT_EQ(n.bucket(2), 2);
  const Histogram most = histogram(m, "vllm:request_max_num_generation_tokens");
  EXPECT_EQ(most.count, 2);
  EXPECT_EQ(most.sum, 6 + 4);  // the group's longest, and the lone request's
  EXPECT_EQ(most.bucket(5), 1);
  EXPECT_EQ(most.bucket(10), 2);
  const Histogram generated = histogram(m, "vllm:request_generation_tokens");
  EXPECT_EQ(generated.count, 3);
  EXPECT_EQ(generated.sum, 2 + 6 + 4);
  const Histogram max_tokens = histogram(m, "vllm:request_params_max_tokens");
  EXPECT_EQ(max_tokens.count, 3);
  EXPECT_EQ(max_tokens.sum, 2 + 6 + 4);
}

// The API makes a prompt's n choices one group: two prompts with n = 3 are two observations of
// n = 3 (not six of 1), while every choice is a finished request of its own.
TEST_F(EngineMetrics, TheApiGroupsEachPromptsChoices) {
  const json r = complete({{"prompt", {{1000, 2000, 3000, 4000, 5000}, {6000, 7000, 8000}}},
                           {"n", 3},
                           {"max_tokens", 2}});
  ASSERT_EQ(r["choices"].size(), 6u) << r.dump();
  const json m = scrape();
  const Histogram n = histogram(m, "vllm:request_params_n");
  EXPECT_EQ(n.count, 2);
  EXPECT_EQ(n.sum, 6);
  EXPECT_EQ(n.bucket(2), 0);
  EXPECT_EQ(n.bucket(5), 2);
  const Histogram most = histogram(m, "vllm:request_max_num_generation_tokens");
  EXPECT_EQ(most.count, 2);
  EXPECT_EQ(most.sum, 4);
  const Histogram prompt = histogram(m, "vllm:request_prompt_tokens");
  EXPECT_EQ(prompt.count, 6);
  EXPECT_EQ(prompt.sum, 3 * 5 + 3 * 3);
  EXPECT_EQ(prompt.bucket(2), 0);
  EXPECT_EQ(prompt.bucket(5), 6);
}

// TTFT and e2e latency count from submit(), not from when the loop took the request in: one
// submitted while the loop was busy (the clock moves half a second before the next run_once) has
// that half second in them, as vLLM's from its API server's arrival. Queue time counts from the
// loop taking it in, as vLLM's from its engine core's QUEUED event (recorded between steps).
// vLLM's prefill, decode and inference times split what follows its first scheduling.
TEST_F(EngineMetrics, LatenciesCountFromSubmitAndSplitAsVllmDoes) {
  bool finished = false;
  submit("late", {1000, 2000, 3000, 4000, 5000}, 3, nullptr, &finished);
  now_ += 0.5;  // the step the request arrived during
  run_until_idle();
  ASSERT_TRUE(finished);
  const json m = scrape();
  const auto latency = [&](const std::string& name) {
    const Histogram h = histogram(m, name);
    EXPECT_EQ(h.bounds, metrics::vllm_request_latency_buckets()) << name;
    EXPECT_EQ(h.count, 1) << name;
    return h.sum;
  };
  EXPECT_EQ(latency("vllm:request_queue_time_seconds"), 0);  // scheduled as it was taken in
  EXPECT_EQ(histogram(m, "vllm:time_to_first_token_seconds").sum, 0.5);
  // First token in the first step, then one token a step: the last two steps later.
  EXPECT_EQ(latency("vllm:e2e_request_latency_seconds"), 0.5 + 2 * kStep);
  EXPECT_EQ(latency("vllm:request_prefill_time_seconds"), 0);  // the clock stands within a step
  EXPECT_EQ(latency("vllm:request_decode_time_seconds"), 2 * kStep);
  EXPECT_EQ(latency("vllm:request_inference_time_seconds"), 2 * kStep);
}

// A request that never ran has no prefill, decode or inference time; it still finishes.
TEST_F(EngineMetrics, ARequestAbortedBeforeItsFirstStepHasNoInferenceTime) {
  bool finished = false;
  submit("gone", {1000, 2000, 3000}, 3, nullptr, &finished);
  engine_->abort("gone");
  run_until_idle();
  ASSERT_TRUE(finished);
  const json m = scrape();
  EXPECT_EQ(histogram(m, "vllm:e2e_request_latency_seconds").count, 1);
  EXPECT_EQ(histogram(m, "vllm:request_prefill_time_seconds").count, 0);
  EXPECT_EQ(histogram(m, "vllm:request_decode_time_seconds").count, 0);
  EXPECT_EQ(histogram(m, "vllm:request_inference_time_seconds").count, 0);
}

// A request is counted before its last output is handed on: a client that reads /metrics once
// answered (the engine thread posts the answer to the HTTP thread, which renders /metrics) finds
// it there, whether it ran to its length or was aborted while waiting.
TEST_F(EngineMetrics, ARequestIsCountedBeforeItsLastOutputIsHandedOn) {
  std::map<std::string, double> seen;  // request id -> its reason's count when it was answered
  auto submit_reading = [&](const std::string& id) {
    EngineRequest r;
    r.id = id;
    r.prompt = {1000, 2000, 3000};
    r.sampling.max_tokens = 2;
    r.on_output = [&, id](const RequestOutput& o) {
      if (!o.finished) return;
      const json counts = family(scrape(), "vllm:request_success", "counter");
      for (const auto& s : counts["samples"])
        if (s["labels"]["finished_reason"] == o.finish_reason) seen[id] = number(s["value"]);
    };
    engine_->submit(std::move(r));
  };
  submit_reading("runs");
  run_until_idle();
  submit_reading("gone");
  engine_->abort("gone");
  run_until_idle();
  EXPECT_EQ(seen, (std::map<std::string, double>{{"gone", 1}, {"runs", 1}}));
}

// Every finished reason vLLM knows is a series from the start, at 0, so that rate() and
// increase() see the first abort or error.
TEST_F(EngineMetrics, EveryFinishedReasonIsASeriesFromTheStart) {
  const json f = family(scrape(), "vllm:request_success", "counter");
  std::map<std::string, double> by_reason;
  for (const auto& s : f["samples"]) {
    auto labels = s["labels"].get<Labels>();
    by_reason[labels["finished_reason"]] = number(s["value"]);
  }
  EXPECT_EQ(by_reason,
            (std::map<std::string, double>{
                {"abort", 0}, {"error", 0}, {"length", 0}, {"repetition", 0}, {"stop", 0}}));
}

// The engine's role is a gauge of 1 in tandem:engine_info, which dashboards join on to count a
// P/D request's legs once.
TEST_F(EngineMetrics, TheEnginesRoleIsAnInfoMetric) {
  const json info = family(scrape(), "tandem:engine_info", "gauge");
  ASSERT_EQ(info["samples"].size(), 1u);
  EXPECT_EQ(info["samples"][0]["labels"].get<Labels>(),
            (Labels{{"model_name", "tiny"}, {"role", "both"}}));
  EXPECT_EQ(number(info["samples"][0]["value"]), 1);
}

// /load's steps counts the steps that ran: not the constructor, not a submission taken in, not a
// run_once with nothing to do.
TEST_F(EngineMetrics, LoadCountsStepsThatRan) {
  EXPECT_EQ(engine_->load().steps, 0u);
  bool finished = false;
  submit("a", {1000, 2000, 3000}, 3, nullptr, &finished);
  run_until_idle();  // a prefill step with the first token, then one a step
  ASSERT_TRUE(finished);
  EXPECT_EQ(engine_->load().steps, 3u);
  engine_->run_once();
  EXPECT_EQ(engine_->load().steps, 3u);
}

}  // namespace
}  // namespace tandem::engine
