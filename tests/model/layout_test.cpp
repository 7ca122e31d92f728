// The checkpoint layout against the published releases' tensor names, shapes and counts, and
// validate_checkpoint's errors for missing, extra, mis-shaped and mistyped tensors.
#include "model/layout.h"

#include <map>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model/make_model.h"
#include "model/model_test_support.h"
#include "text/oracle_support.h"
#include "util/error.h"

namespace tandem::model {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using Shape = std::vector<int64_t>;

// DeepSeek-V3 / R1 (config.json of the release) as a ModelConfig.
ModelConfig v3_config() {
  ModelConfig c = preset_config("tiny-v3");
  c.vocab_size = 129280;
  c.hidden_size = 7168;
  c.intermediate_size = 18432;
  c.moe_intermediate_size = 2048;
  c.num_hidden_layers = 61;
  c.num_attention_heads = 128;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.n_routed_experts = 256;
  c.n_shared_experts = 1;
  c.num_experts_per_tok = 8;
  c.n_group = 8;
  c.topk_group = 4;
  c.first_k_dense_replace = 3;
  c.num_nextn_predict_layers = 1;
  c.fp8 = Fp8Quantization{};
  return c;
}

// DeepSeek-V2-Lite.
ModelConfig v2_lite_config() {
  ModelConfig c = preset_config("bench");
  c.vocab_size = 102400;
  c.num_hidden_layers = 27;
  return c;
}

std::map<std::string, TensorSpec> by_name(const std::vector<TensorSpec>& specs) {
  std::map<std::string, TensorSpec> m;
  for (const auto& s : specs) m.emplace(s.name, s);
  return m;
}

void expect_tensor(const std::map<std::string, TensorSpec>& m, const std::string& name, DType dtype,
                   const Shape& shape) {
  auto it = m.find(name);
  ASSERT_NE(it, m.end()) << name;
  EXPECT_EQ(it->second.dtype, dtype) << name;
  EXPECT_EQ(it->second.shape, shape) << name;
}

int64_t parameters(const std::vector<TensorSpec>& specs) {
  int64_t n = 0;
  for (const auto& s : specs) {
    if (s.name.find("weight_scale") != std::string::npos) continue;
    int64_t e = 1;
    for (int64_t d : s.shape) e *= d;
    n += e;
  }
  return n;
}

TEST(Layout, DeepSeekV3Fp8MatchesTheRelease) {
  const auto specs = checkpoint_layout(v3_config(), DType::kF8E4M3);
  // deepseek-ai/DeepSeek-V3's model.safetensors.index.json maps 91991 tensors, and the model
  // card counts 685B parameters (671B main model + 14B MTP module, embedding and head copies
  // included).
  EXPECT_EQ(specs.size(), 91991u);
  EXPECT_NEAR(static_cast<double>(parameters(specs)), 684.5e9, 1.0e9);
  const auto m = by_name(specs);
  const DType f8 = DType::kF8E4M3, bf = DType::kBF16, f32 = DType::kF32;
  expect_tensor(m, "model.embed_tokens.weight", bf, {129280, 7168});
  expect_tensor(m, "model.layers.0.input_layernorm.weight", bf, {7168});
  expect_tensor(m, "model.layers.0.self_attn.q_a_proj.weight", f8, {1536, 7168});
  expect_tensor(m, "model.layers.0.self_attn.q_a_proj.weight_scale_inv", f32, {12, 56});
  expect_tensor(m, "model.layers.0.self_attn.q_a_layernorm.weight", bf, {1536});
  expect_tensor(m, "model.layers.0.self_attn.q_b_proj.weight", f8, {24576, 1536});
  expect_tensor(m, "model.layers.0.self_attn.q_b_proj.weight_scale_inv", f32, {192, 12});
  expect_tensor(m, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", f8, {576, 7168});
  expect_tensor(m, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv", f32, {5, 56});
  expect_tensor(m, "model.layers.0.self_attn.kv_a_layernorm.weight", bf, {512});
  expect_tensor(m, "model.layers.0.self_attn.kv_b_proj.weight", f8, {32768, 512});
  expect_tensor(m, "model.layers.0.self_attn.kv_b_proj.weight_scale_inv", f32, {256, 4});
  expect_tensor(m, "model.layers.0.self_attn.o_proj.weight", f8, {7168, 16384});
  expect_tensor(m, "model.layers.0.self_attn.o_proj.weight_scale_inv", f32, {56, 128});
  expect_tensor(m, "model.layers.2.mlp.gate_proj.weight", f8, {18432, 7168});
  expect_tensor(m, "model.layers.2.mlp.down_proj.weight_scale_inv", f32, {56, 144});
  EXPECT_FALSE(m.count("model.layers.3.mlp.gate_proj.weight"));
  expect_tensor(m, "model.layers.3.mlp.gate.weight", bf, {256, 7168});
  expect_tensor(m, "model.layers.3.mlp.gate.e_score_correction_bias", f32, {256});
  expect_tensor(m, "model.layers.3.mlp.experts.255.down_proj.weight", f8, {7168, 2048});
  expect_tensor(m, "model.layers.3.mlp.experts.255.down_proj.weight_scale_inv", f32, {56, 16});
  expect_tensor(m, "model.layers.60.mlp.shared_experts.up_proj.weight", f8, {2048, 7168});
  expect_tensor(m, "model.norm.weight", bf, {7168});
  expect_tensor(m, "lm_head.weight", bf, {129280, 7168});
  expect_tensor(m, "model.layers.61.embed_tokens.weight", bf, {129280, 7168});
  expect_tensor(m, "model.layers.61.enorm.weight", bf, {7168});
  expect_tensor(m, "model.layers.61.hnorm.weight", bf, {7168});
  expect_tensor(m, "model.layers.61.eh_proj.weight", bf, {7168, 14336});
  expect_tensor(m, "model.layers.61.self_attn.q_b_proj.weight", f8, {24576, 1536});
  expect_tensor(m, "model.layers.61.mlp.experts.0.gate_proj.weight", f8, {2048, 7168});
  expect_tensor(m, "model.layers.61.shared_head.norm.weight", bf, {7168});
  expect_tensor(m, "model.layers.61.shared_head.head.weight", bf, {129280, 7168});
  EXPECT_FALSE(m.count("model.layers.62.enorm.weight"));
  EXPECT_FALSE(m.count("model.layers.61.eh_proj.weight_scale_inv"));
  EXPECT_FALSE(m.count("model.layers.3.mlp.gate.weight_scale_inv"));
  EXPECT_FALSE(m.count("lm_head.weight_scale_inv"));
}

// meituan/DeepSeek-R1-Channel-INT8: the same linears quantized, each with an F32 [out, 1] scale.
TEST(Layout, Int8PerChannel) {
  ModelConfig c = v3_config();
  c.fp8.reset();
  c.int8 = Int8Quantization{};
  const auto specs = checkpoint_layout(c, DType::kI8);
  EXPECT_EQ(specs.size(), 91991u);
  const auto m = by_name(specs);
  expect_tensor(m, "model.layers.0.self_attn.q_a_proj.weight", DType::kI8, {1536, 7168});
  expect_tensor(m, "model.layers.0.self_attn.q_a_proj.weight_scale", DType::kF32, {1536, 1});
  expect_tensor(m, "model.layers.5.mlp.experts.7.up_proj.weight_scale", DType::kF32, {2048, 1});
  expect_tensor(m, "model.layers.5.mlp.gate.weight", DType::kBF16, {256, 7168});
  EXPECT_FALSE(m.count("model.layers.0.self_attn.q_a_proj.weight_scale_inv"));
}

TEST(Layout, DeepSeekV2LiteBf16) {
  const auto specs = checkpoint_layout(v2_lite_config(), DType::kBF16);
  // DeepSeek-V2-Lite has 15.7B parameters.
  EXPECT_NEAR(static_cast<double>(parameters(specs)), 15.7e9, 0.05e9);
  const auto m = by_name(specs);
  expect_tensor(m, "model.layers.0.self_attn.q_proj.weight", DType::kBF16, {3072, 2048});
  expect_tensor(m, "model.layers.0.self_attn.kv_b_proj.weight", DType::kBF16, {4096, 512});
  expect_tensor(m, "model.layers.0.mlp.down_proj.weight", DType::kBF16, {2048, 10944});
  expect_tensor(m, "model.layers.26.mlp.shared_experts.gate_proj.weight", DType::kBF16,
                {2816, 2048});
  expect_tensor(m, "model.layers.26.mlp.experts.63.gate_proj.weight", DType::kBF16, {1408, 2048});
  EXPECT_FALSE(m.count("model.layers.0.self_attn.q_a_proj.weight"));
  EXPECT_FALSE(m.count("model.layers.1.mlp.gate.e_score_correction_bias"));
  EXPECT_FALSE(m.count("model.layers.27.eh_proj.weight"));
  // The F32 correction bias stays F32 in a BF16 checkpoint; tied embeddings drop lm_head.
  ModelConfig c = preset_config("tiny-v3");
  c.tie_word_embeddings = true;
  const auto tied = by_name(checkpoint_layout(c, DType::kBF16));
  EXPECT_FALSE(tied.count("lm_head.weight"));
  expect_tensor(tied, "model.layers.1.mlp.gate.e_score_correction_bias", DType::kF32, {8});
  expect_tensor(tied, "model.layers.3.shared_head.head.weight", DType::kBF16, {129280, 64});
}

TEST(Layout, WeightDtypeMustMatchTheQuantization) {
  ModelConfig c = preset_config("tiny-v3");
  EXPECT_THROW(checkpoint_layout(c, DType::kF8E4M3), Error);
  EXPECT_THROW(checkpoint_layout(c, DType::kI8), Error);
  c.fp8 = Fp8Quantization{};
  EXPECT_THROW(checkpoint_layout(c, DType::kBF16), Error);
  EXPECT_THROW(checkpoint_layout(c, DType::kI8), Error);
  EXPECT_NO_THROW(checkpoint_layout(c, DType::kF8E4M3));
}

// ---- validate_checkpoint ----

void fill_zero(const TensorSpec&, std::span<std::byte> out) {
  std::fill(out.begin(), out.end(), std::byte{0});
}

std::string validate_error(const std::filesystem::path& dir, const ModelConfig& c) {
  try {
    validate_checkpoint(Checkpoint::open(dir), c);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

class ValidateTest : public ::testing::Test {
 protected:
  ModelConfig config_ = preset_config("tiny-v2-lite");
  std::vector<TensorSpec> specs_ = checkpoint_layout(config_, DType::kBF16);
  test::TempDir dir_{"validate"};

  std::string check(const std::vector<TensorSpec>& specs) {
    write_checkpoint(dir_.path(), specs, fill_zero, size_t{1} << 20);
    return validate_error(dir_.path(), config_);
  }
  std::vector<TensorSpec> without(const std::string& name) {
    auto s = specs_;
    std::erase_if(s, [&](const TensorSpec& t) { return t.name == name; });
    return s;
  }
};

TEST_F(ValidateTest, CompleteCheckpointPasses) {
  EXPECT_EQ(check(specs_), "(no error)");
  // Unquantized tensors may come in any float dtype: the loader converts them.
  auto f32 = specs_;
  for (auto& s : f32)
    if (s.name.find("norm") != std::string::npos) s.dtype = DType::kF32;
  EXPECT_EQ(check(f32), "(no error)");
}

TEST_F(ValidateTest, MissingTensor) {
  const std::string name = "model.layers.1.mlp.experts.3.up_proj.weight";
  EXPECT_THAT(check(without(name)),
              AllOf(HasSubstr(dir_.path().string()), HasSubstr("missing tensor '" + name + "'"),
                    HasSubstr("BF16 [48, 96]")));
}

TEST_F(ValidateTest, ExtraTensor) {
  auto s = specs_;
  s.push_back({"model.layers.1.mlp.experts.8.up_proj.weight", DType::kBF16, {48, 96}});
  EXPECT_THAT(check(s),
              AllOf(HasSubstr("unexpected tensor 'model.layers.1.mlp.experts.8.up_proj.weight'"),
                    HasSubstr("DeepseekV2ForCausalLM")));
}

TEST_F(ValidateTest, MisShapedTensor) {
  auto s = specs_;
  for (auto& t : s)
    if (t.name == "model.layers.0.self_attn.kv_b_proj.weight") t.shape = {64, 32};
  EXPECT_THAT(check(s), AllOf(HasSubstr("'model.layers.0.self_attn.kv_b_proj.weight'"),
                              HasSubstr("is BF16 [64, 32]"), HasSubstr("expected BF16 [128, 32]")));
}

TEST_F(ValidateTest, QuantizedTensorsInAnUnquantizedConfig) {
  auto s = specs_;
  for (auto& t : s)
    if (t.name == "model.layers.0.self_attn.o_proj.weight") t.dtype = DType::kF8E4M3;
  EXPECT_THAT(check(s), AllOf(HasSubstr("'model.layers.0.self_attn.o_proj.weight'"),
                              HasSubstr("F8_E4M3"), HasSubstr("no quantization_config")));
}

TEST_F(ValidateTest, CountsFurtherProblems) {
  auto s = without("model.norm.weight");
  s.push_back({"stray", DType::kF32, {1}});
  s.push_back({"stray2", DType::kF32, {1}});
  EXPECT_THAT(check(s), AllOf(HasSubstr("missing tensor 'model.norm.weight'"),
                              HasSubstr("2 more problems"), HasSubstr("'stray'")));
}

// An extra tensor's name comes from the file: it was written into the message as it was, so a
// line break split the log line, an escape sequence reached the terminal, and a name of a
// megabyte made a message of a megabyte. It is quoted as the safetensors reader quotes names.
TEST_F(ValidateTest, AnUnexpectedTensorsNameIsQuotedEscapedAndCut) {
  auto s = specs_;
  s.push_back({"evil\nname\x1b[2J", DType::kF32, {1}});
  const std::string error = check(s);
  EXPECT_THAT(error, HasSubstr("unexpected tensor 'evil\\x0aname\\x1b[2J'"));
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  EXPECT_EQ(error.find('\x1b'), std::string::npos) << error;
  auto long_name = specs_;
  long_name.push_back({std::string(1 << 20, 'x'), DType::kF32, {1}});
  EXPECT_LT(check(long_name).size(), size_t{2000});
}

TEST_F(ValidateTest, QuantizedCheckpointNeedsQuantizedWeightsAndFloatScales) {
  config_.int8 = Int8Quantization{};
  auto s = checkpoint_layout(config_, DType::kI8);
  EXPECT_EQ(check(s), "(no error)");
  auto bad = s;
  for (auto& t : bad)
    if (t.name == "model.layers.2.mlp.shared_experts.down_proj.weight_scale") t.dtype = DType::kI8;
  EXPECT_THAT(check(bad),
              AllOf(HasSubstr("'model.layers.2.mlp.shared_experts.down_proj.weight_scale'"),
                    HasSubstr("is I8 [96, 1], expected F32 [96, 1]")));
  bad = s;
  for (auto& t : bad)
    if (t.name == "model.layers.0.self_attn.q_proj.weight") t.dtype = DType::kBF16;
  EXPECT_THAT(check(bad), AllOf(HasSubstr("'model.layers.0.self_attn.q_proj.weight'"),
                                HasSubstr("expected I8 [96, 96]")));
  bad = s;
  for (auto& t : bad)  // BF16 scales are converted like any float tensor
    if (t.name == "model.layers.2.mlp.shared_experts.down_proj.weight_scale")
      t.dtype = DType::kBF16;
  EXPECT_EQ(check(bad), "(no error)");
}

// Derived DeepSeek-V3/R1 checkpoints strip every MTP tensor and keep num_nextn_predict_layers:
// such a checkpoint validates without its MTP layers, with a warning naming the field (it was
// refused for 44 missing tensors). One with some MTP tensors but not all is still refused,
// naming the missing one.
TEST(Layout, AConfigsMtpLayersWithoutAnyTensorAreDroppedSomeMissingAreRefused) {
  const ModelConfig config = preset_config("tiny-v3");
  ASSERT_EQ(config.num_nextn_predict_layers, 1);
  test::TempDir dir("mtp-absent");
  ModelConfig stripped = config;
  stripped.num_nextn_predict_layers = 0;
  write_checkpoint(dir.path(), checkpoint_layout(stripped, DType::kBF16), fill_zero,
                   size_t{1} << 20);
  ModelConfig c = config;
  const std::string warning = drop_absent_mtp_layers(Checkpoint::open(dir.path()), c);
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
  EXPECT_THAT(warning, AllOf(HasSubstr((dir.path() / "config.json").string()),
                             HasSubstr("num_nextn_predict_layers: 1"),
                             HasSubstr("no MTP tensors (model.layers.3.*")));
  EXPECT_EQ(validate_error(dir.path(), c), "(no error)");

  std::vector<TensorSpec> partial = checkpoint_layout(config, DType::kBF16);
  std::erase_if(partial,
                [](const TensorSpec& t) { return t.name == "model.layers.3.enorm.weight"; });
  write_checkpoint(dir.path(), partial, fill_zero, size_t{1} << 20);
  c = config;
  EXPECT_EQ(drop_absent_mtp_layers(Checkpoint::open(dir.path()), c), "");
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_THAT(validate_error(dir.path(), c),
              HasSubstr("missing tensor 'model.layers.3.enorm.weight'"));
  // A config without MTP layers is left alone.
  c = stripped;
  EXPECT_EQ(drop_absent_mtp_layers(Checkpoint::open(dir.path()), c), "");
}

}  // namespace
}  // namespace tandem::model
