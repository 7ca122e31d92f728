// The cluster simulator runs the gateway's and engines' own code in virtual time: answers come
// at exactly the times the latency model gives, the same inputs give the same run, and every
// request ends with its blocks returned.
#include "sim/cluster_simulation.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "api/load_report.h"
#include "bench/driver.h"
#include "bench/workload.h"
#include "gateway/virtual_executor.h"
#include "sim/simulated_engine.h"
#include "sim/virtual_time.h"
#include "sim/virtual_upstream.h"
#include "text/oracle_support.h"
#include "util/error.h"

namespace tandem::sim {
namespace {

using Fault = SimulationOptions::Fault;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

std::shared_ptr<const text::Tokenizer> tokenizer() {
  static auto tok = std::make_shared<const text::Tokenizer>(
      text::Tokenizer::from_dir(test::lenml_model("deepseek_v3")));
  return tok;
}

const bench::TokenVocab& vocab() {
  static const bench::TokenVocab v = bench::TokenVocab::build(*tokenizer());
  return v;
}

// A latency model with round numbers: 10 ms per step, plus 1 ms per prefill token.
std::string hand_model() {
  // One file per call: ctest runs the tests of this binary in parallel processes, and a shared
  // path let one read the file while another rewrote it.
  const auto path = test::scratch_path("tandem_sim_hand_model");
  std::ofstream(path) << R"({"name": "hand", "step_s": 0.01, "prefill_token_s": 0.001,
    "prefill_pair_s": 0, "decode_token_s": 0, "decode_seq_s": 0, "decode_pair_s": 0})";
  return path.string();
}

SimulationOptions options(int engines, const std::string& preset) {
  SimulationOptions o;
  o.decode = engines;
  o.executor.preset = preset;
  o.gateway.model = test::lenml_model("deepseek_v3").string();
  o.body_bytes_per_s = 0;  // bodies arrive at once: times are the latency model's alone
  return o;
}

bench::BenchRequest request(double at, std::vector<int32_t> prompt, int64_t output) {
  bench::BenchRequest r;
  r.arrival_s = at;
  r.prompt_ids = std::move(prompt);
  r.output_len = output;
  return r;
}

std::vector<int32_t> words(size_t n, size_t from) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < n; ++i) ids.push_back(vocab().id((from + i * 7) % vocab().size()));
  return ids;
}

std::vector<bench::BenchRequest> random_requests(int64_t n, uint64_t seed) {
  bench::RandomOptions r;
  r.num_requests = n;
  r.input_len = 300;
  r.output_len = 20;
  r.range_ratio = 0.5;
  r.seed = seed;
  auto reqs = bench::random_workload(vocab(), r);
  for (size_t i = 0; i < reqs.size(); ++i) reqs[i].arrival_s = 0.05 * double(i);
  return reqs;
}

TEST(ClusterSimulation, OneRequestTakesTheStepTimesOfTheLatencyModel) {
  // A 100-token prompt: one prefill step of 10 + 100 ms yields the first token, then a decode
  // step of 10 ms per token.
  const auto run =
      simulate({request(0.5, words(100, 1), 5)}, options(1, hand_model()), tokenizer());
  ASSERT_EQ(run.results.size(), 1u);
  const auto& r = run.results[0];
  ASSERT_TRUE(r.success) << r.error;
  EXPECT_DOUBLE_EQ(r.start_s, 0.5);
  EXPECT_NEAR(r.ttft_s, 0.110, 1e-9);
  EXPECT_NEAR(r.latency_s, 0.110 + 4 * 0.010, 1e-9);
  ASSERT_EQ(r.itl_s.size(), 4u);
  for (double gap : r.itl_s) EXPECT_NEAR(gap, 0.010, 1e-9);
  EXPECT_EQ(r.output_tokens, 5);
  EXPECT_EQ(r.prompt_tokens, 100);
  EXPECT_NEAR(run.duration_s, 0.5 + 0.150, 1e-9);
  ASSERT_EQ(run.engines.size(), 1u);
  EXPECT_EQ(run.engines[0].steps, 5);
  EXPECT_NEAR(run.engines[0].busy_s, 0.150, 1e-9);
}

TEST(ClusterSimulation, TheAccessLogHasALinePerRequestInVirtualTime) {
  // Two requests 5 s apart, each one prefill step of 10 + 100 ms: the log says where each went
  // and when, in the run's own time, the same on every replay.
  const std::vector<bench::BenchRequest> reqs{request(0.5, words(100, 1), 3),
                                              request(5.5, words(100, 9), 3)};
  auto read_lines = [&] {
    auto o = options(1, hand_model());
    const auto path = test::scratch_path("tandem_sim_access", ".log");
    o.gateway.access_log = path.string();
    const auto run = simulate(reqs, o, tokenizer());
    for (const auto& r : run.results) EXPECT_TRUE(r.success) << r.error;
    std::vector<nlohmann::json> lines;
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
    std::sort(lines.begin(), lines.end(), [](const auto& a, const auto& b) {
      return a["time_unix_ms"].template get<int64_t>() < b["time_unix_ms"].template get<int64_t>();
    });
    return lines;
  };
  const auto lines = read_lines();
  ASSERT_EQ(lines.size(), 2u);
  for (const auto& line : lines) {
    EXPECT_EQ(line["status"], 200);
    EXPECT_EQ(line["decode"], "decode-0");
    EXPECT_EQ(line["prompt_tokens"], 100);
    EXPECT_NEAR(line["ttft_seconds"].get<double>(), 0.110, 1e-6);
  }
  EXPECT_EQ(lines[1]["time_unix_ms"].get<int64_t>() - lines[0]["time_unix_ms"].get<int64_t>(),
            5000);
  EXPECT_EQ(read_lines(), lines);
}

TEST(ClusterSimulation, MtpDraftsThatAreAlwaysRightHalveTheDecodeSteps) {
  // One draft per step, always accepted, drafting free: the prefill step (10 + 100 ms) yields
  // the first token, then every 10 ms decode step yields two.
  auto o = options(1, hand_model());
  o.executor.mtp.drafts = 1;
  o.executor.mtp.acceptance = {1.0};
  o.executor.mtp.draft_pass_share = 0;
  const auto run = simulate({request(0, words(100, 1), 5)}, o, tokenizer());
  const auto& r = run.results[0];
  ASSERT_TRUE(r.success) << r.error;
  EXPECT_NEAR(r.ttft_s, 0.110, 1e-9);
  EXPECT_NEAR(r.latency_s, 0.130, 1e-9);  // tokens 2-3 at 120 ms, 4-5 at 130 ms
  EXPECT_EQ(r.output_tokens, 5);
  EXPECT_EQ(run.engines[0].steps, 3);
  EXPECT_EQ(run.draft_tokens, 2);
  EXPECT_EQ(run.accepted_tokens, 2);
}

TEST(ClusterSimulation, MtpDraftsThatAreNeverRightCostTheirDraftPassesAndNothingElse) {
  // Rejected drafts leave one token per step; each step drafts one token at half its time.
  auto o = options(1, hand_model());
  o.executor.mtp.drafts = 1;
  o.executor.mtp.acceptance = {0.0};
  o.executor.mtp.draft_pass_share = 0.5;
  const auto run = simulate({request(0, words(100, 1), 5)}, o, tokenizer());
  const auto& r = run.results[0];
  ASSERT_TRUE(r.success) << r.error;
  EXPECT_NEAR(r.ttft_s, 0.165, 1e-9);
  EXPECT_NEAR(r.latency_s, 0.165 + 4 * 0.015, 1e-9);
  EXPECT_EQ(run.engines[0].steps, 5);
  EXPECT_EQ(run.draft_tokens, 3);  // none in the last step: max_tokens leaves no room
  EXPECT_EQ(run.accepted_tokens, 0);
}

TEST(ClusterSimulation, ARequestArrivingDuringAStepJoinsTheNextOne) {
  // Both arrive at once, but the first starts a step of its own as soon as it reaches the idle
  // engine (10 + 50 ms); the second is prefilled in the next step (10 + 50 ms, beside the first's
  // decode), then both decode together in 10 ms steps.
  const auto run = simulate({request(0, words(50, 1), 3), request(0, words(50, 2), 3)},
                            options(1, hand_model()), tokenizer());
  const auto& first = run.results[0];
  const auto& second = run.results[1];
  ASSERT_TRUE(first.success) << first.error;
  ASSERT_TRUE(second.success) << second.error;
  EXPECT_NEAR(first.ttft_s, 0.060, 1e-9);
  EXPECT_NEAR(first.latency_s, 0.130, 1e-9);  // tokens at 60, 120 and 130 ms
  EXPECT_NEAR(second.ttft_s, 0.120, 1e-9);
  EXPECT_NEAR(second.latency_s, 0.140, 1e-9);  // tokens at 120, 130 and 140 ms
  EXPECT_EQ(run.engines[0].steps, 4);
}

// One simulated engine of the hand-checkable model, "engine-0" port 1 of a virtual upstream.
struct OneEngine {
  gateway::VirtualExecutor clock;
  VirtualUpstream upstream{clock};
  SimulatedEngine engine{clock,
                         tokenizer(),
                         [] {
                           SimulatedEngineOptions eo;
                           eo.name = "engine-0";
                           eo.executor.preset = eo.executor.model_name = hand_model();
                           return eo;
                         }(),
                         {}};
  OneEngine() { upstream.add("engine-0", 1, &engine); }
};

TEST(ClusterSimulation, ALoadReportDuringAStepCountsThePromptsSubmittedSinceItBegan) {
  // A live engine's HTTP thread submits requests while a step runs, and GET /load counts them
  // as queued prefill work; the simulated engine must too, or the gateway sends the next request
  // to an engine that looks idle behind a long prompt.
  OneEngine rig;
  auto& [clock, upstream, engine] = rig;
  auto post = [&](size_t tokens, size_t from) {
    net::AsyncHttpRequest r;
    r.host = "engine-0";
    r.port = 1;
    r.method = "POST";
    r.target = "/v1/completions";
    r.body = nlohmann::json{{"prompt", words(tokens, from)}, {"max_tokens", 1}}.dump();
    upstream.start(std::move(r), {});
  };
  auto queued_prefill = [&] {
    net::AsyncHttpRequest r;
    r.host = "engine-0";
    r.port = 1;
    r.target = "/load";
    std::string body;
    net::AsyncHttpHandlers h;
    h.on_body = [&](std::string_view piece) {
      body.append(piece);
      return true;
    };
    upstream.start(std::move(r), std::move(h));
    clock.run_ready();
    return api::parse_load_report(body).prefill_tokens;
  };
  post(1000, 1);  // its prefill step runs 10 + 1000 ms
  clock.run_ready();
  clock.advance_by(std::chrono::milliseconds(100));
  EXPECT_EQ(queued_prefill(), 0);  // the running step's work is not queued work
  post(500, 2);
  clock.run_ready();
  EXPECT_EQ(queued_prefill(), 500);
  clock.advance_by(std::chrono::seconds(5));
  EXPECT_EQ(queued_prefill(), 0);
}

TEST(ClusterSimulation, AnAnswersCreatedIsTheVirtualTimeItsRequestCame) {
  // The wall clock would make the same inputs give different answers from run to run.
  OneEngine rig;
  auto& [clock, upstream, engine] = rig;
  std::vector<std::shared_ptr<std::string>> answers;
  auto post = [&](const char* target, nlohmann::json body) {
    net::AsyncHttpRequest r;
    r.host = "engine-0";
    r.port = 1;
    r.method = "POST";
    r.target = target;
    r.body = body.dump();
    auto answer = answers.emplace_back(std::make_shared<std::string>());
    net::AsyncHttpHandlers h;
    h.on_body = [answer](std::string_view piece) {
      answer->append(piece);
      return true;
    };
    upstream.start(std::move(r), std::move(h));
  };
  clock.advance_by(std::chrono::seconds(42));
  const int64_t first_came = clock.unix_ms() / 1000;
  post("/v1/completions", {{"prompt", words(10, 1)}, {"max_tokens", 2}});
  clock.advance_by(std::chrono::seconds(60));
  post("/v1/chat/completions",
       {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}});
  clock.advance_by(std::chrono::seconds(60));
  ASSERT_EQ(answers.size(), 2u);
  const auto first = nlohmann::json::parse(*answers[0]);
  const auto second = nlohmann::json::parse(*answers[1]);
  EXPECT_EQ(first.value("created", int64_t{-1}), first_came) << *answers[0];
  EXPECT_EQ(second.value("created", int64_t{-1}), first_came + 60) << *answers[1];
  EXPECT_LT(first_came, 86400);  // the virtual clock's day one, not the wall clock's
}

// A call cancelled while its body is still queued on its virtual line never reached its engine:
// reported as the HTTP client reports a call cancelled before it connected (kNotConnected), so
// the gateway lets go of a decode leg's KV no engine took. It ended "cancelled" with no failure,
// which the gateway reads as a leg that reached its engine (no KV release).
TEST(ClusterSimulation, ACallCancelledWhileQueuedOnItsLineNeverConnected) {
  OneEngine one;
  VirtualUpstream slow{one.clock, 1000};  // 1000 bytes/s: a 1000-byte body takes 1 s
  slow.add("engine-0", 1, &one.engine);
  std::optional<net::CallFailure> failure;
  std::optional<std::string> done;
  net::AsyncHttpHandlers h;
  h.on_failure = [&](net::CallFailure f) { failure = f; };
  h.on_done = [&](const std::string& error) { done = error; };
  net::AsyncHttpRequest request;
  request.host = "engine-0";
  request.port = 1;
  request.method = "POST";
  request.target = "/v1/completions";
  request.body = std::string(1000, ' ');
  request.timeout = std::chrono::seconds(10);
  const auto id = slow.start(std::move(request), std::move(h));
  slow.cancel(id);
  one.clock.run_ready();
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(*done, "cancelled");
  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(*failure, net::CallFailure::kNotConnected);
  one.clock.advance_by(std::chrono::seconds(2));  // its delivery time passes: nothing more
  EXPECT_EQ(one.engine.steps(), 0);
}

TEST(ClusterSimulation, RequestBodiesArriveInOrderAfterTheirBytes) {
  // A 20K-token prompt and a short one leave the client together. The long body takes its time
  // to reach the gateway and then the engine (twice its bytes at the rate, about 0.2 s each way
  // at 1 MB/s), and the short one follows it on both hops: it never overtakes.
  const std::vector<bench::BenchRequest> reqs = {request(0, words(20000, 1), 2),
                                                 request(0, words(100, 2), 2)};
  // First come first served on the engine: no prefill deadlines, which would let the short one
  // pass the long one there (AShortPromptPassesALongOneAtItsNextChunkByDeadline).
  auto fcfs = options(1, hand_model());
  fcfs.gateway.scheduling.tandem.prefill_deadline_slack = 0;
  auto o = fcfs;
  o.body_bytes_per_s = 1e6;
  const auto run = simulate(reqs, o, tokenizer());
  const auto instant = simulate(reqs, fcfs, tokenizer());
  ASSERT_TRUE(run.results[0].success && run.results[1].success);
  const double long_body_s = double(bench::request_body(reqs[0], {}).size()) / 1e6;
  EXPECT_GT(long_body_s, 0.05);
  EXPECT_NEAR(run.results[0].ttft_s - instant.results[0].ttft_s, 2 * long_body_s,
              0.1 * long_body_s);
  // The short one waits behind the long one's chunks (its first token comes with the long one's
  // last chunk at the earliest), with or without the bodies' time.
  EXPECT_GE(run.results[1].ttft_s + 1e-9, run.results[0].ttft_s);
  EXPECT_GE(instant.results[1].ttft_s + 1e-9, instant.results[0].ttft_s);
}

TEST(ClusterSimulation, TheSameInputsGiveTheSameRun) {
  const auto reqs = random_requests(40, 3);
  const auto a = simulate(reqs, options(2, "deepseek-v3-h800"), tokenizer());
  const auto b = simulate(reqs, options(2, "deepseek-v3-h800"), tokenizer());
  ASSERT_EQ(a.results.size(), b.results.size());
  for (size_t i = 0; i < a.results.size(); ++i) {
    EXPECT_EQ(a.results[i].ttft_s, b.results[i].ttft_s) << i;
    EXPECT_EQ(a.results[i].itl_s, b.results[i].itl_s) << i;
    EXPECT_EQ(a.results[i].latency_s, b.results[i].latency_s) << i;
  }
  EXPECT_EQ(a.duration_s, b.duration_s);
  EXPECT_EQ(a.upstream_calls, b.upstream_calls);
  for (size_t k = 0; k < a.engines.size(); ++k) EXPECT_EQ(a.engines[k].steps, b.engines[k].steps);
}

TEST(ClusterSimulation, EveryRequestEndsOnceAndEveryBlockReturns) {
  const auto reqs = random_requests(60, 5);
  const auto run = simulate(reqs, options(3, "deepseek-v3-h800"), tokenizer());
  ASSERT_EQ(run.results.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(run.results[i].success) << i << ": " << run.results[i].error;
    EXPECT_EQ(run.results[i].output_tokens, reqs[i].output_len) << i;
    EXPECT_GE(run.results[i].start_s, reqs[i].arrival_s - 1e-9) << i;
  }
  int64_t steps = 0;
  for (const auto& e : run.engines) {
    EXPECT_EQ(e.blocks_in_use, 0) << e.name;
    steps += e.steps;
  }
  EXPECT_GT(steps, 0);
  // Every engine got work from the gateway's policy.
  for (const auto& e : run.engines) EXPECT_GT(e.steps, 0) << e.name;
}

TEST(ClusterSimulation, KvEventsLeadARepeatedPrefixToTheEngineThatHoldsIt) {
  // Requests that share a 512-token prefix, one after another: after the first, the prefix-aware
  // policy finds the prefix through the engines' KV events, and the engines report hits.
  const auto prefix = words(512, 11);
  std::vector<bench::BenchRequest> reqs;
  for (int i = 0; i < 6; ++i) {
    auto p = prefix;
    const auto tail = words(32, 100 + size_t(i) * 50);
    p.insert(p.end(), tail.begin(), tail.end());
    reqs.push_back(request(1.0 * i, p, 4));
  }
  auto o = options(4, "deepseek-v3-h800");
  o.gateway.policy = "tandem";
  const auto run = simulate(reqs, o, tokenizer());
  for (const auto& r : run.results) ASSERT_TRUE(r.success) << r.error;
  // Five of the six prompts find the 512 tokens cached (32 full blocks of 16).
  EXPECT_EQ(run.prefix_hits, 5 * 512);
  EXPECT_EQ(run.prefix_queries, 6 * 544);
  // The gateway's index learnt every full block from the events: the shared 32, and 2 of each
  // prompt's own (544 prompt + 4 generated tokens fill 34 blocks of 16).
  EXPECT_EQ(run.indexed_blocks, 32 + 6 * 2);
}

SimulationOptions pd_options(gateway::PdMode mode, int prefill, int decode,
                             const std::string& preset) {
  auto o = options(decode, preset);
  o.gateway.mode = mode;
  o.prefill = prefill;
  return o;
}

// Sequential P/D with decode-0 dead before the first request: a decode leg sent there is refused
// before it connects, so the gateway sends it to decode-1 with the same KV (each prompt is
// prefilled, and its KV moved, once) and every request succeeds. The simulator reported the
// refusal as a failure of unknown reach, which a sequential decode leg may not retry (its engine
// may be running it): those requests failed with a 502.
TEST(ClusterSimulation, ASequentialDecodeLegRefusedByADeadEngineTakesTheSameKvToAnother) {
  std::vector<bench::BenchRequest> reqs;
  for (int i = 0; i < 8; ++i) reqs.push_back(request(0.01 * (i + 1), words(64, size_t(i)), 4));
  auto o = pd_options(gateway::PdMode::kSequential, 1, 2, "deepseek-v3-h800");
  o.faults = {{Fault::Kind::kDeath, "decode-0", 0.0}};
  const auto run = simulate(reqs, o, tokenizer());
  for (size_t i = 0; i < reqs.size(); ++i)
    EXPECT_TRUE(run.results[i].success) << i << ": " << run.results[i].error;
  EXPECT_GT(run.retries, 0);  // some decode legs went to decode-0 first
  EXPECT_EQ(run.kv_transfers, int64_t(reqs.size()));
}

class DisaggregatedSimulation : public ::testing::TestWithParam<gateway::PdMode> {};

TEST_P(DisaggregatedSimulation, EveryRequestMovesItsKvOnceAndEndsWithEveryBlockFree) {
  const auto reqs = random_requests(30, 7);
  const auto run = simulate(reqs, pd_options(GetParam(), 2, 2, "deepseek-v3-h800"), tokenizer());
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(run.results[i].success) << i << ": " << run.results[i].error;
    EXPECT_EQ(run.results[i].output_tokens, reqs[i].output_len) << i;
  }
  EXPECT_EQ(run.kv_transfers, int64_t(reqs.size()));
  EXPECT_GT(run.kv_transfer_bytes, 0);
  for (const auto& e : run.engines) {
    EXPECT_EQ(e.blocks_in_use, 0) << e.name;
    EXPECT_GT(e.steps, 0) << e.name;
  }
}

// A decode engine of 6 blocks of 16 tokens: X decodes in 3 of them (positions 32..47) when D's
// prompt KV (3 blocks) arrives into the other 3, so X, at its next block boundary, must give way.
// D arrives at every decode step's offset in turn; at one of them its KV joins the scheduler in
// the very step X needs the block. Before, that step scheduled nothing (no admission after a
// preemption), the simulated engine was never stepped again without an outside event, and at the
// end of the trace X and D waited for the gateway's timeouts. Every request ends now.
TEST_P(DisaggregatedSimulation, ADecodeLegWhoseKvFillsTheCacheAsItsNeighbourNeedsABlockRuns) {
  for (int step = 0; step < 24; ++step) {
    SCOPED_TRACE("D arrives at step " + std::to_string(step));
    auto o = pd_options(GetParam(), 1, 1, hand_model());
    o.executor.num_blocks = 6;
    const auto run =
        simulate({request(0, words(17, 1), 60), request(0.15 + 0.01 * step, words(48, 500), 4)}, o,
                 tokenizer());
    for (size_t i = 0; i < run.results.size(); ++i)
      ASSERT_TRUE(run.results[i].success) << i << ": " << run.results[i].error;
    for (const auto& e : run.engines) EXPECT_EQ(e.blocks_in_use, 0) << e.name;
  }
}

TEST_P(DisaggregatedSimulation, ASlowLinkDelaysTheFirstTokenByItsTransferTime) {
  // 100 KB/s: the transfer of a 200-token prompt's cache (tens of MB for DeepSeek-V3's 61 layers)
  // takes minutes, far longer than any step; the first token waits for it.
  auto o = pd_options(GetParam(), 1, 1, "deepseek-v3-h800");
  o.kv_link.bytes_per_s = 1e5;
  o.kv_transfer_timeout_s = 1e6;
  const auto run = simulate({request(0, words(200, 3), 4)}, o, tokenizer());
  ASSERT_TRUE(run.results[0].success) << run.results[0].error;
  ASSERT_EQ(run.kv_transfers, 1);
  const double transfer_s = run.kv_transfer_bytes / 1e5;
  EXPECT_GT(transfer_s, 60);
  EXPECT_GE(run.results[0].ttft_s, transfer_s);
  EXPECT_LT(run.results[0].ttft_s, transfer_s + 1.0);
}

TEST_P(DisaggregatedSimulation, TheSameInputsGiveTheSameRun) {
  const auto reqs = random_requests(20, 9);
  const auto o = pd_options(GetParam(), 2, 2, "deepseek-v3-h800");
  const auto a = simulate(reqs, o, tokenizer());
  const auto b = simulate(reqs, o, tokenizer());
  for (size_t i = 0; i < a.results.size(); ++i) {
    EXPECT_EQ(a.results[i].ttft_s, b.results[i].ttft_s) << i;
    EXPECT_EQ(a.results[i].latency_s, b.results[i].latency_s) << i;
  }
  EXPECT_EQ(a.kv_transfer_bytes, b.kv_transfer_bytes);
}

TEST(ClusterSimulation, ARunRepeatsWhenBodiesTakeTimeByTheirBytes) {
  // One request at a time on idle engines: each first token waits for its bodies' bytes, among
  // them the bootstrap room's decimal digits, which the gateway draws at random (18 or 19 digits).
  auto reqs = random_requests(40, 11);
  for (size_t i = 0; i < reqs.size(); ++i) reqs[i].arrival_s = 5.0 * double(i);
  auto o = pd_options(gateway::PdMode::kParallel, 1, 1, "deepseek-v3-h800");
  o.body_bytes_per_s = 1e6;
  const auto a = simulate(reqs, o, tokenizer());
  const auto b = simulate(reqs, o, tokenizer());
  ASSERT_EQ(a.results.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(a.results[i].success) << i << ": " << a.results[i].error;
    EXPECT_EQ(a.results[i].ttft_s, b.results[i].ttft_s) << i;
    EXPECT_EQ(a.results[i].latency_s, b.results[i].latency_s) << i;
  }
}

TEST_P(DisaggregatedSimulation, ARequestNoEngineCanHoldIsRefusedAtOnceAndEjectsNoEngine) {
  // 64 blocks of 16 tokens: a 2000-token prompt fits no engine, even an idle one.
  auto o = pd_options(GetParam(), 1, 1, "deepseek-v3-h800");
  o.executor.num_blocks = 64;
  std::vector<bench::BenchRequest> reqs;
  reqs.push_back(request(0.0, words(2000, 1), 8));
  for (int i = 0; i < 4; ++i) reqs.push_back(request(0.5 + 0.5 * i, words(100, 50 + 10 * i), 8));
  const auto run = simulate(reqs, o, tokenizer());
  ASSERT_FALSE(run.results[0].success);
  // The engine's own answer (a 400 that says why), not a hold until the queue timeout (503) nor
  // an engine failure (502).
  EXPECT_NE(run.results[0].error.find("HTTP 400"), std::string::npos) << run.results[0].error;
  // The cache's 64 x 16 tokens are the longest sequence (since 0002fb9 the engine says so as its
  // maximum context length).
  EXPECT_NE(run.results[0].error.find("maximum context length is 1024 tokens"), std::string::npos)
      << run.results[0].error;
  EXPECT_LT(run.results[0].latency_s, 1.0);
  for (size_t i = 1; i < reqs.size(); ++i)
    EXPECT_TRUE(run.results[i].success) << i << ": " << run.results[i].error;
  EXPECT_EQ(run.engine_failures, 0);
  EXPECT_EQ(run.retries, 0);
  for (const auto& e : run.engines) EXPECT_TRUE(e.healthy) << e.name;
}

TEST(ClusterSimulation, AParallelPrefillIsAnsweredWhenTheEngineNextLoopsNotAfterItsNextPass) {
  // SGLang's flow: the prefill leg is answered once the KV has left. A (100 tokens) prefills
  // 0-0.110 s and its KV leaves; B (500) prefills 0.110-0.620 s, and A's transfer ends during that
  // step; C (200) arrives meanwhile and runs 0.620-0.830 s. A live engine's loop takes A's finished
  // transfer in at 0.620 and answers A's prefill leg then, before C's forward pass; it does not
  // wait for that pass to end.
  auto o = pd_options(gateway::PdMode::kParallel, 1, 1, hand_model());
  const auto path = test::scratch_path("tandem_sim_prefill_answer", ".log");
  o.gateway.access_log = path.string();
  const auto run = simulate({request(0, words(100, 1), 2), request(0.05, words(500, 5), 2),
                             request(0.2, words(200, 9), 2)},
                            o, tokenizer());
  for (const auto& r : run.results) ASSERT_TRUE(r.success) << r.error;
  std::ifstream in(path);
  std::optional<double> prefill_done;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j["prompt_tokens"] == 100) prefill_done = j["phases"]["prefill_done"].get<double>();
  }
  ASSERT_TRUE(prefill_done.has_value());
  EXPECT_NEAR(*prefill_done, 0.620, 0.005);
}

TEST(ClusterSimulation, AShortPromptPassesALongOneAtItsNextChunkByDeadline) {
  // One prefill engine, chunks of 2048 tokens at 10 ms + 1 ms per token a step. A 6000-token
  // prompt arrives at 0 s and a 100-token one at 0.5 s, during the long one's first step
  // (0-2.058 s). By deadline (the tandem policy's default) the short prompt is due first and takes
  // 100 tokens of the second step, which ends at 4.116 s; the long one goes on with 1948 and
  // ends in the third (2004 tokens: 6.130 s). First come first served (no slack) the long one
  // keeps the budget and the short one fits beside its last 1904 tokens in the third step. A
  // first token comes a decode step (10 ms) and a KV transfer (about 1 ms) after its prefill.
  for (const double slack : {8.0, 0.0}) {
    auto o = pd_options(gateway::PdMode::kParallel, 1, 1, hand_model());
    o.gateway.scheduling.tandem.prefill_deadline_slack = slack;
    const auto run =
        simulate({request(0, words(6000, 1), 2), request(0.5, words(100, 5), 2)}, o, tokenizer());
    for (const auto& r : run.results) ASSERT_TRUE(r.success) << r.error;
    EXPECT_NEAR(run.results[1].ttft_s, (slack > 0 ? 4.116 : 6.130) + 0.011 - 0.5, 0.003)
        << "slack " << slack;
    // The long one is computed by 6.130 s either way (its first token may also wait for the
    // short one's decode step).
    EXPECT_GT(run.results[0].ttft_s, 6.130) << "slack " << slack;
    EXPECT_LT(run.results[0].ttft_s, 6.130 + 0.025) << "slack " << slack;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, DisaggregatedSimulation,
                         ::testing::Values(gateway::PdMode::kSequential,
                                           gateway::PdMode::kParallel),
                         [](const auto& info) {
                           return std::string(gateway::mode_name(info.param));
                         });

TEST(ClusterSimulation, AnEngineThatDiesIsEjectedAndLaterRequestsGoToTheOthers) {
  // 40 requests over 20 s on two engines; decode-0 dies at 5 s. Its streams are cut (those
  // requests fail, as a live client would see), its health probes fail, and every request that
  // arrives after the gateway ejected it is served by decode-1.
  auto reqs = random_requests(40, 13);
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].arrival_s = 0.5 * double(i);
    reqs[i].output_len = 200;  // ~5 s of decode each: several stream on decode-0 when it dies
  }
  auto o = options(2, "deepseek-v3-h800");
  o.gateway.policy = "round_robin";
  o.faults = {{Fault::Kind::kDeath, "decode-0", 5.0}};
  const auto run = simulate(reqs, o, tokenizer());
  const double ejected_by = 5.0 + 3 * 2.0 + 2.0;  // three failed probes, 2 s apart, and slack
  size_t failed = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    if (!run.results[i].success) ++failed;
    if (reqs[i].arrival_s < 5.0 - 1e-9) continue;  // before the death: anything may have happened
    if (reqs[i].arrival_s > ejected_by) {
      EXPECT_TRUE(run.results[i].success) << i << ": " << run.results[i].error;
    }
  }
  EXPECT_GT(failed, 0u);  // the streams it was sending, cut
  EXPECT_LT(failed, reqs.size() / 2);
  ASSERT_EQ(run.engines.size(), 2u);
  EXPECT_TRUE(run.engines[0].died);
  EXPECT_FALSE(run.engines[1].died);
  EXPECT_EQ(run.engines[1].blocks_in_use, 0);
}

TEST(ClusterSimulation, APrefillEngineThatDiesLeavesItsRequestsToTheOtherPrefillEngine) {
  auto reqs = random_requests(30, 17);
  for (size_t i = 0; i < reqs.size(); ++i) reqs[i].arrival_s = 0.5 * double(i);
  auto o = pd_options(gateway::PdMode::kParallel, 2, 2, "deepseek-v3-h800");
  o.faults = {{Fault::Kind::kDeath, "prefill-1", 3.0}};
  const auto run = simulate(reqs, o, tokenizer());
  // Requests arriving once prefill-1 is ejected all succeed, on prefill-0.
  for (size_t i = 0; i < reqs.size(); ++i)
    if (reqs[i].arrival_s > 3.0 + 8.0) {
      EXPECT_TRUE(run.results[i].success) << i << ": " << run.results[i].error;
    }
  EXPECT_TRUE(run.engines[1].died);  // prefill-1
  for (const auto& e : run.engines) {
    if (!e.died) {
      EXPECT_EQ(e.blocks_in_use, 0) << e.name;
    }
  }
}

TEST(ClusterSimulation, AStalledEngineIsEjectedAndItsStreamsResumeWhenItWakes) {
  // decode-0 hangs from 5 s to 35 s, shorter than the gateway's idle timeout (120 s): its probes
  // at 6, 8 and 10 s time out a second later, ejecting it at 11 s. Round robin sends it every
  // other request (those sent at 0.25 s past a whole second: none at the ejection's instant).
  // Those it got from 5 s to 11 s (sent at 5.25, 6.25, .., 10.25 s) sent their clients nothing:
  // as live (Dispatcher::engines_changed) their legs are cut at the ejection and retried on
  // decode-1, their first tokens after 11 s. Later requests go to decode-1; the streams decode-0
  // was sending (the one sent at 4.25 s had its first token before 5 s) pause and then finish.
  // Nothing is lost; it is healthy again at the end.
  auto reqs = random_requests(60, 21);
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].arrival_s = 0.25 + 0.5 * double(i);
    reqs[i].output_len = 100;
  }
  auto o = options(2, "deepseek-v3-h800");
  o.gateway.policy = "round_robin";
  o.faults = {{Fault::Kind::kStall, "decode-0", 5.0, 30.0}};
  const auto run = simulate(reqs, o, tokenizer());
  size_t paused = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto& r = run.results[i];
    ASSERT_TRUE(r.success) << i << ": " << r.error;
    const double longest_gap =
        r.itl_s.empty() ? 0 : *std::max_element(r.itl_s.begin(), r.itl_s.end());
    if (longest_gap > 20 || r.ttft_s > 20) ++paused;
    const double at = reqs[i].arrival_s;
    if (i % 2 == 0 && at >= 5.0 && at <= 11.0) {
      EXPECT_GE(at + r.ttft_s, 11.0) << i << ": cut at the ejection";
      EXPECT_LT(at + r.ttft_s, 12.0) << i << ": retried on decode-1 at once";
    } else if (i % 2 == 0 && at < 5.0) {
      EXPECT_LT(at + r.ttft_s, 5.0) << i << ": streaming when decode-0 stalled";
    } else if (at > 11.0 && at < 35) {
      EXPECT_LT(r.ttft_s + longest_gap, 5.0) << i << ": served by decode-1";
    }
  }
  EXPECT_GT(paused, 0u);
  EXPECT_GT(run.timeouts, 0);  // the probes
  EXPECT_EQ(run.retries, 6);   // sent at 5.25, 6.25, .., 10.25 s
  for (const auto& e : run.engines) {
    EXPECT_TRUE(e.healthy) << e.name;
    EXPECT_EQ(e.blocks_in_use, 0) << e.name;
  }
}

TEST(ClusterSimulation, TheLegOfAStalledEngineThatFailsItsProbesIsRetriedElsewhereOnItsEjection) {
  // As the live gateway (Dispatcher::engines_changed): decode-0 hangs from 5 s; a 20-token request
  // sent there at 5.5 s has sent its client nothing. The probes at 6, 8 and 10 s time out a
  // second later (7, 9, 11 s): the third ejects it at 11 s, its leg is cut and retried on decode-1,
  // which prefills it in one step of 10 + 20 ms and decodes the other 3 tokens in 10 ms each. The
  // simulator dispatched there instead, and the leg waited for decode-0 to wake at 105 s.
  auto o = options(2, hand_model());
  o.gateway.policy = "round_robin";  // the first request goes to decode-0
  o.gateway.timeouts.first_token = o.gateway.timeouts.idle = std::chrono::seconds(1000);
  o.faults = {{Fault::Kind::kStall, "decode-0", 5.0, 100.0}};
  const auto run = simulate({request(5.5, words(20, 1), 4)}, o, tokenizer());
  const auto& r = run.results[0];
  ASSERT_TRUE(r.success) << r.error;
  EXPECT_NEAR(r.ttft_s, 11.0 + 0.030 - 5.5, 1e-9);
  EXPECT_NEAR(r.latency_s, 11.0 + 0.030 + 3 * 0.010 - 5.5, 1e-9);
  EXPECT_EQ(run.retries, 1);
  ASSERT_EQ(run.engines.size(), 2u);
  EXPECT_EQ(run.engines[1].steps, 4);
}

TEST(ClusterSimulation, AnEngineEjectedForFailedRequestsThatAnswersItsProbesKeepsItsLegs) {
  // decode-0 hangs from 0.1 s to 1.9 s, between its probes at 0 and 2 s, which both pass. The
  // legs sent there at 0.2, 0.3 and 0.4 s time out at 1.2, 1.3 and 1.4 s (first-token timeout
  // 1 s, no probe passed since they left): three failed requests eject it at 1.4 s, its probes
  // still passing, and they are retried on decode-1. D, sent there at 1 s, has sent its client
  // nothing when load reports come again after 1.9 s: it keeps its leg, as live (an engine
  // ejected for failed requests may be working through its legs), and decode-0 prefills it as
  // it wakes, in one step of 10 + 20 ms, and decodes its other 3 tokens in 10 ms each.
  auto o = options(2, hand_model());
  o.gateway.policy = "round_robin";  // decode-0, decode-1 in turn
  o.gateway.timeouts.first_token = std::chrono::seconds(1);
  o.faults = {{Fault::Kind::kStall, "decode-0", 0.1, 1.8}};
  std::vector<bench::BenchRequest> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(request(0.2 + 0.05 * i, words(20, size_t(i)), 4));
  reqs.push_back(request(1.0, words(20, 9), 4));  // D, to decode-0
  const auto run = simulate(reqs, o, tokenizer());
  for (size_t i = 0; i < reqs.size(); ++i)
    ASSERT_TRUE(run.results[i].success) << i << ": " << run.results[i].error;
  const auto& d = run.results.back();
  EXPECT_NEAR(d.ttft_s, 1.9 + 0.030 - 1.0, 1e-9);
  EXPECT_NEAR(d.latency_s, 1.9 + 0.030 + 3 * 0.010 - 1.0, 1e-9);
  EXPECT_EQ(run.retries, 3);           // the timed-out legs, not D's
  EXPECT_EQ(run.engines[0].steps, 4);  // D's alone
  // Still ejected: the run ends with D's answer at 1.96 s, before its probe at 2 s readmits it.
  EXPECT_FALSE(run.engines[0].healthy);
}

TEST(ClusterSimulation, AStalledEngineDropsTheCallsWhoseCallersGaveUp) {
  // A hung engine keeps a call until its stall ends only while its caller still waits: the
  // gateway probes every 2 s and polls every 100 ms, each call timing out after a second, and
  // kept, they grew without bound over a long stall.
  OneEngine rig;
  auto& [clock, upstream, engine] = rig;
  engine.stall(clock.now() + std::chrono::seconds(1000000));
  int answered = 0, timed_out = 0;
  auto probe = [&](std::chrono::seconds timeout) {
    net::AsyncHttpRequest r;
    r.host = "engine-0";
    r.port = 1;
    r.target = "/health";
    r.timeout = timeout;
    net::AsyncHttpHandlers h;
    h.on_done = [&](const std::string& error) { ++(error.empty() ? answered : timed_out); };
    upstream.start(std::move(r), std::move(h));
  };
  for (int i = 0; i < 1000; ++i) {
    probe(std::chrono::seconds(1));
    clock.advance_by(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(timed_out, 991);          // those sent by 99 s
  EXPECT_LE(engine.deferred(), 10u);  // those still waiting
  EXPECT_LE(clock.pending_timers(), 20u);
  // A caller that waits long enough is answered when the stall ends.
  probe(std::chrono::seconds(2000000));
  clock.advance_by(std::chrono::seconds(1000000));
  EXPECT_EQ(answered, 1);
  EXPECT_EQ(engine.deferred(), 0u);
}

TEST(ClusterSimulation, AStallThatEndsInsideANanosecondEndsForTheCallsThatWaited) {
  // 496.4 s is no whole number of nanoseconds: the stall's end, kept in seconds, was armed at the
  // nanosecond before it, when the engine was still stalled, and nothing woke it again.
  OneEngine rig;
  auto& [clock, upstream, engine] = rig;
  engine.stall(clock.now() + duration_of(496.4));
  int answered = 0;
  net::AsyncHttpRequest r;
  r.host = "engine-0";
  r.port = 1;
  r.target = "/health";
  r.timeout = std::chrono::seconds(1000);
  net::AsyncHttpHandlers h;
  h.on_done = [&](const std::string& error) { answered += error.empty(); };
  upstream.start(std::move(r), std::move(h));
  clock.advance_by(duration_of(496));
  EXPECT_EQ(answered, 0);
  clock.advance_by(duration_of(1));
  EXPECT_EQ(answered, 1);
  EXPECT_FALSE(engine.stalled());
  EXPECT_EQ(engine.deferred(), 0u);
}

TEST(ClusterSimulation, ARunWithAStallThatEndsInsideANanosecondFinishes) {
  // `--stall decode-0@400+96.4` (and a prefill engine's, whose KV requests waited for it) hung
  // `tandem simulate`: the engine never stepped after its stall, and the run polled it forever
  // (or until the gateway's timeouts gave up on it). In a child whose CPU time is bounded, so
  // that a hang fails rather than hangs.
  for (const std::string stalled : {"decode-0", "prefill-0"}) {
    SCOPED_TRACE(stalled);
    std::vector<bench::BenchRequest> reqs = random_requests(6, 41);
    for (size_t i = 0; i < reqs.size(); ++i) reqs[i].arrival_s = 398.0 + 0.5 * double(i);
    reqs.push_back(request(500.0, words(50, 1), 4));  // after the stall
    auto o = pd_options(gateway::PdMode::kSequential, 1, 1, "deepseek-v3-h800");
    o.gateway.timeouts.prefill = o.gateway.timeouts.first_token = o.gateway.timeouts.idle =
        std::chrono::seconds(1000);
    o.kv_transfer_timeout_s = 1000;
    o.faults = {{Fault::Kind::kStall, stalled, 400.0, 96.4}};
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      const rlimit cpu{120, 120};
      ::setrlimit(RLIMIT_CPU, &cpu);
      const SimulationRun run = simulate(reqs, o, tokenizer());
      // Every request answered by the stall's end (496.4 s) and a little more, none after the
      // gateway's timeouts (1000 s). Those the stalled engine held that had sent nothing are
      // answered when its probes eject it (at 407 s), as live: their legs are cut and no other
      // engine of its pool can take them. The request sent after the stall is served: the
      // engine woke.
      const bool all = std::all_of(run.results.begin(), run.results.end(), [](const auto& x) {
        return x.latency_s < 200 &&
               (x.success || x.error.find("no healthy engine") != std::string::npos);
      });
      ::_exit(all && run.results.back().success ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status)) << "ended by signal " << WTERMSIG(status);
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }
}

TEST(ClusterSimulation, ARunEndsWithTheLastAnswerNotWithALongStall) {
  // decode-0 hangs from 1 s for 10^6 s; its request fails by the gateway's timeouts and the
  // others go to decode-1. The run ends then (plus at most the transfer timeout, for held
  // blocks), not after the stall: the stalled engine is reported as such.
  auto reqs = random_requests(8, 31);
  auto o = options(2, "deepseek-v3-h800");
  o.gateway.policy = "round_robin";
  o.gateway.timeouts.idle = o.gateway.timeouts.first_token = std::chrono::seconds(10);
  o.faults = {{Fault::Kind::kStall, "decode-0", 0.1, 1e6}};
  const auto run = simulate(reqs, o, tokenizer());
  EXPECT_LT(run.virtual_end_s, 1000);
  size_t failed = 0;
  for (const auto& r : run.results) failed += !r.success;
  EXPECT_GT(failed, 0u);
  EXPECT_LT(failed, reqs.size());
  ASSERT_EQ(run.engines.size(), 2u);
  EXPECT_TRUE(run.engines[0].stalled);
  EXPECT_FALSE(run.engines[1].stalled);
  EXPECT_EQ(run.engines[1].blocks_in_use, 0);
}

TEST(ClusterSimulation, AStallLongerThanTheIdleTimeoutCutsItsStreamsByTheTimeout) {
  auto reqs = random_requests(20, 23);
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].arrival_s = 0.5 * double(i);
    reqs[i].output_len = 200;
  }
  auto o = options(2, "deepseek-v3-h800");
  o.gateway.policy = "round_robin";
  o.gateway.timeouts.idle = o.gateway.timeouts.first_token = std::chrono::seconds(10);
  o.faults = {{Fault::Kind::kStall, "decode-0", 3.0, 60.0}};
  const auto run = simulate(reqs, o, tokenizer());
  size_t failed = 0;
  for (const auto& r : run.results) failed += !r.success;
  EXPECT_GT(failed, 0u);  // streams decode-0 was sending, cut after 10 s of silence
  EXPECT_LT(failed, reqs.size());
  EXPECT_GT(run.engine_failures, 0);
  for (const auto& e : run.engines) EXPECT_EQ(e.blocks_in_use, 0) << e.name;
}

TEST(ClusterSimulation, ADecodeEngineStalledPastTheTimeoutsLetsGoOfItsBootstrapRooms) {
  // Parallel P/D, decode-0 hangs for 60 s, longer than the gateway's first-token and idle
  // timeouts (10 s here): its legs are cancelled while their rooms wait on the prefill engines,
  // which must learn it (the rooms fail and free their blocks) without the run breaking.
  auto reqs = random_requests(30, 29);
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].arrival_s = 0.3 * double(i);
    reqs[i].output_len = 100;
  }
  auto o = pd_options(gateway::PdMode::kParallel, 2, 2, "deepseek-v3-h800");
  o.gateway.timeouts.idle = o.gateway.timeouts.first_token = std::chrono::seconds(10);
  o.faults = {{Fault::Kind::kStall, "decode-0", 2.0, 60.0}};
  const auto run = simulate(reqs, o, tokenizer());
  size_t failed = 0;
  for (const auto& r : run.results) failed += !r.success;
  EXPECT_LT(failed, reqs.size());
  EXPECT_GT(run.timeouts, 0);
  for (const auto& e : run.engines) EXPECT_EQ(e.blocks_in_use, 0) << e.name;
}

TEST(ClusterSimulation, ASlowLinkFaultDelaysTheTransfersThatStartWhileItLasts) {
  // The links of prefill-0 run 10x slower from 0 to 200 s: the first request's transfer takes
  // 10x as long; one sent after the fault ended takes the link's own time.
  auto o = pd_options(gateway::PdMode::kParallel, 1, 1, "deepseek-v3-h800");
  o.kv_link.bytes_per_s = 1e6;
  o.kv_transfer_timeout_s = 1e6;
  o.gateway.timeouts.prefill = o.gateway.timeouts.first_token = std::chrono::seconds(10000);
  o.faults = {{Fault::Kind::kSlowLink, "prefill-0", 0.0, 200.0, 10.0}};
  const auto run =
      simulate({request(0, words(200, 3), 4), request(300, words(200, 5), 4)}, o, tokenizer());
  ASSERT_TRUE(run.results[0].success) << run.results[0].error;
  ASSERT_TRUE(run.results[1].success) << run.results[1].error;
  ASSERT_EQ(run.kv_transfers, 2);
  const double transfer_s = run.kv_transfer_bytes / 2 / 1e6;  // at full speed
  EXPECT_GT(transfer_s, 5);
  EXPECT_GE(run.results[0].ttft_s, 10 * transfer_s);
  EXPECT_LT(run.results[0].ttft_s, 10 * transfer_s + 1.0);
  EXPECT_GE(run.results[1].ttft_s, transfer_s);
  EXPECT_LT(run.results[1].ttft_s, transfer_s + 1.0);
}

TEST(ClusterSimulation, SlowLinkFaultsOnOneEngineDoNotCancelEachOther) {
  // Two slow-link faults on prefill-0 that overlap, or run back to back: while either lasts its
  // links run at the slowest one's speed. The later fault's start overwrote the factor and the
  // first one's end set it back to 1 (back to back, listed later-first, they meet at one instant).
  const std::vector<std::vector<Fault>> cases = {
      {{Fault::Kind::kSlowLink, "prefill-0", 10.0, 10.0, 10.0},
       {Fault::Kind::kSlowLink, "prefill-0", 0.0, 10.0, 10.0}},
      {{Fault::Kind::kSlowLink, "prefill-0", 0.0, 100.0, 10.0},
       {Fault::Kind::kSlowLink, "prefill-0", 10.0, 10.0, 2.0}}};
  const double sent_at[] = {12, 50};  // as the 10..20 s fault lasts; after it, in the 0..100 s one
  for (size_t c = 0; c < cases.size(); ++c) {
    SCOPED_TRACE(c);
    auto o = pd_options(gateway::PdMode::kParallel, 1, 1, "deepseek-v3-h800");
    o.kv_link.bytes_per_s = 1e6;
    o.kv_transfer_timeout_s = 1e6;
    o.gateway.timeouts.prefill = o.gateway.timeouts.first_token = std::chrono::seconds(10000);
    o.faults = cases[c];
    const auto run = simulate(
        {request(sent_at[c], words(200, 3), 4), request(300, words(200, 5), 4)}, o, tokenizer());
    ASSERT_TRUE(run.results[0].success) << run.results[0].error;
    ASSERT_TRUE(run.results[1].success) << run.results[1].error;
    const double transfer_s = run.kv_transfer_bytes / 2 / 1e6;  // at full speed
    EXPECT_GE(run.results[0].ttft_s, 10 * transfer_s);
    EXPECT_LT(run.results[0].ttft_s, 10 * transfer_s + 1.0);
    EXPECT_LT(run.results[1].ttft_s, transfer_s + 1.0);  // both ended
  }
}

// P/D with one decode engine whose KV transfers take seconds (a 200-token prompt's over 5 s at
// 1 MB/s), bounded by `kv_transfer_timeout_s`, under gateway timeouts that end no request first.
SimulationOptions slow_transfer_options(gateway::PdMode mode, int prefill,
                                        double kv_transfer_timeout_s) {
  auto o = pd_options(mode, prefill, 1, "deepseek-v3-h800");
  o.kv_link.bytes_per_s = 1e6;
  o.kv_transfer_timeout_s = kv_transfer_timeout_s;
  o.gateway.timeouts.prefill = o.gateway.timeouts.first_token = o.gateway.timeouts.idle =
      std::chrono::seconds(10000);
  return o;
}

TEST(ClusterSimulation, AStalledEngineMovesNoKvUntilItWakes) {
  // A stall is the engine frozen whole, as bench/chaos.sh stops it (SIGSTOP): its KV transfer
  // threads too. A transfer under way when either engine of its link stalls stops, and goes on
  // when the engine wakes: the first token comes the stall's length later. A stalled prefill
  // engine kept streaming its KV, and its stall delayed nothing. The stall (3 s to 4.5 s) answers
  // its probe of 4 s within the probe timeout: a longer one would eject the engine at 9 s and, as
  // live, cut a leg that sent its client nothing (the decode leg, or a parallel prefill leg whose
  // room is sending), which no other engine of its pool could take.
  for (const auto mode : {gateway::PdMode::kSequential, gateway::PdMode::kParallel})
    for (const std::string stalled : {"", "prefill-0", "decode-0"}) {
      SCOPED_TRACE(std::string(gateway::mode_name(mode)) + " " + stalled);
      auto o = slow_transfer_options(mode, 1, 1e5);
      const double stall_s = stalled.empty() ? 0 : 1.5;
      if (!stalled.empty()) o.faults = {{Fault::Kind::kStall, stalled, 3.0, stall_s}};
      const auto run = simulate({request(0, words(200, 3), 4)}, o, tokenizer());
      ASSERT_TRUE(run.results[0].success) << run.results[0].error;
      ASSERT_EQ(run.kv_transfers, 1);
      const double transfer_s = run.kv_transfer_bytes / 1e6;
      EXPECT_GT(transfer_s, 5);  // under way at 3 s
      EXPECT_GE(run.results[0].ttft_s, transfer_s + stall_s);
      EXPECT_LT(run.results[0].ttft_s, transfer_s + stall_s + 1.0);
    }
}

TEST(ClusterSimulation, ATransferFrozenByAStallLongerThanTheTransferTimeoutFails) {
  // Live, each frame of a transfer is sent and received within --kv-transfer-timeout: an engine
  // stopped mid-transfer for longer fails it at the timeout from the stall's start, as the prefill
  // engine's fault, and the gateway prefills the request again on the other prefill engine. The
  // transfer of a 200-token prompt's KV (over 5 s at 1 MB/s) from prefill-0 to decode-0 is under
  // way when one of them stalls from 3 s to 4.5 s (its probe of 4 s answered within the probe
  // timeout: not ejected); with a 1 s timeout it fails at 4 s. prefill-0 stalled: decode-0 hears
  // it at once and the KV moves again from prefill-1, the first token after 4 s plus a whole
  // transfer. decode-0 stalled: it hears it when it wakes at 4.5 s, and the first token comes
  // after 4.5 s plus a whole transfer. The access log names the attempt that served the request:
  // prefill-1, as the first attempt's prefill engine was blamed, by decode-0's failed fetch (in
  // parallel mode with decode-0 stalled, by prefill-0's own leg, failed with its room at 4 s), and
  // left out of the retry; blamed on decode-0, the retry went back to prefill-0, which holds the
  // prompt's prefix. The simulator paused the transfer for the stall and went on, the first token
  // a transfer and 1.5 s in. Every block is free at the end: the failed hold or room let go.
  for (const auto mode : {gateway::PdMode::kSequential, gateway::PdMode::kParallel})
    for (const std::string stalled : {"prefill-0", "decode-0"}) {
      SCOPED_TRACE(std::string(gateway::mode_name(mode)) + " " + stalled);
      auto o = slow_transfer_options(mode, 2, 1);
      o.gateway.policy = "cache_aware";  // prefill-0 first (both idle), then where the prefix is
      const auto path = test::scratch_path("tandem_sim_frozen_transfer", ".log");
      o.gateway.access_log = path.string();
      o.faults = {{Fault::Kind::kStall, stalled, 3.0, 1.5}};
      const auto run = simulate({request(0, words(200, 3), 4)}, o, tokenizer());
      ASSERT_TRUE(run.results[0].success) << run.results[0].error;
      EXPECT_EQ(run.retries, 1);
      ASSERT_EQ(run.kv_transfers, 1);  // the second
      const double transfer_s = run.kv_transfer_bytes / 1e6;
      EXPECT_GT(transfer_s, 5);  // the first was under way at 3 s
      const double retried_s = stalled == "prefill-0" ? 4.0 : 4.5;
      EXPECT_GE(run.results[0].ttft_s, retried_s + transfer_s);
      EXPECT_LT(run.results[0].ttft_s, retried_s + transfer_s + 1.0);
      std::ifstream in(path);
      std::string line;
      ASSERT_TRUE(std::getline(in, line));
      const auto j = nlohmann::json::parse(line);
      EXPECT_EQ(j["attempts"], 2);
      EXPECT_EQ(j["prefill"], "prefill-1");
      EXPECT_EQ(j["decode"], "decode-0");
      for (const auto& e : run.engines) EXPECT_EQ(e.blocks_in_use, 0) << e.name;
    }
}

TEST(ClusterSimulation,
     APrefillEngineStalledMidTransferIsEjectedByItsProbesAndServesAgainWhenItWakes) {
  // Parallel P/D: prefill-0 hangs from 3 s to 13 s while its room streams the KV of A (sent at 0 s,
  // a 200-token prompt, over 5 s at 1 MB/s) to decode-0. The transfer fails at 4 s (--kv-transfer-
  // timeout 1 s), as prefill-0's fault, and A is prefilled again on prefill-1. Its probes of 4, 6
  // and 8 s time out: three failures in a row eject it at 9 s, as the gateway's rule says (the
  // transfer's failure is no fourth: a probe passed since A was sent, so it counts as overload).
  // B, sent at 11 s while it is out, goes to prefill-1 and does not wait for the wake. It wakes at
  // 13 s, its probe of 14 s readmits it, and it serves again: later requests take turns on both.
  // Nothing is lost and every block is free at the end.
  auto o = slow_transfer_options(gateway::PdMode::kParallel, 2, 1);
  o.gateway.policy = "round_robin";  // prefill-0 first
  const auto path = test::scratch_path("tandem_sim_stalled_room", ".log");
  o.gateway.access_log = path.string();
  o.faults = {{Fault::Kind::kStall, "prefill-0", 3.0, 10.0}};
  std::vector<bench::BenchRequest> reqs = {request(0, words(200, 3), 4),
                                           request(11, words(20, 7), 4)};
  for (int i = 0; i < 4; ++i) reqs.push_back(request(30 + i, words(20, size_t(10 + i)), 4));
  const auto run = simulate(reqs, o, tokenizer());
  for (size_t i = 0; i < reqs.size(); ++i)
    ASSERT_TRUE(run.results[i].success) << i << ": " << run.results[i].error;
  EXPECT_EQ(run.retries, 1);  // A's
  EXPECT_LT(run.results[1].ttft_s, 13.0 - 11.0);
  std::map<std::string, nlohmann::json> lines;  // by request id (sim-N: the Nth sent)
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    lines[j["request_id"]] = j;
  }
  ASSERT_EQ(lines.size(), reqs.size());
  EXPECT_EQ(lines["sim-0"]["attempts"], 2);
  EXPECT_EQ(lines["sim-0"]["prefill"], "prefill-1");
  EXPECT_EQ(lines["sim-1"]["attempts"], 1);
  EXPECT_EQ(lines["sim-1"]["prefill"], "prefill-1");
  int on_prefill_0 = 0;
  for (int i = 2; i < 6; ++i)
    on_prefill_0 += lines["sim-" + std::to_string(i)]["prefill"] == "prefill-0";
  EXPECT_EQ(on_prefill_0, 2);
  for (const auto& e : run.engines) {
    EXPECT_TRUE(e.healthy) << e.name;  // prefill-0 readmitted
    EXPECT_EQ(e.blocks_in_use, 0) << e.name;
    // prefill-0 by its probes, once (B did not wait for its wake); no other engine.
    EXPECT_EQ(e.ejections, e.name == "prefill-0" ? 1 : 0) << e.name;
  }
}

TEST(ClusterSimulation, APullFromAStalledPrefillEngineFailsAtTheHandshakeTimeoutAndIsRetried) {
  // As live engines since the handshake timeout bounds a pull: decode-0 is stalled when the
  // decode leg comes (it takes the leg when it wakes at 5.5 s; its probes of 2 and 4 s fail, too
  // few to eject it, which would cut the leg) and prefill-0, which holds the KV, is stalled from
  // 5 s to 35 s: the pull fails at the handshake timeout (5 s) as prefill-0's fault, and the
  // gateway prefills the request again on prefill-1, long before prefill-0 wakes.
  auto o = pd_options(gateway::PdMode::kSequential, 2, 1, hand_model());
  o.gateway.timeouts.prefill = o.gateway.timeouts.first_token = o.gateway.timeouts.idle =
      std::chrono::seconds(1000);
  o.faults = {{Fault::Kind::kStall, "decode-0", 0.01, 5.49},
              {Fault::Kind::kStall, "prefill-0", 5.0, 30.0}};
  const auto run = simulate({request(0, words(20, 1), 4)}, o, tokenizer());
  ASSERT_TRUE(run.results[0].success) << run.results[0].error;
  EXPECT_EQ(run.retries, 1);
  EXPECT_EQ(run.kv_transfers, 1);
  EXPECT_GE(run.results[0].ttft_s, 10.5);  // the pull began at 5.5 s and failed 5 s later
  EXPECT_LT(run.results[0].ttft_s, 11.5);  // not prefill-0's wake (35 s)
}

// --kv-transfer-handshake-timeout bounds the pull of the test above as `tandem engine`'s flag
// does: at 2 s the pull that began at 5.5 s fails at 7.5 s, and the request is prefilled again.
TEST(ClusterSimulation, TheHandshakeTimeoutBoundsAPullFromAStalledPrefillEngine) {
  auto o = pd_options(gateway::PdMode::kSequential, 2, 1, hand_model());
  o.gateway.timeouts.prefill = o.gateway.timeouts.first_token = o.gateway.timeouts.idle =
      std::chrono::seconds(1000);
  o.kv_transfer_handshake_timeout_s = 2;
  o.faults = {{Fault::Kind::kStall, "decode-0", 0.01, 5.49},
              {Fault::Kind::kStall, "prefill-0", 5.0, 30.0}};
  const auto run = simulate({request(0, words(20, 1), 4)}, o, tokenizer());
  ASSERT_TRUE(run.results[0].success) << run.results[0].error;
  EXPECT_EQ(run.retries, 1);
  EXPECT_GE(run.results[0].ttft_s, 7.5);
  EXPECT_LT(run.results[0].ttft_s, 8.5);  // not at the 5 s default's 10.5 s
}

// Two runs of one workload agree in everything they report.
void expect_same_run(const SimulationRun& a, const SimulationRun& b) {
  ASSERT_EQ(a.results.size(), b.results.size());
  for (size_t i = 0; i < a.results.size(); ++i) {
    const auto &x = a.results[i], &y = b.results[i];
    EXPECT_EQ(x.success, y.success) << i;
    EXPECT_EQ(x.error, y.error) << i;
    EXPECT_EQ(x.start_s, y.start_s) << i;
    EXPECT_EQ(x.ttft_s, y.ttft_s) << i;
    EXPECT_EQ(x.latency_s, y.latency_s) << i;
    EXPECT_EQ(x.itl_s, y.itl_s) << i;
    EXPECT_EQ(x.output_tokens, y.output_tokens) << i;
  }
  EXPECT_EQ(a.duration_s, b.duration_s);
  EXPECT_EQ(a.virtual_end_s, b.virtual_end_s);
  EXPECT_EQ(a.upstream_calls, b.upstream_calls);
  EXPECT_EQ(a.timeouts, b.timeouts);
  EXPECT_EQ(a.engine_failures, b.engine_failures);
  EXPECT_EQ(a.retries, b.retries);
  EXPECT_EQ(a.prefix_hits, b.prefix_hits);
  EXPECT_EQ(a.indexed_blocks, b.indexed_blocks);
  ASSERT_EQ(a.engines.size(), b.engines.size());
  for (size_t i = 0; i < a.engines.size(); ++i) {
    EXPECT_EQ(a.engines[i].steps, b.engines[i].steps) << i;
    EXPECT_EQ(a.engines[i].busy_s, b.engines[i].busy_s) << i;
    EXPECT_EQ(a.engines[i].healthy, b.engines[i].healthy) << i;
    EXPECT_EQ(a.engines[i].died, b.engines[i].died) << i;
  }
}

TEST(ClusterSimulation, IdleGapsAreSkippedAndTheRunIsTheSame) {
  // Bursts of requests with idle gaps of minutes between them, a repeated prefix across the
  // gaps, an engine stalled in a gap (ejected, then taken back) and one killed (its probes then
  // fail every 2 s): skipping the gaps' probes and polls changes nothing reported, their calls
  // and failures included.
  std::vector<bench::BenchRequest> reqs;
  for (int burst = 0; burst < 4; ++burst)
    for (int i = 0; i < 5; ++i)
      reqs.push_back(
          request(400.0 * burst + 0.3 * i + (burst == 3 ? 0.0123 : 0), words(200, i), 8));
  for (const bool pd : {false, true}) {
    auto o = pd ? pd_options(gateway::PdMode::kParallel, 1, 3, "deepseek-v3-h800")
                : options(3, "deepseek-v3-h800");
    o.faults = {{Fault::Kind::kDeath, "decode-2", 650.0},
                {Fault::Kind::kStall, "decode-0", 420.0, 30.0}};
    const auto skipped = simulate(reqs, o, tokenizer());
    o.skip_idle = false;
    const auto whole = simulate(reqs, o, tokenizer());
    SCOPED_TRACE(pd ? "parallel P/D" : "aggregated");
    EXPECT_GT(skipped.skipped_s, 1000);
    EXPECT_EQ(whole.skipped_s, 0);
    // The killed engine's probes, one every 2 s for the ~550 s after its death (out of routing
    // after its first few: counted apart from failures_total); the skipped run counts them too.
    EXPECT_GT(whole.engine_failures, 200);
    expect_same_run(skipped, whole);
  }
}

TEST(ClusterSimulation, RequestsWaitingOnAStalledEngineAreSkippedAndTheRunIsTheSame) {
  // decode-0 hangs from 1 s to 601 s with requests on it; the gateway's timeouts outlast the
  // stall, so they wait and then finish. Skipping the wait's probes and polls (requests in
  // flight, but nothing to move them) changes nothing reported, its calls and timeouts included.
  auto reqs = random_requests(6, 41);
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].arrival_s = 0.2 * double(i) + (i == 5 ? 700.0 : 0.0);  // the last after the stall
    reqs[i].output_len = 300;
  }
  for (const bool pd : {false, true}) {
    auto o = pd ? pd_options(gateway::PdMode::kParallel, 1, 2, "deepseek-v3-h800")
                : options(2, "deepseek-v3-h800");
    o.gateway.timeouts.queue = o.gateway.timeouts.prefill = o.gateway.timeouts.first_token =
        o.gateway.timeouts.idle = std::chrono::seconds(2000);
    o.kv_transfer_timeout_s = 2000;
    o.faults = {{Fault::Kind::kStall, "decode-0", 1.0, 600.0}};
    const auto skipped = simulate(reqs, o, tokenizer());
    o.skip_idle = false;
    const auto whole = simulate(reqs, o, tokenizer());
    SCOPED_TRACE(pd ? "parallel P/D" : "aggregated");
    EXPECT_GT(skipped.skipped_s, 300);
    EXPECT_EQ(whole.skipped_s, 0);
    EXPECT_GT(whole.timeouts, 0);  // the stalled engine's probes and polls
    for (const auto& r : whole.results) EXPECT_TRUE(r.success) << r.error;
    expect_same_run(skipped, whole);
  }
}

TEST(ClusterSimulation, AnIdleGapWithAStalledEngineIsSkippedAndTheRunIsTheSame) {
  // decode-0 hangs from 10 s for 19,000 s while nothing is in flight, 20,000 s between two
  // requests: the gap was run probe by probe while the stall lasted (a stalled engine is not
  // quiet, and with nothing in flight the skip for a stall did not apply), its wall time linear
  // in the stall's length. Skipped up to the stall's end, the run is the same.
  auto o = options(2, "deepseek-v3-h800");
  o.faults = {{Fault::Kind::kStall, "decode-0", 10.0, 19000.0}};
  const std::vector<bench::BenchRequest> reqs = {request(0, words(100, 1), 4),
                                                 request(20000, words(100, 2), 4)};
  const auto skipped = simulate(reqs, o, tokenizer());
  o.skip_idle = false;
  const auto whole = simulate(reqs, o, tokenizer());
  EXPECT_GT(skipped.skipped_s, 19000);
  EXPECT_EQ(whole.skipped_s, 0);
  EXPECT_GT(whole.timeouts, 0);  // the stalled engine's probes and polls
  for (const auto& r : whole.results) EXPECT_TRUE(r.success) << r.error;
  expect_same_run(skipped, whole);
}

TEST(ClusterSimulation, AStallWithMillisecondProbesAndLongTimeoutsEnds) {
  // 1 ms probes and timeouts of 2^31 ms with a request on an engine hung for 10^6 s: timer by
  // timer that was 10^9 probes, hours of simulation. Skipped, the request is answered when the
  // engine wakes. Its stream is under way (its first token came at 0.11 s: one prefill step of
  // 10 + 100 ms), so the ejection leaves it its leg, as live.
  auto o = options(1, hand_model());
  o.gateway.health.probe_interval = o.gateway.health.probe_timeout = std::chrono::milliseconds(1);
  o.gateway.timeouts.queue = o.gateway.timeouts.prefill = o.gateway.timeouts.first_token =
      o.gateway.timeouts.idle = std::chrono::milliseconds(2147483647);
  o.faults = {{Fault::Kind::kStall, "decode-0", 0.2, 1e6}};
  const auto run = simulate({request(0, words(100, 1), 50)}, o, tokenizer());
  ASSERT_TRUE(run.results[0].success) << run.results[0].error;
  EXPECT_GT(run.results[0].latency_s, 1e6);
  EXPECT_GT(run.skipped_s, 0.99e6);
  EXPECT_GT(run.timeouts, 1e8);  // the skipped probes are counted
}

TEST(ClusterSimulation, AnIdleGapOfYearsIsSkipped) {
  // 10^8 s between two requests: timer by timer, a million seconds took 46 s to simulate.
  const auto run = simulate({request(0, words(100, 1), 4), request(1e8, words(100, 2), 4)},
                            options(1, "deepseek-v3-h800"), tokenizer());
  ASSERT_TRUE(run.results[1].success) << run.results[1].error;
  EXPECT_EQ(run.results[1].start_s, 1e8);
  EXPECT_GT(run.skipped_s, 0.99e8);
}

TEST(ClusterSimulation, BadInputIsACleanError) {
  auto o = options(1, "deepseek-v3-h800");
  o.gateway.policy = "fastest";
  EXPECT_THROW(simulate({request(0, words(10, 1), 2)}, o, tokenizer()), Error);
  EXPECT_THROW(
      simulate({request(-1, words(10, 1), 2)}, options(1, "deepseek-v3-h800"), tokenizer()), Error);
  EXPECT_THROW(simulate({request(0, words(10, 1), 2)}, options(1, "no-such-preset"), tokenizer()),
               Error);
  EXPECT_THROW(simulate({request(0, words(10, 1), 2)}, options(0, "deepseek-v3-h800"), tokenizer()),
               Error);
  auto faulty = options(1, "deepseek-v3-h800");
  faulty.faults = {{Fault::Kind::kStall, "decode-7", 1.0, 1.0}};
  try {
    simulate({request(0, words(10, 1), 2)}, faulty, tokenizer());
    ADD_FAILURE() << "an unknown engine's fault was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("decode-7"), std::string::npos) << e.what();
  }
  faulty.faults = {{Fault::Kind::kStall, "decode-0", 1.0, -1.0}};
  EXPECT_THROW(simulate({request(0, words(10, 1), 2)}, faulty, tokenizer()), Error);
  // Times no clock can count: their nanoseconds overflowed int64 and the fault came at 0.
  for (const double at : {1e10, kInf, kNan}) {
    faulty.faults = {{Fault::Kind::kDeath, "decode-0", at}};
    EXPECT_THROW(simulate({request(0, words(10, 1), 2)}, faulty, tokenizer()), Error) << at;
  }
  faulty.faults = {{Fault::Kind::kStall, "decode-0", 1.0, 1e300}};
  EXPECT_THROW(simulate({request(0, words(10, 1), 2)}, faulty, tokenizer()), Error);
  EXPECT_THROW(
      simulate({request(1e10, words(10, 1), 2)}, options(1, "deepseek-v3-h800"), tokenizer()),
      Error);
}

TEST(ClusterSimulation, CheckOptionsRefusesWhatARunWouldBeforeAnyRuns) {
  // What a sweep checks for every point before the first: the counts the mode can serve and
  // the engines the faults name.
  auto o = options(2, "deepseek-v3-h800");
  o.faults = {{Fault::Kind::kDeath, "decode-1", 1.0}};
  EXPECT_NO_THROW(check_options(o));
  o.decode = 1;
  try {
    check_options(o);
    ADD_FAILURE() << "a fault on decode-1 of one decode engine was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no engine named 'decode-1' among 0 prefill and 1 decode"),
              std::string::npos)
        << e.what();
  }
  o.faults.clear();
  o.gateway.mode = gateway::PdMode::kSequential;
  EXPECT_THROW(check_options(o), Error);  // no prefill engine
  o.prefill = 1;
  EXPECT_NO_THROW(check_options(o));
  o.decode = kMaxEngines + 1;
  EXPECT_THROW(check_options(o), Error);
  // The aggregated mode moves no KV between engines: a slow-link fault there did nothing.
  o = options(1, "deepseek-v3-h800");
  o.faults = {{Fault::Kind::kSlowLink, "decode-0", 1.0, 10.0, 5.0}};
  try {
    check_options(o);
    ADD_FAILURE() << "a slow-link fault in the aggregated mode was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("aggregated mode")) << e.what();
  }
}

TEST(ClusterSimulation, KvSizesAndLinksOutOfBoundsAreRefusedNamingTheFlag) {
  // Every engine allocated block_size x token bytes unchecked (a typo took the machine's
  // memory), a negative block count meant the preset's, and a link of 1e-300 GB/s or 1e300 us
  // made a transfer's time no clock counts.
  const auto refused = [](const std::function<void(SimulationOptions&)>& change,
                          const std::string& flag) {
    auto o = options(2, "deepseek-v3-h800");
    EXPECT_NO_THROW(check_options(o));
    change(o);
    try {
      check_options(o);
      ADD_FAILURE() << flag << " accepted";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::StartsWith(flag)) << e.what();
    }
  };
  refused([](auto& o) { o.executor.block_size = 0; }, "--block-size: expected 1..4096");
  refused([](auto& o) { o.executor.block_size = 4097; }, "--block-size");
  refused([](auto& o) { o.executor.kv_token_bytes = -1; }, "--sim-kv-token-bytes: expected");
  refused([](auto& o) { o.executor.kv_token_bytes = int64_t{1} << 40; }, "--sim-kv-token-bytes");
  refused(
      [](auto& o) {
        o.decode = 5000;
        o.executor.block_size = 4096;
        o.executor.kv_token_bytes = 1 << 20;
      },
      "--sim-kv-token-bytes 1048576 x --block-size 4096 x 5000 engines");
  refused([](auto& o) { o.executor.num_blocks = -1; }, "--num-kv-blocks: expected 0");
  refused([](auto& o) { o.executor.num_blocks = kMaxNumBlocks + 1; }, "--num-kv-blocks");
  // At 0, the model's bytes per token (DeepSeek-V3's 1,152): the bound was skipped.
  refused(
      [](auto& o) {
        o.decode = 5000;
        o.executor.block_size = 4096;
      },
      "--sim-kv-token-bytes 0 (the model's 1152) x --block-size 4096 x 5000 engines");
  // Blocks in all: 48 engines of 10^8 took 115 GB and ended in bad_alloc or the OOM killer.
  refused(
      [](auto& o) {
        o.decode = 48;
        o.executor.num_blocks = kMaxNumBlocks;
      },
      "--num-kv-blocks 100000000 x 48 engines");
  // At 0, the preset's count (32,768 blocks of 16 tokens: 524,288 of 1).
  refused(
      [](auto& o) {
        o.decode = 1000;
        o.executor.block_size = 1;
      },
      "--num-kv-blocks 0 (the preset's 524288 at --block-size 1) x 1000 engines");
  refused([](auto& o) { o.scheduler.max_num_seqs = 0; }, "--max-num-seqs: expected at least 1");
  refused([](auto& o) { o.scheduler.max_num_batched_tokens = 0; },
          "--max-num-batched-tokens: expected at least 1");
  refused([](auto& o) { o.kv_link.bytes_per_s = 1e-300; }, "--kv-link-gb-per-s");
  refused([](auto& o) { o.kv_link.bytes_per_s = kInf; }, "--kv-link-gb-per-s");
  refused([](auto& o) { o.kv_link.latency_s = 1e300; }, "--kv-link-latency-us");
  refused([](auto& o) { o.kv_link.latency_s = kNan; }, "--kv-link-latency-us");
  auto o = options(2, "deepseek-v3-h800");
  o.executor.block_size = 4096;
  o.executor.kv_token_bytes = 65536;
  o.kv_link = {1e5, 1000};  // the slowest link and longest latency allowed
  EXPECT_NO_THROW(check_options(o));
}

// The KV transfer timeouts take what `tandem engine`'s flags take: seconds from a millisecond
// (the transports' timeouts count milliseconds: less was none, or failed every frame at once) to
// 2147483.647 (int64 milliseconds' bound), finite. 0.0001 s was taken.
TEST(ClusterSimulation, KvTransferTimeoutsAreBoundedAsTheEnginesFlagsNamingThem) {
  for (const bool handshake : {false, true}) {
    const std::string flag =
        handshake ? "--kv-transfer-handshake-timeout" : "--kv-transfer-timeout";
    for (const double bad : {0.0, 0.0001, 0.00099, 2147483.648, 1e9, kInf, kNan, -1.0}) {
      auto o = options(1, "deepseek-v3-h800");
      (handshake ? o.kv_transfer_handshake_timeout_s : o.kv_transfer_timeout_s) = bad;
      try {
        check_options(o);
        ADD_FAILURE() << flag << " " << bad << " accepted";
      } catch (const Error& e) {
        EXPECT_THAT(e.what(), ::testing::StartsWith(flag + ": expected 0.001..2147483.647 seconds"))
            << bad;
      }
    }
    for (const double good : {0.001, 5.0, 2147483.647}) {
      auto o = options(1, "deepseek-v3-h800");
      (handshake ? o.kv_transfer_handshake_timeout_s : o.kv_transfer_timeout_s) = good;
      EXPECT_NO_THROW(check_options(o)) << flag << " " << good;
    }
  }
  EXPECT_EQ(SimulationOptions{}.kv_transfer_handshake_timeout_s,
            engine::KvTransferConfig{}.handshake_timeout_s);
}

TEST(VirtualTime, ATimeTheClockCannotCountIsAnErrorNotAnOverflow) {
  EXPECT_EQ(duration_of(1.5), std::chrono::milliseconds(1500));
  EXPECT_EQ(duration_of(-2), std::chrono::seconds(-2));
  for (const double s : {1e10, -1e10, kInf, kNan}) EXPECT_THROW(duration_of(s), Error) << s;
}

}  // namespace
}  // namespace tandem::sim
