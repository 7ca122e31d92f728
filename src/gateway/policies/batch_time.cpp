#include "gateway/policies/batch_time.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

namespace tandem::gateway {
namespace {

int seq_row(int64_t seqs) {
  if (seqs <= 0) return BatchTimeEstimator::kSeqRows;  // unknown: the pooled row
  return std::min<int>(std::bit_width(static_cast<uint64_t>(seqs)) - 1,
                       BatchTimeEstimator::kSeqRows - 1);
}

int token_bucket(int64_t tokens) {
  return std::min<int>(std::bit_width(static_cast<uint64_t>(tokens)),
                       BatchTimeEstimator::kTokenBuckets - 1);
}

void add(BatchTimeEstimator::Bucket& b, int window, double tokens, double seconds) {
  b.count = std::min<int64_t>(b.count + 1, std::max(window, 1));
  const double w = 1.0 / static_cast<double>(b.count);
  b.mean_tokens += (tokens - b.mean_tokens) * w;
  b.mean_s += (seconds - b.mean_s) * w;
}

// Piecewise-linear interpolation over the populated buckets of one row; false when it has none.
bool interpolate(
    const std::array<BatchTimeEstimator::Bucket, BatchTimeEstimator::kTokenBuckets>& row,
    double tokens, double& out) {
  const BatchTimeEstimator::Bucket* lo = nullptr;  // the last populated bucket at or below
  const BatchTimeEstimator::Bucket* hi = nullptr;  // the first populated bucket above
  const BatchTimeEstimator::Bucket* first = nullptr;
  const BatchTimeEstimator::Bucket* second = nullptr;
  const BatchTimeEstimator::Bucket* before_last = nullptr;
  const BatchTimeEstimator::Bucket* last = nullptr;
  for (const auto& b : row) {
    if (b.count == 0) continue;
    if (!first)
      first = &b;
    else if (!second)
      second = &b;
    before_last = last;
    last = &b;
    if (b.mean_tokens <= tokens)
      lo = &b;
    else if (!hi)
      hi = &b;
  }
  if (!first) return false;
  auto line = [tokens](const BatchTimeEstimator::Bucket& a, const BatchTimeEstimator::Bucket& b) {
    const double dt = b.mean_tokens - a.mean_tokens;
    const double slope = dt > 0 ? std::max(0.0, (b.mean_s - a.mean_s) / dt) : 0.0;
    return std::max(0.0, a.mean_s + slope * (tokens - a.mean_tokens));
  };
  if (!second) {  // one point: proportional to tokens
    out = first->mean_tokens > 0 ? first->mean_s * tokens / first->mean_tokens : first->mean_s;
  } else if (lo && hi) {
    out = line(*lo, *hi);
  } else if (!lo) {  // below every point: the first segment, extended
    out = line(*first, *second);
  } else {  // above every point: the last segment, extended
    out = line(*before_last, *last);
  }
  return true;
}

// The pairs model's feature scales (see PairFit).
constexpr double kTokenScale = 1e-3, kPairScale = 1e-9;

double xx_at(const BatchTimeEstimator::PairFit& f, int i, int j) {
  static constexpr int kIndex[3][3] = {{0, 1, 2}, {1, 3, 4}, {2, 4, 5}};
  return f.xx[static_cast<size_t>(kIndex[i][j])];
}

// Least squares over the features in `mask` (bit i: feature i), the others fixed at 0. False
// when those features do not determine a solution (a feature never varied) or a coefficient
// comes out negative.
bool solve_subset(const BatchTimeEstimator::PairFit& f, int mask, std::array<double, 3>& theta) {
  int idx[3];
  int n = 0;
  for (int i = 0; i < 3; ++i)
    if (mask & (1 << i)) idx[n++] = i;
  double a[3][4];
  double scale = 0;
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < n; ++c) a[r][c] = xx_at(f, idx[r], idx[c]);
    a[r][n] = f.xy[static_cast<size_t>(idx[r])];
    scale = std::max(scale, std::abs(a[r][r]));
  }
  if (scale <= 0) return false;
  for (int c = 0; c < n; ++c) {  // Gaussian elimination, partial pivoting
    int p = c;
    for (int r = c + 1; r < n; ++r)
      if (std::abs(a[r][c]) > std::abs(a[p][c])) p = r;
    if (std::abs(a[p][c]) <= 1e-10 * scale) return false;
    for (int k = 0; k <= n; ++k) std::swap(a[c][k], a[p][k]);
    for (int r = c + 1; r < n; ++r) {
      const double m = a[r][c] / a[c][c];
      for (int k = c; k <= n; ++k) a[r][k] -= m * a[c][k];
    }
  }
  theta = {0, 0, 0};
  for (int r = n - 1; r >= 0; --r) {
    double v = a[r][n];
    for (int k = r + 1; k < n; ++k) v -= a[r][k] * theta[static_cast<size_t>(idx[k])];
    v /= a[r][r];
    if (!(v >= 0)) return false;
    theta[static_cast<size_t>(idx[r])] = v;
  }
  return true;
}

// Non-negative least squares on three features: the best of the feasible subset solutions.
void refit(BatchTimeEstimator::PairFit& f) {
  double best = std::numeric_limits<double>::infinity();
  for (int mask = 1; mask < 8; ++mask) {
    std::array<double, 3> t{};
    if (!solve_subset(f, mask, t)) continue;
    double sse = f.yy;
    for (int i = 0; i < 3; ++i) {
      sse -= 2 * t[static_cast<size_t>(i)] * f.xy[static_cast<size_t>(i)];
      for (int j = 0; j < 3; ++j)
        sse += t[static_cast<size_t>(i)] * xx_at(f, i, j) * t[static_cast<size_t>(j)];
    }
    if (sse < best) {
      best = sse;
      f.step_s = t[0];
      f.token_s = t[1] * kTokenScale;
      f.pair_s = t[2] * kPairScale;
    }
  }
}

void add_pairs(BatchTimeEstimator::PairFit& f, int window, double tokens, double pairs,
               double seconds) {
  const double keep = 1.0 - 1.0 / (4.0 * std::max(window, 1));
  for (auto& v : f.xx) v *= keep;
  for (auto& v : f.xy) v *= keep;
  f.yy *= keep;
  const double x[3] = {1.0, tokens * kTokenScale, pairs * kPairScale};
  int k = 0;
  for (int i = 0; i < 3; ++i)
    for (int j = i; j < 3; ++j) f.xx[static_cast<size_t>(k++)] += x[i] * x[j];
  for (int i = 0; i < 3; ++i) f.xy[static_cast<size_t>(i)] += x[i] * seconds;
  f.yy += seconds * seconds;
  ++f.count;
  refit(f);
}

double pairs_model_s(const BatchTimeEstimator::PairFit& f, double batches, int64_t tokens,
                     int64_t pairs) {
  return batches * f.step_s + static_cast<double>(tokens) * f.token_s +
         static_cast<double>(pairs) * f.pair_s;
}

}  // namespace

bool uses_pairs(const BatchTimeEstimator& e) {
  return e.pair_fit.count >= BatchTimeEstimator::kMinPairObservations;
}

BatchTimeEstimator observe(BatchTimeEstimator e, int64_t seqs, int64_t tokens, double seconds,
                           int64_t pairs) {
  if (tokens < 1 || seqs < 1 || !std::isfinite(seconds) || seconds < 0) return e;
  if (pairs >= 0)
    add_pairs(e.pair_fit, e.options.window, static_cast<double>(tokens), static_cast<double>(pairs),
              seconds);
  const int k = token_bucket(tokens);
  const double t = static_cast<double>(tokens);
  add(e.rows[static_cast<size_t>(seq_row(seqs))][static_cast<size_t>(k)], e.options.window, t,
      seconds);
  add(e.rows[BatchTimeEstimator::kSeqRows][static_cast<size_t>(k)], e.options.window, t, seconds);
  ++e.observations;
  return e;
}

double estimate_batch_s(const BatchTimeEstimator& e, int64_t seqs, int64_t tokens, int64_t pairs) {
  if (tokens <= 0) return 0;
  if (pairs >= 0 && uses_pairs(e)) return pairs_model_s(e.pair_fit, 1, tokens, pairs);
  const double t = static_cast<double>(tokens);
  if (e.observations == 0) return e.options.prior_overhead_s + e.options.prior_s_per_token * t;
  double out = 0;
  if (interpolate(e.rows[static_cast<size_t>(seq_row(seqs))], t, out)) return out;
  if (interpolate(e.rows[BatchTimeEstimator::kSeqRows], t, out)) return out;
  return e.options.prior_overhead_s + e.options.prior_s_per_token * t;
}

double estimate_work_s(const BatchTimeEstimator& e, int64_t tokens, int64_t batch_tokens,
                       int64_t pairs) {
  if (tokens <= 0) return 0;
  if (pairs >= 0 && uses_pairs(e)) {
    const int64_t batches = batch_tokens > 0 ? (tokens + batch_tokens - 1) / batch_tokens : 1;
    return pairs_model_s(e.pair_fit, static_cast<double>(batches), tokens, pairs);
  }
  if (batch_tokens <= 0 || tokens <= batch_tokens) return estimate_batch_s(e, 0, tokens);
  const int64_t full = tokens / batch_tokens;
  return static_cast<double>(full) * estimate_batch_s(e, 0, batch_tokens) +
         estimate_batch_s(e, 0, tokens % batch_tokens);
}

double time_until_free_s(const BatchTimeEstimator& e, int64_t seqs, int64_t tokens,
                         double running_for_s, int64_t pairs) {
  return std::max(0.0, estimate_batch_s(e, seqs, tokens, pairs) - std::max(0.0, running_for_s));
}

}  // namespace tandem::gateway
