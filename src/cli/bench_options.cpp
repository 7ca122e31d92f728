#include "cli/bench_options.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "bench/arrivals.h"
#include "cli/model_commands.h"
#include "util/error.h"

namespace tandem::cli {

using nlohmann::json;

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, sep);)
    if (!part.empty()) out.push_back(part);
  return out;
}

void add_workload_options(CLI::App& cmd, WorkloadCliOptions& o) {
  cmd.add_option("--dataset-name", o.dataset,
                 "random, prefix-repetition, sharegpt, mooncake or azure")
      ->capture_default_str();
  cmd.add_option("--dataset-path", o.dataset_path, "ShareGPT JSON, Mooncake JSONL or Azure CSV");
  cmd.add_option("--tokenizer", o.tokenizer,
                 "folder with tokenizer.json (default: the DeepSeek-V3 tokenizer)");
  cmd.add_option("--num-prompts", o.num_prompts, "requests (synthetic datasets, ShareGPT)")
      ->capture_default_str();
  cmd.add_option("--random-input-len", o.random_input_len)->capture_default_str();
  cmd.add_option("--random-output-len", o.random_output_len)->capture_default_str();
  cmd.add_option("--random-range-ratio", o.random_range_ratio)->capture_default_str();
  cmd.add_option("--prefix-repetition-prefix-len", o.prefix_len)->capture_default_str();
  cmd.add_option("--prefix-repetition-suffix-len", o.suffix_len)->capture_default_str();
  cmd.add_option("--prefix-repetition-num-prefixes", o.num_prefixes)->capture_default_str();
  cmd.add_option("--prefix-repetition-output-len", o.prefix_output_len)->capture_default_str();
  cmd.add_option("--trace-start", o.trace_start, "traces: the first record to replay")
      ->capture_default_str();
  cmd.add_option("--trace-limit", o.trace_limit, "traces: records to replay (0: all)")
      ->capture_default_str();
  cmd.add_option("--time-scale", o.time_scale,
                 "traces: multiply timestamps (0.5 replays twice as fast)")
      ->capture_default_str();
  cmd.add_flag("--trace-spread", o.trace_spread,
               "mooncake: the records sharing a timestamp (the trace rounds them to 3 s) arrive at "
               "random times (--seed) up to the next one, not all at once");
  cmd.add_option("--request-rate", o.request_rate,
                 "requests/s (Poisson or gamma); default inf (all at once; traces: their "
                 "timestamps)");
  cmd.add_option("--burstiness", o.burstiness, "gamma shape of the gaps (1: Poisson)")
      ->capture_default_str();
  cmd.add_option("--seed", o.seed)->capture_default_str();
}

std::string workload_tokenizer_dir(const WorkloadCliOptions& o) {
  return o.tokenizer.empty() ? default_tokenizer().string() : o.tokenizer;
}

namespace {

// --trace-spread: for the Mooncake trace's own arrivals only (a rate replaces them).
void check_trace_spread(const WorkloadCliOptions& o) {
  if (!o.trace_spread) return;
  if (o.dataset != "mooncake")
    throw Error("--trace-spread applies to --dataset-name mooncake, not " + o.dataset);
  if (std::isfinite(o.request_rate))
    throw Error(
        "--trace-spread spreads the trace's own arrivals, which --request-rate replaces: give "
        "one of the two");
}

// The rate-driven arrivals the flags ask for (--request-rate, --burstiness, --seed).
bench::ArrivalOptions arrival_options(const WorkloadCliOptions& o) {
  bench::ArrivalOptions a;
  a.request_rate = o.request_rate;
  a.burstiness = o.burstiness;
  a.seed = o.seed;
  return a;
}

}  // namespace

bench::LazyWorkload build_lazy_workload(const WorkloadCliOptions& o, const text::Tokenizer& tok) {
  check_trace_spread(o);
  if (o.dataset != "mooncake" || o.dataset_path.empty()) return bench::lazy(build_workload(o, tok));
  // A Mooncake trace is its records (a few hash ids each) until a request is sent.
  bench::MooncakeOptions m;
  m.path = o.dataset_path;
  m.window = {o.trace_start, o.trace_limit, o.time_scale};
  m.seed = o.seed;
  m.spread = o.trace_spread;
  auto records = std::make_shared<const std::vector<bench::MooncakeRecord>>(
      bench::read_mooncake_trace(m.path, m.window, m.block_size));
  bench::LazyWorkload w;
  w.arrival_s = std::isfinite(o.request_rate)
                    ? bench::rate_arrivals(records->size(), arrival_options(o))
                    : bench::mooncake_arrivals(*records, o.time_scale, m.spread, m.seed);
  auto vocab = std::make_shared<const bench::TokenVocab>(bench::TokenVocab::build(tok));
  w.make = [records, vocab, m, arrivals = w.arrival_s](size_t i) {
    bench::BenchRequest r;
    r.arrival_s = arrivals.at(i);
    r.prompt_ids = bench::mooncake_prompt(*vocab, records->at(i), m.block_size, m.seed);
    r.output_len = records->at(i).output_length;
    return r;
  };
  return w;
}

std::vector<bench::BenchRequest> build_workload(const WorkloadCliOptions& o,
                                                const text::Tokenizer& tok) {
  const auto vocab = bench::TokenVocab::build(tok);
  if ((o.trace() || o.dataset == "sharegpt") && o.dataset_path.empty())
    throw Error("--dataset-name " + o.dataset + " needs --dataset-path");
  check_trace_spread(o);
  bench::TraceWindow window;
  window.start = o.trace_start;
  window.limit = o.trace_limit;
  window.time_scale = o.time_scale;
  std::vector<bench::BenchRequest> reqs;
  if (o.dataset == "random") {
    bench::RandomOptions r;
    r.num_requests = o.num_prompts;
    r.input_len = o.random_input_len;
    r.output_len = o.random_output_len;
    r.range_ratio = o.random_range_ratio;
    r.num_special_tokens = tok.bos_id() ? 1 : 0;
    r.seed = o.seed;
    reqs = bench::random_workload(vocab, r);
  } else if (o.dataset == "prefix-repetition") {
    bench::PrefixRepetitionOptions p;
    p.num_requests = o.num_prompts;
    p.prefix_len = o.prefix_len;
    p.suffix_len = o.suffix_len;
    p.num_prefixes = o.num_prefixes;
    p.output_len = o.prefix_output_len;
    p.seed = o.seed;
    reqs = bench::prefix_repetition_workload(vocab, p);
  } else if (o.dataset == "sharegpt") {
    bench::ShareGptOptions s;
    s.path = o.dataset_path;
    s.num_requests = o.num_prompts;
    s.seed = o.seed;
    reqs = bench::sharegpt_workload(tok, s);
  } else if (o.dataset == "mooncake") {
    bench::MooncakeOptions m;
    m.path = o.dataset_path;
    m.window = window;
    m.seed = o.seed;
    m.spread = o.trace_spread;
    reqs = bench::mooncake_workload(vocab, m);
  } else if (o.dataset == "azure") {
    bench::AzureOptions a;
    a.path = o.dataset_path;
    a.window = window;
    a.seed = o.seed;
    reqs = bench::azure_workload(vocab, a);
  } else {
    throw Error(
        "--dataset-name: expected random, prefix-repetition, sharegpt, mooncake or azure, "
        "got '" +
        o.dataset + "'");
  }
  // Traces keep their own timestamps unless a rate is given; the others follow the rate.
  if (!o.trace() || std::isfinite(o.request_rate))
    bench::apply_arrivals(reqs, bench::rate_arrivals(reqs.size(), arrival_options(o)));
  return reqs;
}

void add_metrics_options(CLI::App& cmd, MetricsCliOptions& o) {
  cmd.add_option("--percentile-metrics", o.percentile_metrics,
                 "comma list of ttft, tpot, itl, e2el, tbt")
      ->capture_default_str();
  cmd.add_option("--metric-percentiles", o.metric_percentiles, "comma list, e.g. 50,90,99")
      ->capture_default_str();
  cmd.add_option("--goodput", o.goodput, "SLO KEY:MS (ttft, tpot, e2el, tbt); repeatable");
}

bench::MetricsOptions metrics_options(const MetricsCliOptions& o) {
  bench::MetricsOptions m;
  m.percentile_metrics = split(o.percentile_metrics, ',');
  m.percentiles.clear();
  for (const auto& p : split(o.metric_percentiles, ',')) {
    try {
      m.percentiles.push_back(std::stod(p));
    } catch (const std::exception&) {
      throw Error("--metric-percentiles: '" + p + "' is not a number");
    }
  }
  for (const auto& g : o.goodput) {
    const auto colon = g.find(':');
    double ms = 0;
    if (colon != std::string::npos) {
      try {
        ms = std::stod(g.substr(colon + 1));
      } catch (const std::exception&) {
        ms = 0;
      }
    }
    const std::string key = g.substr(0, colon);
    if (colon == std::string::npos || ms <= 0)
      throw Error("--goodput: expected KEY:MS with KEY ttft, tpot, e2el or tbt, got '" + g + "'");
    if (key == "ttft")
      m.goodput_ttft_ms = ms;
    else if (key == "tpot")
      m.goodput_tpot_ms = ms;
    else if (key == "e2el")
      m.goodput_e2el_ms = ms;
    else if (key == "tbt")
      m.goodput_tbt_ms = ms;
    else
      throw Error("--goodput: unknown metric '" + key + "' (ttft, tpot, e2el, tbt)");
  }
  return m;
}

void write_run(const bench::BenchSummary& summary, std::span<const bench::RequestResult> results,
               const RunDescription& run, const RunOutputs& outputs, const char* program) {
  std::string table = bench::summary_table(summary, run.report.table);
  json out = bench::to_json(summary, results);
  if (run.prefix_cache_hit_rate) {
    out["prefix_cache_hit_rate"] = *run.prefix_cache_hit_rate;
    char line[96];
    std::snprintf(line, sizeof line, "%-40s%-10.2f\n",
                  "Prefix cache hit rate (%):", *run.prefix_cache_hit_rate * 100);
    table += line;
  }
  for (const auto& [key, value] : run.extra.items()) out[key] = value;
  std::fputs(table.c_str(), stdout);
  std::fflush(stdout);
  if (!outputs.html.empty()) {
    std::ofstream f(outputs.html);
    if (!f) throw Error("--html: cannot write " + outputs.html);
    f << bench::html_report(summary, results, run.report);
    std::fprintf(stderr, "%s: report in %s\n", program, outputs.html.c_str());
  }
  if (!outputs.result_file.empty()) {
    std::ofstream f(outputs.result_file);
    if (!f) throw Error("--result-file: cannot write " + outputs.result_file);
    f << out.dump(2) << "\n";
    std::fprintf(stderr, "%s: results in %s\n", program, outputs.result_file.c_str());
  }
}

}  // namespace tandem::cli
