// Tests of src/util/metrics. The rendered text is parsed by an independent oracle
// (util/prometheus_oracle.h: tests/oracle/parse_prometheus.py, a strict grammar check plus the
// Prometheus Python client's parser); a missing package is a failure, not a skip. The parsed
// samples must equal what the test recorded.
#include "util/metrics.h"

#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "util/error.h"
#include "util/prometheus_oracle.h"
#include "util/utf8.h"

namespace tandem::metrics {
namespace {

using nlohmann::json;

// Runs the oracle on `text`; returns its JSON, or fails the test with its stderr.
json parse_with_oracle(const std::string& text) {
  return test::parse_prometheus(text);
}

double json_number(const json& v) {
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    if (s == "+Inf") return INFINITY;
    if (s == "-Inf") return -INFINITY;
    if (s == "NaN") return NAN;
    ADD_FAILURE() << "unexpected value " << s;
    return 0;
  }
  return v.get<double>();
}

// A sample's identity: name plus its labels in sorted order (label order is not semantic).
using SampleKey = std::pair<std::string, std::map<std::string, std::string>>;

std::map<SampleKey, double> samples_of(const json& parsed) {
  std::map<SampleKey, double> out;
  for (const auto& family : parsed["families"]) {
    for (const auto& s : family["samples"]) {
      SampleKey key{s["name"].get<std::string>(),
                    s["labels"].get<std::map<std::string, std::string>>()};
      EXPECT_FALSE(out.count(key)) << "duplicate sample " << key.first;
      out[key] = json_number(s["value"]);
    }
  }
  return out;
}

// Adds the samples a histogram with these observations must render.
void expect_histogram(std::map<SampleKey, double>& expected, const std::string& name,
                      const std::map<std::string, std::string>& labels,
                      const std::vector<double>& bounds, const std::vector<double>& values) {
  auto with_le = [&](const std::string& le) {
    auto l = labels;
    l["le"] = le;
    return l;
  };
  double sum = 0;
  for (double v : values) sum += v;
  for (double bound : bounds) {
    double n = 0;
    for (double v : values) n += v <= bound ? 1 : 0;
    // The parser keeps the le text; compare through its float value instead.
    expected[{name + "_bucket", with_le("bound:" + std::to_string(bound))}] = n;
  }
  expected[{name + "_bucket", with_le("+Inf")}] = static_cast<double>(values.size());
  expected[{name + "_sum", labels}] = sum;
  expected[{name + "_count", labels}] = static_cast<double>(values.size());
}

// Rewrites parsed `le` labels "0.25" -> "bound:0.250000" so they match expect_histogram's keys
// whatever spelling of the number the renderer chose.
std::map<SampleKey, double> normalize_le(const std::map<SampleKey, double>& in) {
  std::map<SampleKey, double> out;
  for (const auto& [original, value] : in) {
    SampleKey key = original;
    auto it = key.second.find("le");
    if (it != key.second.end() && it->second != "+Inf") {
      it->second = "bound:" + std::to_string(std::stod(it->second));
    }
    out[key] = value;
  }
  return out;
}

const std::string kAwkward = "quote \" backslash \\ newline \n brace } comma , equals = \xc3\xbc";

TEST(Metrics, RendersEveryKindAndTheOracleReadsBackTheRecordedValues) {
  Registry registry;
  const LabelPairs engine = {{"model_name", kAwkward}, {"engine", "0"}};
  std::map<SampleKey, double> expected;
  const std::map<std::string, std::string> engine_map = {{"model_name", kAwkward}, {"engine", "0"}};
  auto with = [&](std::map<std::string, std::string> extra) {
    auto l = engine_map;
    l.insert(extra.begin(), extra.end());
    return l;
  };

  auto& running = registry.gauge("vllm:num_requests_running",
                                 "Number of requests in model execution batches.", engine);
  running.set(7);
  running.inc();
  running.dec(3);
  expected[{"vllm:num_requests_running", engine_map}] = 5;

  auto& prompt_tokens = registry.int_counter("vllm:prompt_tokens_total",
                                             "Number of prefill tokens processed.", engine);
  prompt_tokens.inc(12345678901ULL);
  prompt_tokens.inc();
  expected[{"vllm:prompt_tokens_total", engine_map}] = 12345678902.0;

  auto& busy =
      registry.counter("tandem_busy_seconds_total", "Help with a backslash \\ and a\nnewline.");
  busy.inc(0.125);
  busy.inc(1e-9);
  expected[{"tandem_busy_seconds_total", {}}] = 0.125 + 1e-9;

  auto& success = registry.int_counter_family("vllm:request_success_total",
                                              "Count of successfully processed requests.",
                                              {"finished_reason"}, engine);
  success.labels({"stop"}).inc(3);
  success.labels({"length"}).inc(2);
  success.labels({"abort"});
  success.labels({"stop"}).inc();
  expected[{"vllm:request_success_total", with({{"finished_reason", "stop"}})}] = 4;
  expected[{"vllm:request_success_total", with({{"finished_reason", "length"}})}] = 2;
  expected[{"vllm:request_success_total", with({{"finished_reason", "abort"}})}] = 0;

  auto& odd = registry.gauge_family("odd_values", "", {"a", "b"});
  odd.labels({kAwkward, ""}).set(-2.5);
  odd.labels({"}{", "\\n is not a newline"}).set(INFINITY);
  odd.labels({"x", "y"}).set(-INFINITY);
  odd.labels({"tiny", "huge"}).set(1e-300);
  odd.labels({"huge", "tiny"}).set(1.7976931348623157e308);
  expected[{"odd_values", {{"a", kAwkward}, {"b", ""}}}] = -2.5;
  expected[{"odd_values", {{"a", "}{"}, {"b", "\\n is not a newline"}}}] = INFINITY;
  expected[{"odd_values", {{"a", "x"}, {"b", "y"}}}] = -INFINITY;
  expected[{"odd_values", {{"a", "tiny"}, {"b", "huge"}}}] = 1e-300;
  expected[{"odd_values", {{"a", "huge"}, {"b", "tiny"}}}] = 1.7976931348623157e308;

  registry.counter_family("never_used_total", "A family without children.", {"x"});

  auto& ttft = registry.histogram("vllm:time_to_first_token_seconds",
                                  "Histogram of time to first token in seconds.",
                                  vllm_ttft_buckets(), engine);
  const std::vector<double> ttft_values = {0.0005, 0.001, 0.0011, 0.25, 0.3, 2560, 3000, -1};
  for (double v : ttft_values) ttft.observe(v);
  expect_histogram(expected, "vllm:time_to_first_token_seconds", engine_map, vllm_ttft_buckets(),
                   ttft_values);

  auto& steps =
      registry.histogram_family("step_tokens", "Tokens per step.", {"role"}, {1, 2, 4, 8, 1e6});
  const std::vector<double> prefill_values = {1, 2, 3, 1e6, 1e7};
  for (double v : prefill_values) steps.labels({"prefill"}).observe(v);
  expect_histogram(expected, "step_tokens", {{"role", "prefill"}}, {1, 2, 4, 8, 1e6},
                   prefill_values);
  steps.labels({"decode \"d\""});
  expect_histogram(expected, "step_tokens", {{"role", "decode \"d\""}}, {1, 2, 4, 8, 1e6}, {});

  const std::string text = registry.render();
  const json parsed = parse_with_oracle(text);
  ASSERT_FALSE(parsed.is_null());

  // Families in registration order, with their types and (unescaped) help.
  struct Family {
    std::string name, type, help;
  };
  const std::vector<Family> families = {
      {"vllm:num_requests_running", "gauge", "Number of requests in model execution batches."},
      {"vllm:prompt_tokens", "counter", "Number of prefill tokens processed."},
      {"tandem_busy_seconds", "counter", "Help with a backslash \\ and a\nnewline."},
      {"vllm:request_success", "counter", "Count of successfully processed requests."},
      {"odd_values", "gauge", ""},
      {"never_used", "counter", "A family without children."},
      {"vllm:time_to_first_token_seconds", "histogram",
       "Histogram of time to first token in seconds."},
      {"step_tokens", "histogram", "Tokens per step."},
  };
  ASSERT_EQ(parsed["families"].size(), families.size()) << text;
  for (size_t i = 0; i < families.size(); ++i) {
    EXPECT_EQ(parsed["families"][i]["name"], families[i].name);
    EXPECT_EQ(parsed["families"][i]["type"], families[i].type);
    EXPECT_EQ(parsed["families"][i]["help"], families[i].help);
  }

  const auto got = normalize_le(samples_of(parsed));
  EXPECT_EQ(got.size(), expected.size());
  for (const auto& [key, value] : expected) {
    auto it = got.find(key);
    if (it == got.end()) {
      ADD_FAILURE() << "missing sample " << key.first << " in\n" << text;
      continue;
    }
    EXPECT_EQ(it->second, value) << key.first;
  }
  for (const auto& [key, value] : got) {
    EXPECT_TRUE(expected.count(key)) << "unexpected sample " << key.first;
  }
}

TEST(Metrics, ConcurrentUpdatesAndScrapesAddUpExactly) {
  Registry registry;
  auto& tokens = registry.int_counter("tokens_total", "tokens");
  auto& seconds = registry.counter("seconds_total", "seconds");
  auto& inflight = registry.gauge("inflight", "in flight");
  auto& latency = registry.histogram("latency_seconds", "latency", {0.5, 1, 2});
  auto& reasons = registry.int_counter_family("finished_total", "finished", {"finished_reason"});
  auto& per_thread = registry.gauge_family("per_thread", "one child per thread", {"thread"});

  constexpr int kThreads = 4;
  constexpr int kIterations = 20000;
  const std::vector<std::string> reason_names = {"stop", "length", "abort"};
  std::atomic<bool> done{false};
  std::vector<std::string> scrapes;
  std::thread scraper([&] {
    // Scrapes while the writers run; a few are kept for the oracle.
    int n = 0;
    while (!done.load()) {
      std::string text = registry.render();
      if (n++ % 50 == 0 && scrapes.size() < 3) scrapes.push_back(std::move(text));
    }
    scrapes.push_back(registry.render());
  });
  std::vector<std::thread> writers;
  for (int t = 0; t < kThreads; ++t) {
    writers.emplace_back([&, t] {
      auto& mine = per_thread.labels({std::to_string(t)});
      for (int i = 0; i < kIterations; ++i) {
        tokens.inc(3);
        seconds.inc(0.25);  // exact in binary, so the sum is exact in any order
        inflight.inc();
        latency.observe((i % 4) * 0.75);  // 0, 0.75, 1.5, 2.25
        reasons.labels({reason_names[i % 3]}).inc();
        mine.inc(2);
        inflight.dec();
      }
    });
  }
  for (auto& w : writers) w.join();
  done = true;
  scraper.join();

  // Scrapes taken mid-run parse and are self-consistent (count equals the +Inf bucket).
  EXPECT_GE(scrapes.size(), 2u);
  for (size_t s = 0; s + 1 < scrapes.size(); ++s) {
    const auto mid = samples_of(parse_with_oracle(scrapes[s]));
    const double count = mid.at({"latency_seconds_count", {}});
    EXPECT_EQ(mid.at({"latency_seconds_bucket", {{"le", "+Inf"}}}), count);
    EXPECT_LE(mid.at({"latency_seconds_bucket", {{"le", "0.5"}}}),
              mid.at({"latency_seconds_bucket", {{"le", "1.0"}}}));
    EXPECT_LE(mid.at({"latency_seconds_bucket", {{"le", "1.0"}}}),
              mid.at({"latency_seconds_bucket", {{"le", "2.0"}}}));
    EXPECT_LE(mid.at({"latency_seconds_bucket", {{"le", "2.0"}}}), count);
  }

  const auto got = samples_of(parse_with_oracle(scrapes.back()));
  const double n = static_cast<double>(kThreads) * kIterations;
  EXPECT_EQ(got.at({"tokens_total", {}}), 3 * n);
  EXPECT_EQ(got.at({"seconds_total", {}}), 0.25 * n);
  EXPECT_EQ(got.at({"inflight", {}}), 0);
  EXPECT_EQ(got.at({"latency_seconds_bucket", {{"le", "0.5"}}}), n / 4);
  EXPECT_EQ(got.at({"latency_seconds_bucket", {{"le", "1.0"}}}), n / 2);
  EXPECT_EQ(got.at({"latency_seconds_bucket", {{"le", "2.0"}}}), 3 * n / 4);
  EXPECT_EQ(got.at({"latency_seconds_bucket", {{"le", "+Inf"}}}), n);
  EXPECT_EQ(got.at({"latency_seconds_count", {}}), n);
  EXPECT_EQ(got.at({"latency_seconds_sum", {}}), (0 + 0.75 + 1.5 + 2.25) * n / 4);
  double reason_total = 0;
  for (const auto& r : reason_names) {
    reason_total += got.at({"finished_total", {{"finished_reason", r}}});
  }
  EXPECT_EQ(reason_total, n);
  // 20000 iterations per thread: i % 3 == 0 occurs 6667 times, 1 and 2 6667 and 6666 times.
  EXPECT_EQ(got.at({"finished_total", {{"finished_reason", "stop"}}}), kThreads * 6667.0);
  EXPECT_EQ(got.at({"finished_total", {{"finished_reason", "abort"}}}), kThreads * 6666.0);
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(got.at({"per_thread", {{"thread", std::to_string(t)}}}), 2.0 * kIterations);
  }
}

TEST(Metrics, ExactTextOfASmallRegistry) {
  Registry registry;
  registry
      .int_counter_family("vllm:request_success_total", "Finished requests.", {"finished_reason"},
                          {{"engine", "0"}})
      .labels({"stop"})
      .inc(2);
  auto& h = registry.histogram("h", "a \\ b\nc", {0.5, 1, 2560});
  h.observe(1);
  h.observe(0.1);
  registry.gauge("g", "gauge").set(0.1);
  EXPECT_EQ(registry.render(),
            "# HELP vllm:request_success_total Finished requests.\n"
            "# TYPE vllm:request_success_total counter\n"
            "vllm:request_success_total{engine=\"0\",finished_reason=\"stop\"} 2\n"
            "# HELP h a \\\\ b\\nc\n"
            "# TYPE h histogram\n"
            "h_bucket{le=\"0.5\"} 1\n"
            "h_bucket{le=\"1.0\"} 2\n"
            "h_bucket{le=\"2560.0\"} 2\n"
            "h_bucket{le=\"+Inf\"} 2\n"
            "h_sum 1.1\n"
            "h_count 2\n"
            "# HELP g gauge\n"
            "# TYPE g gauge\n"
            "g 0.1\n");
}

// Expected texts are prometheus_client's floatToGoString (utils.py) of each value, run in Python.
TEST(Metrics, BucketBoundsAreWrittenAsPrometheusClientWritesThem) {
  const std::pair<double, const char*> table[] = {
      {0.0, "0.0"},
      {-0.0, "-0.0"},
      {1.0, "1.0"},
      {0.5, "0.5"},
      {0.1, "0.1"},
      {7.5, "7.5"},
      {0.001, "0.001"},
      {0.0001, "0.0001"},
      {0.00001, "1e-05"},
      {0.000015, "1.5e-05"},
      {3e-05, "3e-05"},
      {1e-300, "1e-300"},
      {2560.0, "2560.0"},
      {100000.0, "100000.0"},
      {999999.0, "999999.0"},
      {123456.5, "123456.5"},
      {1e6, "1e+06"},
      {2.5e6, "2.5e+06"},
      {1234567.0, "1.234567e+06"},
      {12345678.5, "1.23456785e+07"},
      {1e15, "1e+015"},
      {1e16, "1e+16"},
      {1.5e16, "1.5e+16"},
      {1e22, "1e+22"},
      {1.7976931348623157e308, "1.7976931348623157e+308"},
      {-1.0, "-1.0"},
      {-1e6, "-1000000.0"},
      {-0.00001, "-1e-05"},
      {INFINITY, "+Inf"},
      {-INFINITY, "-Inf"},
  };
  for (const auto& [value, text] : table) EXPECT_EQ(format_le(value), text) << value;
  Registry registry;
  registry.histogram("h", "h", {1e5, 1e6}).observe(1);
  EXPECT_NE(registry.render().find("h_bucket{le=\"100000.0\"} 1\nh_bucket{le=\"1e+06\"} 1\n"),
            std::string::npos)
      << registry.render();
}

TEST(Metrics, HistogramBucketsAreUpperInclusive) {
  Histogram h({1, 2, INFINITY});
  EXPECT_EQ(h.bounds(), (std::vector<double>{1, 2}));
  for (double v : {-5.0, 1.0, 1.0000001, 2.0, 2.5}) h.observe(v);
  const auto snap = h.snapshot();
  EXPECT_EQ(snap.cumulative, (std::vector<uint64_t>{2, 4, 5}));
  EXPECT_EQ(snap.count, 5u);
  EXPECT_DOUBLE_EQ(snap.sum, -5 + 1 + 1.0000001 + 2 + 2.5);
}

// NaN (a duration computed from a missing stamp, say) is counted in the +Inf bucket only, and
// the sum stays a number: it used to land in the first bucket, and _sum became NaN for good.
TEST(Metrics, NanIsCountedInTheInfBucketOnlyAndLeavesTheSumANumber) {
  Registry registry;
  Histogram& h = registry.histogram("h", "test", {1, 2});
  h.observe(0.5);
  h.observe(NAN);
  h.observe(NAN, 2);
  h.observe(1.5);
  const auto snap = h.snapshot();
  EXPECT_EQ(snap.cumulative, (std::vector<uint64_t>{1, 2, 5}));
  EXPECT_EQ(snap.count, 5u);
  EXPECT_DOUBLE_EQ(snap.sum, 2.0);
  const auto parsed = normalize_le(samples_of(parse_with_oracle(registry.render())));
  std::string le_one = "bound:";
  le_one += std::to_string(1.0);  // (appended: GCC 12's -Wrestrict misreads "..." + string)
  EXPECT_EQ(parsed.at({"h_bucket", {{"le", le_one}}}), 1);
  EXPECT_EQ(parsed.at({"h_bucket", {{"le", "+Inf"}}}), 5);
  EXPECT_EQ(parsed.at({"h_sum", {}}), 2.0);
}

// A removed child is rendered no more; the same labels later start a new child at 0. The other
// children, and their order, stay.
TEST(Metrics, ARemovedChildIsGoneAndItsLabelsStartAgainAtZero) {
  for (int kind = 0; kind < 4; ++kind) {
    Registry registry;
    std::string name = "m";
    name += std::to_string(kind);
    auto check = [&](auto& family, auto bump, auto value_of) {
      bump(family.labels({"a"}));
      bump(family.labels({"b"}));
      bump(family.labels({"c"}));
      EXPECT_TRUE(family.remove({"b"}));
      EXPECT_FALSE(family.remove({"b"}));
      EXPECT_FALSE(family.remove({"never"}));
      const std::string text = registry.render();
      EXPECT_EQ(text.find("\"b\""), std::string::npos) << text;
      EXPECT_LT(text.find("\"a\""), text.find("\"c\"")) << text;
      parse_with_oracle(text);  // still well-formed
      EXPECT_EQ(value_of(family.labels({"b"})), 0) << name;
      EXPECT_NE(registry.render().find("\"b\""), std::string::npos);
    };
    auto value = [](auto& m) { return static_cast<double>(m.value()); };
    switch (kind) {
      case 0:
        check(
            registry.counter_family(name, "t", {"e"}), [](Counter& c) { c.inc(2); }, value);
        break;
      case 1:
        check(
            registry.int_counter_family(name, "t", {"e"}), [](IntCounter& c) { c.inc(2); }, value);
        break;
      case 2:
        check(
            registry.gauge_family(name, "t", {"e"}), [](Gauge& g) { g.set(2); }, value);
        break;
      case 3:
        check(
            registry.histogram_family(name, "t", {"e"}, {1}), [](Histogram& h) { h.observe(0.5); },
            [](Histogram& h) { return static_cast<double>(h.snapshot().count); });
        break;
    }
  }
}

// A registry's constant labels go first on every sample of every family, of every kind
// (gateway replicas behind one port: {gateway_replica="k"} keeps their series apart).
TEST(Metrics, ARegistrysConstantLabelsAreOnEverySample) {
  Registry registry({{"gateway_replica", "1"}, {"zone", kAwkward}});
  registry.int_counter("plain_total", "t").inc(3);
  registry.counter_family("reasons_total", "t", {"reason"}, {{"engine", "0"}})
      .labels({"stop"})
      .inc(2);
  registry.gauge("g", "t").set(0.5);
  auto& h = registry.histogram_family("h", "t", {"pool"}, {1});
  h.labels({"decode"}).observe(0.5);
  h.labels({"decode"}).observe(3);
  const std::string text = registry.render();
  EXPECT_NE(text.find("plain_total{gateway_replica=\"1\",zone="), std::string::npos) << text;
  EXPECT_NE(text.find("reasons_total{gateway_replica=\"1\",zone=\"quote \\\" backslash"),
            std::string::npos)
      << text;
  const std::map<std::string, std::string> base = {{"gateway_replica", "1"}, {"zone", kAwkward}};
  auto with = [&](std::map<std::string, std::string> more) {
    more.insert(base.begin(), base.end());
    return more;
  };
  std::map<SampleKey, double> expected = {
      {{"plain_total", base}, 3},
      {{"reasons_total", with({{"engine", "0"}, {"reason", "stop"}})}, 2},
      {{"g", base}, 0.5}};
  expect_histogram(expected, "h", with({{"pool", "decode"}}), {1}, {0.5, 3});
  EXPECT_EQ(normalize_le(samples_of(parse_with_oracle(text))), expected);
  // A family may not name a registry label again; the registry's names are checked too.
  auto error_of = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(error_of([&] {
              registry.gauge_family("x", "", {"gateway_replica"});
            }).find("\"gateway_replica\" appears twice"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              registry.gauge("y", "", {{"zone", "a"}});
            }).find("\"zone\" appears twice"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              Registry(LabelPairs{{"a", "1"}, {"a", "2"}});
            }).find("\"a\" appears twice"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              Registry(LabelPairs{{"le", "1"}});
            }).find("reserved"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              Registry(LabelPairs{{"1x", "1"}});
            }).find("\"1x\" is invalid"),
            std::string::npos);
}

// Replicas behind one port (`tandem serve --gateways 2`): a scrape reaches one of them, on a
// keep-alive connection always the same one, so each replica's registry alone showed only its own
// share of the requests. In one group, either member's render shows both replicas' series, each
// family's HELP and TYPE once with all its samples together, as the oracle reads them; a member
// that is gone is rendered no more.
TEST(Metrics, ARegistryGroupRendersEveryMembersSeriesUnderOneHelpAndType) {
  const auto group = std::make_shared<RegistryGroup>();
  auto replica = [&](const std::string& k) {
    return std::make_unique<Registry>(LabelPairs{{"gateway_replica", k}}, group);
  };
  auto zero = replica("0");
  auto one = replica("1");
  std::map<SampleKey, double> expected;
  for (const auto& [k, r] : {std::pair{"0", zero.get()}, std::pair{"1", one.get()}}) {
    const double n = k == std::string("0") ? 7 : 23;
    r->int_counter_family("requests_total", "requests", {"status"})
        .labels({"200"})
        .inc(static_cast<uint64_t>(n));
    r->gauge("in_flight", "in flight").set(n);
    r->histogram("latency_seconds", "latency", {1}).observe(n);
    const std::map<std::string, std::string> labels = {{"gateway_replica", k}};
    expected[{"requests_total", {{"gateway_replica", k}, {"status", "200"}}}] = n;
    expected[{"in_flight", labels}] = n;
    expect_histogram(expected, "latency_seconds", labels, {1}, {n});
  }
  for (const Registry* r : {zero.get(), one.get()}) {
    const std::string text = r->render();
    const json parsed = parse_with_oracle(text);
    EXPECT_EQ(normalize_le(samples_of(parsed)), expected) << text;
    std::vector<std::string> names;
    for (const auto& family : parsed["families"]) names.push_back(family["name"]);
    EXPECT_EQ(names, (std::vector<std::string>{"requests", "in_flight", "latency_seconds"}))
        << text;
    for (const std::string header : {"# HELP ", "# TYPE "})
      for (const std::string name : {"requests_total", "in_flight", "latency_seconds"}) {
        const size_t at = text.find(header + name + " ");
        ASSERT_NE(at, std::string::npos) << text;
        EXPECT_EQ(text.find(header + name + " ", at + 1), std::string::npos) << text;
      }
  }
  one.reset();
  std::map<SampleKey, double> only_zero;
  for (const auto& [key, value] : expected)
    if (key.second.at("gateway_replica") == "0") only_zero[key] = value;
  EXPECT_EQ(normalize_le(samples_of(parse_with_oracle(zero->render()))), only_zero);
}

// The exposition is UTF-8, and a label value may be a client's text (a model name): an ill-formed
// sequence in it becomes U+FFFD per maximal subpart, as Python's bytes.decode("utf-8", "replace")
// reads it (the expected values below are that function's), so a scraper can still read the page.
TEST(Metrics, ALabelValueThatIsNoUtf8HasItsBadBytesReplaced) {
  const std::string kReplacement = "\xef\xbf\xbd";
  const std::vector<std::pair<std::string, std::string>> values = {
      {"model-\xff", "model-" + kReplacement},
      {"a\xc3", "a" + kReplacement},
      {"\xe2\x82x", kReplacement + "x"},
      {"\xed\xa0\x80", kReplacement + kReplacement + kReplacement},
      {"\xc0\xaf\"", kReplacement + kReplacement + "\""},
      {"ok \xc3\xbc", "ok \xc3\xbc"}};
  Registry registry(LabelPairs{{"zone", "\xfe"}});
  auto& family = registry.gauge_family("g", "t", {"model"});
  std::map<SampleKey, double> expected;
  double n = 0;
  for (const auto& [sent, read] : values) {
    family.labels({sent}).set(++n);
    expected[{"g", {{"zone", kReplacement}, {"model", read}}}] = n;
  }
  const std::string text = registry.render();
  EXPECT_EQ(utf8::to_valid_lossy(text), text);
  EXPECT_EQ(samples_of(parse_with_oracle(text)), expected);
}

TEST(Metrics, RepeatedObservationsEqualSingleOnes) {
  Histogram once({1, 2}), repeated({1, 2});
  for (int i = 0; i < 3; ++i) once.observe(1.5);
  once.observe(0.5);
  repeated.observe(1.5, 3);
  repeated.observe(0.5, 1);
  repeated.observe(7, 0);  // nothing
  const auto a = once.snapshot(), b = repeated.snapshot();
  EXPECT_EQ(a.cumulative, b.cumulative);
  EXPECT_EQ(b.count, 4u);
  EXPECT_DOUBLE_EQ(a.sum, b.sum);
}

TEST(Metrics, BadInputIsAnErrorNamingTheMetric) {
  Registry r;
  auto expect_error = [](auto&& fn, const std::string& fragment) {
    try {
      fn();
      ADD_FAILURE() << "expected an error mentioning " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  r.gauge("taken", "");
  r.histogram("lat", "", {1});
  expect_error([&] { r.gauge("taken", ""); }, "taken is already registered");
  expect_error([&] { r.counter("lat_count", ""); }, "lat_count is already registered");
  expect_error([&] { r.gauge("1bad", ""); }, "metric name \"1bad\" is invalid");
  expect_error([&] { r.gauge("bad-name", ""); }, "bad-name");
  expect_error([&] { r.gauge_family("x1", "", {"a:b"}); }, "label name \"a:b\" is invalid");
  expect_error([&] { r.gauge_family("x2", "", {"__reserved"}); }, "__reserved");
  expect_error([&] { r.gauge_family("x3", "", {"a", "a"}); }, "\"a\" appears twice");
  expect_error([&] { r.gauge_family("x4", "", {"a"}, {{"a", "1"}}); }, "\"a\" appears twice");
  expect_error([&] { r.histogram_family("x5", "", {"le"}, {1}); }, "reserved");
  expect_error([&] { r.histogram("x6", "", {2, 1}); }, "strictly increasing");
  expect_error([&] { r.histogram("x7", "", {1, NAN}); }, "finite");
  expect_error([&] { r.histogram("x8", "", {INFINITY, 1}); }, "finite");
  auto& family = r.counter_family("c_total", "", {"reason"});
  expect_error([&] { family.labels({}); }, "metric c_total: expected 1 label value(s), got 0");
  expect_error([&] { family.labels({"a", "b"}); }, "got 2");
  expect_error([&] { family.labels({"a"}).inc(-1); }, "non-negative");
  expect_error([&] { family.labels({"a"}).inc(NAN); }, "non-negative");
  // Failed registrations leave nothing behind.
  EXPECT_EQ(r.render().find("x5"), std::string::npos);
}

TEST(Metrics, VllmBuckets) {
  EXPECT_EQ(vllm_ttft_buckets().size(), 22u);
  EXPECT_EQ(vllm_ttft_buckets().front(), 0.001);
  EXPECT_EQ(vllm_ttft_buckets().back(), 2560.0);
  EXPECT_EQ(vllm_tpot_buckets().size(), 19u);
  EXPECT_EQ(vllm_tpot_buckets().front(), 0.01);
  EXPECT_EQ(vllm_tpot_buckets().back(), 80.0);
  EXPECT_EQ(vllm_request_latency_buckets().size(), 21u);
  EXPECT_EQ(vllm_request_latency_buckets().front(), 0.3);
  EXPECT_EQ(vllm_request_latency_buckets().back(), 7680.0);
  EXPECT_EQ(vllm_iteration_tokens_buckets().back(), 16384.0);
  for (const auto* b : {&vllm_ttft_buckets(), &vllm_tpot_buckets(), &vllm_request_latency_buckets(),
                        &vllm_iteration_tokens_buckets()}) {
    EXPECT_NO_THROW(Histogram{*b});
  }
  EXPECT_EQ(buckets_1_2_5(100), (std::vector<double>{1, 2, 5, 10, 20, 50, 100}));
  EXPECT_EQ(buckets_1_2_5(4096),
            (std::vector<double>{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000}));
  EXPECT_TRUE(buckets_1_2_5(0.5).empty());
}

}  // namespace
}  // namespace tandem::metrics
