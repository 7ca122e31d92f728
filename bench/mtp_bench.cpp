// Speculative decoding with the MTP module (run by bench/mtp.sh on the trained checkpoint):
//  1. the serving engine in process, greedy, prompts cut from held-out text: decode tokens/s and
//     the acceptance per draft position for each batch size and K draft tokens, K = 0 (plain) in
//     the same run, rounds alternating the order of K; the speedup is K's rate over the plain
//     run of the same round, medians over rounds;
//  2. the cost curve, measured in each round beside the engine runs: a verify step (1 + K query
//     tokens per sequence) plus the draft passes over a plain step, split into the model's parts
//     (the draft pass re-reads the LM head), and the speedup the round's acceptance and cost
//     allow, (1 + accepted) / cost, next to the measured one;
//  3. a projection to DeepSeek-V3's shape (61 layers, 58 MoE, one MTP layer, FP8 weights, BF16
//     latent cache) at 80% acceptance of one draft: the bytes each part of a plain step, a
//     verify step and the draft pass reads there, times the share of the allowed speedup this
//     code path keeps here.
// Usage: tandem-bench-mtp --model DIR --text FILE [--batches 1,4,16] [--ks 0,1,2,3]
//        [--prompt 128] [--max-tokens 64] [--rounds 5] [--v3-context 4096]
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
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
  // Shares of the decode window spent in the executor's steps, and in the model's timed parts.
  double execute_share = 0, model_share = 0;
};

double metric(const std::string& text, const std::string& name, const std::string& labels = {}) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(name + "{", 0) == 0 && line.find(labels) != std::string::npos)
      return std::stod(line.substr(line.rfind(' ') + 1));
  return 0;
}

// Decode tokens/s while the whole batch decodes: the tokens of the steps after the one that gave
// the last request its first token, up to the step in which the first request finished, over the
// time between those steps' outputs. With drafts, requests finish at different steps; the steps
// after the first finish run a smaller batch than the cost curve measures (and, on this model,
// cost nearly as much), which is the closed benchmark's tail, not the code path.
// The CPU executor, timed: the seconds its steps took (forward passes, sampling, drafts), which
// the engine's decode time is compared to.
class TimedExecutor final : public engine::Executor {
 public:
  explicit TimedExecutor(std::unique_ptr<engine::Executor> inner) : inner_(std::move(inner)) {}
  const engine::ExecutorInfo& info() const override { return inner_->info(); }
  engine::ExecResult execute(std::span<const engine::ExecItem> batch,
                             const engine::LayerHook& on_layer) override {
    const auto start = Clock::now();
    auto r = inner_->execute(batch, on_layer);
    seconds_ += seconds_since(start);
    return r;
  }
  const std::byte* kv_bytes(int32_t block, int64_t layer) const override {
    return inner_->kv_bytes(block, layer);
  }
  void write_kv(int32_t block, int64_t layer, std::span<const std::byte> bytes) override {
    inner_->write_kv(block, layer, bytes);
  }
  // Engine thread.
  double seconds() const { return seconds_; }

 private:
  std::unique_ptr<engine::Executor> inner_;
  double seconds_ = 0;
};

EngineRun run_engine(std::shared_ptr<model::DeepSeekModel> m,
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
  auto timed =
      std::make_unique<TimedExecutor>(std::make_unique<engine::CpuExecutor>(m, *tok, "bench", o));
  TimedExecutor* executor = timed.get();
  model::StepProfile profile;
  m->set_profile(&profile);
  engine::Engine engine(config, std::move(timed), tok, engine::eos_ids(*tok, {}), registry);
  engine.start();
  struct Arrival {
    Clock::time_point at;
    size_t tokens;
    uint64_t step;              // the engine's steps before the one that produced it
    double execute_s, model_s;  // the executor's and the model's seconds so far
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
        // Outputs come on the engine thread after their step, before it counts the step.
        arrivals[size_t(i)].push_back({Clock::now(), out.tokens.size(), engine.load().steps,
                                       executor->seconds(), profile.total()});
      }
      if (out.finished) done[size_t(i)].set_value();
    };
    engine.submit(std::move(r));
  }
  for (auto& d : done) d.get_future().wait();
  engine.stop();
  uint64_t first_step = 0, last_step = std::numeric_limits<uint64_t>::max();
  for (const auto& a : arrivals) {
    first_step = std::max(first_step, a.front().step);
    last_step = std::min(last_step, a.back().step);
  }
  if (last_step <= first_step) throw Error("the batch never decoded together");
  // Each window edge at the last output of its step.
  Clock::time_point t0 = Clock::time_point::min(), end = Clock::time_point::min();
  double execute0 = 0, execute1 = 0, model0 = 0, model1 = 0;
  size_t tokens = 0;
  for (const auto& a : arrivals)
    for (const auto& x : a) {
      if (x.step == first_step) t0 = std::max(t0, x.at), execute0 = x.execute_s, model0 = x.model_s;
      if (x.step == last_step)
        end = std::max(end, x.at), execute1 = x.execute_s, model1 = x.model_s;
      if (x.step > first_step && x.step <= last_step) tokens += x.tokens;
    }
  EngineRun r;
  const double window = std::chrono::duration<double>(end - t0).count();
  r.tokens_per_s = double(tokens) / window;
  r.execute_share = (execute1 - execute0) / window;
  r.model_share = (model1 - model0) / window;
  m->set_profile(nullptr);
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

// `texts`: per sequence, held-out text of at least context + k + 2 tokens; its first context - 1
// fill the cache and the next ones are the step's tokens, so that the 1 + k tokens a verify step
// routes are distinct, as a real continuation's are (a repeated token would route every row to
// the same experts).
CostCurve measure_cost(model::DeepSeekModel& m, const std::vector<std::vector<int32_t>>& texts,
                       int64_t context, int64_t k, int64_t accepted, int reps) {
  const auto b = static_cast<int64_t>(texts.size());
  const int64_t bs = 16;
  for (const auto& t : texts)
    if (int64_t(t.size()) < context + k + 2) throw Error("measure_cost: a text is too short");
  const int64_t per_seq = (context + 2 * k + 8 + bs - 1) / bs;
  model::LatentCache cache(m.cache_shape(bs), b * per_seq);
  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(b));
  for (int64_t s = 0; s < b; ++s)
    for (int64_t i = 0; i < per_seq; ++i) tables[size_t(s)].push_back(int32_t(s * per_seq + i));
  {
    std::vector<model::SequenceStep> fill;
    for (int64_t s = 0; s < b; ++s)
      fill.push_back({std::span(texts[size_t(s)]).first(size_t(context - 1)), 0, tables[size_t(s)],
                      model::LogitRows::kNone});
    m.forward(fill, cache);
  }
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
  // The median run, split in the parts' shares of all runs (a mean part over a median total
  // would show shares above 100% when a few runs are slow).
  auto summary = [&](const Samples& x) {
    Timed t{median(x.seconds), {}};
    double total = 0;
    for (double s : x.seconds) total += s;
    for (size_t i = 0; i < kParts; ++i) t.parts.seconds[i] = x.parts.seconds[i] / total * t.seconds;
    return t;
  };
  // q tokens of each text from `from`, at positions from `at`.
  auto steps_of = [&](int64_t from, int64_t q, int64_t at, model::LogitRows rows) {
    std::vector<model::SequenceStep> steps;
    for (int64_t s = 0; s < b; ++s)
      steps.push_back({std::span(texts[size_t(s)]).subspan(size_t(from), size_t(q)), at,
                       tables[size_t(s)], rows});
    return steps;
  };
  const auto plain = steps_of(context - 1, 1, context - 1, model::LogitRows::kLast);
  const auto verify = steps_of(context - 1, 1 + k, context - 1, model::LogitRows::kAll);
  model::StepOutput out = m.forward(verify, cache);
  // The first draft pass covers the step's verified positions, fed the token after each; the
  // others one position each.
  const int64_t h = m.config().hidden_size;
  const auto first = steps_of(context, 1 + accepted, context - 1, model::LogitRows::kLast);
  std::vector<float> hidden;
  for (int64_t s = 0; s < b; ++s)
    hidden.insert(hidden.end(), out.hidden.begin() + s * (1 + k) * h,
                  out.hidden.begin() + (s * (1 + k) + 1 + accepted) * h);
  const auto next =
      steps_of(context + accepted + 1, 1, context + accepted, model::LogitRows::kLast);
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

// Each batch size runs in a fresh process of this program (--child-batch), so each starts from
// the same state: no other thread's OpenMP team waiting on the cores (on two cores a team that
// spins beside a step slows it several times). Within it every run of the engine is paired with
// the plain run and the cost curve of its own round: this VM's speed drifts by 20% between
// processes minutes apart, which ratios of separate processes' medians did not survive.
std::vector<std::string> run_child(const std::string& args) {
  // popen's shell would be /proc/self/exe by then: resolve our own path first.
  static const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string cmd = "'" + self + "' " + args;
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) throw Error("cannot run " + cmd);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, f)) out.append(buf, n);
  if (pclose(f) != 0) throw Error(cmd + " failed");
  std::vector<std::string> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(line);
  return lines;
}

// The numbers of a child's line after its tag.
std::vector<double> numbers(const std::string& line) {
  std::istringstream in(line);
  std::string tag;
  in >> tag;
  std::vector<double> v;
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
  std::string model_dir, text_file, batches_s = "1,4,16", ks_s = "0,1,2,3";
  int64_t prompt_len = 128, max_tokens = 64, v3_context = 4096, child_batch = 0;
  int rounds = 5;
  app.add_option("--model", model_dir, "checkpoint with an MTP module")->required();
  app.add_option("--text", text_file, "held-out text the prompts are cut from")->required();
  app.add_option("--batches", batches_s, "batch sizes");
  app.add_option("--ks", ks_s, "draft tokens per step (0: plain decoding)");
  app.add_option("--prompt", prompt_len, "prompt tokens");
  app.add_option("--max-tokens", max_tokens, "tokens generated per request");
  app.add_option("--rounds", rounds, "rounds (the order of K alternates; medians)");
  app.add_option("--v3-context", v3_context, "context of the DeepSeek-V3 projection");
  app.add_option("--child-batch", child_batch,
                 "internal: measure this batch size (every K, all rounds) and print the rounds");
  CLI11_PARSE(app, argc, argv);
  try {
    auto tok = std::make_shared<const text::Tokenizer>(text::Tokenizer::from_dir(model_dir));
    std::ifstream in(text_file);
    if (!in) throw Error(text_file + ": cannot read");
    std::stringstream text;
    text << in.rdbuf();
    const auto ids = tok->encode(text.str(), false);
    // b pieces of the text of `len` tokens, spread over it.
    auto texts_of = [&](int64_t b, int64_t len) {
      if (int64_t(ids.size()) < b * len)
        throw Error(text_file + ": " + std::to_string(ids.size()) + " tokens, need " +
                    std::to_string(b * len));
      std::vector<std::vector<int32_t>> p;
      const int64_t stride = int64_t(ids.size()) / b;
      for (int64_t i = 0; i < b; ++i)
        p.emplace_back(ids.begin() + i * stride, ids.begin() + i * stride + len);
      return p;
    };
    const auto batches = parse_list(batches_s), ks = parse_list(ks_s);
    if (std::find(ks.begin(), ks.end(), 0) == ks.end())
      throw Error("--ks must include 0 (the plain decoding every speedup is measured against)");
    if (child_batch > 0) {
      // One batch size, every K, `rounds` rounds in this process: the engine runs (the order of
      // K alternating), then the cost curve for each K at the acceptance just measured. A run
      // and its plain twin, and the cost that judges them, are minutes apart at most, so the
      // machine's drift touches them alike.
      auto m = std::make_shared<model::DeepSeekModel>(model::DeepSeekModel::load(model_dir));
      const auto prompts = texts_of(child_batch, prompt_len);
      run_engine(m, tok, prompts, 0, max_tokens);  // warm-up: weights and caches touched once
      // At the middle of the decode the engine runs (prompt + half the generated tokens).
      const int64_t context = prompt_len + max_tokens / 2;
      for (int r = 0; r < rounds; ++r) {
        auto order = ks;
        if (r % 2 == 1) std::reverse(order.begin(), order.end());
        std::map<int64_t, double> accepted;
        for (int64_t k : order) {
          const EngineRun e = run_engine(m, tok, prompts, k, max_tokens);
          accepted[k] = e.drafts > 0 ? e.accepted / e.drafts : 0;
          std::printf("engine %d %lld %.9g %.9g %.9g %.9g %.9g %.9g", r, (long long)k,
                      e.tokens_per_s, e.drafts, e.draft_tokens, e.accepted, e.execute_share,
                      e.model_share);
          for (double a : e.accepted_at) std::printf(" %.9g", a);
          std::printf("\n");
        }
        for (int64_t k : ks) {
          if (k == 0) continue;
          const auto c = measure_cost(*m, texts_of(child_batch, context + k + 2), context, k,
                                      std::lround(accepted[k]), 5);
          std::printf("cost %d %lld", r, (long long)k);
          print_timed(c.plain);
          print_timed(c.verify);
          print_timed(c.draft);
          std::printf("\n");
        }
        std::fflush(stdout);
      }
      return 0;
    }
    const model::ModelConfig config = model::ModelConfig::load(model_dir);
    const std::string common = "--model '" + model_dir + "' --text '" + text_file + "' --prompt " +
                               std::to_string(prompt_len) + " --max-tokens " +
                               std::to_string(max_tokens) + " --ks " + ks_s + " --rounds " +
                               std::to_string(rounds);
    std::printf("model %s: %lld layers, hidden %lld, %lld experts top-%lld, vocab %lld\n",
                model_dir.c_str(), (long long)config.num_hidden_layers,
                (long long)config.hidden_size, (long long)config.n_routed_experts,
                (long long)config.num_experts_per_tok, (long long)config.vocab_size);
    std::printf(
        "greedy, prompts of %lld tokens from %s, %lld tokens each; per batch size one fresh "
        "process runs %d rounds of every K and its cost curve; medians over rounds\n\n",
        (long long)prompt_len, text_file.c_str(), (long long)max_tokens, rounds);

    // Every batch size's rounds.
    struct Round {
      std::map<int64_t, std::vector<double>> engine;  // by K
      std::map<int64_t, CostCurve> cost;              // by K > 0
    };
    std::map<int64_t, std::vector<Round>> by_batch;
    for (int64_t b : batches) {
      std::vector<Round> rs(static_cast<size_t>(rounds));
      for (const std::string& line : run_child(common + " --child-batch " + std::to_string(b))) {
        const std::vector<double> v = numbers(line);
        const auto r = static_cast<size_t>(v.at(0));
        const auto k = static_cast<int64_t>(v.at(1));
        if (line.rfind("engine ", 0) == 0)
          rs.at(r).engine[k].assign(v.begin() + 2, v.end());
        else if (line.rfind("cost ", 0) == 0)
          rs.at(r).cost[k] = {timed_from(v, 2), timed_from(v, 2 + 1 + kParts),
                              timed_from(v, 2 + 2 * (1 + kParts))};
      }
      by_batch[b] = std::move(rs);
    }

    // 1. The engine.
    std::printf("%5s %3s %10s %8s %8s %9s  %s\n", "batch", "K", "tok/s", "speedup", "model",
                "accepted", "acceptance by draft position");
    std::map<std::pair<int64_t, int64_t>, double> mean_accepted;
    for (int64_t b : batches)
      for (int64_t k : ks) {
        std::vector<double> t, speedup, model;
        double drafts = 0, accepted = 0;
        std::vector<double> at(static_cast<size_t>(k), 0.0);
        for (const Round& r : by_batch[b]) {
          const auto& x = r.engine.at(k);
          t.push_back(x.at(0));
          speedup.push_back(x.at(0) / r.engine.at(0).at(0));
          model.push_back(x.at(5));
          drafts += x.at(1);
          accepted += x.at(3);
          for (int64_t p = 0; p < k; ++p) at[size_t(p)] += x.at(6 + size_t(p));
        }
        mean_accepted[{b, k}] = drafts > 0 ? accepted / drafts : 0;
        std::printf("%5lld %3lld %10.1f %7.2fx %7.0f%% %9.2f ", (long long)b, (long long)k,
                    median(t), median(speedup), 100 * median(model), mean_accepted[{b, k}]);
        for (int64_t p = 0; p < k; ++p)
          std::printf(" %5.1f%%", drafts > 0 ? 100 * at[size_t(p)] / drafts : 0.0);
        std::printf("\n");
      }

    // 2. The cost curve, and what the engine kept of what it allows, round by round.
    std::printf(
        "(speedup: the median over rounds of K's tok/s over the plain run of the same round; "
        "model: the share of the decode time in the model's timed passes, the rest being the "
        "engine, sampling and drafting around them)\n"
        "\ncost of a step over a plain one (model only, context %lld, the middle of the decode; "
        "5 interleaved repetitions a round, medians over rounds):\n",
        (long long)(prompt_len + max_tokens / 2));
    std::printf("%5s %3s %8s %8s %8s %7s %8s %9s %8s %10s\n", "batch", "K", "plain ms", "verify",
                "draft", "cost", "LM head", "allowed", "measured", "of allowed");
    std::map<int64_t, double> k1_kept;  // batch -> median share of the allowed speedup, K = 1
    for (int64_t b : batches)
      for (int64_t k : ks) {
        if (k == 0) continue;
        std::vector<double> plain, verify, draft, cost, head, allowed, measured, kept;
        for (const Round& r : by_batch[b]) {
          const CostCurve& c = r.cost.at(k);
          const double x = (c.verify.seconds + c.draft.seconds) / c.plain.seconds;
          const auto& e = r.engine.at(k);
          const double acc = e.at(1) > 0 ? e.at(3) / e.at(1) : 0;
          const double s = e.at(0) / r.engine.at(0).at(0);
          plain.push_back(c.plain.seconds);
          verify.push_back(c.verify.seconds / c.plain.seconds);
          draft.push_back(c.draft.seconds / c.plain.seconds);
          cost.push_back(x);
          head.push_back((c.verify.parts.seconds[size_t(StepPart::kLmHead)] +
                          c.draft.parts.seconds[size_t(StepPart::kLmHead)]) /
                         (c.verify.seconds + c.draft.seconds));
          allowed.push_back((1 + acc) / x);
          measured.push_back(s);
          kept.push_back(s / ((1 + acc) / x));
        }
        if (k == 1) k1_kept[b] = median(kept);
        std::printf("%5lld %3lld %8.2f %7.2fx %7.2fx %6.2fx %7.0f%% %8.2fx %7.2fx %9.0f%%\n",
                    (long long)b, (long long)k, 1e3 * median(plain), median(verify), median(draft),
                    median(cost), 100 * median(head), median(allowed), median(measured),
                    100 * median(kept));
      }
    std::printf(
        "(verify: 1 + K tokens per sequence, logits for all; draft: the MTP passes; cost "
        "= (verify + draft) / plain; allowed = (1 + mean accepted) / cost; LM head: its "
        "share of verify + draft; of allowed: measured / allowed, per round)\n");
    // 3. DeepSeek-V3. Its decode steps are bound by the bytes they read (weights and latent
    // cache); this model's are not (its LM head, 129K rows of 128, is compute-bound in the row
    // kernels), so its per-part seconds do not scale. The projection takes V3's bytes per part
    // and what this code path loses beyond its model passes, measured above (measured / allowed).
    std::vector<double> efficiency;
    for (const auto& [b, kept] : k1_kept) efficiency.push_back(std::min(1.0, kept));
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
