// The /load report, the contract between an engine that writes it and a gateway that reads it:
// what the engine writes reads back the same, reports from engines that predate some fields keep
// their defaults, and a bad report is refused with the field named.
#include "api/load_report.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "api/load_report_samples.h"
#include "util/error.h"

namespace tandem::api {
namespace {

constexpr const char* kReport = samples::kRunningStepReport;

std::string error_of(const std::string& body) {
  try {
    parse_load_report(body);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(LoadReport, ParsesTheEnginesReport) {
  const LoadReport r = parse_load_report(kReport);
  EXPECT_EQ(r.running, 2);
  EXPECT_EQ(r.waiting, 3);
  EXPECT_EQ(r.free_blocks, 900);
  EXPECT_EQ(r.total_blocks, 1024);
  EXPECT_EQ(r.block_size, 16);
  EXPECT_EQ(r.tokens_in_flight, 5000);
  EXPECT_EQ(r.prefill_tokens, 6000);
  EXPECT_EQ(r.max_batch_tokens, 2048);
  EXPECT_EQ(r.step_seqs, 2);
  EXPECT_EQ(r.step_tokens, 2048);
  EXPECT_DOUBLE_EQ(r.step_running_for_s, 0.05);
  ASSERT_EQ(r.recent_steps.size(), 3u);
  EXPECT_EQ(r.recent_steps[0].index, 15u);
  EXPECT_EQ(r.recent_steps[2].seqs, 2);
  EXPECT_DOUBLE_EQ(r.recent_steps[2].seconds, 0.25);
  // An idle engine: no step running.
  const LoadReport idle = parse_load_report(R"({"running":0,"step":null,"recent_steps":[]})");
  EXPECT_EQ(idle.step_seqs, 0);
  EXPECT_TRUE(idle.recent_steps.empty());
}

TEST(LoadReport, BadReportsNameTheField) {
  EXPECT_NE(error_of("[1,2]").find("expected a JSON object"), std::string::npos);
  EXPECT_NE(error_of("{not json").find("expected a JSON object"), std::string::npos);
  EXPECT_NE(error_of(R"({"running":-1})").find("running"), std::string::npos);
  EXPECT_NE(error_of(R"({"free_blocks":"many"})").find("free_blocks"), std::string::npos);
  EXPECT_NE(error_of(R"({"step":[1]})").find("step"), std::string::npos);
  EXPECT_NE(error_of(R"({"step":{"seqs":1,"running_for_s":-2}})").find("running_for_s"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"recent_steps":{}})").find("recent_steps"), std::string::npos);
  EXPECT_NE(error_of(R"({"recent_steps":[[1,1,64,0.1],[2,1,64]]})").find("recent_steps[1]"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"recent_steps":[[1,1,64,-0.1]]})").find("recent_steps[0]"),
            std::string::npos);
}

TEST(LoadReport, WhatTheEngineWritesReadsBackTheSame) {
  LoadReport r;
  r.running = 3;
  r.waiting = 7;
  r.free_blocks = 100;
  r.total_blocks = 4096;
  r.block_size = 16;
  r.tokens_in_flight = 12345;
  r.kv_usage = 0.25;
  r.cached_blocks = 80;
  r.steps = 99;
  r.prefill_tokens = 8000;
  r.prefill_pairs = 32004000;
  r.max_batch_tokens = 2048;
  r.schedules_by_priority = true;
  r.step_seqs = 4;
  r.step_tokens = 2051;
  r.step_prefill_pairs = 2098176;
  r.step_running_for_s = 0.125;
  r.recent_steps = {{41, 2, 2048, 0.5, 2098176}, {42, 5, 5, 0.03125, 0}};
  const LoadReport back = parse_load_report(to_json(r));
  EXPECT_EQ(back.running, 3);
  EXPECT_EQ(back.waiting, 7);
  EXPECT_EQ(back.free_blocks, 100);
  EXPECT_EQ(back.total_blocks, 4096);
  EXPECT_EQ(back.block_size, 16);
  EXPECT_EQ(back.tokens_in_flight, 12345);
  EXPECT_DOUBLE_EQ(back.kv_usage, 0.25);
  EXPECT_EQ(back.cached_blocks, 80);
  EXPECT_EQ(back.steps, 99u);
  EXPECT_EQ(back.prefill_tokens, 8000);
  EXPECT_EQ(back.prefill_pairs, 32004000);
  EXPECT_EQ(back.max_batch_tokens, 2048);
  EXPECT_TRUE(back.schedules_by_priority);
  EXPECT_EQ(back.step_seqs, 4);
  EXPECT_EQ(back.step_tokens, 2051);
  EXPECT_EQ(back.step_prefill_pairs, 2098176);
  EXPECT_DOUBLE_EQ(back.step_running_for_s, 0.125);
  ASSERT_EQ(back.recent_steps.size(), 2u);
  EXPECT_EQ(back.recent_steps[0].index, 41u);
  EXPECT_EQ(back.recent_steps[0].prefill_pairs, 2098176);
  EXPECT_EQ(back.recent_steps[1].seqs, 5);
  EXPECT_DOUBLE_EQ(back.recent_steps[1].seconds, 0.03125);
  EXPECT_EQ(back.recent_steps[1].prefill_pairs, 0);
}

// The process instance reads back as written; a report without one (an engine that predates
// the field) leaves it empty and writes none.
TEST(LoadReport, TheProcessInstanceReadsBackAndIsOptional) {
  LoadReport r;
  r.instance = this_process_instance();
  EXPECT_EQ(parse_load_report(to_json(r)).instance, r.instance);
  EXPECT_EQ(parse_load_report(kReport).instance, "");
  EXPECT_FALSE(nlohmann::json::parse(to_json(LoadReport{})).contains("instance"));
  EXPECT_NE(error_of(R"({"instance":42})").find("instance"), std::string::npos);
}

TEST(LoadReport, ThisProcessInstanceIsSixteenHexDigitsThatStayTheSame) {
  const std::string& instance = this_process_instance();
  ASSERT_EQ(instance.size(), 16u);
  EXPECT_EQ(instance.find_first_not_of("0123456789abcdef"), std::string::npos) << instance;
  EXPECT_EQ(this_process_instance(), instance);
}

TEST(LoadReport, AnIdleEngineWritesNoStepAndUnreportedPairsStayUnreported) {
  LoadReport idle;
  const auto j = nlohmann::json::parse(to_json(idle));
  EXPECT_TRUE(j.at("step").is_null());
  EXPECT_FALSE(j.contains("prefill_pairs"));
  const LoadReport back = parse_load_report(to_json(idle));
  EXPECT_EQ(back.step_seqs, 0);
  EXPECT_EQ(back.prefill_pairs, -1);
  EXPECT_EQ(back.step_prefill_pairs, -1);
  EXPECT_FALSE(back.schedules_by_priority);  // first come first served unless it says otherwise
}

TEST(LoadReport, KvUsageAndCountsMustBeNumbers) {
  EXPECT_NE(error_of(R"({"kv_usage":"half"})").find("kv_usage"), std::string::npos);
  EXPECT_NE(error_of(R"({"cached_blocks":-3})").find("cached_blocks"), std::string::npos);
  EXPECT_NE(error_of(R"({"steps":1.5})").find("steps"), std::string::npos);
  EXPECT_NE(error_of(R"({"scheduling_policy":1})").find("scheduling_policy"), std::string::npos);
}

// Other servers answer GET /load too: vLLM's server-load tracking, or a proxy's fixed reply. They
// parse, but describe no engine, so a gateway does not take them for an engine with nothing free.
TEST(LoadReport, APollSinceAStepGetsOnlyTheStepsAfterIt) {
  LoadReport r;
  r.total_blocks = 10;
  r.block_size = 16;
  for (uint64_t i = 5; i <= 9; ++i) r.recent_steps.push_back({i, 1, 1, 0.01, -1});
  auto indices = [](const LoadReport& report) {
    std::vector<uint64_t> out;
    for (const auto& s : report.recent_steps) out.push_back(s.index);
    return out;
  };
  EXPECT_EQ(indices(parse_load_report(to_json(r))), (std::vector<uint64_t>{5, 6, 7, 8, 9}));
  EXPECT_EQ(indices(parse_load_report(to_json(r, 7))), (std::vector<uint64_t>{8, 9}));
  EXPECT_TRUE(parse_load_report(to_json(r, 9)).recent_steps.empty());
  // Beyond the newest step the poller knew an earlier life of the engine: every step.
  EXPECT_EQ(indices(parse_load_report(to_json(r, 40))), (std::vector<uint64_t>{5, 6, 7, 8, 9}));
}

TEST(LoadReport, ThePollTargetCarriesTheLastStepSeen) {
  EXPECT_EQ(load_target(0), "/load");
  EXPECT_EQ(load_target(123), "/load?since_step=123");
  EXPECT_EQ(load_since_step(load_target(123)), 123u);
  EXPECT_EQ(load_since_step("/load"), 0u);
  EXPECT_EQ(load_since_step("/load?x=1&since_step=7"), 7u);
  for (const char* bad : {"/load?since_step=", "/load?since_step=-3", "/load?since_step=1e3",
                          "/load?since_step=99999999999999999999999", "/load?since=5"})
    EXPECT_EQ(load_since_step(bad), 0u) << bad;
}

TEST(LoadReport, OnlyAnEnginesReportDescribesAnEngine) {
  EXPECT_FALSE(describes_an_engine(parse_load_report(R"({"server_load":3})")));
  EXPECT_FALSE(describes_an_engine(parse_load_report(R"({"id":"cmpl-1","choices":[]})")));
  EXPECT_TRUE(describes_an_engine(parse_load_report(kReport)));
  LoadReport engine;
  engine.total_blocks = 8;
  engine.block_size = 16;
  EXPECT_TRUE(describes_an_engine(parse_load_report(to_json(engine))));
}

}  // namespace
}  // namespace tandem::api
