#pragma once
// Which ids have text. A model's vocabulary may have rows past the tokenizer's ids (padded:
// DeepSeek-V3 has 129,280 rows for 128,815 ids); a prompt may hold them, as vLLM's may, but they
// have no text: decoded they read as nothing, as transformers' decode skips ids it does not know,
// and an engine never samples them. The API's echo, logprob tokens and /detokenize and the
// engine's sampling masks all ask here, so they agree on which ids those are.
#include <cstdint>
#include <span>
#include <vector>

#include "text/tokenizer.h"

namespace tandem::text {

inline bool has_text(const Tokenizer& tokenizer, TokenId id) {
  return tokenizer.id_to_token(id).has_value();
}

// `ids` without those that have no text, in order: what a decode of them reads.
inline std::vector<TokenId> ids_with_text(const Tokenizer& tokenizer,
                                          std::span<const TokenId> ids) {
  std::vector<TokenId> out;
  out.reserve(ids.size());
  for (TokenId id : ids)
    if (has_text(tokenizer, id)) out.push_back(id);
  return out;
}

// The ids below `vocab_size` (the model's rows) that have no text, ascending.
inline std::vector<TokenId> ids_without_text(const Tokenizer& tokenizer, int64_t vocab_size) {
  std::vector<TokenId> out;
  for (int64_t id = 0; id < vocab_size; ++id)
    if (!has_text(tokenizer, static_cast<TokenId>(id))) out.push_back(static_cast<TokenId>(id));
  return out;
}

}  // namespace tandem::text
