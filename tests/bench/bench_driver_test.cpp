// `tandem bench`'s driver against deterministic servers in-process: a fake engine that answers
// each streamed request with a known timing (first token after 60 ms, then a token every 25 ms)
// so the measured TTFT and latency are never below those values (the server cannot be faster
// than its own sleeps; how much later a loaded machine reads each chunk is not bounded, so gaps
// are checked on synthetic times in StreamMeasurement's tests); failed requests are counted,
// never hidden; the concurrency cap holds; requests are never sent before their arrival time; a
// Mooncake replay sent as text reproduces the trace's prefix sharing when the server tokenizes
// what it received; and the CLI writes vLLM's result keys.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "api/error.h"
#include "bench/arrivals.h"
#include "bench/driver.h"
#include "bench/metrics.h"
#include "bench/stream_measure.h"
#include "bench/workload.h"
#include "model/model_test_support.h"
#include "net/http_server.h"
#include "net/sse.h"
#include "text/oracle_support.h"
#include "text/tokenizer.h"
#include "util/child_process.h"
#include "util/error.h"

namespace tandem::bench {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

constexpr double kTtft = 0.060, kItl = 0.025;

// Streams `max_tokens` one-token chunks: the first after kTtft, the others kItl apart, then the
// usage chunk and [DONE]. Every `fail_every`-th request (1-based) gets HTTP 500 instead.
class TimedServer {
 public:
  // `fail_body`: what the failures answer instead of an OpenAI error, as it is (text/plain).
  explicit TimedServer(int fail_every = 0, std::string fail_body = {})
      : fail_every_(fail_every), fail_body_(std::move(fail_body)) {
    net::HttpServerOptions o;
    o.host = "127.0.0.1";
    o.threads = 2;
    o.error_response = api::openai_error_response;
    server_ = std::make_unique<net::HttpServer>(o);
    // What vLLM's bench asks for when --model is not given.
    server_->route(
        "GET", "/v1/models", [](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
          ex->respond(200, R"({"object":"list","data":[{"id":"fake-model"}]})", "application/json");
        });
    for (const char* path : {"/v1/completions", "/v1/chat/completions"})
      server_->route("POST", path,
                     [this](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
                       handle(req, std::move(ex));
                     });
    server_->start();
  }
  ~TimedServer() {
    server_->stop();
    for (auto& t : threads_) t.join();
  }
  uint16_t port() const { return server_->port(); }
  int max_in_flight() const { return max_in_flight_; }
  std::vector<json> bodies() {
    std::lock_guard lock(mutex_);
    return bodies_;
  }

 private:
  void handle(const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
    const json body = json::parse(req.body);
    int n;
    {
      std::lock_guard lock(mutex_);
      bodies_.push_back(body);
      n = static_cast<int>(bodies_.size());
    }
    if (fail_every_ > 0 && n % fail_every_ == 0) {
      if (fail_body_.empty())
        ex->send_error(500, "fake failure", "server_error");
      else
        ex->respond(500, fail_body_, "text/plain");
      return;
    }
    const int64_t tokens = body.value("max_tokens", body.value("max_completion_tokens", 1));
    const int now = ++in_flight_;
    for (int m = max_in_flight_; now > m && !max_in_flight_.compare_exchange_weak(m, now);) {
    }
    std::lock_guard lock(mutex_);
    threads_.emplace_back([this, ex, tokens] {
      ex->start_stream(200, "text/event-stream");
      std::this_thread::sleep_for(std::chrono::duration<double>(kTtft));
      for (int64_t i = 0; i < tokens; ++i) {
        if (i > 0) std::this_thread::sleep_for(std::chrono::duration<double>(kItl));
        ex->write(net::sse_event(
            json{{"object", "text_completion"}, {"choices", {{{"index", 0}, {"text", " x"}}}}}
                .dump()));
      }
      ex->write(net::sse_event(json{{"object", "text_completion"},
                                    {"choices", json::array()},
                                    {"usage", {{"completion_tokens", tokens}}}}
                                   .dump()));
      --in_flight_;  // before the end: the client may send the next one at once
      ex->write(net::kSseDone);
      ex->end();
    });
  }

  int fail_every_;
  std::string fail_body_;
  std::unique_ptr<net::HttpServer> server_;
  std::mutex mutex_;
  std::vector<json> bodies_;
  std::vector<std::thread> threads_;
  std::atomic<int> in_flight_{0}, max_in_flight_{0};
};

std::vector<BenchRequest> uniform_requests(int n, int64_t prompt, int64_t output) {
  std::vector<BenchRequest> r(n);
  for (auto& q : r) {
    q.prompt_ids.assign(prompt, 1000);
    q.output_len = output;
  }
  return r;
}

TEST(BenchDriver, MeasuresAKnownServerAsVllmDefinesIt) {
  TimedServer server;
  DriverOptions o;
  o.port = server.port();
  o.max_concurrency = 4;
  const int64_t out = 9;
  const auto run = run_workload(uniform_requests(8, 20, out), o);
  ASSERT_EQ(run.results.size(), 8u);
  for (const auto& r : run.results) {
    ASSERT_TRUE(r.success) << r.error;
    // Only lower bounds: a chunk is never read before the server wrote it, but may be read late,
    // which shortens the gap after it (StreamMeasurement.TimesAreVllmsTtftGapsAndLatency checks
    // the gaps on synthetic times).
    EXPECT_GE(r.ttft_s, kTtft);
    ASSERT_EQ(r.itl_s.size(), static_cast<size_t>(out - 1));
    EXPECT_EQ(r.output_tokens, out);  // from the usage chunk
    EXPECT_EQ(r.prompt_tokens, 20);
    EXPECT_GE(r.latency_s, kTtft + (out - 1) * kItl);
    // One clock: the first token, then each gap, make the latency.
    double sum = r.ttft_s;
    for (double g : r.itl_s) {
      EXPECT_GE(g, 0);
      sum += g;
    }
    EXPECT_NEAR(sum, r.latency_s, 1e-9);
  }
  EXPECT_LE(server.max_in_flight(), 4);
  const BenchSummary s = summarize(run.results, run.duration_s);
  EXPECT_EQ(s.completed, 8);
  EXPECT_EQ(s.failed, 0);
  EXPECT_EQ(s.total_output_tokens, 8 * out);
  EXPECT_GE(s.ttft.median_ms, kTtft * 1000);
  // Two waves of four requests: the run lasts at least two request lifetimes.
  EXPECT_GE(run.duration_s, 2 * (kTtft + (out - 1) * kItl));
  EXPECT_NEAR(s.request_throughput, 8 / run.duration_s, 1e-9);
  EXPECT_NEAR(s.output_throughput, 8 * out / run.duration_s, 1e-9);
  // The body asks for exactly what vLLM's client asks for.
  const json b = server.bodies().at(0);
  EXPECT_EQ(b["max_tokens"], out);
  EXPECT_EQ(b["stream"], true);
  EXPECT_EQ(b["stream_options"]["include_usage"], true);
  EXPECT_EQ(b["ignore_eos"], true);
  EXPECT_EQ(b["prompt"].size(), 20u);
}

TEST(BenchDriver, ChatRequestsSendMessagesAndAreMeasuredTheSameWay) {
  TimedServer server;
  DriverOptions o;
  o.port = server.port();
  o.endpoint = "/v1/chat/completions";
  o.model = "m";
  auto reqs = uniform_requests(3, 4, 5);
  for (auto& r : reqs) r.prompt_text = " hello world";
  const auto run = run_workload(reqs, o);
  for (const auto& r : run.results) {
    ASSERT_TRUE(r.success) << r.error;
    EXPECT_EQ(r.output_tokens, 5);
    EXPECT_EQ(r.itl_s.size(), 4u);
  }
  const json b = server.bodies().at(0);
  EXPECT_EQ(b["model"], "m");
  EXPECT_EQ(b["messages"], json::parse(R"([{"role":"user","content":" hello world"}])"));
  EXPECT_EQ(b["max_completion_tokens"], 5);
  EXPECT_FALSE(b.contains("prompt"));
}

TEST(BenchDriver, FailedRequestsAreCountedNotHidden) {
  TimedServer server(/*fail_every=*/3);
  DriverOptions o;
  o.port = server.port();
  o.max_concurrency = 1;  // a fixed order, so exactly requests 3, 6 and 9 fail
  const auto run = run_workload(uniform_requests(9, 5, 2), o);
  int failed = 0;
  for (const auto& r : run.results)
    if (!r.success) {
      ++failed;
      EXPECT_NE(r.error.find("HTTP 500"), std::string::npos) << r.error;
    }
  EXPECT_EQ(failed, 3);
  const BenchSummary s = summarize(run.results, run.duration_s);
  EXPECT_EQ(s.failed, 3);
  EXPECT_EQ(s.completed, 6);
  // Nobody listening: every request fails with the transport error.
  DriverOptions gone = o;
  gone.port = 1;
  const auto none = run_workload(uniform_requests(2, 5, 2), gone);
  for (const auto& r : none.results) {
    EXPECT_FALSE(r.success);
    EXPECT_FALSE(r.error.empty());
  }
}

TEST(StreamMeasurement, AnErrorBodyThatIsNotUtf8IsKeptAsUtf8) {
  StreamMeasurement m(0, 5);
  m.head(500);
  m.body("bad \xff\xfe <b>", 0.5);
  const RequestResult r = m.done("", 0.5, 0);
  EXPECT_FALSE(r.success);
  EXPECT_EQ(r.error, "HTTP 500: bad \xef\xbf\xbd\xef\xbf\xbd <b>");  // U+FFFD each
  // So the result JSON, which refuses bytes that are not UTF-8, can hold it.
  const std::vector<RequestResult> results = {r};
  EXPECT_NO_THROW(to_json(summarize(results, 1), results).dump());
  // A transport error is kept as UTF-8 too.
  StreamMeasurement t(0, 5);
  EXPECT_EQ(t.done("reset by \xc3", 1, 0).error, "reset by \xef\xbf\xbd");
}

// vLLM's definitions on known times: TTFT at the first event with choices (an event counts when
// its last byte arrives), one gap per later such event, latency at the last one (not at the usage
// chunk, [DONE] or the end), output tokens from the usage chunk; TPOT is then (latency - TTFT)
// over the output tokens after the first.
TEST(StreamMeasurement, TimesAreVllmsTtftGapsAndLatency) {
  const std::string chunk = net::sse_event(R"({"choices": [{"index": 0, "text": " x"}]})");
  StreamMeasurement m(10.0, 20);
  m.head(200);
  m.body(": a comment, not an event\n\n", 10.01);
  m.body(chunk, 10.06);
  m.body(chunk, 10.085);
  m.body(chunk.substr(0, 10), 10.1);  // this event arrives in two pieces: it counts at the second
  m.body(chunk.substr(10) + chunk, 10.15);  // and a whole one in the same piece: a 0 s gap
  m.body(net::sse_event(R"({"choices": [], "usage": {"completion_tokens": 5}})"), 10.3);
  m.body(std::string(net::kSseDone), 10.4);
  const RequestResult r = m.done("", 10.5, 9.0);
  ASSERT_TRUE(r.success) << r.error;
  EXPECT_NEAR(r.start_s, 1.0, 1e-9);
  EXPECT_NEAR(r.ttft_s, 0.06, 1e-9);
  ASSERT_EQ(r.itl_s.size(), 3u);
  EXPECT_NEAR(r.itl_s[0], 0.025, 1e-9);
  EXPECT_NEAR(r.itl_s[1], 0.065, 1e-9);
  EXPECT_NEAR(r.itl_s[2], 0.0, 1e-9);
  EXPECT_NEAR(r.latency_s, 0.15, 1e-9);
  EXPECT_EQ(r.output_tokens, 5);
  EXPECT_EQ(r.prompt_tokens, 20);
  const std::vector<RequestResult> results = {r};
  // (latency - TTFT) / (tokens - 1): 90 ms over 4 gaps.
  EXPECT_NEAR(summarize(results, 1).tpot.mean_ms, 22.5, 1e-6);
}

// vLLM's calculate_metrics: with no usage count (or 0) the output is the generated text
// re-tokenized without special tokens, not the chunks (a chunk may carry several tokens).
TEST(StreamMeasurement, WithoutAUsageCountTheGeneratedTextIsReTokenized) {
  const auto tok = text::Tokenizer::from_dir(test::lenml_model("deepseek_v3"));
  const std::string text = " the cat sat on the mat and the dog ran";
  const size_t expected = tok.encode(text, false).size();
  ASSERT_GT(expected, 2u);  // more tokens than the two chunks below
  auto completion = [&](const std::string& usage, const text::Tokenizer* t) {
    StreamMeasurement m(0, 5, t);
    m.head(200);
    m.body(net::sse_event(json{{"choices", {{{"index", 0}, {"text", text.substr(0, 12)}}}}}.dump()),
           0.1);
    m.body(net::sse_event(json{{"choices", {{{"index", 0}, {"text", text.substr(12)}}}}}.dump()),
           0.2);
    if (!usage.empty()) m.body(net::sse_event(usage), 0.3);
    const RequestResult r = m.done("", 0.3, 0);
    EXPECT_TRUE(r.success) << r.error;
    return r.output_tokens;
  };
  EXPECT_EQ(completion("", &tok), static_cast<int64_t>(expected));
  EXPECT_EQ(completion(R"({"choices": [], "usage": {"completion_tokens": 0}})", &tok),
            static_cast<int64_t>(expected));
  // A usage count wins; with no tokenizer the chunks are counted.
  EXPECT_EQ(completion(R"({"choices": [], "usage": {"completion_tokens": 3}})", &tok), 3);
  EXPECT_EQ(completion("", nullptr), 2);
  // Chat: the delta's content, else its reasoning_content, as vLLM's client reads them.
  StreamMeasurement chat(0, 5, &tok);
  chat.head(200);
  chat.body(net::sse_event(R"({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})"), 0.1);
  chat.body(net::sse_event(json{
                {"choices",
                 {{{"index", 0},
                   {"delta", {{"reasoning_content", text.substr(0, 12)}, {"content", nullptr}}}}}}}
                               .dump()),
            0.2);
  chat.body(
      net::sse_event(
          json{{"choices", {{{"index", 0}, {"delta", {{"content", text.substr(12)}}}}}}}.dump()),
      0.3);
  EXPECT_EQ(chat.done("", 0.3, 0).output_tokens, static_cast<int64_t>(expected));
}

// vLLM's datasets count the BOS a server adds to a text prompt; a token-id prompt is taken as
// given, so the driver puts the BOS first and counts it, and the server sees the target length.
TEST(BenchDriver, TokenIdPromptsStartWithTheBosTheirLengthCounts) {
  BenchRequest r;
  r.prompt_ids = {1000, 1001, 1002};
  r.prompt_text = " a b c";
  r.output_len = 2;
  DriverOptions o;
  EXPECT_EQ(json::parse(request_body(r, o))["prompt"], json({1000, 1001, 1002}));
  EXPECT_EQ(sent_prompt_tokens(r, o), 3);
  o.bos_id = 0;
  EXPECT_EQ(json::parse(request_body(r, o))["prompt"], json({0, 1000, 1001, 1002}));
  EXPECT_EQ(sent_prompt_tokens(r, o), 4);
  // Text (and chat) prompts get the BOS from the server: sent as they are, counted with it.
  o.prompt_format = PromptFormat::kText;
  EXPECT_EQ(json::parse(request_body(r, o))["prompt"], " a b c");
  EXPECT_EQ(sent_prompt_tokens(r, o), 4);
  o.count_bos = false;  // vLLM's prefix_repetition counts prefix + suffix alone
  EXPECT_EQ(sent_prompt_tokens(r, o), 3);
}

TEST(BenchDriver, SamplingParametersAreSentWhenSetAndTemperatureZeroByDefault) {
  BenchRequest r;
  r.prompt_ids = {1000};
  r.output_len = 2;
  DriverOptions o;
  json b = json::parse(request_body(r, o));
  EXPECT_EQ(b["temperature"], 0.0);  // vLLM's client sends greedy unless told otherwise
  for (const char* key : {"top_p", "top_k", "min_p"}) EXPECT_FALSE(b.contains(key)) << key;
  o.temperature = 0.7;
  o.top_p = 0.9;
  o.top_k = 5;
  o.min_p = 0.1;
  o.ignore_eos = false;
  b = json::parse(request_body(r, o));
  EXPECT_EQ(b["temperature"], 0.7);
  EXPECT_EQ(b["top_p"], 0.9);
  EXPECT_EQ(b["top_k"], 5);
  EXPECT_EQ(b["min_p"], 0.1);
  EXPECT_FALSE(b.contains("ignore_eos"));
}

TEST(StreamMeasurement, AnErrorBodyIsKeptToItsFirstFourKilobytes) {
  StreamMeasurement m(0, 5);
  m.head(503);
  m.body(std::string(3000, 'a'), 0.1);
  m.body(std::string(1 << 20, 'b'), 0.2);
  EXPECT_EQ(m.done("", 0.2, 0).error.size(), std::string("HTTP 503: ").size() + 4096);
}

TEST(StreamMeasurement, AUsageCountNoRequestCanHaveFailsTheRequest) {
  // A negative or absurd count would make the run's token totals and throughputs so.
  for (const char* count : {"-5", "18446744073709551615", "10000000001"}) {
    StreamMeasurement m(0, 5);
    m.head(200);
    m.body(net::sse_event(R"({"choices": [{"index": 0, "text": " x"}]})"), 0.1);
    m.body(net::sse_event(std::string(R"({"choices": [], "usage": {"completion_tokens": )") +
                          count + "}}"),
           0.2);
    const RequestResult r = m.done("", 0.2, 0);
    EXPECT_FALSE(r.success) << count;
    EXPECT_NE(r.error.find(std::string("usage.completion_tokens ") + count), std::string::npos)
        << r.error;
    const std::vector<RequestResult> results = {r};
    EXPECT_EQ(summarize(results, 1).total_output_tokens, 0) << count;
  }
  StreamMeasurement ok(0, 5);
  ok.head(200);
  ok.body(net::sse_event(R"({"choices": [{"index": 0, "text": " x"}]})"), 0.1);
  ok.body(net::sse_event(R"({"choices": [], "usage": {"completion_tokens": 7}})"), 0.2);
  EXPECT_EQ(ok.done("", 0.2, 0).output_tokens, 7);
}

TEST(BenchDriver, ArrivalTimesOutOfRangeOrOrderAreRefusedBeforeAnythingIsSent) {
  TimedServer server;
  DriverOptions o;
  o.port = server.port();
  for (const std::vector<double>& times :
       {std::vector<double>{0, 1e10}, std::vector<double>{0, INFINITY}, std::vector<double>{0, NAN},
        std::vector<double>{-1, 0}, std::vector<double>{0, 2, 1}}) {
    auto reqs = uniform_requests(static_cast<int>(times.size()), 5, 1);
    apply_arrivals(reqs, times);
    EXPECT_THROW(run_workload(reqs, o), Error) << times.back();
  }
  EXPECT_TRUE(server.bodies().empty());
}

TEST(BenchDriver, RequestsAreSentAtTheirArrivalTimes) {
  TimedServer server;
  DriverOptions o;
  o.port = server.port();
  auto reqs = uniform_requests(40, 5, 1);
  ArrivalOptions a;
  a.request_rate = 100;
  a.seed = 3;
  apply_arrivals(reqs, rate_arrivals(reqs.size(), a));
  const auto run = run_workload(reqs, o);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(run.results[i].success) << run.results[i].error;
    EXPECT_GE(run.results[i].start_s, reqs[i].arrival_s) << "request " << i << " sent early";
  }
  // The whole schedule was followed: the last send is not before the last arrival.
  EXPECT_GE(run.duration_s, reqs.back().arrival_s);
}

TEST(BenchDriver, MooncakeReplayReproducesThePrefixSharingTheServerSees) {
  const auto tok = text::Tokenizer::from_dir(test::lenml_model("deepseek_v3"));
  const auto vocab = TokenVocab::build(tok);
  MooncakeOptions m;
  m.path = std::filesystem::path(TANDEM_SOURCE_DIR) / "tests/data/bench" /
           "mooncake_conversation_head200.jsonl";
  m.window.limit = 24;
  m.window.time_scale = 0.0005;  // the window's minutes in well under a second
  const auto reqs = mooncake_workload(vocab, m);
  const auto records = read_mooncake_trace(m.path, m.window);
  ASSERT_EQ(reqs.size(), records.size());
  TimedServer server;
  DriverOptions o;
  o.port = server.port();
  o.prompt_format = PromptFormat::kText;
  std::vector<BenchRequest> small = reqs;
  for (auto& r : small) r.output_len = 1;
  const auto run = run_workload(small, o);
  for (const auto& r : run.results) ASSERT_TRUE(r.success) << r.error;
  // What arrived, tokenized again, grouped into 512-token blocks per hash id.
  std::map<std::string, size_t> index_of_text;
  const auto bodies = server.bodies();
  ASSERT_EQ(bodies.size(), reqs.size());
  std::map<int64_t, std::vector<int32_t>> block_of_hash;
  int shared = 0;
  for (const auto& body : bodies) {
    const std::string text = body["prompt"];
    const auto ids = tok.encode(text, false);
    // Which record it was: the one whose ids these are (arrival order may differ).
    size_t k = reqs.size();
    for (size_t i = 0; i < reqs.size(); ++i)
      if (reqs[i].prompt_text == text) k = i;
    ASSERT_LT(k, reqs.size());
    ASSERT_EQ(static_cast<int64_t>(ids.size()), records[k].input_length);
    for (size_t b = 0; b < records[k].hash_ids.size(); ++b) {
      const size_t from = b * 512, to = std::min(ids.size(), from + 512);
      std::vector<int32_t> block(ids.begin() + from, ids.begin() + to);
      auto [it, fresh] = block_of_hash.emplace(records[k].hash_ids[b], block);
      if (!fresh) {
        ++shared;
        // A shared id may end a shorter prompt: compare the common part.
        const size_t n = std::min(it->second.size(), block.size());
        EXPECT_TRUE(std::equal(block.begin(), block.begin() + n, it->second.begin()))
            << "hash id " << records[k].hash_ids[b] << " differs between requests";
      }
    }
  }
  EXPECT_GT(shared, 0) << "the window has no shared prefix blocks; pick another";
}

TEST(BenchDriver, TheCommandWritesVllmResultKeys) {
  TimedServer server;
  const auto file = std::filesystem::temp_directory_path() /
                    ("bench-result-" + std::to_string(::getpid()) + ".json");
  const auto html = std::filesystem::temp_directory_path() /
                    ("bench-report-" + std::to_string(::getpid()) + ".html");
  ChildProcess p(TANDEM_BINARY, {"tandem",
                                 "bench",
                                 "--base-url",
                                 "http://127.0.0.1:" + std::to_string(server.port()),
                                 "--num-prompts",
                                 "6",
                                 "--random-input-len",
                                 "30",
                                 "--random-output-len",
                                 "3",
                                 "--max-concurrency",
                                 "3",
                                 "--metric-percentiles",
                                 "50,99",
                                 "--percentile-metrics",
                                 "ttft,tpot,itl,e2el",
                                 "--goodput",
                                 "ttft:10000",
                                 "--result-file",
                                 file.string(),
                                 "--html",
                                 html.string(),
                                 "--no-progress",
                                 "--tokenizer",
                                 test::lenml_model("deepseek_v3").string()});
  std::string out;
  for (std::string l = p.read_line(); !l.empty(); l = p.read_line()) out += l;
  EXPECT_EQ(p.stop(), 0) << out;  // it already exited: its own status
  EXPECT_NE(out.find("Serving Benchmark Result"), std::string::npos) << out;
  std::ifstream in(file);
  const json r = json::parse(in);
  std::filesystem::remove(file);
  for (const char* key :
       {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
        "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
        "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "ttfts", "itls"})
    EXPECT_TRUE(r.contains(key)) << key;
  EXPECT_EQ(r["completed"], 6);
  EXPECT_EQ(r["total_output_tokens"], 18);
  EXPECT_EQ(r["request_goodput"], r["request_throughput"]);  // every TTFT is far below 10 s
  // vLLM's setup keys; the model is the first /v1/models lists when --model is not given.
  EXPECT_EQ(r["model_id"], "fake-model");
  EXPECT_EQ(r["endpoint_type"], "openai");
  EXPECT_TRUE(r["label"].is_null());
  EXPECT_EQ(r["tokenizer_id"], test::lenml_model("deepseek_v3").string());
  EXPECT_EQ(r["date"].get<std::string>().size(), std::string("20260101-120000").size());
  // The random prompts are --random-input-len tokens as the server sees them, the BOS first.
  const auto tok = text::Tokenizer::from_dir(test::lenml_model("deepseek_v3"));
  ASSERT_TRUE(tok.bos_id());
  EXPECT_EQ(r["input_lens"], json(std::vector<int>(6, 30)));
  const auto bodies = server.bodies();
  ASSERT_EQ(bodies.size(), 6u);
  for (const json& b : bodies) {
    EXPECT_EQ(b["prompt"].size(), 30u);
    EXPECT_EQ(b["prompt"][0], *tok.bos_id());
    EXPECT_EQ(b["model"], "fake-model");
    EXPECT_EQ(b["ignore_eos"], true);  // vLLM forces the random dataset's lengths
    EXPECT_EQ(b["temperature"], 0.0);
  }
  // The report is written (its content is bench_report_test's business).
  std::ifstream h(html);
  const std::string page((std::istreambuf_iterator<char>(h)), std::istreambuf_iterator<char>());
  std::filesystem::remove(html);
  EXPECT_NE(page.find("<svg"), std::string::npos);
}

TEST(BenchDriver, AServerErrorThatIsNotUtf8IsWrittenToTheResultFile) {
  TimedServer server(/*fail_every=*/1, "bad \xff\xfe <script>");
  const auto file = test::scratch_path("bench-utf8-result", ".json");
  std::ofstream(file) << "{\"an earlier run\": 1}\n";
  ChildProcess p(
      TANDEM_BINARY,
      {"tandem", "bench", "--base-url", "http://127.0.0.1:" + std::to_string(server.port()),
       "--num-prompts", "2", "--random-input-len", "30", "--random-output-len", "3",
       "--result-file", file.string(), "--no-progress", "--tokenizer",
       test::lenml_model("deepseek_v3").string()});
  std::string out;
  for (std::string l = p.read_line(); !l.empty(); l = p.read_line()) out += l;
  // Every request failed: the run says so and exits 1 (8cf0623), the result file written first.
  EXPECT_EQ(p.stop(), 1) << out;
  std::ifstream in(file);
  const json r = json::parse(in);
  EXPECT_EQ(r["failed"], 2);
  ASSERT_EQ(r["errors"].size(), 2u);
  EXPECT_EQ(r["errors"][0], "HTTP 500: bad \xef\xbf\xbd\xef\xbf\xbd <script>");
}

// --- the commands' checks before a run ----------------------------------------------------

// `tandem ARGS` through the shell (ARGS must be quoted for it), with the test tokenizer; stdout
// and stderr together.
test::CommandResult run_tandem(const std::string& args) {
  return test::run_capture(std::string(TANDEM_BINARY) + " " + args + " --tokenizer " +
                           test::lenml_model("deepseek_v3").string() + " 2>&1");
}

// A small run of each command: bench against a port nothing listens on (every request fails at
// once, and the table is still printed; with --model, as without one bench stops when
// /v1/models is not answered), simulate in virtual time.
const char* const kSmallRuns[] = {
    "bench --no-progress --base-url http://127.0.0.1:1 --model m --num-prompts 2 "
    "--random-input-len 20 --random-output-len 2",
    "simulate --num-prompts 2 --random-input-len 20 --random-output-len 2"};

// vLLM's request defaults: ignore_eos only for the random dataset unless --ignore-eos, greedy
// unless --temperature, the other sampling flags sent when given; --goodput ttft:0 is an SLO
// (vLLM refuses only values below 0) that no request meets. Prefix-repetition prompts reach the
// server as vLLM's do, the BOS first, and are counted as vLLM counts them, prefix + suffix.
TEST(BenchCommands, SamplingAndIgnoreEosFollowVllmsDefaults) {
  const auto tok = text::Tokenizer::from_dir(test::lenml_model("deepseek_v3"));
  const auto file = test::scratch_path("bench-defaults", ".json");
  for (const bool ignore_eos : {false, true}) {
    TimedServer server;
    const auto r = run_tandem(
        "bench --no-progress --base-url http://127.0.0.1:" + std::to_string(server.port()) +
        " --model m --label lab --dataset-name prefix-repetition --num-prompts 2"
        " --prefix-repetition-num-prefixes 1 --prefix-repetition-prefix-len 8"
        " --prefix-repetition-suffix-len 4 --prefix-repetition-output-len 2 --temperature 0.5"
        " --top-p 0.9 --top-k 5 --min-p 0.05 --goodput ttft:0 --result-file " +
        file.string() + (ignore_eos ? " --ignore-eos" : ""));
    ASSERT_EQ(r.status, 0) << r.output;
    const auto bodies = server.bodies();
    ASSERT_EQ(bodies.size(), 2u);
    for (const json& b : bodies) {
      EXPECT_EQ(b.contains("ignore_eos"), ignore_eos) << b.dump();
      EXPECT_EQ(b["temperature"], 0.5);
      EXPECT_EQ(b["top_p"], 0.9);
      EXPECT_EQ(b["top_k"], 5);
      EXPECT_EQ(b["min_p"], 0.05);
      EXPECT_EQ(b["prompt"].size(), 13u);
      EXPECT_EQ(b["prompt"][0], *tok.bos_id());
    }
    std::ifstream in(file);
    const json result = json::parse(in);
    EXPECT_EQ(result["input_lens"], json({12, 12}));
    EXPECT_EQ(result["label"], "lab");
    EXPECT_EQ(result["model_id"], "m");
    EXPECT_EQ(result["request_goodput"], 0.0);
  }
  std::filesystem::remove(file);
  const auto both = run_tandem("bench --base-url http://127.0.0.1:1 --ignore-eos --no-ignore-eos");
  EXPECT_NE(both.status, 0);
  EXPECT_THAT(both.output, ::testing::HasSubstr("give one of the two"));
}

// An output that cannot be written is refused before the workload is built, not after the run,
// whose results it would lose: the table must not have been printed.
TEST(BenchCommands, AnOutputThatCannotBeWrittenIsRefusedBeforeTheRun) {
  const auto dir = test::scratch_path("bench-outputs", "");
  std::filesystem::create_directories(dir);
  const std::string missing = (dir / "no-such-folder" / "out").string();
  for (const char* command : kSmallRuns) {
    for (const char* flag : {"--result-file", "--html"}) {
      auto r = run_tandem(std::string(command) + " " + flag + " " + missing);
      EXPECT_NE(r.status, 0) << command << flag;
      EXPECT_THAT(r.output,
                  ::testing::HasSubstr(std::string(flag) + " " + missing + ": no such directory " +
                                       (dir / "no-such-folder").string()))
          << command;
      EXPECT_EQ(r.output.find("Serving Benchmark Result"), std::string::npos) << r.output;
      r = run_tandem(std::string(command) + " " + flag + " " + dir.string());
      EXPECT_NE(r.status, 0) << command << flag;
      EXPECT_THAT(r.output, ::testing::HasSubstr(std::string(flag) + " " + dir.string() +
                                                 ": is a directory, not a file"));
      EXPECT_EQ(r.output.find("Serving Benchmark Result"), std::string::npos) << r.output;
    }
  }
  // What the check makes to probe the folder, it removes.
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  std::filesystem::remove_all(dir);
}

// Each command with no workload flags: a case that is refused stops before anything runs (bench
// with --model: without one it stops when /v1/models is not answered).
const char* const kBareRuns[] = {"bench --no-progress --base-url http://127.0.0.1:1 --model m",
                                 "simulate"};

std::string mooncake_head() {
  return (test::source_dir() / "tests" / "data" / "bench" / "mooncake_conversation_head200.jsonl")
      .string();
}

// A flag the dataset does not use is refused, as --trace-spread with --request-rate is, not
// ignored: the run would be of another workload than the one asked for. Given at its default
// value it is refused too (--random-input-len 1024 with sharegpt reads as a length the run never
// had).
TEST(BenchCommands, AFlagTheDatasetDoesNotUseIsRefused) {
  const std::string mooncake = "--dataset-name mooncake --dataset-path " + mooncake_head();
  const std::string azure =
      "--dataset-name azure --dataset-path " +
      (test::source_dir() / "tests/data/bench/azure_code_2023_head200.csv").string();
  const std::pair<std::string, std::string> cases[] = {
      {"--trace-start 1",
       "--trace-start applies to the traces (--dataset-name mooncake or azure), not random"},
      {"--trace-limit 1", "--trace-limit applies to the traces"},
      {"--time-scale 2", "--time-scale applies to the traces"},
      {"--trace-start 0", "--trace-start applies to the traces"},
      {"--dataset-name prefix-repetition --time-scale 0",
       "--time-scale applies to the traces (--dataset-name mooncake or azure), not "
       "prefix-repetition"},
      {"--dataset-name sharegpt --dataset-path x.json --trace-limit 5",
       "--trace-limit applies to the traces (--dataset-name mooncake or azure), not sharegpt"},
      {"--dataset-path x.json", "--dataset-path: --dataset-name random reads no file"},
      {"--dataset-name prefix-repetition --dataset-path x.json",
       "--dataset-path: --dataset-name prefix-repetition reads no file"},
      {mooncake + " --trace-limit 2 --request-rate 5 --time-scale 2",
       "--time-scale scales the trace's own arrivals, which --request-rate replaces"},
      // The synthetic datasets' lengths, with a dataset that takes its own from its file.
      {"--dataset-name sharegpt --dataset-path x.json --random-input-len 1024",
       "--random-input-len applies to --dataset-name random, not sharegpt (its lengths are the "
       "file's)"},
      {mooncake + " --random-output-len 5",
       "--random-output-len applies to --dataset-name random, not mooncake"},
      {azure + " --random-range-ratio 0.5",
       "--random-range-ratio applies to --dataset-name random, not azure"},
      {"--dataset-name prefix-repetition --random-input-len 20",
       "--random-input-len applies to --dataset-name random, not prefix-repetition"},
      {"--prefix-repetition-prefix-len 10",
       "--prefix-repetition-prefix-len applies to --dataset-name prefix-repetition, not random"},
      {mooncake + " --prefix-repetition-num-prefixes 2",
       "--prefix-repetition-num-prefixes applies to --dataset-name prefix-repetition, not "
       "mooncake"},
      // On a trace --num-prompts and --trace-limit say the same thing.
      {mooncake + " --num-prompts 2 --trace-limit 2",
       "--num-prompts and --trace-limit both say how many of the trace's records to replay"},
      // Gaps of a rate, with no rate.
      {"--num-prompts 2 --random-input-len 20 --burstiness 0.5",
       "--burstiness shapes the gaps between the arrivals of a finite --request-rate; without one "
       "every request is sent at once"},
      {mooncake + " --trace-limit 2 --burstiness 2 --request-rate inf",
       "without one the trace's own timestamps are replayed"},
  };
  for (const char* command : kBareRuns) {
    for (const auto& [flags, error] : cases) {
      const auto r = run_tandem(std::string(command) + " " + flags);
      EXPECT_NE(r.status, 0) << command << " " << flags;
      EXPECT_THAT(r.output, ::testing::HasSubstr(error)) << command << " " << flags;
      EXPECT_EQ(r.output.find("Serving Benchmark Result"), std::string::npos) << r.output;
    }
    // Refused before the tokenizer is loaded (a second or more for a real one): a tokenizer that
    // is not there is not what the error names.
    const auto r = test::run_capture(
        std::string(TANDEM_BINARY) + " " + command + " --trace-limit 1 --tokenizer " +
        test::scratch_path("bench-no-tokenizer", "").string() + " 2>&1");
    EXPECT_NE(r.status, 0) << command;
    EXPECT_THAT(r.output, ::testing::HasSubstr("--trace-limit applies to the traces")) << command;
  }
  // Each where its dataset takes it: a trace its window, a rate its gaps.
  for (const std::string& flags :
       {std::string("--num-prompts 2 --random-input-len 20 --random-range-ratio 0.5 "
                    "--random-output-len 2 --request-rate 100 --burstiness 0.5"),
        std::string("--dataset-name prefix-repetition --num-prompts 2 "
                    "--prefix-repetition-prefix-len 8 --prefix-repetition-suffix-len 8 "
                    "--prefix-repetition-num-prefixes 1 --prefix-repetition-output-len 2"),
        mooncake + " --trace-start 1 --trace-limit 2 --time-scale 0.5",
        mooncake + " --trace-limit 2 --request-rate 5 --burstiness 2"}) {
    const auto r = run_tandem(std::string(kBareRuns[1]) + " " + flags);
    EXPECT_EQ(r.status, 0) << flags << "\n" << r.output;
  }
}

// On a trace --num-prompts is the number of records replayed, the first of the window, as the
// requests of a vLLM run: it was ignored, and the whole trace replayed.
TEST(BenchCommands, NumPromptsOnATraceReplaysItsFirstRecords) {
  const std::string azure =
      "--dataset-name azure --dataset-path " +
      (test::source_dir() / "tests/data/bench/azure_code_2023_head200.csv").string() +
      " --time-scale 0";
  for (const char* command : kBareRuns) {
    for (const std::string& trace :
         {"--dataset-name mooncake --dataset-path " + mooncake_head() + " --time-scale 0", azure}) {
      auto r = run_tandem(std::string(command) + " " + trace + " --num-prompts 3");
      EXPECT_THAT(r.output, ::testing::HasSubstr(": 3 requests (")) << command << " " << trace;
      EXPECT_THAT(r.output, ::testing::HasSubstr("Serving Benchmark Result")) << r.output;
      // From --trace-start; past the trace's end, what it has.
      r = run_tandem(std::string(command) + " " + trace + " --trace-start 198 --num-prompts 5");
      EXPECT_THAT(r.output, ::testing::HasSubstr(": 2 requests (")) << command << " " << trace;
    }
  }
}

// A sweep without an SLO has no goodput: its rows say n/a, not 0.000 (and with one, a number).
TEST(BenchCommands, ASweepWithoutAnSloSaysItsGoodputIsNotApplicable) {
  const std::string sweep = std::string(kSmallRuns[1]) + " --sweep decode=1,2";
  auto r = run_tandem(sweep);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::ContainsRegex("\n      0      1  0.00 tandem\\s+n/a "));
  EXPECT_THAT(r.output, ::testing::ContainsRegex("\n      0      2  0.00 tandem\\s+n/a "));
  r = run_tandem(sweep + " --goodput ttft:1000000");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::ContainsRegex("\n      0      1  0.00 tandem\\s+[0-9.]+ "));
  EXPECT_EQ(r.output.find("n/a"), std::string::npos) << r.output;
}

// An empty workload says why, naming the flag, or the file and the window.
TEST(BenchCommands, AnEmptyWorkloadSaysWhy) {
  const std::string head = mooncake_head();
  const auto empty = test::scratch_path("empty-trace", ".jsonl");
  std::ofstream(empty) << "\n  \n";
  const auto header_only = test::scratch_path("header-only", ".csv");
  std::ofstream(header_only) << "TIMESTAMP,ContextTokens,GeneratedTokens\n";
  const std::pair<std::string, std::string> cases[] = {
      {"--dataset-name mooncake --dataset-path " + head + " --trace-start 100000000",
       "the workload has no requests: --trace-start 100000000 is past the 200 records of "
       "mooncake trace " +
           head},
      {"--dataset-name mooncake --dataset-path " + empty.string(),
       "the workload has no requests: mooncake trace " + empty.string() + ": no records"},
      {"--dataset-name azure --dataset-path " + header_only.string(),
       "the workload has no requests: azure trace " + header_only.string() + ": no records"},
      {"--num-prompts 0", "the workload has no requests: --num-prompts 0"},
      // A trace's window of no records, not the whole trace (a --trace-limit of 0).
      {"--dataset-name mooncake --dataset-path " + head + " --num-prompts 0",
       "the workload has no requests: --num-prompts 0"},
  };
  for (const char* command : kBareRuns) {
    for (const auto& [flags, error] : cases) {
      const auto r = run_tandem(std::string(command) + " " + flags);
      EXPECT_NE(r.status, 0) << command << " " << flags;
      EXPECT_THAT(r.output, ::testing::HasSubstr(error)) << command << " " << flags;
    }
  }
}

}  // namespace
}  // namespace tandem::bench
