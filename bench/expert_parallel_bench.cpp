// Expert parallelism on one host: the same steps on the single-process CPU executor (EP 1) and
// on an expert-parallel executor of N rank processes (EP N), in alternating rounds, medians:
//   - prefill of B prompts of P tokens in one step, then D decode steps of B tokens: tokens/s;
//   - per MoE layer and step on EP N: bytes through the exchange, the copies (dispatch and
//     combine), the barrier waits (which include the busiest rank's lead), the experts; and what
//     moving those bytes would take over a real link, per GB/s;
//   - routing skew and a live rebalance: the routed rows each rank's experts computed under a
//     placement that puts the experts the model routes to most on rank 0, then after a live
//     switch to the Omni planner's incremental plan from the same loads.
// On a 2-core machine EP is a correctness and overhead demonstration: N ranks share the cores.
// Usage: tandem-bench-expert-parallel --model DIR --tandem BUILD/tandem [--ranks 2]
//        [--rounds 3] [--batch 8] [--prompt 64] [--decode 16]
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <numeric>

#include <omp.h>

#include <CLI/CLI.hpp>

#include "engine/executor/cpu_executor.h"
#include "engine/expert_parallel/ep_executor.h"
#include "placement/planner.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace {

using namespace tandem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Run {
  double prefill_s = 0, decode_step_s = 0;
};

// B sequences: one prefill step of P tokens each, then D decode steps; greedy.
// `after_prefill`, when given, runs between the prefill step and the decode steps.
Run run_steps(engine::Executor& ex, int64_t batch, int64_t prompt, int64_t decode, int seed,
              const std::function<void()>& after_prefill = {}) {
  const int64_t bs = ex.info().block_size;
  const int64_t per_seq = (prompt + decode + bs) / bs;
  std::vector<std::vector<int32_t>> tokens(static_cast<size_t>(batch)),
      blocks(static_cast<size_t>(batch));
  api::SamplingParams greedy;
  greedy.temperature = 0;
  std::vector<std::unique_ptr<engine::Sampler>> samplers;
  for (int64_t s = 0; s < batch; ++s) {
    for (int64_t i = 0; i < prompt; ++i)
      tokens[size_t(s)].push_back(int32_t(1000 + (i * 7919 + s * 104729 + seed * 31) % 20000));
    for (int64_t b = 0; b < per_seq; ++b) blocks[size_t(s)].push_back(int32_t(s * per_seq + b));
    samplers.push_back(std::make_unique<engine::Sampler>(greedy, 1));
  }
  auto step = [&](bool first) {
    std::vector<engine::ExecItem> items;
    for (int64_t s = 0; s < batch; ++s) {
      auto& t = tokens[size_t(s)];
      engine::ExecItem item;
      item.tokens = first ? std::span<const int32_t>(t) : std::span<const int32_t>(t).last(1);
      item.start = first ? 0 : int64_t(t.size()) - 1;
      item.blocks = blocks[size_t(s)];
      item.sample = true;
      item.sampler = samplers[size_t(s)].get();
      item.prompt = t;
      items.push_back(item);
    }
    const auto out = ex.execute(items);
    for (int64_t s = 0; s < batch; ++s)
      tokens[size_t(s)].push_back(out.sampled[size_t(s)].tokens.front().token);
  };
  Run r;
  auto t0 = Clock::now();
  step(true);
  r.prefill_s = seconds_since(t0);
  if (after_prefill) after_prefill();
  t0 = Clock::now();
  for (int64_t d = 0; d < decode; ++d) step(false);
  r.decode_step_s = seconds_since(t0) / double(decode);
  return r;
}

engine::RankWork sum(const std::vector<engine::RankWork>& v) {
  engine::RankWork s;
  for (const auto& r : v) {
    s.exchange_bytes += r.exchange_bytes;
    s.copy_seconds += r.copy_seconds;
    s.wait_seconds += r.wait_seconds;
    s.expert_seconds += r.expert_seconds;
    s.expert_rows += r.expert_rows;
    s.moe_layers = std::max(s.moe_layers, r.moe_layers);
  }
  return s;
}

std::vector<engine::RankWork> minus(const std::vector<engine::RankWork>& a,
                                    const std::vector<engine::RankWork>& b) {
  std::vector<engine::RankWork> d(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    d[i].moe_layers = a[i].moe_layers - b[i].moe_layers;
    d[i].exchange_bytes = a[i].exchange_bytes - b[i].exchange_bytes;
    d[i].copy_seconds = a[i].copy_seconds - b[i].copy_seconds;
    d[i].wait_seconds = a[i].wait_seconds - b[i].wait_seconds;
    d[i].expert_seconds = a[i].expert_seconds - b[i].expert_seconds;
    d[i].expert_rows = a[i].expert_rows - b[i].expert_rows;
  }
  return d;
}

// Switches `ex` live to `next` and waits for it.
engine::PlacementSwitch switch_to(engine::ep::EpExecutor& ex, const placement::Placement& next) {
  std::mutex m;
  std::condition_variable cv;
  bool loaded = false;
  ex.stage_expert_placement(next, [&] {
    std::lock_guard l(m);
    loaded = true;
    cv.notify_all();
  });
  std::unique_lock l(m);
  cv.wait(l, [&] { return loaded; });
  return ex.switch_expert_placement();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Tandem expert parallelism on one host: EP N next to EP 1");
  std::string model_dir, tandem_path;
  int ranks = 2, rounds = 3;
  int64_t batch = 8, prompt = 64, decode = 16;
  app.add_option("--model", model_dir, "checkpoint folder (make-model --preset bench)")->required();
  app.add_option("--tandem", tandem_path, "the tandem binary (runs the ranks)")->required();
  app.add_option("--ranks", ranks, "expert-parallel ranks")->capture_default_str();
  app.add_option("--rounds", rounds, "alternating rounds (medians)")->capture_default_str();
  app.add_option("--batch", batch, "sequences")->capture_default_str();
  app.add_option("--prompt", prompt, "prompt tokens per sequence")->capture_default_str();
  app.add_option("--decode", decode, "decode steps")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const auto tokenizer = text::Tokenizer::from_dir(model_dir);
    engine::CpuExecutorOptions cache;
    cache.num_blocks = batch * ((prompt + decode + 16) / 16) + 1;
    auto model =
        std::make_shared<const model::DeepSeekModel>(model::DeepSeekModel::load(model_dir));
    const auto& c = model->config();
    engine::CpuExecutor single(model, tokenizer, "ep1", cache);
    engine::ep::EpExecutorOptions eo;
    eo.ranks = ranks;
    eo.model_dir = model_dir;
    eo.model_name = "epN";
    eo.cache = cache;
    eo.max_tokens = batch * prompt;
    eo.max_items = batch;
    eo.rank_program = tandem_path;
    eo.threads_per_rank = 1;
    engine::ep::EpExecutor ep(eo, tokenizer);
    const int64_t moe_layers = int64_t(single.info().moe_layers.size());
    std::printf("model %s: %lld layers (%lld MoE), %lld experts, top-%lld, hidden %lld\n",
                model_dir.c_str(), static_cast<long long>(c.num_hidden_layers),
                static_cast<long long>(moe_layers), static_cast<long long>(c.n_routed_experts),
                static_cast<long long>(c.num_experts_per_tok),
                static_cast<long long>(c.hidden_size));
    std::printf("%d cores: EP 1 runs %d threads, EP %d one per rank\n", omp_get_num_procs(),
                omp_get_num_procs(), ranks);
    std::printf(
        "%d rounds of: %lld prompts of %lld tokens in one step, %lld decode steps of %lld\n",
        rounds, static_cast<long long>(batch), static_cast<long long>(prompt),
        static_cast<long long>(decode), static_cast<long long>(batch));

    std::vector<double> pre1, dec1, preN, decN;
    std::vector<engine::RankWork> prefill_x;  // EP N, summed over ranks
    // EP 1 uses every core; EP N one thread per rank (rank 0 runs on this thread).
    const int cores = omp_get_num_procs();
    for (int r = 0; r < rounds; ++r) {
      omp_set_num_threads(cores);
      const Run a = run_steps(single, batch, prompt, decode, r);
      omp_set_num_threads(1);
      pre1.push_back(a.prefill_s);
      dec1.push_back(a.decode_step_s);
      // EP N, with the exchange figures of its prefill step.
      const auto before = ep.rank_work();
      const Run b = run_steps(ep, batch, prompt, decode, r,
                              [&] { prefill_x.push_back(sum(minus(ep.rank_work(), before))); });
      preN.push_back(b.prefill_s);
      decN.push_back(b.decode_step_s);
    }
    // Decode alone, for per-step exchange figures.
    const auto before = ep.rank_work();
    run_steps(ep, batch, 1, decode, 99);
    const auto dx = sum(minus(ep.rank_work(), before));

    const double p1 = median(pre1), pN = median(preN), d1 = median(dec1), dN = median(decN);
    const std::string ep_name = "EP " + std::to_string(ranks);
    std::printf("\n%-22s %12s %12s %8s\n", "", "EP 1", ep_name.c_str(), "EPN/EP1");
    std::printf("%-22s %12.1f %12.1f %7.2fx\n", "prefill tokens/s", double(batch * prompt) / p1,
                double(batch * prompt) / pN, p1 / pN);
    std::printf("%-22s %12.1f %12.1f %7.2fx\n", "decode tokens/s", double(batch) / d1,
                double(batch) / dN, d1 / dN);
    std::printf("%-22s %12.2f %12.2f\n", "decode step ms", d1 * 1e3, dN * 1e3);

    // Per MoE layer of one decode step, averaged over ranks.
    const double layer_steps = double(dx.moe_layers);  // MoE layers x steps each rank went through
    const double per = 1e6 / layer_steps / ranks;      // µs per layer per rank
    std::printf("\nexchange per MoE layer and decode step (batch %lld, mean over ranks):\n",
                static_cast<long long>(batch));
    std::printf("  bytes %.0f (rows out + results in, all ranks)\n",
                double(dx.exchange_bytes) / layer_steps);
    std::printf("  copies (dispatch + combine) %.1f us, barrier waits %.1f us, experts %.1f us\n",
                dx.copy_seconds * per, dx.wait_seconds * per, dx.expert_seconds * per);
    std::printf("  the same bytes over a link: %.1f us at 1 GB/s (divide by the link's GB/s)\n",
                double(dx.exchange_bytes) / layer_steps / 1e3);
    const auto px = prefill_x.back();
    const double pl = double(px.moe_layers);
    std::printf(
        "exchange per MoE layer of the %lld-token prefill step: %.0f bytes, copies %.1f "
        "us, waits %.1f us, experts %.1f us\n",
        static_cast<long long>(batch * prompt), double(px.exchange_bytes) / pl,
        px.copy_seconds * 1e6 / pl / ranks, px.wait_seconds * 1e6 / pl / ranks,
        px.expert_seconds * 1e6 / pl / ranks);

    // Skew and a live rebalance. The loads: the routes of the steps so far.
    std::vector<int64_t> counts(size_t(moe_layers * c.n_routed_experts), 0);
    for (size_t li = 0; li < size_t(moe_layers); ++li)
      for (int64_t e = 0; e < c.n_routed_experts; ++e)
        counts[li * size_t(c.n_routed_experts) + size_t(e)] =
            int64_t(model->expert_counts()[size_t(single.info().moe_layers[li])][size_t(e)]);
    placement::ExpertLoads loads{moe_layers, c.n_routed_experts,
                                 std::vector<double>(counts.begin(), counts.end())};
    // Worst case: per layer, experts sorted by load, the hottest ones filling rank 0 first.
    placement::Placement skewed{ranks, c.n_routed_experts, {}};
    for (int64_t l = 0; l < moe_layers; ++l) {
      std::vector<int32_t> order(size_t(c.n_routed_experts));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return loads.at(l, a) > loads.at(l, b); });
      std::vector<std::vector<int32_t>> layer(static_cast<size_t>(ranks));
      for (size_t i = 0; i < order.size(); ++i)
        layer[i * size_t(ranks) / order.size()].push_back(order[i]);
      skewed.layers.push_back(layer);
    }
    auto rows_per_rank = [&](const placement::Placement& p, const char* name) {
      const auto s0 = ep.rank_work();
      run_steps(ep, batch, prompt, decode, 7);
      const auto s = minus(ep.rank_work(), s0);
      int64_t most = 0, total = 0;
      std::printf("  %-34s", name);
      for (const auto& r : s) {
        std::printf(" %8lld", static_cast<long long>(r.expert_rows));
        most = std::max(most, r.expert_rows);
        total += r.expert_rows;
      }
      std::printf("   busiest/mean %.2f  (step proxy of the loads %.2f)\n",
                  double(most) * ranks / double(std::max<int64_t>(total, 1)),
                  placement::evaluate(loads, p).step_proxy);
    };
    std::printf("\nrouted rows computed per rank over one round (prefill + decode):\n");
    const auto sw1 = switch_to(ep, skewed);
    rows_per_rank(skewed, "hottest experts on rank 0");
    const auto plan = placement::plan_incremental(loads, skewed, {});
    const auto sw2 = switch_to(ep, plan.placement);
    rows_per_rank(plan.placement, "after a live incremental rebalance");
    std::printf(
        "live switches: %lld and %lld copies moved, loaded in %.1f and %.1f ms in the "
        "background, pause between two steps %.2f and %.2f ms\n",
        static_cast<long long>(sw1.moves), static_cast<long long>(sw2.moves),
        sw1.load_seconds * 1e3, sw2.load_seconds * 1e3, sw1.pause_seconds * 1e3,
        sw2.pause_seconds * 1e3);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
