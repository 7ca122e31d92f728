#include "model/moe_experts.h"

#include <algorithm>
#include <numeric>

#include "model/expert_exchange.h"

namespace tandem::model {

void swiglu(const MlpWeights& w, const float* xn, const uint16_t* xb, int64_t n, float* out) {
  const int64_t inter = w.gate.rows;
  // Reused per thread: fresh zero-filled buffers cost page faults on every layer.
  thread_local std::vector<float> g, u;
  g.resize(n * inter);
  u.resize(n * inter);
  if (kernels::gemm_takes_bf16(w.gate, n)) {
    // BF16 GEMMs: the activations are rounded once for gate and up (the caller may have done it),
    // and silu(gate) * up is rounded as it is computed, not in a pass of its own.
    thread_local std::vector<uint16_t> x_own, hidden;
    if (!xb) {
      x_own.resize(n * w.gate.cols);
      kernels::to_bf16(xn, n * w.gate.cols, x_own.data());
      xb = x_own.data();
    }
    kernels::matmul_bf16(w.gate, xb, n, g.data());
    kernels::matmul_bf16(w.up, xb, n, u.data());
    hidden.resize(n * inter);
    kernels::silu_mul_bf16(g.data(), u.data(), n * inter, hidden.data());
    kernels::matmul_bf16(w.down, hidden.data(), n, out);
    return;
  }
  kernels::matmul(w.gate, xn, n, g.data());
  kernels::matmul(w.up, xn, n, u.data());
  kernels::silu_mul(g.data(), u.data(), n * inter, g.data());
  kernels::matmul(w.down, g.data(), n, out);
}

void routed_experts(const std::vector<MlpWeights>& experts,
                    const std::vector<std::vector<std::pair<int64_t, float>>>& by_expert,
                    const float* xn, int64_t n, int64_t h, const float* extra, float* out) {
  std::fill(out, out + n * h, 0.0f);
  if (experts.empty()) return;
  // BF16 experts on a CPU with BF16 GEMMs: every token's activations rounded once, gathered per
  // expert as BF16 (elsewhere the products keep float32 activations and need no rounded copy).
  const bool bf16 =
      experts[0].gate.type == kernels::WeightType::kBF16 && kernels::bf16_gemm_available();
  thread_local std::vector<uint16_t> xb;
  if (bf16) {
    xb.resize(n * h);
    kernels::to_bf16(xn, n * h, xb.data());
  }
  const uint16_t* xbp = xb.data();
  // One expert per thread: each expert's tokens are few (about n * top_k / experts), and a
  // single-threaded product on a small shape keeps a core busier than one split across cores.
  // Results of expert i at rows first_row[i] of one buffer (reused: no page faults per layer).
  std::vector<size_t> active;
  std::vector<int64_t> first_row;
  int64_t rows = 0;
  for (size_t slot = 0; slot < by_expert.size(); ++slot) {
    if (by_expert[slot].empty()) continue;
    active.push_back(slot);
    first_row.push_back(rows);
    rows += static_cast<int64_t>(by_expert[slot].size());
  }
  thread_local std::vector<float> results_buf;
  results_buf.resize(rows * h);
  float* results = results_buf.data();
  // Busiest experts first, so the last ones to finish are short and threads end together.
  std::vector<size_t> order(active.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return by_expert[active[a]].size() > by_expert[active[b]].size();
  });
#pragma omp parallel for schedule(dynamic, 1) if (active.size() > 1)
  for (size_t j = 0; j < order.size(); ++j) {
    const size_t i = order[j];
    const auto& list = by_expert[active[i]];
    const int64_t m = static_cast<int64_t>(list.size());
    const MlpWeights& e = experts[active[i]];
    float* result = results + first_row[i] * h;
    if (bf16 && kernels::gemm_takes_bf16(e.gate, m)) {
      thread_local std::vector<uint16_t> in;
      in.resize(m * h);
      for (int64_t k = 0; k < m; ++k) std::copy_n(xbp + list[k].first * h, h, in.data() + k * h);
      swiglu(e, nullptr, in.data(), m, result);
    } else {
      thread_local std::vector<float> in;
      in.resize(m * h);
      for (int64_t k = 0; k < m; ++k) std::copy_n(xn + list[k].first * h, h, in.data() + k * h);
      swiglu(e, in.data(), nullptr, m, result);
    }
  }
  // Summed in expert order, then the shared experts, so the result does not depend on which
  // thread ran which expert; threads take column ranges.
  constexpr int64_t kColumns = kRoutedSumColumns;
#pragma omp parallel for schedule(static) if (n > 16)
  for (int64_t c0 = 0; c0 < h; c0 += kColumns) {
    const int64_t width = std::min(kColumns, h - c0);
    for (size_t i = 0; i < active.size(); ++i) {
      const auto& list = by_expert[active[i]];
      for (size_t k = 0; k < list.size(); ++k)
        kernels::axpy(list[k].second, results + (first_row[i] + k) * h + c0,
                      out + list[k].first * h + c0, width);
    }
    if (extra)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t c = c0; c < c0 + width; ++c) out[t * h + c] += extra[t * h + c];
  }
}

}  // namespace tandem::model
