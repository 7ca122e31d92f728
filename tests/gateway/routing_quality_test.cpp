// Routing quality (src/gateway/routing_quality.h) on hand-built cases, the priority class of a
// request (src/gateway/priority.h), and reading what an engine reused from its answer.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "api/error.h"
#include "gateway/answer_text.h"
#include "gateway/priority.h"
#include "gateway/routing_quality.h"
#include "net/http.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

EndpointLoad engine(int id, int64_t cached) {
  EndpointLoad e;
  e.id = id;
  e.cached_tokens = cached;
  return e;
}

TEST(RoutingQuality, AvailableIsTheBestEngineOfThePoolAndChosenTheOnePicked) {
  const std::vector<EndpointLoad> pool = {engine(1, 64), engine(2, 512), engine(3, 0)};
  const PrefixReuse picked_best = reuse_at_decision(pool, 2);
  EXPECT_EQ(picked_best.available, 512);
  EXPECT_EQ(picked_best.chosen, 512);
  const PrefixReuse gave_up = reuse_at_decision(pool, 3);
  EXPECT_EQ(gave_up.available, 512);
  EXPECT_EQ(gave_up.chosen, 0);
  EXPECT_EQ(gave_up.delivered, -1);  // the engine has not said yet
}

TEST(RoutingQuality, SaturatedAndEjectedEnginesStillCountAsAvailable) {
  std::vector<EndpointLoad> pool = {engine(1, 16), engine(2, 4096)};
  pool[1].eligible = false;
  pool[1].in_flight = pool[1].max_in_flight = 8;
  EXPECT_EQ(reuse_at_decision(pool, 1).available, 4096);
}

TEST(RoutingQuality, UnknownWithoutTheChosenEnginesDepth) {
  // Engines without KV events report -1: nothing is known of the split.
  const std::vector<EndpointLoad> pool = {engine(1, -1), engine(2, 128)};
  const PrefixReuse none = reuse_at_decision(pool, 1);
  EXPECT_EQ(none.available, -1);
  EXPECT_EQ(none.chosen, -1);
  EXPECT_EQ(reuse_at_decision(pool, 7).chosen, -1);  // not in this pool
  // An engine without events beside the chosen one adds nothing to what is available.
  EXPECT_EQ(reuse_at_decision(pool, 2).available, 128);
}

TEST(RoutingQuality, TotalsCountOnlyRequestsMeasuredInFull) {
  ReuseTotals t;
  t.add({512, 256, 240}, 1000);
  t.add({512, 256, -1}, 1000);  // the engine did not report: left out entirely
  t.add({-1, -1, 100}, 1000);
  t.add({0, 0, 0}, 300);
  EXPECT_EQ(t.requests, 2);
  EXPECT_EQ(t.prompt_tokens, 1300);
  EXPECT_EQ(t.available, 512);
  EXPECT_EQ(t.chosen, 256);
  EXPECT_EQ(t.delivered, 240);
}

TEST(RoutingQuality, CachedTokensComeFromTheUsageOfAnAnswerOrAStream) {
  const json answer = {{"choices", {{{"text", "cached_tokens"}}}},
                       {"usage",
                        {{"prompt_tokens", 900},
                         {"completion_tokens", 3},
                         {"prompt_tokens_details", {{"cached_tokens", 768}}}}}};
  EXPECT_EQ(usage_cached_tokens(answer.dump()), 768);
  const std::string stream =
      "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
      "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"prompt_tokens_details\":"
      "{\"cached_tokens\": 64}}}\n\ndata: [DONE]\n\n";
  EXPECT_EQ(usage_cached_tokens(stream), 64);
  // vLLM without --enable-prompt-tokens-details: null details, nothing reported.
  EXPECT_EQ(usage_cached_tokens(R"({"usage":{"prompt_tokens":5,"prompt_tokens_details":null}})"),
            -1);
  EXPECT_EQ(usage_cached_tokens(R"({"choices":[]})"), -1);
}

// ------------------------------------------------------------------------------ priority classes

PriorityClasses classes() {
  PriorityClasses pc;
  pc.classes = {{"interactive", 0, std::chrono::seconds(2), std::nullopt},
                {"standard", 5, std::chrono::seconds(10), std::nullopt},
                {"batch", 10, std::chrono::seconds(60), std::nullopt}};
  pc.default_class = 1;
  pc.api_keys = {{"k-batch", 2}, {"k-chat", 0}};
  return pc;
}

TEST(PriorityClass, ARequestChoosesByValueOrNameElseTheDefault) {
  const PriorityClasses pc = classes();
  EXPECT_EQ(request_class(pc, nullptr, ""), 1u);
  EXPECT_EQ(request_class(pc, json(0), ""), 0u);
  EXPECT_EQ(request_class(pc, json(10), "unmapped-key"), 2u);
  EXPECT_EQ(request_class(pc, json("batch"), ""), 2u);
  // A whole float is its integer, as the engine reads priority (api::whole_number).
  EXPECT_EQ(request_class(pc, json(5.0), ""), 1u);
  EXPECT_EQ(request_class(pc, json(10.0), ""), 2u);
}

TEST(PriorityClass, AMappedKeyDecidesAndARequestMayOnlyLowerIt) {
  const PriorityClasses pc = classes();
  EXPECT_EQ(request_class(pc, nullptr, "k-batch"), 2u);
  EXPECT_EQ(request_class(pc, json(0), "k-batch"), 2u);  // cannot climb above its key's class
  EXPECT_EQ(request_class(pc, nullptr, "k-chat"), 0u);
  EXPECT_EQ(request_class(pc, json("batch"), "k-chat"), 2u);  // may go lower
}

TEST(PriorityClass, EnginesScheduleByPriorityWithClassesOrWhereTheyComputeDeadlinedPrompts) {
  const auto tandem = make_policy("tandem");  // sets prefill deadlines by default
  const auto kv_router = make_policy("kv_router");
  const PriorityClasses none;
  EXPECT_TRUE(engine_schedules_by_priority(none, *tandem, /*computes_prompts=*/true));
  EXPECT_FALSE(engine_schedules_by_priority(none, *tandem, /*computes_prompts=*/false));
  EXPECT_FALSE(engine_schedules_by_priority(none, *kv_router, true));
  for (const bool computes : {true, false})
    EXPECT_TRUE(engine_schedules_by_priority(classes(), *kv_router, computes));
}

// With classes the class is the priority: the tandem policy then sets no deadlines, so it holds
// requests for the queued tokens of engines that schedule by priority (by class), as before
// deadlines, instead of treating them as engines that take its deadlines.
TEST(PriorityClass, WithClassesTheTandemPolicyGivesNoDeadlinesAndHoldsForQueuedTokens) {
  Topology t;
  t.scheduling.tandem.prefill_deadline_slack = 12;
  EXPECT_EQ(policy_options(t).tandem.prefill_deadline_slack, 12);
  t.priority = classes();
  const auto tandem = make_policy("tandem", policy_options(t));
  EXPECT_FALSE(tandem->sets_prefill_deadlines());
  ClusterView v;
  v.prefill.resize(1);
  v.prefill[0].max_in_flight = 64;
  v.prefill[0].in_flight = 1;
  v.prefill[0].queued_prefill_tokens = 40000;  // over the 32000-token limit
  v.prefill[0].schedules_by_priority = true;
  RequestInfo r;
  r.prompt_tokens = 100;
  EXPECT_EQ(tandem->choose_prefill(v, r, Clock::time_point{}).kind, Choice::Kind::kSaturated);
  EXPECT_FALSE(tandem->prefill_deadline(v.prefill[0], r).has_value());
}

TEST(PriorityClass, UnknownValuesAndNamesAre400sNamingTheField) {
  const PriorityClasses pc = classes();
  for (const json& bad : {json(3), json("urgent"), json(1.5), json::array({0}), json(true)}) {
    try {
      request_class(pc, bad, "");
      ADD_FAILURE() << bad.dump() << " was accepted";
    } catch (const api::ApiError& e) {
      EXPECT_EQ(e.status, 400);
      EXPECT_EQ(e.param, "priority");
      EXPECT_THAT(e.message, HasSubstr("(0, 5, 10)"));
      EXPECT_THAT(e.message, HasSubstr("(interactive, standard, batch)"));
      EXPECT_THAT(e.message, HasSubstr("got " + bad.dump()));
    }
  }
  // A hostile value comes back cut short.
  try {
    request_class(pc, json(std::string(10000, 'x')), "");
    ADD_FAILURE();
  } catch (const api::ApiError& e) {
    EXPECT_LT(e.message.size(), 300u);
  }
}

// ------------------------------------------------------------------------------ query strings

TEST(QueryParam, FindsAndDecodesAValue) {
  EXPECT_EQ(net::query_param("endpoint=p0&key=a%2Fb+c", "key"), "a/b c");
  EXPECT_EQ(net::query_param("endpoint=%3C%2Fscript%3E", "endpoint"), "</script>");
  EXPECT_EQ(net::query_param("a=1&flag&b=2", "flag"), "");
  EXPECT_EQ(net::query_param("a=1", "b"), std::nullopt);
  EXPECT_EQ(net::query_param("a=%zz%4", "a"), "%zz%4");  // malformed escapes stay as sent
  EXPECT_EQ(net::query_param("", "a"), std::nullopt);
}

}  // namespace
}  // namespace tandem::gateway
