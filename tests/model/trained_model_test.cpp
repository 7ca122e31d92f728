// The CPU forward pass on a checkpoint written by the trainer, tools/train_tiny_deepseek.py,
// against the trainer's own PyTorch model reading the same files (`train_tiny_deepseek.py
// forward`, the request and answer format of tests/oracle/deepseek_reference.py). The trainer
// trains its `tiny` preset (hidden 64, 3 layers + MTP, 8 experts in 4 groups) for a few steps
// here, in seconds: trained weights, correction biases moved by the balancing rule and an MTP
// module that has learnt something are what random-weight checkpoints never have.
//
// Compared: logits at every position of sequences of 1 to ~30 tokens (text of the training kind,
// and random ids, many of which the trainer's vocabulary never saw and so share one row), run
// whole and token by token through the cache (expanded and absorbed attention); the MTP
// module's logits; 16-token greedy continuations (identical ids). Tolerance (float32
// checkpoint): max |tandem - trainer| <= 1e-4 x max(1, max |trainer|) over the logits compared;
// positions from the first token whose expert choice is within 1e-5 of a tie on are not compared
// (as in numerics_test), and at least 60% of positions must be.
//
// Also: the same seed gives the same weights (a BF16 run's tensors are the F32 run's, rounded to
// nearest even; the correction biases stay F32 and equal), so the trainer is deterministic and its
// BF16 writer is right; both checkpoints load.
//
// Needs Debian's /usr/bin/python3 with python3-torch and python3-numpy; skipped without them.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/generate.h"
#include "model/deepseek.h"
#include "model/dtype.h"
#include "model/model_test_support.h"
#include "model/safetensors.h"
#include "text/oracle_support.h"
#include "text/tokenizer.h"

namespace tandem::model {
namespace {

namespace fs = std::filesystem;

constexpr double kTol = 1e-4;
constexpr float kMinMargin = 1e-5f;
constexpr int kSteps = 6;
constexpr int kGreedyTokens = 16;

std::string trainer() {
  return "/usr/bin/python3 " + test::quote(test::source_dir() / "tools" / "train_tiny_deepseek.py");
}

class TrainedModel : public ::testing::Test {
 protected:
  // One training per dtype for the whole suite: the same seed, so the weights must agree.
  static void SetUpTestSuite() {
    have_torch_ = test::run_command("/usr/bin/python3 -c 'import torch, numpy' 2>/dev/null") == 0;
    if (!have_torch_) return;
    dir_ = new test::TempDir("trained-model");
    for (const char* dtype : {"f32", "bf16"}) {
      const std::string cmd = trainer() + " train --preset tiny --steps " + std::to_string(kSteps) +
                              " --seed 3 --dtype " + dtype + " --out " +
                              test::quote(*dir_ / dtype) + " --tandem " +
                              test::quote(TANDEM_BINARY) + " 2>&1";
      trained_ok_ = trained_ok_ && test::run_command(cmd) == 0;
      if (!trained_ok_) std::fprintf(stderr, "training failed: %s\n", cmd.c_str());
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }

  void SetUp() override {
    if (!have_torch_)
      GTEST_SKIP() << "/usr/bin/python3 lacks torch or numpy (Debian "
                      "python3-torch, python3-numpy; scripts/install-deps.sh)";
    ASSERT_TRUE(trained_ok_) << "the trainer failed; its output is above";
  }

  static fs::path model_dir(const std::string& dtype) { return *dir_ / dtype; }

  // The trainer's answer to `request` for the checkpoint in `model`.
  static nlohmann::json trainer_forward(const fs::path& model, const nlohmann::json& request) {
    auto req = test::temp_path("trained-request"), out = test::temp_path("trained-out");
    std::ofstream(req) << request.dump();
    const std::string cmd = trainer() + " forward --model " + test::quote(model) + " --request " +
                            test::quote(req) + " --out " + test::quote(out);
    EXPECT_EQ(test::run_command(cmd), 0) << "trainer forward failed: " << cmd;
    std::ifstream in(out);
    auto doc = nlohmann::json::parse(in, nullptr, false);
    fs::remove(req);
    fs::remove(out);
    return doc;
  }

  static inline bool have_torch_ = false;
  static inline bool trained_ok_ = true;
  static inline test::TempDir* dir_ = nullptr;
};

// Text like the training text (the trainer reads the Python standard library), and random ids
// below 128000: most of those never occur in training and share the trainer's spare row.
std::vector<std::vector<int32_t>> test_sequences(const text::Tokenizer& tok) {
  std::vector<std::vector<int32_t>> seqs = {
      tok.encode("import os", true),
      tok.encode("def read(path):\n    with open(path) as f:\n        return f.read()\n", true),
      tok.encode("class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = "
                 "maxsize\n        self._init(maxsize)\n",
                 true)};
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> id(2, 127999);
  for (int len : {1, 9}) {
    std::vector<int32_t> s(len);
    for (auto& t : s) t = id(rng);
    seqs.push_back(s);
  }
  return seqs;
}

TEST_F(TrainedModel, LogitsAndMtpMatchTheTrainer) {
  const auto dir = model_dir("f32");
  const auto model = DeepSeekModel::load(dir);
  const auto& cfg = model.config();
  ASSERT_EQ(cfg.num_nextn_predict_layers, 1);
  const int64_t vocab = cfg.vocab_size;
  const auto tok = text::Tokenizer::from_dir(dir);
  const auto seqs = test_sequences(tok);
  ASSERT_GT(seqs[2].size(), 24u);
  const auto ref = trainer_forward(dir, {{"sequences", seqs}, {"all_logits", true}, {"mtp", true}});
  ASSERT_TRUE(ref.is_object() && ref["sequences"].size() == seqs.size());

  for (bool one_by_one : {false, true}) {
    const int64_t block = 4;
    LatentCache cache(model.cache_shape(block), 64);
    const auto tables = test::block_tables(seqs, block);
    // Whole sequences in one mixed batch (expanded attention), or one token per sequence per
    // step (absorbed attention over the cache).
    std::vector<std::vector<float>> rows(seqs.size()), hidden(seqs.size()), margins(seqs.size());
    std::vector<size_t> done(seqs.size(), 0);
    while (true) {
      std::vector<SequenceStep> batch;
      std::vector<size_t> who;
      for (size_t s = 0; s < seqs.size(); ++s) {
        if (done[s] == seqs[s].size()) continue;
        const size_t n = one_by_one ? 1 : seqs[s].size();
        batch.push_back({std::span(seqs[s]).subspan(done[s], n), static_cast<int64_t>(done[s]),
                         tables[s], LogitRows::kAll});
        who.push_back(s);
      }
      if (batch.empty()) break;
      const auto out = model.forward(batch, cache);
      size_t before = 0;
      for (size_t b = 0; b < batch.size(); ++b) {
        const size_t s = who[b], n = batch[b].tokens.size();
        const float* first = out.logits.data() + out.first_row[b] * vocab;
        rows[s].insert(rows[s].end(), first, first + n * vocab);
        hidden[s].insert(hidden[s].end(), out.hidden.begin() + before * cfg.hidden_size,
                         out.hidden.begin() + (before + n) * cfg.hidden_size);
        margins[s].insert(margins[s].end(), out.routing_margin.begin() + before,
                          out.routing_margin.begin() + before + n);
        before += n;
        done[s] += n;
      }
    }

    std::vector<size_t> stable(seqs.size());  // positions before the first routing near-tie
    size_t compared = 0, positions = 0;
    for (size_t s = 0; s < seqs.size(); ++s) {
      const auto expected = ref["sequences"][s]["logits"].get<std::vector<std::vector<float>>>();
      ASSERT_EQ(expected.size(), seqs[s].size());
      while (stable[s] < seqs[s].size() && margins[s][stable[s]] >= kMinMargin) ++stable[s];
      const double dev = test::logit_deviation(expected, rows[s].data(), vocab, stable[s]);
      EXPECT_LE(dev, kTol) << "sequence " << s << " (" << seqs[s].size() << " tokens), "
                           << (one_by_one ? "token by token" : "whole");
      std::printf(
          "[ trained f32 ] %s, sequence of %zu tokens: %zu positions compared, max "
          "relative logit deviation %.2e\n",
          one_by_one ? "token by token" : "whole", seqs[s].size(), stable[s], dev);
      compared += stable[s];
      positions += seqs[s].size();
    }
    EXPECT_GE(compared, positions * 6 / 10) << "too many routing near-ties to compare";
    if (one_by_one) continue;

    // MTP: position i reads the main model's hidden state i and the token at i + 1.
    std::vector<SequenceStep> batch;
    std::vector<float> hidden_in;
    std::vector<size_t> who;
    for (size_t s = 0; s < seqs.size(); ++s) {
      if (seqs[s].size() < 2) continue;
      batch.push_back({std::span(seqs[s]).subspan(1), 0, tables[s], LogitRows::kAll});
      hidden_in.insert(hidden_in.end(), hidden[s].begin(), hidden[s].end() - cfg.hidden_size);
      who.push_back(s);
    }
    const auto mtp = model.forward_mtp(batch, hidden_in.data(), cache);
    size_t t = 0;
    for (size_t b = 0; b < batch.size(); ++b) {
      const auto expected =
          ref["sequences"][who[b]]["mtp_logits"].get<std::vector<std::vector<float>>>();
      ASSERT_EQ(expected.size(), batch[b].tokens.size());
      size_t count = std::min(stable[who[b]], expected.size());
      for (size_t i = 0; i < count; ++i)
        if (mtp.routing_margin[t + i] < kMinMargin) count = i;
      t += batch[b].tokens.size();
      const double dev = test::logit_deviation(
          expected, mtp.logits.data() + mtp.first_row[b] * vocab, vocab, count);
      EXPECT_LE(dev, kTol) << "MTP, sequence " << who[b];
      EXPECT_GE(count, expected.size() / 2) << "MTP, sequence " << who[b];
      std::printf(
          "[ trained f32 ] MTP over %zu positions: %zu compared, max relative deviation "
          "%.2e\n",
          expected.size(), count, dev);
    }
  }
}

TEST_F(TrainedModel, GreedyContinuationMatchesTheTrainer) {
  const auto dir = model_dir("f32");
  const auto model = DeepSeekModel::load(dir);
  const auto tok = text::Tokenizer::from_dir(dir);
  const std::vector<std::vector<int32_t>> prompts = {
      tok.encode("import sys\n\n\ndef main(argv):\n", true), tok.encode("    return", true)};
  const auto ref = trainer_forward(dir, {{"sequences", prompts}, {"greedy_tokens", kGreedyTokens}});
  ASSERT_TRUE(ref.is_object() && ref["sequences"].size() == prompts.size());
  for (size_t s = 0; s < prompts.size(); ++s) {
    engine::SamplingParams greedy;
    greedy.temperature = 0;
    greedy.max_tokens = kGreedyTokens;
    greedy.ignore_eos = true;
    const auto result = engine::generate(model, tok, prompts[s], greedy);
    EXPECT_EQ(result.tokens, ref["sequences"][s]["greedy"].get<std::vector<int32_t>>())
        << "prompt " << s;
  }
}

TEST_F(TrainedModel, SameSeedSameWeightsAndBf16IsRoundedF32) {
  const auto f32 = Checkpoint::open(model_dir("f32"));
  const auto bf16 = Checkpoint::open(model_dir("bf16"));
  ASSERT_EQ(f32.tensors().size(), bf16.tensors().size());
  size_t mismatched_tensors = 0;
  for (const auto& [name, a] : f32.tensors()) {
    const TensorInfo* b = bf16.find(name);
    ASSERT_NE(b, nullptr) << name;
    ASSERT_EQ(a.shape, b->shape) << name;
    ASSERT_EQ(a.dtype, DType::kF32) << name;
    const bool bias = name.ends_with("e_score_correction_bias");
    ASSERT_EQ(b->dtype, bias ? DType::kF32 : DType::kBF16) << name;
    const auto n = static_cast<size_t>(a.numel());
    std::vector<float> wide(n), narrow(n);
    to_f32(a.dtype, a.data, wide.data(), n);
    to_f32(b->dtype, b->data, narrow.data(), n);
    size_t differ = 0;
    for (size_t i = 0; i < n; ++i) {
      const float want = bias ? wide[i] : bf16_to_f32(f32_to_bf16(wide[i]));
      differ += want != narrow[i];
    }
    if (differ) ++mismatched_tensors;
    EXPECT_EQ(differ, 0u) << name << ": " << differ << " of " << n << " values differ";
    if (mismatched_tensors > 5) break;
  }
  // The BF16 checkpoint loads too, and its config says so.
  const auto model = DeepSeekModel::load(model_dir("bf16"));
  EXPECT_EQ(model.config().torch_dtype, "bfloat16");
}

}  // namespace
}  // namespace tandem::model
