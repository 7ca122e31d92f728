#include "gateway/policies/batch_time.h"

#include <algorithm>
#include <bit>
#include <cmath>

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

}  // namespace

BatchTimeEstimator observe(BatchTimeEstimator e, int64_t seqs, int64_t tokens, double seconds) {
  if (tokens < 1 || seqs < 1 || !std::isfinite(seconds) || seconds < 0) return e;
  const int k = token_bucket(tokens);
  const double t = static_cast<double>(tokens);
  add(e.rows[static_cast<size_t>(seq_row(seqs))][static_cast<size_t>(k)], e.options.window, t,
      seconds);
  add(e.rows[BatchTimeEstimator::kSeqRows][static_cast<size_t>(k)], e.options.window, t, seconds);
  ++e.observations;
  return e;
}

double estimate_batch_s(const BatchTimeEstimator& e, int64_t seqs, int64_t tokens) {
  if (tokens <= 0) return 0;
  const double t = static_cast<double>(tokens);
  double out = 0;
  if (interpolate(e.rows[static_cast<size_t>(seq_row(seqs))], t, out)) return out;
  if (interpolate(e.rows[BatchTimeEstimator::kSeqRows], t, out)) return out;
  return e.options.prior_overhead_s + e.options.prior_s_per_token * t;
}

double estimate_work_s(const BatchTimeEstimator& e, int64_t tokens, int64_t batch_tokens) {
  if (tokens <= 0) return 0;
  if (batch_tokens <= 0 || tokens <= batch_tokens) return estimate_batch_s(e, 0, tokens);
  const int64_t full = tokens / batch_tokens;
  return static_cast<double>(full) * estimate_batch_s(e, 0, batch_tokens) +
         estimate_batch_s(e, 0, tokens % batch_tokens);
}

double time_until_free_s(const BatchTimeEstimator& e, int64_t seqs, int64_t tokens,
                         double running_for_s) {
  return std::max(0.0, estimate_batch_s(e, seqs, tokens) - std::max(0.0, running_for_s));
}

}  // namespace tandem::gateway
