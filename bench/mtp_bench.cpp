// Speculative decoding with the MTP module (run by bench/mtp.sh on the trained checkpoint):
//  1. the serving engine in process, greedy, prompts cut from held-out text: decode tokens/s and
//     the acceptance per draft position for each batch size and K draft tokens, K = 0 (plain) in
//     the same run, rounds alternating the order of K, medians;
//  2. the cost curve: a verify step (1 + K query tokens per sequence) plus the draft passes over
//     a plain step, split into the model's parts (the draft pass re-reads the LM head), and the
//     speedup the measured acceptance and cost allow, (1 + accepted) / cost, next to the
//     measured one;
//  3. a projection to DeepSeek-V3's shape (61 layers, 58 MoE, one MTP layer, FP8 weights, BF16
//     latent cache) at 80% acceptance of one draft: the bytes each part of a plain step, a
//     verify step and the draft pass reads there, times the share of the allowed speedup this
//     code path keeps here.
// Usage: tandem-bench-mtp --model DIR --text FILE [--batches 1,4,16] [--ks 0,1,2,3]
//        [--prompt 128] [--max-tokens 64] [--rounds 3] [--v3-context 4096]
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <sstream>

#include <CLI/CLI.hpp>

#include "engine/engine.h"
#include "engine/executor/cpu_executor.h"
#include "engine/output_processor.h"
#include "model/deepseek.h"
#include "util/error.h"

namespace {

using namespace tandem;
using Clock = std::chrono::steady_clock;
using model::StepPart;
using model::StepProfile;
constexpr size_t kParts = static_cast<size_t>(StepPart::kCount);
using PartArray = std::array<double, kParts>;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct EngineRun {
  double tokens_per_s = 0;
  double drafts = 0, draft_tokens = 0, accepted = 0;
  std::vector<double> accepted_at;  // per draft position
};

double metric(const std::string& text, const std::string& name, const std::string& labels = {}) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(name + "{", 0) == 0 && line.find(labels) != std::string::npos)
      return std::stod(line.substr(line.rfind(' ') + 1));
  return 0;
}

// Decode tokens/s: the tokens that arrive after every request has its first one, over the time
// from then to the last.
EngineRun run_engine(std::shared_ptr<const model::DeepSeekModel> m,
                     std::shared_ptr<const text::Tokenizer> tok,
                     const std::vector<std::vector<int32_t>>& prompts, int64_t k,
                     int64_t max_tokens) {
  const auto b = static_cast<int64_t>(prompts.size());
  engine::CpuExecutorOptions o;
  o.block_size = 16;
  int64_t positions = 0;
  for (const auto& p : prompts) positions += int64_t(p.size()) + max_tokens + 2 * k + 32;
  o.num_blocks = positions / 16 + b + 8;
  o.speculative_tokens = k;
  metrics::Registry registry;
  engine::EngineConfig config;
  config.scheduler.max_num_seqs = b;
  config.scheduler.max_num_batched_tokens = 8192;
  engine::Engine engine(config, std::make_unique<engine::CpuExecutor>(m, *tok, "bench", o), tok,
                        engine::eos_ids(*tok, std::nullopt), registry);
  engine.start();
  struct Arrival {
    Clock::time_point at;
    size_t tokens;
  };
  std::mutex mu;
  std::vector<std::vector<Arrival>> arrivals(static_cast<size_t>(b));
  std::vector<std::promise<void>> done(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) {
    engine::EngineRequest r;
    r.id = std::to_string(i);
    r.prompt = prompts[size_t(i)];
    r.sampling.temperature = 0;
    r.sampling.max_tokens = max_tokens;
    r.sampling.ignore_eos = true;
    r.on_output = [&, i](const api::RequestOutput& out) {
      {
        std::lock_guard lock(mu);
        arrivals[size_t(i)].push_back({Clock::now(), out.tokens.size()});
      }
      if (out.finished) done[size_t(i)].set_value();
    };
    engine.submit(std::move(r));
  }
  for (auto& d : done) d.get_future().wait();
  engine.stop();
  Clock::time_point t0 = Clock::time_point::min(), end = Clock::time_point::min();
  for (const auto& a : arrivals) {
    t0 = std::max(t0, a.front().at);
    end = std::max(end, a.back().at);
  }
  size_t after = 0;
  for (const auto& a : arrivals)
    for (const auto& x : a)
      if (x.at > t0) after += x.tokens;
  EngineRun r;
  r.tokens_per_s = double(after) / std::chrono::duration<double>(end - t0).count();
  const std::string text = registry.render();
  r.drafts = metric(text, "vllm:spec_decode_num_drafts_total");
  r.draft_tokens = metric(text, "vllm:spec_decode_num_draft_tokens_total");
  r.accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total");
  for (int64_t p = 0; p < k; ++p)
    r.accepted_at.push_back(metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                   "position=\"" + std::to_string(p) + "\""));
  return r;
}

// Bytes a step reads per part: weights of every layer it passes plus the latent cache it
// attends over. Routed experts: those the step's tokens touch, taking routing as uniform.
struct Shape {
  double attn_proj = 0, kv_b = 0, router = 0, expert = 0, shared = 0, dense = 0, head = 0;
  double eh_proj = 0;                 // the MTP module's input projection
  double layers = 0, moe_layers = 0;  // main model
  double experts = 0, top_k = 0;
  double entry_bytes = 0;  // one position's latent cache entry, one layer
  // The MTP layer (a MoE layer of the same widths).
  double touched(double tokens) const {
    return experts * (1 - std::pow(1 - top_k / experts, tokens));
  }
  PartArray main_bytes(double seqs, double tokens_per_seq, double context) const {
    PartArray b{};
    b[size_t(StepPart::kAttentionProjections)] = layers * attn_proj;
    b[size_t(StepPart::kAttentionCore)] = layers * (kv_b + seqs * context * entry_bytes);
    b[size_t(StepPart::kRouting)] = moe_layers * router;
    b[size_t(StepPart::kRoutedExperts)] = moe_layers * touched(seqs * tokens_per_seq) * expert;
    b[size_t(StepPart::kSharedExperts)] = moe_layers * shared;
    b[size_t(StepPart::kDenseMlp)] = (layers - moe_layers) * dense;
    b[size_t(StepPart::kLmHead)] = head;
    return b;
  }
  PartArray mtp_bytes(double seqs, double tokens_per_seq, double context) const {
    PartArray b{};
    b[size_t(StepPart::kAttentionProjections)] = attn_proj + eh_proj;
    b[size_t(StepPart::kAttentionCore)] = kv_b + seqs * context * entry_bytes;
    b[size_t(StepPart::kRouting)] = router;
    b[size_t(StepPart::kRoutedExperts)] = touched(seqs * tokens_per_seq) * expert;
    b[size_t(StepPart::kSharedExperts)] = shared;
    b[size_t(StepPart::kLmHead)] = head;
    return b;
  }
};

// DeepSeek-V3 (its published config.json): FP8 weights (1 byte), BF16 router and latent cache.
Shape deepseek_v3() {
  const double h = 7168, heads = 128, nope = 128, rope = 64, v = 128, q_lora = 1536, kv = 512;
  Shape s;
  s.attn_proj = h * q_lora + q_lora * heads * (nope + rope) + h * (kv + rope) + heads * v * h;
  s.kv_b = kv * heads * (nope + v);
  s.router = 256 * h * 2;
  s.expert = 3 * h * 2048;
  s.shared = 3 * h * 2048;
  s.dense = 3 * h * 18432;
  s.head = 129280 * h;
  s.eh_proj = 2 * h * h;
  s.layers = 61;
  s.moe_layers = 58;
  s.experts = 256;
  s.top_k = 8;
  s.entry_bytes = (kv + rope) * 2;
  return s;
}

struct Timed {
  double seconds = 0;
  StepProfile parts;
};

// The model-level cost of one decode step of `seqs` sequences at `context`: plain (one token
// each), verify (1 + k tokens each, logits for all), and the draft passes (the module over
// 1 + accepted positions, then k - 1 single positions).
struct CostCurve {
  Timed plain, verify, draft;
};

CostCurve measure_cost(model::DeepSeekModel& m, const std::vector<std::vector<int32_t>>& prompts,
                       int64_t k, int64_t accepted, int reps) {
  const auto b = static_cast<int64_t>(prompts.size());
  const int64_t bs = 16, context = int64_t(prompts[0].size());
  const int64_t per_seq = (context + 2 * k + 8 + bs - 1) / bs;
  model::LatentCache cache(m.cache_shape(bs), b * per_seq);
  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(b));
  for (int64_t s = 0; s < b; ++s)
    for (int64_t i = 0; i < per_seq; ++i) tables[size_t(s)].push_back(int32_t(s * per_seq + i));
  {
    std::vector<model::SequenceStep> fill;
    for (int64_t s = 0; s < b; ++s)
      fill.push_back({std::span(prompts[size_t(s)]).first(size_t(context - 1)), 0,
                      tables[size_t(s)], model::LogitRows::kNone});
    m.forward(fill, cache);
  }
  std::vector<std::vector<int32_t>> step_tokens(static_cast<size_t>(b));
  for (int64_t s = 0; s < b; ++s)
    step_tokens[size_t(s)].assign(prompts[size_t(s)].end() - 1, prompts[size_t(s)].end());
  // One run of f: its seconds and, through the profile, its parts.
  struct Samples {
    std::vector<double> seconds;
    StepProfile parts;  // summed
  };
  auto once = [&](Samples& into, const std::function<void()>& f) {
    StepProfile p;
    m.set_profile(&p);
    const auto start = Clock::now();
    f();
    into.seconds.push_back(seconds_since(start));
    m.set_profile(nullptr);
    for (size_t i = 0; i < kParts; ++i) into.parts.seconds[i] += p.seconds[i];
  };
  auto summary = [&](const Samples& x) {
    Timed t{median(x.seconds), {}};
    for (size_t i = 0; i < kParts; ++i) t.parts.seconds[i] = x.parts.seconds[i] / reps;
    return t;
  };
  auto steps_of = [&](int64_t q, model::LogitRows rows, std::vector<std::vector<int32_t>>& ids) {
    std::vector<model::SequenceStep> steps;
    for (int64_t s = 0; s < b; ++s) {
      ids[size_t(s)].resize(size_t(q), step_tokens[size_t(s)][0]);
      steps.push_back({ids[size_t(s)], context - 1, tables[size_t(s)], rows});
    }
    return steps;
  };
  std::vector<std::vector<int32_t>> ids(static_cast<size_t>(b)), vids(static_cast<size_t>(b));
  auto plain = steps_of(1, model::LogitRows::kLast, ids);
  auto verify = steps_of(1 + k, model::LogitRows::kAll, vids);
  model::StepOutput out = m.forward(verify, cache);
  // The first draft pass covers the step's verified positions, the others one position each.
  const int64_t h = m.config().hidden_size;
  std::vector<std::vector<int32_t>> dids(static_cast<size_t>(b)), one(static_cast<size_t>(b));
  auto first = steps_of(1 + accepted, model::LogitRows::kLast, dids);
  std::vector<float> hidden;
  for (int64_t s = 0; s < b; ++s)
    hidden.insert(hidden.end(), out.hidden.begin() + s * (1 + k) * h,
                  out.hidden.begin() + (s * (1 + k) + 1 + accepted) * h);
  auto next = steps_of(1, model::LogitRows::kLast, one);
  for (auto& st : next) st.start = context + accepted;
  // Interleaved, so the machine's drift touches the three alike.
  Samples p, v, d;
  for (int r = 0; r < reps; ++r) {
    once(p, [&] { m.forward(plain, cache); });
    once(v, [&] { m.forward(verify, cache); });
    if (k > 0)
      once(d, [&] {
        auto o = m.forward_mtp(first, hidden.data(), cache);
        for (int64_t i = 1; i < k; ++i) m.forward_mtp(next, o.hidden.data(), cache);
      });
  }
  CostCurve c{summary(p), summary(v), k > 0 ? summary(d) : Timed{}};
  return c;
}

// Every measurement runs in a fresh process of this program, so each starts from the same state
// (weights not yet touched, no other thread's OpenMP team waiting on the cores; on two cores a
// team that spins beside a step slows it several times).
std::vector<double> run_child(const std::string& args) {
  // popen's shell would be /proc/self/exe by then: resolve our own path first.
  static const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string cmd = "'" + self + "' " + args;
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) throw Error("cannot run " + cmd);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, f)) out.append(buf, n);
  if (pclose(f) != 0) throw Error(cmd + " failed");
  std::vector<double> v;
  std::istringstream in(out);
  double x;
  while (in >> x) v.push_back(x);
  return v;
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoll(item));
  return out;
}

// Numbers a child prints: a run's figures, or a cost curve's (seconds, then the parts).
void print_timed(const Timed& t) {
  std::printf(" %.9g", t.seconds);
  for (double p : t.parts.seconds) std::printf(" %.9g", p);
}

Timed timed_from(const std::vector<double>& v, size_t at) {
  Timed t;
  t.seconds = v.at(at);
  for (size_t i = 0; i < kParts; ++i) t.parts.seconds[i] = v.at(at + 1 + i);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Speculative decoding with the MTP module: acceptance, speedup, cost curve"};
  std::string model_dir, text_file, batches_s = "1,4,16", ks_s = "0,1,2,3", child;
  int64_t prompt_len = 128, max_tokens = 64, v3_context = 4096, batch = 1, k_child = 0;
  double accepted_child = 0;
  int rounds = 3;
  app.add_option("--model", model_dir, "checkpoint with an MTP module")->required();
  app.add_option("--text", text_file, "held-out text the prompts are cut from")->required();
  app.add_option("--batches", batches_s, "batch sizes");
  app.add_option("--ks", ks_s, "draft tokens per step (0: plain decoding)");
  app.add_option("--prompt", prompt_len, "prompt tokens");
  app.add_option("--max-tokens", max_tokens, "tokens generated per request");
  app.add_option("--rounds", rounds, "rounds (the order of K alternates; medians)");
  app.add_option("--v3-context", v3_context, "context of the DeepSeek-V3 projection");
  app.add_option("--child", child, "internal: run one measurement (engine or cost) and print it");
  app.add_option("--batch", batch, "internal: the child's batch");
  app.add_option("--k", k_child, "internal: the child's K");
  app.add_option("--accepted", accepted_child, "internal: the child's drafts accepted per step");
  CLI11_PARSE(app, argc, argv);
  try {
    auto tok = std::make_shared<const text::Tokenizer>(text::Tokenizer::from_dir(model_dir));
    std::ifstream in(text_file);
    if (!in) throw Error(text_file + ": cannot read");
    std::stringstream text;
    text << in.rdbuf();
    const auto ids = tok->encode(text.str(), false);
    auto prompts_of = [&](int64_t b) {
      if (int64_t(ids.size()) < b * prompt_len)
        throw Error(text_file + ": " + std::to_string(ids.size()) + " tokens, need " +
                    std::to_string(b * prompt_len));
      std::vector<std::vector<int32_t>> p;
      const int64_t stride = int64_t(ids.size()) / b;
      for (int64_t i = 0; i < b; ++i)
        p.emplace_back(ids.begin() + i * stride, ids.begin() + i * stride + prompt_len);
      return p;
    };
    if (!child.empty()) {
      auto m = std::make_shared<model::DeepSeekModel>(model::DeepSeekModel::load(model_dir));
      if (child == "engine") {
        const EngineRun r = run_engine(m, tok, prompts_of(batch), k_child, max_tokens);
        std::printf("%.9g %.9g %.9g %.9g", r.tokens_per_s, r.drafts, r.draft_tokens, r.accepted);
        for (double a : r.accepted_at) std::printf(" %.9g", a);
      } else if (child == "cost") {
        const auto c =
            measure_cost(*m, prompts_of(batch), k_child, std::lround(accepted_child), 15);
        print_timed(c.plain);
        print_timed(c.verify);
        print_timed(c.draft);
      } else {
        throw Error("--child: engine or cost, got '" + child + "'");
      }
      std::printf("\n");
      return 0;
    }
    const auto batches = parse_list(batches_s), ks = parse_list(ks_s);
    if (std::find(ks.begin(), ks.end(), 0) == ks.end())
      throw Error("--ks must include 0 (the plain decoding every speedup is measured against)");
    const model::ModelConfig config = model::ModelConfig::load(model_dir);
    const std::string common = "--model '" + model_dir + "' --text '" + text_file + "' --prompt " +
                               std::to_string(prompt_len) + " --max-tokens " +
                               std::to_string(max_tokens);
    std::printf("model %s: %lld layers, hidden %lld, %lld experts top-%lld, vocab %lld\n",
                model_dir.c_str(), (long long)config.num_hidden_layers,
                (long long)config.hidden_size, (long long)config.n_routed_experts,
                (long long)config.num_experts_per_tok, (long long)config.vocab_size);
    std::printf(
        "greedy, prompts of %lld tokens from %s, %lld tokens each, %d rounds, each run "
        "in a fresh process\n\n",
        (long long)prompt_len, text_file.c_str(), (long long)max_tokens, rounds);

    // 1. The engine.
    std::map<std::pair<int64_t, int64_t>, std::vector<std::vector<double>>> runs;
    for (int r = 0; r < rounds; ++r)
      for (int64_t b : batches) {
        auto order = ks;
        if (r % 2 == 1) std::reverse(order.begin(), order.end());
        for (int64_t k : order)
          runs[{b, k}].push_back(run_child(common + " --child engine --batch " + std::to_string(b) +
                                           " --k " + std::to_string(k)));
      }
    std::printf("%5s %3s %10s %8s %9s  %s\n", "batch", "K", "tok/s", "speedup", "accepted",
                "acceptance by draft position");
    std::map<std::pair<int64_t, int64_t>, double> tok_s, mean_accepted;
    for (int64_t b : batches)
      for (int64_t k : ks) {
        std::vector<double> t;
        double drafts = 0, accepted = 0;
        std::vector<double> at(static_cast<size_t>(k), 0.0);
        for (const auto& x : runs[{b, k}]) {
          t.push_back(x.at(0));
          drafts += x.at(1);
          accepted += x.at(3);
          for (int64_t p = 0; p < k; ++p) at[size_t(p)] += x.at(4 + size_t(p));
        }
        tok_s[{b, k}] = median(t);
        mean_accepted[{b, k}] = drafts > 0 ? accepted / drafts : 0;
        std::printf("%5lld %3lld %10.1f %7.2fx %9.2f ", (long long)b, (long long)k, median(t),
                    median(t) / tok_s[{b, 0}], mean_accepted[{b, k}]);
        for (int64_t p = 0; p < k; ++p)
          std::printf(" %5.1f%%", drafts > 0 ? 100 * at[size_t(p)] / drafts : 0.0);
        std::printf("\n");
      }

    // 2. The cost curve.
    std::printf(
        "\ncost of a step over a plain one (model only, context %lld; medians of 15, "
        "interleaved):\n",
        (long long)prompt_len);
    std::printf("%5s %3s %8s %8s %8s %7s %8s %9s %8s %10s\n", "batch", "K", "plain ms", "verify",
                "draft", "cost", "LM head", "allowed", "measured", "of allowed");
    std::map<int64_t, CostCurve> k1_curve;
    for (int64_t b : batches)
      for (int64_t k : ks) {
        if (k == 0) continue;
        const double acc = mean_accepted[{b, k}];
        const auto v = run_child(common + " --child cost --batch " + std::to_string(b) + " --k " +
                                 std::to_string(k) + " --accepted " + std::to_string(acc));
        CostCurve c{timed_from(v, 0), timed_from(v, 1 + kParts), timed_from(v, 2 * (1 + kParts))};
        if (k == 1) k1_curve[b] = c;
        const double cost = (c.verify.seconds + c.draft.seconds) / c.plain.seconds;
        const double head = (c.verify.parts.seconds[size_t(StepPart::kLmHead)] +
                             c.draft.parts.seconds[size_t(StepPart::kLmHead)]) /
                            (c.verify.seconds + c.draft.seconds);
        const double allowed = (1 + acc) / cost, measured = tok_s[{b, k}] / tok_s[{b, 0}];
        std::printf("%5lld %3lld %8.2f %7.2fx %7.2fx %6.2fx %7.0f%% %8.2fx %7.2fx %9.0f%%\n",
                    (long long)b, (long long)k, 1e3 * c.plain.seconds,
                    c.verify.seconds / c.plain.seconds, c.draft.seconds / c.plain.seconds, cost,
                    100 * head, allowed, measured, 100 * measured / allowed);
      }
    std::printf(
        "(verify: 1 + K tokens per sequence, logits for all; draft: the MTP passes; cost "
        "= (verify + draft) / plain; allowed = (1 + mean accepted) / cost; LM head: its "
        "share of verify + draft)\n");
    // 3. DeepSeek-V3. Its decode steps are bound by the bytes they read (weights and latent
    // cache); this model's are not (its LM head, 129K rows of 128, is compute-bound in the row
    // kernels), so its per-part seconds do not scale. The projection takes V3's bytes per part
    // and what this code path loses beyond its model passes, measured above (measured / allowed).
    std::vector<double> efficiency;
    for (int64_t b : batches)
      if (k1_curve.count(b)) {
        const auto& c = k1_curve[b];
        const double cost = (c.verify.seconds + c.draft.seconds) / c.plain.seconds;
        efficiency.push_back(
            std::min(1.0, tok_s[{b, 1}] / tok_s[{b, 0}] / ((1 + mean_accepted[{b, 1}]) / cost)));
      }
    const double code_path = efficiency.empty() ? 1.0 : median(efficiency);
    const Shape v3 = deepseek_v3();
    const double ctx = double(v3_context);
    std::printf(
        "\nDeepSeek-V3 projection: K = 1, the draft accepted 80%% of the time, FP8 weights, "
        "BF16 latent cache, context %lld; bytes read per step (uniform routing), times "
        "this code path's measured share of what acceptance and cost allow (%.0f%%):\n",
        (long long)v3_context, 100 * code_path);
    std::printf("%5s %9s %9s %9s %7s %10s %10s   %s\n", "batch", "plain GB", "verify GB",
                "draft GB", "cost", "byte-bound", "projected", "verify + draft bytes by part");
    auto total = [](const PartArray& a) {
      double t = 0;
      for (double x : a) t += x;
      return t;
    };
    for (const double b : {1.0, 8.0, 32.0, 128.0}) {
      const PartArray plain = v3.main_bytes(b, 1, ctx), verify = v3.main_bytes(b, 2, ctx),
                      draft = v3.mtp_bytes(b, 1.8, ctx);
      const double cost = (total(verify) + total(draft)) / total(plain);
      std::printf("%5.0f %9.2f %9.2f %9.2f %6.2fx %9.2fx %9.2fx  ", b, total(plain) / 1e9,
                  total(verify) / 1e9, total(draft) / 1e9, cost, 1.8 / cost,
                  1.8 / cost * code_path);
      for (size_t i = 0; i < kParts; ++i)
        if (verify[i] + draft[i] > 0)
          std::printf(" %s %.0f%%", StepProfile::name(static_cast<StepPart>(i)),
                      100 * (verify[i] + draft[i]) / (total(verify) + total(draft)));
      std::printf("\n");
    }
    std::printf(
        "(at batch 1 each token reads its own 8 routed experts per MoE layer, so verifying "
        "two tokens reads nearly twice the routed bytes; from a few dozen sequences the "
        "batch touches most experts anyway and a verify step costs about a plain one)\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem-bench-mtp: %s\n", e.what());
    return 1;
  }
  return 0;
}
