#include "cli/max_tokens_flags.h"

#include "cli/number_checks.h"

namespace tandem::cli {

void add_max_tokens_flags(CLI::App& cmd, MaxTokensFlags& flags) {
  cmd.add_option("--max-tokens-limit", flags.limit,
                 "the largest max_tokens a request may ask for; more is refused with 400 (0: what "
                 "the context leaves; a gateway applies it where it tokenizes, with --model)")
      ->capture_default_str()
      ->check(non_negative_number());
  cmd.add_option("--default-max-tokens", flags.default_value,
                 "max_tokens of a request that gives none (0: the API's default: 16 for "
                 "completions, the context's room for chat, 128 for /generate; never above "
                 "--max-tokens-limit)")
      ->capture_default_str()
      ->check(non_negative_number());
}

}  // namespace tandem::cli
