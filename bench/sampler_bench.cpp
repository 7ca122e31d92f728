// The cost of drawing one token over a DeepSeek-sized vocabulary (129,280 ids), per sampling
// setting, next to the obvious baseline: the whole vocabulary sorted by logit when a filter
// needs the order (top-k: its k best), then std::discrete_distribution over the kept probabilities
// (what the sampler did before its keyed race and partial top-p sort). Rounds alternate the two and
// the medians are printed; the logits are a fixed random draw (normal, sd 3), as sharp as a
// model's. Usage: tandem-bench-sampler [--rounds N] [--draws N]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>

#include "engine/sampler.h"

namespace {

using namespace tandem;
using Clock = std::chrono::steady_clock;

constexpr int64_t kVocab = 129'280;

// The baseline: temperature, a whole sort for top-k/top-p, softmax, then a streamed draw.
int32_t baseline_draw(std::vector<float> logits, const engine::SamplingParams& p,
                      std::mt19937_64& rng) {
  for (auto& l : logits) l /= static_cast<float>(p.temperature);
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  };
  if (p.top_k > 0)
    std::partial_sort(order.begin(), order.begin() + p.top_k, order.end(), by_logit);
  else if (p.top_p < 1.0)
    std::sort(order.begin(), order.end(), by_logit);
  if (p.top_k > 0) order.resize(size_t(p.top_k));
  const float top = logits[size_t(*std::max_element(
      order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] < logits[b]; }))];
  std::vector<double> probs(order.size());
  double sum = 0;
  for (size_t i = 0; i < order.size(); ++i) sum += probs[i] = std::exp(logits[order[i]] - top);
  size_t keep = order.size();
  if (p.top_p < 1.0) {
    double mass = 0;
    size_t cut = 0;
    while (cut < keep && mass < p.top_p * sum) mass += probs[cut++];
    keep = std::max<size_t>(cut, 1);
  }
  std::discrete_distribution<size_t> pick(probs.begin(), probs.begin() + int64_t(keep));
  return order[pick(rng)];
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Cost of one sampled token over a 129k vocabulary, next to a sort+CDF baseline"};
  int rounds = 5, draws = 100;
  app.add_option("--rounds", rounds, "alternating rounds (medians)")->check(CLI::Range(1, 1000));
  app.add_option("--draws", draws, "tokens per round and setting")->check(CLI::Range(1, 100000));
  CLI11_PARSE(app, argc, argv);

  std::mt19937 gen(1);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(kVocab);
  for (auto& l : logits) l = normal(gen);

  struct Setting {
    const char* name;
    engine::SamplingParams params;
  };
  std::vector<Setting> settings(3);
  settings[0].name = "temperature 0.7";
  settings[0].params.temperature = 0.7;
  settings[1].name = "temperature 0.7, top_p 0.95";
  settings[1].params.temperature = 0.7;
  settings[1].params.top_p = 0.95;
  settings[2].name = "temperature 0.7, top_k 50";
  settings[2].params.temperature = 0.7;
  settings[2].params.top_k = 50;

  std::printf("%-30s %12s %12s %8s\n", "setting", "tandem_ms", "baseline_ms", "speedup");
  for (const auto& s : settings) {
    std::vector<double> ours, base;
    std::mt19937_64 rng(7);
    for (int r = 0; r < rounds; ++r) {
      engine::Sampler sampler(s.params, uint64_t(r));
      std::vector<int32_t> output;
      auto t0 = Clock::now();
      for (int i = 0; i < draws; ++i) {
        auto l = logits;
        output.push_back(sampler.sample(l, {}, output));
      }
      ours.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / draws);
      t0 = Clock::now();
      int64_t sink = 0;
      for (int i = 0; i < draws; ++i) sink += baseline_draw(logits, s.params, rng);
      base.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / draws);
      if (sink < 0) std::printf("unreachable\n");
    }
    std::printf("%-30s %12.3f %12.3f %7.1fx\n", s.name, median(ours), median(base),
                median(base) / median(ours));
  }
  return 0;
}
