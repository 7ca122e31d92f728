#pragma once
// The operator's limits on a request's max_tokens, as `tandem engine`, `tandem gateway` and
// `tandem serve` take them (api::ModelLimits).
#include <cstdint>

#include <CLI/CLI.hpp>

namespace tandem::cli {

struct MaxTokensFlags {
  int64_t limit = 0;          // --max-tokens-limit
  int64_t default_value = 0;  // --default-max-tokens
};

void add_max_tokens_flags(CLI::App& cmd, MaxTokensFlags& flags);

}  // namespace tandem::cli
