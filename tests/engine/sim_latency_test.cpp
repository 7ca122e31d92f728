// Tests of src/engine/executor/sim_latency: the presets reproduce the published figures they
// were derived from (sources in sim_latency.cpp), the model is monotonic in every kind of work,
// the fit recovers known parameters, and the JSON form round-trips and rejects bad input.
#include "engine/executor/sim_latency.h"

#include <unistd.h>
#include <array>
#include <cmath>

#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "util/error.h"

namespace tandem::engine {
namespace {

// Deterministic uniform [0, 1) from the raw generator (distributions differ between libraries).
double uniform(std::mt19937_64& gen) {
  return static_cast<double>(gen() >> 11) * 0x1.0p-53;
}
int64_t uniform_int(std::mt19937_64& gen, int64_t lo, int64_t hi) {
  return lo + static_cast<int64_t>(uniform(gen) * static_cast<double>(hi - lo + 1));
}

StepShape prefill_batch(int64_t prompts, int64_t new_tokens, int64_t context_tokens = 0) {
  StepShape s;
  s.prefills.assign(prompts, PrefillPart{new_tokens, context_tokens});
  return s;
}

StepShape decode_batch(int64_t seqs, int64_t tokens_per_seq, int64_t context_per_seq) {
  StepShape s;
  s.decode_seqs = seqs;
  s.decode_tokens = seqs * tokens_per_seq;
  s.decode_context_tokens = seqs * context_per_seq;
  return s;
}

void expect_within(double value, double target, double rel, const std::string& what) {
  EXPECT_NEAR(value / target, 1.0, rel) << what << ": " << value << " vs " << target;
}

TEST(SimLatency, DeepSeekH800ReproducesItsSources) {
  const auto m = SimLatencyModel::preset("deepseek-v3-h800");
  EXPECT_EQ(m.name(), "deepseek-v3-h800");
  // DeepSeek profile, decode: 128 requests/GPU, KV 4,096: 18,598 tok/s per node of 8 GPUs.
  const double profile_step = m.step_seconds(decode_batch(128, 1, 4096));
  expect_within(128 / profile_step, 18598.0 / 8, 0.02, "profile decode tok/s/GPU");
  // Day-6 production: 1,850 tok/s/GPU at 20-22 tok/s per user, average KV 4,989 (88 users).
  const double production_step = m.step_seconds(decode_batch(88, 1, 4989));
  EXPECT_GE(1 / production_step, 20.0);
  EXPECT_LE(1 / production_step, 22.0);
  expect_within(88 / production_step, 14800.0 / 8, 0.03, "production decode tok/s/GPU");
  // DeepSeek profile, prefill: 16,384 tokens/GPU of 4K prompts: 62,713 tok/s per node.
  const double t4k = m.step_seconds(prefill_batch(4, 4096));
  expect_within(16384 / t4k, 62713.0 / 8, 0.02, "profile prefill tok/s/GPU");
  // SGLang EP32 prefill, 1K / 2K / 4K prompts: 57,674 / 54,543 / 50,302 tok/s per node.
  expect_within(t4k / m.step_seconds(prefill_batch(16, 1024)), 57674.0 / 50302, 0.02, "1K/4K");
  expect_within(t4k / m.step_seconds(prefill_batch(8, 2048)), 54543.0 / 50302, 0.02, "2K/4K");
  // Production prefill (4,383-token prompts, 56.3% cached) averaged 32,206 uncached tok/s per
  // node over the day; the model's capacity must be at least that.
  const double t_cached = m.step_seconds(prefill_batch(8, 1915, 2468));
  EXPECT_GT(8 * 1915 / t_cached, 32206.0 / 8);
}

TEST(SimLatency, DeepSeekH20ReproducesItsSources) {
  const auto m = SimLatencyModel::preset("deepseek-v3-h20");
  // Ant Group on H20, MTP 1/1/2 (2 tokens per sequence per step, accept length 1.85), inputs
  // 4,096 and outputs 1,536 (mean context 4,864): 43 / 278 / 675 tok/s/GPU at BS 1 / 8 / 32.
  const double accept = 1.85;
  const std::vector<std::pair<int64_t, double>> figures = {{1, 43}, {8, 278}, {32, 675}};
  for (const auto& [bs, tok_s] : figures) {
    const double step = m.step_seconds(decode_batch(bs, 2, 4864));
    expect_within(bs * accept / step, tok_s, 0.02, "H20 decode BS " + std::to_string(bs));
  }
  // SLA tiers: 32 sequences/GPU meet TPOT < 50 ms, 48 meet TPOT < 70 ms.
  EXPECT_LT(m.step_seconds(decode_batch(32, 2, 4864)) / accept, 0.050);
  EXPECT_LT(m.step_seconds(decode_batch(48, 2, 4864)) / accept, 0.070);
  // Prefill: H800's per-token costs scaled by the compute ratio 989/148 (an estimate).
  const auto h800 = SimLatencyModel::preset("deepseek-v3-h800");
  expect_within(m.params().prefill_token_s / h800.params().prefill_token_s, 989.0 / 148, 0.01,
                "prefill token cost ratio");
  expect_within(m.params().prefill_pair_s / h800.params().prefill_pair_s, 989.0 / 148, 0.01,
                "prefill pair cost ratio");
  const double tput = 16384 / m.step_seconds(prefill_batch(4, 4096));
  EXPECT_GT(tput, 1000);
  EXPECT_LT(tput, 1300);
}

// An estimate from H100's published peaks and Qwen3-30B-A3B's published sizes (see the preset):
// it must reproduce the anchors it was derived from.
TEST(SimLatency, Qwen3H100ReproducesItsRooflineAnchors) {
  const auto m = SimLatencyModel::preset("qwen3-30b-a3b-h100");
  const double bandwidth = 3.35e12, compute = 0.6 * 989e12;
  // Batch 1 reads the 3.3B active BF16 parameters; batch 64 nearly every weight plus compute.
  expect_within(m.step_seconds(decode_batch(1, 1, 0)), 3.3e9 * 2 / bandwidth, 0.01, "batch 1");
  expect_within(m.step_seconds(decode_batch(64, 1, 0)),
                (1 - std::pow(120.0 / 128, 64)) * 61e9 / bandwidth + 64 * 6.6e9 / compute, 0.02,
                "batch 64");
  // Attention per cached token: its K and V over all layers at full bandwidth.
  expect_within(m.params().decode_pair_s, 48.0 * 2 * 4 * 128 * 2 / bandwidth, 0.01, "pair");
  expect_within(m.params().prefill_token_s, 6.6e9 / compute, 0.01, "prefill token");
  expect_within(m.params().prefill_pair_s, 48.0 * 32 * 2 * 2 * 128 / compute, 0.01, "prefill pair");
}

TEST(SimLatency, TinyIsFastButNotFree) {
  const auto m = SimLatencyModel::preset("tiny");
  const double prefill = m.step_seconds(prefill_batch(1, 100));
  EXPECT_GT(prefill, 1e-3);
  EXPECT_LT(prefill, 10e-3);
  const double decode = m.step_seconds(decode_batch(4, 1, 100));
  EXPECT_GT(decode, 1e-3);
  EXPECT_LT(decode, 5e-3);
}

TEST(SimLatency, FormulaOnAHandComputedShape) {
  const SimLatencyModel m({.step_s = 1,
                           .prefill_token_s = 10,
                           .prefill_pair_s = 100,
                           .decode_token_s = 1000,
                           .decode_seq_s = 10000,
                           .decode_pair_s = 100000},
                          "hand");
  StepShape s;
  s.prefills = {{3, 5}, {2, 0}};  // pairs: 3*5 + 3*4/2 = 21, and 2*3/2 = 3
  s.decode_seqs = 2;
  s.decode_tokens = 4;          // one draft each
  s.decode_context_tokens = 7;  // pairs: 7 * 4 / 2 = 14
  const StepFeatures f = step_features(s);
  EXPECT_EQ(f.prefill_tokens, 5);
  EXPECT_EQ(f.prefill_pairs, 24);
  EXPECT_EQ(f.decode_tokens, 4);
  EXPECT_EQ(f.decode_seqs, 2);
  EXPECT_EQ(f.decode_pairs, 14);
  EXPECT_EQ(m.step_seconds(s), 1 + 10 * 5 + 100 * 24 + 1000 * 4 + 10000 * 2 + 100000 * 14);
  EXPECT_EQ(m.step_seconds(StepShape{}), 0);  // an empty step has no fixed cost
  EXPECT_EQ(SimLatencyModel().step_seconds(s), 0);
}

TEST(SimLatency, AddingWorkNeverMakesAStepFaster) {
  std::mt19937_64 gen(7);
  for (const std::string& name : SimLatencyModel::preset_names()) {
    const auto m = SimLatencyModel::preset(name);
    const bool strict = name == "tiny";  // every parameter of tiny is positive
    auto check = [&](const StepShape& base, const StepShape& more, const char* what) {
      const double a = m.step_seconds(base), b = m.step_seconds(more);
      if (strict) {
        EXPECT_GT(b, a) << name << ": " << what;
      } else {
        EXPECT_GE(b, a) << name << ": " << what;
      }
    };
    for (int trial = 0; trial < 200; ++trial) {
      StepShape s;
      const int64_t parts = uniform_int(gen, 0, 3);
      for (int64_t i = 0; i < parts; ++i) {
        s.prefills.push_back({uniform_int(gen, 1, 4096), uniform_int(gen, 0, 8192)});
      }
      const int64_t seqs = uniform_int(gen, 0, 64);
      const int64_t per_seq_tokens = uniform_int(gen, 1, 3);
      const int64_t per_seq_context = uniform_int(gen, 1, 8192);
      if (seqs > 0)
        s = [&] {
          StepShape d = decode_batch(seqs, per_seq_tokens, per_seq_context);
          d.prefills = s.prefills;
          return d;
        }();

      StepShape more = s;
      more.prefills.push_back({uniform_int(gen, 1, 512), uniform_int(gen, 0, 512)});
      check(s, more, "another prefill chunk");
      if (!s.prefills.empty()) {
        more = s;
        more.prefills[0].new_tokens += uniform_int(gen, 1, 100);
        check(s, more, "more new prefill tokens");
        more = s;
        more.prefills[0].context_tokens += uniform_int(gen, 1, 100);
        check(s, more, "more prefill context");
      }
      // Another decoding sequence like the others.
      more = s;
      more.decode_seqs += 1;
      more.decode_tokens += per_seq_tokens;
      more.decode_context_tokens += per_seq_context;
      check(s, more, "another decoding sequence");
      if (seqs > 0) {
        more = s;
        more.decode_tokens += 1;
        check(s, more, "a draft token");
        more = s;
        more.decode_context_tokens += uniform_int(gen, 1, 1000);
        check(s, more, "more decode context");
      }
    }
  }
}

// Shapes that exercise every parameter: prefill chunks with and without cache, decode batches
// with 1-4 tokens per sequence, mixed steps.
std::vector<StepShape> varied_shapes(std::mt19937_64& gen, int count) {
  std::vector<StepShape> shapes;
  for (int i = 0; i < count; ++i) {
    StepShape s;
    const int kind = i % 3;  // prefill only, decode only, mixed
    if (kind != 1) {
      const int64_t parts = uniform_int(gen, 1, 4);
      for (int64_t p = 0; p < parts; ++p) {
        s.prefills.push_back(
            {uniform_int(gen, 1, 8192), uniform_int(gen, 0, 1) * uniform_int(gen, 0, 16384)});
      }
    }
    if (kind != 0) {
      const int64_t seqs = uniform_int(gen, 1, 256);
      StepShape d = decode_batch(seqs, uniform_int(gen, 1, 4), uniform_int(gen, 1, 16384));
      d.decode_context_tokens += uniform_int(gen, 0, seqs);  // not always a multiple
      d.prefills = s.prefills;
      s = d;
    }
    shapes.push_back(s);
  }
  return shapes;
}

void expect_params_near(const SimLatencyParams& got, const SimLatencyParams& want, double rel) {
  EXPECT_NEAR(got.step_s, want.step_s, rel * want.step_s);
  EXPECT_NEAR(got.prefill_token_s, want.prefill_token_s, rel * want.prefill_token_s);
  EXPECT_NEAR(got.prefill_pair_s, want.prefill_pair_s, rel * want.prefill_pair_s);
  EXPECT_NEAR(got.decode_token_s, want.decode_token_s, rel * want.decode_token_s);
  EXPECT_NEAR(got.decode_seq_s, want.decode_seq_s, rel * want.decode_seq_s);
  EXPECT_NEAR(got.decode_pair_s, want.decode_pair_s, rel * want.decode_pair_s);
}

TEST(SimLatency, FitRecoversKnownParametersWithoutNoise) {
  std::mt19937_64 gen(11);
  const SimLatencyParams truth = {.step_s = 3e-3,
                                  .prefill_token_s = 80e-6,
                                  .prefill_pair_s = 9e-9,
                                  .decode_token_s = 150e-6,
                                  .decode_seq_s = 40e-6,
                                  .decode_pair_s = 30e-9};
  const SimLatencyModel model(truth);
  std::vector<LatencySample> samples;
  for (const StepShape& s : varied_shapes(gen, 60)) samples.push_back({s, model.step_seconds(s)});
  const LatencyFit fit = fit_sim_latency(samples, "recovered");
  EXPECT_EQ(fit.model.name(), "recovered");
  expect_params_near(fit.model.params(), truth, 1e-9);
  EXPECT_LT(fit.max_relative_error, 1e-12);
}

TEST(SimLatency, FitWithNoiseStaysClose) {
  std::mt19937_64 gen(12);
  const auto truth = SimLatencyModel::preset("deepseek-v3-h800");
  SimLatencyParams with_seq = truth.params();
  with_seq.decode_seq_s = 50e-6;
  const SimLatencyModel model(with_seq);
  std::vector<LatencySample> samples;
  for (const StepShape& s : varied_shapes(gen, 600)) {
    const double noise = 1 + 0.06 * (uniform(gen) - 0.5);  // +-3%, uniform
    samples.push_back({s, model.step_seconds(s) * noise});
  }
  const LatencyFit fit = fit_sim_latency(samples);
  expect_params_near(fit.model.params(), with_seq, 0.15);
  EXPECT_LT(fit.rms_relative_error, 0.02);  // uniform +-3% has rms 1.73%
  EXPECT_LT(fit.max_relative_error, 0.035);
}

TEST(SimLatency, FitKeepsParametersNonNegative) {
  // Times that fall as prefill grows: unconstrained least squares would give a negative
  // per-token cost; NNLS puts it at zero and explains the data with the fixed cost.
  std::vector<LatencySample> samples;
  for (int64_t n = 1; n <= 20; ++n) {
    samples.push_back({prefill_batch(1, n * 100), 0.010 - n * 1e-4});
  }
  const LatencyFit fit = fit_sim_latency(samples);
  const SimLatencyParams& p = fit.model.params();
  for (double v : {p.step_s, p.prefill_token_s, p.prefill_pair_s, p.decode_token_s, p.decode_seq_s,
                   p.decode_pair_s}) {
    EXPECT_GE(v, 0);
  }
  EXPECT_EQ(p.prefill_token_s, 0);
  EXPECT_EQ(p.prefill_pair_s, 0);
  EXPECT_GT(p.step_s, 0.008);
  EXPECT_LT(p.step_s, 0.010);
}

TEST(SimLatency, FitSatisfiesTheOptimalityConditionsWhenConstraintsBind) {
  // Data from random linear models with some negative coefficients, so that different subsets
  // of parameters end at zero. The fit minimises sum((predicted/measured - 1)^2) over
  // parameters >= 0; its solution must satisfy the Karush-Kuhn-Tucker conditions: the gradient
  // is zero along every positive parameter and points outward (>= 0 descent blocked) for every
  // zero one.
  std::mt19937_64 gen(14);
  const std::array<double, 6> scale = {0.05, 20e-6, 3e-9, 300e-6, 100e-6, 10e-9};
  int zeros = 0, positives = 0;
  for (int trial = 0; trial < 40; ++trial) {
    std::array<double, 6> c;
    for (size_t j = 0; j < 6; ++j) c[j] = (2 * uniform(gen) - 1) * scale[j];
    std::vector<LatencySample> samples;
    std::vector<std::array<double, 6>> features;
    for (const StepShape& s : varied_shapes(gen, 30)) {
      const StepFeatures f = step_features(s);
      const std::array<double, 6> row = {
          1, f.prefill_tokens, f.prefill_pairs, f.decode_tokens, f.decode_seqs, f.decode_pairs};
      double y = 1.0;  // keeps every time positive
      for (size_t j = 0; j < 6; ++j) y += c[j] * row[j];
      ASSERT_GT(y, 0);
      samples.push_back({s, y});
      features.push_back(row);
    }
    const LatencyFit fit = fit_sim_latency(samples);
    const SimLatencyParams& p = fit.model.params();
    const std::array<double, 6> x = {p.step_s,         p.prefill_token_s, p.prefill_pair_s,
                                     p.decode_token_s, p.decode_seq_s,    p.decode_pair_s};
    for (size_t j = 0; j < 6; ++j) {
      double w = 0, norm2 = 0;
      for (size_t i = 0; i < samples.size(); ++i) {
        const double a = features[i][j] / samples[i].seconds;
        w += a * (1 - fit.model.step_seconds(samples[i].shape) / samples[i].seconds);
        norm2 += a * a;
      }
      const double g = w / std::sqrt(norm2 * static_cast<double>(samples.size()));
      EXPECT_GE(x[j], 0);
      if (x[j] > 0) {
        ++positives;
        EXPECT_NEAR(g, 0, 1e-9) << "trial " << trial << " parameter " << j;
      } else {
        ++zeros;
        EXPECT_LT(g, 1e-9) << "trial " << trial << " parameter " << j;
      }
    }
  }
  // Both kinds of conditions were exercised.
  EXPECT_GT(zeros, 20);
  EXPECT_GT(positives, 20);
}

TEST(SimLatency, FitWithoutDraftsGivesTheTokenTheSequenceCost) {
  // Without speculative drafts decode tokens and sequences are the same count: the fit cannot
  // tell them apart and puts the whole cost on decode_token_s (documented).
  std::mt19937_64 gen(13);
  const SimLatencyParams truth = {.step_s = 0.02,
                                  .prefill_token_s = 0,
                                  .prefill_pair_s = 0,
                                  .decode_token_s = 1e-4,
                                  .decode_seq_s = 3e-5,
                                  .decode_pair_s = 2e-8};
  const SimLatencyModel model(truth);
  std::vector<LatencySample> samples;
  for (int i = 0; i < 40; ++i) {
    const StepShape s = decode_batch(uniform_int(gen, 1, 200), 1, uniform_int(gen, 1, 8000));
    samples.push_back({s, model.step_seconds(s)});
  }
  const LatencyFit fit = fit_sim_latency(samples);
  EXPECT_NEAR(fit.model.params().decode_token_s, 1.3e-4, 1e-12);
  EXPECT_EQ(fit.model.params().decode_seq_s, 0);
  EXPECT_NEAR(fit.model.params().step_s, 0.02, 1e-12);
  EXPECT_NEAR(fit.model.params().decode_pair_s, 2e-8, 1e-17);
  EXPECT_LT(fit.max_relative_error, 1e-12);
}

TEST(SimLatency, JsonRoundTrip) {
  for (const std::string& name : SimLatencyModel::preset_names()) {
    const auto m = SimLatencyModel::preset(name);
    const auto back = SimLatencyModel::from_json(m.to_json());
    EXPECT_EQ(back.name(), name);
    const SimLatencyParams &a = m.params(), &b = back.params();
    EXPECT_EQ(a.step_s, b.step_s);
    EXPECT_EQ(a.prefill_token_s, b.prefill_token_s);
    EXPECT_EQ(a.prefill_pair_s, b.prefill_pair_s);
    EXPECT_EQ(a.decode_token_s, b.decode_token_s);
    EXPECT_EQ(a.decode_seq_s, b.decode_seq_s);
    EXPECT_EQ(a.decode_pair_s, b.decode_pair_s);
  }
  // Through a file, with awkward values (a fit's output has all 17 digits).
  const SimLatencyModel odd({.step_s = 0.1 + 0.2,
                             .prefill_token_s = 1e-300,
                             .prefill_pair_s = 3.0000000000000004e-9,
                             .decode_token_s = 0,
                             .decode_seq_s = 123.456,
                             .decode_pair_s = 5e-324},
                            "odd \"name\"");
  const auto path = std::filesystem::temp_directory_path() /
                    ("sim-latency-" + std::to_string(::getpid()) + ".json");
  odd.save(path);
  const auto back = SimLatencyModel::load(path);
  std::filesystem::remove(path);
  EXPECT_EQ(back.name(), "odd \"name\"");
  EXPECT_EQ(back.params().step_s, 0.1 + 0.2);
  EXPECT_EQ(back.params().prefill_token_s, 1e-300);
  EXPECT_EQ(back.params().prefill_pair_s, 3.0000000000000004e-9);
  EXPECT_EQ(back.params().decode_seq_s, 123.456);
  EXPECT_EQ(back.params().decode_pair_s, 5e-324);
  // The name is optional.
  EXPECT_EQ(SimLatencyModel::from_json(R"({"step_s": 1, "prefill_token_s": 0,
      "prefill_pair_s": 0, "decode_token_s": 0, "decode_seq_s": 0, "decode_pair_s": 0})")
                .name(),
            "custom");
}

void expect_error(const std::function<void()>& fn, const std::string& fragment) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning: " << fragment;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(SimLatency, ErrorsNameTheFieldOrPreset) {
  expect_error([] { SimLatencyModel::preset("deepseek-v3-a100"); },
               "unknown latency model preset \"deepseek-v3-a100\" (expected one of: "
               "deepseek-v3-h800, deepseek-v3-h20, qwen3-30b-a3b-h100, tiny)");

  const std::string good =
      R"({"step_s": 1, "prefill_token_s": 0, "prefill_pair_s": 0, "decode_token_s": 0,
          "decode_seq_s": 0, "decode_pair_s": 0)";
  expect_error([&] { SimLatencyModel::from_json(good, "m.json"); }, "m.json: invalid JSON");
  expect_error([] { SimLatencyModel::from_json("[1]", "m.json"); }, "expected a JSON object");
  expect_error([&] { SimLatencyModel::from_json(good + R"(, "decode_tokens_s": 1})", "m.json"); },
               "m.json: unknown field \"decode_tokens_s\"");
  expect_error(
      [] {
        SimLatencyModel::from_json(R"({"step_s": 1, "prefill_token_s": 0, "prefill_pair_s": 0,
            "decode_token_s": 0, "decode_seq_s": 0})");
      },
      "field \"decode_pair_s\" is missing");
  expect_error([&] { SimLatencyModel::from_json(good + R"(, "name": 3})"); },
               "field \"name\" must be a string");
  expect_error(
      [] {
        SimLatencyModel::from_json(R"({"step_s": -1, "prefill_token_s": 0, "prefill_pair_s": 0,
            "decode_token_s": 0, "decode_seq_s": 0, "decode_pair_s": 0})");
      },
      "field \"step_s\" must be a non-negative finite number of seconds, got -1");
  try {  // a value quoted in a message is an excerpt, however large
    SimLatencyModel::from_json(R"({"step_s": )" +
                               nlohmann::json(std::vector<int>(60000, 7)).dump() +
                               R"(, "prefill_token_s": 0, "prefill_pair_s": 0, "decode_token_s": 0,
                               "decode_seq_s": 0, "decode_pair_s": 0})");
    ADD_FAILURE() << "a list of seconds was accepted";
  } catch (const Error& e) {
    EXPECT_LT(std::string(e.what()).size(), 300u) << e.what();
  }
  expect_error(
      [] {
        SimLatencyModel::from_json(R"({"step_s": 1, "prefill_token_s": "fast",
            "prefill_pair_s": 0, "decode_token_s": 0, "decode_seq_s": 0, "decode_pair_s": 0})");
      },
      "field \"prefill_token_s\" must be a non-negative finite number");
  expect_error([] { SimLatencyModel::load("/nonexistent/model.json"); }, "/nonexistent/model.json");
  expect_error([] { SimLatencyModel({.decode_seq_s = -1e-6}, "bad"); },
               "latency model bad: decode_seq_s must be a non-negative finite number");

  const auto m = SimLatencyModel::preset("tiny");
  expect_error([&] { m.step_seconds(prefill_batch(2, 0)); }, "prefills[0].new_tokens must be >= 1");
  expect_error([&] { m.step_seconds(prefill_batch(1, 5, -1)); },
               "prefills[0].context_tokens must be >= 0");
  StepShape s;
  s.decode_seqs = 4;
  s.decode_tokens = 3;
  expect_error([&] { m.step_seconds(s); }, "decode_tokens (3) must be >= decode_seqs (4)");
  s = {};
  s.decode_tokens = 1;
  expect_error([&] { m.step_seconds(s); }, "must be 0 when decode_seqs is 0");
  s = {};
  s.decode_seqs = -1;
  expect_error([&] { m.step_seconds(s); }, "decode_seqs must be >= 0");

  expect_error([] { fit_sim_latency({}); }, "latency fit: no samples");
  expect_error(
      [] {
        fit_sim_latency({{prefill_batch(1, 5), 0.0}});
      },
      "samples[0].seconds must be a positive finite number");
  expect_error(
      [] {
        fit_sim_latency({{prefill_batch(1, 5), 1.0}, {StepShape{}, 1.0}});
      },
      "samples[1] is an empty step");
  expect_error(
      [] {
        fit_sim_latency({{prefill_batch(1, 0), 1.0}});
      },
      "latency fit: samples[0]: step shape: prefills[0].new_tokens");
}

}  // namespace
}  // namespace tandem::engine
