// W_UK transposed and packed for absorbed attention (AttentionWeights::k_up_t): every element is
// the key row value of kv_b it stands for, as stored for a BF16 checkpoint and, for an INT8 one,
// the INT8 value times its row's scale rounded to BF16 (the copy the decode row kernels stream).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/ops.h"
#include "model/deepseek.h"
#include "model/make_model.h"
#include "model/model_test_support.h"
#include "text/oracle_support.h"

namespace tandem::model {
namespace {

class KeyUp : public ::testing::TestWithParam<DType> {};

// Whether this CPU packs a BF16 matrix of k_up_t's shape for tiny-v3 (AVX-512 BF16).
bool packs_bf16() {
  std::vector<uint16_t> zeros(4 * 64 * 16);
  kernels::Matrix m = kernels::matrix_view(4 * 64, 16, kernels::WeightType::kBF16, zeros.data());
  return kernels::pack_for_gemm(m);
}

TEST_P(KeyUp, TransposedCopyHoldsEveryHeadsKeyRowsOfKvB) {
  const test::TempDir dir("key-up");
  MakeModelOptions o;
  o.preset = "tiny-v3";  // kv_lora_rank 64: one whole row block per head
  o.out = dir.path();
  o.tokenizer_dir = test::lenml_model("deepseek_v3");
  o.dtype = GetParam();
  o.seed = 11;
  const ModelConfig c = make_model(o);
  const auto model = DeepSeekModel::load(dir.path());
  const int64_t heads = c.num_attention_heads, nope = c.qk_nope_head_dim, v = c.v_head_dim,
                latent = c.kv_lora_rank;
  if (!packs_bf16()) GTEST_SKIP() << "no packed BF16 layout on this CPU";
  for (const LayerWeights& layer : model.weights().layers) {
    const kernels::Matrix& kv_b = layer.attn.kv_b;
    const kernels::Matrix& t = layer.attn.k_up_t;
    ASSERT_TRUE(t.packed);
    ASSERT_EQ(t.type, kernels::WeightType::kBF16);
    ASSERT_EQ(t.rows, heads * latent);
    ASSERT_EQ(t.cols, nope);
    const auto* packed = reinterpret_cast<const uint16_t*>(t.packed->data.get());
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = 0; r < nope; ++r) {
        const int64_t row = h * (nope + v) + r;
        for (int64_t col = 0; col < latent; ++col) {
          const int64_t at = row * latent + col;
          const uint16_t want =
              kv_b.type == kernels::WeightType::kI8
                  ? kernels::f32_to_bf16(static_cast<const int8_t*>(kv_b.data)[at] *
                                         kv_b.row_scales[row])
                  : static_cast<const uint16_t*>(kv_b.data)[at];
          ASSERT_EQ(packed[t.packed->layout.offset(h * latent + col, r)], want)
              << "head " << h << " key row " << r << " latent " << col;
        }
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KeyUp, ::testing::Values(DType::kBF16, DType::kI8),
                         [](const auto& info) {
                           return std::string(info.param == DType::kI8 ? "int8" : "bf16");
                         });

}  // namespace
}  // namespace tandem::model
