#pragma once
// Speculative decoding's draft side: DeepSeek's multi-token-prediction (MTP) module run after a
// step's main forward pass.
//
// The MTP module at position i reads the main model's hidden state of token i and the embedding
// of token i+1 and predicts token i+2; its one decoder layer keeps its own latent cache (the
// cache layer after the main ones). So after every step it runs over each item's positions
// whose next token is now known (a prefill chunk's, a decode step's verified ones), which keeps
// that cache complete; for sampled items its last row proposes the first draft, and the module
// applied again to its own output (its hidden state standing in for the main model's, as vLLM
// and SGLang do for K > 1) proposes the others, one position further each time. Entries those
// extra passes write past the verified tokens are overwritten by the next step's first pass.
#include <cstdint>
#include <span>
#include <vector>

#include "engine/executor/executor.h"
#include "model/deepseek.h"

namespace tandem::engine {

class MtpDrafter {
 public:
  // `draft_tokens` (>= 1) drafts per sampled item. Throws tandem::Error when the model has no
  // MTP module.
  MtpDrafter(const model::DeepSeekModel& model, int64_t draft_tokens,
             std::span<const int32_t> no_text);

  // After the main pass `main` over `batch` (each item's rows: its tokens, then its drafts) and
  // sample_items(): fills the MTP cache for the verified positions and sets the drafts (and,
  // for sampled requests, their distributions) of every sampled item in `sampled`. Items whose
  // block table has no room for a further draft's position get fewer drafts.
  void run(std::span<const ExecItem> batch, const model::StepOutput& main,
           model::LatentCache& cache, std::vector<StepTokens>& sampled) const;

 private:
  const model::DeepSeekModel& model_;
  int64_t draft_tokens_;
  std::vector<int32_t> no_text_;
};

}  // namespace tandem::engine
