// The cost of constrained decoding per generated token: the token mask of each step, computed by
// walking the vocabulary's trie from the grammar state (cold: a state met for the first time) or
// taken from the per-grammar cache (warm), next to the obvious baseline that matches every token
// of the vocabulary on its own from the same state (the masks of both must be equal). Answers are
// random walks over the masks, as a model with random weights writes them.
// Usage: tandem-bench-structured --tokenizer DIR [--walks N] [--baseline-states N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "structured/matcher.h"
#include "structured/output_spec.h"
#include "structured/token_constraint.h"
#include "text/tokenizer.h"

namespace {

using namespace tandem;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * double(v.size())))];
}

struct Case {
  const char* name;
  structured::OutputSpec spec;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Constrained decoding: token mask cost per step"};
  std::string dir;
  int walks = 20, baseline_states = 8;
  size_t max_tokens = 200;
  app.add_option("--tokenizer", dir, "folder with tokenizer.json")->required();
  app.add_option("--walks", walks, "answers per case");
  app.add_option("--max-tokens", max_tokens, "tokens per answer at most");
  app.add_option("--baseline-states", baseline_states, "states per case matched token by token");
  CLI11_PARSE(app, argc, argv);

  auto tok = std::make_shared<const text::Tokenizer>(text::Tokenizer::from_dir(dir));
  auto t0 = Clock::now();
  structured::MaskVocabulary vocabulary(*tok);
  std::printf("vocabulary: %zu ids, trie of %zu nodes built in %.0f ms\n", vocabulary.size(),
              vocabulary.trie().nodes.size(), ms_since(t0));

  using K = structured::OutputSpec::Kind;
  const std::vector<Case> cases = {
      {"json_schema (object of 4 fields)",
       {K::kJsonSchema,
        R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer"}, "email": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
            "required": ["name", "age", "email"], "additionalProperties": false})",
        "bench"}},
      {"json_object", {K::kJsonObject, "", "bench"}},
      {"regex (ISO date and time)",
       {K::kRegex, R"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?Z)", "bench"}},
  };
  const int32_t eos = tok->eos_id().value_or(0);
  const std::vector<int32_t> ends = {eos};
  std::mt19937 rng(1);
  std::printf("\n%-34s %8s %8s %9s %9s %9s %9s %10s %9s\n", "case", "tokens", "states",
              "cold p50", "cold p99", "warm p50", "per tok", "baseline", "speedup");
  for (const auto& c : cases) {
    structured::StructuredOutputs outputs(tok);
    std::vector<double> cold, warm;
    int64_t tokens = 0, states = 0;
    std::vector<float> logits(tok->vocab_size());
    for (int w = 0; w < walks; ++w) {
      auto constraint = outputs.start(c.spec);
      for (size_t n = 0; n < max_tokens; ++n) {
        std::fill(logits.begin(), logits.end(), 0.0f);
        const int64_t computed = constraint->stats().masks_computed;
        const auto t = Clock::now();
        constraint->mask(logits, ends);
        const double ms = ms_since(t);
        (constraint->stats().masks_computed > computed ? cold : warm).push_back(ms);
        std::vector<int32_t> allowed;
        for (size_t id = 0; id < logits.size(); ++id)
          if (logits[id] == 0.0f) allowed.push_back(static_cast<int32_t>(id));
        int32_t pick = allowed[rng() % allowed.size()];
        if (constraint->complete() && rng() % 2 == 0) pick = eos;
        constraint->accept(pick, ends);
        ++tokens;
        if (pick == eos) break;
      }
    }
    states = static_cast<int64_t>(cold.size());
    double total = 0;
    for (double v : cold) total += v;
    for (double v : warm) total += v;

    // The baseline: every token matched on its own, from states met along one walk.
    const auto grammar = structured::compile(c.spec);
    structured::GrammarMatcher m(grammar);
    std::vector<double> base, trie;
    for (int s = 0; s < baseline_states; ++s) {
      std::vector<uint64_t> by_trie((vocabulary.size() + 63) / 64, 0), by_token(by_trie.size(), 0);
      auto t = Clock::now();
      m.accepted_tokens(vocabulary.trie(), by_trie);
      trie.push_back(ms_since(t));
      t = Clock::now();
      for (size_t id = 0; id < vocabulary.size(); ++id) {
        const std::string& b = vocabulary.bytes(static_cast<int32_t>(id));
        if (b.empty()) continue;
        structured::GrammarMatcher copy = m;
        if (copy.advance(b)) by_token[id / 64] |= uint64_t(1) << (id % 64);
      }
      base.push_back(ms_since(t));
      if (by_trie != by_token) {
        std::fprintf(stderr, "%s: the trie's mask differs from the token-by-token one\n", c.name);
        return 1;
      }
      std::vector<int32_t> allowed;
      for (size_t id = 0; id < vocabulary.size(); ++id)
        if ((by_trie[id / 64] >> (id % 64)) & 1) allowed.push_back(static_cast<int32_t>(id));
      if (allowed.empty()) break;
      m.advance(vocabulary.bytes(allowed[rng() % allowed.size()]));
    }
    std::printf("%-34s %8lld %8lld %7.2fms %7.2fms %7.3fms %7.3fms %8.1fms %8.0fx\n", c.name,
                static_cast<long long>(tokens), static_cast<long long>(states),
                percentile(cold, 0.5), percentile(cold, 0.99), percentile(warm, 0.5),
                total / double(std::max<int64_t>(tokens, 1)), percentile(base, 0.5),
                percentile(base, 0.5) / std::max(percentile(trie, 0.5), 1e-9));
  }
  std::printf(
      "\ncold: a state met for the first time (trie walk); warm: a cached mask, applied to the "
      "logits;\nper tok: all mask time over all tokens; baseline: every token matched on its own "
      "(median state),\nspeedup: baseline over the trie walk on the same states (masks equal).\n");
  return 0;
}
