// The data and metrics layer of `tandem bench` (src/bench): workloads from generators and traces,
// arrival processes, and vLLM-compatible metrics. The metrics are compared with an independent
// numpy computation (tests/oracle/bench_metrics_oracle.py under /usr/bin/python3 with Debian's
// python3-numpy; a missing package is a failure, not a skip). Token content is checked with the
// real DeepSeek-V3 tokenizer (npm oracle package); the traces are heads of the real Mooncake and
// Azure files (tests/data/bench/README.md).
#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "bench/arrivals.h"
#include "bench/metrics.h"
#include "bench/report.h"
#include "bench/rng.h"
#include "bench/stream_measure.h"
#include "bench/workload.h"
#include "net/sse.h"
#include "text/oracle_support.h"
#include "util/error.h"
#include "util/file.h"

namespace tandem::bench {
namespace {

using nlohmann::json;
using test::quote;
using ::testing::HasSubstr;

std::filesystem::path data_dir() {
  return test::source_dir() / "tests" / "data" / "bench";
}
std::filesystem::path mooncake_path() {
  return data_dir() / "mooncake_conversation_head200.jsonl";
}
std::filesystem::path azure_path() {
  return data_dir() / "azure_code_2023_head200.csv";
}

class BenchData : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tokenizer_ = new text::Tokenizer(text::Tokenizer::from_dir(test::lenml_model("deepseek_v3")));
    vocab_ = new TokenVocab(TokenVocab::build(*tokenizer_));
  }
  static void TearDownTestSuite() {
    delete vocab_;
    delete tokenizer_;
  }

  // The promise every workload makes: the text encodes to exactly the ids (no BOS).
  static void expect_round_trip(const std::vector<BenchRequest>& requests, size_t max_checked) {
    for (size_t i = 0; i < requests.size() && i < max_checked; ++i) {
      ASSERT_EQ(tokenizer_->encode(requests[i].prompt_text, false), requests[i].prompt_ids)
          << "request " << i;
    }
  }

  inline static text::Tokenizer* tokenizer_ = nullptr;
  inline static TokenVocab* vocab_ = nullptr;
};

// --- vocabulary ----------------------------------------------------------------------------

TEST_F(BenchData, VocabularyIsTextSafe) {
  ASSERT_GE(vocab_->size(), 1000u);
  Rng rng(7);
  for (int k = 0; k < 200; ++k) {
    const int32_t id = vocab_->id(rng.below(vocab_->size()));
    const std::string bytes = tokenizer_->token_bytes(id);
    ASSERT_GE(bytes.size(), 2u);
    EXPECT_EQ(bytes[0], ' ');
    for (size_t i = 1; i < bytes.size(); ++i) EXPECT_TRUE(std::isalpha((unsigned char)bytes[i]));
    EXPECT_EQ(vocab_->render(std::vector<int32_t>{id}), bytes);
  }
  // A token that is not a plain word (the BOS) is refused when rendering.
  const auto bos = tokenizer_->bos_id();
  ASSERT_TRUE(bos.has_value());
  EXPECT_FALSE(vocab_->contains(*bos));
  EXPECT_THROW(vocab_->render(std::vector<int32_t>{*bos}), Error);
}

// --- random --------------------------------------------------------------------------------

TEST_F(BenchData, RandomLengthsStayInTheRange) {
  RandomOptions o;
  o.num_requests = 300;
  o.input_len = 101;
  o.output_len = 21;
  o.range_ratio = 0.5;
  o.num_special_tokens = 1;  // 100 tokens of our own, as vLLM subtracts the BOS
  o.seed = 3;
  const auto w = random_workload(*vocab_, o);
  ASSERT_EQ(w.size(), 300u);
  std::set<size_t> input_lens;
  std::set<int64_t> output_lens;
  for (const BenchRequest& r : w) {
    EXPECT_GE(r.prompt_ids.size(), 50u);   // floor(100 * 0.5)
    EXPECT_LE(r.prompt_ids.size(), 150u);  // ceil(100 * 1.5)
    EXPECT_GE(r.output_len, 10);           // floor(21 * 0.5)
    EXPECT_LE(r.output_len, 32);           // ceil(21 * 1.5) = ceil(31.5)
    EXPECT_EQ(r.arrival_s, 0.0);
    input_lens.insert(r.prompt_ids.size());
    output_lens.insert(r.output_len);
  }
  // Uniform over 101 and 23 values: 300 draws cover most of them, both ends included.
  EXPECT_GT(input_lens.size(), 80u);
  EXPECT_EQ(output_lens.size(), 23u);
  expect_round_trip(w, w.size());

  // Same seed, same workload; another seed, another one.
  const auto again = random_workload(*vocab_, o);
  EXPECT_EQ(again[17].prompt_ids, w[17].prompt_ids);
  o.seed = 4;
  EXPECT_NE(random_workload(*vocab_, o)[17].prompt_ids, w[17].prompt_ids);

  // range_ratio 0: exact lengths.
  o.range_ratio = 0;
  for (const BenchRequest& r : random_workload(*vocab_, o)) {
    EXPECT_EQ(r.prompt_ids.size(), 100u);
    EXPECT_EQ(r.output_len, 21);
  }
  o.range_ratio = 1.0;
  try {
    random_workload(*vocab_, o);
    FAIL() << "range_ratio 1 accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("range_ratio must be in [0, 1)"));
  }
}

// --- prefix_repetition ---------------------------------------------------------------------

TEST_F(BenchData, PrefixRepetitionSharesPrefixes) {
  PrefixRepetitionOptions o;
  o.num_requests = 27;  // 27 / 4 = 6 per prefix: 24 requests, as vLLM
  o.num_prefixes = 4;
  o.prefix_len = 40;
  o.suffix_len = 15;
  o.output_len = 9;
  o.seed = 11;
  const auto w = prefix_repetition_workload(*vocab_, o);
  ASSERT_EQ(w.size(), 24u);
  std::map<std::vector<int32_t>, int> per_prefix;
  std::set<std::vector<int32_t>> suffixes;
  for (const BenchRequest& r : w) {
    ASSERT_EQ(r.prompt_ids.size(), 55u);
    EXPECT_EQ(r.output_len, 9);
    per_prefix[std::vector<int32_t>(r.prompt_ids.begin(), r.prompt_ids.begin() + 40)]++;
    suffixes.insert(std::vector<int32_t>(r.prompt_ids.begin() + 40, r.prompt_ids.end()));
  }
  ASSERT_EQ(per_prefix.size(), 4u);
  for (const auto& [prefix, count] : per_prefix) EXPECT_EQ(count, 6);
  EXPECT_EQ(suffixes.size(), 24u);
  expect_round_trip(w, w.size());

  // Shuffled by default: not grouped by prefix.
  o.shuffle = false;
  const auto grouped = prefix_repetition_workload(*vocab_, o);
  for (size_t i = 0; i < grouped.size(); ++i) {
    EXPECT_TRUE(std::equal(grouped[i].prompt_ids.begin(), grouped[i].prompt_ids.begin() + 40,
                           grouped[i / 6 * 6].prompt_ids.begin()));
  }
  bool grouped_order = true;
  for (size_t i = 0; i < w.size(); ++i) {
    grouped_order =
        grouped_order && std::equal(w[i].prompt_ids.begin(), w[i].prompt_ids.begin() + 40,
                                    w[i / 6 * 6].prompt_ids.begin());
  }
  EXPECT_FALSE(grouped_order);

  o.num_requests = 3;
  EXPECT_THROW(prefix_repetition_workload(*vocab_, o), Error);
}

// --- sharegpt ------------------------------------------------------------------------------

TEST_F(BenchData, ShareGptTakesTheFirstTwoTurnsAndFilters) {
  std::string long_prompt;
  for (int i = 0; i < 1100; ++i) long_prompt += " apple";
  const json conversations = json::array({
      {{"id", "a"},
       {"conversations",
        {{{"from", "human"}, {"value", "What is the capital city of France, please?"}},
         {{"from", "gpt"}, {"value", "The capital of France is Paris, a large city."}},
         {{"from", "human"}, {"value", "And of Spain?"}}}}},
      {{"id", "one-turn"},
       {"conversations", {{{"from", "human"}, {"value", "Only a question, no reply here."}}}}},
      {{"id", "short-prompt"},
       {"conversations",
        {{{"from", "human"}, {"value", "Hi"}},
         {{"from", "gpt"}, {"value", "Hello! How can I help you today, my friend?"}}}}},
      {{"id", "short-reply"},
       {"conversations",
        {{{"from", "human"}, {"value", "Say a single word to me, any word at all."}},
         {{"from", "gpt"}, {"value", "Ok"}}}}},
      {{"id", "too-long"},
       {"conversations",
        {{{"from", "human"}, {"value", long_prompt}},
         {{"from", "gpt"}, {"value", "Yes indeed."}}}}},
      {{"id", "b"},
       {"conversations",
        {{{"from", "human"}, {"value", "Write a haiku about the sea.\nPlease keep it short."}},
         {{"from", "gpt"},
          {"value",
           "Waves fold into foam,\nsalt wind carries gull voices,\n"
           "the tide breathes and sleeps."}}}}},
  });
  const auto path = test::temp_path("sharegpt");
  {
    std::ofstream f(path);
    f << conversations.dump(1);
  }
  ShareGptOptions o;
  o.path = path;
  o.num_requests = 10;
  o.oversample = false;
  auto w = sharegpt_workload(*tokenizer_, o);
  // Kept: "a" and "b" (one-turn dropped; "Hi" is 2 tokens with BOS < 4; "Ok" likewise;
  // the long prompt is over 1024 tokens).
  ASSERT_EQ(w.size(), 2u);
  std::map<std::string, const BenchRequest*> by_text;
  for (const BenchRequest& r : w) by_text[r.prompt_text] = &r;
  const std::string a = "What is the capital city of France, please?";
  const std::string b = "Write a haiku about the sea.\nPlease keep it short.";
  ASSERT_TRUE(by_text.count(a) && by_text.count(b));
  EXPECT_EQ(
      by_text[a]->output_len,
      (int64_t)tokenizer_->encode("The capital of France is Paris, a large city.", true).size());
  EXPECT_EQ(by_text[a]->prompt_ids, tokenizer_->encode(a, false));
  expect_round_trip(w, w.size());

  // A fixed output length lifts the short-reply filter only.
  o.output_len = 50;
  w = sharegpt_workload(*tokenizer_, o);
  ASSERT_EQ(w.size(), 3u);
  for (const BenchRequest& r : w) EXPECT_EQ(r.output_len, 50);

  // Oversampling tops the list up with repeats of the kept entries.
  o.oversample = true;
  o.num_requests = 7;
  w = sharegpt_workload(*tokenizer_, o);
  ASSERT_EQ(w.size(), 7u);
  std::set<std::string> distinct;
  for (const BenchRequest& r : w) distinct.insert(r.prompt_text);
  EXPECT_EQ(distinct.size(), 3u);

  // num_requests cuts the list.
  o.num_requests = 1;
  EXPECT_EQ(sharegpt_workload(*tokenizer_, o).size(), 1u);
  std::filesystem::remove(path);

  o.path = "/nonexistent/sharegpt.json";
  EXPECT_THROW(sharegpt_workload(*tokenizer_, o), Error);
}

// --- Mooncake ------------------------------------------------------------------------------

TEST_F(BenchData, MooncakeEqualHashIdsGiveIdenticalBlocks) {
  const auto records = read_mooncake_trace(mooncake_path(), {});
  ASSERT_EQ(records.size(), 200u);
  MooncakeOptions o;
  o.path = mooncake_path();
  o.seed = 5;
  const auto w = mooncake_workload(*vocab_, o);
  ASSERT_EQ(w.size(), 200u);

  // Every block position of every request, grouped by hash id.
  struct Use {
    size_t request;
    size_t block;
  };
  std::map<int64_t, std::vector<Use>> uses;
  for (size_t i = 0; i < records.size(); ++i) {
    ASSERT_EQ((int64_t)w[i].prompt_ids.size(), records[i].input_length) << "request " << i;
    EXPECT_EQ(w[i].output_len, records[i].output_length);
    EXPECT_DOUBLE_EQ(w[i].arrival_s, (records[i].timestamp_ms - records[0].timestamp_ms) / 1000);
    for (size_t b = 0; b < records[i].hash_ids.size(); ++b) {
      uses[records[i].hash_ids[b]].push_back({i, b});
    }
  }
  const auto block_of = [&](const Use& u) {
    const auto& ids = w[u.request].prompt_ids;
    const size_t begin = u.block * 512;
    const size_t end = std::min(ids.size(), begin + 512);
    return std::vector<int32_t>(ids.begin() + begin, ids.begin() + end);
  };
  size_t shared_pairs = 0;
  std::set<std::vector<int32_t>> full_blocks;
  for (const auto& [hash, list] : uses) {
    const auto first = block_of(list[0]);
    if (first.size() == 512) full_blocks.insert(first);
    // The block's tokens are the function of (seed, hash id) the header promises.
    const auto expected = mooncake_block(*vocab_, hash, 512, o.seed);
    EXPECT_TRUE(std::equal(first.begin(), first.end(), expected.begin())) << "hash id " << hash;
    for (size_t x = 0; x < list.size(); ++x) {
      for (size_t y = x + 1; y < list.size(); ++y) {
        const auto bx = block_of(list[x]);
        const auto by = block_of(list[y]);
        const size_t n = std::min(bx.size(), by.size());
        ASSERT_TRUE(std::equal(bx.begin(), bx.begin() + n, by.begin()))
            << "hash id " << hash << " differs between requests " << list[x].request << " and "
            << list[y].request;
        ++shared_pairs;
      }
    }
  }
  // The conversation trace shares a lot (every request starts with hash id 0).
  EXPECT_GT(shared_pairs, 1000u);
  EXPECT_GE(uses[0].size(), 200u);
  // Distinct hash ids give distinct blocks.
  size_t full_ids = 0;
  for (const auto& [hash, list] : uses) full_ids += block_of(list[0]).size() == 512;
  EXPECT_EQ(full_blocks.size(), full_ids);

  // One record expanded alone equals its place in the workload.
  EXPECT_EQ(mooncake_request(*vocab_, records[77], 512, o.seed).prompt_ids, w[77].prompt_ids);
  EXPECT_EQ(mooncake_prompt(*vocab_, records[77], 512, o.seed), w[77].prompt_ids);
  // And the workload made on demand is the same workload.
  const LazyWorkload made = lazy(w);
  ASSERT_EQ(made.size(), w.size());
  for (size_t i : {size_t{0}, size_t{77}, w.size() - 1}) {
    EXPECT_EQ(made.arrival_s[i], w[i].arrival_s);
    EXPECT_EQ(made.make(i).prompt_ids, w[i].prompt_ids);
    EXPECT_EQ(made.make(i).output_len, w[i].output_len);
  }

  expect_round_trip(w, 40);  // 40 requests, ~500k tokens: enough for the concatenation rule
}

TEST_F(BenchData, MooncakeWindowAndTimeScale) {
  MooncakeOptions o;
  o.path = mooncake_path();
  const auto all = mooncake_workload(*vocab_, o);
  o.window = {.start = 150, .limit = 20, .time_scale = 0.5};
  const auto part = mooncake_workload(*vocab_, o);
  ASSERT_EQ(part.size(), 20u);
  EXPECT_EQ(part[0].arrival_s, 0.0);
  for (size_t i = 0; i < part.size(); ++i) {
    EXPECT_EQ(part[i].prompt_ids, all[150 + i].prompt_ids);
    EXPECT_NEAR(part[i].arrival_s, (all[150 + i].arrival_s - all[150].arrival_s) * 0.5, 1e-9);
  }
  // A window past the end is empty.
  o.window = {.start = 500, .limit = 0, .time_scale = 1};
  EXPECT_TRUE(mooncake_workload(*vocab_, o).empty());
}

TEST(MooncakeArrivals, SpreadPutsEachRunOfEqualTimestampsBetweenItAndTheNext) {
  // Runs of 3, 2 and 2 records at 0, 3000 and 4000 ms, replayed at time scale 2.
  std::vector<MooncakeRecord> records(7);
  const double ms[] = {0, 0, 0, 3000, 3000, 4000, 4000};
  for (size_t i = 0; i < records.size(); ++i) records[i].timestamp_ms = ms[i];
  EXPECT_EQ(mooncake_arrivals(records, 2), (std::vector<double>{0, 0, 0, 6, 6, 8, 8}));
  const auto a = mooncake_arrivals(records, 2, true, 1);
  ASSERT_EQ(a.size(), records.size());
  EXPECT_TRUE(std::is_sorted(a.begin(), a.end()));
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(a[i] >= 0 && a[i] < 6) << i;
  for (size_t i = 3; i < 5; ++i) EXPECT_TRUE(a[i] >= 6 && a[i] < 8) << i;
  for (size_t i = 5; i < 7; ++i) EXPECT_TRUE(a[i] >= 8 && a[i] < 10) << i;  // the gap before
  EXPECT_NE(a[0], a[1]);
  EXPECT_EQ(mooncake_arrivals(records, 2, true, 1), a);
  EXPECT_NE(mooncake_arrivals(records, 2, true, 2), a);
}

TEST(MooncakeArrivals, SpreadOverTheRealTraceKeepsItsRateAndEndsTheBursts) {
  const auto records = read_mooncake_trace(mooncake_path(), {});
  const auto plain = mooncake_arrivals(records, 1);
  const auto spread = mooncake_arrivals(records, 1, true, 0);
  ASSERT_EQ(spread.size(), plain.size());
  size_t distinct_plain = 1, distinct_spread = 1;
  for (size_t i = 1; i < plain.size(); ++i) {
    distinct_plain += plain[i] != plain[i - 1];
    distinct_spread += spread[i] != spread[i - 1];
    EXPECT_GE(spread[i], plain[i]) << i;
  }
  EXPECT_LT(distinct_plain, plain.size() / 4);  // the trace's bursts: ~10 records a timestamp
  EXPECT_EQ(distinct_spread, spread.size());
  EXPECT_LT(spread.back() - plain.back(), 3.01);  // at most one 3 s step later
}

TEST_F(BenchData, MooncakeErrorsNameTheLine) {
  const auto path = test::temp_path("mooncake");
  {
    std::ofstream f(path);
    f << R"({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]})"
      << "\n"
      << R"({"timestamp": 3, "input_length": 600, "output_length": 5, "hash_ids": [1]})"
      << "\n";
  }
  try {
    read_mooncake_trace(path, {});
    FAIL() << "bad hash_ids accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(":2: 1 hash_ids for input_length 600"));
  }
  EXPECT_EQ(read_mooncake_trace(path, {.start = 0, .limit = 1}).size(), 1u);
  std::filesystem::remove(path);
}

// The message of the Error `read` throws (a test failure when it throws none).
template <typename F>
std::string error_of(F read) {
  try {
    read();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return {};
}

std::filesystem::path write_trace(const std::string& stem, const std::string& content) {
  const auto path = test::scratch_path(stem);
  std::ofstream(path, std::ios::binary) << content;
  return path;
}

std::string mooncake_line(const std::string& timestamp, int64_t output_length = 4) {
  return R"({"timestamp": )" + timestamp + R"(, "input_length": 100, "output_length": )" +
         std::to_string(output_length) + R"(, "hash_ids": [7]})" + "\n";
}

// A window of one timestamp has no gap inside it: the first later record after the window
// gives the gap, so that --num-prompts 5 of a trace whose first 10 records share time 0 (and
// whose 11th is at 3000 ms) spreads them over [0, 3 s), where it sent all five at 0.
TEST(MooncakeArrivals, SpreadOfAWindowOfOneTimestampReachesTheFirstLaterRecordAfterIt) {
  const auto path = write_trace("mooncake-one-time", mooncake_line("0") + mooncake_line("0") +
                                                         mooncake_line("0") + mooncake_line("0") +
                                                         mooncake_line("3000"));
  const auto records = read_mooncake_trace(path, {.start = 0, .limit = 2});
  ASSERT_EQ(records.size(), 2u);
  const auto a = mooncake_arrivals(records, 2, true, 1);
  EXPECT_TRUE(std::is_sorted(a.begin(), a.end()));
  for (double x : a) EXPECT_TRUE(x >= 0 && x < 6) << x;  // 3 s at time scale 2
  EXPECT_NE(a[0], a[1]);
  // The real trace's head, as the review replayed it.
  const auto head = read_mooncake_trace(mooncake_path(), {.start = 0, .limit = 5});
  ASSERT_EQ(head.size(), 5u);
  ASSERT_EQ(head.back().timestamp_ms, head.front().timestamp_ms);
  const auto spread = mooncake_arrivals(head, 1, true, 0);
  EXPECT_GT(spread.back(), 0.0);
}

// With no later record in the file and one timestamp in the window there is no gap to spread
// over: refused, naming the line, rather than sent at once as if spread.
TEST(MooncakeArrivals, SpreadWithNoGapKnownIsRefusedNamingTheLine) {
  const auto path =
      write_trace("mooncake-no-gap", mooncake_line("0") + mooncake_line("5") + mooncake_line("5"));
  const auto tail = read_mooncake_trace(path, {.start = 1, .limit = 0});
  ASSERT_EQ(tail.size(), 2u);
  EXPECT_EQ(mooncake_arrivals(tail, 1), (std::vector<double>{0, 0}));
  EXPECT_THAT(error_of([&] { mooncake_arrivals(tail, 1, true, 0); }),
              HasSubstr("--trace-spread: every record of the window (line 2 on) has timestamp 5 ms "
                        "and no later record follows in the file"));
  // The whole file has a gap before its last run: that one is spread over it, as before.
  const auto all = read_mooncake_trace(path, {});
  const auto a = mooncake_arrivals(all, 1, true, 0);
  for (size_t i = 1; i < a.size(); ++i) EXPECT_TRUE(a[i] >= 0.005 && a[i] < 0.010) << i;
}

TEST(MooncakeTrace, ARecordEarlierThanTheOneBeforeItIsRefusedNamingTheLine) {
  // Sent in file order, it could only go late: a trace out of order is not replayed.
  const auto path =
      write_trace("mooncake-unsorted", mooncake_line("0") + mooncake_line("1000") +
                                           mooncake_line("-3000") + mooncake_line("3000"));
  EXPECT_THAT(error_of([&] { read_mooncake_trace(path, {}); }),
              HasSubstr(path.string() + ":3: timestamp -3000 ms is before line 2's 1000 ms"));
  // Equal timestamps (the published traces round them to 3 s) are in order.
  const auto equal = write_trace("mooncake-equal", mooncake_line("5") + mooncake_line("5"));
  EXPECT_EQ(read_mooncake_trace(equal, {}).size(), 2u);
}

TEST(MooncakeTrace, ATimeNoClockCanCountIsRefusedNamingTheLine) {
  // 1e13 ms is 317 years after the first record: its nanoseconds overflow int64, which sent it
  // at time 0.
  const auto far = write_trace("mooncake-far", mooncake_line("0") + mooncake_line("1e13"));
  EXPECT_THAT(error_of([&] { read_mooncake_trace(far, {}); }),
              HasSubstr(far.string() + ":2: this record would be sent 10000000000 s after"));
  const auto huge = write_trace("mooncake-huge", mooncake_line("0") + mooncake_line("1e400"));
  EXPECT_THAT(error_of([&] { read_mooncake_trace(huge, {}); }), HasSubstr(huge.string() + ":2:"));
  // The time scale counts: an hour replayed a million times slower is out of range too.
  const auto hour = write_trace("mooncake-hour", mooncake_line("0") + mooncake_line("3600000"));
  EXPECT_EQ(read_mooncake_trace(hour, {}).size(), 2u);
  EXPECT_THAT(error_of([&] { read_mooncake_trace(hour, {.time_scale = 1e6}); }),
              HasSubstr(hour.string() + ":2: this record would be sent 3600000000 s after"));
}

TEST(MooncakeTrace, ALengthNoRequestCanHaveIsRefusedNamingTheLineAndField) {
  const auto path =
      write_trace("mooncake-long", mooncake_line("0") + mooncake_line("1", 1000000000000000));
  EXPECT_THAT(error_of([&] { read_mooncake_trace(path, {}); }),
              HasSubstr(path.string() + ":2: output_length must be in 1..10000000"));
}

TEST(MooncakeTrace, ALengthIsQuotedAsWrittenAndNoOutputIsRefused) {
  // Past int64 it was read back as one and reported as "got -1"; an output of 0 tokens failed on
  // every server.
  const auto huge = write_trace(
      "mooncake-u64",
      mooncake_line("0") +
          R"({"timestamp": 1, "input_length": 18446744073709551615, "output_length": 4,)"
          R"( "hash_ids": [7]})"
          "\n");
  EXPECT_THAT(error_of([&] { read_mooncake_trace(huge, {}); }),
              HasSubstr(huge.string() +
                        ":2: input_length must be in 1..10000000, got 18446744073709551615"));
  const auto none = write_trace("mooncake-no-output", mooncake_line("0") + mooncake_line("1", 0));
  EXPECT_THAT(error_of([&] { read_mooncake_trace(none, {}); }),
              HasSubstr(none.string() + ":2: output_length must be in 1..10000000, got 0"));
}

TEST(MooncakeTrace, AWindowToTheLargestLimitEndsAtTheEndOfTheFile) {
  const auto all = read_mooncake_trace(mooncake_path(), {});
  const auto rest = read_mooncake_trace(mooncake_path(),
                                        {.start = 1, .limit = std::numeric_limits<int64_t>::max()});
  ASSERT_EQ(rest.size(), all.size() - 1);
  EXPECT_EQ(rest[0].hash_ids, all[1].hash_ids);
}

TEST(MooncakeTrace, ALineLongerThanTheCapIsRefusedNamingTheLine) {
  // A file without newlines would otherwise be read into memory whole, as one line.
  std::string content = mooncake_line("0");
  content += std::string(kMaxLineBytes + 1, ' ');
  const auto path = write_trace("mooncake-line", content);
  content.clear();
  content.shrink_to_fit();
  EXPECT_THAT(error_of([&] { read_mooncake_trace(path, {}); }),
              HasSubstr(path.string() + ":2: line longer than 64 MiB"));
  std::filesystem::remove(path);
}

TEST_F(BenchData, ADirectoryForADatasetIsRefusedNamingIt) {
  // Reading one failed inside the stream library ("basic_filebuf::underflow", an internal error
  // naming nothing), and ShareGPT called it malformed JSON.
  const auto dir = test::scratch_path("dataset-dir", "");
  std::filesystem::create_directories(dir);
  const std::string is_dir = dir.string() + ": is a directory, not a file";
  EXPECT_THAT(error_of([&] { read_mooncake_trace(dir, {}); }),
              HasSubstr("mooncake trace " + is_dir));
  EXPECT_THAT(error_of([&] { read_azure_trace(dir, {}); }), HasSubstr("azure trace " + is_dir));
  ShareGptOptions s;
  s.path = dir;
  EXPECT_THAT(error_of([&] { sharegpt_workload(*tokenizer_, s); }),
              HasSubstr("sharegpt dataset " + is_dir));
  EXPECT_THAT(error_of([&] { check_input_file(dir / "missing", "--x"); }),
              HasSubstr("--x: no such file"));
  // A read that fails past the opening names the file and line, not the library.
  std::ifstream in(dir, std::ios::binary);
  std::string line;
  EXPECT_THAT(error_of([&] { read_line(in, line, "trace " + dir.string(), 1); }),
              HasSubstr("trace " + dir.string() + ":1: cannot read the file"));
}

// --- Azure ---------------------------------------------------------------------------------

TEST_F(BenchData, AzureTraceHead) {
  const auto records = read_azure_trace(azure_path(), {});
  ASSERT_EQ(records.size(), 200u);
  // 2023-11-16 18:17:03.9799600,4808,10 and 18:17:04.0319600,3180,8.
  EXPECT_EQ(records[0].offset_s, 0.0);
  EXPECT_EQ(records[0].context_tokens, 4808);
  EXPECT_EQ(records[0].generated_tokens, 10);
  EXPECT_NEAR(records[1].offset_s, 0.052, 1e-9);
  EXPECT_EQ(records[1].context_tokens, 3180);
  EXPECT_EQ(records[1].generated_tokens, 8);
  for (size_t i = 1; i < records.size(); ++i)
    EXPECT_GE(records[i].offset_s, records[i - 1].offset_s);

  AzureOptions o;
  o.path = azure_path();
  o.window = {.start = 10, .limit = 30, .time_scale = 2};
  const auto w = azure_workload(*vocab_, o);
  ASSERT_EQ(w.size(), 30u);
  for (size_t i = 0; i < w.size(); ++i) {
    EXPECT_EQ((int64_t)w[i].prompt_ids.size(), records[10 + i].context_tokens);
    EXPECT_EQ(w[i].output_len, records[10 + i].generated_tokens);
    EXPECT_NEAR(w[i].arrival_s, (records[10 + i].offset_s - records[10].offset_s) * 2, 1e-9);
  }
  expect_round_trip(w, w.size());
}

// A CSV saved by Excel (a UTF-8 byte order mark first) reads as the same trace, as pandas reads
// it: the mark was part of the first column's name, so the header "had no TIMESTAMP". (The
// Azure files end their lines with CRLF already.)
TEST_F(BenchData, AnAzureTraceWithAByteOrderMarkReadsTheSame) {
  std::ifstream original(azure_path(), std::ios::binary);
  const auto path = test::scratch_path("azure-bom", ".csv");
  {
    std::ofstream f(path, std::ios::binary);
    f << "\xEF\xBB\xBF";
    f << original.rdbuf();
  }
  const auto expected = read_azure_trace(azure_path(), {});
  const auto records = read_azure_trace(path, {});
  ASSERT_EQ(records.size(), expected.size());
  for (size_t i = 0; i < records.size(); ++i) {
    EXPECT_EQ(records[i].offset_s, expected[i].offset_s) << i;
    EXPECT_EQ(records[i].context_tokens, expected[i].context_tokens) << i;
    EXPECT_EQ(records[i].generated_tokens, expected[i].generated_tokens) << i;
  }
}

TEST_F(BenchData, AzureErrorsNameTheField) {
  const auto path = test::temp_path("azure");
  {
    std::ofstream f(path);
    f << "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12,x\n";
  }
  try {
    read_azure_trace(path, {});
    FAIL() << "bad row accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(":2: GeneratedTokens must be an integer"));
  }
  {
    std::ofstream f(path);
    f << "TIMESTAMP,ContextTokens,GeneratedTokens\n16/11/2023 18:17,12,3\n";
  }
  EXPECT_THROW(read_azure_trace(path, {}), Error);
  std::filesystem::remove(path);
}

std::string azure_file(const std::vector<std::string>& rows) {
  std::string out = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
  for (const auto& r : rows) out += r + "\n";
  return out;
}

TEST(AzureTrace, TimestampsMustBeDatesAndTimesThatExist) {
  auto error_for = [](const std::string& stamp) {
    const auto path = write_trace("azure-stamp", azure_file({stamp + ",10,2"}));
    return error_of([&] { read_azure_trace(path, {}); });
  };
  for (const char* bad :
       {"2023-11-16 18:-9:-9", "2023-11-16 18:17:-1", "2023-02-31 18:17:05", "2023-02-29 00:00:00",
        "2023-04-31 00:00:00", "2023-11-16 18: 7:05", "2023-11-16 24:00:00", "2023-11-16 18:17:05.",
        "2023-11-16T18:17:05", "+023-11-16 18:17:05"})
    EXPECT_THAT(error_for(bad), HasSubstr(":2: TIMESTAMP \"" + std::string(bad) + "\" is not"))
        << bad;
  const auto leap = write_trace(
      "azure-leap", azure_file({"2024-02-29 23:59:59.5,10,2", "2024-03-01 00:00:00.25,10,2"}));
  const auto records = read_azure_trace(leap, {});
  ASSERT_EQ(records.size(), 2u);
  EXPECT_DOUBLE_EQ(records[1].offset_s, 0.75);
}

TEST(AzureTrace, ARowEarlierThanTheOneBeforeItIsRefusedNamingTheLine) {
  const auto path = write_trace(
      "azure-unsorted", azure_file({"2023-11-16 18:17:03.5,10,2", "2023-11-16 18:17:03.25,10,2"}));
  EXPECT_THAT(
      error_of([&] { read_azure_trace(path, {}); }),
      HasSubstr(path.string() + ":3: TIMESTAMP \"2023-11-16 18:17:03.25\" is before line 2's "
                                "\"2023-11-16 18:17:03.5\""));
}

TEST(AzureTrace, ALengthNoRequestCanHaveIsRefusedNamingTheLineAndField) {
  const auto path = write_trace("azure-long", azure_file({"2023-11-16 18:17:03,100,10",
                                                          "2023-11-16 18:17:04,1000000000000,10"}));
  EXPECT_THAT(
      error_of([&] { read_azure_trace(path, {}); }),
      HasSubstr(path.string() +
                ":3: ContextTokens must be an integer in 1..10000000, got \"1000000000000\""));
}

TEST(AzureTrace, ARowOfAnotherFieldCountThanTheHeaderIsRefusedUnsplit) {
  // A row of 60 million commas was split into as many strings (3.1 GB) and accepted.
  const auto many = write_trace(
      "azure-commas", azure_file({"2023-11-16 18:17:03,100,10",
                                  "2023-11-16 18:17:04,100,10" + std::string(1000000, ',')}));
  EXPECT_THAT(error_of([&] { read_azure_trace(many, {}); }),
              HasSubstr(many.string() +
                        ":3: expected 3 comma-separated fields, as the header has, got 1000003"));
  const auto few =
      write_trace("azure-few", azure_file({"2023-11-16 18:17:03,100,10", "2023-11-16 18:17:04"}));
  EXPECT_THAT(error_of([&] { read_azure_trace(few, {}); }),
              HasSubstr(few.string() + ":3: expected 3 comma-separated fields"));
  const auto header = write_trace(
      "azure-header", "TIMESTAMP,ContextTokens,GeneratedTokens" + std::string(5000, ',') + "\n");
  EXPECT_THAT(error_of([&] { read_azure_trace(header, {}); }),
              HasSubstr(header.string() + ":1: a header of 5003 columns; expected at most 1024"));
}

TEST(AzureTrace, ARequestOfNoPromptOrNoOutputIsRefusedNamingTheLine) {
  // Every such request failed on the server.
  const auto prompt = write_trace(
      "azure-no-prompt", azure_file({"2023-11-16 18:17:03,100,10", "2023-11-16 18:17:04,0,10"}));
  EXPECT_THAT(error_of([&] { read_azure_trace(prompt, {}); }),
              HasSubstr(prompt.string() + ":3: ContextTokens must be an integer in 1.."));
  const auto output = write_trace(
      "azure-no-output", azure_file({"2023-11-16 18:17:03,100,10", "2023-11-16 18:17:04,100,0"}));
  EXPECT_THAT(error_of([&] { read_azure_trace(output, {}); }),
              HasSubstr(output.string() + ":3: GeneratedTokens must be an integer in 1.."));
}

TEST(AzureTrace, AWindowToTheLargestLimitEndsAtTheEndOfTheFile) {
  const auto rest =
      read_azure_trace(azure_path(), {.start = 1, .limit = std::numeric_limits<int64_t>::max()});
  EXPECT_EQ(rest.size(), 199u);
}

TEST_F(BenchData, SyntheticCountsAndLengthsAreBoundedBeforeAnythingIsAllocated) {
  RandomOptions r;
  r.num_requests = int64_t{1} << 62;
  EXPECT_THAT(error_of([&] { random_workload(*vocab_, r); }),
              HasSubstr("num_requests must be in 0..10000000"));
  r.num_requests = 1;
  r.input_len = std::numeric_limits<int64_t>::max();
  EXPECT_THAT(error_of([&] { random_workload(*vocab_, r); }),
              HasSubstr("input_len must be in 1..10000000"));
  r.input_len = 9'000'000;
  r.range_ratio = 0.5;  // up to 13.5M tokens
  EXPECT_THAT(error_of([&] { random_workload(*vocab_, r); }),
              HasSubstr("a request may have 13500000 tokens"));
  PrefixRepetitionOptions p;
  p.prefix_len = std::numeric_limits<int64_t>::max();
  EXPECT_THAT(error_of([&] { prefix_repetition_workload(*vocab_, p); }),
              HasSubstr("with a sum in 1..10000000"));
}

// A trace window made whole (tandem bench) is bounded as the synthetic workloads are, 10^8
// prompt tokens in all, and refused at the record that crosses it, naming its line, before any
// prompt is made: 100 Azure rows of 10^7 tokens ran 107 s into an allocation failure.
TEST_F(BenchData, ATraceWindowMadeWholeIsBoundedInPromptTokensNamingTheLine) {
  std::string csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
  for (int i = 0; i < 12; ++i) {
    if (i == 3) csv += "\n";  // a blank line: lines and records differ
    csv += "2023-11-16 18:17:" + std::to_string(10 + i) + ".0,10000000,5\n";
  }
  AzureOptions a;
  a.path = write_trace("azure-huge", csv);
  // The 11th row (line 13) takes the window to 110,000,000 tokens.
  EXPECT_THAT(error_of([&] { azure_workload(*vocab_, a); }),
              HasSubstr("azure trace " + a.path.string() +
                        ":13: the window's first 11 records, up to this one, hold 110000000 "
                        "prompt tokens; a workload made whole (ids and text in memory) holds at "
                        "most 100000000"));
  // Reading the records is not bounded: a driver that makes each request as it sends it (tandem
  // simulate) replays the whole file, with the same prompts.
  const auto records = read_azure_trace(a.path, {});
  ASSERT_EQ(records.size(), 12u);
  EXPECT_EQ(records[3].line, 6);
  EXPECT_EQ(records[3].index, 3);
  a.window = {.start = 2, .limit = 3};
  a.max_prompt_tokens = 30'000'000;  // the window's three fit
  const auto w = azure_workload(*vocab_, a);
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[1].prompt_ids, azure_prompt(*vocab_, records[3], a.seed));
  a.window.limit = 4;
  EXPECT_THAT(error_of([&] { azure_workload(*vocab_, a); }),
              HasSubstr(":8: the window's first 4 records, up to this one, hold 40000000"));

  // Mooncake alike, on the trace's head: its records 10.. (lines 11..) hold their input_lengths.
  const auto head = read_mooncake_trace(mooncake_path(), {.start = 10, .limit = 5});
  MooncakeOptions m;
  m.path = mooncake_path();
  m.window = {.start = 10, .limit = 5};
  m.max_prompt_tokens = head[0].input_length + head[1].input_length + head[2].input_length - 1;
  EXPECT_THAT(error_of([&] { mooncake_workload(*vocab_, m); }),
              HasSubstr("mooncake trace " + mooncake_path().string() + ":" +
                        std::to_string(head[2].line) + ": the window's first 3 records"));
  EXPECT_EQ(head[2].line, 13);
  m.max_prompt_tokens += 1;
  m.window.limit = 3;
  EXPECT_EQ(mooncake_workload(*vocab_, m).size(), 3u);
}

// A malformed JSON line is quoted in the error as a cell of a CSV is, its first 40 bytes: the
// parser's message held the whole token, and a line with a 50 MB string made a 50 MB error. Its
// words and position (line, column) stay.
TEST_F(BenchData, AMalformedJsonLineIsQuotedShortKeepingItsPosition) {
  const std::string big(1'000'000, 'A');
  const auto expect_short = [&](const std::string& error, const std::string& start) {
    EXPECT_LT(error.size(), 600u) << error.substr(0, 600);
    EXPECT_THAT(error, HasSubstr(start));
    EXPECT_THAT(error, HasSubstr("missing closing quote; last read: \"\"AAAAAAAAAA"));
    EXPECT_THAT(error, HasSubstr("AAA...\""));
  };
  const auto mooncake =
      write_trace("json-error-mooncake", mooncake_line("0") + "{\"timestamp\": \"" + big + "\n");
  expect_short(error_of([&] { read_mooncake_trace(mooncake, {}); }),
               mooncake.string() + ":2: malformed JSON: [json.exception.parse_error.101] parse " +
                   "error at line 1, column 1000016: syntax error while parsing value - invalid " +
                   "string: missing closing quote; last read: ");
  ShareGptOptions sharegpt;
  sharegpt.path = write_trace("json-error-sharegpt", "[\n{\"conversations\": \"" + big);
  expect_short(error_of([&] { sharegpt_workload(*tokenizer_, sharegpt); }),
               "malformed JSON: [json.exception.parse_error.101] parse error at line 2, column " +
                   std::to_string(big.size() + 20) + ": syntax error");
  const auto log = write_trace("json-error-log", "\"" + big + "\n");
  expect_short(error_of([&] { read_access_log(log); }),
               "access log " + log.string() + ":1: not a JSON line ([json.exception.parse_error." +
                   "101] parse error at line 1, column " + std::to_string(big.size() + 2));
  // What follows the text read ("; expected ...") is kept.
  const auto expected = write_trace("json-error-expected", R"({"a": 1 )" + big + "\n");
  EXPECT_THAT(error_of([&] { read_mooncake_trace(expected, {}); }),
              HasSubstr("column 9: syntax error while parsing object - invalid literal; last read: "
                        "\"1 A\"; expected '}'"));
  // A multi-byte character is not split by the cut.
  EXPECT_EQ(excerpt(std::string(39, 'x') + "\xc3\xa9" + "yz"),
            "\"" + std::string(39, 'x') + "...\"");
  EXPECT_EQ(excerpt("short"), "\"short\"");
}

// --- arrivals ------------------------------------------------------------------------------

struct GapStats {
  double mean, cv2;
};
GapStats gap_stats(const std::vector<double>& t) {
  std::vector<double> gaps;
  double prev = 0;
  for (double x : t) {
    gaps.push_back(x - prev);
    prev = x;
  }
  double sum = 0;
  for (double g : gaps) sum += g;
  const double mean = sum / gaps.size();
  double sq = 0;
  for (double g : gaps) sq += (g - mean) * (g - mean);
  return {mean, sq / gaps.size() / (mean * mean)};
}

TEST(BenchArrivals, GammaGapsHaveTheRequestedRateAndShape) {
  const size_t n = 40000;
  for (double k : {1.0, 0.5, 4.0}) {
    ArrivalOptions o;
    o.request_rate = 8;
    o.burstiness = k;
    o.rescale_to_rate = false;
    o.seed = 42;
    const auto t = rate_arrivals(n, o);
    ASSERT_EQ(t.size(), n);
    for (size_t i = 1; i < n; ++i) ASSERT_GE(t[i], t[i - 1]);
    const GapStats s = gap_stats(t);
    // Gamma(k, 1/(rate k)): mean 1/rate, squared coefficient of variation 1/k. The mean of n
    // gaps has a relative standard error of sqrt(1/(k n)); allow 5 of them.
    EXPECT_NEAR(s.mean * o.request_rate, 1.0, 5 * std::sqrt(1.0 / (k * n))) << "k " << k;
    EXPECT_NEAR(s.cv2 * k, 1.0, 0.08) << "k " << k;

    // vLLM's rescaling: the last request lands on n / rate exactly.
    o.rescale_to_rate = true;
    const auto r = rate_arrivals(n, o);
    EXPECT_NEAR(r.back(), n / o.request_rate, 1e-9);
  }
}

TEST(BenchArrivals, SpecialRatesTraceAndApply) {
  ArrivalOptions o;  // rate inf
  for (double t : rate_arrivals(5, o)) EXPECT_EQ(t, 0.0);
  o.request_rate = 4;
  o.burstiness = INFINITY;
  const auto even = rate_arrivals(4, o);
  EXPECT_THAT(even, ::testing::ElementsAre(0.25, 0.5, 0.75, 1.0));
  o.burstiness = 1;
  o.seed = 1;
  const auto a = rate_arrivals(100, o);
  EXPECT_EQ(rate_arrivals(100, o), a);
  o.seed = 2;
  EXPECT_NE(rate_arrivals(100, o), a);
  o.request_rate = 0;
  EXPECT_THROW(rate_arrivals(3, o), Error);
  o.request_rate = 1;
  o.burstiness = -1;
  EXPECT_THROW(rate_arrivals(3, o), Error);

  std::vector<BenchRequest> reqs(3);
  reqs[1].arrival_s = 2;
  reqs[2].arrival_s = 5;
  EXPECT_THAT(trace_arrivals(reqs, 0.5), ::testing::ElementsAre(0.0, 1.0, 2.5));
  apply_arrivals(reqs, std::vector<double>{1, 2, 3});
  EXPECT_EQ(reqs[2].arrival_s, 3.0);
  EXPECT_THROW(apply_arrivals(reqs, std::vector<double>{1}), Error);
}

// --- metrics -------------------------------------------------------------------------------

json run_oracle(const json& input) {
  const auto in = test::temp_path("bench-metrics-in");
  const auto out = test::temp_path("bench-metrics-out");
  const auto err = test::temp_path("bench-metrics-err");
  {
    std::ofstream f(in);
    f << input.dump();
  }
  const int status = test::run_command(
      "/usr/bin/python3 " + quote(test::oracle_dir() / "bench_metrics_oracle.py") + " < " +
      quote(in) + " > " + quote(out) + " 2> " + quote(err));
  const std::string err_text = std::filesystem::exists(err) ? read_file(err) : "";
  json result;
  if (status == 0) result = json::parse(read_file(out));
  std::filesystem::remove(in);
  std::filesystem::remove(out);
  std::filesystem::remove(err);
  EXPECT_EQ(status, 0) << "bench_metrics_oracle.py failed (is python3-numpy installed?):\n"
                       << err_text;
  return result;
}

// A deterministic mix: failures, 0/1/2-token outputs, long streams, overlapping intervals.
std::vector<RequestResult> sample_results(uint64_t seed, size_t n) {
  Rng rng(seed);
  std::vector<RequestResult> out;
  for (size_t i = 0; i < n; ++i) {
    RequestResult r;
    r.start_s = 100 + rng.uniform() * 20;
    r.prompt_tokens = rng.between(1, 4000);
    if (rng.below(10) == 0) {
      r.success = false;
      r.error = "HTTP 503";
      out.push_back(r);
      continue;
    }
    r.success = true;
    const uint64_t kind = rng.below(8);
    r.output_tokens = kind == 0 ? 1 : kind == 1 ? 2 : rng.between(3, 300);
    r.ttft_s = 0.02 + rng.uniform() * 1.5;
    double t = r.ttft_s;
    // One gap per token after the first; sometimes chunks of two tokens (fewer gaps).
    const int64_t chunks = rng.below(4) == 0 ? r.output_tokens / 2 : r.output_tokens - 1;
    for (int64_t c = 0; c < chunks; ++c) {
      const double gap = rng.below(50) == 0 ? 0.3 + rng.uniform() : 0.01 + rng.uniform() * 0.04;
      r.itl_s.push_back(gap);
      t += gap;
    }
    r.latency_s = t + (r.output_tokens == 1 ? rng.uniform() * 0.01 : 0.0);
    out.push_back(r);
  }
  return out;
}

json results_json(const std::vector<RequestResult>& results) {
  json a = json::array();
  for (const auto& r : results) {
    a.push_back({{"success", r.success},
                 {"start", r.start_s},
                 {"ttft", r.ttft_s},
                 {"latency", r.latency_s},
                 {"itl", r.itl_s},
                 {"prompt_tokens", r.prompt_tokens},
                 {"output_tokens", r.output_tokens}});
  }
  return a;
}

void expect_matches_oracle(const std::vector<RequestResult>& results, double duration,
                           const MetricsOptions& o, const TableContext& ctx) {
  const BenchSummary s = summarize(results, duration, o);
  const json ours = to_json(s);
  json goodput = json::object();
  if (o.goodput_ttft_ms) goodput["ttft"] = *o.goodput_ttft_ms;
  if (o.goodput_tpot_ms) goodput["tpot"] = *o.goodput_tpot_ms;
  if (o.goodput_e2el_ms) goodput["e2el"] = *o.goodput_e2el_ms;
  if (o.goodput_tbt_ms) goodput["tbt"] = *o.goodput_tbt_ms;
  const json oracle = run_oracle(
      {{"duration", duration},
       {"percentiles", o.percentiles},
       {"metrics", o.percentile_metrics},
       {"goodput", goodput},
       {"request_rate", std::isfinite(ctx.request_rate) ? json(ctx.request_rate) : json(nullptr)},
       {"max_concurrency", ctx.max_concurrency ? json(*ctx.max_concurrency) : json(nullptr)},
       {"results", results_json(results)}});
  ASSERT_TRUE(oracle.is_object());
  for (const auto& [key, value] : oracle.items()) {
    if (key == "table") continue;
    ASSERT_TRUE(ours.contains(key)) << "missing key " << key;
    if (value.is_null()) {
      EXPECT_TRUE(ours[key].is_null()) << key;
    } else if (value.is_number_integer()) {
      EXPECT_EQ(ours[key], value) << key;
    } else {
      const double want = value.get<double>();
      EXPECT_NEAR(ours[key].get<double>(), want, 1e-9 * std::max(1.0, std::fabs(want))) << key;
    }
  }
  for (const auto& [key, value] : ours.items()) {
    EXPECT_TRUE(oracle.contains(key)) << "key the oracle does not know: " << key;
  }
  EXPECT_EQ(summary_table(s, ctx), oracle["table"].get<std::string>());
}

TEST(BenchMetrics, MatchNumpyWithDefaults) {
  const auto results = sample_results(1, 400);
  expect_matches_oracle(results, 31.7, MetricsOptions{}, TableContext{});
}

TEST(BenchMetrics, MatchNumpyWithAllMetricsPercentilesAndGoodput) {
  const auto results = sample_results(2, 333);
  MetricsOptions o;
  o.percentiles = {50, 90, 99, 99.9, 12.5, 0, 100, 0.0001, 1e-05, 0.00015, 2.5e-07};
  o.percentile_metrics = {"ttft", "tpot", "itl", "e2el", "tbt"};
  o.goodput_ttft_ms = 900;
  o.goodput_tpot_ms = 40;
  o.goodput_e2el_ms = 8000;
  expect_matches_oracle(results, 25.0, o,
                        TableContext{.request_rate = 12.5, .max_concurrency = 64});
  // One SLO at a time, TBT's included.
  MetricsOptions tpot_only;
  tpot_only.goodput_tpot_ms = 30;
  expect_matches_oracle(results, 25.0, tpot_only, TableContext{});
  MetricsOptions tbt_only;
  tbt_only.goodput_tbt_ms = 100;
  tbt_only.percentile_metrics = {"tbt"};
  expect_matches_oracle(results, 25.0, tbt_only, TableContext{});
}

TEST(BenchMetrics, SmallCasesByHand) {
  // TPOT excludes one-token outputs; for goodput they count with TPOT 0.
  std::vector<RequestResult> r(4);
  r[0] = {true, "", 0.0, 0.1, 0.5, {0.2, 0.2}, 10, 3};  // TPOT (0.5-0.1)/2 = 0.2
  r[1] = {true, "", 0.2, 0.3, 0.3, {}, 20, 1};          // no TPOT
  r[2] = {true, "", 0.4, 0.2, 1.2, {0.1, 0.9}, 30, 3};  // TPOT 0.5
  r[3] = {false, "timeout", 0.5, 0, 0, {}, 40, 0};
  MetricsOptions o;
  o.percentile_metrics = {"ttft", "tpot", "itl", "e2el", "tbt"};
  o.percentiles = {50, 99};
  o.goodput_tpot_ms = 300;  // r[0] (200 ms) and r[1] (0) are good, r[2] (500 ms) is not
  const BenchSummary s = summarize(r, 2.0, o);
  EXPECT_EQ(s.completed, 3);
  EXPECT_EQ(s.failed, 1);
  EXPECT_EQ(s.total_input_tokens, 60);
  EXPECT_EQ(s.total_output_tokens, 7);
  EXPECT_DOUBLE_EQ(s.request_throughput, 1.5);
  ASSERT_TRUE(s.request_goodput.has_value());
  EXPECT_DOUBLE_EQ(*s.request_goodput, 1.0);
  EXPECT_DOUBLE_EQ(s.tpot.mean_ms, 350);
  EXPECT_DOUBLE_EQ(s.tpot.std_ms, 150);                    // population std of {200, 500}
  EXPECT_DOUBLE_EQ(s.tpot.percentiles_ms[1].second, 497);  // 200 + 300 * 0.99
  EXPECT_DOUBLE_EQ(s.itl.median_ms, 200);                  // {100, 200, 200, 900}
  EXPECT_DOUBLE_EQ(s.tbt.mean_ms, 550);                    // slowest gap of each: 200 and 900
  EXPECT_EQ(s.max_concurrent_requests, 3);                 // [0,0.5) [0.2,0.5) [0.4,1.6) at 0.4
  EXPECT_DOUBLE_EQ(s.max_output_tokens_per_s, 6);          // .1 .3 .5 | .5 | .6 .7 1.6

  const json j = to_json(s, r);
  EXPECT_EQ(j["p50_tpot_ms"], s.tpot.percentiles_ms[0].second);
  EXPECT_EQ(j["output_lens"], json({3, 1, 3, 0}));
  EXPECT_EQ(j["errors"][3], "timeout");
  EXPECT_FALSE(to_json(summarize(r, 2.0)).contains("mean_e2el_ms"));
  EXPECT_TRUE(to_json(summarize(r, 2.0))["request_goodput"].is_null());

  // Nothing completed: every statistic is 0, as vLLM's np.mean(values or 0).
  const BenchSummary none = summarize(std::vector<RequestResult>{r[3]}, 1.0);
  EXPECT_EQ(none.completed, 0);
  EXPECT_EQ(none.ttft.mean_ms, 0);
  EXPECT_EQ(none.ttft.percentiles_ms[0].second, 0);

  EXPECT_DOUBLE_EQ(mooncake_tbt(std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}), 10.5);
  EXPECT_DOUBLE_EQ(percentile({4, 1, 3, 2}, 99), 3.97);
  EXPECT_THROW(summarize(r, 0.0), Error);
  o.percentile_metrics = {"ttft", "latency"};
  EXPECT_THROW(summarize(r, 1.0, o), Error);
}

// With speculative decoding (MTP) a streamed chunk carries several tokens. Counting one token per
// chunk put the peak output tokens per second below the mean output throughput: here ten chunks
// of three tokens, all within the first second, are 30 tokens in that second, not 10.
TEST(BenchMetrics, PeakOutputTokensCountEveryTokenOfAChunkThatCarriesSeveral) {
  StreamMeasurement m(0.0, 8);
  m.head(200);
  for (int k = 0; k < 10; ++k)
    m.body(net::sse_event(R"({"choices": [{"index": 0, "text": " a b c"}]})"), 0.05 + 0.08 * k);
  m.body(net::sse_event(R"({"choices": [], "usage": {"completion_tokens": 30}})"), 0.9);
  m.body(std::string(net::kSseDone), 0.9);
  const std::vector<RequestResult> results = {m.done("", 0.9, 0.0)};
  ASSERT_TRUE(results[0].success) << results[0].error;
  ASSERT_EQ(results[0].itl_s.size(), 9u);
  const BenchSummary s = summarize(results, 1.0);
  EXPECT_DOUBLE_EQ(s.output_throughput, 30);
  EXPECT_DOUBLE_EQ(s.max_output_tokens_per_s, 30);
  EXPECT_GE(s.max_output_tokens_per_s, s.output_throughput);
  // Spread over a second boundary: chunks at 0.5 .. 1.4 s, three each, split 15 / 15.
  RequestResult late = results[0];
  late.ttft_s = 0.5;
  late.itl_s.assign(9, 0.1);
  late.latency_s = 1.4;
  const Timeline t = timeline(std::vector<RequestResult>{late});
  ASSERT_EQ(t.busy_seconds.size(), 2u);
  EXPECT_EQ(t.busy_seconds[0].second + t.busy_seconds[1].second, 30);
  // A chunk more than the tokens (a role chunk first): the tokens, not the chunks, are counted.
  RequestResult role = late;
  role.output_tokens = 9;
  const Timeline r = timeline(std::vector<RequestResult>{role});
  int64_t counted = 0;
  for (const auto& [second, tokens] : r.busy_seconds) counted += tokens;
  EXPECT_EQ(counted, 9);
}

// vLLM names a percentile's key str(int(p)) when p is whole, else Python's str(p): the shortest
// digits that read back, in scientific notation only below 1e-4 ("1e-05", not "1e-5").
TEST(BenchMetrics, PercentileKeysAreWrittenAsPythonWritesTheNumber) {
  std::vector<RequestResult> r(1);
  r[0] = {true, "", 0.0, 0.1, 0.5, {0.2, 0.2}, 10, 3};
  MetricsOptions o;
  o.percentile_metrics = {"ttft"};
  o.percentiles = {99, 99.9, 0.0001, 0.00015, 1e-05, 1.5e-05, 0.001, 12.5};
  const json j = to_json(summarize(r, 1.0, o));
  for (const char* key : {"p99_ttft_ms", "p99.9_ttft_ms", "p0.0001_ttft_ms", "p0.00015_ttft_ms",
                          "p1e-05_ttft_ms", "p1.5e-05_ttft_ms", "p0.001_ttft_ms", "p12.5_ttft_ms"})
    EXPECT_TRUE(j.contains(key)) << key << " in " << j.dump();
  EXPECT_THAT(summary_table(summarize(r, 1.0, o)), HasSubstr("P0.0001 TTFT (ms):"));
}

// vLLM's serve.py once reported the busiest 1 s bucket of requests touching it (every request
// active in any part of a second counted there), which calls three requests one after another
// within a second "3 concurrent". Current vLLM takes the most in flight at one instant over
// [start, start + latency), an end before a start at the same time (its sweep over start and end
// events, vllm-project/vllm#56653), and so does tandem.
TEST(BenchMetrics, PeakConcurrencyIsTheMostInFlightAtOneInstantAsCurrentVllmCountsIt) {
  std::vector<RequestResult> r(4);
  r[0] = {true, "", 0.0, 0.1, 0.2, {}, 10, 1};  // [0, 0.2)
  r[1] = {true, "", 0.2, 0.1, 0.3, {}, 10, 1};  // [0.2, 0.5): starts as r[0] ends
  r[2] = {true, "", 0.6, 0.1, 0.3, {}, 10, 1};  // [0.6, 0.9)
  r[3] = {true, "", 1.5, 0.1, 0.4, {}, 10, 1};  // [1.5, 1.9)
  EXPECT_EQ(summarize(r, 2.0).max_concurrent_requests, 1);
  r[3].start_s = 0.7;  // [0.7, 1.1) overlaps r[2]
  EXPECT_EQ(summarize(r, 2.0).max_concurrent_requests, 2);
}

// The workload is made whole, repeats included: oversampling had no bound on its prompt tokens
// (10^7 requests of a 1,000-token conversation would have made 10^10), while the random
// workloads and the traces are refused past kMaxWorkloadPromptTokens. The bound is checked
// before any repeat is made, and the workload it lets through is the one made without it.
TEST_F(BenchData, ShareGptRepeatsBeyondThePromptTokenBoundAreRefusedNamingTheCount) {
  const json conversations = json::array({
      {{"conversations",
        {{{"from", "human"}, {"value", "What is the capital city of France, please?"}},
         {{"from", "gpt"}, {"value", "The capital of France is Paris, a large city."}}}}},
      {{"conversations",
        {{{"from", "human"}, {"value", "Write a haiku about the sea, and keep it short."}},
         {{"from", "gpt"}, {"value", "Waves fold into foam, salt wind carries gull voices."}}}}},
  });
  const auto path = test::temp_path("sharegpt-bound");
  std::ofstream(path) << conversations.dump();
  ShareGptOptions o;
  o.path = path;
  o.num_requests = 6;
  const std::vector<BenchRequest> unbounded = sharegpt_workload(*tokenizer_, o);
  ASSERT_EQ(unbounded.size(), 6u);
  int64_t total = 0, kept = 0;
  for (const BenchRequest& r : unbounded) total += static_cast<int64_t>(r.prompt_ids.size());
  for (size_t i = 0; i < 2; ++i) kept += static_cast<int64_t>(unbounded[i].prompt_ids.size());

  o.max_prompt_tokens = total;  // exactly enough: the same requests
  const std::vector<BenchRequest> bounded = sharegpt_workload(*tokenizer_, o);
  ASSERT_EQ(bounded.size(), unbounded.size());
  for (size_t i = 0; i < bounded.size(); ++i)
    EXPECT_EQ(bounded[i].prompt_ids, unbounded[i].prompt_ids) << i;

  o.max_prompt_tokens = total - 1;
  o.num_requests_name = "--num-prompts";
  EXPECT_THAT(error_of([&] { sharegpt_workload(*tokenizer_, o); }),
              HasSubstr("sharegpt dataset " + path.string() +
                        ": --num-prompts 6: its 2 usable conversations, repeated to make 6 "
                        "requests (vLLM's oversampling), hold " +
                        std::to_string(total) + " prompt tokens by request 6; at most " +
                        std::to_string(total - 1) + " prompt tokens in all"));
  // The conversations themselves, without repeats.
  o.max_prompt_tokens = kept - 1;
  o.num_requests_name = "num_requests";
  EXPECT_THAT(
      error_of([&] { sharegpt_workload(*tokenizer_, o); }),
      HasSubstr(": num_requests 6: its first 2 usable conversations hold " + std::to_string(kept) +
                " prompt tokens; at most " + std::to_string(kept - 1)));
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace tandem::bench
