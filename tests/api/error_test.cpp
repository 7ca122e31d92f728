// The OpenAI error body every HTTP error of engine and gateway carries.
#include "api/error.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace tandem::api {
namespace {

TEST(OpenAiError, BodyShape) {
  EXPECT_EQ(openai_error_body("bad \"x\"", "invalid_request_error"),
            R"({"error":{"message":"bad \"x\"","type":"invalid_request_error","param":null,)"
            R"("code":null}})");
  auto json = nlohmann::json::parse(openai_error_body("m", "t", "c42"));
  EXPECT_EQ(json["error"]["code"], "c42");
  EXPECT_EQ(default_error_type(404), "invalid_request_error");
  EXPECT_EQ(default_error_type(503), "server_error");
}

TEST(OpenAiError, TheMessageReadsBackFromTheBody) {
  EXPECT_EQ(openai_error_message(openai_error_body("KV transfer failed", "server_error")),
            "KV transfer failed");
  EXPECT_EQ(openai_error_message(R"({"error":"flat"})"), std::nullopt);
  EXPECT_EQ(openai_error_message(R"({"error":{"message":7}})"), std::nullopt);
  EXPECT_EQ(openai_error_message("not json"), std::nullopt);
  EXPECT_EQ(openai_error_message("[]"), std::nullopt);
}

TEST(OpenAiError, TheCodeReadsBackFromTheBody) {
  EXPECT_EQ(openai_error_code(openai_error_body("gone", "server_error", kRoomAbandonedCode)),
            "room_abandoned");
  EXPECT_EQ(openai_error_code(openai_error_body("no code", "server_error")), std::nullopt);
  EXPECT_EQ(openai_error_code(R"({"error":{"message":"m","code":7}})"), std::nullopt);
  EXPECT_EQ(openai_error_code("not json"), std::nullopt);
}

TEST(OpenAiError, InvalidUtf8InTheMessageIsReplacedNotThrown) {
  const auto json = nlohmann::json::parse(openai_error_body("bad \xff byte"));
  EXPECT_EQ(json["error"]["message"], "bad \xef\xbf\xbd byte");
}

}  // namespace
}  // namespace tandem::api
