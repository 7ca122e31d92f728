#pragma once
// The executor runs one engine step: a batch in which every sequence contributes some new tokens
// (a prefill chunk, one decode token, later speculative drafts) at positions it names, reading
// and writing the paged latent cache through its block table; for the sequences whose step ends
// at their last known token it samples the next one. Two implementations: the CPU model and a
// simulated executor (a latency model and deterministic tokens) that lets one small machine
// stand in for a cluster of large GPUs. The scheduler, cache, events and API are the same for both.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "engine/scheduler/sequence.h"

namespace tandem::engine {

struct ExecItem {
  std::span<const int32_t> tokens;  // the new tokens
  int64_t start = 0;                // position of tokens[0]
  std::span<const int32_t> blocks;  // block table covering start + tokens.size() positions
  bool sample = false;              // sample a token after the last new one
  // For sampling: the sequence's sampler and history (penalties look at both).
  Sampler* sampler = nullptr;
  std::span<const int32_t> prompt, generated;
  int32_t logprobs = -1;  // -1: none, else also return the k most likely tokens
};

struct ExecResult {
  // Per item with sample = true, in batch order; empty entries for the others.
  std::vector<TokenLogprob> sampled;
};

struct ExecutorInfo {
  std::string model_name;
  int64_t vocab_size = 0;
  int64_t max_model_len = 0;
  int64_t num_blocks = 0;  // KV blocks the executor's cache holds
  int64_t block_size = 0;
};

class Executor {
 public:
  virtual ~Executor() = default;
  virtual const ExecutorInfo& info() const = 0;
  virtual ExecResult execute(std::span<const ExecItem> batch) = 0;
};

}  // namespace tandem::engine
