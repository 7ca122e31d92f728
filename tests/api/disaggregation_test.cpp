// The disaggregation fields, written by one side and read by the other: the gateway's prefill leg
// reads as a prefill for a remote decode, a prefill engine's answer spliced into the decode leg
// reads back as the transfer it names, the bootstrap members read back as the room, and malformed
// fields are refused with the field named.
#include "api/disaggregation.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "api/error.h"
#include "util/error.h"

namespace tandem::api {
namespace {

using nlohmann::json;

constexpr int64_t kVocab = 1000;

ApiError error_of(const json& body) {
  try {
    parse_disaggregation(body, kVocab);
  } catch (const ApiError& e) {
    return e;
  }
  return {0, "", "", "", ""};
}

TEST(Disaggregation, APlainRequestHasNoDisaggregationFields) {
  const DisaggregationParams d = parse_disaggregation(json{{"prompt", "hi"}}, kVocab);
  EXPECT_FALSE(d.remote_decode);
  EXPECT_FALSE(d.remote_prefill);
  EXPECT_FALSE(d.has_bootstrap);
}

TEST(Disaggregation, ThePrefillLegAsksForARemoteDecodeAndOneUnstreamedToken) {
  const json client = {{"prompt", "hi"},
                       {"stream", true},
                       {"stream_options", {{"include_usage", true}}},
                       {"max_tokens", 200},
                       {"max_completion_tokens", 200},
                       {"min_tokens", 5},
                       {"temperature", 0.5}};
  const json leg = prefill_leg_body(client);
  const DisaggregationParams d = parse_disaggregation(leg, kVocab);
  EXPECT_TRUE(d.remote_decode);
  EXPECT_FALSE(d.remote_prefill);
  EXPECT_EQ(leg.at("stream"), false);
  EXPECT_FALSE(leg.contains("stream_options"));
  EXPECT_EQ(leg.at("max_tokens"), 1);
  EXPECT_EQ(leg.at("max_completion_tokens"), 1);
  EXPECT_FALSE(leg.contains("min_tokens"));
  EXPECT_EQ(leg.at("temperature"), 0.5);  // the rest as the client sent it
}

TEST(Disaggregation, ThePrefillAnswerSplicedIntoTheDecodeLegNamesTheSameTransfer) {
  const PulledKv kv{"engine-7", "127.0.0.9", 7001, "xfer-42", {3, 4, 9}, {11, 12, 13}, {}};
  const std::string answer = json{
      {"id", "cmpl-1"},
      {"choices", json::array()},
      {"kv_transfer_params",
       kv_transfer_params(kv)}}.dump();
  const std::string member = kv_transfer_params_member(answer);
  const json decode_leg = json::parse("{\"prompt\":\"hi\"," + member + "}");
  const DisaggregationParams d = parse_disaggregation(decode_leg, kVocab);
  EXPECT_TRUE(d.remote_prefill);
  EXPECT_FALSE(d.remote_decode);
  EXPECT_EQ(d.remote_engine_id, "engine-7");
  EXPECT_EQ(d.remote_host, "127.0.0.9");
  EXPECT_EQ(d.remote_port, 7001);
  EXPECT_EQ(d.remote_request_id, "xfer-42");
  EXPECT_EQ(d.remote_block_ids, (std::vector<int32_t>{3, 4, 9}));
  EXPECT_EQ(d.prompt_token_ids, (std::vector<int32_t>{11, 12, 13}));
}

// A prefill engine's prompt logprobs ride in its kv_transfer_params and read back as written
// (-inf as OpenAI's -9999, which JSON can carry); without them the field is absent.
TEST(Disaggregation, PromptLogprobsInTheTransferParamsReadBackAsWritten) {
  PulledKv kv{"e", "h", 7001, "t", {1}, {5, 6, 7}, {}};
  EXPECT_FALSE(kv_transfer_params(kv).contains("prompt_logprobs"));
  kv.prompt_logprobs = {{6, -0.5f, {{6, -0.5f}, {9, -1.25f}}, 1},
                        {7, -std::numeric_limits<float>::infinity(), {}, 999}};
  const json params = kv_transfer_params(kv);
  const DisaggregationParams d =
      parse_disaggregation(json::parse(json{{"kv_transfer_params", params}}.dump()), kVocab);
  ASSERT_EQ(d.prompt_logprobs.size(), 2u);
  EXPECT_EQ(d.prompt_logprobs[0].token, 6);
  EXPECT_EQ(d.prompt_logprobs[0].logprob, -0.5f);
  EXPECT_EQ(d.prompt_logprobs[0].rank, 1);
  EXPECT_EQ(d.prompt_logprobs[0].top, kv.prompt_logprobs[0].top);
  EXPECT_EQ(d.prompt_logprobs[1].logprob, -9999.0f);
  EXPECT_EQ(d.prompt_logprobs[1].rank, 999);
  EXPECT_TRUE(d.prompt_logprobs[1].top.empty());
}

// Prompt logprobs too large for a decode leg's body are left out: the decode engine computes them.
TEST(Disaggregation, PromptLogprobsLargerThanTheBoundAreLeftOut) {
  PulledKv kv{"e", "h", 7001, "t", {1}, {5}, {}};
  TokenLogprob lp{6, -0.5f, {}, 1};
  for (int32_t k = 0; k < 20; ++k) lp.top.emplace_back(100 + k, -1.5f);
  // About 230 bytes each: 10000 of them fit in 4 MiB, 20000 do not.
  kv.prompt_logprobs.assign(10000, lp);
  EXPECT_TRUE(kv_transfer_params(kv).contains("prompt_logprobs"));
  kv.prompt_logprobs.assign(20000, lp);
  EXPECT_FALSE(kv_transfer_params(kv).contains("prompt_logprobs"));
}

TEST(Disaggregation, MalformedPromptLogprobsAreRefusedNamingTheField) {
  const json base = kv_transfer_params({"e", "h", 7001, "t", {1}, {2, 3}, {}});
  for (const json& bad :
       {json("x"), json::array({json::array({3, -0.5})}),              // too short
        json::array({json::array({kVocab, -0.5, 1, json::array()})}),  // id outside
        json::array({json::array({3, 0.5, 1, json::array()})}),        // a logprob above 0
        json::array({json::array({3, -0.5, 0, json::array()})}),       // rank 0
        json::array({json::array({3, -0.5, 1, json::array({json::array({3})})})}),
        json::array({json::array({3, -0.5, 1, json::array({json::array({-1, -0.5})})})}),
        json::array({json::array({3, "x", 1, json::array()})})}) {
    json params = base;
    params["prompt_logprobs"] = bad;
    const ApiError e = error_of(json{{"kv_transfer_params", params}});
    EXPECT_EQ(e.param, "kv_transfer_params") << bad;
    EXPECT_NE(e.message.find("prompt_logprobs"), std::string::npos) << e.message;
  }
}

TEST(Disaggregation, AnAnswerWithoutTransferParamsIsAnError) {
  EXPECT_THROW(kv_transfer_params_member(R"({"choices":[]})"), Error);
  EXPECT_THROW(kv_transfer_params_member(R"({"kv_transfer_params":null})"), Error);
  EXPECT_THROW(kv_transfer_params_member("not json"), Error);
  EXPECT_THROW(kv_transfer_params_member("[1]"), Error);
}

TEST(Disaggregation, BootstrapMembersReadBackAsTheRoom) {
  const uint64_t room = std::numeric_limits<int64_t>::max();
  const json body =
      json::parse("{\"prompt\":\"hi\"," + bootstrap_members("10.1.2.3", 8998, room) + "}");
  const DisaggregationParams d = parse_disaggregation(body, kVocab);
  EXPECT_TRUE(d.has_bootstrap);
  EXPECT_EQ(d.bootstrap_host, "10.1.2.3");
  EXPECT_EQ(d.bootstrap_port, 8998);
  EXPECT_EQ(d.bootstrap_room, room);
}

TEST(Disaggregation, StrippingRemovesEveryFieldTheGatewaySets) {
  json body = json::parse("{\"prompt\":\"hi\"," + bootstrap_members("h", 1, 2) + "}");
  body["kv_transfer_params"] = {{"do_remote_decode", true}};
  strip_disaggregation_fields(body);
  EXPECT_EQ(body, (json{{"prompt", "hi"}}));
  const DisaggregationParams d = parse_disaggregation(body, kVocab);
  EXPECT_FALSE(d.remote_decode || d.remote_prefill || d.has_bootstrap);
}

TEST(Disaggregation, MalformedFieldsAreRefusedNamingTheField) {
  EXPECT_EQ(error_of(json{{"kv_transfer_params", "yes"}}).param, "kv_transfer_params");
  EXPECT_EQ(error_of(json{{"kv_transfer_params",
                           {{"do_remote_decode", true}, {"do_remote_prefill", true}}}})
                .param,
            "kv_transfer_params");
  json pull = kv_transfer_params({"e", "h", 7001, "t", {1}, {2}, {}});
  pull["remote_port"] = 70000;
  EXPECT_NE(error_of(json{{"kv_transfer_params", pull}}).message.find("remote_port"),
            std::string::npos);
  pull = kv_transfer_params({"e", "h", 7001, "t", {1}, {kVocab}, {}});
  EXPECT_NE(error_of(json{{"kv_transfer_params", pull}}).message.find("outside the vocabulary"),
            std::string::npos);
  pull = kv_transfer_params({"e", "h", 7001, "t", {1}, {2}, {}});
  pull.erase("remote_host");
  EXPECT_NE(error_of(json{{"kv_transfer_params", pull}}).message.find("remote_host"),
            std::string::npos);
  EXPECT_EQ(error_of(json{{"bootstrap_room", -1}}).param, "bootstrap_room");
  EXPECT_EQ(error_of(json{{"bootstrap_room", {1, 2}}}).param, "bootstrap_room");
  EXPECT_EQ(error_of(json{{"bootstrap_room", 1}, {"bootstrap_port", 0}}).param, "bootstrap_port");
  EXPECT_EQ(error_of(json{{"bootstrap_room", 1}, {"bootstrap_host", 5}}).param, "bootstrap_host");
}

}  // namespace
}  // namespace tandem::api
