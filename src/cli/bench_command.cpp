#include "cli/bench_command.h"

#include <cmath>
#include <cstdio>
#include <ctime>
#include <memory>

#include <nlohmann/json.hpp>

#include "api/model_list.h"
#include "bench/driver.h"
#include "bench/metrics.h"
#include "bench/report.h"
#include "bench/workload.h"
#include "cli/bench_options.h"
#include "cli/gateway_command.h"
#include "gateway/topology.h"
#include "net/http_client.h"
#include "text/tokenizer.h"
#include "util/duration.h"
#include "util/error.h"
#include "util/progress.h"

namespace tandem::cli {
namespace {

using nlohmann::json;

struct BenchCliOptions {
  std::string base_url = "http://127.0.0.1:" + std::to_string(kDefaultGatewayPort),
              endpoint = "/v1/completions", model, prompt_format = "ids", access_log, api_key,
              label;
  bool label_given = false;
  WorkloadCliOptions workload;
  MetricsCliOptions metrics;
  RunOutputs outputs;
  std::vector<std::string> metrics_urls;
  double timeout = 600;
  int64_t max_concurrency = 0;
  bool ignore_eos = false, no_ignore_eos = false, no_progress = false;
  // vLLM's sampling flags: sent when given; temperature 0 (greedy) when not, as vLLM sends it.
  double temperature = 0;
  std::optional<double> top_p, min_p;
  std::optional<int64_t> top_k;
  bool prompt_format_given = false;  // on the command line
};

// Flags this run would not use are refused, as the workload's are (check_unused_flags), not
// ignored: the run would not be the one asked for.
void check_unused_run_flags(const BenchCliOptions& o) {
  const bool chat = bench::is_chat_endpoint(o.endpoint);
  if (chat && o.prompt_format_given && o.prompt_format == "ids")
    throw Error("--prompt-format ids applies to /v1/completions; " + o.endpoint +
                " sends the prompt as text, in a message");
  if (o.ignore_eos && o.no_ignore_eos)
    throw Error("--ignore-eos and --no-ignore-eos: give one of the two");
  if (!o.access_log.empty() && o.outputs.html.empty())
    throw Error("--access-log " + o.access_log +
                ": the log is read for the HTML report's per-phase breakdown, and no report is "
                "asked for: give --html too");
}

// "HOST:PORT" or "http://HOST:PORT" into host and port: a server's address as the gateway parses
// one (gateway::parse_server_address, its endpoint parser without the bootstrap port); errors
// name `flag`.
std::pair<std::string, uint16_t> split_url(const std::string& url, const std::string& flag) {
  const gateway::Endpoint e = gateway::parse_server_address(url, flag);
  return {e.host, e.port};
}

// The first model a server lists at /v1/models, as vLLM's bench takes it when --model is not
// given; empty (with a warning) when the server lists none, answers with an error or not in time
// (a busy server may still serve the run), and then no model is sent, which servers serving one
// model accept. An address nothing listens at is an error: every request of the run would fail the
// same way.
std::string first_served_model(const std::string& base_url, const std::string& host, uint16_t port,
                               const std::string& api_key) {
  std::string why;
  try {
    net::Headers headers;
    if (!api_key.empty()) headers.set("Authorization", "Bearer " + api_key);
    const net::HttpClientResponse r =
        net::http_request(host, port, "GET", "/v1/models", {}, headers, std::chrono::seconds(10));
    if (r.status != 200)
      why = "HTTP " + std::to_string(r.status);
    else if (auto id = api::first_model_id(r.body))
      return *id;
    else
      why = "it lists no model";
  } catch (const net::HttpConnectError& e) {
    throw Error("--base-url " + base_url + ": no server answered GET /v1/models (" + e.what() +
                "); start one first (tandem serve listens on port " +
                std::to_string(kDefaultGatewayPort) + " by default)");
  } catch (const Error& e) {
    why = e.what();  // a timeout, a malformed answer
  }
  std::fprintf(stderr,
               "tandem bench: warning: no --model, and /v1/models gave none (%s): requests are "
               "sent without a model\n",
               why.c_str());
  return {};
}

// vLLM's result "date": local time as %Y%m%d-%H%M%S.
std::string date_text() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char text[32];
  std::strftime(text, sizeof text, "%Y%m%d-%H%M%S", &local);
  return text;
}

void run(const BenchCliOptions& o) {
  const auto [host, port] = split_url(o.base_url, "--base-url");
  bench::MetricsOptions mo = metrics_options(o.metrics);  // before anything runs
  check_workload_options(o.workload);
  // The access log is read and the outputs written after the run: one that cannot be read or
  // written must say so before it.
  if (!o.access_log.empty()) bench::check_input_file(o.access_log, "--access-log " + o.access_log);
  check_unused_run_flags(o);
  check_outputs(o.outputs);
  const auto tok = text::Tokenizer::from_dir(workload_tokenizer_dir(o.workload));
  auto reqs = build_workload(o.workload, tok);  // not empty

  bench::DriverOptions d;
  d.host = host;
  d.port = port;
  d.endpoint = o.endpoint;
  d.model = o.model.empty() ? first_served_model(o.base_url, host, port, o.api_key) : o.model;
  if (o.prompt_format != "ids" && o.prompt_format != "text")
    throw Error("--prompt-format: expected ids or text");
  d.prompt_format =
      o.prompt_format == "ids" ? bench::PromptFormat::kTokenIds : bench::PromptFormat::kText;
  d.ignore_eos = ignore_eos_of(o.workload, o.ignore_eos, o.no_ignore_eos);
  d.temperature = o.temperature;
  d.top_p = o.top_p;
  d.top_k = o.top_k;
  d.min_p = o.min_p;
  d.tokenizer = &tok;
  set_prompt_bos(o.workload, tok, d);
  if (o.max_concurrency > 0) d.max_concurrency = o.max_concurrency;
  if (!(o.timeout > 0 && o.timeout <= bench::kMaxArrivalSeconds))
    throw Error("--timeout: expected seconds > 0 and at most " +
                std::to_string(int64_t(bench::kMaxArrivalSeconds)));
  d.timeout = milliseconds_of(o.timeout);
  d.api_key = o.api_key;

  // Prefix-cache counters before and after, from the server (or the engines given).
  std::vector<std::pair<std::string, uint16_t>> metric_sources;
  for (const auto& u : o.metrics_urls) metric_sources.push_back(split_url(u, "--metrics-url"));
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

  const WorkloadCliOptions& w = o.workload;
  std::fprintf(stderr, "tandem bench: %zu requests (%s) to %s%s, rate %s, max concurrency %s\n",
               reqs.size(), w.dataset.c_str(), o.base_url.c_str(), o.endpoint.c_str(),
               std::isfinite(w.request_rate) ? number_text(w.request_rate).c_str()
               : w.trace()                   ? "trace"
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
  RunDescription run;
  run.nothing_measured_fails = true;
  run.report.table.request_rate = w.request_rate;
  if (o.max_concurrency > 0) run.report.table.max_concurrency = o.max_concurrency;
  if (before && after && after->queries > before->queries)
    run.prefix_cache_hit_rate = (after->hits - before->hits) / (after->queries - before->queries);
  const bool chat = bench::is_chat_endpoint(o.endpoint);
  run.extra = {{"date", date_text()},
               {"backend", "tandem-bench"},
               {"endpoint_type", chat ? "openai-chat" : "openai"},
               {"label", o.label_given ? json(o.label) : json(nullptr)},
               {"tokenizer_id", workload_tokenizer_dir(w)},
               {"dataset_name", w.dataset},
               {"num_prompts", reqs.size()},
               {"request_rate", std::isfinite(w.request_rate) ? json(w.request_rate) : json("inf")},
               {"burstiness", w.burstiness},
               {"max_concurrency", o.max_concurrency > 0 ? json(o.max_concurrency) : json(nullptr)},
               {"model_id", d.model}};
  run.report.title = "tandem bench: " + w.dataset + " against " + o.base_url;
  run.report.config = {
      {"base URL", o.base_url},
      {"endpoint", o.endpoint},
      {"model", d.model},
      {"dataset", w.dataset + (w.dataset_path.empty() ? "" : " (" + w.dataset_path + ")")},
      {"requests", std::to_string(reqs.size())},
      {"request rate", std::isfinite(w.request_rate) ? number_text(w.request_rate) : "inf / trace"},
      {"max concurrency", o.max_concurrency > 0 ? std::to_string(o.max_concurrency) : "none"}};
  if (!o.access_log.empty())
    run.access_log = [&] {
      try {
        return bench::read_access_log(o.access_log);
      } catch (const Error& e) {
        throw Error("--access-log: " + std::string(e.what()));
      }
    };
  write_run(summary, result.results, run, o.outputs, "tandem bench");
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
  cmd->add_option("--model", o->model,
                  "the model name to send (default: the first that /v1/models lists, as vLLM)");
  add_workload_options(*cmd, o->workload);
  cmd->add_option("--max-concurrency", o->max_concurrency, "requests in flight at most (0: none)")
      ->capture_default_str();
  cmd->add_option("--prompt-format", o->prompt_format,
                  "completions: ids (token-id prompts; for the datasets the tokenizer's BOS "
                  "first, as a server adds it to text) or text (text that tokenizes to them)")
      ->capture_default_str()
      ->each([p = o.get()](const std::string&) { p->prompt_format_given = true; });
  cmd->add_flag("--ignore-eos", o->ignore_eos,
                "send ignore_eos: true, forcing the output lengths (default: for --dataset-name "
                "random only, as vLLM)");
  cmd->add_flag("--no-ignore-eos", o->no_ignore_eos,
                "let the model stop early on --dataset-name random too");
  cmd->add_option("--temperature", o->temperature, "sampling temperature sent")
      ->capture_default_str();
  cmd->add_option_function<double>(
      "--top-p", [p = o.get()](const double& v) { p->top_p = v; }, "top_p sent (default: none)");
  cmd->add_option_function<int64_t>(
      "--top-k", [p = o.get()](const int64_t& v) { p->top_k = v; }, "top_k sent (default: none)");
  cmd->add_option_function<double>(
      "--min-p", [p = o.get()](const double& v) { p->min_p = v; }, "min_p sent (default: none)");
  cmd->add_option("--label", o->label, "the result's \"label\" (default: null, as vLLM)")
      ->each([p = o.get()](const std::string&) { p->label_given = true; });
  add_metrics_options(*cmd, o->metrics);
  cmd->add_option("--metrics-url", o->metrics_urls,
                  "where to read prefix-cache counters (default: the base URL); repeatable, "
                  "e.g. each engine behind a gateway");
  cmd->add_option("--result-file,--result-filename", o->outputs.result_file,
                  "write the JSON result (vLLM's keys) here (vLLM: --save-result "
                  "--result-filename)");
  cmd->add_option("--html", o->outputs.html,
                  "write the HTML report (plots, no server needed) here");
  cmd->add_option("--access-log", o->access_log,
                  "the gateway's access log of the run: per-phase breakdown in the report");
  cmd->add_option("--api-key", o->api_key, "Bearer token");
  cmd->add_option("--timeout", o->timeout, "seconds a request may wait for its next piece")
      ->capture_default_str();
  cmd->add_flag("--no-progress", o->no_progress, "no progress bar");
  cmd->callback([o] { run(*o); });
}

}  // namespace tandem::cli
