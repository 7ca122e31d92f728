// An engine that does not speculate loads a checkpoint without its MTP modules
// (WeightLoadOptions::mtp false): the main model is the same, nothing of the MTP layers is held
// (no packed weights, no cache layer), and missing_mtp() says up front why a checkpoint cannot
// draft. Also what else loading a DeepSeek checkpoint decides about its tensors: a tied model's
// checkpoint that also holds lm_head.weight loads, the embedding its head; an FP8 checkpoint with
// a non-finite weight scale or weight is refused naming the element.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <span>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/deepseek.h"
#include "model/latent_cache.h"
#include "model/make_model.h"
#include "model/model_test_support.h"
#include "model/random_checkpoint.h"
#include "util/error.h"

namespace tandem::model {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

ModelConfig config() {
  return test::small_vocab_tiny_v3();
}

std::vector<float> logits_of(const DeepSeekModel& model, const std::vector<int32_t>& prompt) {
  LatentCache cache(model.cache_shape(16), 4);
  const std::vector<int32_t> table = {0, 1};
  SequenceStep step{prompt, 0, table, LogitRows::kAll};
  const auto logits = model.forward(std::span(&step, 1), cache).logits;
  return {logits.begin(), logits.end()};
}

TEST(MtpLoad, WithoutMtpTheMainModelIsTheSameAndTheMtpLayersAreNotHeld) {
  const test::TempDir dir("mtp-load");
  const ModelConfig c = config();
  ASSERT_EQ(c.num_nextn_predict_layers, 1);
  test::write_random_checkpoint(dir.path(), c);
  size_t full_total = 0;
  const DeepSeekModel full =
      DeepSeekModel::load(dir.path(), [&](size_t, size_t t) { full_total = t; });
  WeightLoadOptions options;
  options.mtp = false;
  size_t done = 0, total = 0;
  const DeepSeekModel main_only = DeepSeekModel::load(
      dir.path(), [&](size_t d, size_t t) { done = d, total = t; }, options);

  ASSERT_EQ(full.weights().mtp.size(), 1u);
  EXPECT_TRUE(main_only.weights().mtp.empty());
  EXPECT_EQ(main_only.config().num_nextn_predict_layers, 0);
  EXPECT_EQ(main_only.cache_shape(16).layers, c.num_hidden_layers);
  EXPECT_EQ(full.cache_shape(16).layers, c.num_hidden_layers + 1);
  // The MTP layer's packed matrices (eh_proj, its attention and experts, its head) are not made,
  // on CPUs that pack weights (AVX-512 BF16 or VNNI); elsewhere neither model packs any.
  if (full.weights().packed_bytes > 0)
    EXPECT_LT(main_only.weights().packed_bytes, full.weights().packed_bytes);
  else
    EXPECT_EQ(main_only.weights().packed_bytes, 0u);
  // The progress bar ends full: the tensors left in the file are not counted.
  EXPECT_GT(total, 0u);
  EXPECT_LT(total, full_total);
  EXPECT_EQ(done, total);

  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 20; ++i) prompt.push_back(5 + 37 * i);
  EXPECT_EQ(logits_of(main_only, prompt), logits_of(full, prompt));
}

TEST(MtpLoad, MissingMtpNamesWhyACheckpointCannotDraft) {
  const ModelConfig c = config();
  const test::TempDir with("mtp-present");
  test::write_random_checkpoint(with.path(), c);
  EXPECT_EQ(DeepSeekModel::missing_mtp(with.path()), "");

  ModelConfig none = c;
  none.num_nextn_predict_layers = 0;
  const test::TempDir without("mtp-none");
  test::write_random_checkpoint(without.path(), none);
  EXPECT_THAT(DeepSeekModel::missing_mtp(without.path()),
              AllOf(HasSubstr((without.path() / "config.json").string()),
                    HasSubstr("num_nextn_predict_layers")));

  // A derived checkpoint: the config names the MTP layer, its tensors were stripped.
  const test::TempDir stripped("mtp-stripped");
  test::write_random_checkpoint(stripped.path(), none);
  std::ofstream(stripped.path() / "config.json") << c.to_json().dump(2);
  EXPECT_THAT(DeepSeekModel::missing_mtp(stripped.path()),
              HasSubstr("no MTP tensors (model.layers.3.*"));
}

// tie_word_embeddings with an lm_head.weight in the file as well (some exporters write both): as
// transformers (tie_weights) and vLLM (skip_prefixes lm_head.), the head is the embedding and the
// file's lm_head is ignored. It was refused as an unexpected tensor.
TEST(TiedHead, AnLmHeadInATiedCheckpointIsIgnoredAndTheEmbeddingIsTheHead) {
  ModelConfig untied = config();
  untied.tie_word_embeddings = false;
  ModelConfig tied = untied;
  tied.tie_word_embeddings = true;
  const test::TempDir both("tied-with-head"), plain("tied-without-head"), own("untied");
  test::write_random_checkpoint(both.path(), untied);  // writes lm_head.weight
  std::ofstream(both.path() / "config.json") << tied.to_json().dump(2);
  test::write_random_checkpoint(plain.path(), tied);  // the same tensors but lm_head
  test::write_random_checkpoint(own.path(), untied);
  ASSERT_NE(Checkpoint::open(both.path()).find("lm_head.weight"), nullptr);
  ASSERT_EQ(Checkpoint::open(plain.path()).find("lm_head.weight"), nullptr);

  size_t done = 0, total = 0;
  const DeepSeekModel with_head =
      DeepSeekModel::load(both.path(), [&](size_t d, size_t t) { done = d, total = t; });
  EXPECT_EQ(done, total);  // the ignored tensor is not counted
  const DeepSeekModel without_head = DeepSeekModel::load(plain.path());
  const DeepSeekModel untied_model = DeepSeekModel::load(own.path());
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 12; ++i) prompt.push_back(7 + 41 * i);
  const std::vector<float> logits = logits_of(with_head, prompt);
  EXPECT_EQ(logits, logits_of(without_head, prompt));
  EXPECT_NE(logits, logits_of(untied_model, prompt));  // the file's lm_head would differ
}

// Overwrites bytes of one tensor in the checkpoint's files: `bytes` at element `index` (of
// `element_size` bytes), found from the safetensors header (8-byte length, JSON, data).
void patch_tensor(const std::filesystem::path& dir, const std::string& tensor, int64_t index,
                  const void* bytes, size_t element_size) {
  std::string file = "model.safetensors";
  if (std::filesystem::exists(dir / "model.safetensors.index.json"))
    file = nlohmann::json::parse(
        test::read_bytes(dir / "model.safetensors.index.json"))["weight_map"][tensor];
  std::fstream f(dir / file, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header_size = 0;
  f.read(reinterpret_cast<char*>(&header_size), 8);
  std::string header(header_size, ' ');
  f.read(header.data(), static_cast<std::streamsize>(header_size));
  const uint64_t begin = nlohmann::json::parse(header)[tensor]["data_offsets"][0];
  f.seekp(static_cast<std::streamoff>(8 + header_size + begin + index * element_size));
  f.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(element_size));
  ASSERT_TRUE(f.good()) << dir / file;
}

std::string load_error(const std::filesystem::path& dir) {
  try {
    DeepSeekModel::load(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "(loaded)";
}

// Checkpoints exported by transformers while RoPE's inv_freq was a persistent buffer hold
// model.layers.N.self_attn.rotary_emb.inv_freq. vLLM's DeepSeek-V2/V3 loader skips every name with
// "rotary_emb.inv_freq" (deepseek_v2.py, load_weights), and so does this one: the model is the
// one without them, and they are not counted as tensors to load. They were refused as unexpected
// tensors. Only those names: a rotary_emb.cos_cached is still refused; and an MTP layer of which
// only the inv_freq is left counts as stripped.
TEST(RotaryBuffers, InvFreqTensorsOfOldExportsAreSkippedAsVllmDoes) {
  const ModelConfig c = config();
  ASSERT_EQ(c.num_nextn_predict_layers, 1);
  const test::TempDir plain("rope-plain"), old("rope-inv-freq"), cached("rope-cos-cached");
  test::write_random_checkpoint(plain.path(), c);
  std::vector<TensorSpec> inv_freq;
  for (int64_t i = 0; i < c.num_hidden_layers + c.num_nextn_predict_layers; ++i)
    inv_freq.push_back({"model.layers." + std::to_string(i) + ".self_attn.rotary_emb.inv_freq",
                        DType::kF32,
                        {c.qk_rope_head_dim / 2}});
  test::copy_with_tensors(plain.path(), old.path(), inv_freq);

  size_t done = 0, total = 0;
  const DeepSeekModel with_buffers =
      DeepSeekModel::load(old.path(), [&](size_t d, size_t t) { done = d, total = t; });
  EXPECT_EQ(done, total);
  EXPECT_EQ(total, Checkpoint::open(plain.path()).tensors().size());
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 12; ++i) prompt.push_back(5 + 37 * i);
  EXPECT_EQ(logits_of(with_buffers, prompt), logits_of(DeepSeekModel::load(plain.path()), prompt));

  const std::string cos = "model.layers.0.self_attn.rotary_emb.cos_cached";
  test::copy_with_tensors(plain.path(), cached.path(), {{cos, DType::kF32, {4, 32}}});
  EXPECT_THAT(load_error(cached.path()), HasSubstr("unexpected tensor '" + cos + "'"));

  // Without the MTP layer's weights, but with its inv_freq: loaded without MTP.
  const test::TempDir stripped("rope-stripped"), stripped_old("rope-stripped-inv-freq");
  ModelConfig no_mtp = c;
  no_mtp.num_nextn_predict_layers = 0;
  test::write_random_checkpoint(stripped.path(), no_mtp);
  std::ofstream(stripped.path() / "config.json") << c.to_json().dump(2);
  test::copy_with_tensors(stripped.path(), stripped_old.path(), inv_freq);
  EXPECT_THAT(DeepSeekModel::missing_mtp(stripped_old.path()), HasSubstr("no MTP tensors"));
  EXPECT_EQ(load_error(stripped_old.path()), "(loaded)");
}

// A NaN or infinite scale made its whole 128x128 block of weights NaN or infinite, and every
// logit with them, without a word. A zero scale is what amax / 448 gives an all-zero block: it
// loads (its block's weights 0).
TEST(Fp8Load, ANonFiniteWeightScaleIsRefusedNamingTheElementAZeroOneLoads) {
  const ModelConfig c = config();
  const std::string scale = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv";
  const std::string weight = "model.layers.1.mlp.shared_experts.down_proj.weight";
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    const test::TempDir dir("fp8-bad-scale");
    test::write_random_checkpoint(dir.path(), c, DType::kF8E4M3);
    const auto shape = Checkpoint::open(dir.path()).find(scale)->shape;
    ASSERT_EQ(shape.size(), 2u);
    ASSERT_GE(shape[1], 1);
    const int64_t row = shape[0] - 1, col = shape[1] - 1;
    patch_tensor(dir.path(), scale, row * shape[1] + col, &bad, 4);
    const std::string element = "element [" + std::to_string(row) + ", " + std::to_string(col);
    EXPECT_THAT(load_error(dir.path()),
                AllOf(HasSubstr("'" + scale + "'"), HasSubstr(element + "]"),
                      HasSubstr(std::isnan(bad) ? "is nan"
                                : bad > 0       ? "is inf"
                                                : "is -inf")))
        << bad;
  }

  const test::TempDir zero("fp8-zero-scale");
  test::write_random_checkpoint(zero.path(), c, DType::kF8E4M3);
  const float nothing = 0;
  patch_tensor(zero.path(), scale, 0, &nothing, 4);
  const DeepSeekModel model = DeepSeekModel::load(zero.path());
  for (const float v : logits_of(model, {2, 40, 600})) ASSERT_TRUE(std::isfinite(v));

  // E4M3's NaN code in a weight: its element is NaN whatever the scale.
  const test::TempDir nan_code("fp8-nan-code");
  test::write_random_checkpoint(nan_code.path(), c, DType::kF8E4M3);
  const uint8_t code = 0x7f;
  patch_tensor(nan_code.path(), weight, 5, &code, 1);
  EXPECT_THAT(load_error(nan_code.path()),
              AllOf(HasSubstr("'" + weight + "'"), HasSubstr("[0, 5]"), HasSubstr("is nan")));
}

}  // namespace
}  // namespace tandem::model
