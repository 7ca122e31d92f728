#pragma once
// One forward step of a batch, for every model family: each sequence contributes any number of
// new tokens (a prefill chunk, one decode token, or a token plus speculative drafts) and asks for
// logits at some of them.
#include <cstdint>
#include <span>
#include <vector>

#include "util/uninitialized_vector.h"

namespace tandem::model {

// Which of a step's new tokens get logits: the last one (the next token), every one (verifying
// speculative drafts) or none (a prefill chunk that does not reach the prompt's end).
enum class LogitRows { kLast, kAll, kNone };

struct SequenceStep {
  std::span<const int32_t> tokens;  // the new tokens
  int64_t start = 0;                // position of tokens[0]; earlier positions are in the cache
  std::span<const int32_t> blocks;  // block table covering start + tokens.size() positions
  LogitRows logits = LogitRows::kLast;
};

struct StepOutput {
  util::UninitializedVector<float> logits;  // [rows, vocab_size]
  std::vector<int64_t> first_row;  // per sequence, its first row in `logits` (if it has rows)
  std::vector<float> hidden;       // [new tokens, hidden_size], before the final norm (MTP input)
  // Per new token, the smallest MoE routing margin over its layers (see Routing::margin);
  // infinity for models without MoE layers.
  std::vector<float> routing_margin;
};

}  // namespace tandem::model
