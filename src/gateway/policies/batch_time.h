#pragma once
// How long an engine takes to run one batch, learned online from observed batch durations: the
// "expected time until the engine can run this request" of the tandem policy. A plain value (a
// few kilobytes, copyable): the gateway keeps one per engine and replaces it with observe()'s
// result after each observed batch; the policy only reads it. No clock, no hidden state.
//
// Model: observations are kept in buckets by batch size in sequences (rows 1, 2-3, 4-7, 8-15,
// 16+) and batch size in tokens (columns by powers of two: [2^k, 2^(k+1))). Each bucket holds the
// running mean of the token counts and of the durations it saw: an exact mean of its first
// `window` observations, then an exponential average with weight 1/window (so it follows an
// engine that slows down or speeds up). An estimate for (seqs, tokens) interpolates linearly in
// tokens between the bucket means of the sequences' row (the all-sizes row when that row is
// empty), extrapolates with the nearest segment's slope (never negative) outside them, scales
// proportionally when only one bucket has data, and uses the prior `overhead + per_token *
// tokens` when none has.
//
// Long prompts: a prefill chunk late in a 100K-token prompt attends to every earlier token, so
// its time grows with the causal attention (query, key) pairs it computes, not with its tokens
// alone (2048 tokens at context 100K take ~10x what they take at context 0). Engines that report
// each step's pairs also feed a second model, a least-squares fit of
// `seconds = a + b * tokens + c * pairs` with non-negative coefficients, where every observation
// weighs (1 - 1/(4 * window)) times the one after it. Estimates that pass pairs use this fit once
// it has kMinPairObservations observations; the others (and those before) use the buckets.
#include <array>
#include <cstdint>

namespace tandem::gateway {

struct BatchTimeOptions {
  int window = 64;                  // observations per bucket before averaging becomes exponential
  double prior_overhead_s = 0.020;  // prior: fixed cost of a batch ...
  double prior_s_per_token = 5e-5;  // ... plus this per token (20k tokens/s)
  bool operator==(const BatchTimeOptions&) const = default;
};

struct BatchTimeEstimator {
  static constexpr int kSeqRows = 5;  // 1, 2-3, 4-7, 8-15, 16+ sequences
  static constexpr int64_t kMinPairObservations = 16;
  static constexpr int kTokenBuckets = 32;  // bucket k: tokens in [2^(k-1), 2^k), k = bit width
  struct Bucket {
    double mean_tokens = 0, mean_s = 0;
    int64_t count = 0;  // observations, capped at the window
  };
  BatchTimeOptions options;
  // rows[kSeqRows] pools every batch size.
  std::array<std::array<Bucket, kTokenBuckets>, kSeqRows + 1> rows{};
  int64_t observations = 0;
  // The pairs model: decayed sums of x x^T (upper triangle), x * seconds and seconds^2 over
  // x = (1, tokens / 1e3, pairs / 1e9) (scaled so the sums stay well conditioned), and the fitted
  // coefficients per step, per token and per pair.
  struct PairFit {
    std::array<double, 6> xx{};  // (0,0) (0,1) (0,2) (1,1) (1,2) (2,2)
    std::array<double, 3> xy{};
    double yy = 0;
    int64_t count = 0;
    double step_s = 0, token_s = 0, pair_s = 0;
  };
  PairFit pair_fit;
};

// The estimator after one batch of `seqs` sequences and `tokens` tokens that took `seconds` and
// computed `pairs` attention pairs of prefill (-1: not reported; the pairs model then does not
// see it). Observations with tokens < 1, seqs < 1 or a negative or non-finite duration are
// ignored.
BatchTimeEstimator observe(BatchTimeEstimator estimator, int64_t seqs, int64_t tokens,
                           double seconds, int64_t pairs = -1);

// True when estimates that pass pairs use the pairs model.
bool uses_pairs(const BatchTimeEstimator& estimator);

// Expected seconds for one batch of `seqs` sequences and `tokens` tokens (0 for tokens <= 0);
// seqs <= 0 means unknown and reads the all-sizes row. With pairs >= 0 and uses_pairs(): the
// pairs model.
double estimate_batch_s(const BatchTimeEstimator& estimator, int64_t seqs, int64_t tokens,
                        int64_t pairs = -1);

// Expected seconds to compute `tokens` prompt tokens when an engine runs at most `batch_tokens`
// tokens per batch (its chunked-prefill budget): full batches plus the remainder, each read from
// the all-sizes row. batch_tokens <= 0 means one batch. With pairs >= 0 (the attention pairs of
// those tokens) and uses_pairs(): batches * a + tokens * b + pairs * c of the pairs model.
double estimate_work_s(const BatchTimeEstimator& estimator, int64_t tokens, int64_t batch_tokens,
                       int64_t pairs = -1);

// Seconds until an engine finishes the batch it started `running_for_s` ago (never negative);
// `pairs` as for estimate_batch_s().
double time_until_free_s(const BatchTimeEstimator& estimator, int64_t seqs, int64_t tokens,
                         double running_for_s, int64_t pairs = -1);

}  // namespace tandem::gateway
