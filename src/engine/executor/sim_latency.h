#pragma once
// How long one engine step would take on real hardware. The simulated executor sleeps for
// `SimLatencyModel::step_seconds(shape)` instead of running the forward pass, so that many
// simulated engines on a small machine behave like a cluster of GPU nodes. The model is pure and
// deterministic: the same shape always gives the same time.
//
// One engine is one attention-data-parallel rank, i.e. one GPU of a wide expert-parallel
// deployment (DeepSeek's and SGLang's setups), assuming the other ranks run similar batches.
//
// The model is linear in six non-negative parameters (seconds), one per kind of work:
//
//   t = 0                                                   for an empty step, otherwise
//   t = step_s                                   fixed cost of a step (launches, weight reads,
//                                                all-to-all latency)
//     + prefill_token_s * Σ new                  linear layers, MoE, dispatch per prefill token
//     + prefill_pair_s  * Σ (new*context + new*(new+1)/2)
//                                                causal attention: one unit per (query, key) pair
//     + decode_token_s  * decode_tokens          linear layers per decode token (drafts included)
//     + decode_seq_s    * decode_seqs            per-sequence work (sampling, metadata)
//     + decode_pair_s   * decode_context_tokens * decode_tokens / decode_seqs
//                                                attention over the cached context, per (query,
//                                                cached key) pair; exact when every decoding
//                                                sequence has the same number of drafts
//
// Adding work (a prefill chunk, new or context tokens, a decoding sequence, a draft token, cached
// context) never makes a step faster. Linear terms keep fitting exact (non-negative least
// squares); the small-batch plateau of memory-bound decode appears as the fixed `step_s`.
//
// JSON form (to_json, from_json, save, load), one object with exactly these fields:
//   {"name": "deepseek-v3-h800",              optional string, default "custom"
//    "step_s": 0.0247, "prefill_token_s": 1.048e-4, "prefill_pair_s": 1.05e-8,
//    "decode_token_s": 1.318e-4, "decode_seq_s": 0, "decode_pair_s": 2.57e-8}
// The six parameters are required, non-negative finite numbers in seconds. Unknown fields,
// missing fields and wrong types are errors naming the field.
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::engine {

// One sequence's prefill chunk in a step.
struct PrefillPart {
  int64_t new_tokens = 0;      // tokens computed in this step (>= 1)
  int64_t context_tokens = 0;  // tokens already in the KV cache before them: cached prefix plus
                               // earlier chunks (>= 0)
};

// The work in one executor step; a batch may mix prefill chunks and decoding sequences.
struct StepShape {
  std::vector<PrefillPart> prefills;
  int64_t decode_seqs = 0;            // sequences decoding in this step
  int64_t decode_tokens = 0;          // their new tokens: one each plus speculative drafts,
                                      // so >= decode_seqs (and 0 when decode_seqs is 0)
  int64_t decode_context_tokens = 0;  // sum over those sequences of tokens already cached
};

// The quantities the parameters multiply (the right-hand column of the formula above).
struct StepFeatures {
  double prefill_tokens = 0, prefill_pairs = 0;
  double decode_tokens = 0, decode_seqs = 0, decode_pairs = 0;
};
// Throws tandem::Error naming the field when the shape is inconsistent (negative counts, an
// empty prefill chunk, decode_tokens < decode_seqs, decode tokens without sequences).
StepFeatures step_features(const StepShape& shape);

struct SimLatencyParams {
  double step_s = 0;
  double prefill_token_s = 0;
  double prefill_pair_s = 0;
  double decode_token_s = 0;
  double decode_seq_s = 0;
  double decode_pair_s = 0;
};

class SimLatencyModel {
 public:
  SimLatencyModel() = default;  // all zero: every step takes no time
  // Throws tandem::Error naming the parameter when one is negative or not finite.
  explicit SimLatencyModel(const SimLatencyParams& params, std::string name = "custom");

  double step_seconds(const StepShape& shape) const;

  const SimLatencyParams& params() const { return params_; }
  const std::string& name() const { return name_; }

  // Built-in models (their derivations are in sim_latency.cpp): "deepseek-v3-h800",
  // "deepseek-v3-h20", "tiny". An unknown name throws tandem::Error listing the valid ones.
  static SimLatencyModel preset(std::string_view name);
  static const std::vector<std::string>& preset_names();

  std::string to_json() const;
  // `origin` names the source (a path) in error messages.
  static SimLatencyModel from_json(std::string_view text,
                                   std::string_view origin = "latency model");
  void save(const std::filesystem::path& path) const;
  static SimLatencyModel load(const std::filesystem::path& path);

 private:
  SimLatencyParams params_;
  std::string name_ = "custom";
};

// A measured step: its shape and how long it took.
struct LatencySample {
  StepShape shape;
  double seconds = 0;
};

struct LatencyFit {
  SimLatencyModel model;
  double rms_relative_error = 0;  // over the samples, (predicted - measured) / measured
  double max_relative_error = 0;  // largest |(predicted - measured) / measured|
};

// Least-squares fit of the parameters to measured steps, minimising relative error (so short
// decode steps count as much as long prefills) under non-negativity (Lawson-Hanson NNLS).
// A parameter whose kind of work no sample contains stays 0; when two kinds always occur in the
// same proportion (decode tokens and sequences without drafts) the earlier one in the formula
// takes the whole cost. Throws tandem::Error for no samples, a non-positive or non-finite
// time, or an inconsistent shape, naming the sample.
LatencyFit fit_sim_latency(const std::vector<LatencySample>& samples, std::string name = "fitted");

}  // namespace tandem::engine
