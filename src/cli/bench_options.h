#pragma once
// What `tandem bench` and `tandem simulate` share: the workload flags (vLLM's dataset names and
// options, trace windows, arrival rates), the metric flags (percentiles, goodput SLOs), and the
// outputs (vLLM's terminal table, result JSON, HTML report), so a simulated run reads exactly
// like a live one.
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/driver.h"
#include "bench/metrics.h"
#include "bench/report.h"
#include "bench/workload.h"
#include "text/tokenizer.h"

namespace tandem::cli {

struct WorkloadCliOptions {
  std::string dataset = "random", dataset_path, tokenizer;
  int64_t num_prompts = 1000, random_input_len = 1024, random_output_len = 128;
  double random_range_ratio = 0;
  int64_t prefix_len = 256, suffix_len = 256, num_prefixes = 10, prefix_output_len = 128;
  int64_t trace_start = 0, trace_limit = 0;
  double time_scale = 1.0, request_rate = std::numeric_limits<double>::infinity(), burstiness = 1.0;
  uint64_t seed = 0;
  bool trace_spread = false;  // Mooncake: spread the records sharing a timestamp (--seed)
  // The workload flags given on the command line (add_workload_options records them), so that a
  // flag the dataset does not use is refused even at its default value. A flag whose value is
  // not its default counts as given too (options filled in by code).
  std::set<std::string, std::less<>> given;

  bool trace() const { return dataset == "mooncake" || dataset == "azure"; }
};
void add_workload_options(CLI::App& cmd, WorkloadCliOptions& o);
// The tokenizer the workload is built with (--tokenizer, default the DeepSeek-V3 one).
std::string workload_tokenizer_dir(const WorkloadCliOptions& o);
// Refuses what the flags alone show wrong (a value out of range, a flag the dataset does not
// use, a dataset without its file), naming the flag: before the tokenizer is loaded, which takes a
// second or more. build_workload and build_lazy_workload check the same.
void check_workload_options(const WorkloadCliOptions& o);
// The requests, with their arrival times. Throws tandem::Error naming the flag on bad values,
// and when there are none, saying why (the flag, the file and the window).
std::vector<bench::BenchRequest> build_workload(const WorkloadCliOptions& o,
                                                const text::Tokenizer& tokenizer);
// The same requests made as they are sent, without their text (token-id prompts): a trace
// (Mooncake or Azure) is read as records and each request made on demand, with no bound on its
// prompt tokens in all; other datasets are built whole.
bench::LazyWorkload build_lazy_workload(const WorkloadCliOptions& o,
                                        const text::Tokenizer& tokenizer);
// How the workload's token-id prompts are sent and counted: vLLM's dataset lengths count the BOS
// the server adds to a text prompt, so it goes first in the ids (and is counted but for
// prefix-repetition); a trace's length is the ids it sends. `tandem bench` and `tandem simulate`.
void set_prompt_bos(const WorkloadCliOptions& o, const text::Tokenizer& tokenizer,
                    bench::DriverOptions& driver);
// Whether the requests send ignore_eos: true, as vLLM's bench sends it: the random dataset's
// lengths are forced (vLLM sets ignore_eos for it), the others' let the model stop, unless
// `ignore_eos` (--ignore-eos) or `no_ignore_eos` (--no-ignore-eos) says otherwise. `tandem bench`
// and `tandem simulate` (which has neither flag).
bool ignore_eos_of(const WorkloadCliOptions& o, bool ignore_eos, bool no_ignore_eos);

struct MetricsCliOptions {
  std::string percentile_metrics = "ttft,tpot,itl", metric_percentiles = "99";
  std::vector<std::string> goodput;
};
void add_metrics_options(CLI::App& cmd, MetricsCliOptions& o);
// Throws tandem::Error naming the flag for a percentile that is not a number in 0..100, an
// unknown metric, or a goodput SLO that is not KEY:MS with MS a finite number >= 0.
bench::MetricsOptions metrics_options(const MetricsCliOptions& o);

// A finished run written as `tandem bench` writes it: the table on stdout (with the prefix-cache
// hit rate when known), and the result JSON and HTML report when asked for.
struct RunOutputs {
  std::string result_file, html;
};
struct RunDescription {
  bench::ReportOptions report;  // the title, configuration rows, table context and access log
  std::optional<double> prefix_cache_hit_rate;
  nlohmann::json extra = nlohmann::json::object();  // more result keys (backend, dataset_name..)
  // Reads the access log for the report (when there is one): after the table and the result file
  // are written.
  std::function<std::vector<nlohmann::json>()> access_log;
  // A run whose every request failed is an error (the command exits non-zero) rather than a
  // warning: a bench against a server (a script or sweep must see that nothing was measured,
  // as vLLM's bench fails when its first request does), not a simulation, where failures may be
  // what is studied.
  bool nothing_measured_fails = false;
};
// Prints the run's table and writes its result file and report; then, when every request
// failed, warns or (RunDescription::nothing_measured_fails) throws Error.
void write_run(const bench::BenchSummary& summary, std::span<const bench::RequestResult> results,
               const RunDescription& run, const RunOutputs& outputs, const char* program);

// Writes an output file (`flag` names it in errors): a regular file is replaced whole, so a
// failure leaves the one before; a pipe or device is written in place.
void write_output(const std::string& flag, const std::string& path, std::string_view bytes);
// Throws tandem::Error "`flag` `path`: ..." unless write_output could write `path` (empty: no
// file asked for): it is not a directory, and a file can be made in its directory. Called before
// a run, so that a typo in a folder name does not cost the run's results.
void check_output(const std::string& flag, const std::string& path);
void check_outputs(const RunOutputs& outputs);
// A result JSON as the files hold it; bytes that are not UTF-8 become U+FFFD.
std::string result_json_text(const nlohmann::json& result);

// Checks a seed flag's text before CLI11 converts it: CLI11 reads an unsigned option through a
// signed or saturating conversion, so -1 and 2^64 both became 2^64 - 1, a seed other than the
// one asked for. Only a whole decimal number in 0..2^64-1 passes.
CLI::Validator seed_range();

std::vector<std::string> split(const std::string& s, char sep);
// `text` as a finite number, all of it ("1.5abc", "5<b>" and "" are not); nullopt otherwise.
std::optional<double> whole_number(const std::string& text);

// A number as a person writes it: 20, 0.5, 1e-07 (not std::to_string's 20.000000).
std::string number_text(double v);

}  // namespace tandem::cli
