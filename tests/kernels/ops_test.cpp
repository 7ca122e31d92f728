// The CPU matrix products against a double-precision reference, for every weight type and the
// token counts that select different kernels (row dots for 1-4 tokens, chunks of four, oneDNN
// GEMMs from 4 or 16 tokens, float32 GEMMs over widened panels where the CPU has no BF16 or INT8
// GEMM), with odd widths that exercise the masked tails. Each kernel's
// documented rounding is part of the reference: BF16 products round activations to BF16, INT8
// products quantise activations per token to int8 (with VNNI or without: the same W8A8 product).
#include "kernels/cpu/ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/gemm_onednn.h"
#include "kernels/cpu/matvec_avx512.h"
#include "kernels/cpu/packed_matvec_avx512.h"

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

  if (c.packed && !pack_for_gemm(w)) {
    // oneDNN 2.x packs BF16 only with AVX-512 kernels, and INT8 is packed only for the VNNI
    // GEMM; on other CPUs the plain cases cover matmul.
    if (c.type == WeightType::kI8)
      ASSERT_FALSE(avx512::has_vnni()) << "oneDNN has no packed INT8 layout for this matrix";
    else
      ASSERT_FALSE(avx512::available()) << "oneDNN has no packed layout for this matrix";
    GTEST_SKIP() << "no packed layout on this CPU (no AVX-512 BF16 GEMM or VNNI)";
  }

  // The activations each kernel actually multiplies.
  std::vector<double> xref(x.begin(), x.end());
  const bool w8a8 = c.type == WeightType::kI8;
  // BF16 weights round the activations to BF16 where a BF16 kernel runs: oneDNN's GEMM from four
  // tokens (where it has one), the vdpbf16ps rows up to four.
  const bool bf16_acts = c.type == WeightType::kBF16 && ((c.n >= 4 && onednn_has_bf16_matmul()) ||
                                                         (c.n <= 4 && avx512::has_bf16_dot()));
  for (int64_t t = 0; t < c.n; ++t) {
    double amax = 0;
    for (int64_t k = 0; k < c.cols; ++k) amax = std::max(amax, std::abs(xref[t * c.cols + k]));
    const float scale = amax > 0 ? static_cast<float>(amax) / 127.0f : 1.0f;
    for (int64_t k = 0; k < c.cols; ++k) {
      double& v = xref[t * c.cols + k];
      if (w8a8)
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
  // Packed weights, with token counts below, at and above one 64-token chunk, and past the
  // 256-token chunks of long products (256 + 64 + 44, 2 x 256 + 3 x 64 + 17).
  for (auto type : {WeightType::kBF16, WeightType::kI8})
    for (int64_t n : {16, 48, 64, 100, 150, 364, 721}) out.push_back({type, 96, 320, n, true});
  // Packed weights at decode's token counts (the packed row kernels: four tokens per pass, and
  // for INT8 several passes over column chunks), rows and columns that need padding.
  for (auto type : {WeightType::kBF16, WeightType::kI8})
    for (int64_t n : {1, 2, 3, 5, 9, 15})
      for (auto [rows, cols] : {std::pair<int64_t, int64_t>{100, 257}, {64, 5000}})
        out.push_back({type, rows, cols, n, true});
  // Packed matrices of realistic size (4 MiB).
  out.push_back({WeightType::kBF16, 1024, 2048, 70, true});
  // Without native BF16/INT8 GEMMs, matrices are widened in panels of 4 MB (512 rows of 2048):
  // three panels, the last one partial.
  for (auto type : {WeightType::kBF16, WeightType::kI8}) out.push_back({type, 1100, 2048, 24});
  out.push_back({WeightType::kI8, 1024, 4096, 20, true});
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllKernels, MatmulTest, ::testing::ValuesIn(cases()));

// The packed copy holds every weight where PackedLayout::offset says, zero in the padding: the
// decode kernels and oneDNN's GEMMs read the same bytes.
TEST(PackedWeights, LayoutOffsetsAddressEveryWeight) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{100, 257}, {64, 64}, {7, 33}}) {
    std::mt19937 rng(static_cast<uint32_t>(rows + cols));
    std::vector<uint16_t> wb(static_cast<size_t>(rows * cols));
    for (auto& v : wb) v = static_cast<uint16_t>(rng() | 1);  // no zero weights
    std::vector<int8_t> wi(wb.size());
    for (auto& v : wi) v = static_cast<int8_t>(1 + rng() % 100);
    Matrix b = matrix_view(rows, cols, WeightType::kBF16, wb.data());
    Matrix i = matrix_view(rows, cols, WeightType::kI8, wi.data());
    i.row_scales.assign(static_cast<size_t>(rows), 1.0f);
    set_int8_row_sums(i);
    if (!pack_for_gemm(b) || !pack_for_gemm(i)) GTEST_SKIP() << "no packed layout on this CPU";
    for (const Matrix* m : {&b, &i}) {
      const PackedLayout& l = m->packed->layout;
      ASSERT_EQ(l.rows, rows);
      ASSERT_EQ(l.cols, cols);
      ASSERT_EQ(l.rows_padded % PackedLayout::kBlockRows, 0);
      ASSERT_GE(l.cols_padded, cols);
      const size_t elem = m->type == WeightType::kBF16 ? 2 : 1;
      ASSERT_EQ(m->packed->bytes, static_cast<size_t>(l.rows_padded * l.cols_padded) * elem);
      std::vector<bool> seen(static_cast<size_t>(l.rows_padded * l.cols_padded), false);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t at = l.offset(r, c);
          seen[at] = true;
          if (m->type == WeightType::kBF16)
            ASSERT_EQ(reinterpret_cast<const uint16_t*>(m->packed->data.get())[at],
                      wb[r * cols + c]);
          else
            ASSERT_EQ(reinterpret_cast<const int8_t*>(m->packed->data.get())[at], wi[r * cols + c]);
        }
      for (size_t at = 0; at < seen.size(); ++at) {
        if (seen[at]) continue;
        for (size_t k = 0; k < elem; ++k) ASSERT_EQ(m->packed->data.get()[at * elem + k], 0);
      }
    }
  }
}

// More than six tokens pass over a row block in column chunks (kept in L2 between the passes of
// up to six, split evenly): the BF16 kernel against exact sums of its BF16 inputs.
class PackedRowsTokens : public ::testing::TestWithParam<int64_t> {};

TEST_P(PackedRowsTokens, ManyTokensOverLongRowsMatchReference) {
  if (!avx512::has_bf16_dot()) GTEST_SKIP() << "no AVX-512 BF16";
  const int64_t rows = 70, cols = 4500, n = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(n));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> wb(static_cast<size_t>(rows * cols));
  for (auto& v : wb) v = f32_to_bf16(normal(rng) * 0.05f);
  Matrix w = matrix_view(rows, cols, WeightType::kBF16, wb.data());
  if (!pack_for_gemm(w)) GTEST_SKIP() << "no packed layout on this CPU";
  const int64_t stride = w.packed->layout.cols_padded;
  std::vector<uint16_t> xb(static_cast<size_t>(n * stride), 0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < cols; ++c) xb[t * stride + c] = f32_to_bf16(normal(rng));
  const int64_t ldy = rows + 3;
  std::vector<float> y(static_cast<size_t>(n * ldy), -1.0f);
  avx512::packed_rows_bf16(*w.packed, 0, w.packed->layout.blocks(), xb.data(), stride, n, y.data(),
                           ldy);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      double ref = 0, mag = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double p = double(bf16_value(wb[r * cols + c])) * bf16_value(xb[t * stride + c]);
        ref += p;
        mag += std::abs(p);
      }
      ASSERT_NEAR(y[t * ldy + r], ref, 1e-5 * mag + 1e-6) << "token " << t << " row " << r;
    }
    for (int64_t r = rows; r < ldy; ++r) ASSERT_EQ(y[t * ldy + r], -1.0f) << "wrote past the rows";
  }
}

// One pass of 6; 7 = 4 + 3; 8 = 4 + 4; 13 = 5 + 4 + 4; 47 = 7 x 6 + 5.
INSTANTIATE_TEST_SUITE_P(PassSplits, PackedRowsTokens, ::testing::Values(6, 7, 8, 13, 47));

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

// The vectorised BF16 rounding is bit-identical to f32_to_bf16: ties to even, NaN kept (quiet),
// infinities, denormals (which vcvtneps2bf16 would flush), and every tail length.
TEST(ToBf16, MatchesScalarRounding) {
  std::vector<float> x;
  for (uint32_t bits : {0x00000000u, 0x80000000u, 0x3F808000u, 0x3F818000u, 0x3F80FFFFu,
                        0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u, 0xFFBFFFFFu,
                        0x00000001u, 0x807FFFFFu, 0x7F7FFFFFu, 0x00400000u}) {
    float f;
    std::memcpy(&f, &bits, 4);
    x.push_back(f);
  }
  std::mt19937 rng(5);
  for (int i = 0; i < 1000; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng());
    float f;
    std::memcpy(&f, &bits, 4);
    x.push_back(f);
  }
  for (size_t n : {x.size(), size_t{1}, size_t{15}, size_t{17}, size_t{33}}) {
    std::vector<uint16_t> out(n + 1, 0xABCD);
    to_bf16(x.data(), static_cast<int64_t>(n), out.data());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], f32_to_bf16(x[i])) << "element " << i;
    EXPECT_EQ(out[n], 0xABCD) << "wrote past the end";
  }
}

TEST(SiluMulBf16, IsTheRoundedFloatProduct) {
  std::mt19937 rng(6);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t n = 1000;
  std::vector<float> g(n), u(n), ref(n);
  for (auto& v : g) v = normal(rng);
  for (auto& v : u) v = normal(rng);
  silu_mul(g.data(), u.data(), n, ref.data());
  std::vector<uint16_t> out(n);
  silu_mul_bf16(g.data(), u.data(), n, out.data());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], f32_to_bf16(ref[i])) << "element " << i;
}

// A causal row of attention probabilities: softmax of the scaled scores, rounded to BF16, zeros
// past the visible keys.
TEST(SoftmaxToBf16, MatchesScaledSoftmaxAndZeroesTheTail) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (int64_t n : {1, 15, 16, 17, 100, 513}) {
    const int64_t width = n + 37;
    const float scale = 0.125f;
    std::vector<float> x(n);
    for (auto& v : x) v = normal(rng);
    double mx = -INFINITY, sum = 0;
    for (float v : x) mx = std::max(mx, double(v) * scale);
    for (float v : x) sum += std::exp(double(v) * scale - mx);
    std::vector<uint16_t> out(width + 1, 0xABCD);
    std::vector<float> work = x;
    softmax_to_bf16(work.data(), n, scale, width, out.data());
    for (int64_t i = 0; i < n; ++i) {
      const double ref = std::exp(double(x[i]) * scale - mx) / sum;
      ASSERT_NEAR(bf16_to_f32(out[i]), ref, ref * (1.0 / 128) + 1e-30) << "n " << n << " i " << i;
    }
    for (int64_t i = n; i < width; ++i) ASSERT_EQ(out[i], 0) << "n " << n << " i " << i;
    EXPECT_EQ(out[width], 0xABCD) << "wrote past the width";
  }
}

TEST(Axpy, MatchesScalarLoop) {
  std::mt19937 rng(10);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t n : {1, 16, 31, 2048}) {
    std::vector<float> x(n), y(n + 1, 5.0f), ref;
    for (auto& v : x) v = normal(rng);
    for (int64_t i = 0; i < n; ++i) y[i] = normal(rng);
    ref = y;
    for (int64_t i = 0; i < n; ++i) ref[i] += 0.37 * double(x[i]);
    axpy(0.37f, x.data(), y.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(y[i], ref[i], 1e-6 * (1 + std::abs(ref[i])));
    EXPECT_EQ(y[n], 5.0f) << "wrote past the end";
  }
}

// matmul_bf16 (activations rounded by the caller) gives exactly what matmul gives, for plain
// and packed BF16 weights and for weights it widens the activations for (INT8).
TEST(MatmulBf16, MatchesMatmul) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t rows = 80, cols = 192;
  std::vector<uint16_t> wb(rows * cols);
  std::vector<int8_t> wi(rows * cols);
  for (auto& v : wb) v = f32_to_bf16(normal(rng) * 0.05f);
  for (auto& v : wi) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
  Matrix plain = matrix_view(rows, cols, WeightType::kBF16, wb.data());
  Matrix packed = plain;
  // oneDNN 2.x packs only with AVX-512 kernels: elsewhere the packed case is the plain one.
  const bool has_packed = pack_for_gemm(packed);
  EXPECT_TRUE(has_packed || !avx512::available());
  Matrix int8 = matrix_view(rows, cols, WeightType::kI8, wi.data());
  int8.row_scales.assign(rows, 0.01f);
  set_int8_row_sums(int8);
  for (const Matrix* w : {&plain, &packed, &int8})
    for (int64_t n : {1, 3, 4, 17, 300}) {
      std::vector<float> x(n * cols), y(n * rows), yb(n * rows);
      std::vector<uint16_t> xb(n * cols);
      for (auto& v : x) v = normal(rng);
      to_bf16(x.data(), n * cols, xb.data());
      // matmul rounds x to BF16 itself only where gemm_takes_bf16 says so; give it the rounded
      // values so both calls multiply the same numbers.
      for (int64_t i = 0; i < n * cols; ++i) x[i] = bf16_to_f32(xb[i]);
      matmul(*w, x.data(), n, y.data());
      matmul_bf16(*w, xb.data(), n, yb.data());
      ASSERT_EQ(y, yb) << "n " << n << " type " << int(w->type) << " packed " << bool(w->packed);
    }
}

// The attention products: strided operands, B plain or transposed, BF16 and float32.
TEST(Gemm, StridedProductsMatchReference) {
  std::mt19937 rng(8);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (bool transposed : {false, true})
    for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1},
                           {5, 7, 33},
                           {128, 200, 192},
                           {37, 128, 300}}) {
      const int64_t lda = k + 3, ldb = (transposed ? k : n) + 5, ldc = n + 2;
      std::vector<float> a(m * lda), b((transposed ? n : k) * ldb);
      for (auto& v : a) v = bf16_to_f32(f32_to_bf16(normal(rng)));
      for (auto& v : b) v = bf16_to_f32(f32_to_bf16(normal(rng)));
      std::vector<uint16_t> ab(a.size()), bb(b.size());
      to_bf16(a.data(), static_cast<int64_t>(a.size()), ab.data());
      to_bf16(b.data(), static_cast<int64_t>(b.size()), bb.data());
      std::vector<float> c16(m * ldc, -7.0f), c32(m * ldc, -7.0f);
      gemm_bf16(m, n, k, ab.data(), lda, bb.data(), ldb, transposed, c16.data(), ldc);
      gemm_f32(m, n, k, a.data(), lda, b.data(), ldb, transposed, c32.data(), ldc);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < ldc; ++j) {
          if (j >= n) {  // the row padding stays untouched
            ASSERT_EQ(c16[i * ldc + j], -7.0f);
            ASSERT_EQ(c32[i * ldc + j], -7.0f);
            continue;
          }
          double ref = 0, mag = 0;
          for (int64_t p = 0; p < k; ++p) {
            const double t =
                double(a[i * lda + p]) * (transposed ? b[j * ldb + p] : b[p * ldb + j]);
            ref += t;
            mag += std::abs(t);
          }
          ASSERT_NEAR(c16[i * ldc + j], ref, 1e-5 * mag + 1e-6) << i << "," << j;
          ASSERT_NEAR(c32[i * ldc + j], ref, 1e-5 * mag + 1e-6) << i << "," << j;
        }
    }
}

// The two row-range products of absorbed attention (W_UK^T q over a head's rows, W_UV o over
// another's), for every weight type, with a row count that is not a multiple of four and widths
// that are not multiples of eight: float32 sums against a double reference.
// Shapes: ragged ranges (the row kernels), and whole 64-row blocks of 520 columns (one 256-column
// register chunk of the transposed product and a tail; the packed blocks for BF16 rows).
struct RowRange {
  int64_t rows, cols, first, count;
};

class Matvec : public ::testing::TestWithParam<RowRange> {};

TEST_P(Matvec, RowRangeProductsMatchReference) {
  const auto [rows, cols, first, count] = GetParam();
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> wf(rows * cols), xr(count), xc(cols);
  std::vector<uint16_t> wb(rows * cols);
  std::vector<int8_t> wi(rows * cols);
  std::vector<double> wref(rows * cols);
  for (auto& v : xr) v = normal(rng);
  for (auto& v : xc) v = normal(rng);
  for (auto type : {WeightType::kF32, WeightType::kBF16, WeightType::kI8}) {
    Matrix w;
    w.rows = rows;
    w.cols = cols;
    w.type = type;
    if (type == WeightType::kI8) w.row_scales.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
      if (type == WeightType::kI8) w.row_scales[r] = 0.01f + 0.001f * static_cast<float>(r);
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = r * cols + c;
        const float v = normal(rng);
        if (type == WeightType::kF32) {
          wref[i] = wf[i] = v;
        } else if (type == WeightType::kBF16) {
          wb[i] = f32_to_bf16(v);
          wref[i] = bf16_value(wb[i]);
        } else {
          wi[i] = static_cast<int8_t>(std::clamp(std::lround(v * 40), -127L, 127L));
          wref[i] = wi[i] * static_cast<double>(w.row_scales[r]);
        }
      }
    }
    w.data = type == WeightType::kF32    ? static_cast<const void*>(wf.data())
             : type == WeightType::kBF16 ? static_cast<const void*>(wb.data())
                                         : static_cast<const void*>(wi.data());
    // Packed BF16 rows over whole blocks take x rounded to BF16.
    const bool rounded =
        type == WeightType::kBF16 && pack_for_gemm(w) && first % 64 == 0 && count % 64 == 0;
    std::vector<double> xcr(xc.begin(), xc.end());
    if (rounded)
      for (auto& v : xcr) v = bf16_value(f32_to_bf16(static_cast<float>(v)));
    std::vector<float> yt(cols, std::nanf("")), yr(count, std::nanf(""));
    matvec_transposed(w, first, count, xr.data(), yt.data());
    matvec_rows(w, first, count, xc.data(), yr.data());
    for (int64_t c = 0; c < cols; ++c) {
      double ref = 0, mag = 0;
      for (int64_t r = 0; r < count; ++r) {
        ref += xr[r] * wref[(first + r) * cols + c];
        mag += std::abs(xr[r] * wref[(first + r) * cols + c]);
      }
      ASSERT_NEAR(yt[c], ref, 1e-5 * mag + 1e-6)
          << "transposed, type " << int(type) << " col " << c;
    }
    for (int64_t r = 0; r < count; ++r) {
      double ref = 0, mag = 0;
      for (int64_t c = 0; c < cols; ++c) {
        ref += xcr[c] * wref[(first + r) * cols + c];
        mag += std::abs(xcr[c] * wref[(first + r) * cols + c]);
      }
      ASSERT_NEAR(yr[r], ref, 1e-5 * mag + 1e-6) << "rows, type " << int(type) << " row " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranges, Matvec,
                         ::testing::Values(RowRange{40, 203, 9, 23}, RowRange{256, 520, 64, 128}));

// Batch-invariant numerics: each token's row of a product has the same bits whatever the
// number of tokens in it (the kernels switch at 4, 16 and 32 tokens otherwise).
TEST(BatchInvariant, ATokensProductRowDoesNotDependOnTheTokenCount) {
  set_batch_invariant(true);
  struct Reset {
    ~Reset() { set_batch_invariant(false); }
  } reset;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t rows = 37, cols = 300, n = 40;
  std::vector<float> x(n * cols), wf(rows * cols);
  for (auto& v : x) v = normal(rng);
  for (auto& v : wf) v = normal(rng) * 0.05f;
  std::vector<uint16_t> wb(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) wb[i] = f32_to_bf16(wf[i]);
  std::vector<int8_t> wi(wf.size());
  for (size_t i = 0; i < wf.size(); ++i)
    wi[i] = static_cast<int8_t>(std::clamp(std::lround(wf[i] * 600.0f), -127L, 127L));
  for (const WeightType type : {WeightType::kF32, WeightType::kBF16, WeightType::kI8}) {
    Matrix w = matrix_view(rows, cols, type,
                           type == WeightType::kF32    ? static_cast<const void*>(wf.data())
                           : type == WeightType::kBF16 ? static_cast<const void*>(wb.data())
                                                       : static_cast<const void*>(wi.data()));
    if (type == WeightType::kI8) {
      w.row_scales.assign(rows, 1.0f / 600.0f);
      set_int8_row_sums(w);
    }
    EXPECT_FALSE(gemm_takes_bf16(w, n));
    std::vector<float> all(n * rows);
    matmul(w, x.data(), n, all.data());
    for (const int64_t m : {1, 2, 3, 5, 16, 33}) {
      std::vector<float> part(m * rows);
      for (int64_t t0 = 0; t0 + m <= n; t0 += 7) {
        matmul(w, x.data() + t0 * cols, m, part.data());
        for (int64_t i = 0; i < m * rows; ++i)
          ASSERT_EQ(part[i], all[t0 * rows + i]) << "type " << int(type) << " m " << m;
      }
    }
  }
}

// argmax is std::max_element's choice (the lowest index on ties) on every length, with -inf
// entries (masked tokens), ties at the ends of the vector loop and in its tail, and around the
// blocks it takes maxima over (1024 floats).
TEST(Argmax, ChoosesWhatMaxElementChooses) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int64_t n : {1, 7, 8, 31, 32, 33, 100, 1023, 1024, 1025, 3000, 129280}) {
    for (int trial = 0; trial < 6; ++trial) {
      std::vector<float> x(n);
      for (auto& v : x) v = normal(rng);
      if (trial == 1) x[size_t(n / 2)] = -std::numeric_limits<float>::infinity();
      if (trial == 2) x.back() = x.front() = 9.0f;  // a tie: the first wins
      if (trial == 3) std::fill(x.begin(), x.end(), 1.5f);
      if (trial == 4) x.back() = 9.0f;  // the last block, maybe partial
      if (trial == 5) x[size_t(n - 1) / 2] = x[size_t(n - 1)] = 9.0f;  // a tie across blocks
      EXPECT_EQ(argmax(x.data(), n), std::max_element(x.begin(), x.end()) - x.begin())
          << "n " << n << " trial " << trial;
    }
  }
  std::vector<float> masked(40, -std::numeric_limits<float>::infinity());
  masked[37] = -3.0f;
  EXPECT_EQ(argmax(masked.data(), 40), 37);
  std::vector<float> with_nan(20, 0.0f);
  with_nan[3] = std::nanf("");
  with_nan[11] = 2.0f;
  EXPECT_EQ(argmax(with_nan.data(), 20), 11);
}

}  // namespace
}  // namespace tandem::kernels
