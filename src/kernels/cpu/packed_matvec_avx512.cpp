#include "kernels/cpu/packed_matvec_avx512.h"

// GCC 12 reports its own _mm512_undefined_* helpers as maybe-uninitialized at -O3.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace tandem::kernels::avx512 {
namespace {

// One target for both element types: the BF16 functions are called only where the CPU has
// AVX-512 BF16 and the INT8 ones only where it has VNNI, and neither body contains the other's
// instructions (the compiler does not invent dot-product instructions for these loops).
#define TANDEM_PACKED \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni")))

constexpr int64_t kRows = PackedLayout::kBlockRows;
// Tokens per pass over a row block's columns: six take 24 accumulators, four weight vectors and a
// broadcast, 29 of the 32 vector registers. (Four per pass ran ~5% slower on 48-token experts:
// each pass reads the block's weights again, from L2, for fewer multiply-adds.)
constexpr int kMaxTokens = 6;

// What differs between the BF16 and INT8 products: the element types, how many columns are
// interleaved per row (the pairs of vdpbf16ps, the quads of vpdpbusd), and the multiply-add.
struct Bf16Product {
  using Weight = uint16_t;
  using Act = uint16_t;
  using Out = float;
  using Acc = __m512;
  static constexpr int kGroup = 2;
  // Columns per pass when several token groups share a row block: 256 KB of weights, kept in L2
  // between the groups.
  static constexpr int64_t kChunkCols = 2048;
  TANDEM_PACKED static Acc zero() { return _mm512_setzero_ps(); }
  TANDEM_PACKED static Acc load(const Out* p) { return _mm512_loadu_ps(p); }
  TANDEM_PACKED static void store(Out* p, Acc a) { _mm512_storeu_ps(p, a); }
  TANDEM_PACKED static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  TANDEM_PACKED static Acc madd(Acc acc, __m512i w, __m512i x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
  }
};

struct I8Product {
  using Weight = int8_t;
  using Act = uint8_t;
  using Out = int32_t;
  using Acc = __m512i;
  static constexpr int kGroup = 4;
  static constexpr int64_t kChunkCols = 4096;
  TANDEM_PACKED static Acc zero() { return _mm512_setzero_si512(); }
  TANDEM_PACKED static Acc load(const Out* p) { return _mm512_loadu_si512(p); }
  TANDEM_PACKED static void store(Out* p, Acc a) { _mm512_storeu_si512(p, a); }
  TANDEM_PACKED static Acc add(Acc a, Acc b) { return _mm512_add_epi32(a, b); }
  TANDEM_PACKED static Acc madd(Acc acc, __m512i w, __m512i x) {
    return _mm512_dpbusd_epi32(acc, x, w);
  }
};

// One group of columns of T tokens, broadcast to every lane.
template <typename P>
TANDEM_PACKED inline __m512i broadcast(const typename P::Act* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

// acc[t * 64 + r] (+)= sum over `groups` column groups of one row block of the weights `w` and
// the activations x[t], t < T. One token runs two sets of accumulators over alternate groups:
// four multiply-add chains alone would wait on the instruction's latency.
template <typename P, int T>
TANDEM_PACKED void block_pass(const typename P::Weight* w, int64_t groups,
                              const typename P::Act* const* x, typename P::Out* acc, bool first) {
  constexpr int kSets = T == 1 ? 2 : 1;
  constexpr int64_t kStep = kRows * P::kGroup;  // elements of one column group
  typename P::Acc a[kSets][T][4];
#pragma GCC unroll 16
  for (int s = 0; s < kSets; ++s)
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t)
#pragma GCC unroll 16
      for (int j = 0; j < 4; ++j)
        a[s][t][j] = first || s > 0 ? P::zero() : P::load(acc + t * kRows + j * 16);
  int64_t g = 0;
  for (; g + kSets <= groups; g += kSets) {
#pragma GCC unroll 16
    for (int s = 0; s < kSets; ++s) {
      const typename P::Weight* wg = w + (g + s) * kStep;
      __m512i wv[4];
#pragma GCC unroll 16
      for (int j = 0; j < 4; ++j) wv[j] = _mm512_load_si512(wg + j * (kStep / 4));
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        const __m512i xv = broadcast<P>(x[t] + (g + s) * P::kGroup);
#pragma GCC unroll 16
        for (int j = 0; j < 4; ++j) a[s][t][j] = P::madd(a[s][t][j], wv[j], xv);
      }
    }
  }
  for (; g < groups; ++g) {
    const typename P::Weight* wg = w + g * kStep;
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      const __m512i xv = broadcast<P>(x[t] + g * P::kGroup);
#pragma GCC unroll 16
      for (int j = 0; j < 4; ++j)
        a[0][t][j] = P::madd(a[0][t][j], _mm512_load_si512(wg + j * (kStep / 4)), xv);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 16
    for (int j = 0; j < 4; ++j) {
      typename P::Acc v = a[0][t][j];
#pragma GCC unroll 16
      for (int s = 1; s < kSets; ++s) v = P::add(v, a[s][t][j]);
      P::store(acc + t * kRows + j * 16, v);
    }
}

template <typename P>
TANDEM_PACKED void pass(int tokens, const typename P::Weight* w, int64_t groups,
                        const typename P::Act* const* x, typename P::Out* acc, bool first) {
  switch (tokens) {
    case 1:
      return block_pass<P, 1>(w, groups, x, acc, first);
    case 2:
      return block_pass<P, 2>(w, groups, x, acc, first);
    case 3:
      return block_pass<P, 3>(w, groups, x, acc, first);
    case 4:
      return block_pass<P, 4>(w, groups, x, acc, first);
    case 5:
      return block_pass<P, 5>(w, groups, x, acc, first);
    default:
      return block_pass<P, 6>(w, groups, x, acc, first);
  }
}

// Row blocks one after the other; within a block, up to six tokens per pass over its columns.
// More tokens take several passes of nearly equal size (8 tokens: 4 + 4, not 6 + 2) over chunks of
// columns small enough to stay in L2.
template <typename P>
TANDEM_PACKED void packed_rows(const PackedWeights& pw, int64_t first_block, int64_t blocks,
                               const typename P::Act* x, int64_t stride, int64_t n,
                               typename P::Out* y, int64_t ldy) {
  const PackedLayout& l = pw.layout;
  const auto* base = reinterpret_cast<const typename P::Weight*>(pw.data.get());
  const int64_t chunk = n <= kMaxTokens ? l.cols_padded : P::kChunkCols;
  const int64_t passes = (n + kMaxTokens - 1) / kMaxTokens;
  thread_local std::vector<typename P::Out> acc_buf;
  acc_buf.resize(static_cast<size_t>(n * kRows));
  typename P::Out* acc = acc_buf.data();
  for (int64_t b = first_block; b < first_block + blocks; ++b) {
    const typename P::Weight* block = base + b * l.block_elements();
    for (int64_t c0 = 0; c0 < l.cols_padded; c0 += chunk) {
      const int64_t cols = std::min(chunk, l.cols_padded - c0);
      for (int64_t i = 0, t0 = 0; i < passes; ++i) {
        const int tokens = static_cast<int>(n / passes + (i < n % passes ? 1 : 0));
        const typename P::Act* xs[kMaxTokens];
        for (int t = 0; t < tokens; ++t) xs[t] = x + (t0 + t) * stride + c0;
        pass<P>(tokens, block + c0 * kRows, cols / P::kGroup, xs, acc + t0 * kRows, c0 == 0);
        t0 += tokens;
      }
    }
    const int64_t rows = std::min(kRows, l.rows - b * kRows);
    for (int64_t t = 0; t < n; ++t)
      std::copy_n(acc + t * kRows, rows, y + t * ldy + (b - first_block) * kRows);
  }
}

}  // namespace

void packed_rows_bf16(const PackedWeights& w, int64_t first_block, int64_t blocks,
                      const uint16_t* xb, int64_t stride, int64_t n, float* y, int64_t ldy) {
  packed_rows<Bf16Product>(w, first_block, blocks, xb, stride, n, y, ldy);
}

void packed_rows_i8(const PackedWeights& w, int64_t first_block, int64_t blocks, const uint8_t* xq,
                    int64_t stride, int64_t n, int32_t* acc, int64_t ldacc) {
  packed_rows<I8Product>(w, first_block, blocks, xq, stride, n, acc, ldacc);
}

}  // namespace tandem::kernels::avx512
