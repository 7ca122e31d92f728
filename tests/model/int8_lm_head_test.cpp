// --int8-lm-head: the LM head (and the MTP head) quantized at load, W8A8 like the checkpoint's
// INT8 linears. Every logit must be exactly the W8A8 product of its token's normed hidden state:
// the weights quantized by model/quantize.h's rule, the activations per token (scale
// max|x| / 127, round to nearest), integer sums, then both scales (float32 rounding only).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/ops.h"
#include "model/deepseek.h"
#include "model/latent_cache.h"
#include "model/make_model.h"
#include "model/mapped_pages.h"
#include "model/model_test_support.h"
#include "model/quantize.h"
#include "model/random_checkpoint.h"
#include "model/weights.h"

namespace tandem::model {
namespace {

ModelConfig config() {
  return test::small_vocab_tiny_v3();
}

// The checkpoint's tensor `name` [rows, cols] as float32.
std::vector<float> tensor(const Checkpoint& ckpt, const std::string& name, int64_t rows,
                          int64_t cols) {
  const TensorInfo& t =
      ckpt.get(name, cols > 0 ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{rows});
  std::vector<float> out(static_cast<size_t>(rows * std::max<int64_t>(cols, 1)));
  to_f32(t.dtype, t.data, out.data(), out.size());
  return out;
}

void expect_w8a8_logits(const ModelConfig& c, const std::vector<float>& head,
                        const std::vector<float>& norm, const StepOutput& out, int64_t tokens) {
  const int64_t h = c.hidden_size, vocab = c.vocab_size;
  ModelConfig rule = c;
  rule.int8 = Int8Quantization{};
  std::vector<std::byte> wq(static_cast<size_t>(vocab * h));
  std::vector<float> w_scales;
  quantize_weight(rule, head, vocab, h, wq.data(), w_scales);
  ASSERT_EQ(static_cast<int64_t>(out.logits.size()), tokens * vocab);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<float> x(static_cast<size_t>(h));
    kernels::rmsnorm(out.hidden.data() + t * h, norm.data(), 1, h, c.rms_norm_eps, x.data());
    float amax = 0;
    for (float v : x) amax = std::max(amax, std::abs(v));
    const float x_scale = amax > 0 ? amax / 127.0f : 1.0f, inv = 1.0f / x_scale;
    std::vector<int32_t> xq(x.size());
    for (int64_t k = 0; k < h; ++k)
      xq[k] = static_cast<int32_t>(std::clamp(std::nearbyint(x[k] * inv), -127.0f, 127.0f));
    for (int64_t r = 0; r < vocab; ++r) {
      int64_t sum = 0;
      for (int64_t k = 0; k < h; ++k) sum += static_cast<int8_t>(wq[r * h + k]) * xq[k];
      const float want = static_cast<float>(sum) * w_scales[r] * x_scale;
      ASSERT_NEAR(out.logits[t * vocab + r], want, 1e-6f * std::abs(want) + 1e-9f)
          << "token " << t << " logit " << r;
    }
  }
}

TEST(Int8LmHead, LogitsAreTheW8A8ProductOfTheNormedHiddenStates) {
  const test::TempDir dir("int8-lm-head");
  const ModelConfig c = config();
  test::write_random_checkpoint(dir.path(), c);
  WeightLoadOptions options;
  options.int8_lm_head = true;
  const DeepSeekModel model = DeepSeekModel::load(dir.path(), {}, options);
  ASSERT_EQ(model.weights().lm_head.type, kernels::WeightType::kI8);
  ASSERT_EQ(model.weights().mtp.at(0).head.type, kernels::WeightType::kI8);

  const Checkpoint ckpt = Checkpoint::open(dir.path());
  const auto head = tensor(ckpt, "lm_head.weight", c.vocab_size, c.hidden_size);
  const auto norm = tensor(ckpt, "model.norm.weight", c.hidden_size, 0);
  // Few tokens (the decode kernels) and many (the GEMM), every token's logits.
  for (int64_t tokens : {3, 20}) {
    LatentCache cache(model.cache_shape(16), 4);
    std::vector<int32_t> prompt(static_cast<size_t>(tokens));
    for (int64_t i = 0; i < tokens; ++i) prompt[i] = static_cast<int32_t>(5 + 37 * i);
    const std::vector<int32_t> table = {0, 1};
    SequenceStep step{prompt, 0, table, LogitRows::kAll};
    const StepOutput out = model.forward(std::span(&step, 1), cache);
    expect_w8a8_logits(c, head, norm, out, tokens);
  }
}

using test::present_pages;
using test::whole_pages;

// The file's embedding rows of a tied model loaded with an INT8 head.
const TensorInfo& tied_embedding(const Weights& w, const ModelConfig& c) {
  return w.checkpoint.get("model.embed_tokens.weight", {c.vocab_size, c.hidden_size});
}

// A tied model whose embedding the binder holds in memory of its own (an F16 one widened to F32;
// a misaligned BF16 or F32 one copied) reads no row of the file's embedding after load, so
// quantizing the LM head from those rows gives their pages back, as every copied or converted
// matrix's are. The quantization read them all and kept them, as if the embedding looked its rows
// up there. An embedding read in place still has its pages: it looks its rows up in them.
TEST(Int8LmHead, ATiedEmbeddingsMappedRowsAreKeptOnlyWhereItReadsThem) {
  ModelConfig c = config();
  c.tie_word_embeddings = true;
  WeightLoadOptions options;
  options.int8_lm_head = true;

  const test::TempDir widened_dir("int8-lm-head-tied-f16");
  test::write_random_checkpoint(widened_dir.path(), c, DType::kF16);
  const Weights widened = Weights::load(Checkpoint::open(widened_dir.path()), c, {}, options);
  ASSERT_FALSE(widened.embed.storage.empty());  // F32 rows of its own
  ASSERT_EQ(widened.lm_head.type, kernels::WeightType::kI8);
  const TensorInfo& f16 = tied_embedding(widened, c);
  const int64_t f16_pages = whole_pages(f16.data, f16.nbytes).count;
  ASSERT_GT(f16_pages, 16);
  EXPECT_EQ(present_pages(f16.data, f16.nbytes), 0);
  // Read again, they come back: what present_pages counts is real.
  volatile std::byte sink{};
  for (size_t i = 0; i < f16.nbytes; i += 512) sink = sink ^ f16.data[i];
  EXPECT_EQ(present_pages(f16.data, f16.nbytes), f16_pages);

  const test::TempDir in_place_dir("int8-lm-head-tied-bf16");
  test::write_random_checkpoint(in_place_dir.path(), c, DType::kBF16);
  const Weights in_place = Weights::load(Checkpoint::open(in_place_dir.path()), c, {}, options);
  const TensorInfo& bf16 = tied_embedding(in_place, c);
  ASSERT_TRUE(in_place.embed.storage.empty());
  ASSERT_EQ(in_place.embed.data, bf16.data);  // looked up in the mapping
  EXPECT_EQ(present_pages(bf16.data, bf16.nbytes), whole_pages(bf16.data, bf16.nbytes).count);
}

// A tied INT8 head is quantized from the embedding as the binder holds it (F16 widened to F32,
// BF16 and F32 as they are), not from the file a second time: the same INT8 rows and scales as
// the W8A8 rule applied to the file's tensor, bit for bit, whatever the file's dtype.
TEST(Int8LmHead, ATiedHeadIsTheW8A8QuantizationOfTheFilesEmbedding) {
  ModelConfig c = config();
  c.tie_word_embeddings = true;
  WeightLoadOptions options;
  options.int8_lm_head = true;
  ModelConfig rule = c;
  rule.int8 = Int8Quantization{};
  for (const DType dtype : {DType::kF16, DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(dtype_name(dtype));
    const test::TempDir dir("int8-lm-head-tied-quantized");
    test::write_random_checkpoint(dir.path(), c, dtype);
    const Weights w = Weights::load(Checkpoint::open(dir.path()), c, {}, options);
    const std::vector<float> file =
        tensor(w.checkpoint, "model.embed_tokens.weight", c.vocab_size, c.hidden_size);
    std::vector<std::byte> want(file.size());
    std::vector<float> want_scales;
    quantize_weight(rule, file, c.vocab_size, c.hidden_size, want.data(), want_scales);
    ASSERT_EQ(w.lm_head.type, kernels::WeightType::kI8);
    ASSERT_EQ(w.lm_head.storage.size(), want.size());
    EXPECT_TRUE(std::equal(want.begin(), want.end(),
                           reinterpret_cast<const std::byte*>(w.lm_head.storage.data())));
    EXPECT_EQ(w.lm_head.row_scales, want_scales);
  }
}

}  // namespace
}  // namespace tandem::model
