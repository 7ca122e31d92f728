#include "cli/bench_command.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>

#include <nlohmann/json.hpp>

#include "bench/arrivals.h"
#include "bench/driver.h"
#include "bench/metrics.h"
#include "bench/report.h"
#include "bench/workload.h"
#include "cli/model_commands.h"
#include "gateway/topology.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/progress.h"

namespace tandem::cli {
namespace {

using nlohmann::json;

struct BenchCliOptions {
  std::string base_url = "http://127.0.0.1:8000", endpoint = "/v1/completions", model,
              dataset = "random", dataset_path, tokenizer, prompt_format = "ids", result_file, html,
              access_log, api_key, percentile_metrics = "ttft,tpot,itl", metric_percentiles = "99";
  std::vector<std::string> goodput, metrics_urls;
  int64_t num_prompts = 1000, random_input_len = 1024, random_output_len = 128;
  double random_range_ratio = 0;
  int64_t prefix_len = 256, suffix_len = 256, num_prefixes = 10, prefix_output_len = 128;
  int64_t trace_start = 0, trace_limit = 0;
  double time_scale = 1.0, request_rate = std::numeric_limits<double>::infinity(), burstiness = 1.0,
         timeout = 600;
  int64_t max_concurrency = 0;
  uint64_t seed = 0;
  bool no_ignore_eos = false, no_progress = false;
};

// "http://HOST:PORT" into host and port: the gateway's endpoint syntax, one parser for both.
std::pair<std::string, uint16_t> split_url(const std::string& url) {
  const gateway::Endpoint e = gateway::parse_endpoint(url);
  return {e.host, e.port};
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, sep);)
    if (!part.empty()) out.push_back(part);
  return out;
}

bench::MetricsOptions metrics_options(const BenchCliOptions& o) {
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

std::vector<bench::BenchRequest> workload(const BenchCliOptions& o, const text::Tokenizer& tok) {
  const auto vocab = bench::TokenVocab::build(tok);
  const bool trace = o.dataset == "mooncake" || o.dataset == "azure";
  if ((trace || o.dataset == "sharegpt") && o.dataset_path.empty())
    throw Error("--dataset-name " + o.dataset + " needs --dataset-path");
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
  if (!trace || std::isfinite(o.request_rate)) {
    bench::ArrivalOptions a;
    a.request_rate = o.request_rate;
    a.burstiness = o.burstiness;
    a.seed = o.seed;
    bench::apply_arrivals(reqs, bench::rate_arrivals(reqs.size(), a));
  }
  return reqs;
}

void run(const BenchCliOptions& o) {
  const auto [host, port] = split_url(o.base_url);
  const auto tok = text::Tokenizer::from_dir(
      o.tokenizer.empty() ? default_tokenizer() : std::filesystem::path(o.tokenizer));
  bench::MetricsOptions mo = metrics_options(o);
  auto reqs = workload(o, tok);
  if (reqs.empty()) throw Error("the workload has no requests");

  bench::DriverOptions d;
  d.host = host;
  d.port = port;
  d.endpoint = o.endpoint;
  d.model = o.model;
  if (o.prompt_format != "ids" && o.prompt_format != "text")
    throw Error("--prompt-format: expected ids or text");
  d.prompt_format =
      o.prompt_format == "ids" ? bench::PromptFormat::kTokenIds : bench::PromptFormat::kText;
  d.ignore_eos = !o.no_ignore_eos;
  if (o.max_concurrency > 0) d.max_concurrency = o.max_concurrency;
  d.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout * 1000));
  d.api_key = o.api_key;

  // Prefix-cache counters before and after, from the server (or the engines given).
  std::vector<std::pair<std::string, uint16_t>> metric_sources;
  for (const auto& u : o.metrics_urls) metric_sources.push_back(split_url(u));
  if (metric_sources.empty()) metric_sources.push_back({host, port});
  auto counters = [&] {
    std::optional<bench::PrefixCacheCounters> sum;
    for (const auto& [h, p] : metric_sources)
      if (auto c = bench::read_prefix_cache_counters(h, p)) {
        if (!sum) sum = bench::PrefixCacheCounters{};
        sum->queries += c->queries;
        sum->hits += c->hits;
      }
    return sum;
  };
  const auto before = counters();

  std::fprintf(stderr, "tandem bench: %zu requests (%s) to %s%s, rate %s, max concurrency %s\n",
               reqs.size(), o.dataset.c_str(), o.base_url.c_str(), o.endpoint.c_str(),
               std::isfinite(o.request_rate) ? std::to_string(o.request_rate).c_str()
               : (o.dataset == "mooncake" || o.dataset == "azure") ? "trace"
                                                                   : "inf",
               o.max_concurrency > 0 ? std::to_string(o.max_concurrency).c_str() : "none");
  std::unique_ptr<ProgressBar> bar;
  if (!o.no_progress) bar = std::make_unique<ProgressBar>("requests");
  d.progress = [&](size_t done, size_t total) {
    if (bar) bar->update(done, total);
  };
  const bench::DriverRun result = bench::run_workload(reqs, d);
  bar.reset();
  const auto after = counters();

  const bench::BenchSummary summary = bench::summarize(result.results, result.duration_s, mo);
  bench::TableContext tc;
  tc.request_rate = o.request_rate;
  if (o.max_concurrency > 0) tc.max_concurrency = o.max_concurrency;
  std::string table = bench::summary_table(summary, tc);
  json out = bench::to_json(summary, result.results);
  if (before && after && after->queries > before->queries) {
    const double rate = (after->hits - before->hits) / (after->queries - before->queries);
    out["prefix_cache_hit_rate"] = rate;
    char line[96];
    std::snprintf(line, sizeof line, "%-40s%-10.2f\n", "Prefix cache hit rate (%):", rate * 100);
    table += line;
  }
  out["backend"] = "tandem-bench";
  out["dataset_name"] = o.dataset;
  out["num_prompts"] = reqs.size();
  out["request_rate"] = std::isfinite(o.request_rate) ? json(o.request_rate) : json("inf");
  out["burstiness"] = o.burstiness;
  out["max_concurrency"] = o.max_concurrency > 0 ? json(o.max_concurrency) : json(nullptr);
  out["model_id"] = o.model;
  std::fputs(table.c_str(), stdout);
  std::fflush(stdout);
  if (!o.html.empty()) {
    bench::ReportOptions ro;
    ro.title = "tandem bench: " + o.dataset + " against " + o.base_url;
    ro.config = {
        {"base URL", o.base_url},
        {"endpoint", o.endpoint},
        {"model", o.model},
        {"dataset", o.dataset + (o.dataset_path.empty() ? "" : " (" + o.dataset_path + ")")},
        {"requests", std::to_string(reqs.size())},
        {"request rate",
         std::isfinite(o.request_rate) ? std::to_string(o.request_rate) : "inf / trace"},
        {"max concurrency", o.max_concurrency > 0 ? std::to_string(o.max_concurrency) : "none"}};
    ro.table = tc;
    if (!o.access_log.empty()) ro.access_log = bench::read_access_log(o.access_log);
    std::ofstream f(o.html);
    if (!f) throw Error("--html: cannot write " + o.html);
    f << bench::html_report(summary, result.results, ro);
    std::fprintf(stderr, "tandem bench: report in %s\n", o.html.c_str());
  }
  if (!o.result_file.empty()) {
    std::ofstream f(o.result_file);
    if (!f) throw Error("--result-file: cannot write " + o.result_file);
    f << out.dump(2) << "\n";
    std::fprintf(stderr, "tandem bench: results in %s\n", o.result_file.c_str());
  }
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto o = std::make_shared<BenchCliOptions>();
  auto* cmd = app.add_subcommand(
      "bench",
      "Load generator and trace replayer for any OpenAI-compatible server (vLLM's "
      "metrics and result keys)");
  cmd->add_option("--base-url", o->base_url, "the server, http://HOST:PORT")->capture_default_str();
  cmd->add_option("--endpoint", o->endpoint, "/v1/completions or /v1/chat/completions")
      ->capture_default_str();
  cmd->add_option("--model", o->model, "the model name to send");
  cmd->add_option("--dataset-name", o->dataset,
                  "random, prefix-repetition, sharegpt, mooncake or azure")
      ->capture_default_str();
  cmd->add_option("--dataset-path", o->dataset_path, "ShareGPT JSON, Mooncake JSONL or Azure CSV");
  cmd->add_option("--tokenizer", o->tokenizer,
                  "folder with tokenizer.json (default: the DeepSeek-V3 tokenizer)");
  cmd->add_option("--num-prompts", o->num_prompts, "requests (synthetic datasets, ShareGPT)")
      ->capture_default_str();
  cmd->add_option("--random-input-len", o->random_input_len)->capture_default_str();
  cmd->add_option("--random-output-len", o->random_output_len)->capture_default_str();
  cmd->add_option("--random-range-ratio", o->random_range_ratio)->capture_default_str();
  cmd->add_option("--prefix-repetition-prefix-len", o->prefix_len)->capture_default_str();
  cmd->add_option("--prefix-repetition-suffix-len", o->suffix_len)->capture_default_str();
  cmd->add_option("--prefix-repetition-num-prefixes", o->num_prefixes)->capture_default_str();
  cmd->add_option("--prefix-repetition-output-len", o->prefix_output_len)->capture_default_str();
  cmd->add_option("--trace-start", o->trace_start, "traces: the first record to replay")
      ->capture_default_str();
  cmd->add_option("--trace-limit", o->trace_limit, "traces: records to replay (0: all)")
      ->capture_default_str();
  cmd->add_option("--time-scale", o->time_scale,
                  "traces: multiply timestamps (0.5 replays twice as fast)")
      ->capture_default_str();
  cmd->add_option("--request-rate", o->request_rate,
                  "requests/s (Poisson or gamma); default inf (all at once; traces: their "
                  "timestamps)");
  cmd->add_option("--burstiness", o->burstiness, "gamma shape of the gaps (1: Poisson)")
      ->capture_default_str();
  cmd->add_option("--max-concurrency", o->max_concurrency, "requests in flight at most (0: none)")
      ->capture_default_str();
  cmd->add_option("--prompt-format", o->prompt_format,
                  "completions: ids (token-id prompts) or text (text that tokenizes to them)")
      ->capture_default_str();
  cmd->add_flag("--no-ignore-eos", o->no_ignore_eos, "let the model stop early");
  cmd->add_option("--percentile-metrics", o->percentile_metrics,
                  "comma list of ttft, tpot, itl, e2el, tbt")
      ->capture_default_str();
  cmd->add_option("--metric-percentiles", o->metric_percentiles, "comma list, e.g. 50,90,99")
      ->capture_default_str();
  cmd->add_option("--goodput", o->goodput, "SLO KEY:MS (ttft, tpot, e2el, tbt); repeatable");
  cmd->add_option("--metrics-url", o->metrics_urls,
                  "where to read prefix-cache counters (default: the base URL); repeatable, "
                  "e.g. each engine behind a gateway");
  cmd->add_option("--result-file", o->result_file, "write the JSON result (vLLM's keys) here");
  cmd->add_option("--html", o->html, "write the HTML report (plots, no server needed) here");
  cmd->add_option("--access-log", o->access_log,
                  "the gateway's access log of the run: per-phase breakdown in the report");
  cmd->add_option("--api-key", o->api_key, "Bearer token");
  cmd->add_option("--seed", o->seed)->capture_default_str();
  cmd->add_option("--timeout", o->timeout, "seconds a request may wait for its next piece")
      ->capture_default_str();
  cmd->add_flag("--no-progress", o->no_progress, "no progress bar");
  cmd->callback([o] { run(*o); });
}

}  // namespace tandem::cli
