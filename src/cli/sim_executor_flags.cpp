#include "cli/sim_executor_flags.h"

#include <cmath>
#include <exception>
#include <optional>

#include "cli/bench_options.h"
#include "cli/number_checks.h"
#include "placement/files.h"
#include "util/error.h"

namespace tandem::cli {

void add_sim_executor_flags(CLI::App& cmd, SimExecutorFlags& f) {
  cmd.add_option("--sim-seed", f.seed, "seed of the simulated executor's tokens and routes")
      ->check(seed_range());
  cmd.add_option("--sim-kv-token-bytes", f.kv_token_bytes,
                 "bytes per token and layer a simulated engine's KV transfers move (default: "
                 "the model's real size)")
      ->check(non_negative_number());
  cmd.add_option("--sim-expert-parallel", f.expert_parallel,
                 "simulated expert-parallel ranks: a step's MoE time follows the busiest rank's "
                 "routes (0: balanced, the latency model as it is)")
      ->check(non_negative_number());
  cmd.add_option("--sim-placement", f.placement,
                 "where experts live for --sim-expert-parallel (.json from `tandem place plan` "
                 "or an Omni .npy); default: every expert once, in order");
  cmd.add_option("--sim-routing-skew", f.routing_skew,
                 "Zipf exponent of the simulated routing, or LOW:HIGH spread over the MoE layers")
      ->capture_default_str();
  cmd.add_option("--sim-moe-share", f.moe_share,
                 "share of a balanced simulated step that MoE layers take")
      ->capture_default_str();
  cmd.add_option("--sim-mtp-acceptance", f.mtp_acceptance,
                 "with --speculative-tokens: the probability that each draft is right given the "
                 "ones before it were, one per draft position (the last repeats); DeepSeek-V3 "
                 "reports 0.85-0.9 for the first")
      ->capture_default_str();
  cmd.add_option("--sim-mtp-draft-pass-share", f.mtp_draft_pass_share,
                 "with --speculative-tokens: what each draft pass adds to a step, as a share of "
                 "its modelled time (default: one layer of DeepSeek-V3's 61)")
      ->check(non_negative_number());
  for (const char* flag : {"--sim-seed", "--sim-kv-token-bytes", "--sim-expert-parallel",
                           "--sim-placement", "--sim-routing-skew", "--sim-moe-share",
                           "--sim-mtp-acceptance", "--sim-mtp-draft-pass-share"})
    cmd.get_option(flag)->each(
        [&f, name = std::string(flag)](const std::string&) { f.given.insert(name); });
}

engine::SimExecutorOptions sim_executor_options(const SimExecutorFlags& f,
                                                const std::string& preset,
                                                int64_t speculative_tokens) {
  engine::SimExecutorOptions so;
  so.preset = preset;
  so.seed = f.seed;
  so.kv_token_bytes = f.kv_token_bytes;
  if (f.expert_parallel > 0) {
    auto& ep = so.expert_parallel;
    ep.ranks = f.expert_parallel;
    ep.moe_share = f.moe_share;
    ep.seed = f.seed;
    ep.skew.seed = f.seed + 1;
    const auto colon = f.routing_skew.find(':');
    const auto lo = whole_number(f.routing_skew.substr(0, colon));
    const auto hi =
        colon == std::string::npos ? lo : whole_number(f.routing_skew.substr(colon + 1));
    if (!lo || !hi || !(*lo >= 0 && *lo <= *hi))
      throw Error(
          "--sim-routing-skew: want ALPHA or LOW:HIGH (Zipf exponents, 0 <= LOW <= HIGH), got '" +
          f.routing_skew + "'");
    ep.skew.alpha_lo = *lo;
    ep.skew.alpha_hi = *hi;
    if (!f.placement.empty()) ep.placement = placement::read_placement(f.placement);
  } else {
    if (!f.placement.empty()) throw Error("--sim-placement needs --sim-expert-parallel N");
    for (const char* flag : {"--sim-routing-skew", "--sim-moe-share"})
      if (f.given.contains(flag)) throw Error(std::string(flag) + " needs --sim-expert-parallel N");
  }
  if (speculative_tokens == 0)
    for (const char* flag : {"--sim-mtp-acceptance", "--sim-mtp-draft-pass-share"})
      if (f.given.contains(flag))
        throw Error(std::string(flag) + " models drafts: it needs --speculative-tokens N");
  // The executor's bound, named by the flag.
  if (!(f.mtp_draft_pass_share >= 0 && f.mtp_draft_pass_share < 1e6))
    throw Error(
        "--sim-mtp-draft-pass-share: expected a share of a step's modelled time in "
        "0..10^6, got " +
        number_text(f.mtp_draft_pass_share));
  so.mtp.drafts = speculative_tokens;
  so.mtp.draft_pass_share = f.mtp_draft_pass_share;
  so.mtp.acceptance.clear();
  for (const std::string& p : split(f.mtp_acceptance, ',')) {
    double v = -1;
    try {
      size_t used = 0;
      v = std::stod(p, &used);
      if (used != p.size()) v = -1;
    } catch (const std::exception&) {
    }
    if (!(v >= 0 && v <= 1))
      throw Error("--sim-mtp-acceptance: want probabilities in 0..1 separated by commas, got '" +
                  f.mtp_acceptance + "'");
    so.mtp.acceptance.push_back(v);
  }
  if (so.mtp.acceptance.empty())
    throw Error("--sim-mtp-acceptance: want at least one probability (0..1)");
  // One per draft position, the last repeating: more than the drafts would be ignored.
  if (speculative_tokens > 0 && int64_t(so.mtp.acceptance.size()) > speculative_tokens)
    throw Error("--sim-mtp-acceptance: " + std::to_string(so.mtp.acceptance.size()) +
                " probabilities, want at most " + std::to_string(speculative_tokens) +
                " (one per draft position of --speculative-tokens " +
                std::to_string(speculative_tokens) + "; the last repeats)");
  return so;
}

}  // namespace tandem::cli
