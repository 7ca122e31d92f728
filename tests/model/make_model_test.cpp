// tandem make-model: complete, valid, deterministic checkpoints in every dtype; quantized weights
// close to the float ones; router scores far from ties; the CLI end to end.
#include "model/make_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/layout.h"
#include "model/model_test_support.h"
#include "model/quantize.h"
#include "model/random_checkpoint.h"
#include "model/safetensors.h"
#include "text/oracle_support.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/file.h"

namespace tandem::model {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

fs::path deepseek_tokenizer() {
  return test::lenml_model("deepseek_v3");
}

ModelConfig make(const std::string& preset, const fs::path& out, DType dtype, uint64_t seed = 0) {
  MakeModelOptions o;
  o.preset = preset;
  o.out = out;
  o.tokenizer_dir = deepseek_tokenizer();
  o.dtype = dtype;
  o.seed = seed;
  return make_model(o);
}

std::vector<float> floats(const TensorInfo& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  to_f32(t.dtype, t.data, v.data(), v.size());
  return v;
}

TEST(MakeModel, PresetsAreValidCheckpointsInEveryDtype) {
  for (const std::string preset : {"tiny-v3", "tiny-v2-lite"}) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kI8}) {
      SCOPED_TRACE(preset + " " + std::string(dtype_name(dtype)));
      test::TempDir dir("make-" + preset);
      const ModelConfig made = make(preset, dir.path(), dtype);
      const ModelConfig loaded = ModelConfig::load(dir.path());
      EXPECT_EQ(loaded, made);
      const auto ck = Checkpoint::open(dir.path());
      EXPECT_NO_THROW(validate_checkpoint(ck, loaded));
      EXPECT_EQ(checkpoint_weight_dtype(ck, loaded), dtype);
      // Sharded as a Hugging Face repository is, even at this size.
      EXPECT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
      EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
      for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
        EXPECT_EQ(test::read_bytes(dir / f), test::read_bytes(deepseek_tokenizer() / f)) << f;
      const auto gen = nlohmann::json::parse(test::read_bytes(dir / "generation_config.json"));
      EXPECT_EQ(gen["bos_token_id"], 0);
      EXPECT_EQ(gen["eos_token_id"], 1);
      EXPECT_EQ(loaded.bos_token_id, 0);
      EXPECT_EQ(loaded.eos_token_ids, std::vector<int64_t>{1});
      // Every value finite.
      for (const auto& [name, t] : ck.tensors())
        for (float v : floats(t)) ASSERT_TRUE(std::isfinite(v)) << name;
    }
  }
}

TEST(MakeModel, SameSeedSameBytesOtherSeedOtherWeights) {
  test::TempDir a("det-a"), b("det-b"), c("det-c");
  make("tiny-v3", a.path(), DType::kF8E4M3, 7);
  make("tiny-v3", b.path(), DType::kF8E4M3, 7);
  make("tiny-v3", c.path(), DType::kF8E4M3, 8);
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(a.path())) {
    const std::string name = e.path().filename();
    ++files;
    EXPECT_EQ(test::read_bytes(e.path()), test::read_bytes(b / name)) << name;
    if (name.ends_with(".safetensors")) {
      EXPECT_NE(test::read_bytes(e.path()), test::read_bytes(c / name)) << name;
    } else {
      EXPECT_EQ(test::read_bytes(e.path()), test::read_bytes(c / name)) << name;
    }
  }
  EXPECT_GT(files, 6u);
}

// The same seed gives the same underlying weights in every dtype: quantized ones must be within
// their format's rounding error of the F32 ones, with DeepSeek's and meituan's scale rules.
TEST(MakeModel, QuantizedWeightsMatchTheFloatOnes) {
  test::TempDir f32_dir("q-f32"), fp8_dir("q-fp8"), int8_dir("q-int8"), bf16_dir("q-bf16");
  make("tiny-v3", f32_dir.path(), DType::kF32, 3);
  make("tiny-v3", bf16_dir.path(), DType::kBF16, 3);
  make("tiny-v3", fp8_dir.path(), DType::kF8E4M3, 3);
  make("tiny-v3", int8_dir.path(), DType::kI8, 3);
  const auto f32 = Checkpoint::open(f32_dir.path());
  const auto bf16 = Checkpoint::open(bf16_dir.path());
  const auto fp8 = Checkpoint::open(fp8_dir.path());
  const auto i8 = Checkpoint::open(int8_dir.path());
  int quantized = 0;
  for (const auto& [name, t] : f32.tensors()) {
    const auto w = floats(t);
    const TensorInfo& bt = *bf16.find(name);
    const auto b = floats(bt);
    for (size_t i = 0; i < w.size(); ++i)  // the correction bias stays F32
      ASSERT_EQ(b[i], bt.dtype == DType::kF32 ? w[i] : bf16_to_f32(f32_to_bf16(w[i]))) << name;
    const TensorInfo& q8 = *fp8.find(name);
    if (q8.dtype != DType::kF8E4M3) {
      // Unquantized tensors of a quantized checkpoint: BF16, or F32 for the correction bias.
      const auto v = floats(q8);
      for (size_t i = 0; i < w.size(); ++i)
        ASSERT_EQ(v[i], q8.dtype == DType::kF32 ? w[i] : bf16_to_f32(f32_to_bf16(w[i]))) << name;
      continue;
    }
    ++quantized;
    const int64_t rows = t.shape[0], cols = t.shape[1];
    const auto block_scale = floats(*fp8.find(name + "_scale_inv"));
    const int64_t sc = (cols + 127) / 128;
    const auto codes = reinterpret_cast<const uint8_t*>(q8.data);
    std::vector<uint8_t> block_max(block_scale.size(), 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const size_t i = r * cols + c, bi = (r / 128) * sc + c / 128;
        const float s = block_scale[bi];
        const float deq = f8e4m3_to_f32(codes[i]) * s;
        // Half an E4M3 ulp: 1/16 relative for normals, 2^-10 * scale below 2^-6 * scale.
        ASSERT_LE(std::fabs(deq - w[i]), std::max(std::fabs(w[i]) / 16, s * 0x1p-10f) * 1.0001f)
            << name << " [" << r << ", " << c << "]";
        block_max[bi] = std::max<uint8_t>(block_max[bi], codes[i] & 0x7F);
      }
    for (uint8_t m : block_max) EXPECT_EQ(m, 0x7E) << name;  // scale = amax / 448

    const TensorInfo& qi = *i8.find(name);
    ASSERT_EQ(qi.dtype, DType::kI8) << name;
    const TensorInfo& row_scale_info = *i8.find(name + "_scale");
    EXPECT_EQ(row_scale_info.shape, (std::vector<int64_t>{rows, 1}));
    const auto row_scale = floats(row_scale_info);
    const auto ints = floats(qi);
    for (int64_t r = 0; r < rows; ++r) {
      float amax = 0;
      for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
      EXPECT_FLOAT_EQ(row_scale[r], amax / 127) << name;  // meituan's channel-wise rule
      float qmax = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const float q = ints[r * cols + c];
        qmax = std::max(qmax, std::fabs(q));
        ASSERT_LE(std::fabs(q * row_scale[r] - w[r * cols + c]), row_scale[r] * 0.5001f) << name;
      }
      EXPECT_EQ(qmax, 127.0f) << name;
    }
  }
  EXPECT_GT(quantized, 40);
}

// ---- Router margins ----

struct RoutingStats {
  double median_margin = 0, median_bf16_shift = 0;
  double flips_bf16 = 0, flips_noise = 0;  // fraction of inputs whose chosen set changes
  double bias_changes = 0;                 // fraction where the correction bias changes it
  std::vector<int> expert_use;
};

std::vector<int> choose(const ModelConfig& c, const std::vector<float>& logits,
                        const std::vector<float>& bias, bool use_bias, float* margin) {
  const int64_t e = c.n_routed_experts;
  std::vector<double> s(e);
  if (c.scoring_func == "sigmoid") {
    for (int64_t i = 0; i < e; ++i) s[i] = 1 / (1 + std::exp(-double(logits[i])));
  } else {
    const double mx = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (int64_t i = 0; i < e; ++i) sum += s[i] = std::exp(logits[i] - mx);
    for (auto& v : s) v /= sum;
  }
  if (use_bias && !bias.empty())
    for (int64_t i = 0; i < e; ++i) s[i] += bias[i];
  double m = INFINITY;
  std::vector<bool> allowed(e, true);
  if (c.n_group > 1) {
    const int64_t per = e / c.n_group;
    std::vector<std::pair<double, int64_t>> g;
    for (int64_t k = 0; k < c.n_group; ++k) {
      std::vector<double> v(s.begin() + k * per, s.begin() + (k + 1) * per);
      std::sort(v.rbegin(), v.rend());
      g.push_back({c.uses_correction_bias() ? v[0] + v[1] : v[0], k});
    }
    std::sort(g.rbegin(), g.rend());
    m = g[c.topk_group - 1].first - g[c.topk_group].first;
    std::fill(allowed.begin(), allowed.end(), false);
    for (int64_t k = 0; k < c.topk_group; ++k)
      for (int64_t i = 0; i < per; ++i) allowed[g[k].second * per + i] = true;
  }
  std::vector<std::pair<double, int>> cand;
  for (int64_t i = 0; i < e; ++i)
    if (allowed[i]) cand.push_back({s[i], static_cast<int>(i)});
  std::sort(cand.rbegin(), cand.rend());
  const int64_t k = c.num_experts_per_tok;
  m = std::min(m, cand[k - 1].first - cand[k].first);
  if (margin) *margin = static_cast<float>(m);
  std::vector<int> chosen;
  for (int64_t i = 0; i < k; ++i) chosen.push_back(cand[i].second);
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

// Router inputs are RMS-normalised hidden states times post_attention_layernorm: random unit-RMS
// vectors stand in for them. A BF16 engine sees them rounded to BF16; errors accumulated over
// layers are modelled as 1% relative noise.
RoutingStats routing_stats(const Checkpoint& ck, const ModelConfig& c, int64_t layer, int n) {
  const std::string p = "model.layers." + std::to_string(layer);
  const auto w = floats(ck.get(p + ".mlp.gate.weight", {c.n_routed_experts, c.hidden_size}));
  const auto norm = floats(ck.get(p + ".post_attention_layernorm.weight", {c.hidden_size}));
  std::vector<float> bias;
  if (c.uses_correction_bias())
    bias = floats(ck.get(p + ".mlp.gate.e_score_correction_bias", {c.n_routed_experts}));
  std::mt19937 rng(static_cast<uint32_t>(layer) + 11);
  std::normal_distribution<float> normal;
  const int64_t h = c.hidden_size, e = c.n_routed_experts;
  auto logits_of = [&](const std::vector<float>& x) {
    std::vector<float> out(e);
    for (int64_t i = 0; i < e; ++i) {
      double acc = 0;
      for (int64_t j = 0; j < h; ++j) acc += double(w[i * h + j]) * x[j];
      out[i] = static_cast<float>(acc);
    }
    return out;
  };
  RoutingStats st;
  st.expert_use.assign(e, 0);
  std::vector<double> margins, shifts;
  int flips_bf16 = 0, flips_noise = 0, bias_changes = 0;
  for (int t = 0; t < n; ++t) {
    std::vector<float> x(h);
    double ss = 0;
    for (auto& v : x) {
      v = normal(rng);
      ss += double(v) * v;
    }
    const float inv = static_cast<float>(1 / std::sqrt(ss / h));
    for (int64_t j = 0; j < h; ++j) x[j] *= inv * norm[j];
    std::vector<float> xb(h), xn(h);
    for (int64_t j = 0; j < h; ++j) {
      xb[j] = bf16_to_f32(f32_to_bf16(x[j]));
      xn[j] = x[j] * (1 + 0.01f * normal(rng));
    }
    const auto l = logits_of(x), lb = logits_of(xb), ln = logits_of(xn);
    float margin = 0;
    const auto chosen = choose(c, l, bias, true, &margin);
    margins.push_back(margin);
    double shift = 0;
    for (int64_t i = 0; i < e; ++i) shift = std::max(shift, std::fabs(double(l[i]) - lb[i]));
    shifts.push_back(shift);
    flips_bf16 += choose(c, lb, bias, true, nullptr) != chosen;
    flips_noise += choose(c, ln, bias, true, nullptr) != chosen;
    bias_changes += choose(c, l, bias, false, nullptr) != chosen;
    for (int id : chosen) ++st.expert_use[id];
  }
  auto median = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  st.median_margin = median(margins);
  st.median_bf16_shift = median(shifts);
  st.flips_bf16 = double(flips_bf16) / n;
  st.flips_noise = double(flips_noise) / n;
  st.bias_changes = double(bias_changes) / n;
  return st;
}

TEST(MakeModel, RouterScoresAreFarFromTies) {
  for (const std::string preset : {"tiny-v3", "tiny-v2-lite"}) {
    test::TempDir dir("route-" + preset);
    const ModelConfig c = make(preset, dir.path(), DType::kBF16);
    const auto ck = Checkpoint::open(dir.path());
    for (int64_t layer = 0; layer < c.num_hidden_layers + c.num_nextn_predict_layers; ++layer) {
      if (!c.is_moe_layer(layer)) continue;
      const RoutingStats st = routing_stats(ck, c, layer, 4000);
      std::printf(
          "%s layer %lld: median top-k margin %.4f (score units), median score shift "
          "from BF16 inputs %.5f (logit units), chosen set changed by BF16 inputs %.2f%%, "
          "by 1%% noise %.2f%%, by the correction bias %.1f%%\n",
          preset.c_str(), static_cast<long long>(layer), st.median_margin, st.median_bf16_shift,
          100 * st.flips_bf16, 100 * st.flips_noise, 100 * st.bias_changes);
      // Margins are wide against BF16 rounding of the inputs, so choices rarely flip.
      EXPECT_GT(st.median_margin, 0.02) << preset << " layer " << layer;
      EXPECT_LT(st.flips_bf16, 0.01) << preset << " layer " << layer;
      EXPECT_LT(st.flips_noise, 0.05) << preset << " layer " << layer;
      // And routing is not degenerate: every expert gets tokens.
      for (int64_t i = 0; i < c.n_routed_experts; ++i)
        EXPECT_GT(st.expert_use[i], 4000 * c.num_experts_per_tok / c.n_routed_experts / 5)
            << preset << " layer " << layer << " expert " << i;
      // The correction bias matters for choosing (noaux_tc only).
      if (c.uses_correction_bias()) {
        EXPECT_GT(st.bias_changes, 0.05);
      }
    }
  }
}

// Logits of a token straight through the final norm and head: finite, spread, not flat.
TEST(MakeModel, HeadLogitsAreSpreadButNotDegenerate) {
  test::TempDir dir("logits");
  const ModelConfig c = make("tiny-v3", dir.path(), DType::kBF16);
  const auto ck = Checkpoint::open(dir.path());
  const int64_t h = c.hidden_size, v = c.vocab_size;
  const auto embed = floats(ck.get("model.embed_tokens.weight", {v, h}));
  const auto norm = floats(ck.get("model.norm.weight", {h}));
  const auto head = floats(ck.get("lm_head.weight", {v, h}));
  for (int64_t token : {0, 100, 5000, 128000}) {
    std::vector<double> x(h);
    double ss = 0;
    for (int64_t j = 0; j < h; ++j) ss += embed[token * h + j] * embed[token * h + j];
    for (int64_t j = 0; j < h; ++j) x[j] = embed[token * h + j] / std::sqrt(ss / h) * norm[j];
    double sum = 0, sum2 = 0, mx = -INFINITY;
    std::vector<double> logits(v);
    for (int64_t i = 0; i < v; ++i) {
      double acc = 0;
      for (int64_t j = 0; j < h; ++j) acc += head[i * h + j] * x[j];
      logits[i] = acc;
      sum += acc;
      sum2 += acc * acc;
      mx = std::max(mx, acc);
    }
    const double mean = sum / v, sd = std::sqrt(sum2 / v - mean * mean);
    double z = 0;
    for (double l : logits) z += std::exp(l - mx);
    const double top_p = 1 / z;
    EXPECT_GT(sd, 2.0);
    EXPECT_LT(sd, 4.5);
    EXPECT_GT(top_p, 1e-3);  // far above uniform (1/129280)
    EXPECT_LT(top_p, 0.9);
  }
}

TEST(MakeModel, BenchPresetIsV2LiteSized) {
  const ModelConfig c = preset_config("bench");
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.n_routed_experts, 64);
  EXPECT_EQ(c.n_shared_experts, 2);
  EXPECT_EQ(c.num_experts_per_tok, 6);
  EXPECT_EQ(c.moe_intermediate_size, 1408);
  size_t bytes = 0;
  for (const auto& s : checkpoint_layout(c, DType::kBF16)) bytes += s.nbytes();
  EXPECT_GT(bytes, size_t{3} << 30);
  EXPECT_LT(bytes, size_t{4} << 30);
}

TEST(MakeModel, LayersReplaceThePresetsDepth) {
  // The bench preset at 8 layers: DeepSeek-V2-Lite's widths, one dense layer then seven MoE ones
  // (about 4.7B parameters, 9.4 GB in BF16); counted from the layout, not written.
  ModelConfig c = preset_config("bench");
  c.num_hidden_layers = 8;
  size_t params = 0;
  for (const auto& s : checkpoint_layout(c, DType::kBF16)) params += s.nbytes() / 2;
  EXPECT_GT(params, size_t{4'600'000'000});  // 4.70B
  EXPECT_LT(params, size_t{4'800'000'000});

  test::TempDir dir("make-layers");
  MakeModelOptions o;
  o.preset = "tiny-v3";
  o.out = dir.path();
  o.tokenizer_dir = deepseek_tokenizer();
  o.layers = 5;
  const ModelConfig made = make_model(o);
  EXPECT_EQ(made.num_hidden_layers, 5);
  const ModelConfig loaded = ModelConfig::load(dir.path());
  EXPECT_EQ(loaded.num_hidden_layers, 5);
  const auto ck = Checkpoint::open(dir.path());
  EXPECT_NO_THROW(validate_checkpoint(ck, loaded));
  EXPECT_TRUE(ck.tensors().count("model.layers.4.self_attn.kv_a_proj_with_mqa.weight"));
  for (int64_t bad : {-1, 257}) {
    o.layers = bad;
    try {
      make_model(o);
      ADD_FAILURE() << bad;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), AllOf(HasSubstr("--layers"), HasSubstr(std::to_string(bad))));
    }
  }
}

// tandem quantize follows make-model's rules: an F32 checkpoint quantizes to exactly the bytes
// make-model writes for the quantized dtype (same seed), tensor by tensor, and the same config.
TEST(Quantize, AnF32CheckpointBecomesWhatMakeModelWritesQuantized) {
  for (DType dtype : {DType::kI8, DType::kF8E4M3}) {
    SCOPED_TRACE(dtype_name(dtype));
    test::TempDir f32("quantize-f32"), made("quantize-made"), out("quantize-out");
    make("tiny-v3", f32.path(), DType::kF32, 7);
    make("tiny-v3", made.path(), dtype, 7);
    QuantizeOptions o;
    o.in = f32.path();
    o.out = out.path() / "q";
    o.dtype = dtype;
    o.max_shard_bytes = size_t{4} << 20;
    const ModelConfig c = quantize_checkpoint(o);
    EXPECT_EQ(c, ModelConfig::load(made.path()));
    EXPECT_EQ(ModelConfig::load(o.out), c);
    const auto expected = Checkpoint::open(made.path());
    const auto got = Checkpoint::open(o.out);
    EXPECT_NO_THROW(validate_checkpoint(got, c));
    ASSERT_EQ(got.tensors().size(), expected.tensors().size());
    for (const auto& [name, t] : expected.tensors()) {
      const TensorInfo& g = got.tensors().at(name);
      ASSERT_EQ(g.dtype, t.dtype) << name;
      ASSERT_EQ(g.nbytes, t.nbytes) << name;
      EXPECT_EQ(std::memcmp(g.data, t.data, t.nbytes), 0) << name;
    }
    EXPECT_EQ(test::read_bytes(o.out / "tokenizer.json"), test::read_bytes(f32 / "tokenizer.json"));
  }
}

TEST(Quantize, ABf16CheckpointQuantizesCloseToItsWeights) {
  test::TempDir bf16("quantize-bf16"), out("quantize-bf16-out");
  make("tiny-v2-lite", bf16.path(), DType::kBF16, 3);
  QuantizeOptions o;
  o.in = bf16.path();
  o.out = out.path();
  o.dtype = DType::kI8;
  const ModelConfig c = quantize_checkpoint(o);
  const auto src = Checkpoint::open(bf16.path());
  const auto q = Checkpoint::open(out.path());
  EXPECT_NO_THROW(validate_checkpoint(q, c));
  const std::string w = "model.layers.1.mlp.experts.0.down_proj.weight";
  const TensorInfo& qw = q.tensors().at(w);
  ASSERT_EQ(qw.dtype, DType::kI8);
  const std::vector<float> original = floats(src.tensors().at(w));
  const std::vector<float> scales = floats(q.tensors().at(w + "_scale"));
  const int64_t rows = qw.shape[0], cols = qw.shape[1];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t col = 0; col < cols; ++col) {
      const float v =
          static_cast<float>(reinterpret_cast<const int8_t*>(qw.data)[r * cols + col]) * scales[r];
      // Half a quantization step of the row's scale.
      EXPECT_NEAR(v, original[r * cols + col], scales[r] * 0.5f + 1e-7f);
    }
}

// The weight `w` [rows, cols] quantized as `c` says and read back as the loader reads it.
std::vector<float> quantized_and_back(const ModelConfig& c, const std::vector<float>& w,
                                      int64_t rows, int64_t cols, std::vector<float>& scales) {
  std::vector<std::byte> q(w.size());
  quantize_weight(c, w, rows, cols, q.data(), scales);
  std::vector<float> back(w.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t col = 0; col < cols; ++col) {
      const auto code = static_cast<uint8_t>(q[r * cols + col]);
      back[r * cols + col] = c.fp8 ? f8e4m3_to_f32(code) * scales[(r / 128) * 2 + col / 128]
                                   : static_cast<float>(static_cast<int8_t>(code)) * scales[r];
    }
  return back;
}

// A block (FP8) or row (INT8) whose amax/448 (amax/127) is below the smallest normal float took
// that scale, 0 for a subnormal weight: its codes were 0/0, NaN at load. The scale is at least
// FLT_MIN: such weights quantize to (nearly) zero, within the format's rounding.
TEST(Quantize, WeightsTooSmallForANormalScaleComeBackNearlyZeroNeverNaN) {
  for (const bool fp8 : {true, false}) {
    SCOPED_TRACE(fp8 ? "fp8" : "int8");
    ModelConfig c;
    if (fp8)
      c.fp8 = Fp8Quantization{};
    else
      c.int8 = Int8Quantization{};
    const int64_t rows = 2, cols = 256;  // FP8: two 128x128 blocks, each holding one row or two
    std::vector<float> w(static_cast<size_t>(rows * cols), 0.f);
    w[5] = 1e-44f;                              // subnormal: amax/448 and amax/127 are 0
    for (int64_t col = 128; col < cols; ++col)  // normal, but amax/448 is subnormal
      w[cols + col] = (col % 2 ? 1.f : -1.f) * 1e-37f * static_cast<float>(col - 127) / 128.f;
    std::vector<float> scales;
    const std::vector<float> back = quantized_and_back(c, w, rows, cols, scales);
    for (const float s : scales) EXPECT_TRUE(std::isnormal(s)) << s;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t col = 0; col < cols; ++col) {
        const float v = w[r * cols + col], got = back[r * cols + col];
        const float s = fp8 ? scales[(r / 128) * 2 + col / 128] : scales[r];
        // FP8 E4M3: half of its 3-bit mantissa's step, or of its smallest subnormal step (2^-9)
        // in units of the scale; INT8: half a step.
        const float rounding =
            fp8 ? std::max(std::fabs(v) / 16.f, s * std::ldexp(1.f, -10)) : s * 0.5f;
        ASSERT_TRUE(std::isfinite(got)) << "[" << r << ", " << col << "]";
        EXPECT_LE(std::fabs(got - v), rounding) << "[" << r << ", " << col << "]";
      }
  }
}

// Sets element `index` of the F32 tensor `name` in the checkpoint `dir`, in its shard's bytes.
void set_f32_element(const fs::path& dir, const std::string& name, int64_t index, float value) {
  const auto index_json =
      nlohmann::json::parse(test::read_bytes(dir / "model.safetensors.index.json"));
  const fs::path shard = dir / index_json["weight_map"][name].get<std::string>();
  std::string bytes = test::read_bytes(shard);
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), sizeof header);
  const auto tensors = nlohmann::json::parse(bytes.substr(8, header));
  ASSERT_EQ(tensors[name]["dtype"], "F32");
  const size_t at = 8 + header + tensors[name]["data_offsets"][0].get<size_t>() +
                    static_cast<size_t>(index) * sizeof value;
  std::memcpy(bytes.data() + at, &value, sizeof value);
  test::write_bytes(shard, bytes);
}

// An infinite or NaN weight has no scale that keeps its block (row) finite: it was quantized into
// a block of NaNs at load, silently. It is refused, naming the tensor and the element.
TEST(Quantize, ANonFiniteWeightIsRefusedNamingTheTensorAndTheElement) {
  const std::string name = "model.layers.0.self_attn.o_proj.weight";
  test::TempDir f32("quantize-inf"), out("quantize-inf-out");
  make("tiny-v3", f32.path(), DType::kF32, 5);
  const int64_t cols = Checkpoint::open(f32.path()).tensors().at(name).shape[1];
  for (const auto& [value, said] :
       {std::pair{INFINITY, "inf"}, std::pair{-INFINITY, "-inf"}, std::pair{NAN, "nan"}}) {
    set_f32_element(f32.path(), name, 3 * cols + 17, value);
    for (DType dtype : {DType::kI8, DType::kF8E4M3}) {
      SCOPED_TRACE(std::string(said) + " " + std::string(dtype_name(dtype)));
      QuantizeOptions o;
      o.in = f32.path();
      o.out = out.path();
      o.dtype = dtype;
      try {
        quantize_checkpoint(o);
        ADD_FAILURE() << "quantized";
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()), name + " [3, 17] is " + said + ": cannot quantize");
      }
    }
  }
}

// A model's chat templates in all the places Tokenizer::from_dir finds them.
void add_chat_template_files(const fs::path& dir, const std::string& tag) {
  test::write_bytes(dir / "chat_template.jinja", "{{ '" + tag + " default' }}");
  fs::create_directories(dir / "additional_chat_templates");
  test::write_bytes(dir / "additional_chat_templates" / "tool_use.jinja",
                    "{{ '" + tag + " tools' }}");
  test::write_bytes(dir / "chat_template.json",
                    R"({"chat_template": "{{ ')" + tag + R"( processor' }}"})");
}

std::vector<std::string> template_texts(const fs::path& dir) {
  std::vector<std::string> texts;
  const auto tok = text::Tokenizer::from_dir(dir);
  for (const auto& t : tok.chat_templates()) texts.push_back(t.name + ": " + t.source);
  return texts;
}

// The quantized folder holds the source's whole tokenizer: chat_template.jinja,
// additional_chat_templates/ and chat_template.json besides tokenizer*.json, so the quantized
// model renders chats with the source's templates.
TEST(Quantize, CopiesEveryFileTheTokenizerReads) {
  test::TempDir bf16("quantize-tok"), out("quantize-tok-out");
  make("tiny-v3", bf16.path(), DType::kBF16, 3);
  add_chat_template_files(bf16.path(), "source");
  QuantizeOptions o;
  o.in = bf16.path();
  o.out = out.path();
  o.dtype = DType::kI8;
  quantize_checkpoint(o);
  for (const std::string file :
       {"chat_template.jinja", "additional_chat_templates/tool_use.jinja", "chat_template.json",
        "generation_config.json", "tokenizer.json", "tokenizer_config.json"})
    EXPECT_EQ(test::read_bytes(out / file), test::read_bytes(bf16 / file)) << file;
  EXPECT_EQ(template_texts(out.path()), template_texts(bf16.path()));
  EXPECT_EQ(template_texts(out.path()).size(), 2u);
}

// Quantizing into a folder that held another model leaves nothing of it: its template files go
// (the new model's tokenizer_config.json template is the one it renders with), as its weights do.
TEST(Quantize, AnEarlierModelsTokenizerFilesInTheOutputFolderGo) {
  test::TempDir bf16("quantize-stale"), out("quantize-stale-out");
  make("tiny-v3", bf16.path(), DType::kBF16, 3);
  add_chat_template_files(out.path(), "stale");
  fs::create_directories(out / "additional_chat_templates" / "nested");
  test::write_bytes(out / "generation_config.json", "{\"stale\": true}");
  fs::remove(bf16 / "generation_config.json");
  QuantizeOptions o;
  o.in = bf16.path();
  o.out = out.path();
  o.dtype = DType::kI8;
  quantize_checkpoint(o);
  for (const std::string file : {"chat_template.jinja", "additional_chat_templates",
                                 "chat_template.json", "generation_config.json"})
    EXPECT_FALSE(fs::exists(out / file)) << file;
  EXPECT_EQ(template_texts(out.path()), template_texts(bf16.path()));
}

// make-model --tokenizer copies the tokenizer folder's templates too, and into a folder that held
// another model's, leaves only its own.
TEST(MakeModel, CopiesEveryFileTheTokenizerReadsAndNoneOfAnEarlierModels) {
  test::TempDir tok("make-tok"), out("make-tok-out"), again("make-tok-again");
  for (const auto& entry : fs::directory_iterator(deepseek_tokenizer()))
    fs::copy(entry.path(), tok / entry.path().filename().string());
  add_chat_template_files(tok.path(), "tokenizer");
  MakeModelOptions o;
  o.preset = "tiny-v3";
  o.out = out.path();
  o.tokenizer_dir = tok.path();
  make_model(o);
  for (const std::string file :
       {"chat_template.jinja", "additional_chat_templates/tool_use.jinja", "chat_template.json"})
    EXPECT_EQ(test::read_bytes(out / file), test::read_bytes(tok / file)) << file;
  EXPECT_EQ(template_texts(out.path()), template_texts(tok.path()));

  add_chat_template_files(again.path(), "stale");
  o.out = again.path();
  o.tokenizer_dir = deepseek_tokenizer();
  make_model(o);
  for (const std::string file :
       {"chat_template.jinja", "additional_chat_templates", "chat_template.json"})
    EXPECT_FALSE(fs::exists(again / file)) << file;
  EXPECT_EQ(template_texts(again.path()), template_texts(deepseek_tokenizer()));
}

// A checkpoint without the MTP layer its config names (a derived V3/R1 one) quantizes without it,
// keeping the config's field as the source does; the result loads the same way.
TEST(Quantize, ACheckpointWithoutItsConfigsMtpTensorsQuantizesWithoutThem) {
  test::TempDir in("quantize-no-mtp"), out("quantize-no-mtp-out");
  ModelConfig c = preset_config("tiny-v3");
  c.num_nextn_predict_layers = 0;
  test::write_random_checkpoint(in.path(), c);
  nlohmann::json doc = nlohmann::json::parse(test::read_bytes(in / "config.json"));
  doc["num_nextn_predict_layers"] = 1;
  test::write_bytes(in / "config.json", doc.dump(2));
  QuantizeOptions o;
  o.in = in.path();
  o.out = out.path();
  o.dtype = DType::kF8E4M3;
  const ModelConfig q = quantize_checkpoint(o);
  EXPECT_EQ(q.num_nextn_predict_layers, 1);
  const auto ck = Checkpoint::open(out.path());
  EXPECT_EQ(ck.find("model.layers.3.enorm.weight"), nullptr);
  ModelConfig held = ModelConfig::load(out.path());
  EXPECT_THAT(drop_absent_mtp_layers(ck, held), HasSubstr("num_nextn_predict_layers: 1"));
  EXPECT_NO_THROW(validate_checkpoint(ck, held));
}

TEST(Quantize, RefusesWhatItCannotDo) {
  test::TempDir made("quantize-err"), out("quantize-err-out");
  make("tiny-v3", made.path(), DType::kI8, 1);
  QuantizeOptions o;
  o.in = made.path();
  o.out = out.path();
  auto message = [&] {
    try {
      quantize_checkpoint(o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_THAT(message(), AllOf(HasSubstr("already quantized"), HasSubstr("config.json")));
  o.dtype = DType::kBF16;
  EXPECT_THAT(message(), HasSubstr("int8 or fp8"));
  o.dtype = DType::kI8;
  o.out = made.path();
  EXPECT_THAT(message(), HasSubstr("another folder"));
  o.in = out.path() / "nowhere";
  o.out = out.path() / "x";
  EXPECT_THAT(message(), HasSubstr("nowhere"));
}

TEST(MakeModel, Errors) {
  test::TempDir dir("make-errors");
  EXPECT_THAT(
      [&] {
        try {
          preset_config("huge");
        } catch (const Error& e) {
          return std::string(e.what());
        }
        return std::string();
      }(),
      AllOf(HasSubstr("'huge'"), HasSubstr("tiny-v3"), HasSubstr("bench")));
  MakeModelOptions o;
  o.preset = "tiny-v3";
  o.out = dir.path();
  o.tokenizer_dir = test::lenml_model("qwen3");  // 151669 ids: more than vocab_size 129280
  try {
    make_model(o);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("vocab_size 129280"), HasSubstr("151")));
  }
  o.tokenizer_dir = dir / "nowhere";
  EXPECT_THROW(make_model(o), Error);
}

// config.json and generation_config.json were checked for errors before the stream was closed,
// so a failure to write their buffered bytes went unseen. They are now written beside their
// place and renamed into it (util/file: write_file_atomically, whose own tests cover failed
// writes); a generation_config.json that cannot be replaced is reported, not passed over.
TEST(MakeModel, AFailedWriteOfItsJsonFilesIsAnError) {
  test::TempDir dir("make-full");
  fs::create_directories(dir / "generation_config.json" / "in-the-way");
  try {
    make("tiny-v3", dir.path(), DType::kBF16);
    FAIL() << "make_model reported success";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr((dir / "generation_config.json").string() + ": cannot rename"));
  }
}

// Shards were written through `<shard>.tmp`, opened with fopen: a link left under that name was
// followed and the file it named overwritten with tensor data, and two writers of one folder
// shared it. They now go through util/file's temporary files (O_EXCL, a name of their own).
TEST(MakeModel, ALinkUnderAShardsOldTemporaryNameIsNotFollowed) {
  test::TempDir dir("make-link");
  test::TempDir elsewhere("make-link-victim");
  test::write_bytes(elsewhere / "victim", "keep");
  fs::create_symlink(elsewhere / "victim", dir / "model-00001-of-00006.safetensors.tmp");
  make("tiny-v3", dir.path(), DType::kBF16);
  EXPECT_EQ(read_file(elsewhere / "victim"), "keep");
  EXPECT_TRUE(fs::is_regular_file(dir / "model-00001-of-00006.safetensors"));
}

// ---- The CLI ----

test::CommandResult tandem(const std::string& args) {
  return test::run_capture(std::string(TANDEM_BINARY) + " " + args + " 2>&1");
}

TEST(MakeModelCli, WritesAValidatedCheckpoint) {
  test::TempDir dir("cli");
  const auto r = tandem("make-model --preset tiny-v2-lite --dtype int8 --seed 5 --out " +
                        test::quote(dir / "m"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("DeepseekV2ForCausalLM"));
  const ModelConfig c = ModelConfig::load(dir / "m");
  EXPECT_TRUE(c.int8);
  EXPECT_NO_THROW(validate_checkpoint(Checkpoint::open(dir / "m"), c));
  // Same as the library with the same options.
  test::TempDir lib("cli-lib");
  make("tiny-v2-lite", lib.path(), DType::kI8, 5);
  EXPECT_EQ(test::read_bytes(dir / "m" / "model-00001-of-00006.safetensors"),
            test::read_bytes(lib / "model-00001-of-00006.safetensors"));
}

TEST(MakeModelCli, QuantizeWritesALoadableCheckpoint) {
  test::TempDir dir("cli-quantize");
  auto r = tandem("make-model --preset tiny-v3 --dtype bf16 --out " + test::quote(dir / "m"));
  ASSERT_EQ(r.status, 0) << r.output;
  r = tandem("quantize --in " + test::quote(dir / "m") + " --out " + test::quote(dir / "q") +
             " --dtype fp8");
  ASSERT_EQ(r.status, 0) << r.output;
  const ModelConfig c = ModelConfig::load(dir / "q");
  EXPECT_TRUE(c.fp8);
  EXPECT_NO_THROW(validate_checkpoint(Checkpoint::open(dir / "q"), c));
  r = tandem("quantize --in " + test::quote(dir / "m") + " --out " + test::quote(dir / "q2") +
             " --dtype f16");
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.output, AllOf(HasSubstr("--dtype"), HasSubstr("f16")));
}

TEST(MakeModelCli, ClearErrors) {
  test::TempDir dir("cli-err");
  const std::string out = " --out " + test::quote(dir / "m");
  auto r = tandem("make-model --preset nope" + out);
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.output, AllOf(HasSubstr("unknown model preset 'nope'"), HasSubstr("tiny-v2-lite")));
  r = tandem("make-model --preset tiny-v3 --dtype int4" + out);
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.output, AllOf(HasSubstr("--dtype"), HasSubstr("int4")));
  r = tandem("make-model --preset tiny-v3 --tokenizer " + test::quote(dir.path()) + out);
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.output, AllOf(HasSubstr("--tokenizer"), HasSubstr("tokenizer.json")));
  r = tandem("make-model --preset tiny-v3 --layers 999" + out);
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.output, AllOf(HasSubstr("--layers 999"), HasSubstr("1..256")));
  r = tandem("make-model --help");
  EXPECT_EQ(r.status, 0);
  EXPECT_THAT(r.output, AllOf(HasSubstr("tiny-v3"), HasSubstr("--seed"), HasSubstr("fp8"),
                              HasSubstr("--layers")));
}

}  // namespace
}  // namespace tandem::model
