#include "cli/simulate_command.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include <nlohmann/json.hpp>

#include "bench/metrics.h"
#include "bench/sweep_report.h"
#include "bench/workload.h"
#include "cli/bench_options.h"
#include "cli/sim_executor_flags.h"
#include "gateway/policy.h"
#include "gateway/topology.h"
#include "sim/cluster_simulation.h"
#include "sim/sweep.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace tandem::cli {
namespace {

using nlohmann::json;

struct SimulateCliOptions {
  WorkloadCliOptions workload;
  MetricsCliOptions metrics;
  RunOutputs outputs;
  std::string model = "sim:deepseek-v3-h800", mode, policy, topology;
  std::optional<int> prefill, decode;  // not given: the topology file's count (else 0 and 1)
  int64_t max_num_seqs = 64, max_num_batched_tokens = 2048, num_blocks = 0, block_size = 16;
  int64_t speculative_tokens = 0;
  SimExecutorFlags sim;
  double kv_link_gb_per_s = 25, kv_link_latency_us = 50, kv_transfer_timeout = 120;
  double kv_transfer_handshake_timeout = sim::SimulationOptions{}.kv_transfer_handshake_timeout_s;
  std::vector<std::string> sweep, kill, stall, slow_link;
};

constexpr std::string_view kSimPrefix = "sim:";

using Fault = sim::SimulationOptions::Fault;

// The fault flags: the kind each makes, and the form it takes.
struct FaultFlag {
  Fault::Kind kind;
  const char* form;
  bool duration, factor;  // the form has +DURATION, :FACTOR
};
const std::map<std::string, FaultFlag> kFaultFlags = {
    {"--kill", {Fault::Kind::kDeath, "ENGINE@SECONDS (e.g. decode-3@120)", false, false}},
    {"--stall",
     {Fault::Kind::kStall, "ENGINE@SECONDS+DURATION (e.g. decode-3@120+30)", true, false}},
    {"--slow-link",
     {Fault::Kind::kSlowLink, "ENGINE@SECONDS+DURATION:FACTOR (e.g. prefill-0@60+120:10)", true,
      true}}};

// A number that is the whole of `text`, or -1.
double number_or_negative(const std::string& text) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    return used == text.size() ? v : -1;
  } catch (const std::exception&) {
    return -1;
  }
}

Fault parse_fault(const std::string& flag, const std::string& spec) {
  const FaultFlag& form = kFaultFlags.at(flag);
  Fault f;
  f.kind = form.kind;
  const auto at = spec.find('@');
  const auto plus = form.duration ? spec.find('+', at) : std::string::npos;
  const auto colon = form.factor ? spec.find(':', at) : std::string::npos;
  bool ok = at != std::string::npos && at > 0 && (!form.duration || plus != std::string::npos) &&
            (!form.factor || (colon != std::string::npos && colon > plus));
  if (ok) {
    f.engine = spec.substr(0, at);
    f.at_s = number_or_negative(spec.substr(at + 1, (form.duration ? plus : spec.size()) - at - 1));
    if (form.duration)
      f.duration_s =
          number_or_negative(spec.substr(plus + 1, (form.factor ? colon : spec.size()) - plus - 1));
    if (form.factor) f.factor = number_or_negative(spec.substr(colon + 1));
    // inf and 1e10 parse as numbers, but no clock counts that far: they would fire at 0.
    const double most = bench::kMaxArrivalSeconds;
    ok = f.at_s >= 0 && f.at_s <= most && f.duration_s >= 0 && f.duration_s <= most &&
         (!form.factor || (f.factor >= 1 && f.factor <= sim::kMaxSlowdown));
  }
  if (!ok)
    throw Error(flag + ": expected " + form.form + " with SECONDS" +
                (form.duration ? " and DURATION" : "") + " in 0.." +
                std::to_string(int64_t(bench::kMaxArrivalSeconds)) +
                (form.factor ? ", FACTOR in 1.." + std::to_string(int64_t(sim::kMaxSlowdown))
                             : std::string()) +
                ", got '" + spec + "'");
  return f;
}

sim::SimulationOptions options_at(const sim::SimulationOptions& base, const sim::SweepPoint& p) {
  sim::SimulationOptions so = base;
  so.prefill = p.prefill;
  so.decode = p.decode;
  so.gateway.policy = p.policy;
  return so;
}

std::string point_name(const sim::SweepPoint& p) {
  return "--sweep point prefill=" + std::to_string(p.prefill) +
         " decode=" + std::to_string(p.decode) + " policy=" + p.policy;
}

// The sweep's points, every one checked before the first runs (a policy, a mode's engine counts,
// a fault's engine): a point that cannot run must not be found hours into the sweep.
std::vector<sim::SweepPoint> checked_sweep_points(const SimulateCliOptions& o,
                                                  const sim::SimulationOptions& base) {
  const auto points = sim::sweep_points(o.sweep, {base.prefill, base.decode, base.gateway.policy});
  for (const auto& p : points) {
    try {
      sim::check_options(options_at(base, p));
    } catch (const Error& e) {
      throw Error(point_name(p) + ": " + e.what());
    }
  }
  return points;
}

// One simulation per grid point over the same workload: a row each (goodput, TTFT and TPOT
// percentiles, prefix hit rate), and the points in the result JSON.
void run_sweep(const SimulateCliOptions& o, const sim::SimulationOptions& base,
               const std::vector<sim::SweepPoint>& points, const bench::LazyWorkload& reqs,
               std::shared_ptr<const text::Tokenizer> tok, bench::MetricsOptions mo) {
  // The percentiles the rows show, besides those asked for.
  for (double q : {50.0, 90.0, 99.0})
    if (std::find(mo.percentiles.begin(), mo.percentiles.end(), q) == mo.percentiles.end())
      mo.percentiles.push_back(q);
  auto pct = [](const bench::MetricStats& m, double q) {
    for (const auto& [p, v] : m.percentiles_ms)
      if (p == q) return v;
    return 0.0;
  };
  std::fprintf(stderr, "tandem simulate: %zu requests (%s), %s mode, %zu points\n", reqs.size(),
               o.workload.dataset.c_str(), gateway::mode_name(base.gateway.mode), points.size());
  std::printf("%7s %6s %5s %-12s %9s %9s %9s %9s %9s %9s %9s %7s\n", "prefill", "decode", "P:D",
              "policy", "goodput", "req/s", "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50",
              "TPOT p99", "hit %");
  json rows = json::array();
  std::vector<bench::SweepRow> report_rows;
  // A point that fails as it runs ends the sweep, but the points before it are still written.
  std::string failure;
  for (const auto& p : points) {
    sim::SimulationRun r;
    try {
      r = sim::simulate(reqs, options_at(base, p), tok);
    } catch (const std::exception& e) {  // an allocation failure too: the rows before are kept
      failure = point_name(p) + ": " + e.what();
      break;
    }
    const bench::BenchSummary s = bench::summarize(r.results, r.duration_s, mo);
    const double hit = r.prefix_queries > 0 ? r.prefix_hits / r.prefix_queries : 0;
    const double ratio = p.decode > 0 ? double(p.prefill) / double(p.decode) : 0;
    // Without an SLO there is no goodput (null in the JSON): n/a, not 0.
    char goodput[32] = "n/a";
    if (s.request_goodput) std::snprintf(goodput, sizeof goodput, "%.3f", *s.request_goodput);
    std::printf("%7d %6d %5.2f %-12s %9s %9.3f %9.0f %9.0f %9.0f %9.1f %9.1f %7.2f\n", p.prefill,
                p.decode, ratio, p.policy.c_str(), goodput, s.request_throughput, pct(s.ttft, 50),
                pct(s.ttft, 90), pct(s.ttft, 99), pct(s.tpot, 50), pct(s.tpot, 99), 100 * hit);
    std::fflush(stdout);
    json row = bench::to_json(s);
    row["prefill"] = p.prefill;
    row["decode"] = p.decode;
    row["policy"] = p.policy;
    row["prefix_cache_hit_rate"] = hit;
    row["kv_transfers"] = r.kv_transfers;
    rows.push_back(row);
    report_rows.push_back({p.prefill, p.decode, p.policy, s.request_goodput, s.request_throughput,
                           pct(s.ttft, 50), pct(s.ttft, 90), pct(s.ttft, 99), pct(s.tpot, 50),
                           pct(s.tpot, 99), hit});
  }
  std::string html, result;
  if (!o.outputs.html.empty()) {
    std::string sweeps;
    for (const auto& sw : o.sweep) sweeps += (sweeps.empty() ? "" : " ") + sw;
    html = bench::sweep_report(
        report_rows,
        "tandem simulate --sweep: " + o.workload.dataset + ", " +
            gateway::mode_name(base.gateway.mode),
        {{"model", o.model},
         {"mode", gateway::mode_name(base.gateway.mode)},
         {"dataset",
          o.workload.dataset +
              (o.workload.dataset_path.empty() ? "" : " (" + o.workload.dataset_path + ")")},
         {"requests", std::to_string(reqs.size())},
         {"sweep", sweeps},
         {"goodput SLOs", o.metrics.goodput.empty() ? "none" : [&] {
            std::string g;
            for (const auto& x : o.metrics.goodput) g += (g.empty() ? "" : " ") + x;
            return g;
          }()}});
  }
  if (!o.outputs.result_file.empty()) {
    json j = {{"backend", "tandem-simulate"}, {"dataset_name", o.workload.dataset},
              {"num_prompts", reqs.size()},   {"mode", gateway::mode_name(base.gateway.mode)},
              {"model_id", o.model},          {"sweep", rows}};
    if (!failure.empty()) j["sweep_error"] = failure;
    result = result_json_text(j);
  }
  if (!o.outputs.result_file.empty()) {
    write_output("--result-file", o.outputs.result_file, result);
    std::fprintf(stderr, "tandem simulate: results in %s\n", o.outputs.result_file.c_str());
  }
  if (!o.outputs.html.empty()) {
    write_output("--html", o.outputs.html, html);
    std::fprintf(stderr, "tandem simulate: report in %s\n", o.outputs.html.c_str());
  }
  if (!failure.empty()) {
    const bool written = !o.outputs.result_file.empty() || !o.outputs.html.empty();
    throw Error(failure + " (the " + std::to_string(rows.size()) + " points before it are " +
                (written ? "written" : "in the table above") + ")");
  }
}

void run(const SimulateCliOptions& o) {
  const bench::MetricsOptions mo = metrics_options(o.metrics);  // before anything runs
  sim::SimulationOptions so;
  if (!o.topology.empty()) {
    so.gateway = gateway::load_topology(o.topology);
    // The simulated clients send no key: a topology that wants one would refuse every request
    // (401) and the run would measure nothing. A production topology still simulates, open.
    if (!so.gateway.api_keys.empty()) {
      std::fprintf(stderr,
                   "tandem simulate: note: --topology %s sets api_keys; the simulated clients "
                   "send no key, so the simulated gateway takes every request without one\n",
                   o.topology.c_str());
      so.gateway.api_keys.clear();
    }
    if (!so.gateway.priority.api_keys.empty())
      std::fprintf(stderr,
                   "tandem simulate: note: --topology %s maps API keys to priority classes; "
                   "the simulated clients send no key, so every request is in the default "
                   "class\n",
                   o.topology.c_str());
  }
  if (!o.policy.empty()) so.gateway.policy = o.policy;
  // A policy the topology file names is checked here, where the file can be named (the check
  // below only names the policy).
  if (!o.topology.empty() && o.policy.empty()) {
    try {
      gateway::make_policy(so.gateway.policy, gateway::policy_options(so.gateway));
    } catch (const Error& e) {
      throw Error("--topology " + o.topology + ": " + e.what());
    }
  }
  if (!o.mode.empty()) so.gateway.mode = gateway::parse_mode(o.mode);
  for (const auto& [flag, count] : {std::pair{"--prefill", o.prefill}, {"--decode", o.decode}})
    if (count && *count < 0)
      throw Error(std::string(flag) + ": expected an engine count >= 0, got " +
                  std::to_string(*count));
  so.prefill = o.prefill            ? *o.prefill
               : o.topology.empty() ? 0
                                    : static_cast<int>(so.gateway.prefill.endpoints.size());
  so.decode = o.decode             ? *o.decode
              : o.topology.empty() ? 1
                                   : static_cast<int>(so.gateway.decode.endpoints.size());
  if (o.model.rfind(kSimPrefix, 0) != 0)
    throw Error(
        "--model: the simulator runs simulated engines, sim:PRESET or sim:FITTED.json, got '" +
        o.model + "'");
  so.executor =
      sim_executor_options(o.sim, o.model.substr(kSimPrefix.size()), o.speculative_tokens);
  so.executor.num_blocks = o.num_blocks;
  so.executor.block_size = o.block_size;
  so.scheduler.max_num_seqs = o.max_num_seqs;
  so.scheduler.max_num_batched_tokens = o.max_num_batched_tokens;
  // The links' bounds, the KV transfer timeouts', the block size's, the KV bytes' and the
  // blocks' are check_options' (each sweep point's too), which names these flags.
  so.kv_transfer_timeout_s = o.kv_transfer_timeout;
  so.kv_transfer_handshake_timeout_s = o.kv_transfer_handshake_timeout;
  so.kv_link.bytes_per_s = o.kv_link_gb_per_s * 1e9;
  so.kv_link.latency_s = o.kv_link_latency_us * 1e-6;
  for (const auto& [flag, specs] : {std::pair{"--kill", &o.kill}, std::pair{"--stall", &o.stall},
                                    std::pair{"--slow-link", &o.slow_link}})
    for (const std::string& spec : *specs) so.faults.push_back(parse_fault(flag, spec));
  // Before the workload is read (a whole trace, maybe): a run that cannot start, or whose
  // results could not be written, says so first.
  check_workload_options(o.workload);
  check_outputs(o.outputs);
  std::vector<sim::SweepPoint> points;
  if (o.sweep.empty())
    sim::check_options(so);
  else
    points = checked_sweep_points(o, so);
  const std::string tokenizer_dir = workload_tokenizer_dir(o.workload);
  so.gateway.model = tokenizer_dir;  // the gateway tokenizes, as `tandem serve` has it do

  auto tok = std::make_shared<const text::Tokenizer>(text::Tokenizer::from_dir(tokenizer_dir));
  const bench::LazyWorkload reqs = build_lazy_workload(o.workload, *tok);  // not empty
  set_prompt_bos(o.workload, *tok, so.client);
  so.client.ignore_eos = ignore_eos_of(o.workload, false, false);  // as tandem bench sends it
  const WorkloadCliOptions& w = o.workload;
  if (!o.sweep.empty()) {
    run_sweep(o, so, points, reqs, tok, mo);
    return;
  }
  std::fprintf(stderr,
               "tandem simulate: %zu requests (%s), %s mode, %d prefill + %d decode engines "
               "(%s), policy %s\n",
               reqs.size(), w.dataset.c_str(), gateway::mode_name(so.gateway.mode), so.prefill,
               so.decode, o.model.c_str(), so.gateway.policy.c_str());
  const auto wall = std::chrono::steady_clock::now();
  const sim::SimulationRun result = sim::simulate(reqs, so, tok);
  const double wall_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall).count();

  const bench::BenchSummary summary = bench::summarize(result.results, result.duration_s, mo);
  RunDescription run;
  run.report.table.request_rate = w.request_rate;
  if (result.prefix_queries > 0)
    run.prefix_cache_hit_rate = result.prefix_hits / result.prefix_queries;
  json engines = json::array();
  for (const auto& e : result.engines)
    engines.push_back({{"name", e.name},
                       {"prefill", e.prefill},
                       {"steps", e.steps},
                       {"busy_s", e.busy_s},
                       {"prefix_cache_queries", e.prefix_queries},
                       {"prefix_cache_hits", e.prefix_hits},
                       {"killed", e.died},
                       {"stalled", e.stalled},
                       {"blocks_in_use", e.blocks_in_use},
                       {"healthy", e.healthy}});
  run.extra = {
      {"backend", "tandem-simulate"},
      {"dataset_name", w.dataset},
      {"num_prompts", reqs.size()},
      {"request_rate", std::isfinite(w.request_rate) ? json(w.request_rate) : json("inf")},
      {"burstiness", w.burstiness},
      {"max_concurrency", nullptr},
      {"model_id", o.model},
      {"simulation",
       {{"mode", gateway::mode_name(so.gateway.mode)},
        {"policy", so.gateway.policy},
        {"prefill", so.prefill},
        {"decode", so.decode},
        {"seed", w.seed},
        {"sim_seed", so.executor.seed},
        {"wall_seconds", wall_s},
        {"kv_transfers", result.kv_transfers},
        {"retries", result.retries},
        {"engine_failures", result.engine_failures},
        {"timeouts", result.timeouts},
        {"idle_skipped_s", result.skipped_s},
        {"kv_transfer_bytes", result.kv_transfer_bytes},
        // The MoE and MTP settings modelled (null where the run did not use one),
        // so a result file says what it simulated.
        {"sim_expert_parallel", o.sim.expert_parallel},
        {"sim_placement", o.sim.placement.empty() ? json(nullptr) : json(o.sim.placement)},
        {"sim_routing_skew", o.sim.expert_parallel > 0 ? json(o.sim.routing_skew) : json(nullptr)},
        {"sim_moe_share", o.sim.expert_parallel > 0 ? json(o.sim.moe_share) : json(nullptr)},
        {"speculative_tokens", o.speculative_tokens},
        {"sim_mtp_acceptance",
         o.speculative_tokens > 0 ? json(so.executor.mtp.acceptance) : json(nullptr)},
        {"sim_mtp_draft_pass_share",
         o.speculative_tokens > 0 ? json(so.executor.mtp.draft_pass_share) : json(nullptr)},
        {"mtp_draft_tokens", result.draft_tokens},
        {"mtp_accepted_tokens", result.accepted_tokens},
        {"engines", engines}}}};
  run.report.title = "tandem simulate: " + w.dataset + ", " + std::to_string(so.prefill) + "P + " +
                     std::to_string(so.decode) + "D, " + so.gateway.policy;
  run.report.config = {
      {"model", o.model},
      {"mode", gateway::mode_name(so.gateway.mode)},
      {"engines",
       std::to_string(so.prefill) + " prefill + " + std::to_string(so.decode) + " decode"},
      {"policy", so.gateway.policy},
      {"dataset", w.dataset + (w.dataset_path.empty() ? "" : " (" + w.dataset_path + ")")},
      {"requests", std::to_string(reqs.size())},
      {"request rate", std::isfinite(w.request_rate) ? number_text(w.request_rate) : "inf / trace"},
      {"seed", std::to_string(w.seed)}};
  write_run(summary, result.results, run, o.outputs, "tandem simulate");
  std::fprintf(stderr,
               "tandem simulate: %.1f s of virtual time (%.1f s of it idle, skipped) in %.2f s "
               "of wall time\n",
               result.virtual_end_s, result.skipped_s, wall_s);
  if (!so.faults.empty())
    std::fprintf(stderr,
                 "  faults: %zu; %lld engine calls timed out (load polls included), %lld calls "
                 "failed (request legs and health probes), %lld legs retried, %lld requests "
                 "failed\n",
                 so.faults.size(), static_cast<long long>(result.timeouts),
                 static_cast<long long>(result.engine_failures),
                 static_cast<long long>(result.retries), static_cast<long long>(summary.failed));
  if (result.draft_tokens > 0)
    std::fprintf(stderr, "  MTP: %.1f%% of %.0f drafts accepted\n",
                 100 * result.accepted_tokens / result.draft_tokens, result.draft_tokens);
  if (result.kv_transfers > 0)
    std::fprintf(stderr, "  %lld KV transfers, %.2f GB\n",
                 static_cast<long long>(result.kv_transfers), result.kv_transfer_bytes / 1e9);
  for (const auto& e : result.engines)
    std::fprintf(stderr, "  %-12s %8lld steps, busy %5.1f%%, prefix hits %5.1f%%%s\n",
                 e.name.c_str(), static_cast<long long>(e.steps),
                 result.duration_s > 0 ? 100 * e.busy_s / result.duration_s : 0.0,
                 e.prefix_queries > 0 ? 100 * e.prefix_hits / e.prefix_queries : 0.0,
                 e.died       ? " (killed)"
                 : e.stalled  ? " (stalled at the end)"
                 : !e.healthy ? " (ejected by the gateway)"
                              : "");
}

}  // namespace

void add_simulate_command(CLI::App& app) {
  auto o = std::make_shared<SimulateCliOptions>();
  auto* cmd = app.add_subcommand(
      "simulate",
      "A workload through the gateway and simulated engines in virtual time (their own code, "
      "no sockets); reported as tandem bench reports a live run");
  add_workload_options(*cmd, o->workload);
  cmd->add_option("--prefill", o->prefill, "prefill engines (default: the topology's, else 0)");
  cmd->add_option("--decode", o->decode, "decode engines (default: the topology's, else 1)");
  cmd->add_option("--mode", o->mode,
                  "aggregated (the default), sequential (vLLM's P/D flow) or parallel (SGLang's)");
  cmd->add_option("--policy", o->policy,
                  "the gateway's scheduling policy (default: the topology's, else tandem)");
  cmd->add_option("--topology", o->topology,
                  "a gateway topology file: its settings (policy, scheduling, health, timeouts, "
                  "queue) and engine counts; its addresses are not used, nor its api_keys (the "
                  "simulated clients send no key)");
  cmd->add_option("--model", o->model, "sim:PRESET or sim:FITTED.json (tandem sim-fit)")
      ->capture_default_str();
  cmd->add_option("--max-num-seqs", o->max_num_seqs, "each engine's running sequences at most")
      ->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", o->max_num_batched_tokens,
                  "each engine's tokens per step at most")
      ->capture_default_str();
  cmd->add_option("--num-kv-blocks", o->num_blocks,
                  "each engine's KV blocks (0: the preset's; at most 10^8)")
      ->capture_default_str();
  cmd->add_option("--block-size", o->block_size, "tokens per KV block (1..4096)")
      ->capture_default_str();
  cmd->add_option("--speculative-tokens", o->speculative_tokens,
                  "MTP drafts per decode step on every engine, accepted as --sim-mtp-acceptance "
                  "says (0: no speculation)")
      ->capture_default_str()
      ->check(CLI::Range(0, 8));  // as tandem engine and tandem serve take it
  add_sim_executor_flags(*cmd, o->sim);
  cmd->add_option("--kv-link-gb-per-s", o->kv_link_gb_per_s,
                  "P/D: each prefill-decode link's bandwidth (GB/s, 0.0001..10^6)")
      ->capture_default_str();
  cmd->add_option("--kv-link-latency-us", o->kv_link_latency_us,
                  "P/D: each link's one-way latency (microseconds, 0..10^9)")
      ->capture_default_str();
  cmd->add_option("--kill", o->kill,
                  "a fault: ENGINE@SECONDS, e.g. decode-3@120 (the engine dies then: its streams "
                  "are cut, its connections refused); repeatable");
  cmd->add_option("--kv-transfer-timeout", o->kv_transfer_timeout,
                  "P/D: seconds a held prefill or a bootstrap room waits for its other leg, and "
                  "each transfer frame may take (tandem engine's flag; 0.001..2147483.647)")
      ->capture_default_str();
  cmd->add_option("--kv-transfer-handshake-timeout", o->kv_transfer_handshake_timeout,
                  "P/D: seconds a prefill engine answers a pull within before a decode engine "
                  "gives it up as hung (tandem engine's flag; 0.001..2147483.647)")
      ->capture_default_str();
  cmd->add_option("--stall", o->stall,
                  "a fault: ENGINE@SECONDS+DURATION, e.g. decode-3@120+30 (the engine hangs for "
                  "that long, as under SIGSTOP: no step, no answer, no KV moved; calls and "
                  "transfers wait or time out); repeatable");
  cmd->add_option("--slow-link", o->slow_link,
                  "a fault: ENGINE@SECONDS+DURATION:FACTOR, e.g. prefill-0@60+120:10 (the "
                  "engine's KV links run FACTOR times slower for that long; sequential and "
                  "parallel modes); repeatable");
  cmd->add_option("--sweep", o->sweep,
                  "a grid of runs: prefill=2..16 (doubling), decode=4..12/4 (steps), "
                  "policy=tandem,kv_router (lists); repeatable, every combination");
  add_metrics_options(*cmd, o->metrics);
  cmd->add_option("--result-file", o->outputs.result_file,
                  "write the JSON result (vLLM's keys, and the simulation's) here");
  cmd->add_option("--html", o->outputs.html,
                  "write the HTML report here (a sweep's: goodput and TTFT/TPOT percentiles "
                  "against the P:D ratio)");
  cmd->callback([o] { run(*o); });
}

}  // namespace tandem::cli
