// CPU engine throughput on a DeepSeek-family checkpoint (the `bench` preset of make-model):
// prefill of a 512-token prompt, and decode at batch 1 and batch 16, each reported as tokens/s,
// as achieved GFLOP/s or GB/s, and as a percentage of this machine's peaks measured in the same
// run (BF16 FMA throughput for prefill, DRAM read bandwidth for decode).
// Also: resident memory after load against the checkpoint's bytes, and with --contexts, decode
// at batch 1 after long contexts against the ideal time.
// Usage: tandem-bench-engine --model DIR [--model DIR ...] [--prompt 512] [--decode 32]
//        [--prefill-runs 3] [--prefill-only | --decode-only] [--contexts 4096,16384,32768]
//        [--batch-invariant] [--int8-lm-head]
// --decode-only measures batch-1 decode after a short prompt and nothing else: a few seconds
// after load, so that bench/peer_decode.sh can alternate it tightly with the peer's decode.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>

#include <CLI/CLI.hpp>

#include "kernels/cpu/mla_attention.h"
#include "machine_peaks.h"
#include "model/deepseek.h"
#include "model/qwen3_moe.h"
#include "util/error.h"
#include "util/huge_pages.h"
#include "util/proc_fields.h"

namespace {

// Untimed decode steps before each timed run, as llama-bench warms up before it times: the first
// steps after a prefill grow per-thread buffers and touch pages a steady decode does not.
constexpr int64_t kWarmupSteps = 2;

using tandem::model::DeepSeekModel;
using tandem::model::LatentCache;
using tandem::model::LayerWeights;
using tandem::model::ModelConfig;
using tandem::model::SequenceStep;
using tandem::model::StepPart;
using tandem::model::StepProfile;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

size_t mlp_bytes(const tandem::model::MlpWeights& m) {
  return m.gate.bytes() + m.up.bytes() + m.down.bytes();
}

size_t attention_bytes(const LayerWeights& l) {
  const auto& a = l.attn;
  return a.q_a.bytes() + a.q_b.bytes() + a.q.bytes() + a.kv_a.bytes() + a.kv_b.bytes() +
         a.o.bytes();
}

// Weight bytes every token reads whatever its routing: attention, dense MLPs, routers, shared
// experts, the LM head.
size_t fixed_bytes(const DeepSeekModel& m) {
  const auto& w = m.weights();
  size_t b = w.lm_head.bytes();
  for (const auto& l : w.layers) {
    b += attention_bytes(l);
    b += l.is_moe ? l.moe.router.bytes() + (l.moe.has_shared ? mlp_bytes(l.moe.shared) : 0)
                  : mlp_bytes(l.dense);
  }
  return b;
}

size_t expert_bytes(const DeepSeekModel& m) {
  for (const auto& l : m.weights().layers)
    if (l.is_moe) return mlp_bytes(l.moe.experts[0]);
  return 0;
}

// FLOPs of a prefill of `p` tokens as the engine computes it (expanded attention; logits for
// the last position only).
double prefill_flops(const ModelConfig& c, const DeepSeekModel& m, int64_t p) {
  const double h = c.hidden_size, heads = c.num_attention_heads;
  double f = 0;
  for (const auto& l : m.weights().layers) {
    const auto& a = l.attn;
    f += 2.0 * p *
         (a.q_a.rows * a.q_a.cols + a.q_b.rows * a.q_b.cols + a.q.rows * a.q.cols +
          a.kv_a.rows * a.kv_a.cols + a.kv_b.rows * a.kv_b.cols + a.o.rows * a.o.cols);
    // Causal scores (nope + rope) and weighted values: sum over i of (i + 1) positions.
    f += 2.0 * heads * (p * (p + 1) / 2.0) * (c.qk_head_dim() + c.v_head_dim);
    if (l.is_moe) {
      f += 2.0 * p * h * c.n_routed_experts;
      f += 2.0 * p * c.num_experts_per_tok * 3 * h * c.moe_intermediate_size;
      if (l.moe.has_shared) f += 2.0 * p * 3 * h * l.moe.shared.gate.rows;
    } else {
      f += 2.0 * p * 3 * h * l.dense.gate.rows;
    }
  }
  return f + 2.0 * h * c.vocab_size;
}

std::vector<int32_t> random_tokens(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> id(100, 127999);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = id(rng);
  return t;
}

int32_t argmax(const float* l, int64_t n) {
  return static_cast<int32_t>(std::max_element(l, l + n) - l);
}

// `steps` greedy decode steps of one sequence, the first feeding `tok` at position `pos`: the
// token the last one chose.
template <typename Model>
int32_t greedy_steps(const Model& model, LatentCache& cache, std::span<const int32_t> table,
                     int32_t tok, int64_t pos, int64_t steps, int64_t vocab) {
  for (int64_t i = 0; i < steps; ++i) {
    SequenceStep d{std::span(&tok, 1), pos + i, table};
    tok = argmax(model.forward(std::span(&d, 1), cache).logits.data(), vocab);
  }
  return tok;
}

// Weight (and cache) bytes one decode token reads in each part of the model.
std::array<double, static_cast<size_t>(StepPart::kCount)> part_bytes(const DeepSeekModel& m,
                                                                     double kv_bytes) {
  std::array<double, static_cast<size_t>(StepPart::kCount)> b{};
  auto at = [&](StepPart p) -> double& { return b[static_cast<size_t>(p)]; };
  const auto& c = m.config();
  for (const auto& l : m.weights().layers) {
    const auto& a = l.attn;
    at(StepPart::kAttentionProjections) += static_cast<double>(
        a.q_a.bytes() + a.q_b.bytes() + a.q.bytes() + a.kv_a.bytes() + a.o.bytes());
    at(StepPart::kAttentionCore) += static_cast<double>(a.kv_b.bytes());
    if (l.is_moe) {
      at(StepPart::kRouting) += static_cast<double>(l.moe.router.bytes());
      at(StepPart::kRoutedExperts) +=
          static_cast<double>(c.num_experts_per_tok) * mlp_bytes(l.moe.experts[0]);
      if (l.moe.has_shared) at(StepPart::kSharedExperts) += mlp_bytes(l.moe.shared);
    } else {
      at(StepPart::kDenseMlp) += static_cast<double>(mlp_bytes(l.dense));
    }
  }
  at(StepPart::kAttentionCore) += kv_bytes;
  at(StepPart::kLmHead) = static_cast<double>(m.weights().lm_head.bytes());
  return b;
}

void print_breakdown(StepProfile& profile, int64_t steps,
                     const std::array<double, static_cast<size_t>(StepPart::kCount)>& bytes,
                     double dram, const char* unit = "token") {
  const double total = profile.total();
  std::printf("  per %s, by part (model timers; %.1f ms/%s in timed parts):\n", unit,
              1e3 * total / steps, unit);
  for (size_t i = 0; i < bytes.size(); ++i) {
    const auto part = static_cast<StepPart>(i);
    const double secs = profile[part] / steps;
    std::printf("    %-22s %7.2f ms %5.1f%%  %7.1f MB  %5.1f GB/s (%3.0f%% of %.1f)\n",
                StepProfile::name(part), 1e3 * secs, 100 * profile[part] / total, bytes[i] / 1e6,
                secs > 0 ? bytes[i] / secs / 1e9 : 0.0,
                secs > 0 ? 100 * bytes[i] / secs / 1e9 / dram : 0.0, dram);
  }
}

// FLOPs of each part of a prefill of `p` tokens, as prefill_flops counts them.
std::array<double, static_cast<size_t>(StepPart::kCount)> part_flops(const ModelConfig& c,
                                                                     const DeepSeekModel& m,
                                                                     int64_t p) {
  std::array<double, static_cast<size_t>(StepPart::kCount)> f{};
  auto at = [&](StepPart part) -> double& { return f[static_cast<size_t>(part)]; };
  const double h = c.hidden_size, heads = c.num_attention_heads, n = static_cast<double>(p);
  for (const auto& l : m.weights().layers) {
    const auto& a = l.attn;
    at(StepPart::kAttentionProjections) +=
        2.0 * n *
        static_cast<double>(a.q_a.rows * a.q_a.cols + a.q_b.rows * a.q_b.cols +
                            a.q.rows * a.q.cols + a.kv_a.rows * a.kv_a.cols + a.o.rows * a.o.cols);
    at(StepPart::kAttentionCore) +=
        2.0 * n * static_cast<double>(a.kv_b.rows * a.kv_b.cols) +
        2.0 * heads * (n * (n + 1) / 2.0) * static_cast<double>(c.qk_head_dim() + c.v_head_dim);
    if (l.is_moe) {
      at(StepPart::kRouting) += 2.0 * n * h * static_cast<double>(c.n_routed_experts);
      at(StepPart::kRoutedExperts) += 2.0 * n * static_cast<double>(c.num_experts_per_tok) * 3 * h *
                                      static_cast<double>(c.moe_intermediate_size);
      if (l.moe.has_shared)
        at(StepPart::kSharedExperts) +=
            2.0 * n * 3 * h * static_cast<double>(l.moe.shared.gate.rows);
    } else {
      at(StepPart::kDenseMlp) += 2.0 * n * 3 * h * static_cast<double>(l.dense.gate.rows);
    }
  }
  at(StepPart::kLmHead) = 2.0 * h * static_cast<double>(c.vocab_size);
  return f;
}

// Where a prefill's time goes: milliseconds and the share of the BF16 (or FP32) peak per part.
void print_prefill_breakdown(StepProfile& profile,
                             const std::array<double, static_cast<size_t>(StepPart::kCount)>& flops,
                             double peak) {
  const double total = profile.total();
  std::printf("  by part (model timers; %.1f ms in timed parts):\n", 1e3 * total);
  for (size_t i = 0; i < flops.size(); ++i) {
    const auto part = static_cast<StepPart>(i);
    const double secs = profile[part];
    const double gflops = secs > 0 ? flops[i] / secs / 1e9 : 0.0;
    std::printf("    %-22s %8.1f ms %5.1f%%  %7.1f GFLOP  %6.1f GFLOP/s (%3.0f%% of peak)\n",
                StepProfile::name(part), 1e3 * secs, 100 * secs / total, flops[i] / 1e9, gflops,
                100 * gflops / peak);
  }
}

// Resident memory of this process now (VmRSS), bytes.
double resident_bytes() {
  return static_cast<double>(tandem::util::proc_kb_field("/proc/self/status", "VmRSS"));
}

// Resident growth since `before` against the checkpoint's tensor bytes, and how much of the
// process is on huge pages.
void print_resident(double before, const DeepSeekModel& model, const char* after) {
  const double growth = resident_bytes() - before;
  std::printf(
      "resident after %s: %.2f GB = %.3fx the checkpoint's tensor bytes; %.2f GB on huge pages\n",
      after, growth / 1e9, growth / model.weights().checkpoint.total_bytes(),
      static_cast<double>(tandem::util::anon_huge_page_bytes()) / 1e9);
}

// Which measurements a run makes.
enum class Phases {
  kAll,
  kPrefillOnly,
  kDecodeOnly,  // batch 1 after a short prompt only
};

// Decode at batch 1 after `context` cached positions. The cache is filled with random latents
// (normal, like the normalised latents a prefill writes) instead of a prefill: a decode step's
// time depends on how many positions it attends to, not on their values, and a 32K prefill
// would take minutes. Reports tokens/s and the share of the ideal: weight and cache bytes at the
// measured read bandwidth plus the attention FLOPs at the measured peak.
void long_context_decode(DeepSeekModel& model, const tandem::bench::MachinePeaks& peaks,
                         int64_t context, int64_t steps, double weight_bytes) {
  const auto& c = model.config();
  const int64_t block = 16, blocks = (context + kWarmupSteps + steps + block - 1) / block + 1;
  const auto shape = model.cache_shape(block);
  LatentCache cache(shape, blocks);
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0);
  {
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> entry(shape.entry());
    for (int64_t p = 0; p < context; ++p)
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        for (auto& x : entry) x = normal(rng);
        cache.store(p / block, l, p % block, entry.data());
      }
  }
  double dram = tandem::bench::measure_dram_gbs();
  int32_t tok = 1000;
  for (int64_t i = 0; i < kWarmupSteps; ++i) {
    SequenceStep d{std::span(&tok, 1), context + i, table};
    tok = argmax(model.forward(std::span(&d, 1), cache).logits.data(), c.vocab_size);
  }
  const double t0 = now();
  for (int64_t i = kWarmupSteps; i < kWarmupSteps + steps; ++i) {
    SequenceStep d{std::span(&tok, 1), context + i, table};
    auto out = model.forward(std::span(&d, 1), cache);
    tok = argmax(out.logits.data(), c.vocab_size);
  }
  const double secs = now() - t0;
  dram = std::max(dram, tandem::bench::measure_dram_gbs());
  const tandem::kernels::MlaShape mla{
      c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim, block, 1.0f, shape.type};
  double kv_bytes = 0, flops = 0;
  for (int64_t i = kWarmupSteps; i < kWarmupSteps + steps; ++i) {
    kv_bytes += static_cast<double>(context + i + 1) * shape.entry_bytes() * c.num_hidden_layers;
    flops += tandem::kernels::mla_decode_flops(mla, 1, context + i + 1) * c.num_hidden_layers;
  }
  const double ideal =
      (weight_bytes * steps + kv_bytes) / (dram * 1e9) + flops / (peaks.bf16_reference() * 1e9);
  std::printf(
      "decode at %6ld:      %8.2f tokens/s  %5.1f%% of ideal (%.1f GB/s, %.0f GFLOP/s; %s "
      "cache)\n",
      static_cast<long>(context), steps / secs, 100 * ideal / secs, dram, peaks.bf16_reference(),
      tandem::model::latent_type_name(shape.type));

  // The same steps again with the model's per-part timers on (the cache has room for them).
  tandem::model::StepProfile profile;
  model.set_profile(&profile);
  for (int64_t i = kWarmupSteps; i < kWarmupSteps + steps; ++i) {
    SequenceStep d{std::span(&tok, 1), context + i, table};
    tok = argmax(model.forward(std::span(&d, 1), cache).logits.data(), c.vocab_size);
  }
  model.set_profile(nullptr);
  print_breakdown(profile, steps, part_bytes(model, kv_bytes / static_cast<double>(steps)), dram);
}

void run(const std::string& dir, const tandem::bench::MachinePeaks& peaks, int64_t prompt_len,
         int64_t decode_steps, int prefill_runs, Phases phases,
         const std::vector<int64_t>& contexts, const tandem::model::WeightLoadOptions& load) {
  const double rss_before = resident_bytes();
  auto model = DeepSeekModel::load(dir, {}, load);
  const auto& c = model.config();
  const int64_t block = 16, entry_bytes = model.cache_shape(block).entry_bytes();
  const int64_t layers = c.num_hidden_layers;
  // The attention output projection is quantised in INT8 checkpoints; the LM head only with
  // --int8-lm-head.
  const auto type = model.weights().layers[0].attn.o.type;
  const std::string dtype = type == tandem::kernels::WeightType::kI8     ? "INT8"
                            : type == tandem::kernels::WeightType::kBF16 ? "BF16"
                                                                         : "F32";
  std::printf("\n== %s (%s weights: %.2f GB, %ld layers, hidden %ld, %ld experts top-%ld)\n",
              dir.c_str(), dtype.c_str(), model.weights().checkpoint.total_bytes() / 1e9,
              static_cast<long>(layers), static_cast<long>(c.hidden_size),
              static_cast<long>(c.n_routed_experts), static_cast<long>(c.num_experts_per_tok));

  // Prefill: one 512-token prompt, best of `prefill_runs` (the median too when there are more
  // than three: this VM's neighbours make single runs noisy).
  const auto prompt = random_tokens(prompt_len, 1);
  // The prompt, the warm-up and timed decode steps, and the profiled steps after them.
  const int64_t blocks = (prompt_len + 2 * decode_steps + kWarmupSteps + block) / block + 1;
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0);
  if (phases != Phases::kDecodeOnly) {
    std::vector<double> times;
    for (int rep = 0; rep < prefill_runs; ++rep) {
      LatentCache cache(model.cache_shape(block), blocks);
      SequenceStep step{prompt, 0, table};
      double t0 = now();
      model.forward(std::span(&step, 1), cache);
      times.push_back(now() - t0);
    }
    // Every weight has been read by now (a 512-token prompt routes to every expert); the prefill's
    // cache is freed. Mapped weights count once they are read, copies made at load at once.
    print_resident(rss_before, model, "a prefill");
    std::sort(times.begin(), times.end());
    const double flops = prefill_flops(c, model, prompt_len);
    const double best = times.front(), gflops = flops / best / 1e9;
    std::printf(
        "prefill %ld tokens:   %8.1f tokens/s  %7.1f GFLOP/s  %5.1f%% of %s peak (%.0f GFLOP/s)\n",
        static_cast<long>(prompt_len), prompt_len / best, gflops,
        100 * gflops / peaks.bf16_reference(), peaks.bf16_gflops > 0 ? "BF16" : "FP32 FMA",
        peaks.bf16_reference());
    if (times.size() > 3) {
      const double median = times[times.size() / 2];
      std::printf("prefill median of %zu: %8.1f tokens/s  %7.1f GFLOP/s  %5.1f%% of %s peak\n",
                  times.size(), prompt_len / median, flops / median / 1e9,
                  100 * flops / median / 1e9 / peaks.bf16_reference(),
                  peaks.bf16_gflops > 0 ? "BF16" : "FP32 FMA");
    }
    {
      // Once more with the per-part timers on (timers add a little; the figures above have none).
      StepProfile profile;
      model.set_profile(&profile);
      LatentCache cache(model.cache_shape(block), blocks);
      SequenceStep step{prompt, 0, table};
      model.forward(std::span(&step, 1), cache);
      model.set_profile(nullptr);
      print_prefill_breakdown(profile, part_flops(c, model, prompt_len), peaks.bf16_reference());
    }
  }
  if (phases == Phases::kPrefillOnly) return;
  int64_t moe_layers = 0;
  for (const auto& l : model.weights().layers) moe_layers += l.is_moe;
  const double token_weight_bytes =
      fixed_bytes(model) +
      static_cast<double>(moe_layers * c.num_experts_per_tok) * expert_bytes(model);
  if (phases == Phases::kAll)
    for (int64_t context : contexts)
      long_context_decode(model, peaks, context, decode_steps, token_weight_bytes);

  // Decode, batch 1, after the prompt.
  {
    double dram = tandem::bench::measure_dram_gbs();
    LatentCache cache(model.cache_shape(block), blocks);
    SequenceStep step{prompt, 0, table};
    auto out = model.forward(std::span(&step, 1), cache);
    int32_t tok = argmax(out.logits.data(), c.vocab_size);
    int64_t pos = prompt_len;
    tok = greedy_steps(model, cache, table, tok, pos, kWarmupSteps, c.vocab_size);
    pos += kWarmupSteps;
    double t0 = now();
    double kv_bytes = 0;
    for (int64_t i = 0; i < decode_steps; ++i) {
      SequenceStep d{std::span(&tok, 1), pos + i, table};
      out = model.forward(std::span(&d, 1), cache);
      tok = argmax(out.logits.data(), c.vocab_size);
      kv_bytes += static_cast<double>(pos + i + 1) * entry_bytes * layers;
    }
    const double secs = now() - t0;
    // This VM's bandwidth drifts with its neighbours: compare with the better of the
    // measurements just before and just after.
    dram = std::max(dram, tandem::bench::measure_dram_gbs());
    const double gbs = (token_weight_bytes * decode_steps + kv_bytes) / secs / 1e9;
    std::printf(
        "decode batch 1:       %8.1f tokens/s  %7.1f GB/s     %5.1f%% of DRAM read bandwidth (%.1f "
        "GB/s, best of just before and just after)\n",
        decode_steps / secs, gbs, 100 * gbs / dram, dram);

    // The same steps again with the model's per-part timers on: where a token's time goes.
    tandem::model::StepProfile profile;
    model.set_profile(&profile);
    for (int64_t i = 0; i < decode_steps; ++i) {
      SequenceStep d{std::span(&tok, 1), pos + decode_steps + i, table};
      out = model.forward(std::span(&d, 1), cache);
      tok = argmax(out.logits.data(), c.vocab_size);
    }
    model.set_profile(nullptr);
    const double kv_token = static_cast<double>(prompt_len + decode_steps * 3 / 2) * entry_bytes *
                            static_cast<double>(layers);
    print_breakdown(profile, decode_steps, part_bytes(model, kv_token), dram);
  }

  if (phases == Phases::kDecodeOnly) {
    print_resident(rss_before, model, "decode");
    return;
  }

  // Decode, batch 16: sixteen 64-token prompts, then steps of one token each.
  {
    double dram = tandem::bench::measure_dram_gbs();
    const int64_t batch = 16, plen = 64;
    const int64_t per_seq = (plen + kWarmupSteps + 2 * decode_steps + block) / block + 1;
    LatentCache cache(model.cache_shape(block), per_seq * batch);
    std::vector<std::vector<int32_t>> prompts, tables;
    std::vector<int32_t> next(batch);
    for (int64_t s = 0; s < batch; ++s) {
      prompts.push_back(random_tokens(plen, 100 + s));
      std::vector<int32_t> t(per_seq);
      std::iota(t.begin(), t.end(), static_cast<int32_t>(s * per_seq));
      tables.push_back(t);
      SequenceStep step{prompts[s], 0, tables[s]};
      auto out = model.forward(std::span(&step, 1), cache);
      next[s] = argmax(out.logits.data(), c.vocab_size);
    }
    auto step_all = [&](int64_t pos) {
      std::vector<SequenceStep> steps;
      for (int64_t s = 0; s < batch; ++s) steps.push_back({std::span(&next[s], 1), pos, tables[s]});
      auto out = model.forward(steps, cache);
      for (int64_t s = 0; s < batch; ++s)
        next[s] = argmax(out.logits.data() + s * c.vocab_size, c.vocab_size);
    };
    for (int64_t i = 0; i < kWarmupSteps; ++i) step_all(plen + i);
    const int64_t first = plen + kWarmupSteps;
    auto counts_before = model.expert_counts();
    double touched_expert_bytes = 0, kv_bytes = 0;
    double t0 = now();
    for (int64_t i = 0; i < decode_steps; ++i) {
      step_all(first + i);
      // Experts read this step: those whose token count moved.
      const auto& counts = model.expert_counts();
      for (size_t l = 0; l < counts.size(); ++l)
        for (size_t e = 0; e < counts[l].size(); ++e)
          if (counts[l][e] != counts_before[l][e]) touched_expert_bytes += expert_bytes(model);
      counts_before = counts;
      kv_bytes += static_cast<double>(batch) * (first + i + 1) * entry_bytes * layers;
    }
    const double secs = now() - t0;
    dram = std::max(dram, tandem::bench::measure_dram_gbs());
    const double gbs =
        (static_cast<double>(fixed_bytes(model)) * decode_steps + touched_expert_bytes + kv_bytes) /
        secs / 1e9;
    std::printf(
        "decode batch 16:      %8.1f tokens/s  %7.1f GB/s     %5.1f%% of DRAM read bandwidth (%.1f "
        "GB/s)\n",
        batch * decode_steps / secs, gbs, 100 * gbs / dram, dram);

    // Again with the per-part timers (per step of 16 tokens; routed experts: those touched).
    tandem::model::StepProfile profile;
    model.set_profile(&profile);
    for (int64_t i = 0; i < decode_steps; ++i) step_all(first + decode_steps + i);
    model.set_profile(nullptr);
    auto bytes = part_bytes(model, kv_bytes / decode_steps);
    bytes[static_cast<size_t>(StepPart::kRoutedExperts)] = touched_expert_bytes / decode_steps;
    print_breakdown(profile, decode_steps, bytes, dram, "step");
  }
}

}  // namespace

// Qwen3-MoE: prefill of one prompt (best of `prefill_runs`) and batch-1 decode after it, with
// the bytes a decode token reads (attention, the experts it routes to, the LM head) against the
// measured read bandwidth.
void run_qwen3(const std::string& dir, int64_t prompt_len, int64_t decode_steps, int prefill_runs) {
  const double rss_before = resident_bytes();
  const auto model = tandem::model::Qwen3MoeModel::load(dir);
  const auto& c = model.config();
  const int64_t block = 16;
  const auto shape = model.cache_shape(block);
  std::printf("\n== %s (Qwen3-MoE %s, %ld layers, hidden %ld, %ld experts top-%ld)\n", dir.c_str(),
              c.torch_dtype.c_str(), static_cast<long>(c.num_hidden_layers),
              static_cast<long>(c.hidden_size), static_cast<long>(c.num_experts),
              static_cast<long>(c.num_experts_per_tok));
  const auto prompt = random_tokens(prompt_len, 1);
  const int64_t blocks = (prompt_len + decode_steps + kWarmupSteps + block) / block + 1;
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0);
  std::vector<double> times;
  for (int rep = 0; rep < prefill_runs; ++rep) {
    LatentCache cache(shape, blocks);
    SequenceStep step{prompt, 0, table};
    const double t0 = now();
    model.forward(std::span(&step, 1), cache);
    times.push_back(now() - t0);
  }
  std::sort(times.begin(), times.end());
  std::printf("resident after a prefill: %.2f GB\n", (resident_bytes() - rss_before) / 1e9);
  std::printf("prefill %ld tokens:   %8.1f tokens/s (best of %d; median %.1f)\n",
              static_cast<long>(prompt_len), prompt_len / times.front(), prefill_runs,
              prompt_len / times[times.size() / 2]);
  const double dram = tandem::bench::measure_dram_gbs();
  LatentCache cache(shape, blocks);
  SequenceStep step{prompt, 0, table};
  auto out = model.forward(std::span(&step, 1), cache);
  int32_t tok = argmax(out.logits.data(), c.vocab_size);
  int64_t pos = prompt_len;
  tok = greedy_steps(model, cache, table, tok, pos, kWarmupSteps, c.vocab_size);
  pos += kWarmupSteps;
  const double t0 = now();
  greedy_steps(model, cache, table, tok, pos, decode_steps, c.vocab_size);
  const double secs = now() - t0;
  // Weights a token reads: attention and norms of every layer, its experts, the LM head.
  const double element = c.torch_dtype == "float32" ? 4 : 2;
  const double h = double(c.hidden_size), hd = double(c.head_dim);
  const double attention = h * hd * (2.0 * c.num_attention_heads + 2.0 * c.num_key_value_heads);
  const double expert = 3.0 * h * double(c.moe_intermediate_size);
  const double per_token =
      element *
          (double(c.num_hidden_layers) * (attention + double(c.num_experts_per_tok) * expert) +
           double(c.vocab_size) * h) +
      4.0 * double(c.num_hidden_layers) * double(c.num_experts) * h;  // float32 routers
  const double gbs = per_token * decode_steps / secs / 1e9;
  std::printf(
      "decode batch 1:       %8.1f tokens/s  %7.1f GB/s     %5.1f%% of DRAM read bandwidth (%.1f "
      "GB/s)\n",
      decode_steps / secs, gbs, 100 * gbs / dram, dram);
}

int main(int argc, char** argv) {
  CLI::App app{"CPU engine throughput: prefill and decode vs the machine's measured peaks"};
  std::vector<std::string> models;
  int64_t prompt = 512, decode = 32;
  int prefill_runs = 3;
  bool prefill_only = false, decode_only = false;
  std::vector<int64_t> contexts;
  app.add_option("--model", models, "model folder (repeatable)")->required();
  app.add_option("--contexts", contexts,
                 "also decode at batch 1 after these many cached positions (e.g. 4096,16384)")
      ->delimiter(',');
  app.add_option("--prefill-runs", prefill_runs, "prefill measurements (best and median)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  auto* prefill_flag = app.add_flag("--prefill-only", prefill_only, "skip the decode measurements");
  app.add_flag("--decode-only", decode_only,
               "batch-1 decode after a short prompt only (no prefill timing, contexts, batch 16)")
      ->excludes(prefill_flag);
  bool batch_invariant = false;
  app.add_flag("--batch-invariant", batch_invariant,
               "batch-invariant numerics (tandem engine --batch-invariant)");
  tandem::model::WeightLoadOptions load;
  app.add_flag("--int8-lm-head", load.int8_lm_head,
               "quantize the LM head to INT8 at load (tandem engine --int8-lm-head)");
  app.add_option("--prompt", prompt, "prefill prompt length")->capture_default_str();
  app.add_option("--decode", decode, "decode steps per measurement")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  tandem::kernels::set_batch_invariant(batch_invariant);
  const Phases phases = prefill_only  ? Phases::kPrefillOnly
                        : decode_only ? Phases::kDecodeOnly
                                      : Phases::kAll;
  try {
    const auto peaks = tandem::bench::measure_peaks();
    std::printf(
        "machine: %d threads; FP32 FMA %.0f GFLOP/s; BF16 dot %.0f GFLOP/s; DRAM read %.1f GB/s (1 "
        "thread), %.1f GB/s (%d threads)\n",
        peaks.threads, peaks.fp32_gflops, peaks.bf16_gflops, peaks.dram_gbs_1, peaks.dram_gbs_all,
        peaks.threads);
    for (const auto& m : models) {
      if (tandem::model::architecture_of(m) == tandem::model::kQwen3MoeArchitecture)
        run_qwen3(m, prompt, decode, prefill_runs);
      else
        run(m, peaks, prompt, decode, prefill_runs, phases, contexts, load);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
