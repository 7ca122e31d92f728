// The gateway's reads of answer text it does not parse, checked against a JSON parser.
#include "gateway/answer_text.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "api/error.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;

TEST(AnswerText, SplicedMembersJoinTheObject) {
  for (const std::string body : {R"({})", R"({"a":1})", "{ \"a\": [1, {\"b\": 2}] }\n", "{\n}"}) {
    const json spliced = json::parse(splice_fields(body, R"("room":7,"host":"h")"));
    json expected = json::parse(body);
    expected["room"] = 7;
    expected["host"] = "h";
    EXPECT_EQ(spliced, expected) << body;
  }
  EXPECT_EQ(splice_fields("not an object", R"("x":1)"), "not an object");
}

// An answer cut short can still end in '}': only a parse tells.
TEST(AnswerText, AWholeJsonObjectIsTellableFromOneCutShort) {
  EXPECT_TRUE(is_json_object(" {\"a\":{\"b\":1}}\n"));
  EXPECT_FALSE(is_json_object("{\"a\":{\"b\":1}"));
  EXPECT_TRUE(looks_like_json_object("{\"a\":{\"b\":1}"));
  EXPECT_FALSE(is_json_object("[1]"));
  EXPECT_FALSE(is_json_object(""));
}

TEST(AnswerText, AJsonObjectIsRecognisedByItsBraces) {
  EXPECT_TRUE(looks_like_json_object(" {\"a\":1}\n"));
  EXPECT_FALSE(looks_like_json_object("[1]"));
  EXPECT_FALSE(looks_like_json_object(""));
  EXPECT_FALSE(looks_like_json_object("this is not json {"));
}

TEST(AnswerText, CompletionTokensComeFromTheUsage) {
  const json answer = {{"id", "cmpl-1"},
                       {"choices", {{{"text", "completion_tokens"}, {"index", 0}}}},
                       {"usage", {{"prompt_tokens", 8}, {"completion_tokens", 123}}}};
  EXPECT_EQ(usage_completion_tokens(answer.dump()), 123);
  EXPECT_EQ(usage_completion_tokens(R"({"usage": {"completion_tokens": 45}})"), 45);
  EXPECT_EQ(usage_completion_tokens(R"({"choices":[]})"), -1);
  EXPECT_EQ(usage_completion_tokens(R"({"usage":{"completion_tokens":null}})"), -1);
}

TEST(AnswerText, ErrorEventsAndTokenEventsAreToldApart) {
  EXPECT_TRUE(is_error_event(api::openai_error_body("KV transfer failed", "server_error")));
  const std::string chunk =
      R"({"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"error"}]})";
  EXPECT_FALSE(is_error_event(chunk));
  EXPECT_TRUE(carries_tokens(chunk));
  EXPECT_TRUE(carries_tokens(R"({"choices":[{"index":0,"text":"[] and []"}]})"));
  EXPECT_FALSE(carries_tokens("[DONE]"));
  EXPECT_FALSE(carries_tokens(R"({"id":"cmpl-1","choices":[],"usage":{"completion_tokens":3}})"));
}

}  // namespace
}  // namespace tandem::gateway
