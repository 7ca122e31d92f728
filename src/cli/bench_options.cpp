#include "cli/bench_options.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "bench/arrivals.h"
#include "cli/model_commands.h"
#include "util/error.h"
#include "util/file.h"

namespace tandem::cli {

using nlohmann::json;

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, sep);)
    if (!part.empty()) out.push_back(part);
  return out;
}

std::string number_text(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", v);
  return text;
}

CLI::Validator seed_range() {
  return CLI::Validator(
      [](const std::string& text) -> std::string {
        uint64_t v = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
        if (text.empty() || ec != std::errc() || end != text.data() + text.size())
          return "expected a seed in 0.." + std::to_string(std::numeric_limits<uint64_t>::max()) +
                 ", got '" + text + "'";
        return std::string();
      },
      "0..2^64-1");
}

void add_workload_options(CLI::App& cmd, WorkloadCliOptions& o) {
  cmd.add_option("--dataset-name", o.dataset,
                 "random, prefix-repetition (vLLM's prefix_repetition too), sharegpt, mooncake "
                 "or azure")
      ->capture_default_str()
      ->transform(CLI::Validator(
          [](std::string& name) {
            if (name == "prefix_repetition") name = "prefix-repetition";  // vLLM's spelling
            return std::string();
          },
          "", "vLLM dataset names"));
  cmd.add_option("--dataset-path", o.dataset_path, "ShareGPT JSON, Mooncake JSONL or Azure CSV");
  cmd.add_option("--tokenizer", o.tokenizer,
                 "folder with tokenizer.json (default: the DeepSeek-V3 tokenizer)");
  cmd.add_option(
         "--num-prompts", o.num_prompts,
         "requests (synthetic datasets, ShareGPT: its conversations repeated when too few); "
         "traces: the records to replay, the first of the window")
      ->capture_default_str();
  // The synthetic datasets' flags, as vLLM's bench names and means them.
  cmd.add_option("--random-input-len", o.random_input_len,
                 "random: prompt tokens per request (special tokens included)")
      ->capture_default_str();
  cmd.add_option("--random-output-len", o.random_output_len,
                 "random: output tokens per request (max_tokens)")
      ->capture_default_str();
  cmd.add_option("--random-range-ratio", o.random_range_ratio,
                 "random: each request's input and output lengths are drawn uniformly from "
                 "[len * (1 - ratio), len * (1 + ratio)]; in [0, 1), 0: every request the same")
      ->capture_default_str();
  cmd.add_option("--prefix-repetition-prefix-len", o.prefix_len,
                 "prefix-repetition: tokens of the prefix that requests share")
      ->capture_default_str();
  cmd.add_option("--prefix-repetition-suffix-len", o.suffix_len,
                 "prefix-repetition: tokens after the prefix, unique to each request (a prompt is "
                 "prefix + suffix tokens)")
      ->capture_default_str();
  cmd.add_option("--prefix-repetition-num-prefixes", o.num_prefixes,
                 "prefix-repetition: distinct prefixes; --num-prompts / this many requests share "
                 "each")
      ->capture_default_str();
  cmd.add_option("--prefix-repetition-output-len", o.prefix_output_len,
                 "prefix-repetition: output tokens per request")
      ->capture_default_str();
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
  cmd.add_option("--burstiness", o.burstiness,
                 "gamma shape of the gaps of --request-rate (1: Poisson)")
      ->capture_default_str();
  cmd.add_option("--seed", o.seed,
                 "random seed of the workload: the synthetic prompts and lengths, ShareGPT's "
                 "sample, the traces' prompt tokens, the arrival times (same seed, same requests)")
      ->capture_default_str()
      ->check(seed_range());
  // The flags a dataset may not use record that they were given as CLI11 takes their values
  // (check_unused_flags reads them).
  for (const char* flag :
       {"--dataset-path", "--num-prompts", "--random-input-len", "--random-output-len",
        "--random-range-ratio", "--prefix-repetition-prefix-len", "--prefix-repetition-suffix-len",
        "--prefix-repetition-num-prefixes", "--prefix-repetition-output-len", "--trace-start",
        "--trace-limit", "--time-scale", "--burstiness"})
    cmd.get_option(flag)->each(
        [&o, name = std::string(flag)](const std::string&) { o.given.insert(name); });
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

// Whether `flag` was given on the command line, or `differs` (its value is not its default).
bool given(const WorkloadCliOptions& o, std::string_view flag, bool differs) {
  return differs || o.given.contains(flag);
}

bool num_prompts_given(const WorkloadCliOptions& o) {
  return given(o, "--num-prompts", o.num_prompts != WorkloadCliOptions{}.num_prompts);
}

// Flags the dataset does not use are refused as --trace-spread is above, not ignored: a run of
// another workload than the one asked for costs its time and misleads. A flag counts as given
// even at its default value (--random-input-len 1024 with sharegpt would pass for a length the
// run never had).
void check_unused_flags(const WorkloadCliOptions& o) {
  const WorkloadCliOptions d;
  const bool synthetic = o.dataset == "random" || o.dataset == "prefix-repetition";
  if (synthetic || o.dataset == "sharegpt") {
    for (const auto& [flag, differs] : {std::pair{"--trace-start", o.trace_start != d.trace_start},
                                        std::pair{"--trace-limit", o.trace_limit != d.trace_limit},
                                        std::pair{"--time-scale", o.time_scale != d.time_scale}})
      if (given(o, flag, differs))
        throw Error(std::string(flag) +
                    " applies to the traces (--dataset-name mooncake or azure), not " + o.dataset);
    if (synthetic && given(o, "--dataset-path", !o.dataset_path.empty()))
      throw Error("--dataset-path: --dataset-name " + o.dataset +
                  " reads no file (its prompts are made up)");
  }
  // The synthetic datasets' own flags: every other dataset takes its lengths from its file.
  const std::pair<const char*, bool> random_flags[] = {
      {"--random-input-len", o.random_input_len != d.random_input_len},
      {"--random-output-len", o.random_output_len != d.random_output_len},
      {"--random-range-ratio", o.random_range_ratio != d.random_range_ratio}};
  const std::pair<const char*, bool> prefix_flags[] = {
      {"--prefix-repetition-prefix-len", o.prefix_len != d.prefix_len},
      {"--prefix-repetition-suffix-len", o.suffix_len != d.suffix_len},
      {"--prefix-repetition-num-prefixes", o.num_prefixes != d.num_prefixes},
      {"--prefix-repetition-output-len", o.prefix_output_len != d.prefix_output_len}};
  using Flags = std::span<const std::pair<const char*, bool>>;
  for (const auto& [owner, flags] : {std::pair{"random", Flags(random_flags)},
                                     std::pair{"prefix-repetition", Flags(prefix_flags)}}) {
    if (o.dataset == owner) continue;
    for (const auto& [flag, differs] : flags)
      if (given(o, flag, differs))
        throw Error(std::string(flag) + " applies to --dataset-name " + owner + ", not " +
                    o.dataset +
                    (o.trace() || o.dataset == "sharegpt" ? " (its lengths are the file's)" : ""));
  }
  // On a trace --num-prompts is the records to replay, the first of the window, as
  // --trace-limit is: one of the two says how many.
  if (o.trace() && num_prompts_given(o) && given(o, "--trace-limit", o.trace_limit != 0))
    throw Error(
        "--num-prompts and --trace-limit both say how many of the trace's records to replay: give "
        "one of the two");
  const bool rate = std::isfinite(o.request_rate);
  if (o.trace() && rate && given(o, "--time-scale", o.time_scale != d.time_scale))
    throw Error(
        "--time-scale scales the trace's own arrivals, which --request-rate replaces: give one "
        "of the two");
  if (!rate && given(o, "--burstiness", o.burstiness != d.burstiness))
    throw Error(
        std::string("--burstiness shapes the gaps between the arrivals of a finite "
                    "--request-rate; without one ") +
        (o.trace() ? "the trace's own timestamps are replayed" : "every request is sent at once") +
        ": give --request-rate too");
}

// The trace's records to replay: --num-prompts (the first of the window, as vLLM's
// --num-prompts is the requests of a run) or --trace-limit (0: all).
bench::TraceWindow trace_window(const WorkloadCliOptions& o) {
  bench::TraceWindow w;
  w.start = o.trace_start;
  w.limit = o.trace_limit;
  w.time_scale = o.time_scale;
  if (num_prompts_given(o)) {
    // A limit of 0 reads as all the records: --num-prompts 0 asks for none.
    if (o.num_prompts == 0) throw Error("the workload has no requests: --num-prompts 0");
    w.limit = o.num_prompts;
  }
  return w;
}

void check_range(const char* flag, int64_t value, int64_t low, int64_t high) {
  if (value < low || value > high)
    throw Error(std::string(flag) + ": expected " + std::to_string(low) + ".." +
                std::to_string(high) + ", got " + std::to_string(value));
}

// Every count and length the flags give, bounded before anything is made (vector::reserve of a
// typo would otherwise end the run as an allocation failure that names nothing).
void check_workload_flags(const WorkloadCliOptions& o) {
  check_range("--num-prompts", o.num_prompts, 0, bench::kMaxRequests);
  check_range("--random-input-len", o.random_input_len, 0, bench::kMaxRequestTokens);
  check_range("--random-output-len", o.random_output_len, 0, bench::kMaxRequestTokens);
  check_range("--prefix-repetition-prefix-len", o.prefix_len, 0, bench::kMaxRequestTokens);
  check_range("--prefix-repetition-suffix-len", o.suffix_len, 0, bench::kMaxRequestTokens);
  check_range("--prefix-repetition-num-prefixes", o.num_prefixes, 1, bench::kMaxRequests);
  check_range("--prefix-repetition-output-len", o.prefix_output_len, 1, bench::kMaxRequestTokens);
  const int64_t max = std::numeric_limits<int64_t>::max();
  check_range("--trace-start", o.trace_start, 0, max);
  check_range("--trace-limit", o.trace_limit, 0, max);
  if (!(std::isfinite(o.time_scale) && o.time_scale >= 0))
    throw Error("--time-scale: expected a finite number >= 0");
  // inf sends everything at once (a trace: at its timestamps); NaN or -inf are no rate, though
  // only a finite rate replaces a trace's timestamps.
  if (!(o.request_rate > 0))
    throw Error("--request-rate: expected requests/s > 0 (or inf), got " +
                number_text(o.request_rate));
  // Before the bound below uses it (NaN would reach an integer conversion).
  if (!(o.random_range_ratio >= 0 && o.random_range_ratio < 1))
    throw Error("--random-range-ratio: expected a number in [0, 1)");
  // A synthetic workload is built whole, prompt ids and text (~25 bytes a token): 20,000 prompts
  // of 1,024 tokens took 513 MB, and the largest counts and lengths above would need terabytes.
  // Both factors are bounded, so the product fits.
  const auto too_many = [&](const char* count_flag, const char* length_flag, int64_t length) {
    if (o.num_prompts * length > bench::kMaxWorkloadPromptTokens)
      throw Error(std::string(count_flag) + " " + std::to_string(o.num_prompts) + " x " +
                  length_flag + " " + std::to_string(length) + ": at most " +
                  std::to_string(bench::kMaxWorkloadPromptTokens) +
                  " prompt tokens in all (the workload is made whole, text included)");
  };
  if (o.dataset == "random") {
    // The longest a prompt may draw: ceil(L * (1 + r)).
    too_many(
        "--num-prompts", "--random-input-len",
        static_cast<int64_t>(std::ceil(double(o.random_input_len) * (1 + o.random_range_ratio))));
  } else if (o.dataset == "prefix-repetition") {
    too_many("--num-prompts", "--prefix-repetition-prefix-len + suffix-len",
             o.prefix_len + o.suffix_len);
  }
}

// The rate-driven arrivals the flags ask for (--request-rate, --burstiness, --seed).
std::vector<double> rate_arrivals(size_t n, const WorkloadCliOptions& o) {
  bench::ArrivalOptions a;
  a.request_rate = o.request_rate;
  a.burstiness = o.burstiness;
  a.seed = o.seed;
  std::vector<double> t = bench::rate_arrivals(n, a);
  // A rate near 0 puts the sends past what the drivers' clocks can count.
  if (!t.empty() && !(t.back() <= bench::kMaxArrivalSeconds))
    throw Error("--request-rate " + number_text(o.request_rate) + ": the last of " +
                std::to_string(n) + " requests would be sent after " + std::to_string(t.back()) +
                " s; expected at most " + std::to_string(bench::kMaxArrivalSeconds) + " s");
  return t;
}

// Why a workload came out empty, naming the flag or the file: a bare "the workload has no
// requests" left the user to guess between an empty file, a window past its end and filters.
std::string empty_workload_reason(const WorkloadCliOptions& o) {
  const std::string none = "the workload has no requests: ";
  if (o.num_prompts == 0 && !o.trace()) return none + "--num-prompts 0";
  if (o.dataset == "sharegpt") {
    const bench::ShareGptOptions d;
    return none + "no conversation of sharegpt dataset " + o.dataset_path +
           " has two turns within the length filters (prompt and completion at least " +
           std::to_string(d.min_len) + " tokens, the prompt at most " +
           std::to_string(d.max_prompt_len) + ", both at most " + std::to_string(d.max_total_len) +
           ")";
  }
  if (o.trace()) {
    // A window past every record: the file's records are counted and none is parsed.
    const bench::TraceWindow all{std::numeric_limits<int64_t>::max(), 0, 1};
    int64_t records = 0;
    if (o.dataset == "mooncake")
      bench::read_mooncake_trace(o.dataset_path, all, bench::MooncakeOptions{}.block_size,
                                 &records);
    else
      bench::read_azure_trace(o.dataset_path, all, &records);
    const std::string what = o.dataset + " trace " + o.dataset_path;
    if (records == 0) return none + what + ": no records";
    return none + "--trace-start " + std::to_string(o.trace_start) + " is past the " +
           std::to_string(records) + " records of " + what;
  }
  return "the workload has no requests";
}

}  // namespace

void set_prompt_bos(const WorkloadCliOptions& o, const text::Tokenizer& tok,
                    bench::DriverOptions& driver) {
  driver.bos_id = o.trace() ? std::nullopt : tok.bos_id();
  driver.count_bos = o.dataset != "prefix-repetition";
}

bool ignore_eos_of(const WorkloadCliOptions& o, bool ignore_eos, bool no_ignore_eos) {
  return !no_ignore_eos && (ignore_eos || o.dataset == "random");
}

void check_workload_options(const WorkloadCliOptions& o) {
  check_workload_flags(o);
  if ((o.trace() || o.dataset == "sharegpt") && o.dataset_path.empty())
    throw Error("--dataset-name " + o.dataset + " needs --dataset-path");
  check_trace_spread(o);
  check_unused_flags(o);
}

bench::LazyWorkload build_lazy_workload(const WorkloadCliOptions& o, const text::Tokenizer& tok) {
  check_workload_options(o);
  if (!o.trace() || o.dataset_path.empty()) return bench::lazy(build_workload(o, tok));
  // A trace is its records (a few numbers, or hash ids, each) until a request is sent, so a
  // whole trace needs no bound on its prompt tokens in all (the Mooncake conversation trace has
  // 145 M).
  const bench::TraceWindow window = trace_window(o);
  auto vocab = std::make_shared<const bench::TokenVocab>(bench::TokenVocab::build(tok));
  bench::LazyWorkload w;
  if (o.dataset == "mooncake") {
    bench::MooncakeOptions m;
    m.path = o.dataset_path;
    m.window = window;
    m.seed = o.seed;
    m.spread = o.trace_spread;
    auto records = std::make_shared<const std::vector<bench::MooncakeRecord>>(
        bench::read_mooncake_trace(m.path, m.window, m.block_size));
    if (records->empty()) throw Error(empty_workload_reason(o));
    w.arrival_s = std::isfinite(o.request_rate)
                      ? rate_arrivals(records->size(), o)
                      : bench::mooncake_arrivals(*records, o.time_scale, m.spread, m.seed);
    w.make = [records, vocab, m, arrivals = w.arrival_s](size_t i) {
      bench::BenchRequest r;
      r.arrival_s = arrivals.at(i);
      r.prompt_ids = bench::mooncake_prompt(*vocab, records->at(i), m.block_size, m.seed);
      r.output_len = records->at(i).output_length;
      return r;
    };
    return w;
  }
  auto records = std::make_shared<const std::vector<bench::AzureRecord>>(
      bench::read_azure_trace(o.dataset_path, window));
  if (records->empty()) throw Error(empty_workload_reason(o));
  w.arrival_s = std::isfinite(o.request_rate) ? rate_arrivals(records->size(), o)
                                              : bench::azure_arrivals(*records, o.time_scale);
  w.make = [records, vocab, seed = o.seed, arrivals = w.arrival_s](size_t i) {
    bench::BenchRequest r;
    r.arrival_s = arrivals.at(i);
    r.prompt_ids = bench::azure_prompt(*vocab, records->at(i), seed);
    r.output_len = records->at(i).generated_tokens;
    return r;
  };
  return w;
}

std::vector<bench::BenchRequest> build_workload(const WorkloadCliOptions& o,
                                                const text::Tokenizer& tok) {
  check_workload_options(o);
  const auto vocab = bench::TokenVocab::build(tok);
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
    s.num_requests_name = "--num-prompts";
    s.seed = o.seed;
    reqs = bench::sharegpt_workload(tok, s);
  } else if (o.dataset == "mooncake") {
    bench::MooncakeOptions m;
    m.path = o.dataset_path;
    m.window = trace_window(o);
    m.seed = o.seed;
    m.spread = o.trace_spread;
    reqs = bench::mooncake_workload(vocab, m);
  } else if (o.dataset == "azure") {
    bench::AzureOptions a;
    a.path = o.dataset_path;
    a.window = trace_window(o);
    a.seed = o.seed;
    reqs = bench::azure_workload(vocab, a);
  } else {
    throw Error(
        "--dataset-name: expected random, prefix-repetition, sharegpt, mooncake or azure, "
        "got '" +
        o.dataset + "'");
  }
  if (reqs.empty()) throw Error(empty_workload_reason(o));
  // Traces keep their own timestamps unless a rate is given; the others follow the rate.
  if (!o.trace() || std::isfinite(o.request_rate))
    bench::apply_arrivals(reqs, rate_arrivals(reqs.size(), o));
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

std::optional<double> whole_number(const std::string& text) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size() && std::isfinite(v)) return v;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

namespace {

constexpr const char* kPercentileMetrics[] = {"ttft", "tpot", "itl", "e2el", "tbt"};

}  // namespace

// Everything is checked here, before the run: summarize() would only refuse it after the run.
bench::MetricsOptions metrics_options(const MetricsCliOptions& o) {
  bench::MetricsOptions m;
  m.percentile_metrics = split(o.percentile_metrics, ',');
  for (const auto& name : m.percentile_metrics)
    if (std::find(std::begin(kPercentileMetrics), std::end(kPercentileMetrics), name) ==
        std::end(kPercentileMetrics))
      throw Error("--percentile-metrics: unknown metric '" + name +
                  "' (expected ttft, tpot, itl, e2el or tbt)");
  m.percentiles.clear();
  for (const auto& p : split(o.metric_percentiles, ',')) {
    const std::optional<double> v = whole_number(p);
    if (!v || *v < 0 || *v > 100)
      throw Error("--metric-percentiles: expected numbers in 0..100, got '" + p + "'");
    m.percentiles.push_back(*v);
  }
  for (const auto& g : o.goodput) {
    const auto colon = g.find(':');
    double ms = -1;  // not an SLO
    if (colon != std::string::npos) ms = whole_number(g.substr(colon + 1)).value_or(-1);
    const std::string key = g.substr(0, colon);
    // vLLM refuses only values below 0: an SLO of 0 ms is one no request meets.
    if (!(ms >= 0))
      throw Error(
          "--goodput: expected KEY:MS with KEY ttft, tpot, e2el or tbt and MS a number >= 0, got "
          "'" +
          g + "'");
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

void write_output(const std::string& flag, const std::string& path, std::string_view bytes) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status)) {
    // A pipe or a device (/dev/stdout): nothing to replace, so written in place.
    std::ofstream f(path, std::ios::binary);
    f.write(bytes.data(), std::streamsize(bytes.size()));
    f.flush();
    if (!f) throw Error(flag + ": cannot write " + path);
    return;
  }
  // A file is replaced whole: a failed write leaves the one before, never an emptied one.
  try {
    write_file_atomically(path, bytes);
  } catch (const Error& e) {
    throw Error(flag + ": " + e.what());
  }
}

void check_output(const std::string& flag, const std::string& path) {
  if (path.empty()) return;
  const std::string what = flag + " " + path;
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (std::filesystem::is_directory(status)) throw Error(what + ": is a directory, not a file");
  // A pipe or a device is written in place; opening a pipe now would wait for its reader.
  if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status)) return;
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  const auto dir_status = std::filesystem::status(dir, ec);
  if (!std::filesystem::exists(dir_status))
    throw Error(what + ": no such directory " + dir.string());
  if (!std::filesystem::is_directory(dir_status))
    throw Error(what + ": " + dir.string() + " is not a directory");
  // A file is made beside it and renamed over it (write_output): made and removed here the same
  // way, which permissions, a read-only file system and a full inode table all answer for.
  std::string probe = path + ".check-XXXXXX";
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) {
    const int err = errno;
    throw Error(what + ": cannot make a file in " + dir.string() + " (" + std::strerror(err) + ")");
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

void check_outputs(const RunOutputs& outputs) {
  check_output("--result-file", outputs.result_file);
  check_output("--html", outputs.html);
}

std::string result_json_text(const json& result) {
  // Strings that came from outside (a server's errors, a flag's value) may hold bytes that are
  // not UTF-8, which dump() would throw on after the run: they are written as U+FFFD instead.
  return result.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
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
  const std::string result = outputs.result_file.empty() ? "" : result_json_text(out);
  std::fputs(table.c_str(), stdout);
  std::fflush(stdout);
  if (!outputs.result_file.empty()) {
    write_output("--result-file", outputs.result_file, result);
    std::fprintf(stderr, "%s: results in %s\n", program, outputs.result_file.c_str());
  }
  if (!outputs.html.empty()) {
    // The report reads the access log last: a log that went bad during the run costs the report
    // alone, not the table and the result file.
    bench::ReportOptions report = run.report;
    if (run.access_log) report.access_log = run.access_log();
    write_output("--html", outputs.html, bench::html_report(summary, results, report));
    std::fprintf(stderr, "%s: report in %s\n", program, outputs.html.c_str());
  }
  // A run whose every request failed measured nothing: its table of zeros must not pass for a
  // result. What was written stays, to tell why.
  if (summary.completed == 0 && summary.failed > 0) {
    std::string first;
    for (const auto& r : results)
      if (!r.success && !r.error.empty()) {
        first = r.error;
        break;
      }
    first = first.substr(0, std::min(first.find('\n'), size_t{300}));
    const std::string what = "all " + std::to_string(summary.failed) +
                             " requests failed: nothing was measured" +
                             (first.empty() ? "" : "; the first failed with: " + first);
    if (run.nothing_measured_fails) throw Error(what);
    std::fprintf(stderr, "%s: warning: %s\n", program, what.c_str());
  }
}

}  // namespace tandem::cli
