// The CPU matrix products against a double-precision reference, for every weight type and the
// token counts that select different kernels (row dots for 1-4 tokens, chunks of four, oneDNN
// GEMMs from 4 or 16 tokens), with odd widths that exercise the masked tails. Each kernel's
// documented rounding is part of the reference: BF16 products round activations to BF16, INT8
// products (with VNNI) quantise activations per token to int8.
#include "kernels/cpu/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/matvec_avx512.h"

namespace tandem::kernels {
namespace {

float bf16_value(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct Case {
  WeightType type;
  int64_t rows, cols, n;
  bool packed = false;  // weights pre-packed for oneDNN's small-batch GEMM
};

class MatmulTest : public ::testing::TestWithParam<Case> {};

TEST_P(MatmulTest, MatchesReference) {
  const Case c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(c.rows * 31 + c.cols * 7 + c.n));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(c.n * c.cols));
  for (auto& v : x) v = normal(rng);

  Matrix w;
  w.rows = c.rows;
  w.cols = c.cols;
  w.type = c.type;
  std::vector<double> wref(static_cast<size_t>(c.rows * c.cols));
  std::vector<float> wf;
  std::vector<uint16_t> wb;
  std::vector<int8_t> wi;
  switch (c.type) {
    case WeightType::kF32:
      wf.resize(wref.size());
      for (size_t i = 0; i < wf.size(); ++i) wref[i] = wf[i] = normal(rng) * 0.05f;
      w.data = wf.data();
      break;
    case WeightType::kBF16:
      wb.resize(wref.size());
      for (size_t i = 0; i < wb.size(); ++i) {
        wb[i] = f32_to_bf16(normal(rng) * 0.05f);
        wref[i] = bf16_value(wb[i]);
      }
      w.data = wb.data();
      break;
    case WeightType::kI8:
      wi.resize(wref.size());
      w.row_scales.resize(static_cast<size_t>(c.rows));
      for (auto& s : w.row_scales) s = 0.001f + 0.0005f * (rng() % 10);
      for (size_t i = 0; i < wi.size(); ++i) {
        wi[i] = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
        wref[i] = wi[i] * static_cast<double>(w.row_scales[i / c.cols]);
      }
      w.data = wi.data();
      set_int8_row_sums(w);
      break;
  }

  if (c.packed) {
    ASSERT_TRUE(pack_for_gemm(w)) << "oneDNN has no packed layout for this matrix";
  }

  // The activations each kernel actually multiplies.
  std::vector<double> xref(x.begin(), x.end());
  const bool vnni = c.type == WeightType::kI8 && avx512::has_vnni();
  const bool bf16_acts = c.type == WeightType::kBF16 && (c.n >= 4 || avx512::has_bf16_dot());
  for (int64_t t = 0; t < c.n; ++t) {
    double amax = 0;
    for (int64_t k = 0; k < c.cols; ++k) amax = std::max(amax, std::abs(xref[t * c.cols + k]));
    const float scale = amax > 0 ? static_cast<float>(amax) / 127.0f : 1.0f;
    for (int64_t k = 0; k < c.cols; ++k) {
      double& v = xref[t * c.cols + k];
      if (vnni)
        v = std::clamp<double>(std::nearbyint(x[t * c.cols + k] * (1.0f / scale)), -127, 127) *
            scale;
      else if (bf16_acts)
        v = bf16_value(f32_to_bf16(x[t * c.cols + k]));
    }
  }

  std::vector<float> y(static_cast<size_t>(c.n * c.rows));
  matmul(w, x.data(), c.n, y.data());
  for (int64_t t = 0; t < c.n; ++t)
    for (int64_t r = 0; r < c.rows; ++r) {
      double ref = 0, mag = 0;
      for (int64_t k = 0; k < c.cols; ++k) {
        ref += wref[r * c.cols + k] * xref[t * c.cols + k];
        mag += std::abs(wref[r * c.cols + k] * xref[t * c.cols + k]);
      }
      // float32 accumulation: error grows with the magnitude of the terms, not of the sum.
      ASSERT_NEAR(y[t * c.rows + r], ref, 1e-5 * mag + 1e-6)
          << "token " << t << " row " << r << " type " << int(c.type) << " n " << c.n;
    }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (auto type : {WeightType::kF32, WeightType::kBF16, WeightType::kI8})
    for (int64_t n : {1, 2, 3, 4, 5, 9, 16, 17, 40})
      for (auto [rows, cols] : {std::pair<int64_t, int64_t>{33, 200}, {64, 257}, {7, 64}})
        out.push_back({type, rows, cols, n});
  // Packed weights, with token counts below, at and above one 64-token chunk.
  for (auto type : {WeightType::kBF16, WeightType::kI8})
    for (int64_t n : {16, 48, 64, 100, 150}) out.push_back({type, 96, 320, n, true});
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllKernels, MatmulTest, ::testing::ValuesIn(cases()));

// The MoE layer runs one expert per thread: products called from inside a parallel region (each
// thread its own matrix and shape) must give exactly what they give when called alone.
TEST(Matmul, ConcurrentCallsMatchSequentialOnes) {
  std::mt19937 rng(3);
  const int count = 8;
  std::vector<std::vector<uint16_t>> wb(count);
  std::vector<std::vector<int8_t>> wi(count);
  std::vector<Matrix> mats;
  std::vector<std::vector<float>> xs(count);
  std::vector<int64_t> ns(count);
  for (int i = 0; i < count; ++i) {
    const int64_t rows = 96 + 16 * i, cols = 128, n = 5 + 7 * i;
    ns[i] = n;
    xs[i].resize(static_cast<size_t>(n * cols));
    for (auto& v : xs[i]) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f;
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    if (i % 2 == 0) {
      wb[i].resize(static_cast<size_t>(rows * cols));
      for (auto& v : wb[i])
        v = f32_to_bf16(static_cast<float>(static_cast<int>(rng() % 201) - 100) / 1000.0f);
      m.type = WeightType::kBF16;
      m.data = wb[i].data();
    } else {
      wi[i].resize(static_cast<size_t>(rows * cols));
      for (auto& v : wi[i]) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
      m.type = WeightType::kI8;
      m.data = wi[i].data();
      m.row_scales.assign(static_cast<size_t>(rows), 0.01f);
      set_int8_row_sums(m);
    }
    mats.push_back(std::move(m));
  }
  std::vector<std::vector<float>> alone(count), together(count);
  for (int i = 0; i < count; ++i) {
    alone[i].resize(static_cast<size_t>(ns[i] * mats[i].rows));
    together[i].resize(alone[i].size());
    matmul(mats[i], xs[i].data(), ns[i], alone[i].data());
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int i = 0; i < count; ++i) matmul(mats[i], xs[i].data(), ns[i], together[i].data());
  for (int i = 0; i < count; ++i) EXPECT_EQ(alone[i], together[i]) << "matrix " << i;
}

}  // namespace
}  // namespace tandem::kernels
