#pragma once
// The simulated executor's flags, shared by `tandem engine --model sim:PRESET` (one live engine)
// and `tandem simulate` (every engine of a virtual cluster): KV bytes per token, expert
// parallelism under a placement with skewed routing, and MTP's acceptance model.
#include <cstdint>
#include <functional>
#include <set>
#include <string>

#include <CLI/CLI.hpp>

#include "engine/executor/sim_executor.h"

namespace tandem::cli {

struct SimExecutorFlags {
  uint64_t seed = 0;
  int64_t kv_token_bytes = 0;
  int expert_parallel = 0;
  std::string placement, routing_skew = "1.0";
  double moe_share = 0.5;
  std::string mtp_acceptance = "0.85";
  double mtp_draft_pass_share = 1.0 / 61;
  // The flags given on the command line (add_sim_executor_flags records them): one that the run
  // would not use is refused even at its default value.
  std::set<std::string, std::less<>> given;
};

// Adds --sim-seed, --sim-kv-token-bytes, --sim-expert-parallel, --sim-placement,
// --sim-routing-skew, --sim-moe-share, --sim-mtp-acceptance and --sim-mtp-draft-pass-share.
void add_sim_executor_flags(CLI::App& cmd, SimExecutorFlags& f);

// The executor's options for `preset` with `speculative_tokens` MTP drafts per step (0: none).
// Throws tandem::Error naming the flag on a bad value (a skew or acceptance list that does not
// parse, a draft pass share out of range, an unreadable placement file) and on a flag the run
// would not use (--sim-placement, --sim-routing-skew or --sim-moe-share without
// --sim-expert-parallel; --sim-mtp-acceptance or --sim-mtp-draft-pass-share without drafts).
engine::SimExecutorOptions sim_executor_options(const SimExecutorFlags& f,
                                                const std::string& preset,
                                                int64_t speculative_tokens);

}  // namespace tandem::cli
